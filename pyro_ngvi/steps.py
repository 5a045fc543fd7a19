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

from .elementwise import SCRATCH_FLOATS, Branches, Inputs, Numbers, Scratch, mean_field_pass, noise_pass
from .family import FullCovarianceSite, SiteCurvature
from .groups import Group, Workspace, flat as _flat
from .kronecker import KroneckerSite
from .low_rank import low_rank_step, marginal_variance, solve
from .low_rank_guide import LowRankSite
from .policies import NoiseState, Settings, dense_count, dense_rates, first_count, noise_constants, pooled_levels
from .hot_path import no_grad, scalar
from .scales import FastExp, known_scale, remember_scale
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


def stall_test(stats: SiteCurvature) -> bool:
    """Whether a group with statistics like ``stats`` runs the stall test (the signs of g kept
    between steps, :func:`~pyro_ngvi.safeguards.far_elements`): sampled full-batch statistics,
    whose mean the trust region may hold far from the data's for long. A network's minibatch
    statistics have watches of their own (growing means, a worsening ELBO)."""
    return stats.sampled and stats.num_data is None


def adaptive_for(stats: SiteCurvature, options: Options) -> bool:
    """Whether statistics like ``stats`` take the adaptive steps: sampled, not a
    BayesianNet's minibatch statistics (``num_data``: their noise is the data's as much
    as the draws', which the adaptive steps would average away; the recipe's steps)."""
    return stats.sampled and options.adaptive and stats.num_data is None


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
        run = Spans(ctx, group, states)
        run.sampled, run.scale = stall_test(first), _scales(group, stats)
        spans = [slice(start, min(start + SPAN, size)) for start in range(0, size, SPAN)]
        if adaptive_for(first, ctx.options):  # the noise is pooled over the whole site first
            run.adaptive = _adaptive_inputs(group, states, settings.beta, settings.momentum, ctx.options.warm_start,
                                            ctx.subsampling)
            sums = []
            for run.slice in spans:
                sums.append(span_step(ctx, group, stats, grad, curvature, settings, tau, states, run, "noise"))
            totals, counts = (sum(parts) for parts in zip(*sums))
            run.levels = pooled_levels(totals, counts, run.adaptive["noise"])
        for run.slice in spans:
            span_step(ctx, group, stats, grad, curvature, settings, tau, states, run)
        result = run.finish(ctx, group, states, first.prior_precision is not None)
    for state in states:
        state.started = True
    return result


