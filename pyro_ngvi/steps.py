"""
One step per kind of site, as a chain that runs each layer once, downward:
statistics :math:`\\to` variance reduction (:mod:`~pyro_ngvi.variance`) :math:`\\to` step
sizes (:mod:`~pyro_ngvi.policies`) :math:`\\to` the Bayesian learning rule
(:mod:`~pyro_ngvi.update`) :math:`\\to` safeguards (:mod:`~pyro_ngvi.safeguards`)
:math:`\\to` the guide's tensors.

:func:`mean_field_group` runs the chain for a :class:`~pyro_ngvi.groups.Group` of
mean-field sites as flat vectors (a large site in spans of :data:`SPAN` elements);
:func:`dense_site` for a full-covariance or Kronecker-factored site (computed, not
written, so that a step whose new precision is not positive definite can be skipped whole).
"""

import math
from typing import Dict, List, NamedTuple, Optional

import torch
from torch._utils import _unflatten_dense_tensors

from .elementwise import Branches, Inputs, Numbers, mean_field_pass
from .family import FullCovarianceSite, SiteCurvature
from .groups import Group, flat as _flat
from .kronecker import KroneckerSite
from .low_rank import low_rank_step, marginal_variance, solve
from .low_rank_guide import LowRankSite
from .policies import NoiseState, Settings, dense_count, dense_rates, first_count, noise_constants
from .scales import known_scale, remember_scale
from .update import full_covariance
from .update import fused
from .update.kronecker import kronecker_step
from .update.mean_field import coupled_mean_step

#: A large site's update runs in spans of this many elements (see :func:`mean_field_group`; 2^18
#: measured 5-6 % faster than 2^16 and than whole sites at 0.5 and 3.8 million weights, 2-core CPU).
SPAN = 1 << 18
#: With ``NGVI(compile=True)``, groups of at least this many elements run compiled (:func:`compiled`;
#: 2^12 measured 8 % faster per step than 2^14 on a 784-100-100-10 MLP, whose small sites make one group).
COMPILE_MIN = 1 << 12
#: A full-covariance site's adaptive steps change its precision by at most this factor in any
#: eigen-direction (4, the mean-field value, lets the upward bias of Lin et al.'s correction on
#: noise-dominated directions inflate the precision at D = 100, K = 16: measured).
DENSE_RATIO = 1.25


class Options(NamedTuple):
    """NGVI's switches, as the chain reads them."""

    control_variate: bool
    warm_start: bool
    max_step: Optional[float]
    adaptive: bool  # the adaptive steps for sampled statistics (averaging on, no user schedule)


class GuardedStep:
    """A Newton step under the safeguard (:class:`~pyro_ngvi.safeguards.NewtonGuard`): its
    damping ``factor`` and the decrease of :math:`F` the quadratic model predicts, summed."""

    __slots__ = ("factor", "predicted")

    def __init__(self, factor: float):
        self.factor, self.predicted = factor, 0.0


class Context(NamedTuple):
    """What the chain of one step reads and updates beside the sites' own state."""

    options: Options
    step: int  # steps taken so far (the watches' clock)
    signs: Dict  # id(group) -> (group, g > 0 at its last sampled step)
    spread_watch: object  # pyro_ngvi.monitor.SpreadWatch
    guarded: Optional[GuardedStep]
    compiled: bool = False  # the element-wise pass compiled (pyro_ngvi.update.fused)
    ok: Optional[torch.Tensor] = None  # a deferred check (pyro_ngvi.checks): write only if it holds


def adaptive_for(stats: SiteCurvature, options: Options) -> bool:
    """Whether statistics like ``stats`` take the adaptive steps: sampled, not a
    BayesianNet's minibatch statistics (``num_data``: their noise is the data's as much
    as the draws', which the adaptive steps would average away; the recipe's steps)."""
    return stats.sampled and options.adaptive and stats.num_data is None


