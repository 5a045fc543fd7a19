"""
The exponential-family view of a Gaussian guide.

:class:`~pyro.infer.autoguide.AutoNormal` and
:class:`~pyro.infer.autoguide.AutoDiagonalNormal` store, in the unconstrained
coordinates ``u`` of the model's latent sites, a Gaussian

.. math:: q(u) = \\mathcal{N}(u; \\mu, \\lambda^{-1}),
          \\qquad \\mu = \\text{loc}, \\quad \\lambda = \\text{scale}^{-2},

with natural parameters :math:`\\eta_1 = \\lambda\\mu`, :math:`\\eta_2 = -\\lambda/2`.
:class:`~pyro.infer.autoguide.AutoMultivariateNormal` stores a full-covariance
Gaussian over the whole latent vector (:class:`FullCovarianceSite`; its algebra
lives in :mod:`pyro_ngvi.full_covariance`). This module finds those tensors
among the ones ``SVI`` hands an optimizer, reads the mean and precision off
them and writes updated values back.

It also holds the one protocol by which an ELBO hands curvature to
:class:`~pyro_ngvi.NGVI`: :class:`SiteCurvature`, attached to the site's
unconstrained ``loc`` tensor with :func:`attach_curvature` (BackPACK style: the
result lives on the parameter) and taken off by :func:`pop_curvature`, under a
hand-over that the ELBO begins (:func:`begin_handover`) and the optimizer ends
(:func:`end_handover`), accepting or rejecting the step; side effects of the
evaluation that a rejected step must not leave behind (BatchNorm running
statistics) are registered with :func:`on_rejected`.
"""

import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch.distributions import biject_to, transform_to
from torch.distributions.transforms import Transform

