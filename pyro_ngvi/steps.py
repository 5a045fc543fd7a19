"""
One step per kind of site, as a chain that runs each layer once, downward:
statistics :math:`\\to` variance reduction (:mod:`~pyro_ngvi.variance`) :math:`\\to` step
sizes (:mod:`~pyro_ngvi.policies`) :math:`\\to` the Bayesian learning rule
(:mod:`~pyro_ngvi.update`) :math:`\\to` safeguards (:mod:`~pyro_ngvi.safeguards`)
:math:`\\to` the guide's tensors.

:func:`mean_field_group` runs the chain for a :class:`~pyro_ngvi.groups.Group` of
mean-field sites as flat vectors (a large site in spans of :data:`SPAN` elements), its state
read and written back by :mod:`~pyro_ngvi.group_io`;
:func:`dense_site` for a full-covariance or Kronecker-factored site (computed, not
written, so that a step whose new precision is not positive definite can be skipped whole).
"""

import math
from typing import Dict, List, NamedTuple, Optional

import torch

from .elementwise import SCRATCH_FLOATS, Scratch, mean_field_pass, noise_pass
from .family import FullCovarianceSite, SiteCurvature
from .group_io import Spans, keep_pass, read_pass
from .groups import Group, Workspace, flat as _flat
from .kronecker import KroneckerSite
from .low_rank import low_rank_step, marginal_variance, solve
from .low_rank_guide import LowRankSite
from .policies import Settings, dense_count, dense_rates
from .hot_path import no_grad
from .update import full_covariance
from .update import fused
from .update.kronecker import kronecker_step
from .update.mean_field import coupled_mean_step
from .variance import dense_control_variate, low_rank_control_variate

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
#: The same bound for a low-rank-precision site (:func:`~pyro_ngvi.low_rank.bounded_change`): without
#: one a wide start collapsed (tests/test_low_rank.py); 1.25 doubled the steps to KL <= 0.01 D on the
#: one-draw benchmark's regressions (D = 10, 24), 2 kept them (3 seeds; not distinguishable from 3 or 4).
LOW_RANK_RATIO = 2.0


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
    workspace: Optional[Workspace] = None  # the scratch buffers of the eager pass (None: new tensors)
    subsampling: float = 0.0  # N / B - 1 of the model's most subsampled site (policies.noise_constants)


@no_grad
def mean_field_group(ctx: Context, group: Group, stats: List[SiteCurvature], grad: torch.Tensor,
                     curvature: torch.Tensor, settings: Settings, tau: float, states: list):
    """
    :func:`span_step` on the whole group; a large site (beyond :data:`SPAN` elements,
    alone in its group, no mask; not when compiled or masked) in spans of :data:`SPAN`
    elements, one after the other: the same element-wise update, with temporaries of a span's
    size that stay in the cache. Under the adaptive steps, whose noise is pooled over the whole
    site, a first pass over the spans prepares the statistics and sums the noise. Returns what
    :func:`span_step` returns.
    """
    first = stats[0]
    size = grad.numel()
    if (not group.one or first.mask is not None or size <= SPAN or compiled(ctx, group, size)
            or ctx.ok is not None):
        result = span_step(ctx, group, stats, grad, curvature, settings, tau, states)
    else:
        run = Spans(ctx, group, stats, states, settings, SPAN)  # (the group's state read once)
        spans = [slice(start, min(start + SPAN, size)) for start in range(0, size, SPAN)]
        if run.adaptive is not None:  # the noise is pooled over the whole site first
            for run.slice in spans:
                run.sums.append(span_step(ctx, group, stats, grad, curvature, settings, tau, states, run,
                                          "noise"))
        for run.slice in spans:  # (the last span returns the run's flags)
            result = span_step(ctx, group, stats, grad, curvature, settings, tau, states, run)
    for state in states:
        state.started = True
    return result