def span_step(ctx: Context, group: Group, stats: List[SiteCurvature], grad: torch.Tensor,
              curvature: torch.Tensor, settings: Settings, tau: float, states: list, run=None, phase=None):
    """
    The chain for the sites of ``group`` at once, as one flat vector; ``grad`` and
    ``curvature`` are the sites' ``g`` and ``h`` so flattened (this step's: written over).
    The sites share the kind of their statistics (:func:`~pyro_ngvi.groups.statistics_kind`).
    Gathers the group's tensors and decides which parts apply from the sites' state
    (:class:`~pyro_ngvi.elementwise.Branches`), runs the element-wise pass
    (:func:`~pyro_ngvi.elementwise.mean_field_pass`, eager or compiled,
    :mod:`~pyro_ngvi.update.fused`) and keeps what it returns. Eagerly the pass writes the
    guide's tensors, the momentum and the remembered :math:`\\sigma` in place and its
    temporaries into the optimizer's workspace (:mod:`~pyro_ngvi.groups`).

    :returns: 0-d bool tensors (no device sync): whether the precision was clamped,
        and, for sampled curvature (else ``None``), whether most elements' gradient
        exceeds :data:`~pyro_ngvi.safeguards.FAR` standard deviations with the sign it
        had at the group's last step; the new :math:`\\sigma` as a flat vector (``None``
        for a masked site); and the flag of the watch on growing means
        (:mod:`pyro_ngvi.monitor`; ``None`` without a prior). In a ``run`` of spans:
        ``None`` (the run gathers them); in its ``"noise"`` phase (the adaptive steps' first pass
        over a large site, :func:`~pyro_ngvi.elementwise.noise_pass`) the span's sums of squared
        innovations and their count.
    """
    options = ctx.options
    first = stats[0]
    lr, beta, rho = settings.lr, settings.beta, settings.momentum

    def cut(flat):  # the span of a flat vector (all of it outside a run)
        return flat if run is None else flat[run.slice]

    fuse = compiled(ctx, group, grad.numel())
    eager = not fuse
    mask = None if first.mask is None else first.mask.reshape(-1)
    masked_write = ctx.ok is not None
    # sigma: the one the ELBO read this step, else the one this optimizer wrote last (the group's
    # own buffer, which the sites remember), else read from the raw scale by the pass
    scale = _scales(group, stats) if run is None else run.scale  # (a run's spans write the raw scale)
    known = scale is not None
    own_scale = group.owned("scale")
    if mask is None and not masked_write:
        out_scale = cut(own_scale)  # (in place: each element's sigma is read before it is written)
    else:
        out_scale = None
    prior = first.prior_precision is not None
    adaptive = adaptive_for(first, options)
    grad, curvature = cut(grad), cut(curvature)
    if group.one:  # (its flat tensors are views: written in place)
        mean, raw = cut(group.locs[0]), cut(group.raw_scales[0])
        in_place = eager and mask is None and not masked_write
        out_mean = out_raw = None
    else:
        mean = group.gather("mean", group.loc_tensors)
        needs_raw = not known or masked_write or (first.gradients and not isinstance(group.transform, FastExp))
        raw = group.gather("raw", group.raw_tensors) if needs_raw else None
        in_place = False
        out_mean, out_raw = (mean, group.owned("raw")) if eager and not masked_write else (None, None)
    inputs = dict(
        mean=mean, raw_scale=raw, grad=grad, curvature=curvature, scale=cut(scale) if known else None, mask=mask,
        prior_precision=cut(group.flat_of("prior_precision", [s.prior_precision for s in stats])) if prior else None,
        prior_loc=cut(group.flat_of("prior_loc", [s.prior_loc for s in stats])) if prior else None,
        floor=None if first.min_precision is None else cut(group.flat_of("min_precision",
                                                                        [s.min_precision for s in stats])),
        out_mean=out_mean, out_raw_scale=out_raw, out_scale=out_scale,
    )
    # (before the buffers are made; for a run of spans, at its start)
    momentum_fresh = run.momentum_fresh if run is not None else [state.momentum is None for state in states]
    if adaptive:
        adaptive_inputs = run.adaptive if run is not None else _adaptive_inputs(group, states, beta, rho,
                                                                                options.warm_start, ctx.subsampling)
        inputs.update({k: v if k == "noise" or v is None else cut(v) for k, v in adaptive_inputs.items()})
        if run is not None and phase is None:  # the second pass: the statistics prepared, the noise pooled
            inputs["levels"] = run.levels
    draws = first.eps_mean is not None or (first.gradients and first.draws)
    control = options.control_variate and draws and first.num_data is None
    if control:
        if not first.gradients:  # (else the pass recovers the draws)
            inputs.update(eps_mean=cut(_flat([s.eps_mean for s in stats])),
                          eps_sq_mean=None if first.eps_sq_mean is None else cut(_flat([s.eps_sq_mean
                                                                                         for s in stats])))
        if not adaptive:  # (compiled: a 0 / 1 mask in the control variate; compiled loops move bools slowly)
            inputs["known"] = cut(group.started(states, True) if not fuse else group.cached(
                ("known", tuple(state.started for state in states)),
                lambda: group.started(states, True).to(grad.dtype)))
    momentum = _momentum_inputs(group, states, rho, run, inputs, cut, momentum_fresh)
    if adaptive:
        rates = "adaptive"
    elif options.warm_start and not all(state.started for state in states):
        rates = "warm"
        inputs["fresh"] = cut(group.started(states, False))
    else:
        rates = "constant"
    trust = first.sampled and options.max_step is not None
    guarded = ctx.guarded is not None and not adaptive and not trust
    last = None
    if ctx.ok is not None:
        inputs["ok"] = ctx.ok
    stalls = stall_test(first)
    if stalls:  # the stall test's signs of the group's last step
        last = _last_signs(ctx, group)
        if last is not None:
            inputs["last_signs"] = cut(last)
    branches = Branches(
        tau=tau != 1, control_variate=control, prior=prior, mask=mask is not None, momentum=momentum, rates=rates,
        correct=not (first.nonnegative and prior), trust=trust, floor=first.min_precision is not None,
        damping=bool(settings.damping), guarded=guarded,
        guard_clip=guarded and ctx.guarded.factor > 1 and options.max_step is not None,
        signs=stalls, far=last is not None, spread=prior and mask is None,
        known_scale=known, fast_scale=hasattr(group.transform, "inverse_and_log"),
        exp_scale=isinstance(group.transform, FastExp), branch_free=fuse,
        # a floor >= 1 keeps every new sigma <= 1 (compiled: the raw scale's series alone)
        at_most_one=fuse and first.min_precision is not None
        and group.least("min_precision", [s.min_precision for s in stats]) >= 1.0,
        in_place=in_place or (fuse and group.one and mask is None), masked=masked_write,
        prepared=run is not None and adaptive and phase is None,
        recover=first.gradients, recover_draws=first.gradients and first.draws and control,
    )
    numbers = Numbers(lr, beta, rho, settings.damping, tau, options.max_step,
                      ctx.guarded.factor if guarded else 1.0, first_count(beta, options.warm_start))
    if phase == "noise":
        return noise_pass(branches, Inputs(**inputs), numbers, group.transform,
                          _scratch(ctx.workspace, grad.numel(), grad))
    if fuse:
        out = fused.run(mean_field_pass, branches, True, Inputs(**inputs), numbers, None)
    else:
        out = mean_field_pass(branches, Inputs(**inputs), numbers, group.transform,
                              _scratch(ctx.workspace, grad.numel(), grad))
    return _keep(ctx, group, states, mask, out, run, rho, own_scale)


