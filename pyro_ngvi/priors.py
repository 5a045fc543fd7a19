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

This module holds that recognition (:func:`conjugate_normal`) and the comparison
of supports and transforms by behaviour. Swapping a model's priors is a handler
(:mod:`pyro_ngvi.handlers`); the continual-learning workflow built on both lives
in :mod:`pyro_ngvi.continual`.
"""

import weakref
from typing import Iterable, List, Optional, Tuple

import torch
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import ComposeTransform, Transform

import pyro.distributions as dist
from pyro.distributions.torch_distribution import ExpandedDistribution

__all__ = ["conjugate_gaussian", "conjugate_multivariate_normal", "conjugate_normal"]

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
    transforms: list = []
    while True:
        cls = type(fn)
        if isinstance(fn, torch.distributions.Normal):
            if cls.log_prob is torch.distributions.Normal.log_prob:
                return fn, transforms
            return None, []
        if isinstance(fn, torch.distributions.Independent):
            if cls.log_prob is not torch.distributions.Independent.log_prob:
                return None, []
        elif isinstance(fn, ExpandedDistribution):
            if cls.log_prob is not ExpandedDistribution.log_prob:
                return None, []
        elif isinstance(fn, torch.distributions.TransformedDistribution):
            if cls.log_prob is not torch.distributions.TransformedDistribution.log_prob:
                return None, []
            transforms = list(fn.transforms) + transforms
        else:
            return None, []
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
    return loc.expand(u_shape), scale.pow(-2).expand(u_shape)


def _multivariate_normal_and_transforms(fn):
    """
    As :func:`_normal_and_transforms`, for a
    :class:`~torch.distributions.MultivariateNormal` at the bottom (behind
    ``TransformedDistribution`` layers only; ``Independent`` / ``expand`` would
    give it a batch shape, which a single vector site does not have).
    """
    transforms: list = []
    while True:
        cls = type(fn)
        if isinstance(fn, torch.distributions.MultivariateNormal):
            if cls.log_prob is torch.distributions.MultivariateNormal.log_prob:
                return fn, transforms
            return None, []
        if not isinstance(fn, torch.distributions.TransformedDistribution) or (
            cls.log_prob is not torch.distributions.TransformedDistribution.log_prob
        ):
            return None, []
        transforms = list(fn.transforms) + transforms
        fn = fn.base_dist


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
    :func:`conjugate_normal`); else ``None``. This is the prior
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
    :func:`conjugate_normal` or :func:`conjugate_multivariate_normal` in one
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