def span_step(ctx: Context, group: Group, stats: List[SiteCurvature], grad: torch.Tensor,
              curvature: torch.Tensor, settings: Settings, tau: float, states: list, run=None, phase=None):
    """
    The chain for the sites of ``group`` at once, as one flat vector; ``grad`` and
    ``curvature`` are the sites' ``g`` and ``h`` so flattened (this step's: written over).
    The sites share the kind of their statistics (:func:`~pyro_ngvi.groups.statistics_kind`).
    Reads the pass's arguments from the group's state in one call
    (:func:`~pyro_ngvi.group_io.read_pass`), runs the element-wise pass
    (:func:`~pyro_ngvi.elementwise.mean_field_pass`, eager or compiled,
    :mod:`~pyro_ngvi.update.fused`) and writes what it returns back in one
    (:func:`~pyro_ngvi.group_io.keep_pass`). Eagerly the pass writes the
    guide's tensors, the momentum and the remembered :math:`\\sigma` in place and its
    temporaries into the optimizer's workspace (:mod:`~pyro_ngvi.groups`).

    :returns: 0-d bool tensors (no device sync): whether the precision was clamped,
        and, for sampled curvature (else ``None``), whether most elements' gradient
        exceeds :data:`~pyro_ngvi.safeguards.FAR` standard deviations with the sign it
        had at the group's last step; the new :math:`\\sigma` as a flat vector (``None``
        for a masked site); and the flag of the watch on growing means
        (:mod:`pyro_ngvi.monitor`; ``None`` without a prior). In a ``run`` of spans:
        ``None`` until its last span, which returns the run's (gathered span by span); in its ``"noise"`` phase (the adaptive steps' first pass
        over a large site, :func:`~pyro_ngvi.elementwise.noise_pass`) the span's sums of squared
        innovations and their count.
    """
    fuse = compiled(ctx, group, grad.numel())
    args = read_pass(ctx, group, stats, grad, curvature, settings, tau, states, fuse, SPAN, run, phase)
    branches, inputs, numbers = args
    g = inputs.grad  # (the span's, in a run of spans)
    scratch = None if fuse else workspace_scratch(ctx.workspace, g.numel(), g)
    if branches.kept:
        scratch = run.kept(ctx.workspace, scratch, g)
    if phase == "noise":
        return noise_pass(branches, inputs, numbers, group.transform, scratch)
    if fuse:
        out = fused.run(mean_field_pass, branches, True, inputs, numbers, None)
    else:
        out = mean_field_pass(branches, inputs, numbers, group.transform, scratch)
    return keep_pass(ctx, group, states, args, out, run, SPAN)


def workspace_scratch(workspace: Optional[Workspace], n: int, like: torch.Tensor) -> Scratch:
    """The pass's scratch buffers of ``n`` elements from ``workspace`` (none: it allocates)."""
    if workspace is None:
        return Scratch()
    rows = Scratch._fields.index("a")  # (a and b are adjacent rows: one (2, n) view of both)
    return workspace.kept(n, like, SCRATCH_FLOATS, "scratch", lambda: Scratch(
        *workspace.take(n, like, SCRATCH_FLOATS), ab=workspace.rows(n, like, SCRATCH_FLOATS, rows, rows + 2)))


