"""
Bayesian neural networks: :class:`BayesianNet` (the Pyro model, :mod:`.model`)
and its BackPACK fast path (:mod:`.fast_path`).
"""

from .model import BayesianNet

__all__ = ["BayesianNet"]
