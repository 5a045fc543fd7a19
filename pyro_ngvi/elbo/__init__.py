"""
:class:`CurvatureELBO` (:mod:`.curvature_elbo`), a Pyro ELBO that also hands
:class:`~pyro_ngvi.NGVI` the gradient :math:`g` and curvature :math:`h` of
:math:`\\ell` per guide site, and its pieces:

- :mod:`.protocol`: what a model may offer (its own fast path, statistics hints)
  and the hand-over to NGVI;
- :mod:`.mean_field`: the traced path for AutoNormal guides, the average of
  :mod:`.particle` s (one draw: value and per-site :math:`g, h, \\epsilon`);
- :mod:`.full_covariance`: the traced path for AutoMultivariateNormal guides;
- :mod:`.learned_priors`: prior params learned by the evidence in closed form;
- :mod:`.sites`: reading a model trace (the terms of :math:`\\ell`, plates, checks).

The curvature of each source lives in :mod:`pyro_ngvi.curvature`.
"""

from .curvature_elbo import CurvatureELBO

__all__ = ["CurvatureELBO"]
