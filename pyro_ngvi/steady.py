"""
The steady state of a guide structure (issue 24): a step that takes the decisions of the step
before it, made once and replayed.

Once a :class:`~pyro_ngvi.plan.Plan`'s sites have started (constant steps, their momentum
buffers made), a step of a :class:`~pyro_ngvi.BayesianNet`'s recipe takes every branch of the
chain of :mod:`~pyro_ngvi.chain` as the step before took it, step after step: the same groups, the
same pass arguments (:func:`~pyro_ngvi.group_io.read_pass`: the same flat buffers and views, the
same :class:`~pyro_ngvi.elementwise.Branches` and :class:`~pyro_ngvi.elementwise.Numbers`), no
guard, no cross terms, no dense site. The checks are read at once (K = 1, the CPU's default) or every K
steps (``NGVI.sync_every``, :data:`~pyro_ngvi.checks.SYNC_EVERY_CUDA` on CUDA): then, as the chain's
deferred step, each group's finiteness :math:`\\mathrm{ok} = [\\sum g + \\sum h \\text{ finite}]` is kept
(:class:`~pyro_ngvi.checks.DeferredChecks`), the pass writes :math:`\\mu' \\leftarrow \\mathrm{ok}\\,?\\,
\\mu' : \\mu` (and so :math:`\\sigma'` and the momentum), and at the K-th step the host reads the steps'
flags and the safeguards' in one sync and settles them (:func:`~pyro_ngvi.checks.settle_checks`: a
non-finite step's count taken back and warned of, late). Point parameters beside the sites (a learned
noise scale, a BatchNorm's weights) are stepped by the point optimizer as the chain steps them, after
the checks (theirs read at once with the sites', as the chain reads a step with point gradients) and
before the groups' writes. :meth:`SteadyStep.build` asks the
chain's own functions for those decisions after a step the chain took (the arguments
:func:`~pyro_ngvi.group_io.read_pass` gives for the next step), and keeps them only where they
are the steady ones; :meth:`SteadyStep.run` then takes the next step with them: each group's
:math:`g` and :math:`h` flat, the checks (finite, the last step's flags) read, the element-wise pass
(:func:`~pyro_ngvi.elementwise.mean_field_pass`, the update
:math:`\\lambda' = (1-\\beta)\\lambda + \\beta(\\lambda_0 + h)`,
:math:`\\mu' = \\mu - \\alpha(\\bar g + \\lambda_0(\\mu - m_0))/(\\lambda' + \\gamma)`), the guide
written, :math:`\\sigma'` remembered, the safeguards' flags, the ELBO watch and the counts kept:
the same operations in the same order as the chain, so the same values to the bit. It holds
while everything that decided a branch is as it was: NGVI's settings, the ``SVI`` and its ELBO,
no state waiting from ``set_state``, no process group, the sites' states (their momentum the
group's buffer, started), and each site's statistics of the same kind with the same prior, floor
and :math:`\\sigma` tensors (:meth:`SteadyStep.fits`). Anything else, and whenever a check or a
safeguard fires, goes to the chain (the flags already read are handed to
:func:`~pyro_ngvi.checks.settle_checks`), which builds the steady step anew after its step.

The traced path (``AutoNormal``, ``Trace_ELBO`` of one particle, ``NGVI()``): from the second step on,
the chain takes the same branches there too (the adaptive steps' rates and the safeguards are masks
inside the pass; the stall test has its last signs; no cross terms where the sites with known draws hold
more than :data:`~pyro_ngvi.variance.CROSS_MAX` elements or one). The steady step then recovers each
site's :math:`\\hat g, \\hat h, \\epsilon = \\sigma\\hat h/\\hat g` from the gradients as the chain does
(:func:`~pyro_ngvi.statistics.step_statistics`; handed to the chain where they do not :meth:`SteadyStep.fits`),
reads anew the draws and the adaptive steps' pooled noise (``_Group.refreshed``), and keeps the pass's
state as the chain keeps it (:func:`~pyro_ngvi.group_io.keep_pass`, the noisy-curvature flags).
"""

