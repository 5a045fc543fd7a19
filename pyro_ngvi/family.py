"""
The exponential-family view of a Gaussian guide, and which guide sites are Gaussians.

A mean-field Gaussian site stores, in the unconstrained coordinates ``u`` of the model's
latent sites,

.. math:: q(u) = \\mathcal{N}(u; \\mu, \\lambda^{-1}),
          \\qquad \\mu = \\text{loc}, \\quad \\lambda = \\text{scale}^{-2},

with natural parameters :math:`\\eta_1 = \\lambda\\mu`, :math:`\\eta_2 = -\\lambda/2`
(:class:`GaussianSite`). :class:`~pyro.infer.autoguide.AutoMultivariateNormal` stores a
full-covariance Gaussian over the whole latent vector (:class:`FullCovarianceSite`; its
algebra lives in :mod:`pyro_ngvi.full_covariance`), :class:`~pyro_ngvi.KroneckerNormal`
Kronecker factors per layer.

**Which sites are Gaussians** (:func:`guide_view`, :func:`split_params`). Autoguides
whose storage is known (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal,
KroneckerNormal, alone or as parts of an ``AutoGuideList``) are read from their
structure, with no extra run; anything else (hand-written guides, ``AutoCallable`` parts,
autoguides inside poutine handlers, partials, subclasses) is read off the guide's trace
(:mod:`pyro_ngvi.guide_trace`): a ``Normal`` whose loc is a ``pyro.param`` and whose
scale is a positive ``pyro.param``. Never off names a user chooses. Sites that are not
Gaussians are trained by the point optimizer, and :func:`split_params` warns once per
guide structure (:class:`NotGaussianWarning`) naming them and why.

The hand-over of curvature from an ELBO to the optimizer lives in
:mod:`pyro_ngvi.handover` (its names are re-exported here).
"""

import sys
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.distributions import transform_to
from torch.distributions.transforms import Transform

import pyro
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoMultivariateNormal, AutoNormal

from . import full_covariance
from .guide_trace import (NotGaussian, consistent_reading, first_consistent, full_covariance_prefixes, hidden_sites,
                          read_runs, read_trace, refuse_sampled_tmc)
from .handover import (  # noqa: F401 (re-exported: the ELBOs and NGVI import them from here)
    PriorParam,
    SiteCurvature,
    attach_curvature,
    begin_handover,
    end_handover,
    live_handover,
    on_rejected,
    pop_curvature,
)
from .kronecker import KroneckerNormal, KroneckerSite
from .low_rank_guide import LowRankPrecisionNormal, LowRankSite
from .monitor import NGVIWarning
from .scales import SCALE_MAPS, known_scale, scale_transform

#: The curvature of the negative log-likelihood per example assumed before the data say
#: otherwise, in the units of a likelihood whose curvature in its output is of order one
#: (a softmax's is at most 1/2, a Bernoulli's 1/4, a standardised Gaussian's 1; ivon-opt's
#: ``hess_init``): a minibatch-trained guide starts at precision N times it, and NGVI's mean
#: step is damped by as much (see NGVI and BayesianNet.guide).
CURVATURE_PER_EXAMPLE = 1.0
#: How far up the call stack :func:`calling_svi` looks for ``SVI.step``.
_STACK_DEPTH = 6
#: How far up the call stack :func:`calling_step` looks for ``SVI.step``.
_ARGS_DEPTH = 12


