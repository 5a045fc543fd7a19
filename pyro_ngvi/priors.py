"""
Priors in the guide's coordinates: conjugacy, posterior-as-prior, prior swapping.

A mean-field Gaussian guide such as :class:`~pyro.infer.autoguide.AutoNormal`
lives in the unconstrained coordinates ``u`` of every latent site,

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
  a positive site is one; the prior :func:`posterior_as_prior` builds is another.

"Are ``T``" is decided by what the transforms do, not by ``==``: in torch 2.14
``biject_to(constraints.positive)`` is ``ComposeTransform([ExpTransform(),
AffineTransform(0, 1)])``, which does not compare equal to ``ExpTransform()``.

This module recognises such priors (:func:`conjugate_normal`), turns a fitted
guide into tomorrow's prior (:func:`posterior_as_prior`, continual learning),
swaps a model's priors with an effect handler (:class:`PriorMessenger`,
:func:`with_priors`; a :class:`~pyro_ngvi.nn.BayesianNet` stays one) and sets
up the next task's guide at yesterday's posterior or afresh, as the caller
chooses (:func:`start_task`).

**References**

[1] Mohammad Emtiyaz Khan, Didrik Nielsen, Voot Tangkaratt, Wu Lin, Yarin Gal,
    Akash Srivastava (2018),
    "Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam",
    https://arxiv.org/abs/1806.04854

[2] Cuong V. Nguyen, Yingzhen Li, Thang D. Bui, Richard E. Turner (2018),
    "Variational Continual Learning",
    https://arxiv.org/abs/1710.10628
"""

import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import ComposeTransform, Transform

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions.torch_distribution import ExpandedDistribution
from pyro.infer.autoguide import AutoNormal
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.subsample_messenger import SubsampleMessenger, _Subsample

__all__ = [
    "PriorMessenger",
    "conjugate_normal",
    "posterior_as_prior",
    "start_task",
    "with_priors",
]

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