@torch.no_grad()
def mean_field_group(ctx: Context, group: Group, stats: List[SiteCurvature], grad: torch.Tensor,
                     curvature: torch.Tensor, settings: Settings, tau: float, states: list):
    """
    :func:`span_step` on the whole group; a large site (beyond :data:`SPAN` elements,
    alone in its group, no mask, not the adaptive steps, whose noise is pooled over the
    site first; not when compiled or masked) in spans of :data:`SPAN` elements, one after
    the other: the same element-wise update, with temporaries of a span's size that stay in
    the last-level cache and are reused by the allocator (on the CPU, whole-vector temporaries
    of a large site go back to the system and page-fault on every step). Returns what
    :func:`span_step` returns.
    """
    first = stats[0]
    size = grad.numel()
    if (len(group.sites) > 1 or first.mask is not None or size <= SPAN or adaptive_for(first, ctx.options)
            or compiled(ctx, group, size) or ctx.ok is not None):
        # (a compiled pass has no temporaries, a masked one writes at its end: the whole site at once)
        result = span_step(ctx, group, stats, grad, curvature, settings, tau, states)
    else:
        run = Spans(ctx, group, states[0], first.sampled, settings.momentum)
        for start in range(0, size, SPAN):
            run.slice = slice(start, min(start + SPAN, size))
            span_step(ctx, group, stats, grad, curvature, settings, tau, states, run)
        result = run.finish(ctx, group, states[0], first.prior_precision is not None)
    for state in states:
        state.started = True
    return result


