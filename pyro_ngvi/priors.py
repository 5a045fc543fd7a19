"""
Priors in the guide's coordinates: which priors a Gaussian guide meets conjugately.

A Gaussian guide such as :class:`~pyro.infer.autoguide.AutoNormal` lives in the
unconstrained coordinates ``u`` of every latent site,

.. math:: x = T(u), \\qquad T = \\text{biject_to}(\\text{support}).

A prior :math:`p_0(x)` is *conjugate* to that guide when its density pulled back
to ``u`` is Gaussian,

.. math:: p_0(T(u))\\,|\\det J_T(u)| = \\mathcal{N}(u; m_0, \\lambda_0^{-1}),

because then it enters a natural-gradient step through its natural parameters
:math:`(\\lambda_0 m_0, -\\lambda_0/2)` exactly, with no Monte-Carlo noise and
no curvature estimate. Two kinds of prior have this property:

- a Normal on a site with real support (``T`` is the identity);
- a :class:`~torch.distributions.TransformedDistribution` of a Normal whose
  transforms, composed, *are* ``T``. :class:`~pyro.distributions.LogNormal` on
  a positive site is one; the prior :func:`~pyro_ngvi.posterior_as_prior` builds
  is another.

"Are ``T``" is decided by what the transforms do, not by ``==``: in torch 2.14
``biject_to(constraints.positive)`` is ``ComposeTransform([ExpTransform(),
AffineTransform(0, 1)])``, which does not compare equal to ``ExpTransform()``.

This module holds that recognition (:func:`~pyro_ngvi.conjugate_normal`), the comparison
of supports and transforms by behaviour, and the type-II maximum-likelihood
update of a conjugate prior's ``loc`` and ``scale`` when they are ``pyro.param``
values of the model (:func:`prior_param_index`, :func:`update_learned_priors`). Swapping a model's priors is a handler
(:mod:`pyro_ngvi.handlers`); the continual-learning workflow built on both lives
in :mod:`pyro_ngvi.continual`.
"""

import functools
import math
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.distributions import biject_to, constraints, transform_to
from torch.distributions.transforms import ComposeTransform, Transform

import pyro.distributions as dist
from pyro.distributions.torch_distribution import ExpandedDistribution

from .family import PriorParam, SiteCurvature

__all__ = ["conjugate_gaussian", "conjugate_multivariate_normal", "conjugate_normal", "conjugate_normal_parts",
           "prior_param_index", "update_learned_priors"]

# Two transforms "do the same" when they agree to this tolerance on the probes.
_RTOL = 1e-5
_ATOL = 1e-7
_PROBE_SEED = 0


# --------------------------------------------------------------------------- #
# Comparing transforms and supports by behaviour
# --------------------------------------------------------------------------- #


def _probes(shape: torch.Size, device) -> List[torch.Tensor]:
    """
    Fixed probe points in ``u`` space, float64: an even grid on [-2.5, 2.5] and
    seeded standard-normal draws (a private generator: the global RNG is left
    alone). Made afresh on every call.
    """
    n = shape.numel()
    grid = torch.linspace(-2.5, 2.5, n, dtype=torch.float64).reshape(shape)
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    draws = torch.randn(shape, generator=generator, dtype=torch.float64)
    return [grid.to(device), draws.to(device)]


def _same_map(
    transform: Transform, bijection: Transform, u_shape: torch.Size, device
) -> bool:
    """
    Whether ``transform`` and ``bijection`` map the same points of ``u`` space
    (of shape ``u_shape``) to the same values: equal output shapes and
    :func:`torch.allclose` values on :func:`_probes`. Any failure to evaluate
    (NaN, a dtype clash, a domain error) counts as "not the same".
    """
    try:
        x_shape = bijection.forward_shape(u_shape)
        if transform.forward_shape(u_shape) != x_shape:
            return False
        if u_shape.numel() == 0:
            return True
        for u in _probes(u_shape, device):
            a, b = transform(u), bijection(u)
            if a.shape != b.shape or not torch.allclose(
                a.to(b.dtype), b, rtol=_RTOL, atol=_ATOL
            ):
                return False
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def _unwrap_constraint(constraint) -> Tuple[object, int]:
    """Strip ``independent`` wrappers: (base constraint, reinterpreted dims)."""
    extra = 0
    while isinstance(constraint, constraints.independent):
        extra += constraint.reinterpreted_batch_ndims
        constraint = constraint.base_constraint
    return constraint, extra


