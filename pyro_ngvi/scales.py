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
* inverse: where every :math:`\\sigma \\le 1`, :math:`r = \\log\\sigma +
  \\log(\\mathrm{expm1}(\\sigma)/\\sigma)`, the second term a short series in :math:`\\sigma`
  (one ``log``); else
  :math:`e^\\sigma - 1 = \\sigma (u - 1)/\\log u` with :math:`u \\approx e^\\sigma`
  (Kahan's ``expm1``: the rounding of :math:`u` cancels between numerator and
  denominator, so :math:`u` may come from the cheaper ``exp2``; the ratio is 1 where
  :math:`u = 1`);
* above :math:`r, \\sigma > 17` the two coincide in float32
  (:math:`e^{-17} < \\mathrm{ulp}(17)/2`): :math:`\\sigma = r`.

Other dtypes and devices use torch's own kernels.

**The exponential.** A guide whose scales are ``constraints.positive`` (the recipe's
:meth:`~pyro_ngvi.BayesianNet.guide`) has :math:`\\sigma = e^r`, :math:`r = \\log\\sigma`
(:class:`FastExp`): one vectorised ``exp`` or ``log`` each way, and
:math:`\\sum\\log\\sigma = \\sum r` needs no logarithm at all (:func:`sum_log_scale`).
Torch's ``biject_to(constraints.positive)`` is ``exp`` followed by the identity
affine map, which gives the same bits.