def span_step(ctx: Context, group: Group, stats: List[SiteCurvature], grad: torch.Tensor,
              curvature: torch.Tensor, settings: Settings, tau: float, states: list, run=None):
    """
    The chain for the sites of ``group`` at once, as one flat vector; ``grad`` and
    ``curvature`` are the sites' ``g`` and ``h`` so flattened (this step's: written over).
    The sites share the kind of their statistics (:func:`~pyro_ngvi.groups.statistics_kind`).
    Gathers the group's tensors and decides which parts apply from the sites' state
    (:class:`~pyro_ngvi.elementwise.Branches`), runs the element-wise pass
    (:func:`~pyro_ngvi.elementwise.mean_field_pass`, eager or compiled,
    :mod:`~pyro_ngvi.update.fused`) and keeps what it returns.

    :returns: 0-d bool tensors (no device sync): whether the precision was clamped,
        and, for sampled curvature (else ``None``), whether most elements' gradient
        exceeds :data:`~pyro_ngvi.safeguards.FAR` standard deviations with the sign it
        had at the group's last step; the new :math:`\\sigma` as a flat vector (``None``
        for a masked site); and the flag of the watch on growing means
        (:mod:`pyro_ngvi.monitor`; ``None`` without a prior). In a ``run`` of spans:
        ``None`` (the run gathers them).
    """
    options = ctx.options
    first, sites = stats[0], group.sites
    lr, beta, rho = settings.lr, settings.beta, settings.momentum

    def cut(flat):  # the span of a flat vector (all of it outside a run)
        return flat if run is None else flat[run.slice]

    # the sigma the ELBO read this step, else the one this optimizer wrote last (in a run, as it was
    # at the run's start: the spans before this one have written the raw scale since)
    scales = [(known_scale(site.raw_scale) if run is None else run.old_scale) if s.scale is None else s.scale
              for s, site in zip(stats, sites)]
    known = all(scale is not None for scale in scales)
    mask = None if first.mask is None else first.mask.reshape(-1)
    prior = first.prior_precision is not None
    adaptive = adaptive_for(first, options)
    grad, curvature = cut(grad), cut(curvature)
    one = len(sites) == 1  # (its flat tensors are views)
    fuse = compiled(ctx, group, grad.numel())
    inputs = dict(
        mean=cut(group.locs[0] if one else _flat([site.loc for site in sites])),
        raw_scale=(cut(group.raw_scales[0]) if one else None if known and ctx.ok is None
                   else _flat([site.raw_scale for site in sites])),
        grad=grad, curvature=curvature, scale=cut(_flat(scales)) if known else None, mask=mask,
        prior_precision=cut(group.flat_of("prior_precision", [s.prior_precision for s in stats])) if prior else None,
        prior_loc=cut(group.flat_of("prior_loc", [s.prior_loc for s in stats])) if prior else None,
        floor=None if first.min_precision is None else cut(group.flat_of("min_precision",
                                                                        [s.min_precision for s in stats])),
    )
    if run is not None:  # a span: straight into the site's tensors and remembered scale
        inputs.update(out_mean=inputs["mean"], out_raw_scale=inputs["raw_scale"], out_scale=run.scale[run.slice])
    if adaptive:
        inputs.update(_adaptive_inputs(group, states, beta, rho, options.warm_start))
    control = options.control_variate and first.eps_mean is not None and first.num_data is None
    if control:
        inputs.update(eps_mean=cut(_flat([s.eps_mean for s in stats])), eps_sq_mean=cut(_flat([s.eps_sq_mean
                                                                                               for s in stats])))
        if not adaptive:
            inputs["known"] = (torch.full_like(grad, states[0].started, dtype=torch.bool) if run is not None
                               else group.started(states, True))
            if fuse:  # (a 0 / 1 mask in the control variate; compiled loops move bools slowly)
                inputs["known"] = inputs["known"].to(grad.dtype)
    momentum = _momentum_inputs(group, states, grad, rho, run, inputs)
    if adaptive:
        rates = "adaptive"
    elif options.warm_start and not all(state.started for state in states):
        rates = "warm"
        inputs["fresh"] = (torch.full_like(grad, True, dtype=torch.bool) if run is not None
                           else group.started(states, False))
    else:
        rates = "constant"
    trust = first.sampled and options.max_step is not None
    guarded = ctx.guarded is not None and not adaptive and not trust
    last = None
    if ctx.ok is not None:
        inputs["ok"] = ctx.ok
    if first.sampled:  # the stall test's signs of the group's last step
        last = run.last_signs if run is not None else _last_signs(ctx, group)
        if last is not None:
            inputs["last_signs"] = cut(last)
    branches = Branches(
        tau=tau != 1, control_variate=control, prior=prior, mask=mask is not None, momentum=momentum, rates=rates,
        correct=not (first.nonnegative and prior), trust=trust, floor=first.min_precision is not None,
        damping=bool(settings.damping), guarded=guarded,
        guard_clip=guarded and ctx.guarded.factor > 1 and options.max_step is not None,
        signs=first.sampled, far=last is not None, spread=prior and mask is None,
        known_scale=known, fast_scale=hasattr(group.transform, "inverse_and_log"), branch_free=fuse,
        # a floor >= 1 keeps every new sigma <= 1 (compiled: the raw scale's series alone)
        at_most_one=fuse and first.min_precision is not None
        and group.least("min_precision", [s.min_precision for s in stats]) >= 1.0,
        in_place=fuse and one and mask is None, masked=ctx.ok is not None,
    )
    numbers = Numbers(lr, beta, rho, settings.damping, tau, options.max_step,
                      ctx.guarded.factor if guarded else 1.0, first_count(beta, options.warm_start))
    out = fused.run(mean_field_pass, branches, fuse, Inputs(**inputs), numbers, None if fuse else group.transform)
    return _keep(ctx, group, states, mask, out, run, rho)


def compiled(ctx: Context, group: Group, size: int) -> bool:
    """Whether the group's pass runs compiled: asked for (``NGVI(compile=True)``), a scale of
    AutoNormal's softplus, and at least :data:`COMPILE_MIN` elements (below, a compiled call's own
    cost, its guards, exceeds the kernels it saves)."""
    return ctx.compiled and size >= COMPILE_MIN and hasattr(group.transform, "inverse_and_log")


