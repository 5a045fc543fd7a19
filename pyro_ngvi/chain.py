"""
One NGVI step, from the statistics the shell (:class:`~pyro_ngvi.NGVI`) hands over to the guide's
tensors, as a chain that runs each layer once and in order:

1. the safeguard on the last step (the Newton guard may undo it, :mod:`~pyro_ngvi.safeguards`);
2. variance reduction across sites (the control variate's cross terms, :mod:`~pyro_ngvi.variance`);
3. the checks before any write (finiteness, read now or a few steps late, :mod:`~pyro_ngvi.checks`);
4. step sizes (schedules and per-site defaults, :mod:`~pyro_ngvi.policies`);
5. the Bayesian learning rule per group of sites (:mod:`~pyro_ngvi.steps`, which runs the element-wise
   pass of :mod:`~pyro_ngvi.update`), full-covariance steps computed before anything is written;
6. the writes: the point optimizer's step, the mean-field groups, the coupled mean step, the
   dense sites, the priors' M-step, and the watches' inputs.

A step that cannot be completed leaves everything unchanged: whatever can refuse it runs before
the first write.
"""

from typing import Callable, Dict, List, NamedTuple, Optional

from .checks import read_checks, sync_every, warn_skip
from .family import FullCovarianceSite, SiteCurvature, step_loss
from .policies import Settings, resolve, scheduled
from .priors import update_learned_priors
from .safeguards import Safeguards, finite, noisy_flags, warn_dense_stall
from .state import advance, schedule_clock
from .statistics import one_draw
from .steps import Context, GuardedStep, Options, couple_means, dense_adaptive, dense_site, mean_field_group, start_of
from .variance import cross_terms


class Config(NamedTuple):
    """The optimizer's settings, as the chain reads them (``NGVI``'s arguments)."""

    lr: object  # a number, a schedule or None (per site)
    beta: object
    tau: object
    momentum: Optional[float]
    damping: Optional[float]
    options: Options
    safeguard: bool
    sync_every: Optional[int]
    compile: bool
    watch_elbo: bool


class Request(NamedTuple):
    """What the shell hands the chain for one step."""

    plan: object  # pyro_ngvi.plan.Plan
    states: list  # each site's SiteState, in the order of plan.sites
    stats: Dict  # site key -> its statistics
    others: List  # the point optimizer's tensors
    learned: bool  # prior params set in closed form this step
    svi: object  # the SVI running the step (None: called directly)
    state_of: Callable  # site -> SiteState
    point_step: Callable  # others -> None: the point optimizer's step