def _is_real(constraint) -> bool:
    base, _ = _unwrap_constraint(constraint)
    return type(base) is type(constraints.real)


def _same_support(a, b, x_shape: torch.Size, device) -> bool:
    """
    Whether two supports define the same unconstrained space for a site of
    shape ``x_shape``: the same constraint (type and printed parameters, after
    stripping ``independent`` wrappers), or bijections that do the same
    (``positive`` and ``nonnegative`` both map ``u`` to ``exp(u)``; a guide built
    for one serves the other).
    """
    if a.event_dim != b.event_dim:
        return False
    base_a, _ = _unwrap_constraint(a)
    base_b, _ = _unwrap_constraint(b)
    if type(base_a) is type(base_b) and str(base_a) == str(base_b):
        return True
    if a.is_discrete or b.is_discrete:
        return False
    try:
        bijection_a, bijection_b = biject_to(a), biject_to(b)
        u_shape = bijection_a.inverse_shape(x_shape)
        if bijection_b.inverse_shape(x_shape) != u_shape:
            return False
    except (NotImplementedError, ValueError, RuntimeError):
        return False
    return _same_map(bijection_a, bijection_b, u_shape, device)


def _tensors_in(obj, seen=None) -> Iterable[torch.Tensor]:
    """Tensors held by a distribution or transform (recursively, through lists)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, seen)
    elif isinstance(obj, (torch.distributions.Distribution, Transform)):
        for value in vars(obj).values():
            if not isinstance(value, weakref.ref):
                yield from _tensors_in(value, seen)


def _device_of(obj):
    for tensor in _tensors_in(obj):
        return tensor.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- #
# conjugate_normal
# --------------------------------------------------------------------------- #


def _normal_and_transforms(fn) -> Tuple[Optional[torch.distributions.Normal], list]:
    """
    Peel ``Independent``, ``ExpandedDistribution`` and ``TransformedDistribution``
    layers off ``fn``; return the Normal at the bottom and the transforms met on
    the way (base to top), or ``(None, [])``. A subclass that overrides
    ``log_prob`` (``HalfNormal``, ``FoldedDistribution``) is not peeled: its
    density is no longer the one its layers describe.
    """
    return _peel(fn, torch.distributions.Normal,
                 (torch.distributions.Independent, ExpandedDistribution, torch.distributions.TransformedDistribution))


def _peel(fn, bottom, layers) -> Tuple[Optional[torch.distributions.Distribution], list]:
    """``fn``'s ``bottom`` distribution behind ``layers`` (classes whose ``log_prob`` is their own,
    not overridden), and the transforms of its ``TransformedDistribution`` layers, base to top;
    ``(None, [])`` where anything else is met."""
    transforms: list = []
    while True:
        cls = type(fn)
        if isinstance(fn, bottom):
            return (fn, transforms) if cls.log_prob is bottom.log_prob else (None, [])
        layer = next((kind for kind in layers if isinstance(fn, kind)), None)
        if layer is None or cls.log_prob is not layer.log_prob:
            return None, []
        if layer is torch.distributions.TransformedDistribution:
            transforms = list(fn.transforms) + transforms
        fn = fn.base_dist


def _bijection_and_u_shape(support, shape: torch.Size):
    """``biject_to(support)`` and the unconstrained shape of ``shape``, or ``(None, None)``."""
    try:
        bijection = biject_to(support)
        return bijection, bijection.inverse_shape(shape)
    except (NotImplementedError, ValueError, RuntimeError):
        return None, None


def conjugate_normal(
    fn: torch.distributions.Distribution, support=None
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """
    The Gaussian a prior is in the site's unconstrained coordinates, if it is one.

    With :math:`T = \\text{biject_to}(\\text{support})` and ``u`` the
    unconstrained value (``x = T(u)``), returns :math:`(m_0, \\lambda_0)` when

    .. math:: p_0(T(u))\\,|\\det J_T(u)| = \\mathcal{N}(u; m_0, \\lambda_0^{-1})

    element-wise, i.e. when ``fn`` is a Normal (possibly behind ``.to_event`` /
    ``.expand``) on a real site, or a
    :class:`~torch.distributions.TransformedDistribution` of such a Normal whose
    transforms, composed, map ``u`` to the same values as ``T`` (checked on fixed
    float64 probe points, since transforms that do the same need not compare
    equal). Otherwise returns ``None``: e.g. ``HalfCauchy``, ``Gamma``, a Normal
    on a positive site, a masked distribution, a base whose support is not real.

    The tensors are ``fn``'s own (not detached): in a hierarchical model they may
    depend on other latent values.

    :param fn: the distribution of a model sample site.
    :param support: the support that fixes the site's coordinates
        (default: ``fn.support``). Pass it when ``fn`` reports a support wider
        than its true one, e.g. ``TransformedDistribution(Normal, biject_to(positive))``
        reports ``real`` (the codomain of its last part, ``AffineTransform``).
    :returns: ``(prior_loc, prior_precision)``, both of shape
        ``batch_shape + unconstrained event_shape``, or ``None``.
    :raises ValueError: when ``fn`` is not a distribution.
    """
    if not isinstance(fn, torch.distributions.Distribution):
        raise ValueError(f"conjugate_normal: fn must be a distribution, got {fn!r}")
    if support is not None and not isinstance(support, constraints.Constraint):
        raise TypeError(f"conjugate_normal: support must be a constraint (e.g. constraints.positive), got {support!r}")
    parts = conjugate_normal_parts(fn, support)
    if parts is None:
        return None
    loc, scale = parts
    return loc, scale.pow(-2)


def conjugate_normal_parts(
    fn: torch.distributions.Distribution, support=None
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """
    As :func:`~pyro_ngvi.conjugate_normal`, but the Normal's ``(loc, scale)``
    :math:`(m_0, s_0)` themselves, expanded to ``batch_shape + unconstrained
    event_shape``: views of the Normal's own tensors, so a ``pyro.param`` they
    broadcast stays recognisable through them (:func:`prior_param_index`).
    """
    support = fn.support if support is None else support
    normal, transforms = _normal_and_transforms(fn)
    if normal is None:
        return None
    bijection, u_shape = _bijection_and_u_shape(support, fn.batch_shape + fn.event_shape)
    if bijection is None:
        return None
    loc, scale = normal.loc, normal.scale
    if not (_broadcasts_to(loc.shape, u_shape) and _broadcasts_to(scale.shape, u_shape)):
        return None
    # a plain Normal on a real site needs no probing: both maps are the identity
    if (transforms or not _is_real(support)) and not _same_map(
        ComposeTransform(transforms), bijection, u_shape, loc.device
    ):
        return None
    return loc.expand(u_shape), scale.expand(u_shape)


def _multivariate_normal_and_transforms(fn):
    """
    As :func:`_normal_and_transforms`, for a
    :class:`~torch.distributions.MultivariateNormal` at the bottom (behind
    ``TransformedDistribution`` layers only; ``Independent`` / ``expand`` would
    give it a batch shape, which a single vector site does not have).
    """
    return _peel(fn, torch.distributions.MultivariateNormal, (torch.distributions.TransformedDistribution,))


def conjugate_multivariate_normal(
    fn: torch.distributions.Distribution, support=None
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """
    The correlated Gaussian a prior is in a vector site's unconstrained
    coordinates, if it is one: ``(prior_loc, prior_precision)`` of shapes
    ``(d,)`` and ``(d, d)`` when ``fn`` is a
    :class:`~torch.distributions.MultivariateNormal` without batch shape on a
    real vector site of ``d`` coordinates, or a ``TransformedDistribution`` of
    one whose transforms do what ``biject_to(support)`` does (see
    :func:`~pyro_ngvi.conjugate_normal`); else ``None``. This is the prior
    :func:`~pyro_ngvi.posterior_as_prior` makes of a full-covariance guide.
    """
    support = fn.support if support is None else support
    normal, transforms = _multivariate_normal_and_transforms(fn)
    if normal is None or normal.batch_shape != ():
        return None
    bijection, u_shape = _bijection_and_u_shape(support, fn.batch_shape + fn.event_shape)
    if bijection is None or u_shape != normal.event_shape:
        return None
    if (transforms or not _is_real(support)) and not _same_map(
        ComposeTransform(transforms), bijection, u_shape, normal.loc.device
    ):
        return None
    return normal.loc, normal.precision_matrix


def conjugate_gaussian(
    fn: torch.distributions.Distribution, support=None
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """
    :func:`~pyro_ngvi.conjugate_normal` or :func:`conjugate_multivariate_normal` in one
    form for a full-covariance guide: ``(prior_loc, prior_precision)`` of shapes
    ``(d,)`` and ``(d, d)`` over the site's ``d`` unconstrained coordinates
    (flattened in the order ``AutoContinuous`` packs them), or ``None``.
    """
    prior = conjugate_normal(fn, support)
    if prior is not None:
        loc, precision = prior
        return loc.reshape(-1), torch.diag_embed(precision.reshape(-1))
    return conjugate_multivariate_normal(fn, support)


def _broadcasts_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (``torch.broadcast_shapes(shape,
    target) == target``, without its cost on every step)."""
    return len(shape) <= len(target) and all(
        a == 1 or a == b for a, b in zip(reversed(shape), reversed(target))
    )