def _scratch(workspace: Optional[Workspace], n: int, like: torch.Tensor) -> Scratch:
    """The pass's scratch buffers of ``n`` elements from ``workspace`` (none: it allocates)."""
    if workspace is None:
        return Scratch()
    rows = Scratch._fields.index("a")  # (a and b are adjacent rows: one (2, n) view of both)
    return workspace.kept(n, like, SCRATCH_FLOATS, "scratch", lambda: Scratch(
        *workspace.take(n, like, SCRATCH_FLOATS), ab=workspace.rows(n, like, SCRATCH_FLOATS, rows, rows + 2)))


def _scales(group: Group, stats: List[SiteCurvature]) -> Optional[torch.Tensor]:
    """The sites' sigma as one flat vector: the group's own buffer when every site's is the view
    of it that it remembers (the sigma this optimizer wrote last), else the sigma the ELBO read or
    the one remembered, copied into that buffer; ``None`` when a site's is unknown (the pass
    reads it from the raw scale)."""
    scales = [known_scale(site.raw_scale) if s.scale is None else s.scale for s, site in zip(stats, group.sites)]
    if any(scale is None for scale in scales):
        return None
    own = group.owned("scale")
    views = group.cached("scale views", lambda: group.views(own))
    if all(scale is view for scale, view in zip(scales, views)):
        return own
    if group.one:
        return _flat(scales)
    if any(scale.untyped_storage().data_ptr() == own.untyped_storage().data_ptr() for scale in scales):
        # (some sites' sigma still views this buffer, others' another group's: a guide whose
        # structure changes between steps; torch refuses a cat into memory it reads from)
        return own.copy_(_flat(scales))
    return _flat(scales, out=own)


def compiled(ctx: Context, group: Group, size: int) -> bool:
    """Whether the group's pass runs compiled: asked for (``NGVI(compile=True)``), a scale of
    AutoNormal's softplus or an exponential, and at least :data:`COMPILE_MIN` elements (below, a compiled call's own
    cost, its guards, exceeds the kernels it saves)."""
    return ctx.compiled and size >= COMPILE_MIN and hasattr(group.transform, "inverse_and_log")