def _broadcasts_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (``torch.broadcast_shapes(shape,
    target) == target``, without its cost on every step)."""
    return len(shape) <= len(target) and all(
        a == 1 or a == b for a, b in zip(reversed(shape), reversed(target))
    )


# --------------------------------------------------------------------------- #
# posterior_as_prior
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


def _guide_sites(guide) -> List[str]:
    return [name for name, _ in guide.prototype_trace.iter_stochastic_nodes()]


def posterior_as_prior(guide, sites=None) -> Dict[str, torch.distributions.Distribution]:
    """
    Yesterday's posterior as today's prior (variational continual learning [2]).

    For each latent site of a fitted :class:`~pyro.infer.autoguide.AutoNormal`,
    whose factor is :math:`q(u) = \\mathcal{N}(u; \\mu, \\sigma^2)` in the site's
    unconstrained coordinates, returns the same law in the site's own
    coordinates :math:`x = T(u)`, :math:`T = \\text{biject_to}(\\text{support})`:

    .. math:: p_0(x) = \\mathcal{N}(T^{-1}(x); \\mu, \\sigma^2)\\,
              |\\det J_{T^{-1}}(x)|,

    i.e. ``Normal(mu, sigma).to_event(d)`` for a real site and a
    :class:`~pyro.distributions.TransformedDistribution` of it through ``T``
    otherwise (its ``support`` is the site's). Such a prior is conjugate
    (:func:`conjugate_normal`). ``mu`` and ``sigma`` are detached clones: training
    the guide further leaves the priors unchanged. Under a subsampled plate the
    prior has the plate's full size, like the guide; :func:`with_priors` picks
    the rows of each minibatch.

    :param guide: a fitted :class:`~pyro.infer.autoguide.AutoNormal`.
    :param sites: names of the sites to return (default: all latent sites).
    :returns: ``{site name: prior distribution}``.
    :raises NotImplementedError: for any other guide.
    :raises ValueError: if the guide has not been run yet, or for an unknown site.
    """
    if not isinstance(guide, AutoNormal):
        raise NotImplementedError(
            f"posterior_as_prior supports AutoNormal guides; got {type(guide).__name__}."
        )
    if guide.prototype_trace is None:
        raise ValueError(
            "posterior_as_prior: the guide has not been initialised; run the guide "
            "once (guide(*args)) or take an SVI step first."
        )
    known = _guide_sites(guide)
    if sites is None:
        names = known
    else:
        names = [sites] if isinstance(sites, str) else list(sites)
        for name in names:
            if name not in known:
                raise ValueError(
                    f"posterior_as_prior: site '{name}' is not a latent site of the "
                    f"guide; its sites are {known}."
                )
    priors = {}
    for name in names:
        support = guide.prototype_trace.nodes[name]["fn"].support
        loc, scale = guide._get_loc_and_scale(name)
        loc, scale = loc.detach().clone(), scale.detach().clone()
        base = dist.Normal(loc, scale).to_event(guide._event_dims[name])
        if _is_real(support):
            priors[name] = base
        else:
            priors[name] = _SiteTransformedDistribution(base, biject_to(support), support)
    return priors


# --------------------------------------------------------------------------- #
# Selecting the rows of a subsample
# --------------------------------------------------------------------------- #


def _has_batched_tensors(transform: Transform) -> bool:
    return any(t.numel() > 1 for t in _tensors_in(transform))


def _select_rows(fn, dim: int, index: torch.Tensor):
    """
    ``fn`` restricted to the rows ``index`` along batch dimension ``dim``
    (counted from the left of ``fn.batch_shape``; leading batch dimensions keep
    their position through ``Independent``, ``expand`` and transforms).

    :raises NotImplementedError: for a distribution whose parameters cannot be
        indexed this way.
    """
    if isinstance(fn, torch.distributions.Independent):
        return dist.Independent(
            _select_rows(fn.base_dist, dim, index), fn.reinterpreted_batch_ndims
        )
    if isinstance(fn, ExpandedDistribution):
        batch_shape = list(fn.batch_shape)
        batch_shape[dim] = len(index)
        base = fn.base_dist
        base_dim = dim - (len(fn.batch_shape) - len(base.batch_shape))
        if base_dim >= 0 and base.batch_shape[base_dim] != 1:
            base = _select_rows(base, base_dim, index)
        return base.expand(torch.Size(batch_shape))
    params = {k: fn.__dict__[k] for k in fn.arg_constraints if k in fn.__dict__}
    if params:
        batch_ndim = len(fn.batch_shape)
        selected = {}
        for key, value in params.items():
            if (
                not isinstance(value, torch.Tensor)
                or value.shape[:batch_ndim] != fn.batch_shape
            ):
                break
            selected[key] = value.index_select(dim, index.to(value.device))
        else:
            try:
                return type(fn)(**selected)
            except (TypeError, ValueError):
                pass
    if (
        isinstance(fn, torch.distributions.TransformedDistribution)
        and type(fn).log_prob is torch.distributions.TransformedDistribution.log_prob
        and not any(_has_batched_tensors(t) for t in fn.transforms)
    ):
        # keep the support fn reports (LogNormal's, or a site's)
        base = _select_rows(fn.base_dist, dim, index)
        return _SiteTransformedDistribution(base, fn.transforms, fn.support)
    raise NotImplementedError(
        f"cannot select subsample rows of a {type(fn).__name__} prior"
    )


def _plate_indices(name: str) -> Optional[torch.Tensor]:
    """The current subsample of the active plate ``name`` (from Pyro's stack)."""
    for messenger in reversed(_PYRO_STACK):
        if isinstance(messenger, SubsampleMessenger) and messenger.name == name:
            return messenger.indices
    return None


# --------------------------------------------------------------------------- #
# The handler
# --------------------------------------------------------------------------- #


class PriorMessenger(Messenger):
    """
    Replaces the distributions of named latent sample sites by new priors.

    At a site named in ``priors`` the model's ``fn`` is swapped for the prior
    before the site's value is drawn, replayed or scored, so traces, ELBOs,
    autoguides and :class:`~pyro.infer.Predictive` all see the new prior. Apply
    it around the model (as :func:`with_priors` does), so that the model's own
    plates have already broadcast the site when the handler sees it.

    Under a subsampled plate a prior of the plate's full size (as
    :func:`posterior_as_prior` makes) is indexed by the plate's current subsample
    indices; a prior of size 1 along the plate broadcasts. The prior's batch shape
    must otherwise broadcast to the site's, and its event shape equal the site's.

    Each of these is a :class:`ValueError` naming the site: a prior for an
    observed site; a shape mismatch; a support mismatch (supports count as equal
    when their bijections do the same, e.g. ``positive`` and ``nonnegative``; a
    :class:`~torch.distributions.TransformedDistribution` of a real base whose
    transforms do what ``biject_to(site support)`` does takes the site's support,
    whatever its last transform reports); and, when the model returns, a prior
    for a site that never reached the handler.

    :param priors: ``{site name: distribution}``.
    """

    def __init__(self, priors: Dict[str, torch.distributions.Distribution]) -> None:
        super().__init__()
        if not isinstance(priors, dict):
            raise TypeError(f"priors must be a dict of distributions, got {type(priors)}")
        for name, prior in priors.items():
            if not isinstance(prior, torch.distributions.Distribution):
                raise TypeError(
                    f"prior for site '{name}' must be a Distribution, got {type(prior)}"
                )
        self.priors = dict(priors)
        self._seen: set = set()

    def __enter__(self):
        self._seen = set()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            unused = sorted(set(self.priors) - self._seen)
            if unused:
                raise ValueError(
                    f"with_priors: the model never sampled site(s) {unused} "
                    "(misspelt, or hidden by poutine.block inside the model?)."
                )

    def _pyro_sample(self, msg) -> None:
        name = msg["name"]
        if name not in self.priors or isinstance(msg["fn"], _Subsample):
            return
        self._seen.add(name)
        if msg["is_observed"]:
            raise ValueError(
                f"with_priors: site '{name}' is observed; priors replace latent sites only."
            )
        msg["fn"] = self._site_prior(name, msg)

    def _site_prior(self, name: str, msg) -> torch.distributions.Distribution:
        site_fn = msg["fn"]
        prior = self.priors[name]
        batch_shape = site_fn.batch_shape
        # 1. rows of the current subsample
        for frame in msg["cond_indep_stack"]:
            if frame.dim is None or frame.full_size is None:
                continue
            if frame.size == frame.full_size:
                continue
            if len(prior.batch_shape) < -frame.dim:
                continue
            size = prior.batch_shape[frame.dim]
            if size == 1:
                continue
            if size != frame.full_size:
                raise ValueError(
                    f"with_priors: prior for site '{name}' has size {size} along "
                    f"plate '{frame.name}' (dim {frame.dim}); expected the plate's "
                    f"full size {frame.full_size} (the subsample's rows are selected) or 1."
                )
            index = _plate_indices(frame.name)
            if index is None:
                raise ValueError(
                    f"with_priors: site '{name}': plate '{frame.name}' is not active."
                )
            try:
                prior = _select_rows(prior, len(prior.batch_shape) + frame.dim, index)
            except NotImplementedError as error:
                raise ValueError(
                    f"with_priors: site '{name}' under subsampled plate "
                    f"'{frame.name}': {error}."
                ) from error
        # 2. shape
        if prior.event_shape != site_fn.event_shape:
            raise ValueError(
                f"with_priors: prior for site '{name}' has event shape "
                f"{tuple(prior.event_shape)}, the site has {tuple(site_fn.event_shape)} "
                "(use .to_event(...) to move batch dims into the event)."
            )
        try:
            broadcast = torch.broadcast_shapes(prior.batch_shape, batch_shape)
        except RuntimeError:
            broadcast = None
        if broadcast != batch_shape:
            raise ValueError(
                f"with_priors: prior for site '{name}' has batch shape "
                f"{tuple(prior.batch_shape)}, which does not broadcast to the site's "
                f"{tuple(batch_shape)}."
            )
        # 3. support
        site_support = site_fn.support
        x_shape = batch_shape + site_fn.event_shape
        device = _device_of(prior)
        if not _same_support(prior.support, site_support, x_shape, device):
            fixed = self._with_site_support(prior, site_support, device)
            if fixed is None:
                raise ValueError(
                    f"with_priors: prior for site '{name}' has support {prior.support}, "
                    f"the site has {site_support}."
                )
            prior = fixed
        if prior.batch_shape != batch_shape:
            prior = prior.expand(batch_shape)
        return prior

    @staticmethod
    def _with_site_support(prior, site_support, device):
        """
        ``prior`` with the site's support when it is a transformed real base whose
        transforms do what ``biject_to(site_support)`` does; else ``None``.
        """
        if not isinstance(prior, torch.distributions.TransformedDistribution):
            return None
        if not _is_real(prior.base_dist.support):
            return None
        if prior.support.event_dim != site_support.event_dim:
            return None
        bijection, u_shape = _bijection_and_u_shape(site_support, prior.batch_shape + prior.event_shape)
        if bijection is None:
            return None
        if not _same_map(ComposeTransform(list(prior.transforms)), bijection, u_shape, device):
            return None
        return _SiteTransformedDistribution(prior.base_dist, prior.transforms, site_support)


def with_priors(
    model: Callable, priors: Dict[str, torch.distributions.Distribution]
) -> Callable:
    """
    The same model with the priors of some latent sites replaced, e.g. by
    :func:`posterior_as_prior` of yesterday's guide::

        priors = posterior_as_prior(guide)
        model_t2 = with_priors(model, priors)
        svi = SVI(model_t2, AutoNormal(model_t2), optim, Trace_ELBO())

    A :class:`~pyro_ngvi.nn.BayesianNet` gives a :class:`~pyro_ngvi.nn.BayesianNet`
    (:meth:`~pyro_ngvi.nn.BayesianNet.with_priors`): the same plain network with
    those weights' Normal priors replaced, so that
    :class:`~pyro_ngvi.CurvatureELBO` keeps its BackPACK fast path. Any other
    model is wrapped in a :class:`PriorMessenger`.

    :param model: a Pyro model.
    :param priors: ``{site name: distribution}``; see :class:`PriorMessenger`
        (and :meth:`~pyro_ngvi.nn.BayesianNet.with_priors`) for the checks made.
    :returns: the new model.
    """
    from .nn import BayesianNet  # nn imports this module

    if isinstance(model, BayesianNet):
        return model.with_priors(priors)
    return PriorMessenger(priors)(model)


def _weight_prior_loc_scale(
    name: str, prior, shape: torch.Size
) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    ``(loc, scale)`` of a prior for a real weight site of shape ``shape``, with
    the checks :class:`PriorMessenger` makes (event shape equal to the site's,
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


# --------------------------------------------------------------------------- #
# Where the next task's guide starts
# --------------------------------------------------------------------------- #


def start_task(guide, priors, *args, carry: bool, **kwargs):
    """
    Set up a new task's :class:`~pyro.infer.autoguide.AutoNormal` guide and make
    where it starts an explicit choice.

    Pyro's param store outlives guides: a new ``AutoNormal`` named like an old
    one (the default name is ``"AutoNormal"``) silently takes the old guide's
    ``locs.<site>`` / ``scales.<site>`` for every site of the same name, i.e.
    starts at yesterday's posterior, mean *and* precision, and may even reuse
    a tensor of another shape for a site that only shares a name (a new task's
    head). This helper first removes every ``locs.*`` / ``scales.*`` entry under
    the guide's name, sets the guide up on ``args`` (one minibatch is enough;
    nothing is drawn from the global RNG unless the guide's ``init_loc_fn``
    does), and then

    - ``carry=True``: starts each site named in ``priors`` at that prior, which
      must be Normal in the site's unconstrained coordinates (what
      :func:`posterior_as_prior` gives): :math:`\\mu = m_0`,
      :math:`\\sigma = s_0`. With ``priors = posterior_as_prior(old_guide)`` the
      new guide starts at the previous posterior, so the natural-gradient
      precision :math:`\\lambda = \\sigma^{-2}` of :class:`~pyro_ngvi.NGVI` is
      carried from task to task, and the initial KL to the new prior is zero;
    - ``carry=False``: every site starts at the guide's own initialisation
      (``init_loc_fn``, ``init_scale``), as on the first task.

    Sites not named in ``priors`` start at the guide's initialisation either way.
    The optimizer's own per-site state (momentum, :class:`~pyro_ngvi.NGVI`'s
    first-step warm start) belongs to the optimizer instance: use a new
    :class:`~pyro_ngvi.NGVI` per task, as in::

        priors = None
        for data in tasks:
            guide = start_task(AutoNormal(model), priors, *data[0], carry=True)
            svi = SVI(model, guide, NGVI(...), CurvatureELBO("ggn"))
            ...                                       # train on data
            priors = posterior_as_prior(guide)
            model = with_priors(model, priors)

    :param guide: a new :class:`~pyro.infer.autoguide.AutoNormal`, not run yet.
    :param priors: ``{site name: prior}`` (or ``None`` for none), usually
        :func:`posterior_as_prior` of the previous guide; every name must be a
        latent site of the guide.
    :param args: model arguments to set the guide up with (e.g. a minibatch).
    :param bool carry: start at the priors (``True``) or at the guide's
        initialisation (``False``); required, there is no default.
    :param kwargs: model keyword arguments.
    :returns: ``guide``, set up.
    :raises ValueError: if the guide has been run already, for a name that is
        not a latent site, and with ``carry=True`` for a prior that is not
        Normal in the site's unconstrained coordinates or whose shape does not
        broadcast to the site's (the site is named).
    """
    if not isinstance(guide, AutoNormal):
        raise NotImplementedError(
            f"start_task supports AutoNormal guides; got {type(guide).__name__}."
        )
    if not isinstance(carry, bool):
        raise TypeError(f"carry must be True or False, got {carry!r}")
    if guide.prototype_trace is not None:
        raise ValueError(
            "start_task: the guide has already been run; pass a new AutoNormal "
            "(its initial values are gone once it is set up)."
        )
    priors = {} if priors is None else priors
    if not isinstance(priors, dict):
        raise TypeError(f"priors must be a dict of distributions or None, got {type(priors)}")
    store = pyro.get_param_store()
    prefixes = (f"{guide._pyro_name}.locs.", f"{guide._pyro_name}.scales.")
    for param_name in [n for n in store.keys() if n.startswith(prefixes)]:
        del store[param_name]
    with poutine.block():
        guide(*args, **kwargs)
    known = _guide_sites(guide)
    for name in priors:
        if name not in known:
            raise ValueError(
                f"start_task: site '{name}' is not a latent site of the guide; "
                f"its sites are {known}."
            )
    if carry:
        for name, prior in priors.items():
            _start_at(guide, name, prior)
    return guide


@torch.no_grad()
def _start_at(guide, name: str, prior) -> None:
    """Write ``prior``'s Normal (in ``u``) into the guide's loc and scale of ``name``."""
    support = guide.prototype_trace.nodes[name]["fn"].support
    if conjugate_normal(prior, support) is None:
        raise ValueError(
            f"start_task(carry=True): prior for site '{name}' is not Normal in the "
            f"site's unconstrained coordinates (support {support}), so the guide "
            "cannot start at it; posterior_as_prior gives such priors. Use carry=False."
        )
    normal, _ = _normal_and_transforms(prior)
    store = pyro.get_param_store()
    loc = store._params[f"{guide._pyro_name}.locs.{name}"]  # real: loc is unconstrained
    scale_name = f"{guide._pyro_name}.scales.{name}"
    raw_scale = store._params[scale_name]
    shape = loc.shape
    try:
        broadcast = torch.broadcast_shapes(normal.loc.shape, normal.scale.shape, shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(
            f"start_task: prior for site '{name}' has loc {tuple(normal.loc.shape)} and "
            f"scale {tuple(normal.scale.shape)} in unconstrained coordinates; the "
            f"guide's are {tuple(shape)}."
        )
    loc.copy_(normal.loc.expand(shape))
    raw_scale.copy_(biject_to(store._constraints[scale_name]).inv(normal.scale.expand(shape)))