import math
import weakref
from operator import attrgetter
from dataclasses import replace
from typing import List, Optional

import torch

from .checks import read_flags, settle_checks, sync_every, take_flags
from .draws import particles
from .elementwise import Inputs, mean_field_pass
from .family import SiteCurvature, step_loss
from .groups import flat
from .group_io import adaptive_for, keep_pass, read_pass, stall_test
from .handover import _live_handover, give_back, take_curvatures  # (the counter read without a call: per step)
from .hot_path import no_grad, scalar
from .policies import Settings, resolve
from .safeguards import Safeguards, finite, noisy_flags
from .scales import Remembered
from .statistics import one_draw, step_statistics
from .steps import SPAN, Context, workspace_scratch
from .variance import CROSS_MAX, takes_cross_terms

#: what the step reads off each site's statistics and state (by ``map``: no Python-level call per site)
_GRAD, _CURVATURE, _TAKEN = attrgetter("grad"), attrgetter("curvature"), attrgetter("taken")

OK = Inputs._fields.index("ok")  # (where a group of one's template holds a masked step's flag)


def settings_key(optim) -> tuple:
    """NGVI's settings that decide a step's branches (compared whole at every steady step)."""
    return (optim.lr, optim.beta, optim.tau, optim.momentum, optim.damping, optim.max_step, optim.sync_every,
            optim.watch_elbo, optim.control_variate, optim.warm_start, optim.averaging, optim.safeguard,
            optim.compile)


def _flags(s: SiteCurvature) -> tuple:
    """What of a site's statistics decides its step's branches (:func:`~pyro_ngvi.groups.statistics_kind`
    and what :func:`~pyro_ngvi.group_io.read_pass` reads of it), but its tensors (:func:`_kind`)."""
    return (s.mask is None, s.sampled, s.nonnegative, s.eps_mean is None, s.eps_sq_mean is None, s.num_data,
            s.gradients, s.draws)


def _kind(s: SiteCurvature) -> tuple:
    """:func:`_flags`, and the tensors a steady step takes as given: sigma, the prior's and the floor's
    (each with its version: a fixed prior's flat copy is kept while they are unchanged)."""
    return (_flags(s), s.scale) + tuple(x for t in (s.prior_precision, s.prior_loc, s.min_precision)
                                         for x in (t, None if t is None else t._version))