# --------------------------------------------------------------------------- #
# Prior hyperparameters learned by the evidence (type-II maximum likelihood)
# --------------------------------------------------------------------------- #


def prior_param_index(tensor: torch.Tensor, value: torch.Tensor) -> Optional[torch.Tensor]:
    """
    Whether ``tensor`` is ``value`` read through strides (a broadcast,
    ``expand``, ``unsqueeze``, ``transpose``, ...: the same memory, no copy),
    and if so, for each element of ``tensor`` the flat index of the element of
    ``value`` it reads: ``value.reshape(-1)[index]`` equals ``tensor``. This is
    how a conjugate prior's loc or scale (:func:`conjugate_normal_parts`) is
    recognised as a ``pyro.param`` of the model: ``Normal(0, s).expand(shape)``
    holds ``s`` broadcast. Anything computed from the param (``2 * s``,
    ``s.sqrt()``, ``s[idx]``) is a new tensor and gives ``None``.

    :param torch.Tensor tensor: e.g. the prior's scale, expanded to the site's shape.
    :param torch.Tensor value: the param's (constrained) value, contiguous.
    :returns: an integer tensor of ``tensor``'s shape (a strided view, no copy), or ``None``.
    """
    if (tensor.dtype != value.dtype or tensor.device != value.device or tensor.numel() == 0
            or not value.is_contiguous()
            or tensor.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()):
        return None
    offset = tensor.storage_offset() - value.storage_offset()
    last = offset + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    if offset < 0 or last >= value.numel() or any(stride < 0 for stride in tensor.stride()):
        return None
    index = torch.arange(value.numel(), device=value.device).as_strided(
        tensor.shape, tensor.stride(), offset)
    if not torch.equal(value.detach().reshape(-1)[index], tensor.detach()):
        return None
    return index


