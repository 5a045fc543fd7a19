"""pyro_ngvi: natural-gradient variational inference for Pyro."""

from .optim import NGVI, NGVIWarning

__all__ = ["NGVI", "NGVIWarning"]
