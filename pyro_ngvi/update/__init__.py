"""
The Bayesian learning rule as tensor functions, one module per family: mean-field
(:mod:`~pyro_ngvi.update.mean_field`, on flat vectors of sites), full covariance
(:mod:`~pyro_ngvi.update.full_covariance`) and Kronecker-factored layers
(:mod:`~pyro_ngvi.update.kronecker`). Each takes the current Gaussian, the statistics
and the step sizes, and returns (or writes into buffers it is given) the new one; none
knows about Pyro, the guide or the optimizer's bookkeeping.
"""