class NotGaussianWarning(NGVIWarning):
    """Warned once per guide structure when some of a guide's sites are not Gaussians NGVI
    can take natural-gradient steps on: their params get the ordinary ELBO gradient from
    NGVI's point optimizer (the step Adam would take). The message names each site and why."""


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

    :param float weight: the ``poutine.scale`` factor of the guide site beyond its
        plates' subsampling (1 for a plain guide; see
        :class:`~pyro_ngvi.param_views.GaussianBlock`).
    :param tuple blocks: the sizes of the model's latents the flat site is made of, in order
        (an ``AutoDiagonalNormal``'s), each pooling its own noise for the adaptive steps
        (default: empty, the site is one).
    :param str scale_map: ``"exp"`` or ``"softplus"`` where the guide computes :math:`\\sigma`
        from an unconstrained raw scale itself (``torch.exp(log_scale)``); ``None``: the bijection
        of the raw scale's constraint.
    """

    weight: float = 1.0
    blocks: Tuple[int, ...] = ()
    scale_map: Optional[str] = None

    @property
    def _scale_transform(self) -> Transform:
        """:math:`\\sigma` of the raw scale: ``scale_map`` (``"exp"`` or ``"softplus"``) where the guide
        computes it from an unconstrained param, else the bijection of the param's constraint."""
        return super()._scale_transform if self.scale_map is None else SCALE_MAPS[self.scale_map]()

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


def step_loss(svi) -> Optional[float]:
    """The loss ``SVI.step`` of ``svi`` computed before it called the optimizer (its local
    ``loss``, a Pyro ELBO's estimate of the negative ELBO), found on the call stack as
    :func:`calling_svi` finds ``svi``; ``None`` when there is none (another caller)."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH + 2):
        if frame is None:
            return None
        code = frame.f_code  # (a frame's locals are read only where a local "loss" may be: cheap)
        if "loss" in code.co_varnames and "self" in code.co_varnames and frame.f_locals.get("self") is svi:
            loss = frame.f_locals.get("loss")
            return loss if isinstance(loss, (float, int)) or (torch.is_tensor(loss) and loss.numel() == 1) else None
        frame = frame.f_back
    return None


class StepCall(NamedTuple):
    """What the ``SVI.step`` running a call was given: its model and the step's arguments (and
    its ELBO, where it is one: SVI keeps its bound ``loss_and_grads``)."""

    model: object
    args: tuple
    kwargs: dict
    loss: object = None


def calling_step(guide) -> Optional[StepCall]:
    """
    The model and ``(args, kwargs)`` of the ``SVI.step`` running this call for ``guide``:
    read off the nearest frame on the stack whose ``self`` has ``guide`` as its guide and
    which holds ``args`` and ``kwargs`` (``SVI.step(self, *args, **kwargs)``); ``None``
    outside such a call. What the guide (and the model) are run on to read the guide's trace.
    """
    frame = sys._getframe(1)
    for _ in range(_ARGS_DEPTH):
        if frame is None:
            return None
        local = frame.f_locals
        owner = local.get("self")
        if (owner is not None and getattr(owner, "guide", None) is guide and hasattr(owner, "model")  # (not NGVI's)
                and isinstance(local.get("args"), tuple) and isinstance(local.get("kwargs"), dict)):
            return StepCall(getattr(owner, "model", None), local["args"], local["kwargs"],
                            getattr(getattr(owner, "loss_and_grads", None), "__self__", None))
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


Site = Union[GaussianSite, FullCovarianceSite, KroneckerSite]


class GuideView(NamedTuple):
    """What NGVI makes of a guide: the Gaussian ``sites`` it takes natural-gradient steps
    on, and the ``others`` (:class:`~pyro_ngvi.guide_trace.NotGaussian`) whose params its
    point optimizer trains."""

    sites: List[Site]
    others: List[NotGaussian]
    read: Optional[frozenset] = None  # the params its run and the model's replay read (None: not known)


def _structural_sites(guide, store) -> Tuple[List[Site], bool]:
    """The sites of the parts of ``guide`` whose storage is known (exact AutoNormal,
    AutoDiagonalNormal, AutoMultivariateNormal, KroneckerNormal, LowRankPrecisionNormal), and
    whether any other part is left for the trace to read."""
    sites: List[Site] = []
    rest = False
    for part in guide_parts(guide):
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
            shapes = part._unconstrained_shapes  # (the latent vector's layout, in this order)
            blocks = tuple(shapes[name].numel() for name, _ in part.prototype_trace.iter_stochastic_nodes())
            sites.append(GaussianSite(prefix, store._params[f"{prefix}.loc"],
                                      store._params[f"{prefix}.scale"], f"{prefix}.scale", blocks=blocks))
        elif _is_kronecker_normal(part):
            sites.extend(_kronecker_sites(part, store))
        elif _is_automultivariatenormal(part):
            site = _full_covariance_site(part, store)
            if site is not None:
                sites.append(site)
        elif type(part) is LowRankPrecisionNormal:
            if part.prototype_trace is not None and f"{part._pyro_name}.loc" in store._params:
                sites.append(LowRankSite.of(part))
        else:
            rest = True
    return sites, rest


def guide_view(guide, args: Sequence = (), kwargs: Optional[dict] = None, model=None, elbo=None) -> GuideView:
    """
    The Gaussian sites of ``guide`` and its other parts. Parts whose storage is known are
    read from their structure; if any other part is left (or ``guide`` is not an
    autoguide), ``guide`` is run once on ``args``/``kwargs`` under
    :func:`~pyro_ngvi.guide_trace.trace_guide` (random streams untouched) and the rest is
    read off the trace (:func:`~pyro_ngvi.guide_trace.read_trace`); with ``model`` given,
    the model is replayed once against that trace too, and a Gaussian built from a param
    the model also reads is not taken (:func:`~pyro_ngvi.guide_trace.model_params`). Where
    those runs fail (a guide or model that asserts the shapes its ELBO's enumeration or
    vectorised particles give it), both are run as ``elbo`` runs them
    (:func:`~pyro_ngvi.guide_trace.elbo_traces`).

    :param guide: what ``SVI`` was handed as the guide.
    :param args: the arguments of the step (what the guide is run on).
    :param kwargs: its keyword arguments.
    :param model: the model (default: None, not checked).
    :param elbo: the step's loss (default: None).
    """
    store = pyro.get_param_store()
    kwargs = kwargs or {}
    sites, rest = _structural_sites(guide, store)
    if not rest:
        return GuideView(sites, [])
    trace, model_reads = read_runs(guide, args, kwargs, model, elbo)
    refuse_sampled_tmc(trace, elbo)
    sites += [s for s in (_full_covariance_site(None, store, p) for p in full_covariance_prefixes(trace)) if s]
    claimed = [t for site in sites for t in site.tensors]
    blocks, others = read_trace(trace, claimed, store, model_reads)
    for block in blocks:
        name = block.site
        if name.endswith("_unconstrained") and name[: -len("_unconstrained")] in trace.nodes:
            name = name[: -len("_unconstrained")]  # AutoNormal's: the site it is the Gaussian of
        sites.append(GaussianSite(name, store._params[block.loc], store._params[block.scale], block.scale,
                                  weight=block.weight, scale_map=block.bijection if block.computed else None))
    return GuideView(sites, others, None if model is None else frozenset(model_reads).union(  # (None: the model's
        name for name, node in trace.nodes.items() if node["type"] == "param"))  # params are not known)


def gaussian_sites(guide, *args, **kwargs) -> List[Site]:
    """The Gaussian sites of ``guide`` (:func:`guide_view`; ``args``/``kwargs`` are what
    the guide is run on, needed only for guides read off their trace)."""
    return guide_view(guide, args, kwargs).sites


def _full_covariance_site(part, store, prefix: Optional[str] = None) -> Optional[FullCovarianceSite]:
    """The :class:`FullCovarianceSite` of an AutoMultivariateNormal ``part`` or, with ``part`` None, of
    the one of ``prefix`` seen in a trace (``None`` before it is set up), checked to store what pyro 1.9 stores."""
    prefix = part._pyro_name if part is not None else prefix
    names = (f"{prefix}.loc", f"{prefix}.scale", f"{prefix}.scale_tril")
    if (part is not None and part.prototype_trace is None) or not all(name in store._params for name in names):
        return None
    loc, raw_scale, raw_scale_tril = (store._params[name] for name in names)
    scale_constraint = store._constraints[names[1]]
    tril_constraint = store._constraints[names[2]]
    if (loc.dim() != 1 or raw_scale.shape != loc.shape
            or raw_scale_tril.shape != loc.shape + loc.shape
            or not isinstance(tril_constraint, type(constraints.unit_lower_cholesky))
            or scale_constraint.event_dim != 0):
        raise NotImplementedError(
            f"NGVI cannot train {type(part).__name__ if part is not None else prefix}: its parameters are not "
            "the loc (D,), positive scale (D,) and unit lower-triangular scale_tril (D, D) of pyro 1.9. "
            "A Pyro optimizer such as pyro.optim.Adam trains any guide.")
    return FullCovarianceSite(prefix, loc, raw_scale, names[1], raw_scale_tril, names[2])


# --------------------------------------------------------------------------- #
# The split SVI's tensors: Gaussian sites, and the rest for the point optimizer
# --------------------------------------------------------------------------- #

#: Guide structures already warned about, per guide (see :func:`warn_not_gaussian`).
_warned_guides: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_warned_ids: set = set()


def _first_time(guide, signature, warned: Optional[set]) -> bool:
    """Whether a warning of this ``signature`` (a guide's structure) is new: not in ``warned``
    when given (an optimizer's own record), else in a record kept per guide; recorded."""
    if warned is None:
        try:
            warned = _warned_guides.setdefault(guide, set())
        except TypeError:  # not weakly referenceable
            warned, signature = _warned_ids, (id(guide), signature)
    if signature in warned:
        return False
    warned.add(signature)
    return True


def warn_not_gaussian(guide, others: List[NotGaussian], warned: Optional[set] = None) -> None:
    """
    One :class:`NotGaussianWarning` naming the ``others`` of ``guide`` and why, unless
    this structure (the same sites, reasons and params) was warned about already: in
    ``warned`` when given (an optimizer's own record), else in a record kept per guide.
    """
    if not others:
        return
    if not _first_time(guide, frozenset(others), warned):
        return
    parts = "; ".join(f"'{part.site}' ({part.reason}; params {', '.join(repr(p) for p in part.params)})"
                      for part in others)
    warnings.warn(
        f"NGVI trains these guide sites with its point optimizer (the ordinary ELBO gradient, the step "
        f"Adam would take), not with natural-gradient steps: {parts}. Natural-gradient steps need a "
        "Normal (possibly .to_event()) whose loc is a pyro.param and whose scale is a positive "
        "pyro.param, of the site's shape. By default the point optimizer is Adam, for these params "
        "with a step size decaying from 0.05 as 0.05 / (1 + t / 50); NGVI(point_optim_args={'lr': ...}) "
        "sets one for every param. Filter pyro_ngvi.NotGaussianWarning to silence this.",
        NotGaussianWarning,
        stacklevel=4,
    )


def warn_hidden(guide, sites: List[str], warned: Optional[set] = None) -> None:
    """One :class:`~pyro_ngvi.NGVIWarning` naming the guide ``sites`` none of whose params
    ``SVI`` handed the optimizer (a handler hides their ``pyro.param`` statements, e.g.
    ``poutine.block(guide, expose_types=["sample"])``): nothing trains them. Once per structure,
    as :func:`warn_not_gaussian`."""
    if not sites:
        return
    if not _first_time(guide, ("hidden", frozenset(sites)), warned):
        return
    warnings.warn(
        f"SVI handed NGVI none of the params of the guide sites {', '.join(repr(s) for s in sites)}: a "
        "handler hides their pyro.param statements from SVI (e.g. poutine.block(guide, "
        "expose_types=['sample']) or hide_types=['param']), so no optimizer trains them. Expose the "
        "guide's params to train them.",
        NGVIWarning,
        stacklevel=4,
    )


def split_params(guide, params, args: Optional[Sequence] = None, kwargs: Optional[dict] = None,
                 warned: Optional[set] = None,
                 model=None) -> Tuple[List[Site], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """
    Split the tensors ``SVI.step`` hands an optimizer into the Gaussian sites of
    ``guide`` (:func:`guide_view`) whose ``loc`` is among them, and everything else
    (model parameters, params of guide parts that are not Gaussians), which a point
    optimizer trains, and of those the params of guide parts that are not Gaussians, and
    of those the params of score-function sites (``NotGaussian.score_function``); warns
    (:func:`warn_not_gaussian`) about those parts. A site's scale need not be among ``params``: an ELBO that hands
    :math:`\\sigma` over in :class:`~pyro_ngvi.handover.SiteCurvature` need not read it through ``pyro.param``
    (:class:`~pyro_ngvi.BayesianNet`'s fast path does not).

    :param guide: the guide.
    :param params: the tensors ``SVI.step`` hands over.
    :param args: the step's arguments, to run a guide read off its trace on (default:
        those of the ``SVI.step`` on the call stack whose guide is ``guide``, see
        :func:`calling_step`, else none).
    :param kwargs: the step's keyword arguments (default: as ``args``).
    :param warned: the caller's record of structures warned about (default: one per guide).
    :param model: the model, replayed to find guide params it reads too (default: that of
        the ``SVI.step`` on the call stack, if found with ``args``).
    """
    elbo = None
    if args is None:
        found = calling_step(guide)
        if found is not None:
            model, args, kwargs = model if model is not None else found.model, found.args, found.kwargs
            elbo = found.loss
        else:
            args = ()
    params = list(params)
    present, store = {id(p) for p in params}, pyro.get_param_store()._params
    view = first_consistent(lambda: guide_view(guide, args, kwargs, model, elbo),  # (a branch the step took)
                            lambda view: consistent_reading(view, present, store))
    handed = [part for part in view.others if any(id(store.get(name)) in present for name in part.params)]
    hidden = hidden_sites(view, present, store)
    # (of a part, only the params SVI hands over are trained: one a handler hides is not)
    handed = [replace(part, params=tuple(name for name in part.params if id(store.get(name)) in present))
              for part in handed]
    warn_not_gaussian(guide, handed, warned)
    warn_hidden(guide, hidden, warned)
    sites = [site for site in view.sites if id(site.loc) in present]
    used = {id(t) for site in sites for t in site.tensors}
    others = [p for p in params if id(p) not in used]
    in_parts = {id(store[name]) for part in view.others for name in part.params if name in store}
    score = {id(store[name]) for part in view.others if part.score_function for name in part.params if name in store}
    parts = [p for p in others if id(p) in in_parts]
    return sites, others, parts, [p for p in parts if id(p) in score]