def _pools(group: Group) -> List[tuple]:
    """Per site, the sizes of the blocks that pool their noise for the adaptive steps: a site's
    ``blocks`` (an AutoDiagonalNormal's latents: one latent's noise says nothing of another's),
    or the whole site (also a site updated in spans, whose sums run span by span)."""
    return group.cached("pools", lambda: [
        site.blocks if len(site.blocks) > 1 and site.loc.numel() <= SPAN else (site.loc.numel(),)
        for site in group.sites])


def _adaptive_inputs(group: Group, states, beta: float, rho: float, warm_start: bool,
                     subsampling: float = 0.0) -> dict:
    """The adaptive steps' state as the group's flat buffers, and the sites' pooled noise stacked
    (one pool per block, :func:`_pools`; ``subsampling``: :func:`~pyro_ngvi.policies.noise_constants`)."""
    like = group.like
    pools = _pools(group)
    for state, blocks in zip(states, pools):
        if state.noise is None or state.steps.numel() != len(blocks):  # (new, or saved with other pools)
            shape = () if len(blocks) == 1 else (len(blocks),)
            state.steps = torch.zeros(shape, dtype=like.dtype, device=like.device)
            state.noise = torch.full((2,) + shape + (2,), math.inf, dtype=like.dtype, device=like.device)
    constants = group.cached((like.dtype, like.device, subsampling), lambda: noise_constants(
        [size for blocks in pools for size in blocks], like.dtype, like.device, subsampling))
    noise = NoiseState(torch.cat([state.steps.reshape(-1) for state in states]),
                       torch.cat([state.noise.reshape(2, -1, 2) for state in states], dim=1), **constants)
    fresh = group.fresh(states, "hdrift")
    return dict(count=group.state(states, "count", first_count(beta, warm_start)),
                drift=group.state(states, "momentum" if rho else "drift", 0.0),
                hdrift=group.state(states, "hdrift", 0.0), excess=group.state(states, "excess", 0.0), fresh=fresh,
                noise=noise)


def _momentum_inputs(group: Group, states, rho: float, run, inputs: dict, cut, fresh: List[bool]) -> str:
    """The momentum buffer (:func:`~pyro_ngvi.update.mean_field.momentum`; the group's, which the
    sites' states view; with the adaptive steps it is their drift) in ``inputs``, and which branch
    of the average applies: every site has one, none has (``fresh``; a span's first step takes g),
    or some have (``started`` says which)."""
    if rho == 0:
        return "none"
    inputs["momentum"] = inputs["drift"] if inputs.get("drift") is not None else cut(
        group.state(states, "momentum", 0.0))
    if run is not None:
        return "span_first" if all(fresh) else "span"
    if not any(fresh):
        return "average"
    inputs["started"] = group.flags([not f for f in fresh])
    return "mixed"


def _last_signs(ctx: Context, group: Group) -> Optional[torch.Tensor]:
    """The signs of the group's gradient at its last sampled step (``None``: none yet)."""
    last = ctx.signs.get(id(group))
    return last[1] if last is not None and last[0] is group else None