#: Constraints a learned prior param may have: the closed-form maximiser is
#: clipped into them (strictly inside, where ``transform_to(...).inv`` is finite).
_LEARNABLE_CONSTRAINTS = (
    type(constraints.real),
    constraints._GreaterThan,
    constraints._GreaterThanEq,
    constraints._LessThan,
    constraints._Interval,
    constraints._HalfOpenInterval,
)


def learnable_constraint(constraint) -> bool:
    """Whether :func:`update_learned_priors` can write into a param with ``constraint``
    (the real line, a half line or an interval, with scalar bounds)."""
    base, _ = _unwrap_constraint(constraint)
    bounds = [getattr(base, name, None) for name in ("lower_bound", "upper_bound")]
    return type(base) in _LEARNABLE_CONSTRAINTS and all(
        b is None or isinstance(b, (int, float)) or (isinstance(b, torch.Tensor) and b.numel() == 1)
        for b in bounds)


@functools.lru_cache(maxsize=64)
def _bounds(constraint, dtype: torch.dtype) -> Tuple[Optional[float], Optional[float]]:
    """The open interior ``(lower, upper)`` of a learnable constraint (``None``: unbounded),
    as the nearest ``dtype`` numbers inside its bounds (where ``transform_to(...).inv``
    is finite)."""
    base, _ = _unwrap_constraint(constraint)
    bounds = []
    for bound, towards in ((getattr(base, "lower_bound", None), math.inf),
                           (getattr(base, "upper_bound", None), -math.inf)):
        if bound is not None:
            bound = float(torch.nextafter(torch.tensor(float(bound), dtype=dtype),
                                          torch.tensor(towards, dtype=dtype)))
        bounds.append(bound)
    return tuple(bounds)