class _Group:
    """One group's part of a steady step: its pass's arguments and where its flat tensors come from
    and go to."""

    __slots__ = ("group", "states", "start", "stop", "args", "template", "scratch", "gather", "gathered",
                 "mean_views", "sources", "write_to", "write_from", "momentum", "views", "remember", "count", "ctx", "name",
                 "traced")

    def __init__(self, group, states, start: int, args, scratch, ctx):
        self.group, self.states, self.start, self.stop = group, states, start, start + len(group.sites)
        self.args, self.scratch, self.ctx = args, scratch, ctx
        self.template = list(args.inputs)  # (a group of one: this step's g and h are views of its own)
        self.gathered = not group.one
        cached = group.cache
        self.gather = None if group.one else cached[("views", "grad")] + cached[("views", "curvature")]
        self.mean_views = None if group.one else cached[("views", "mean")]
        self.sources = None if group.one else group.loc_tensors
        if (args.branches.masked or args.inputs.raw_scale is not None) and not group.one:  # (the raw scale read
            self.mean_views = self.mean_views + cached[("views", "raw")]  # too, gathered)
            self.sources = group.loc_tensors + group.raw_tensors
        self.name = ", ".join(repr(site.name) for site in group.sites)  # (a deferred check's, as the chain's)
        self.write_to = self.write_from = None  # the group's tensors written back from its flat buffers
        if not group.one and not args.branches.masked:
            self.write_to = group.locs + (group.raw_scales if args.inputs.out_raw_scale is not None else [])
            self.write_from = list(group.pieces("mean", args.inputs.out_mean)) + (
                list(group.pieces("raw", args.inputs.out_raw_scale)) if args.inputs.out_raw_scale is not None else [])
        self.momentum = args.inputs.momentum
        self.views = None if self.momentum is None else cached[("state", "momentum")][1]
        own = group.owned("scale")
        self.remember = Remembered(group.raw_tensors, group.cached("scale views", lambda: group.views(own)))
        self.count = scalar(float(group.numel), own)
        # the statistics recovered from the gradients (the traced path): the parts of the pass read anew
        # each step, as read_pass reads them (the draws, the adaptive steps' pooled noise, the stall test)
        self.traced = args.branches.rates == "adaptive" or args.branches.control_variate or args.branches.signs


    def refreshed(self, inputs: Inputs, stats: List[SiteCurvature]) -> Inputs:
        """``inputs`` with what :func:`~pyro_ngvi.group_io.read_pass` reads anew at each step of the traced
        path: the draws recovered this step and the adaptive steps' pooled noise of the sites' states."""
        if inputs.eps_mean is not None:
            inputs = inputs._replace(eps_mean=flat([s.eps_mean for s in stats]), eps_sq_mean=None if inputs.eps_sq_mean
                                     is None else flat([s.eps_sq_mean for s in stats]))
        if inputs.noise is not None:
            noise = inputs.noise._replace(steps=torch.cat([state.steps.reshape(-1) for state in self.states]),
                                          noise=torch.cat([state.noise.reshape(2, -1, 2) for state in self.states],
                                                          dim=1))
            inputs = inputs._replace(noise=noise)
        return inputs