def _keep(ctx: Context, group: Group, states, mask, out, run, rho: float, own_scale: torch.Tensor):
    """Keep what the pass returned: the new mean and raw scale in the guide (only the ``mask`` rows),
    :math:`\\sigma'` remembered, the momentum and adaptive state in the group's buffers, the stall
    test's signs and the flags. (Eagerly most of it was written in place by the pass.)"""
    def store(name: str, value: torch.Tensor, fill=None) -> None:  # (eagerly written in place already)
        buffer = group.state(states, name, fill)
        target = buffer if run is None else buffer[run.slice]
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)

    steps = out.adaptive
    if steps is not None:
        for name in ("count", "hdrift") + (() if steps.drift is None else ("drift",)):
            store(name, getattr(steps, name))
        start = 0
        for state, blocks in zip(states, _pools(group)):
            pick = start if len(blocks) == 1 else slice(start, start + len(blocks))
            state.steps, state.noise = steps.steps[pick], steps.noise[:, pick]
            start += len(blocks)
    if rho != 0:
        store("momentum", out.momentum, 0.0)
    if run is not None:  # one site, no mask: the span is written
        run.clamped.append(out.clamped)
        if out.spread is not None:
            run.spread = run.spread + out.spread
        if out.signs is not None:  # (after the pass read the last step's)
            group.owned("signs")[run.slice].copy_(out.signs)
            if out.far is not None:
                run.far = run.far + out.far
        return None
    if ctx.guarded is not None and out.predicted is not None:  # the decrease of F the quadratic model predicts
        numerator_step, curvature_step = out.predicted
        ctx.guarded.predicted = ctx.guarded.predicted + numerator_step - 0.5 * curvature_step
    far = None
    if out.signs is not None:  # (0 / 1 in the sites' dtype, kept in the group's buffer after the pass read it)
        ctx.signs[id(group)] = (group, group.owned("signs").copy_(out.signs))
        if out.far is None:
            far = torch.zeros((), dtype=torch.bool, device=out.signs.device)
        elif mask is None:
            far = out.far > out.signs.numel() // 2
        else:
            far = out.far * 2 > torch.count_nonzero(mask)
    spreading = None
    if out.spread is not None:
        spreading = ctx.spread_watch.flag(group, out.spread / scalar(float(out.mean.numel()), out.spread), ctx.step)
    if mask is None:
        if out.mean is not group.locs[0]:
            torch._foreach_copy_(group.locs, out.mean.split_with_sizes(group.sizes))
        if out.raw_scale is not group.raw_scales[0]:
            torch._foreach_copy_(group.raw_scales, out.raw_scale.split_with_sizes(group.sizes))
        if out.scale is not own_scale:
            own_scale.copy_(out.scale)
        _remember(group, own_scale)
        new_scale = own_scale
    else:  # a masked site is a group of its own
        (loc,), (raw_scale,) = group.locs, group.raw_scales
        torch.where(mask, out.mean, loc, out=loc)
        torch.where(mask, out.raw_scale, raw_scale, out=raw_scale)
        new_scale = None  # untouched rows keep their old scale
    return out.clamped, far, new_scale, spreading


def _remember(group: Group, own_scale: torch.Tensor) -> None:
    """Each site remembers its view of the group's sigma buffer as the scale its raw tensor holds."""
    views = group.cached("scale views", lambda: group.views(own_scale))
    for site, view in zip(group.sites, views):
        remember_scale(site.raw_scale, view)


class Spans:
    """
    What a large site's update accumulates span by span (:func:`mean_field_group`): the
    current ``slice``, the signs of :math:`g` (sampled statistics) and the counts of the stall
    test, the clamp flags and the spread of the watch on growing means. The mean, the raw
    scale, :math:`\\sigma` and the momentum are written in place, span by span.
    """

    def __init__(self, ctx: Context, group: Group, states):
        like = group.like
        self.momentum_fresh = [state.momentum is None for state in states]
        self.adaptive = self.levels = None  # the adaptive steps' inputs, and their noise pooled over the spans
        self.slice = slice(0, 0)
        self.clamped: List[torch.Tensor] = []
        self.spread = torch.zeros((), dtype=like.dtype, device=like.device)  # sum lambda_0 (mu - m_0)^2
        self.far = 0
        self.last_signs = _last_signs(ctx, group)
        self.sampled = False

    def finish(self, ctx: Context, group: Group, states, prior: bool):
        """Keep the site's signs and remembered scale; the flags and the new scale, as
        :func:`span_step` returns (the watch on growing means fed the spread the spans summed,
        given a ``prior``)."""
        own_scale = group.owned("scale")
        _remember(group, own_scale)
        size = own_scale.numel()
        far = None
        if self.sampled:
            ctx.signs[id(group)] = (group, group.owned("signs"))
            far = (torch.as_tensor(self.far) > size // 2) if self.last_signs is not None else torch.zeros(
                (), dtype=torch.bool, device=own_scale.device)
        spreading = ctx.spread_watch.flag(group, self.spread / size, ctx.step) if prior else None
        return torch.stack(self.clamped).any(), far, own_scale, spreading


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
        newton = step.factor.T.to(direction) @ direction  # z = C'^T g
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
