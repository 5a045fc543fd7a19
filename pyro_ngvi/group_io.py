"""
A group's state read as the element-wise pass's arguments, and the pass's results written back.

:func:`read_pass` gathers, in one call, everything the pass
(:func:`~pyro_ngvi.elementwise.mean_field_pass`) needs of a :class:`~pyro_ngvi.groups.Group`
of mean-field sites: the sites' tensors as flat vectors, their :math:`\\sigma`, priors and floor,
the momentum and the adaptive steps' state from the group's flat buffers, the stall test's
signs, and which parts of the pass apply (:class:`~pyro_ngvi.elementwise.Branches`);
:func:`keep_pass` writes what the pass returned back into the guide and those buffers in one.
A large site updated in spans (:func:`~pyro_ngvi.steps.mean_field_group`) reads its state once,
at the start of its run of spans, sums the spans' flags and keeps them at its last (:class:`Spans`).
"""

import math
from typing import List, NamedTuple, Optional

import torch

from .elementwise import Branches, Inputs, Numbers
from .family import SiteCurvature
from .groups import Group, flat
from .hot_path import scalar
from .policies import NoiseState, Settings, first_count, noise_constants, pooled_levels
from .scales import FastExp, known_scale, remember_scale


class PassArguments(NamedTuple):
    """The element-wise pass's arguments, read from a group's state (:func:`read_pass`)."""

    branches: Branches
    inputs: Inputs
    numbers: Numbers


def stall_test(stats: SiteCurvature) -> bool:
    """Whether a group with statistics like ``stats`` runs the stall test (the signs of g kept
    between steps, :func:`~pyro_ngvi.safeguards.far_elements`): sampled full-batch statistics,
    whose mean the trust region may hold far from the data's for long. A network's minibatch
    statistics have watches of their own (growing means, a worsening ELBO)."""
    return stats.sampled and stats.num_data is None


def adaptive_for(stats: SiteCurvature, options) -> bool:
    """Whether statistics like ``stats`` take the adaptive steps: sampled, not a
    BayesianNet's minibatch statistics (``num_data``: their noise is the data's as much
    as the draws', which the adaptive steps would average away; the recipe's steps)."""
    return stats.sampled and options.adaptive and stats.num_data is None


def read_pass(ctx, group: Group, stats: List[SiteCurvature], grad: torch.Tensor, curvature: torch.Tensor,
              settings: Settings, tau: float, states: list, fuse: bool, span: int, run=None,
              phase=None) -> PassArguments:
    """
    The pass's arguments for the sites of ``group`` as one flat vector (``grad`` and ``curvature``
    their ``g`` and ``h`` so flattened; ``ctx`` the chain's :class:`~pyro_ngvi.steps.Context`):
    the group's tensors gathered, the parts that apply decided from the sites' state, the
    momentum and adaptive buffers made where new. ``fuse``: the pass runs compiled; ``span``:
    :data:`~pyro_ngvi.steps.SPAN` (``_pools``); in a ``run`` of spans, its current span, and
    in its ``"noise"`` phase the arguments of :func:`~pyro_ngvi.elementwise.noise_pass`.
    """
    options = ctx.options
    first = stats[0]
    lr, beta, rho = settings.lr, settings.beta, settings.momentum

    def cut(vector):  # the span of a flat vector (all of it outside a run)
        return vector if run is None else vector[run.slice]

    # which parts of the pass apply, from the statistics and the sites' state (before any buffer is made)
    eager = not fuse
    mask = None if first.mask is None else first.mask.reshape(-1)
    masked_write = ctx.ok is not None
    prior = first.prior_precision is not None
    adaptive = adaptive_for(first, options)
    draws = first.eps_mean is not None or (first.gradients and first.draws)
    control = options.control_variate and draws and first.num_data is None
    stalls = stall_test(first)
    last = _last_signs(ctx, group) if stalls else None  # the stall test's signs of the group's last step
    # (for a run of spans, at its start)
    momentum_fresh = run.momentum_fresh if run is not None else [state.momentum is None for state in states]
    momentum = _momentum_branch(rho, run, momentum_fresh)
    if adaptive:
        rates = "adaptive"
    elif options.warm_start and not all(state.started for state in states):
        rates = "warm"
    else:
        rates = "constant"
    trust = first.sampled and options.max_step is not None
    guarded = ctx.guarded is not None and not adaptive and not trust
    known_scales = _known_scales(group, stats) if run is None else None
    levels = run.noise_levels() if run is not None and adaptive and phase is None else None
    if adaptive:  # (the adaptive steps' buffers made where new)
        adaptive_inputs = run.adaptive if run is not None else _adaptive_inputs(group, states, beta, rho,
                                                                                options.warm_start, span,
                                                                                ctx.subsampling)
    # the tensors, as flat vectors: the sites' and the group's buffers
    # sigma: the one the ELBO read this step, else the one this optimizer wrote last (the group's
    # own buffer, which the sites remember), else read from the raw scale by the pass
    scale = group.sigma(known_scales) if run is None else run.scale  # (a run's spans write the raw scale)
    known = scale is not None
    own_scale = group.owned("scale")
    if mask is None and not masked_write:
        out_scale = cut(own_scale)  # (in place: each element's sigma is read before it is written)
    else:
        out_scale = None
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
    if adaptive:
        inputs.update({k: v if k == "noise" or v is None else cut(v) for k, v in adaptive_inputs.items()})
        if levels is not None:  # the second pass: the statistics prepared, the noise pooled
            inputs["levels"] = levels
    if control:
        if not first.gradients:  # (else the pass recovers the draws)
            inputs.update(eps_mean=cut(flat([s.eps_mean for s in stats])),
                          eps_sq_mean=None if first.eps_sq_mean is None else cut(flat([s.eps_sq_mean
                                                                                        for s in stats])))
        if not adaptive:  # (compiled: a 0 / 1 mask in the control variate; compiled loops move bools slowly)
            inputs["known"] = cut(group.started(states, True) if not fuse else group.cached(
                ("known", tuple(state.started for state in states)),
                lambda: group.started(states, True).to(grad.dtype)))
    if momentum != "none":  # the group's momentum buffer, which the sites' states view (adaptive: their drift)
        inputs["momentum"] = inputs["drift"] if inputs.get("drift") is not None else cut(
            group.state(states, "momentum", 0.0))
    if momentum == "mixed":
        inputs["started"] = group.flags([not f for f in momentum_fresh])
    if rates == "warm":
        inputs["fresh"] = cut(group.started(states, False))
    if ctx.ok is not None:
        inputs["ok"] = ctx.ok
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
        kept=run is not None and adaptive and eager and ctx.workspace is not None,
    )
    numbers = Numbers(lr, beta, rho, settings.damping, tau, options.max_step,
                      ctx.guarded.factor if guarded else 1.0, first_count(beta, options.warm_start))
    return PassArguments(branches, Inputs(**inputs), numbers)


