"""pyro_ngvi: natural-gradient variational inference for Pyro."""