def _adaptive_inputs(group: Group, states, beta: float, rho: float, warm_start: bool) -> dict:
    """The adaptive steps' state as flat vectors, and the sites' pooled noise stacked."""
    for state in states:
        if state.noise is None:
            state.steps = torch.zeros((), dtype=group.locs[0].dtype, device=group.locs[0].device)
            state.noise = torch.full((2, 2), math.inf, dtype=group.locs[0].dtype, device=group.locs[0].device)
    like = group.locs[0]
    constants = group.cached((like.dtype, like.device), lambda: noise_constants(group.sizes, like.dtype, like.device))
    noise = NoiseState(torch.stack([state.steps for state in states]),
                       torch.stack([state.noise for state in states], dim=1), **constants)
    return dict(count=group.buffer(states, "count", first_count(beta, warm_start)),
                drift=group.buffer(states, "momentum" if rho else "drift", 0.0),
                hdrift=group.buffer(states, "hdrift", 0.0), fresh=group.fresh(states, "hdrift"), noise=noise)


def _momentum_inputs(group: Group, states, grad, rho: float, run, inputs: dict) -> str:
    """The old momentum average (:func:`~pyro_ngvi.update.mean_field.momentum`) as a flat
    vector in ``inputs``, and which branch of it applies."""
    if rho == 0:
        return "none"
    if run is not None:  # one site: its buffer's span, updated in place
        inputs["momentum"] = run.momentum[run.slice]
        return "span_first" if run.fresh_momentum else "span"
    if all(state.momentum is not None for state in states):
        inputs["momentum"] = _flat([state.momentum for state in states])
        return "average"
    # some site's first step: its buffer starts at g
    pieces = grad.split(group.sizes)
    inputs["momentum"] = _flat([piece if state.momentum is None else state.momentum.reshape(-1)
                                for state, piece in zip(states, pieces)])
    inputs["started"] = _flat([torch.full_like(piece, state.momentum is not None, dtype=torch.bool)
                               for state, piece in zip(states, pieces)])
    return "mixed"


def _last_signs(ctx: Context, group: Group) -> Optional[torch.Tensor]:
    """The signs of the group's gradient at its last sampled step (``None``: none yet)."""
    last = ctx.signs.get(id(group))
    return last[1] if last is not None and last[0] is group else None


def _keep(ctx: Context, group: Group, states, mask, out, run, rho: float):
    """Keep what the pass returned: the new mean and raw scale in the guide (only the ``mask`` rows),
    :math:`\\sigma'` remembered, the momentum and adaptive state, the stall test's signs and the flags."""
    steps = out.adaptive
    if steps is not None:
        group.keep(states, "count", steps.count)
        group.keep(states, "hdrift", steps.hdrift)
        if steps.drift is not None:
            group.keep(states, "drift", steps.drift)
        for j, state in enumerate(states):
            state.steps, state.noise = steps.steps[j], steps.noise[:, j]
    if run is not None:  # one site, no mask: the span is written
        run.clamped.append(out.clamped)
        if out.spread is not None:
            run.spread = run.spread + out.spread
        if out.signs is not None:
            if out.far is not None:
                run.far = run.far + out.far
            run.signs[run.slice] = out.signs
        return None
    if rho != 0:
        for state, piece in zip(states, _unflatten_dense_tensors(out.momentum, [site.loc for site in group.sites])):
            state.momentum = piece  # shaped like the site's loc
    if ctx.guarded is not None and out.predicted is not None:  # the decrease of F the quadratic model predicts
        numerator_step, curvature_step = out.predicted
        ctx.guarded.predicted = ctx.guarded.predicted + numerator_step - 0.5 * curvature_step
    far = None
    if out.signs is not None:
        ctx.signs[id(group)] = (group, out.signs)
        if out.far is None:
            far = torch.zeros((), dtype=torch.bool, device=out.signs.device)
        elif mask is None:
            far = out.far > out.signs.numel() // 2
        else:
            far = out.far * 2 > torch.count_nonzero(mask)
    spreading = None
    if out.spread is not None:
        spreading = ctx.spread_watch.flag(group, out.spread / out.mean.numel(), ctx.step)
    if mask is None:
        if out.mean is not group.locs[0]:
            torch._foreach_copy_(group.locs, out.mean.split_with_sizes(group.sizes))
        if out.raw_scale is not group.raw_scales[0]:
            torch._foreach_copy_(group.raw_scales, out.raw_scale.split_with_sizes(group.sizes))
        new_scale = out.scale
        for site, piece in zip(group.sites, new_scale.split_with_sizes(group.sizes)):
            remember_scale(site.raw_scale, piece.view_as(site.loc))
    else:  # a masked site is a group of its own
        (loc,), (raw_scale,) = group.locs, group.raw_scales
        loc.copy_(torch.where(mask, out.mean, loc))
        raw_scale.copy_(torch.where(mask, out.raw_scale, raw_scale))
        new_scale = None  # untouched rows keep their old scale
    return out.clamped, far, new_scale, spreading


