"""
pyro_ngvi: natural-gradient variational inference (the Bayesian learning rule,
VON / VOGN) for the Gaussian guides of Pyro models (mean-field, full covariance,
low-rank-plus-diagonal precision, Kronecker-factored layers), driven by Pyro's own ``SVI``.
"""

from .checkpoint import load_param_store
from .elbo import CurvatureELBO
from .laplace import LaplaceResult, LaplaceWarning, laplace, optimize_prior_precision
from .nn import BayesianNet, ValidationSelection, select_by_validation
from .optim import NGVI, NGVIWarning
from .continual import posterior_as_prior, start_task, with_priors
from .handlers import PriorMessenger
from .family import NotGaussianWarning
from .kronecker import KroneckerNormal
from .low_rank_guide import LowRankPrecisionNormal
from .priors import conjugate_normal

__all__ = [
    "BayesianNet",
    "CurvatureELBO",
    "KroneckerNormal",
    "LaplaceResult",
    "LaplaceWarning",
    "LowRankPrecisionNormal",
    "NGVI",
    "NGVIWarning",
    "NotGaussianWarning",
    "PriorMessenger",
    "conjugate_normal",
    "laplace",
    "load_param_store",
    "optimize_prior_precision",
    "posterior_as_prior",
    "select_by_validation",
    "start_task",
    "ValidationSelection",
    "with_priors",
]