import pyro
from pyro.distributions import constraints
from pyro.distributions.transforms import SoftplusTransform
from pyro.infer.autoguide import (
    AutoCallable,
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuide,
    AutoGuideList,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from . import full_covariance
from .kronecker import KroneckerNormal, KroneckerSite
from .scales import FastSoftplus, known_scale

_CURVATURE_ATTR = "_pyro_ngvi_curvature"
#: The curvature of the negative log-likelihood per example assumed before the data say
#: otherwise, in the units of a likelihood whose curvature in its output is of order one
#: (a softmax's is at most 1/2, a Bernoulli's 1/4, a standardised Gaussian's 1; ivon-opt's
#: ``hess_init``): a minibatch-trained guide starts at precision N times it, and NGVI's mean
#: step is damped by as much (see NGVI and BayesianNet.guide).
CURVATURE_PER_EXAMPLE = 1.0
_SUPPORTED = (
    "AutoNormal and AutoDiagonalNormal (mean-field), AutoMultivariateNormal (full "
    "covariance) and pyro_ngvi's KroneckerNormal (per-layer Kronecker factors) guides, alone "
    "or as parts of an AutoGuideList (where AutoDelta parts are point-estimated beside them)"
)
#: How far up the call stack :func:`calling_svi` looks for ``SVI.step``.
_STACK_DEPTH = 6
#: The id of the live hand-over (one per ELBO evaluation), see :func:`begin_handover`.
_live_handover = [0]
#: How to undo the live hand-over's side effects, should the optimizer reject the step.
_undo: List[Callable[[], None]] = []


@dataclass
class PriorParam:
    """
    A ``pyro.param`` of the model that the ``loc`` or the ``scale`` of a site's
    conjugate Normal prior (in ``u``) is, broadcast over the site: the prior
    hyperparameter :class:`~pyro_ngvi.NGVI` sets by type-II maximum likelihood
    (:func:`~pyro_ngvi.priors.update_learned_priors`) instead of the point
    optimizer.

    :param str name: the param's name in the param store.
    :param torch.Tensor unconstrained: its unconstrained tensor there (written in place).
    :param constraint: its constraint (the value is ``transform_to(constraint)(unconstrained)``).
    :param torch.Tensor index: integer tensor of the site's ``loc`` shape: element
        :math:`i` of the site has the prior loc (or scale) ``value.reshape(-1)[index[i]]``.
    """

    name: str
    unconstrained: torch.Tensor
    constraint: object
    index: torch.Tensor


@dataclass
class SiteCurvature:
    """
    What an ELBO hands :class:`~pyro_ngvi.NGVI` for one guide site. Every tensor
    has the shape of the site's ``loc`` (all rows, also under a subsampled plate),
    except for a :class:`FullCovarianceSite` (``loc`` of shape ``(D,)``), whose
    ``curvature`` and ``prior_precision`` are symmetric ``(D, D)`` matrices.

    :param torch.Tensor grad: gradient of the non-conjugate part :math:`\\ell`
        of the negative log joint w.r.t. ``u`` (likelihood plus any prior that is
        not Normal in ``u``), averaged over particles and divided by the site's
        own plate scale, so touched rows carry their full-data value.
    :param torch.Tensor curvature: diagonal curvature :math:`h` of the same part.
    :param prior_loc: mean :math:`m_0` of a conjugate Normal prior in ``u``,
        or ``None`` when the prior is already inside ``grad``/``curvature``.
    :param prior_precision: precision :math:`\\lambda_0` of that prior, or ``None``.
    :param mask: boolean tensor of the rows this step touched (``None``: all).
    :param bool sampled: ``curvature`` is a Price (reparameterisation) estimate
        :math:`g\\epsilon/\\sigma`, whose noise grows with :math:`|g|`.
    :param bool nonnegative: ``curvature`` is :math:`\\ge 0` by construction
        (Gauss-Newton, Fisher): with a conjugate prior the precision target is
        then positive and the optimizer skips its positivity correction.
    :param scale: the guide's :math:`\\sigma` the ELBO read this step, or ``None``
        (the optimizer then reads it from the param store itself).
    :param bool whitened: (full-covariance sites) ``curvature`` is
        :math:`C^\\top H C`, in the coordinates that whiten the guide's Gaussian
        (:func:`~pyro_ngvi.full_covariance.whiten`): what the Price estimate gives
        without an inverse.
    :param prior_loc_param: the :class:`PriorParam` that ``prior_loc`` is, or ``None``
        (a fixed prior loc).
    :param prior_scale_param: the :class:`PriorParam` that the prior scale
        :math:`\\lambda_0^{-1/2}` is, or ``None`` (a fixed prior scale).
    :param float prior_weight: the weight of each row's :math:`\\mathrm{KL}(q \\| p_0)`
        in the full-data ELBO (a ``poutine.scale`` factor; 1 for a plain model),
        used to pool sites that share a learned prior param.
    :param eps_mean: for a Price estimate whose draws are known, the mean over
        particles of the standard-normal draws :math:`\\epsilon` (``u = mu + sigma eps``);
        with ``eps_sq_mean`` (the mean of :math:`\\epsilon^2`) NGVI subtracts a
        control variate from ``(grad, curvature)``; ``None`` otherwise.
    :param eps_sq_mean: see ``eps_mean``.
    :param float objective: for statistics evaluated at the mean (``deterministic``),
        :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|` there (the same
        for every site of the evaluation), whose Newton step the update is; NGVI's
        step safeguard compares it between steps. ``None`` otherwise.
    :param int num_data: set when ``grad`` and ``curvature`` are minibatch
        estimates of sums over ``num_data`` examples (a
        :class:`~pyro_ngvi.BayesianNet`'s): :class:`~pyro_ngvi.NGVI` then resolves
        its defaults for minibatch training, the damping relative to ``num_data``
        included (``None``: full-batch statistics).
    :param min_precision: the least precision :math:`\\lambda_{\\min}` the
        variational family allows the site (a cap :math:`\\lambda_{\\min}^{-1/2}` on
        its standard deviation; a tensor of the ``loc``'s shape: an expanded view of
        one number costs no memory), or ``None``:
        :class:`~pyro_ngvi.NGVI` keeps :math:`\\lambda' \\ge \\lambda_{\\min}` (the
        step projected on the family).
    :param loss: the ELBO evaluation's loss (the negative ELBO estimate ``SVI.step``
        returns; a 0-d tensor or a float, the same for every site of the
        evaluation), for :class:`~pyro_ngvi.NGVI`'s watch on a worsening ELBO, or
        ``None``.
    :param int handover: the ELBO evaluation that made these statistics
        (set by :func:`attach_curvature`).
    """

    grad: torch.Tensor
    curvature: torch.Tensor
    prior_loc: Optional[torch.Tensor] = None
    prior_precision: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    sampled: bool = False
    nonnegative: bool = False
    scale: Optional[torch.Tensor] = None
    prior_loc_param: Optional[PriorParam] = None
    prior_scale_param: Optional[PriorParam] = None
    prior_weight: float = 1.0
    handover: int = 0
    whitened: bool = False
    eps_mean: Optional[torch.Tensor] = None
    eps_sq_mean: Optional[torch.Tensor] = None
    objective: Optional[float] = None
    num_data: Optional[int] = None
    min_precision: Optional[torch.Tensor] = None
    loss: Optional[torch.Tensor] = None

    def prior_params(self) -> List[PriorParam]:
        """The learned prior params of this site (none, one or two)."""
        return [p for p in (self.prior_loc_param, self.prior_scale_param) if p is not None]


def begin_handover() -> int:
    """
    Start a new hand-over: an ELBO calls this once per evaluation, before it
    attaches anything. Statistics attached under an earlier hand-over (an
    evaluation whose optimizer step never came: an exception, an interrupt, a
    call outside ``SVI``) are stale from now on and never reach the optimizer;
    that evaluation's side effects stay (as after any forward pass).
    """
    _live_handover[0] += 1
    _undo.clear()
    return _live_handover[0]


def live_handover() -> int:
    """The id of the live hand-over."""
    return _live_handover[0]


def on_rejected(undo: Callable[[], None]) -> None:
    """
    Register how to undo a side effect of the live evaluation (a model's
    BatchNorm running statistics), run by :func:`end_handover` should the
    optimizer reject the step (skip it, or fail before its update).
    """
    _undo.append(undo)


def end_handover(accepted: bool) -> None:
    """
    The optimizer's verdict on the live hand-over: when not ``accepted``, undo
    the side effects registered with :func:`on_rejected` (latest first). Either
    way the hand-over closes: statistics still attached are stale.
    """
    undo = _undo[::-1]
    _undo.clear()
    _live_handover[0] += 1
    if not accepted:
        for action in undo:
            action()


def attach_curvature(loc: torch.Tensor, stats: SiteCurvature) -> None:
    """Hand ``stats`` to the optimizer on the site's unconstrained ``loc`` tensor,
    under the live hand-over (replacing anything stale left there)."""
    stats.handover = _live_handover[0]
    setattr(loc, _CURVATURE_ATTR, stats)


def pop_curvature(loc: torch.Tensor) -> Optional[SiteCurvature]:
    """Take the :class:`SiteCurvature` of the live hand-over off ``loc`` (``None``
    when there is none; stale statistics are dropped)."""
    stats = getattr(loc, _CURVATURE_ATTR, None)
    if stats is None:
        return None
    delattr(loc, _CURVATURE_ATTR)
    return stats if stats.handover == _live_handover[0] else None


@dataclass
class _StoredGaussian:
    """The tensors every Gaussian site of a guide has in Pyro's param store: the
    unconstrained ``loc`` and a raw (unconstrained) positive ``scale``."""

    name: str
    loc: torch.Tensor
    raw_scale: torch.Tensor
    scale_name: str

    def __post_init__(self):
        # the param-store name of ``loc``: unique, unlike a site name two guides may share
        self.key = pyro.get_param_store().param_name(self.loc) or self.name

    @property
    def _scale_transform(self) -> Transform:
        return scale_transform(pyro.get_param_store()._constraints[self.scale_name])

    @property
    def mean(self) -> torch.Tensor:
        return self.loc.detach()

    @property
    def scale(self) -> torch.Tensor:
        """:math:`\\sigma` (the one NGVI remembered writing, while the raw scale is unchanged:
        read-only)."""
        known = known_scale(self.raw_scale)
        return known if known is not None else self._scale_transform(self.raw_scale.detach())


@dataclass
class GaussianSite(_StoredGaussian):
    """
    One mean-field Gaussian block of a guide: the unconstrained ``loc`` tensor and
    the unconstrained (raw) ``scale`` tensor as stored in Pyro's param store.
    """

    @property
    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """The param-store tensors the site is made of."""
        return self.loc, self.raw_scale

    @property
    def precision(self) -> torch.Tensor:
        return self.scale.pow(-2)

    def natural_params(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """:math:`(\\eta_1, \\eta_2) = (\\lambda\\mu, -\\lambda/2)`."""
        lam = self.precision
        return lam * self.mean, -0.5 * lam

    @torch.no_grad()
    def write(self, mean: torch.Tensor, precision: torch.Tensor, mask=None) -> None:
        """Set :math:`\\mu` and :math:`\\lambda` in place (only the ``mask`` rows)."""
        raw = self._scale_transform.inv(precision.rsqrt())
        if mask is None:
            self.loc.copy_(mean)
            self.raw_scale.copy_(raw)
        else:
            self.loc.copy_(torch.where(mask, mean, self.loc))
            self.raw_scale.copy_(torch.where(mask, raw, self.raw_scale))


@dataclass
class FullCovarianceSite(_StoredGaussian):
    """
    The full-covariance Gaussian :math:`q(u) = \\mathcal{N}(\\mu, \\Sigma)` of an
    :class:`~pyro.infer.autoguide.AutoMultivariateNormal` over its whole latent
    vector ``u`` (shape ``(D,)``), as stored in Pyro's param store: ``loc``, the
    raw (unconstrained) ``scale`` :math:`s` (the diagonal of :math:`C`, not the
    marginal standard deviations) and the raw unit lower-triangular
    ``scale_tril`` :math:`L`, with :math:`\\Sigma = C C^\\top`,
    :math:`C = \\mathrm{diag}(s) L` (see :mod:`pyro_ngvi.full_covariance`).
    """

    raw_scale_tril: torch.Tensor = None
    scale_tril_name: str = ""

    @property
    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """The param-store tensors the site is made of."""
        return self.loc, self.raw_scale, self.raw_scale_tril

    @property
    def _tril_transform(self) -> Transform:
        return transform_to(pyro.get_param_store()._constraints[self.scale_tril_name])

    @property
    def unit_tril(self) -> torch.Tensor:
        return self._tril_transform(self.raw_scale_tril.detach())

    @property
    def factor(self) -> torch.Tensor:
        """:math:`C`, the lower Cholesky factor of the covariance."""
        return full_covariance.covariance_factor(self.scale, self.unit_tril)

    @property
    def precision(self) -> torch.Tensor:
        """:math:`S = C^{-\\top} C^{-1}`."""
        return full_covariance.precision(self.factor)

    @torch.no_grad()
    def write(self, mean: torch.Tensor, factor: torch.Tensor) -> None:
        """Set :math:`\\mu` and :math:`C` in place (``scale = diag(C)``,
        ``scale_tril = C / scale[:, None]``)."""
        scale, unit_tril = full_covariance.split_factor(factor)
        self.loc.copy_(mean)
        self.raw_scale.copy_(self._scale_transform.inv(scale))
        self.raw_scale_tril.copy_(self._tril_transform.inv(unit_tril))

    @torch.no_grad()
    def write_precision(self, mean: torch.Tensor, precision: torch.Tensor) -> None:
        """Set :math:`\\mu` and the precision :math:`S` (through its Cholesky factor).

        :raises ValueError: if ``precision`` is not positive definite."""
        factor = full_covariance.precision_cholesky(precision.double())
        if factor is None:
            raise ValueError(f"the precision written into '{self.name}' is not positive definite")
        self.write(mean, factor.to(self.loc.dtype))


def scale_transform(constraint) -> Transform:
    """
    The bijection from a raw (unconstrained) scale parameter with ``constraint``
    to :math:`\\sigma`: :func:`~torch.distributions.biject_to`, with the softplus of
    AutoNormal and AutoDiagonalNormal computed faster (:class:`~pyro_ngvi.scales.FastSoftplus`).
    """
    transform = biject_to(constraint)
    return FastSoftplus() if type(transform) is SoftplusTransform else transform


# --------------------------------------------------------------------------- #
# Which tensors form a Gaussian site: read off the guide, never off names
# --------------------------------------------------------------------------- #


def calling_svi(attribute: str, value) -> Optional[object]:
    """
    The :class:`pyro.infer.SVI` (or any object with a ``guide``) whose ``step`` is
    running this call, found on the call stack as the ``self`` of a frame whose
    ``attribute`` is ``value`` (``"optim"`` and the optimizer, or
    ``"loss_and_grads"`` and the ELBO's bound method); ``None`` outside such a call.
    ``SVI.step`` hands an optimizer only tensors: this is how an optimizer learns
    which guide they belong to.
    """
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "guide"):
            try:
                if getattr(owner, attribute, None) == value:
                    return owner
            except RuntimeError:  # an attribute whose == is not a bool
                pass
        frame = frame.f_back
    return None


def _is_autonormal(part) -> bool:
    return isinstance(part, AutoNormal) and all(
        getattr(type(part), method) is getattr(AutoNormal, method)
        for method in ("forward", "_get_loc_and_scale", "_setup_prototype")
    )


def _is_autodiagonalnormal(part) -> bool:
    return isinstance(part, AutoDiagonalNormal) and all(
        getattr(type(part), method) is getattr(AutoDiagonalNormal, method)
        for method in ("get_posterior", "get_transform", "_setup_prototype", "_loc_scale")
    )


def _is_automultivariatenormal(part) -> bool:
    return isinstance(part, AutoMultivariateNormal) and all(
        getattr(type(part), method) is getattr(AutoMultivariateNormal, method)
        for method in ("get_posterior", "get_transform", "get_base_dist", "_setup_prototype",
                       "_loc_scale")
    )


def _is_kronecker_normal(part) -> bool:
    return isinstance(part, KroneckerNormal) and all(
        getattr(type(part), method) is getattr(KroneckerNormal, method)
        for method in ("forward", "get_layer", "_setup_prototype", "_split")
    )


def _kronecker_sites(part, store) -> List[KroneckerSite]:
    """One :class:`~pyro_ngvi.kronecker.KroneckerSite` per layer of a set-up
    :class:`~pyro_ngvi.kronecker.KroneckerNormal` (none before it is set up)."""
    if part.prototype_trace is None:
        return []
    prefix, sites = part._pyro_name, []
    for layer in part.layers:
        names = [f"{prefix}.{kind}.{layer.name}" for kind in ("locs", "row_scale_tril", "col_scale_tril")]
        if all(name in store._params for name in names):
            sites.append(KroneckerSite(layer.name, store._params[names[0]], store._params[names[1]], names[1],
                                       store._params[names[2]], names[2]))
    return sites


def guide_parts(guide) -> List[object]:
    """The leaf guides of ``guide`` (the parts of nested ``AutoGuideList`` s, or ``guide``)."""
    if isinstance(guide, AutoGuideList):
        return [leaf for part in guide for leaf in guide_parts(part)]
    return [guide]


def _unsupported(part, why: str) -> NotImplementedError:
    name = type(part).__name__ if isinstance(part, AutoGuide) else f"hand-written guide {part!r}"
    return NotImplementedError(
        f"NGVI cannot train {name}: {why}. NGVI supports {_SUPPORTED}; a Pyro "
        "optimizer such as pyro.optim.Adam trains any guide."
    )


def gaussian_sites(guide) -> List[Union[GaussianSite, FullCovarianceSite, KroneckerSite]]:
    """
    The Gaussian sites of ``guide``, found from its structure: each part that is
    an :class:`~pyro.infer.autoguide.AutoNormal` (one site per latent site of its
    prototype trace, the tensors Pyro registered for ``locs.<site>`` and
    ``scales.<site>`` under the part's own name) or an
    :class:`~pyro.infer.autoguide.AutoDiagonalNormal` (one site over the whole
    latent vector, its ``loc`` and ``scale``). ``AutoDelta`` parts are point
    estimates and have none.

    :raises NotImplementedError: for a guide (or ``AutoGuideList`` part) of any
        other kind, naming what is supported; for an ``AutoDelta`` that is not
        beside a Gaussian part (NGVI would have nothing to be Bayesian about).
    """
    store = pyro.get_param_store()
    sites: List[Union[GaussianSite, FullCovarianceSite, KroneckerSite]] = []
    parts = guide_parts(guide)
    for part in parts:
        if _is_autonormal(part):
            if part.prototype_trace is None:
                continue
            prefix = part._pyro_name
            for name, _ in part.prototype_trace.iter_stochastic_nodes():
                loc_name, scale_name = f"{prefix}.locs.{name}", f"{prefix}.scales.{name}"
                if loc_name in store._params and scale_name in store._params:
                    sites.append(GaussianSite(name, store._params[loc_name],
                                              store._params[scale_name], scale_name))
        elif _is_autodiagonalnormal(part):
            prefix = part._pyro_name
            if part.prototype_trace is None or f"{prefix}.scale" not in store._params:
                continue
            sites.append(GaussianSite(prefix, store._params[f"{prefix}.loc"],
                                      store._params[f"{prefix}.scale"], f"{prefix}.scale"))
        elif _is_kronecker_normal(part):
            sites.extend(_kronecker_sites(part, store))
        elif _is_automultivariatenormal(part):
            site = _full_covariance_site(part, store)
            if site is not None:
                sites.append(site)
        elif isinstance(part, AutoDelta):
            continue
        elif isinstance(part, AutoLowRankMultivariateNormal):
            raise NotImplementedError(_LOW_RANK_REFUSAL.format(name=type(part).__name__))
        elif isinstance(part, AutoGuide) and part.prototype_trace is not None and not any(
            True for _ in part.prototype_trace.iter_stochastic_nodes()
        ) and not isinstance(part, AutoCallable):
            continue  # an autoguide with no latent site has nothing to train
        else:
            raise _unsupported(part, "it is not a mean-field Gaussian guide NGVI can recognise "
                                     "from its structure")
    if not sites and any(isinstance(part, AutoDelta) and part.prototype_trace is not None
                         and any(True for _ in part.prototype_trace.iter_stochastic_nodes())
                         for part in parts):
        raise _unsupported(
            next(part for part in parts if isinstance(part, AutoDelta)),
            "an AutoDelta is a point estimate, with no Gaussian to take natural-gradient "
            "steps on (inside an AutoGuideList, beside an AutoNormal part, its values are "
            "trained by the point optimizer)",
        )
    return sites


#: Why a low-rank covariance is refused (README "Which guide to pick").
_LOW_RANK_REFUSAL = (
    "NGVI cannot train {name}: its covariance W W^T + diag(d) is not closed under the "
    "natural-gradient step, which moves the precision, S' = (1 - beta) S + beta (S0 + H): "
    "the inverse of diagonal-plus-low-rank plus a curvature is not diagonal-plus-low-rank, "
    "so writing it back would truncate it (SLANG keeps a low-rank-plus-diagonal precision "
    "instead, a different family) and the step would be inexact. Use AutoMultivariateNormal "
    "(full covariance, exact natural gradients; an O(D^3) step that pays up to a few hundred "
    "latent dimensions) or AutoNormal (mean-field, any size); a Pyro optimizer such as "
    "pyro.optim.Adam trains any guide."
)


def _full_covariance_site(part, store) -> Optional[FullCovarianceSite]:
    """The :class:`FullCovarianceSite` of an AutoMultivariateNormal part (``None``
    before it is set up), after checking it stores what pyro 1.9 stores."""
    prefix = part._pyro_name
    names = (f"{prefix}.loc", f"{prefix}.scale", f"{prefix}.scale_tril")
    if part.prototype_trace is None or not all(name in store._params for name in names):
        return None
    loc, raw_scale, raw_scale_tril = (store._params[name] for name in names)
    scale_constraint = store._constraints[names[1]]
    tril_constraint = store._constraints[names[2]]
    if (loc.dim() != 1 or raw_scale.shape != loc.shape
            or raw_scale_tril.shape != loc.shape + loc.shape
            or not isinstance(tril_constraint, type(constraints.unit_lower_cholesky))
            or scale_constraint.event_dim != 0):
        raise _unsupported(part, "its parameters are not the loc (D,), positive scale (D,) and "
                                 "unit lower-triangular scale_tril (D, D) of pyro 1.9")
    return FullCovarianceSite(prefix, loc, raw_scale, names[1], raw_scale_tril, names[2])


def split_params(guide, params) -> Tuple[List[GaussianSite], List[torch.Tensor]]:
    """
    Split the tensors ``SVI.step`` hands an optimizer into the Gaussian sites of
    ``guide`` (:func:`gaussian_sites`) whose ``loc`` is among them, and
    everything else (model parameters, ``AutoDelta`` values), which a point
    optimizer trains. A site's scale need not be among ``params``: an ELBO that
    hands :math:`\\sigma` over in :class:`SiteCurvature` need not read it through
    ``pyro.param`` (:class:`~pyro_ngvi.BayesianNet`'s fast path does not).
    """
    params = list(params)
    present = {id(p) for p in params}
    sites = [site for site in gaussian_sites(guide) if id(site.loc) in present]
    used = {id(t) for site in sites for t in site.tensors}
    return sites, [p for p in params if id(p) not in used]