def _known_scales(group: Group, stats: List[SiteCurvature]) -> List[Optional[torch.Tensor]]:
    """Each site's sigma where known without computing it: the one the ELBO read this step, else the
    one remembered for its raw scale (``None``: unknown; the pass reads it from the raw scale)."""
    return [known_scale(site.raw_scale) if s.scale is None else s.scale for s, site in zip(stats, group.sites)]


def _pools(group: Group, span: int) -> List[tuple]:
    """Per site, the sizes of the blocks that pool their noise for the adaptive steps: a site's
    ``blocks`` (an AutoDiagonalNormal's latents: one latent's noise says nothing of another's),
    or the whole site (also a site updated in spans of ``span`` elements, whose sums run span by span)."""
    return group.cached("pools", lambda: [
        site.blocks if len(site.blocks) > 1 and site.loc.numel() <= span else (site.loc.numel(),)
        for site in group.sites])


def _adaptive_inputs(group: Group, states, beta: float, rho: float, warm_start: bool, span: int,
                     subsampling: float = 0.0) -> dict:
    """The adaptive steps' state as the group's flat buffers, and the sites' pooled noise stacked
    (one pool per block, ``_pools``; ``subsampling``: :func:`~pyro_ngvi.policies.noise_constants`)."""
    like = group.like
    pools = _pools(group, span)
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


def _momentum_branch(rho: float, run, fresh: List[bool]) -> str:
    """Which branch of the momentum average (:func:`~pyro_ngvi.update.mean_field.momentum`) applies:
    none (``rho`` = 0), every site has a momentum buffer, none has (``fresh``; a span's first step
    takes g), or some have (the pass's ``started`` says which)."""
    if rho == 0:
        return "none"
    if run is not None:
        return "span_first" if all(fresh) else "span"
    if not any(fresh):
        return "average"
    return "mixed"


def _last_signs(ctx, group: Group) -> Optional[torch.Tensor]:
    """The signs of the group's gradient at its last sampled step (``None``: none yet)."""
    last = ctx.signs.get(id(group))
    return last[1] if last is not None and last[0] is group else None