def take_step(optim, config: Config, request: Request) -> bool:
    """
    One step of the Bayesian learning rule on the plan's sites, whole or not at all (returns
    whether it was taken; ``optim`` keeps the counts of steps taken, skipped and rejected, the
    workspace and the watches).
    """
    plan, states, stats, others, learned, svi = request[:6]
    sites, mean_field, dense_sites = plan.sites, plan.mean_field, plan.dense_sites
    evaluation = _evaluation(stats)
    objective, arguments = (None, None) if evaluation is None else (evaluation.objective, evaluation.arguments)
    # 1. F compares guide steps only: not while other parameters move with them
    guarded = (config.safeguard and objective is not None and not callable(config.lr) and not learned
               and not any(p.grad is not None for p in others))
    if guarded and plan.newton.rejects(mean_field, objective, optim.num_steps, arguments):
        optim.num_rejected_steps += 1
        for site in sites:
            request.state_of(site).momentum = None
        return False
    # 2. the cross terms of the control variate
    cross = cross_terms(mean_field, stats, request.state_of) if config.options.control_variate else None
    # 3. on CUDA the host reads the checks every few steps (pyro_ngvi.checks): meanwhile a step
    # with non-finite statistics writes nothing (masked)
    groups = plan.groups_for(mean_field, stats)
    group_stats = [[stats[site.key] for site in group.sites] for group in groups]
    flats = [(group.gather("grad", [s.grad for s in st]), group.gather("curvature", [s.curvature for s in st]))
             for group, st in zip(groups, group_stats)]
    every = sync_every(sites[0].loc.device, config.sync_every) if sites else 1
    ok = None
    if every > 1 and not (dense_sites or guarded or learned or cross is not None
                          or any(p.grad is not None for p in others)):
        checks = [finite(g, h, mask=st[0].mask, exact=True) for (g, h), st in zip(flats, group_stats)]
        ok = plan.deferred.add(checks, [", ".join(repr(site.name) for site in group.sites) for group in groups],
                               states)
    elif not read_checks(optim, plan, sites, stats, groups, group_stats, flats, others):
        return False
    # 4. step sizes
    clock = schedule_clock(states)  # the guide's own step count (pyro_ngvi.state)
    lr, beta, tau = scheduled(config.lr, config.beta, config.tau, clock)

    def settings_of(site_stats, dense=False, sampled=False) -> Settings:
        return resolve(Settings(lr, beta, config.momentum, config.damping), site_stats, dense, sampled)

    state_of = {site.key: state for site, state in zip(sites, states)}
    context = Context(config.options, clock, plan.signs, optim._spread_watch, GuardedStep(plan.newton.factor)
                      if guarded else None, config.compile, ok, optim._workspace, plan.subsampling)
    # 5. full-covariance steps are computed before anything is written: one whose new
    # precision is not positive definite skips the whole step
    dense_steps = []
    for site in dense_sites:
        adaptive = dense_adaptive(site, stats[site.key], context.options)
        # (a low-rank site's adaptive steps start from the constant ones: one draw's rank-2 target)
        settings = settings_of(stats[site.key], dense=True, sampled=adaptive and isinstance(site, FullCovarianceSite))
        step = dense_site(context, site, stats[site.key], settings, tau, state_of[site.key], adaptive)
        if step is None:
            optim.num_skipped_steps += 1
            warn_skip(optim, f"the new precision of {site.name!r} is not numerically positive definite (or "
                      "its eigen-decomposition did not converge); the guide is unchanged",
                      "Lower beta or add damping.", every=True, stacklevel=5)
            return False
        dense_steps.append((step, settings.momentum))
    # 6. the writes
    request.point_step(others)  # before any guide write: it may still fail
    if guarded:  # the point to come back to
        plan.newton.keep(mean_field, objective, arguments)
    coupled_start = None if cross is None else start_of(cross.sites, plan.subsampling)
    new_scales = {}  # sigma after the update, for the prior M-step
    for group, st, (grad, curvature) in zip(groups, group_stats, flats):
        group_states = [state_of[site.key] for site in group.sites]
        settings = settings_of(st[0])
        if guarded:  # the Newton step damped by the safeguard
            settings = settings._replace(lr=settings.lr / plan.newton.factor)
        clamped, far, sigma, spreading = mean_field_group(context, group, st, grad, curvature, settings, tau,
                                                          group_states)
        plan.safeguards.append(Safeguards(group, group_states, clamped, far, spreading,
                                          noisy_flags(group_states, plan.subsampling)))
        if learned and sigma is not None:
            new_scales.update((site.key, piece.view_as(site.loc))
                              for site, piece in zip(group.sites, sigma.split(group.sizes)))
    if guarded:
        plan.newton.predicted = float(context.guarded.predicted)
    if cross is not None:  # the regression takes this step's gradients (not before: a skipped step)
        cross.state.cross = cross.new
        couple_means(cross, coupled_start, config.options.max_step)
    for site, ((step, direction, kept), rho) in zip(dense_sites, dense_steps):
        site.write(*step)
        state = state_of[site.key]
        state.started = True
        if rho:
            state.momentum = direction
        for name, value in kept.items():  # the adaptive steps' count and drift test
            setattr(state, name, value)
        if isinstance(site, FullCovarianceSite):  # (a low-rank site's wide start converges slowly, not stalls)
            warn_dense_stall(site, state)
    if learned:
        update_learned_priors([(site.mean, new_scales[site.key] if site.key in new_scales else site.scale,
                                stats[site.key]) for site in mean_field if stats[site.key].prior_params()])
    if config.watch_elbo:
        watch_elbo(plan, stats, tau, svi)
    optim.num_steps += 1
    advance(states)
    if ok is not None and len(plan.deferred) >= every:
        read_checks(optim, plan, [], {}, [], [], [], [])  # the deferred steps' checks
    return True


def _evaluation(stats: Dict) -> Optional[SiteCurvature]:
    """The first statistics that carry the objective :math:`F` for the Newton guard (``None``: none do)."""
    for s in stats.values():
        if isinstance(s, SiteCurvature) and s.objective is not None:
            return s
    return None


def watch_elbo(plan, stats, tau: float, svi) -> None:
    """Feed the ELBO watch (:mod:`pyro_ngvi.monitor`) the loss this step's ELBO handed over (a
    Pyro loss: the one ``SVI.step`` computed, :func:`~pyro_ngvi.family.step_loss`); at another
    temperature than 1 that loss is not the objective: start again."""
    loss = None
    for s in stats.values():
        if not getattr(s, "watched", True):  # (not one family's ELBO)
            return
        if loss is None:
            loss = getattr(s, "loss", None)
    loss = step_loss(svi) if loss is None and svi is not None else loss
    if loss is None:
        return
    if tau != 1:
        plan.elbo_watch.reset()
        return
    plan.elbo_watch.one_draw = svi is not None and one_draw(svi)
    flag = plan.elbo_watch.add(loss)
    if flag is not None:  # (kept until the host reads it: not every step does)
        plan.elbo_flag = flag