class Spans:
    """
    What a large site's update accumulates span by span (:func:`mean_field_group`):
    the current ``slice``, the new :math:`\\sigma` (a whole vector, written span by
    span: the scale remembered for the next reader), the momentum buffer (the site's
    own, updated in place, or a new one on its first step), the signs of :math:`g`
    (sampled statistics) and the counts of the stall test, the clamp flags and the
    spread of the watch on growing means.
    """

    def __init__(self, ctx: Context, group: Group, state, sampled: bool, rho: float):
        like, (site,) = group.locs[0], group.sites
        self.slice = slice(0, 0)
        # the new sigma over the one remembered (ours: each span reads its old values first)
        remembered = known_scale(site.raw_scale)
        self.scale = remembered.view(-1) if remembered is not None and remembered.is_contiguous() else \
            torch.empty_like(like)
        # the old sigma, read span by span before the span's new one is written over it (None: unknown)
        self.old_scale = remembered
        self.fresh_momentum = rho != 0 and state.momentum is None
        self.momentum = None
        if rho != 0:
            self.momentum = torch.empty_like(like) if self.fresh_momentum else state.momentum.view(-1)
        self.clamped: List[torch.Tensor] = []
        self.spread = torch.zeros((), dtype=like.dtype, device=like.device)  # sum lambda_0 (mu - m_0)^2
        self.signs = self.last_signs = None
        self.far = 0
        if sampled:
            last = ctx.signs.get(id(group))
            self.last_signs = last[1] if last is not None and last[0] is group else None
            self.signs = torch.empty_like(like, dtype=torch.bool)

    def finish(self, ctx: Context, group: Group, state, prior: bool):
        """Keep the site's buffers and scale; the flags and the new scale, as :func:`span_step`
        returns (the watch on growing means fed the spread the spans summed, given a ``prior``)."""
        (site,), size = group.sites, self.scale.numel()
        if self.fresh_momentum:
            state.momentum = self.momentum.view_as(site.loc)
        remember_scale(site.raw_scale, self.scale.view_as(site.loc))
        far = None
        if self.signs is not None:
            ctx.signs[id(group)] = (group, self.signs)
            far = (torch.as_tensor(self.far) > size // 2) if self.last_signs is not None else torch.zeros(
                (), dtype=torch.bool, device=self.scale.device)
        spreading = ctx.spread_watch.flag(group, self.spread / size, ctx.step) if prior else None
        return torch.stack(self.clamped).any(), far, self.scale, spreading


