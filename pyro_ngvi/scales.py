"""
The guide's scales: the softplus bijection between AutoNormal's raw (unconstrained)
scale :math:`r` and :math:`\\sigma`, evaluated fast on the CPU, and the
:math:`\\sigma` NGVI last wrote, remembered for the next step.

**The bijection.** :math:`\\sigma = \\log(1 + e^r)`, :math:`r = \\log(e^\\sigma - 1)`.
torch's float32 CPU kernels of ``softplus``, ``expm1`` and ``log1p`` run one element
at a time (torch 2.14: ~12 ms per :math:`10^6` elements), their float64 versions
cost conversions and twice the memory traffic, while float32 ``exp``, ``exp2`` and
``log`` are vectorised (0.2-0.9 ms). So for float32 CPU tensors both directions are
written with those alone, accurate to a few ulps (tested against float64 over
:math:`\\sigma \\in [10^{-8}, 10^3]`):

* forward, :math:`x = e^r`, :math:`u = 1 \\oplus x`: :math:`c = x - (u - 1)` is the
  exact rounding error of the sum (both subtractions are exact for :math:`u < 2^{24}`),
  so :math:`\\log(1 + x) = \\log u + c/u` (Goldberg's compensated ``log1p``);
* inverse, :math:`u \\approx e^\\sigma`: :math:`e^\\sigma - 1 = \\sigma (u - 1)/\\log u`
  (Kahan's ``expm1``: the rounding of :math:`u` cancels between numerator and
  denominator, so :math:`u` may come from the cheaper ``exp2``; the ratio is 1 where
  :math:`u = 1`);
* above :math:`r, \\sigma > 17` the two coincide in float32
  (:math:`e^{-17} < \\mathrm{ulp}(17)/2`): :math:`\\sigma = r`.

Other dtypes and devices use torch's own kernels.

**The remembered scale.** NGVI computes :math:`\\sigma` of every site anyway and
writes its raw scale; :func:`remember_scale` keeps that :math:`\\sigma` beside the
raw tensor, and :func:`known_scale` hands it to the next reader (the BayesianNet
fast path, NGVI's own next step) instead of a softplus pass, as long as the raw
tensor has not been written since (its autograd version counter is unchanged).
The raw scale stays the single source of truth: Predictive, save / load and the
param store always see it, and any in-place write to it (``copy_``, an optimizer,
``load_state_dict``) or a new tensor in the store makes the remembered value
unused. (A write through ``.data`` bypasses the version counter: use ``torch.no_grad()``.)
The cache holds one tensor of the latent size per site, not optimizer state.
"""

import math
from typing import Optional

import torch
from pyro.distributions.transforms import SoftplusTransform
from torch.utils.weak import WeakIdKeyDictionary

#: Above this :math:`r = \\sigma` in float32.
_LINEAR = 17.0
_LOG2E = 1.0 / math.log(2.0)


def _fast(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def softplus(r: torch.Tensor) -> torch.Tensor:
    """:math:`\\sigma = \\log(1 + e^r)` (a new tensor)."""
    if not _fast(r):
        return torch.nn.functional.softplus(r)
    linear = not bool(r.amax() <= _LINEAR)  # also for NaN: it propagates either way
    x = torch.exp(r.clamp(max=_LINEAR) if linear else r)
    u = x + 1.0
    rounded = torch.sub(u, 1.0)
    error = x.sub_(rounded)  # c = x - (u - 1), exactly
    sigma = torch.log(u, out=rounded).add_(error.div_(u))
    return torch.maximum(sigma, r, out=sigma) if linear else sigma


def softplus_inverse(sigma: torch.Tensor) -> torch.Tensor:
    """:math:`r = \\log(e^\\sigma - 1)` (a new tensor)."""
    if not _fast(sigma):
        return sigma + torch.log(-torch.expm1(-sigma))
    linear = not bool(sigma.amax() <= _LINEAR)
    x = sigma.clamp(max=_LINEAR) if linear else sigma
    u = torch.mul(x, _LOG2E).exp2_()
    log_u = torch.log(u)
    # (u - 1) / log u = expm1(x) / x, and 1 where u = 1 (0 / 0)
    ratio = u.sub_(1.0).div_(log_u).nan_to_num_(nan=1.0, posinf=math.inf)
    r = ratio.mul_(x).log_()
    return r.add_(sigma - x) if linear else r


def softplus_derivative(r: torch.Tensor) -> torch.Tensor:
    """:math:`d\\sigma/dr = 1 / (1 + e^{-r})`."""
    return torch.sigmoid(r)


class FastSoftplus(SoftplusTransform):
    """Pyro's :class:`~pyro.distributions.transforms.SoftplusTransform` (the scales of
    AutoNormal and AutoDiagonalNormal), with the float32 CPU kernels above."""

    def _call(self, x):
        return softplus(x)

    def _inverse(self, y):
        return softplus_inverse(y)

    def log_abs_det_jacobian(self, x, y):
        return softplus(-x).neg_()  # log sigmoid(x)

    def derivative(self, x):
        """:math:`d\\sigma/dr` at ``x``."""
        return softplus_derivative(x)


#: raw scale tensor -> (its version counter when written, sigma)
_remembered = WeakIdKeyDictionary()


def remember_scale(raw: torch.Tensor, sigma: torch.Tensor) -> None:
    """Remember ``sigma`` (of ``raw``'s shape) as the scale ``raw`` holds now,
    right after writing ``raw``."""
    _remembered[raw] = (raw._version, sigma)


def known_scale(raw: torch.Tensor) -> Optional[torch.Tensor]:
    """The remembered scale of ``raw``, or ``None`` when none is, or ``raw`` has
    been written since."""
    entry = _remembered.get(raw)
    if entry is None or entry[0] != raw._version:
        return None
    return entry[1]


def forget_scale(raw: torch.Tensor) -> None:
    """Drop what is remembered of ``raw``."""
    _remembered.pop(raw, None)