def keep_pass(ctx, group: Group, states, args: PassArguments, out, run, span: int):
    """Keep what the pass returned (``out``, of the pass on ``args``): the new mean and raw scale in
    the guide (only the mask's rows), :math:`\\sigma'` remembered, the momentum and adaptive state in
    the group's buffers, the stall test's signs and the flags. (Eagerly most of it was written in
    place by the pass.) Returns what :func:`~pyro_ngvi.steps.span_step` returns (in a ``run`` of
    spans, :meth:`Spans.finish` at its last span)."""
    mask, rho = args.inputs.mask, args.numbers.rho
    own_scale = group.owned("scale")

    def store(target: torch.Tensor, value: torch.Tensor) -> None:  # (eagerly written in place already)
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)

    steps = out.adaptive
    if steps is not None:
        for name in ("count", "hdrift") + (() if steps.drift is None else ("drift",)):
            store(getattr(args.inputs, name), getattr(steps, name))
        start = 0
        for state, blocks in zip(states, _pools(group, span)):
            pick = start if len(blocks) == 1 else slice(start, start + len(blocks))
            state.steps, state.noise = steps.steps[pick], steps.noise[:, pick]
            start += len(blocks)
    if rho != 0:
        store(args.inputs.momentum, out.momentum)
    if run is not None:  # one site, no mask: the span is written
        run.clamped.append(out.clamped)
        if out.spread is not None:
            run.spread = run.spread + out.spread
        if out.signs is not None:  # (after the pass read the last step's)
            group.owned("signs")[run.slice].copy_(out.signs)
            if out.far is not None:
                run.far = run.far + out.far
        return run.finish(ctx, group, args.branches.prior) if run.slice.stop == group.numel else None
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
        if out.mean is not group.locs[0]:  # (eagerly, from the group's own buffers: their pieces kept)
            torch._foreach_copy_(group.locs, group.pieces("mean", out.mean))
        if out.raw_scale is not group.raw_scales[0]:
            torch._foreach_copy_(group.raw_scales, group.pieces("raw", out.raw_scale))
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
    A large site's run of spans (:func:`~pyro_ngvi.steps.mean_field_group`): what it reads from
    the group's state once, at its start (which sites' momentum is fresh, the stall test's last
    signs, :math:`\\sigma`, the adaptive steps' inputs), and what it accumulates span by span:
    the current ``slice``, the adaptive steps' sums of the first pass, the counts of the stall test,
    the clamp flags and the spread of the watch on growing means. The mean, the raw scale,
    :math:`\\sigma`, the momentum and the signs are written in place, span by span; the last span
    keeps the rest (:meth:`finish`, from :func:`keep_pass`).
    """

    def __init__(self, ctx, group: Group, stats: List[SiteCurvature], states, settings: Settings, span: int):
        like = group.like
        first = stats[0]
        self.momentum_fresh = [state.momentum is None for state in states]
        self.adaptive = self.levels = None  # the adaptive steps' inputs, and their noise pooled over the spans
        self.sums: list = []  # the first pass's sums of squared innovations and their counts, span by span
        self.slice = slice(0, 0)
        self.size, self._kept = group.numel, None
        self.clamped: List[torch.Tensor] = []
        self.spread = torch.zeros((), dtype=like.dtype, device=like.device)  # sum lambda_0 (mu - m_0)^2
        self.far = 0
        self.last_signs = _last_signs(ctx, group)
        self.sampled = stall_test(first)
        known_scales = _known_scales(group, stats)
        if adaptive_for(first, ctx.options):  # the noise is pooled over the whole site first
            self.adaptive = _adaptive_inputs(group, states, settings.beta, settings.momentum,
                                             ctx.options.warm_start, span, ctx.subsampling)
        self.scale = group.sigma(known_scales)

    def kept(self, workspace, w, like: torch.Tensor):
        """The scratch ``w`` of the current span with its ``precision``, ``scale`` and ``c`` the span of
        three buffers as long as the site (``Branches.kept``: the adaptive steps' second pass reads the
        :math:`\\lambda`, :math:`\\lambda^{-1/2}` and innovation of the first instead of computing them
        again; made once per optimizer, as the workspace's)."""
        if self._kept is None:
            self._kept = workspace.take(self.size, like, 3)
        precision, root, innovation = (buffer[self.slice] for buffer in self._kept)
        return w._replace(precision=precision, scale=root, c=innovation)

    def noise_levels(self):
        """The adaptive steps' noise levels, pooled over the whole site from the first pass's
        ``sums`` (:func:`~pyro_ngvi.elementwise.noise_pass`, span by span; pooled once)."""
        if self.levels is None:
            totals, counts = (sum(parts) for parts in zip(*self.sums))
            self.levels = pooled_levels(totals, counts, self.adaptive["noise"])
        return self.levels

    def finish(self, ctx, group: Group, prior: bool):
        """Keep the site's signs and remembered scale; the flags and the new scale, as
        :func:`~pyro_ngvi.steps.span_step` returns (the watch on growing means fed the spread the
        spans summed, given a ``prior``)."""
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