def dense_site(ctx: Context, site, stats, settings: Settings, tau: float, state, adaptive: bool = False):
    """
    The step of :func:`~pyro_ngvi.update.full_covariance.natural_step` for a
    full-covariance site (of :func:`~pyro_ngvi.update.kronecker.kronecker_step` for a
    Kronecker-factored layer, of :func:`~pyro_ngvi.low_rank.low_rank_step` for a
    low-rank-plus-diagonal precision), not yet written: ``(values to write, momentum,
    state to keep)``, or ``None`` when a new precision is not positive definite.
    Same ``lr``, ``beta``, ``tau``, momentum, damping, trust region (sampled
    curvature) and first-step warm start as the mean-field update (a Kronecker
    layer's first step takes its factors from the data, as noisy K-FAC initialises
    them). With ``adaptive`` (sampled curvature and NGVI's defaults) ``lr`` and
    ``beta`` follow :func:`~pyro_ngvi.policies.dense_rates`, Lin et al.'s correction is
    added only in the eigen-directions whose target is not positive, and the precision
    changes by at most a factor :data:`DENSE_RATIO` per step in each.
    """
    options = ctx.options
    lr, beta, rho, damping = settings
    grad = stats.grad / tau if tau != 1 else stats.grad
    direction = grad
    if rho and state.momentum is not None:
        direction = torch.lerp(grad, state.momentum, rho)
    if isinstance(site, KroneckerSite):
        step = kronecker_step(site.mean, site.row_factor, site.col_factor, direction, stats, lr, beta,
                              tau, damping, first=not state.started)
        return None if step is None else (tuple(step), direction, {})
    if isinstance(site, LowRankSite):
        count = None
        if adaptive:  # (a rank-2 Price estimate is never taken whole: from n = 1 / beta)
            lr, beta, count = dense_rates(settings, state, start=1.0 / beta)
        step = low_rank_step(site.mean, site.factor, site.diag, direction, lr, beta, stats.plus / tau ** 0.5,
                             stats.minus / tau ** 0.5, damping=damping)
        kept = {}
        if adaptive:  # the drift test on the Newton step in the new guide's standard deviations
            newton = solve(step.factor, step.diag, direction) / marginal_variance(step.factor, step.diag).sqrt()
            kept = dense_count(settings, state, count, newton)
        return (step.mean, step.factor, step.diag), direction, kept
    count = None
    if adaptive:
        lr, beta, count = dense_rates(settings, state)
    step = full_covariance.natural_step(
        site.mean, site.factor, direction, stats.curvature, lr, beta, tau, damping,
        stats.prior_loc, stats.prior_precision,
        max_step=options.max_step if stats.sampled else None,
        warm=options.warm_start and not state.started, whitened=stats.whitened,
        by_direction=adaptive, max_ratio=DENSE_RATIO if adaptive else None,
    )
    if step is None:
        return None
    kept = {}
    if adaptive:
        newton = step.factor.T.to(direction) @ direction  # z = C'^T g
        kept = dense_count(settings, state, count, newton)
    return (step.mean, step.factor), direction, kept


@torch.no_grad()
def start_of(sites) -> tuple:
    """The sites' means and standard deviations before the step (flat copies): what
    :func:`couple_means` needs of them."""
    return _flat([site.loc for site in sites]).clone(), _flat([site.scale for site in sites]).clone()


@torch.no_grad()
def couple_means(cross, start: tuple, max_step: Optional[float]) -> None:
    """Replace the element-wise mean step the chain took on the sites of the cross terms
    (``cross``: :class:`~pyro_ngvi.variance.CrossTerms`) by the coupled one,
    :func:`~pyro_ngvi.update.mean_field.coupled_mean_step` (written in place), within the
    trust region of ``max_step`` standard deviations before the step."""
    mean, scale = start
    sites = cross.sites
    step = mean - _flat([site.loc for site in sites])
    denominator = _flat([site.scale for site in sites]).pow(-2)
    radius = scale * max_step if max_step is not None else torch.full_like(scale, math.inf)
    radius = torch.maximum(radius, step.abs())  # never tighter than the step the chain took
    new_mean = mean - coupled_mean_step(step, denominator, cross.off_diagonal.to(step), radius)
    for site, piece in zip(sites, new_mean.split([site.loc.numel() for site in sites])):
        site.loc.copy_(piece.view_as(site.loc))


def dense_adaptive(site, stats, options: Options) -> bool:
    """Whether a full-covariance or low-rank site takes the adaptive steps (sampled
    statistics, with ``averaging`` on and no schedule of the user's)."""
    return options.adaptive and isinstance(site, (FullCovarianceSite, LowRankSite)) and bool(stats.sampled)
