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

from .family import FullCovarianceSite, SiteCurvature
from .groups import Group, flat as _flat
from .kronecker import KroneckerSite
from .low_rank import low_rank_step, marginal_variance, solve
from .low_rank_guide import LowRankSite
from .monitor import spread
from .policies import Settings, adaptive_rates, dense_count, dense_rates, first_count, warm_start_rates
from .safeguards import clamp_precision_, clip_, clip_target, far_elements, mostly, precision_trust_region
from .scales import known_scale, remember_scale
from .update import full_covariance
from .update.kronecker import kronecker_step
from .variance import control_variate
from .update.mean_field import coupled_mean_step, mean_step, momentum, precision_step, precision_target, trusted_mean_step

#: A large site's update runs in spans of this many elements (see :func:`mean_field_group`).
SPAN = 1 << 16
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
    site first) in spans of :data:`SPAN` elements, one after the other: the same
    element-wise update, with temporaries of a span's size that stay in cache and are
    reused by the allocator (on the CPU, whole-vector temporaries of a large site go back
    to the system and page-fault on every step). Returns what :func:`span_step` returns.
    """
    first = stats[0]
    size = grad.numel()
    if len(group.sites) > 1 or first.mask is not None or size <= SPAN or adaptive_for(first, ctx.options):
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

    :returns: 0-d bool tensors (no device sync): whether the precision was clamped,
        and, for sampled curvature (else ``None``), whether most elements' gradient
        exceeds :data:`~pyro_ngvi.safeguards.FAR` standard deviations with the sign it
        had at the group's last step; the new :math:`\\sigma` as a flat vector (``None``
        for a masked site); and the flag of the watch on growing means
        (:mod:`pyro_ngvi.monitor`; ``None`` without a prior). In a ``run`` of spans:
        ``None`` (the run gathers them).
    """
    # In place wherever a value is not needed again: besides the flat copies of a multi-site
    # group, the update holds about five vectors at its peak.
    options = ctx.options
    first, sites, transform = stats[0], group.sites, group.transform
    lr, beta, rho = settings.lr, settings.beta, settings.momentum

    def cut(flat):  # the span of a flat vector (all of it outside a run)
        return flat if run is None else flat[run.slice]

    mean = cut(_flat([site.loc for site in sites]))
    # the sigma the ELBO read this step, else the one this optimizer wrote last (in a run, as it was
    # at the run's start: the spans before this one have written the raw scale since)
    scales = [(known_scale(site.raw_scale) if run is None else run.old_scale) if s.scale is None else s.scale
              for s, site in zip(stats, sites)]
    if all(scale is not None for scale in scales):
        precision = cut(_flat(scales)).pow(-2)
    else:
        precision = transform(cut(_flat([site.raw_scale for site in sites]))).pow_(-2)
    mask = None if first.mask is None else first.mask.reshape(-1)
    prior_precision = None if first.prior_precision is None else cut(
        group.flat_of("prior_precision", [s.prior_precision for s in stats]))
    adaptive = adaptive_for(first, options)
    grad, curvature = cut(grad), cut(curvature)
    grad = grad.div_(tau) if tau != 1 else grad  # from here g / tau and h / tau
    curvature = curvature.div_(tau) if tau != 1 else curvature
    if adaptive:
        count = group.buffer(states, "count", first_count(beta, options.warm_start))
        drift = group.buffer(states, "momentum" if rho else "drift", 0.0)

    # variance: the control variate takes lambda - lambda_0 for the curvature; not where the
    # precision is started above it and floored below it (the minibatch recipe)
    if options.control_variate and first.eps_mean is not None and first.num_data is None:
        if adaptive:
            known, baseline = count > first_count(beta, options.warm_start), drift
        elif run is not None:  # one site
            known, baseline = torch.full_like(grad, states[0].started, dtype=torch.bool), None
        else:
            known, baseline = group.started(states, True), None
        eps_mean = cut(_flat([s.eps_mean for s in stats]))
        control_variate(grad, curvature, eps_mean, cut(_flat([s.eps_sq_mean for s in stats])).sub(1.0),
                        precision, prior_precision, known, baseline)
    target = precision_target(curvature, prior_precision)
    if adaptive:
        target = clip_target(target, precision)
    direction = momentum(group, states, grad, mask, rho, run)
    pull = spreading = None  # the exact prior's gradient, lambda_0 (mu - m_0)
    if prior_precision is not None:
        deviation = mean - cut(group.flat_of("prior_loc", [s.prior_loc for s in stats]))
        if mask is None:  # the watch on growing means (pyro_ngvi.monitor): sum lambda_0 (mu - m_0)^2
            pull = deviation * prior_precision
            if run is None:
                spreading = ctx.spread_watch.flag(group, spread(deviation, pull), ctx.step)
            else:  # summed span by span, the flag at the end of the run
                run.spread = run.spread + torch.dot(pull, deviation)
        else:
            pull = deviation.mul_(prior_precision)
        del deviation

    # policies: the step sizes
    if adaptive:
        step_beta, step_lr = adaptive_rates(group, states, grad, direction, drift, pull, target,
                                            precision, count, lr, beta, mask, rho)
    elif options.warm_start and not all(state.started for state in states):
        fresh = torch.full_like(grad, True, dtype=torch.bool) if run is not None else group.started(states, False)
        step_beta, step_lr = warm_start_rates(fresh, target, precision, beta, lr)
    else:
        step_beta, step_lr = beta, lr

    # the update of the precision, and its safeguards
    new_precision = precision_step(precision, target, step_beta,
                                   correct=not (first.nonnegative and prior_precision is not None))
    del target
    if first.sampled and options.max_step is not None:  # trust region on the precision too
        new_precision = precision_trust_region(new_precision, precision, prior_precision)
    # lambda' in [tiny, max / 4], and >= lambda_min where the family has a floor
    floor = None if first.min_precision is None else cut(group.flat_of("min_precision",
                                                                       [s.min_precision for s in stats]))
    clamped, lowest = clamp_precision_(new_precision, floor)
    del floor
    damping = settings.damping
    denominator = new_precision + damping if damping else new_precision
    del prior_precision
    far = _far_flag(ctx, group, grad, precision, mask, run) if first.sampled else None

    # the update of the mean, and its safeguards
    if first.sampled and options.max_step is not None:
        # the trust region bounds the likelihood part of the step, not the prior's
        new_mean = trusted_mean_step(mean, direction, pull, denominator, step_lr,
                                     precision.rsqrt_().mul_(options.max_step))
    elif ctx.guarded is not None and not torch.is_tensor(step_lr):  # guarded Newton step (at the mean)
        numerator = direction if pull is None else pull.add_(direction)
        step = numerator.mul(step_lr).div_(denominator)
        if ctx.guarded.factor > 1 and options.max_step is not None:
            # while damped, also at most max_step standard deviations (before the step)
            step = clip_(step, precision.rsqrt_().mul_(options.max_step))
        # the decrease of F the quadratic model predicts for it
        ctx.guarded.predicted = (ctx.guarded.predicted + (numerator * step).sum()
                                 - 0.5 * (new_precision * step.square()).sum())
        new_mean = step.neg_().add_(mean)
    else:  # mu - lr (g + lambda_0 (mu - m_0)) / (lambda' + gamma) in one kernel (a span: into loc)
        new_mean = mean_step(mean, direction, pull, denominator, step_lr, out=None if run is None else mean)
    del precision, pull, denominator, direction
    return _write(group, states, mask, new_mean, new_precision, lowest, clamped, far, spreading, run, mean)