def compiled(ctx: Context, group: Group, size: int) -> bool:
    """Whether the group's pass runs compiled: asked for (``NGVI(compile=True)``), a scale of
    AutoNormal's softplus or an exponential, and at least :data:`COMPILE_MIN` elements (below, a compiled call's own
    cost, its guards, exceeds the kernels it saves)."""
    return ctx.compiled and size >= COMPILE_MIN and hasattr(group.transform, "inverse_and_log")


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
    level = {}
    factor = site.factor if isinstance(site, FullCovarianceSite) else None
    if factor is not None and stats.eps_mean is not None:  # one draw: its control variate
        stats, level = dense_control_variate(factor, stats, state)
    elif isinstance(site, LowRankSite) and stats.displacement is not None:
        stats, level = low_rank_control_variate(stats, state)
    grad = stats.grad / tau if tau != 1 else stats.grad
    direction = grad
    if rho and state.momentum is not None:
        direction = torch.lerp(grad, state.momentum, rho)
    if isinstance(site, KroneckerSite):
        step = kronecker_step(site.mean, site.row_factor, site.col_factor, direction, stats, lr, beta,
                              tau, damping, first=not state.started, folded_with=state.prior)
        return None if step is None else (tuple(step), direction, {"prior": stats.prior_precision})
    if isinstance(site, LowRankSite):
        count = None
        if adaptive:  # (a rank-2 Price estimate is never taken whole: from n = 1 / beta)
            lr, beta, count = dense_rates(settings, state, start=1.0 / beta)
        try:
            step = low_rank_step(site.mean, site.factor, site.diag, direction, lr, beta, stats.plus / tau ** 0.5,
                                 stats.minus / tau ** 0.5, damping=damping, level=stats.level / tau,
                                 max_ratio=LOW_RANK_RATIO if adaptive else None,
                                 max_step=options.max_step if stats.sampled else None)
        except torch.linalg.LinAlgError:  # an eigen-decomposition that did not converge: skip the step
            return None
        if not all(bool(torch.isfinite(t).all()) for t in step[:3]):
            return None
        kept = dict(level)
        if adaptive:  # the drift test on the Newton step in the new guide's standard deviations
            newton = solve(step.factor, step.diag, direction) / marginal_variance(step.factor, step.diag).sqrt()
            kept.update(dense_count(settings, state, count, newton))
        return (step.mean, step.factor, step.diag), direction, kept
    count = None
    if adaptive:
        lr, beta, count = dense_rates(settings, state)
    step = full_covariance.natural_step(
        site.mean, factor, direction, stats.curvature, lr, beta, tau, damping,
        stats.prior_loc, stats.prior_precision,
        max_step=options.max_step if stats.sampled else None,
        warm=options.warm_start and not state.started, whitened=stats.whitened,
        by_direction=adaptive, max_ratio=DENSE_RATIO if adaptive else None,
    )
    if step is None:
        return None
    kept = dict(level)
    if adaptive:
        total = direction  # (the whole gradient: with a conjugate prior, g + S_0 (mu - m_0), 0 at the optimum)
        if stats.prior_precision is not None:
            total = direction + stats.prior_precision.to(direction) @ (site.mean - stats.prior_loc).to(direction)
        newton = step.factor.T.to(direction) @ total  # z = C'^T g
        kept.update(dense_count(settings, state, count, newton))
    return (step.mean, step.factor), direction, kept


@torch.no_grad()
def start_of(sites, subsampling: float = 0.0) -> Optional[tuple]:
    """The sites' means and standard deviations before the step (flat copies): what
    :func:`couple_means` needs of them; ``None`` (no coupled step) where the model subsamples its
    data (``subsampling`` :math:`= N/B - 1 > 0`): fitted to minibatch gradients of :math:`N/B`
    times one draw's noise, the slope was 50 % off (50 of 2,000), :math:`D + \\tilde H` nearly
    singular, and the coupled step of an averaged 0.01 sd step took 3 sd, step after step."""
    if subsampling:
        return None
    return _flat([site.loc for site in sites]).clone(), _flat([site.scale for site in sites]).clone()


@torch.no_grad()
def couple_means(cross, start: Optional[tuple], max_step: Optional[float]) -> None:
    """Replace the element-wise mean step the chain took on the sites of the cross terms
    (``cross``: :class:`~pyro_ngvi.variance.CrossTerms`) by the coupled one,
    :func:`~pyro_ngvi.update.mean_field.coupled_mean_step` (written in place), within the
    trust region of ``max_step`` standard deviations before the step (``start``, of
    :func:`start_of`; ``None``: no coupled step)."""
    if start is None:
        return
    mean, scale = start
    sites = cross.sites
    step = mean - _flat([site.loc for site in sites])
    denominator = _flat([site.scale for site in sites]).pow(-2)
    radius = scale * max_step if max_step is not None else torch.full_like(scale, math.inf)
    radius = torch.maximum(radius, step.abs())  # never tighter than the step the chain took
    diagonal = None if cross.diagonal is None else cross.diagonal.to(step)
    new_mean = mean - coupled_mean_step(step, denominator, cross.off_diagonal.to(step), radius, diagonal)
    for site, piece in zip(sites, new_mean.split([site.loc.numel() for site in sites])):
        site.loc.copy_(piece.view_as(site.loc))


def dense_adaptive(site, stats, options: Options) -> bool:
    """Whether a full-covariance or low-rank site takes the adaptive steps (sampled
    statistics, with ``averaging`` on and no schedule of the user's)."""
    return options.adaptive and isinstance(site, (FullCovarianceSite, LowRankSite)) and bool(stats.sampled)