class SteadyStep:
    """A plan's steady step (module docstring): :meth:`build` after a step of the chain, :meth:`run`
    at the steps after while it :meth:`holds` and the statistics :meth:`fits`."""

    __slots__ = ("settings", "svi", "elbo", "locs", "states", "kinds", "groups", "tau", "one_draw", "records", "flags",
                 "every", "others", "deferred", "sites", "handed")

    @classmethod
    @no_grad
    def build(cls, optim, plan, config, states, stats, svi, others, plain: bool) -> Optional["SteadyStep"]:
        """The steady step of ``plan`` after the step the chain just took (with ``config``, on the
        sites' ``states`` and ``stats``, under ``svi``; ``plain``: no draws read, no KL in closed form,
        no learned prior, no process group), or ``None`` where the next step would not be one."""
        sites = plan.sites
        # the traced path (Trace_ELBO, module docstring): statistics recovered from one draw's gradients
        traced = svi is not None and not getattr(getattr(svi.loss_and_grads, "__self__", None), "produces_curvature",
                                                 False)
        if (not plain or svi is None or not sites or plan.dense_sites or plan.weighted
                or len(plan.mean_field) != len(sites) or config.compile or callable(config.lr)
                or callable(config.beta) or callable(config.tau)):
            return None
        # checks read every K steps: the chain's step was deferred (none of what reads them at once:
        # no dense site, guard, learned prior, cross terms or point parameter with a gradient), its writes masked
        every = sync_every(sites[0].loc.device, config.sync_every)
        # (a step whose point parameters have gradients is checked at once: its point step writes unmasked)
        deferred = every > 1 and not any(p.grad is not None for p in others)
        if (not deferred and len(plan.deferred)) or (traced and (every > 1 or particles(svi) is not None)):
            return None
        ordered = [stats[site.key] for site in sites]
        crossed = sum(site.loc.numel() for site, s in zip(sites, ordered)  # (pyro_ngvi.variance.cross_terms'
                      if isinstance(s, SiteCurvature) and takes_cross_terms(s))  # sites: none where too many)
        for s in ordered:
            if (type(s) is not SiteCurvature or not s.fitted or s.objective is not None or not s.watched
                    or (s.loss is None) != traced or s.prior_params() or s.mask is not None
                    or (not traced and (stall_test(s) or adaptive_for(s, config.options)))
                    or (config.options.control_variate and takes_cross_terms(s) and (not traced or 1 < crossed <= CROSS_MAX))):
                return None  # (decided before read_pass below, which would make the buffers of these)
        groups = plan.groups_for(plan.mean_field, stats)
        # the next step's statistics, as this step's but with the sigma this step wrote (the views the
        # sites remember: what the ELBO reads next; read_pass copies any other sigma into the group's own)
        scales = {}
        for group in groups:
            own = group.owned("scale")
            scales.update(zip([site.key for site in group.sites],
                              group.cached("scale views", lambda: group.views(own))))
        if not traced:  # (recovered statistics carry no sigma: read_pass reads the one remembered)
            ordered = [replace(s, scale=scales[site.key]) for s, site in zip(ordered, sites)]
        order = {site.key: j for j, site in enumerate(sites)}
        if [order[site.key] for group in groups for site in group.sites] != list(range(len(sites))):
            return None  # (the groups in the sites' order: each a slice of them)
        steady = cls()
        steady.settings, steady.tau = settings_key(optim), config.tau
        steady.svi, steady.elbo = weakref.ref(svi), svi.loss_and_grads
        steady.one_draw = one_draw(svi)
        steady.locs, steady.states = [site.loc for site in sites], states
        steady.kinds = [_kind(s) for s in ordered]
        steady.groups, steady.records, steady.flags, steady.every, steady.others = [], None, [], every, list(others)
        steady.deferred, steady.sites, steady.handed = deferred, (sites if traced else None), None
        clock = max([state.taken for state in states], default=0)
        given = Settings(config.lr, config.beta, config.momentum, config.damping)
        start = 0
        for group in groups:
            group_states, group_stats = states[start:start + len(group.sites)], ordered[start:start + len(group.sites)]
            if group.one and group.numel > SPAN:
                return None
            ok = None if not deferred else torch.ones((), dtype=torch.bool, device=group.like.device)  # (each step's)
            ctx = Context(config.options, clock, plan.signs, optim._spread_watch, None, False, ok, optim._workspace,
                          plan.subsampling)
            grad = group.gather("grad", [s.grad for s in group_stats])
            curvature = group.gather("curvature", [s.curvature for s in group_stats])
            args = read_pass(ctx, group, group_stats, grad, curvature, resolve(given, group_stats[0]), config.tau,
                             group_states, False, SPAN)
            b = args.branches
            if traced and (b.rates not in ("constant", "adaptive") or b.signs != b.far or args.inputs.fresh is not None
                           or b.recover_draws or b.tau or b.masked):
                return None  # (the stall test once it has the last step's signs; every site started)
            if ((not traced and (b.rates != "constant" or b.control_variate or b.signs or b.far or b.recover))
                    or b.momentum not in ("none", "average") or b.mask or b.guarded or b.masked != (ok is not None)
                    or b.branch_free or b.prepared or b.kept or not b.known_scale or args.inputs.scale is not group.owned("scale")
                    or args.inputs.out_scale is not (None if b.masked else args.inputs.scale)):
                return None
            steady.groups.append(_Group(group, group_states, start, args,
                                        workspace_scratch(optim._workspace, grad.numel(), grad), ctx))
            start += len(group.sites)
        return steady

    def holds(self, optim, svi) -> bool:
        """Whether nothing that decided the steady step's branches changed outside the sites'
        statistics (those: :meth:`fits`)."""
        return (svi is not None and self.svi() is svi and svi.loss_and_grads is self.elbo and optim._loss_checked
                and not optim._pending_states and not optim._restored and settings_key(optim) == self.settings)

    def fits(self, stats: List[Optional[SiteCurvature]]) -> bool:
        """Whether this step's statistics (one per site, as handed over) are of the kinds, with the
        tensors, the steady step was built on, and the sites' states as it left them."""
        live = _live_handover[0]
        for s, (flags, scale, pp, ppv, pl, plv, mp, mpv) in zip(stats, self.kinds):  # (tensors by identity)
            if (s is None or (self.sites is None and s.handover != live) or type(s) is not SiteCurvature or not s.fitted
                    or s.objective is not None or not s.watched or s.prior_loc_param is not None
                    or s.prior_scale_param is not None or s.scale is not scale or s.prior_precision is not pp
                    or s.prior_loc is not pl or s.min_precision is not mp
                    or (s.mask is None, s.sampled, s.nonnegative, s.eps_mean is None, s.eps_sq_mean is None,
                        s.num_data, s.gradients, s.draws) != flags
                    or (pp is not None and pp._version != ppv) or (pl is not None and pl._version != plv)
                    or (mp is not None and mp._version != mpv)):
                return False
        if (stats[0].loss is None) != (self.sites is not None):
            return False
        for part in self.groups:
            for j, state in enumerate(part.states):
                if state.started is not True or (part.views is not None and state.momentum is not part.views[j]):
                    return False
        return True

    @no_grad
    def run(self, optim, plan, svi, point_step) -> Optional[bool]:
        """The step (returns whether it was taken, as :func:`~pyro_ngvi.chain.take_step`; ``point_step``:
        the point optimizer's step on the plan's other parameters, as the chain's), or ``None``, nothing
        done, where this step's statistics do not :meth:`fits` (the chain takes it)."""
        point = [p for p in self.others if p.grad is not None] if self.others else []  # (as read_checks reads them)
        if self.sites is None:
            stats = take_curvatures(self.locs)
        elif particles(svi) is not None or point:
            return None  # (nothing taken yet: the chain reads the draws, or checks the point step's at once)
        else:  # recovered from the gradients as the chain recovers them (written over them: handed to it if unfit)
            stats = list(step_statistics(self.sites, svi, optim.control_variate, optim._buffers).values())
        if not self.fits(stats) or self.deferred != (self.every > 1 and not point):
            if self.sites is None:
                give_back(self.locs, stats)  # (for the chain, as they were handed over)
            else:
                self.handed = dict(zip([site.key for site in self.sites], stats))
            return None
        # the flat g and h of each group, and the checks: finite, and the last step's flags
        flats, parts = [], []
        for part in self.groups:
            mine = stats[part.start:part.stop]
            if part.gathered:
                torch._foreach_copy_(part.gather, list(map(_GRAD, mine)) + list(map(_CURVATURE, mine)))  # (no call each)
                grad, curvature = part.args.inputs.grad, part.args.inputs.curvature
            else:
                grad, curvature = mine[0].grad.reshape(-1), mine[0].curvature.reshape(-1)
            flats.append((grad, curvature))
            if not self.deferred:
                parts += (grad.sum(), curvature.sum())
        if not self.deferred:
            if point:
                parts += [p.grad.sum() for p in point]
            ok = None
            records, plan.safeguards = plan.safeguards, []
            elbo_flag, plan.elbo_flag = plan.elbo_flag, None
            # (the flags of its own last step kept as it made them: Safeguards.flags, in order)
            flags = list(self.flags) if records is self.records else [f for r in records for f in r.flags()]
            if elbo_flag is not None:
                flags.append(elbo_flag)
            values = read_flags(parts + flags)
            if records is self.records and math.isfinite(sum(values[:len(parts)])) and not any(values[len(parts):]):
                plan.skips_in_a_row = 0
            else:  # a check or a safeguard fired, or the flags are a chain's step's: settled as the chain does
                # (called at the depth of read_checks, under the chain's: the warnings point where the chain's do)
                sites, pairs = [site for part in self.groups for site in part.group.sites], 2 * len(flats)
                if not settle_checks(optim, plan, sites, dict(zip([site.key for site in sites], stats)),
                                     [part.group for part in self.groups], point,
                                     [((g, h), None) for g, h in flats] + [((p.grad,), None) for p in point],
                                     [parts[j:j + 2] for j in range(0, pairs, 2)] + [[s] for s in parts[pairs:]], [],
                                     records, elbo_flag, values):
                    return False
        else:  # read K steps late: this step's finiteness kept, its writes masked (pyro_ngvi.chain.take_step)
            ok = plan.deferred.add([finite(g, h, exact=True) for g, h in flats], [part.name for part in self.groups],
                                   self.states)
        # the step: the point optimizer's first (pyro_ngvi.chain.take_step: it may still fail), then the groups'
        if self.others:
            point_step(self.others)
        clock = max(map(_TAKEN, self.states))
        self.records, self.flags = plan.safeguards, []  # (deferred: the steps' records since the last read)
        for part, (grad, curvature) in zip(self.groups, flats):
            args = part.args
            if part.gathered:
                torch._foreach_copy_(part.mean_views, part.sources)
                inputs = args.inputs if ok is None else args.inputs._replace(ok=ok)
                if part.traced:
                    inputs = part.refreshed(inputs, stats[part.start:part.stop])
            else:
                template = part.template
                template[2], template[3] = grad, curvature
                if ok is not None:
                    template[OK] = ok
                inputs = Inputs(*template)
                template[2] = template[3] = template[OK] = None  # (not kept alive until the next step)
                if part.traced:
                    inputs = part.refreshed(inputs, stats[part.start:part.stop])
            out = mean_field_pass(args.branches, inputs, args.numbers, part.group.transform, part.scratch)
            if part.traced:  # (the adaptive state, the stall test's signs: as the chain keeps them)
                clamped, far, _, spreading = keep_pass(part.ctx._replace(step=clock), part.group, part.states,
                                                       args._replace(inputs=inputs), out, None, SPAN)
                record = Safeguards(part.group, part.states, clamped, far, spreading,
                                    noisy_flags(part.states, plan.subsampling))
                plan.safeguards.append(record)
                self.flags += record.flags()
                continue
            if out.mean is not inputs.mean or out.raw_scale is not (inputs.out_raw_scale if part.gathered else
                                                                   inputs.raw_scale) or out.scale is not inputs.scale:
                clamped, _, _, spreading = keep_pass(part.ctx._replace(step=clock), part.group, part.states,
                                                     args._replace(inputs=inputs), out, None, SPAN)
            else:  # (pyro_ngvi.group_io.keep_pass, as it goes for these arguments)
                if part.momentum is not None and out.momentum is not part.momentum \
                        and out.momentum.data_ptr() != part.momentum.data_ptr():
                    part.momentum.copy_(out.momentum)
                spreading = None if out.spread is None else optim._spread_watch.flag(
                    part.group, out.spread / part.count, clock)
                if part.write_to is not None:
                    torch._foreach_copy_(part.write_to, part.write_from)
                part.remember()
                clamped = out.clamped
            plan.safeguards.append(Safeguards(part.group, part.states, clamped, None, spreading, None))
            self.flags += (clamped,) if spreading is None else (clamped, spreading)
        if optim.watch_elbo:  # (pyro_ngvi.chain.watch_elbo)
            if self.tau != 1:
                plan.elbo_watch.reset()
            else:
                plan.elbo_watch.one_draw = self.one_draw
                loss = stats[0].loss if self.sites is None else step_loss(svi)
                flag = None if loss is None else plan.elbo_watch.add(loss)
                if flag is not None:
                    plan.elbo_flag = flag
        optim.num_steps += 1
        for state in self.states:
            state.taken += 1
        if ok is not None and len(plan.deferred) >= self.every:
            # (pyro_ngvi.checks.read_checks of the chain's step, at its depth: the warnings point where its do)
            settle_checks(optim, plan, [], {}, [], [], [], [], *take_flags(plan, []))
        return True