def _far_flag(ctx: Context, group: Group, grad, precision, mask, run) -> Optional[torch.Tensor]:
    """The stall test's flag for sampled statistics: most elements' :math:`|g|\\sigma` beyond
    :data:`~pyro_ngvi.safeguards.FAR`, with the sign of the group's last step (in a run,
    counted span by span: ``None``)."""
    positive = grad > 0
    if run is not None:
        if run.last_signs is not None:
            run.far = run.far + torch.count_nonzero(
                far_elements(grad, precision, positive, run.last_signs[run.slice]))
        run.signs[run.slice] = positive
        return None
    last = ctx.signs.get(id(group))
    ctx.signs[id(group)] = (group, positive)
    if last is not None and last[0] is group:
        return mostly(far_elements(grad, precision, positive, last[1]), mask)
    return torch.zeros((), dtype=torch.bool, device=grad.device)


def _write(group: Group, states, mask, new_mean, new_precision, lowest, clamped, far, spreading, run, mean):
    """Write :math:`\\mu'` and the raw scale of :math:`\\sigma' = \\lambda'^{-1/2}` into the
    guide's tensors (only the ``mask`` rows) and remember :math:`\\sigma'`."""
    transform = group.transform
    new_scale = new_precision.rsqrt_() if run is None else torch.rsqrt(new_precision, out=run.scale[run.slice])
    raw_out = None if run is None else group.raw_scales[0][run.slice]  # a span: straight into the raw scale
    if hasattr(transform, "inverse_and_log"):  # (its log sigma, of sigma before the round trip: unused)
        new_raw_scale = transform.inverse_and_log(new_scale, raw_out, lowest.rsqrt())[0]
    else:
        new_raw_scale = transform.inv(new_scale)
    del new_precision
    # the sigma the new raw scale gives when read, remembered for the next reader: exactly what a
    # process reads from the saved param store, so a resumed run takes the same steps bit for bit
    # (the round trip moves sigma by an ulp or so; the kernels give the same bits at any offset)
    read = transform(new_raw_scale) if mask is None else None
    if run is not None:  # one site, no mask: write the span
        if new_mean is not mean:
            group.locs[0][run.slice].copy_(new_mean)
        if new_raw_scale is not raw_out:
            raw_out.copy_(new_raw_scale)
        run.scale[run.slice].copy_(read)
        run.clamped.append(clamped)
        return None
    if mask is None:
        torch._foreach_copy_(group.locs, new_mean.split_with_sizes(group.sizes))
        torch._foreach_copy_(group.raw_scales, new_raw_scale.split_with_sizes(group.sizes))
        new_scale = read
        for site, piece in zip(group.sites, new_scale.split_with_sizes(group.sizes)):
            remember_scale(site.raw_scale, piece.view_as(site.loc))
    else:  # a masked site is a group of its own
        (loc,), (raw_scale,) = group.locs, group.raw_scales
        loc.copy_(torch.where(mask, new_mean, loc))
        raw_scale.copy_(torch.where(mask, new_raw_scale, raw_scale))
        new_scale = None  # untouched rows keep their old scale
    return clamped, far, new_scale, spreading


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