def _write(param: PriorParam, total: torch.Tensor, count: torch.Tensor, sqrt: bool) -> None:
    """Write ``total / count`` (its square root when ``sqrt``), clipped into the param's
    constraint, where ``count > 0``; elements no site reaches keep their value."""
    value = total / count
    if sqrt:
        value = value.sqrt_()
    lower, upper = _bounds(param.constraint, value.dtype)
    if lower is not None or upper is not None:
        value = value.clamp_(lower, upper)
    value = value.reshape(param.unconstrained.shape)
    transform = transform_to(param.constraint)
    if param.unconstrained.numel() > 1:  # an element no site reaches keeps its value
        value = torch.where(count.reshape(value.shape) > 0, value, transform(param.unconstrained.detach()))
    param.unconstrained.data.copy_(transform.inv(value))


def _pooled(param: PriorParam, entries) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ``entries`` of ``(weight, value, index)`` (value and index of a site's shape,
    weight a number or a tensor broadcasting to it): ``(sum w * value, sum w)`` over the
    site elements each element of ``param`` is the prior of, as flat vectors."""
    numel = param.unconstrained.numel()
    like = param.unconstrained
    total = count = 0.0
    for weight, value, index in entries:
        if numel == 1:  # one param element for the whole site: no scatter
            if isinstance(weight, torch.Tensor):
                total = total + (weight * value).sum()
                count = count + weight.expand_as(value).sum()
            else:
                total = total + weight * value.sum()
                count = count + weight * value.numel()
        else:
            if not isinstance(total, torch.Tensor):
                total, count = like.new_zeros(numel), like.new_zeros(numel)
            weight = torch.as_tensor(weight, dtype=value.dtype, device=value.device)
            flat = index.reshape(-1)
            total.index_add_(0, flat, (weight * value).expand_as(index).reshape(-1))
            count.index_add_(0, flat, weight.expand_as(index).reshape(-1))
    total = torch.as_tensor(total, dtype=like.dtype, device=like.device).reshape(-1)
    return total, torch.as_tensor(count, dtype=like.dtype, device=like.device).reshape(-1)


@torch.no_grad()
def update_learned_priors(sites: Sequence[Tuple[torch.Tensor, torch.Tensor, SiteCurvature]]) -> None:
    """
    Set every learned prior param (:class:`~pyro_ngvi.handover.PriorParam`) to the
    maximiser of the ELBO given the guide: type-II maximum likelihood, the
    M-step of variational EM. Only the prior term of the ELBO depends on the
    hyperparameters; with :math:`q(u_i) = \\mathcal{N}(\\mu_i, \\sigma_i^2)` and the
    prior :math:`\\mathcal{N}(u_i; m_{0i}, s_{0i}^2)` in ``u`` (element :math:`i`
    weighted by :math:`w_i`, the site's ``prior_weight``),

    .. math:: \\mathbb{E}_q[\\log p_0(u)] = -\\sum_i w_i \\Big[
              \\frac{(\\mu_i - m_{0i})^2 + \\sigma_i^2}{2 s_{0i}^2} + \\log s_{0i}\\Big] + \\text{const},

    and an element :math:`k` of a param is :math:`m_{0i}` (or :math:`s_{0i}`) for the
    set :math:`S_k` of site elements its broadcast reaches (over every site that
    uses the param). The maximisers, taken one after the other (coordinate
    ascent, exact when each loc param's elements share one prior scale):

    .. math:: m_{0k} = \\frac{\\sum_{i \\in S_k} w_i \\lambda_{0i} \\mu_i}
                              {\\sum_{i \\in S_k} w_i \\lambda_{0i}}, \\qquad
              s_{0k}^2 = \\frac{\\sum_{i \\in S_k} w_i \\left[(\\mu_i - m_{0i})^2 + \\sigma_i^2\\right]}
                               {\\sum_{i \\in S_k} w_i},

    the second with the new :math:`m_0`; for a zero-mean prior with one scale
    shared by a set of elements, :math:`s_0^2 = \\mathrm{mean}(\\mu^2 + \\sigma^2)`
    over them. Values are clipped into the param's constraint; an element no
    site reaches keeps its value.

    :param sites: ``(mean, scale, stats)`` per site: the guide's :math:`\\mu`,
        :math:`\\sigma` after this step's update, and the
        :class:`~pyro_ngvi.handover.SiteCurvature` the ELBO handed over (its
        ``prior_loc`` and ``prior_precision`` are the prior the step used).
    """
    locs: Dict[int, Tuple[PriorParam, list]] = {}
    scales: Dict[int, Tuple[PriorParam, list]] = {}
    for site in sites:
        stats = site[2]
        for params, param in ((locs, stats.prior_loc_param), (scales, stats.prior_scale_param)):
            if param is not None:
                params.setdefault(id(param.unconstrained), (param, []))[1].append(site)
    new_locs: Dict[int, torch.Tensor] = {}  # id(unconstrained) -> flat new value
    for key, (param, entries) in locs.items():
        pooled = [(stats.prior_weight * stats.prior_precision, mean, param.index)
                  for mean, _, stats in entries]
        _write(param, *_pooled(param, pooled), sqrt=False)
        new_locs[key] = transform_to(param.constraint)(param.unconstrained.detach()).reshape(-1)
    for param, entries in scales.values():
        pooled = []
        for mean, scale, stats in entries:
            loc_param = stats.prior_loc_param
            if loc_param is not None and id(loc_param.unconstrained) in new_locs:
                prior_loc = new_locs[id(loc_param.unconstrained)][loc_param.index]
            else:
                prior_loc = stats.prior_loc
            deviation = mean - prior_loc
            second_moment = torch.addcmul(scale.square(), deviation, deviation)
            pooled.append((stats.prior_weight, second_moment, param.index))
        _write(param, *_pooled(param, pooled), sqrt=True)


# --------------------------------------------------------------------------- #
# A prior in the site's coordinates
# --------------------------------------------------------------------------- #


class _SiteTransformedDistribution(dist.TransformedDistribution):
    """
    ``TransformedDistribution(base, bijection)`` that reports the support of the
    site it was made for. torch's reports the codomain of the last transform,
    which for ``biject_to(positive) = Exp then Affine(0, 1)`` is ``real``: a guide
    built on it would put the site on the whole real line.

    :param base_distribution: distribution of ``u`` (real support).
    :param transforms: the transform(s) with ``x = T(u)``.
    :param support: the site's support, the image of ``T``.
    """

    def __init__(self, base_distribution, transforms, support, validate_args=None):
        self._site_support = support
        super().__init__(base_distribution, transforms, validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False)
    def support(self):
        return self._site_support

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(_SiteTransformedDistribution, _instance)
        new._site_support = self._site_support
        return super().expand(batch_shape, _instance=new)



def _weight_prior_loc_scale(
    name: str, prior, shape: torch.Size
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    ``(loc, scale)`` of a prior for a real weight site of shape ``shape``, with
    the checks :class:`~pyro_ngvi.handlers.PriorMessenger` makes (event shape equal to the site's,
    no batch shape, same support) and one more: the prior must be Normal.
    Errors name the site.
    """
    if not isinstance(prior, torch.distributions.Distribution):
        raise TypeError(
            f"prior for site '{name}' must be a Distribution, got {type(prior).__name__}"
        )
    if prior.event_shape != shape:
        raise ValueError(
            f"with_priors: prior for site '{name}' has event shape "
            f"{tuple(prior.event_shape)}, the site has {tuple(shape)} "
            "(use .to_event(...) to move batch dims into the event)."
        )
    if prior.batch_shape != ():
        raise ValueError(
            f"with_priors: prior for site '{name}' has batch shape "
            f"{tuple(prior.batch_shape)}, which does not broadcast to the site's ()."
        )
    device = _device_of(prior)
    site_support = constraints.independent(constraints.real, len(shape)) if shape else constraints.real
    if not _same_support(prior.support, site_support, shape, device):
        raise ValueError(
            f"with_priors: prior for site '{name}' has support {prior.support}, "
            f"the site has {site_support}."
        )
    normal, transforms = _normal_and_transforms(prior)
    if normal is None or (
        transforms
        and not _same_map(ComposeTransform(transforms), biject_to(constraints.real), shape, device)
    ):
        raise ValueError(
            f"with_priors: prior for site '{name}' is a {type(prior).__name__}; the "
            "weight priors of a BayesianNet are Normal. For another prior wrap the "
            "model in PriorMessenger(priors) (traced path, no BackPACK fast path)."
        )
    return normal.loc, normal.scale