**The remembered scale.** NGVI computes :math:`\\sigma' = \\lambda'^{-1/2}` and writes its raw
scale :math:`r' = T^{-1}(\\sigma')` each step; :func:`remember_scale` keeps :math:`\\sigma'` beside
the raw tensor, and :func:`known_scale` hands it to the next reader (the BayesianNet fast
path, NGVI's own next step) instead of a pass of the bijection, as long as the raw tensor has
not been written since (its autograd version counter is unchanged). The bijection gives
:math:`T(r')` back only to an ulp or two of :math:`\\sigma'` (each direction rounds once), so
NGVI saves :math:`\\sigma'` with its state (:meth:`~pyro_ngvi.NGVI.get_state`) and, restored, remembers
it again for the raw scale loaded beside it when that holds it to a few ulps
(:func:`~pyro_ngvi.state.restore_scale`): a resumed run reads the same :math:`\\sigma` and takes
the same steps. The raw scale stays the guide's own parameter: Predictive, save / load and the
param store always see it, and any in-place write to it (``copy_``, an optimizer,
``load_state_dict``) or a new tensor in the store makes the remembered value unused. (A write
through ``.data`` bypasses the version counter: use ``torch.no_grad()``.) What is remembered
is one latent-size vector in all (the :math:`\\sigma` of every site).
"""

import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from pyro.distributions.transforms import SoftplusTransform
from torch.distributions import biject_to
from torch.distributions.transforms import AffineTransform, ComposeTransform, ExpTransform, Transform

#: Above this :math:`r = \\sigma` in float32.
_LINEAR = 17.0
_LOG2E = 1.0 / math.log(2.0)
#: Up to this :math:`\\sigma` the inverse is a series around :math:`\\log\\sigma`, with the
#: coefficients :math:`B_{2k} / (2k\\,(2k)!)` of :math:`\\sigma^{2k}`, k = 1..4 (the next term,
#: :math:`\\sigma^{10}/479001600`, is below 3e-9 there).
_SERIES_MAX = 1.0
_SERIES = tuple(torch.tensor(c, dtype=torch.float32) for c in (1.0 / 24, -1.0 / 2880, 1.0 / 181440, -1.0 / 9676800))


def _fast(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def softplus(r: torch.Tensor, linear: Optional[bool] = None, out: Optional[torch.Tensor] = None,
             scratch=(None, None)) -> torch.Tensor:
    """:math:`\\sigma = \\log(1 + e^r)` (into ``out``, default a new tensor; ``scratch``: two
    buffers of ``r``'s length); ``linear=False`` when the caller knows every :math:`r \\le 17`
    (default: None, found out)."""
    if not _fast(r):
        return torch.nn.functional.softplus(r) if out is None else out.copy_(torch.nn.functional.softplus(r))
    if linear is None:
        linear = not bool(r.amax() <= _LINEAR)  # also for NaN: it propagates either way
    x = torch.clamp(r, max=_LINEAR, out=scratch[0]).exp_() if linear else torch.exp(r, out=scratch[0])
    u = torch.add(x, 1.0, out=scratch[1])
    rounded = torch.sub(u, 1.0, out=out)
    error = x.sub_(rounded)  # c = x - (u - 1), exactly
    sigma = torch.log(u, out=rounded).add_(error.div_(u))
    return torch.maximum(sigma, r, out=sigma) if linear else sigma


def softplus_inverse(sigma: torch.Tensor) -> torch.Tensor:
    """:math:`r = \\log(e^\\sigma - 1)` (a new tensor)."""
    return softplus_inverse_and_log(sigma)[0]


def softplus_inverse_and_log(sigma: torch.Tensor, out: Optional[torch.Tensor] = None,
                             top: Optional[torch.Tensor] = None,
                             scratch=(None, None, None)) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """
    :math:`r = \\log(e^\\sigma - 1)` (a new tensor) and, when it comes at no extra cost,
    :math:`\\log\\sigma` (else ``None``). Where all :math:`\\sigma \\le 1` (a prior scale
    of at most 1 with a non-negative curvature keeps them there)
    :math:`r = \\log\\sigma + \\sigma/2 + \\sum_{k=1}^{4} \\frac{B_{2k}}{2k\\,(2k)!} \\sigma^{2k}`
    (the series of :math:`\\log(\\mathrm{expm1}(\\sigma)/\\sigma)`, truncated below
    :math:`10^{-8}`): one ``log``, which is also :math:`\\log\\sigma`; else Kahan's form.
    ``out`` receives :math:`r` (default: a new tensor); ``top`` is :math:`\\max\\sigma` when
    the caller knows it (default: computed); ``scratch``: three buffers of the length (the
    first holds :math:`\\log\\sigma` on return).
    """
    if not _fast(sigma):
        return torch.add(sigma, torch.log(-torch.expm1(-sigma)), out=out), None
    if top is None:
        top = sigma.amax()
    first, second, third = scratch
    if bool(top <= _SERIES_MAX):
        log_sigma = torch.log(sigma, out=first)
        square = torch.square(sigma, out=second)
        series = torch.addcmul(_SERIES[2], square, _SERIES[3], out=third)  # Horner in sigma^2
        series = torch.addcmul(_SERIES[1], series, square, out=series)
        series = torch.addcmul(_SERIES[0], series, square, out=series)
        r = torch.addcmul(log_sigma, series, square, out=series if out is None else out)
        return r.add_(sigma, alpha=0.5), log_sigma
    linear = not bool(top <= _LINEAR)  # also for NaN: it propagates either way
    x = torch.clamp(sigma, max=_LINEAR, out=third) if linear else sigma
    u = torch.mul(x, _LOG2E, out=first).exp2_()
    log_u = torch.log(u, out=second)
    # (u - 1) / log u = expm1(x) / x, and 1 where u = 1 (0 / 0)
    ratio = u.sub_(1.0).div_(log_u).nan_to_num_(nan=1.0, posinf=math.inf)
    r = torch.log(ratio.mul_(x), out=ratio if out is None else out)
    return (r.add_(torch.sub(sigma, x, out=second)) if linear else r), None


def softplus_branch_free(r: torch.Tensor) -> torch.Tensor:
    """:func:`softplus` with no branch on values (a compiled kernel's form): the linear part
    selected element by element. Equal to :func:`softplus` to the last ulp or so."""
    if not _fast(r):
        return torch.nn.functional.softplus(r)
    x = torch.exp(r.clamp(max=_LINEAR))
    u = x + 1.0
    sigma = torch.log(u) + (x - (u - 1.0)) / u
    return torch.maximum(sigma, r)


def softplus_inverse_branch_free(sigma: torch.Tensor, at_most_one: bool = False) -> torch.Tensor:
    """
    :func:`softplus_inverse` with no branch on values (a compiled kernel's form), equal to it to
    a few ulps: :math:`r = \\log a + b` with, element by element, the series
    (:math:`a = \\sigma`) where :math:`\\sigma \\le 1` and
    :math:`r = \\sigma + \\log(1 - e^{-\\sigma})` above (where :math:`1 - e^{-\\sigma} \\ge 0.63`
    loses nothing): one ``exp`` and one ``log``. ``at_most_one``: the caller knows every
    :math:`\\sigma \\le 1` (the series alone).
    """
    if not _fast(sigma):
        return sigma + torch.log(-torch.expm1(-sigma))
    square = sigma.square()
    series = _SERIES[2] + square * _SERIES[3]
    series = _SERIES[1] + series * square
    series = _SERIES[0] + series * square
    if at_most_one:
        return torch.log(sigma) + series * square + 0.5 * sigma
    small = sigma <= _SERIES_MAX
    argument = torch.where(small, sigma, 1.0 - torch.exp(-sigma))
    return torch.log(argument) + torch.where(small, series * square + 0.5 * sigma, sigma)


def softplus_derivative(r: torch.Tensor) -> torch.Tensor:
    """:math:`d\\sigma/dr = 1 / (1 + e^{-r})`."""
    return torch.sigmoid(r)


class FastSoftplus(SoftplusTransform):
    """Pyro's :class:`~pyro.distributions.transforms.SoftplusTransform` (the scales of
    AutoNormal and AutoDiagonalNormal), with the float32 CPU kernels above."""

    def _call(self, x, linear: Optional[bool] = None, out=None, scratch=(None, None)):
        return softplus(x, linear, out, scratch)

    def _inverse(self, y):
        return softplus_inverse(y)

    def inverse_and_log(self, y, out=None, top=None, scratch=(None, None, None)):
        """:func:`softplus_inverse_and_log` of ``y``."""
        return softplus_inverse_and_log(y, out, top, scratch)

    def log_abs_det_jacobian(self, x, y):
        return softplus(-x).neg_()  # log sigmoid(x)

    def derivative(self, x):
        """:math:`d\\sigma/dr` at ``x``."""
        return softplus_derivative(x)


class FastExp(ExpTransform):
    """:math:`\\sigma = e^r` (the scales of a guide with ``constraints.positive``), with the
    methods the element-wise pass calls on :class:`FastSoftplus`."""

    def _call(self, x, linear: Optional[bool] = None, out=None, scratch=None):
        return torch.exp(x, out=out)

    def inverse_and_log(self, y, out=None, top=None, scratch=None):
        """:math:`r = \\log\\sigma`, which is also :math:`\\log\\sigma`."""
        r = torch.log(y, out=out)
        return r, r

    def derivative(self, x):
        """:math:`d\\sigma/dr = \\sigma` at ``x``."""
        return torch.exp(x)


def is_exp(transform) -> bool:
    """Whether ``transform`` is :math:`e^r` (``biject_to(constraints.positive)``: ``exp`` and the
    identity affine map)."""
    if type(transform) is ExpTransform:
        return True
    if type(transform) is not ComposeTransform or not transform.parts:
        return False
    first, *rest = transform.parts
    return type(first) is ExpTransform and all(
        type(t) is AffineTransform and isinstance(t.loc, (int, float)) and isinstance(t.scale, (int, float))
        and t.loc == 0 and t.scale == 1 for t in rest)


#: Probe points of a scale's bijection, and how exactly it must act as ``exp`` or ``softplus``.
PROBE = (-20.0, -3.0, -0.5, 0.0, 0.5, 3.0, 20.0)
PROBE_RTOL = 1e-9


def scale_bijection(constraint) -> Optional[str]:
    """``"exp"`` or ``"softplus"``: what ``biject_to(constraint)`` computes, element-wise,
    probed on a few points; ``None`` for anything else."""
    try:
        transform = biject_to(constraint)
        if transform.domain.event_dim or transform.codomain.event_dim:
            return None
        x = torch.tensor(PROBE, dtype=torch.float64)
        y = transform(x)
    except (NotImplementedError, TypeError, RuntimeError, ValueError):
        return None
    if not torch.is_tensor(y) or y.shape != x.shape:
        return None
    for kind, reference in (("exp", x.exp()), ("softplus", torch.nn.functional.softplus(x))):
        if torch.allclose(y, reference, rtol=PROBE_RTOL, atol=0.0):
            return kind
    return None


#: The maps from a raw scale to :math:`\sigma` that a guide may compute itself (``torch.exp(log_scale)``,
#: ``F.softplus(rho)``), by name (:class:`~pyro_ngvi.family.GaussianSite`'s ``scale_map``).
SCALE_MAPS = {"exp": FastExp, "softplus": FastSoftplus}


def scale_transform(constraint) -> Transform:
    """
    The bijection from a raw (unconstrained) scale parameter with ``constraint``
    to :math:`\\sigma`: :func:`~torch.distributions.biject_to`, with the softplus of
    AutoNormal and AutoDiagonalNormal computed faster (:class:`~pyro_ngvi.scales.FastSoftplus`) and
    the exponential of ``constraints.positive`` as :class:`~pyro_ngvi.scales.FastExp`.
    """
    transform = biject_to(constraint)
    if type(transform) is SoftplusTransform:
        return FastSoftplus()
    return FastExp() if is_exp(transform) else transform



def sum_log_scale(raw: torch.Tensor, sigma: torch.Tensor, transform) -> torch.Tensor:
    """:math:`\\sum\\log\\sigma` of a site: the sum of its raw scale where :math:`\\sigma = e^r`
    (no logarithm), else of :math:`\\log\\sigma`; to be called without gradients (the raw scale, a
    guide's parameter, is summed as it is, not detached first)."""
    if isinstance(transform, FastExp):
        return raw.sum()
    return torch.log(sigma).sum()


#: id(raw scale tensor) -> (weak reference to it, its version counter when written, sigma);
#: an entry goes when its tensor does
_remembered: Dict[int, tuple] = {}


def _entry(raw: torch.Tensor) -> Optional[tuple]:
    entry = _remembered.get(id(raw))
    if entry is None or entry[0]() is not raw or entry[1] != raw._version or entry[2].dtype != raw.dtype \
            or entry[2].device != raw.device:  # (moved by guide.to(...): the remembered sigma is the old one's)
        return None
    return entry


def remember_scale(raw: torch.Tensor, sigma: torch.Tensor) -> None:
    """Remember ``sigma`` (of ``raw``'s shape, not to be changed in place) as the scale
    ``raw`` holds now, right after writing ``raw``."""
    key = id(raw)
    entry = _remembered.get(key)
    ref = entry[0] if entry is not None and entry[0]() is raw else weakref.ref(raw, _forgetter(key))
    _remembered[key] = (ref, raw._version, sigma)


def _forgetter(key: int):
    def forget(ref):
        entry = _remembered.get(key)
        if entry is not None and entry[0] is ref:
            del _remembered[key]
    return forget


def known_scale(raw: torch.Tensor) -> Optional[torch.Tensor]:
    """The remembered scale of ``raw``, or ``None`` when none is, or ``raw`` has
    been written since."""
    entry = _entry(raw)
    return None if entry is None else entry[2]


def known_scales(raws: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """:func:`known_scale` of each of ``raws`` (their entries looked up by ``map``, in one call)."""
    found = list(map(_remembered.get, map(id, raws)))  # (the entries, then their scales: no call for a list of None)
    for j, (raw, entry) in enumerate(zip(raws, found)):
        if entry is not None and entry[1] == raw._version and entry[0]() is raw and entry[2].dtype == raw.dtype \
                and entry[2].device == raw.device:  # (as _entry)
            found[j] = entry[2]
        else:
            found[j] = None
    return found


def sum_log_scales(raws: List[torch.Tensor], sigmas: List[torch.Tensor], exps: List[bool]) -> torch.Tensor:
    """The sum over sites of :func:`sum_log_scale` (``exps``: whether each site's transform is
    :class:`FastExp`, decided once), added from the first site's: no 0-d kernel adding it to 0."""
    total = None
    for raw, sigma, exp in zip(raws, sigmas, exps):
        term = raw.sum() if exp else torch.log(sigma).sum()
        total = term if total is None else total + term
    return 0.0 if total is None else total


def forget_scale(raw: torch.Tensor) -> None:
    """Drop what is remembered of ``raw``."""
    if _entry(raw) is not None or (id(raw) in _remembered and _remembered[id(raw)][0]() is raw):
        del _remembered[id(raw)]


class Remembered:
    """:func:`remember_scale` of fixed ``raws`` and their ``sigmas`` (a group's raw scales and its views
    of :math:`\\sigma`), all in one call a step: each entry's key and weak reference are taken once
    (here, by remembering them now), and a call writes only the entries' versions anew."""

    __slots__ = ("entries",)

    def __init__(self, raws: List[torch.Tensor], sigmas: List[torch.Tensor]):
        for raw, sigma in zip(raws, sigmas):
            remember_scale(raw, sigma)
        self.entries = [(id(raw), _remembered[id(raw)][0], raw, sigma) for raw, sigma in zip(raws, sigmas)]

    def __call__(self) -> None:
        for key, ref, raw, sigma in self.entries:  # (remember_scale's entry, its reference reused)
            _remembered[key] = (ref, raw._version, sigma)
