"""
:class:`NGVI`: the Bayesian learning rule for Gaussian guides as a
:class:`pyro.optim.PyroOptim` that ``pyro.infer.SVI`` can drive.

The shell: it finds the guide's Gaussian sites (:mod:`~pyro_ngvi.family`, kept per guide
structure in a :class:`~pyro_ngvi.plan.Plan`), takes their statistics
(:mod:`~pyro_ngvi.statistics`) and hands them to the chain of :mod:`~pyro_ngvi.chain` (the
safeguards, variance reduction, step sizes, the update, the writes), whose point optimizer, a
torch optimizer, trains everything else; it keeps state per site for
:meth:`~NGVI.get_state` / :meth:`~NGVI.set_state`.
"""

import copy
import math
import numbers
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

import pyro
from pyro.optim.optim import PyroOptim

from .chain import Config, Request, take_step
from .arguments import check_load_arguments
from .checkpoint import safe_load
from .checks import check_step_arguments, read_checks
from .distributed import all_reduce_stats, is_distributed, without_draws
from .draws import GuideDraws
from .family import GaussianSite, SiteCurvature, calling_svi, end_handover, guide_parts, split_params
from .groups import Workspace
from .hot_path import kept_caller
from .mean_field_kl import analytic_locs, mean_field_elbo, move_prior_to_draws
from .monitor import NGVIWarning, SpreadWatch
from .plan import Plan, Plans
from .policies import (DENSE, DENSE_SAMPLED, FULL_BATCH, MINIBATCH, Checked, Schedule, Settings, check_schedule,
                       defaults, number, resolve)
from .point import (LowRankLocs, check_point_args, check_point_optim, check_point_states, clamp_gradients,
                    decay_guide_part_lr, param_label, probe_point_step)
from .state import SiteState, check_pending, check_state, restore_scales, warn_unmatched
from .statistics import Buffers, step_statistics, warn_loss_function
from .steady import SteadyStep
from .steps import Options

__all__ = ["NGVI", "NGVIWarning", "Settings", "defaults", "FULL_BATCH", "DENSE", "DENSE_SAMPLED", "MINIBATCH"]


def _calling_svi(optim):
    """The SVI whose step calls ``optim`` (:func:`~pyro_ngvi.family.calling_svi`), confirmed at
    the calling frame while it is the one found last (``optim._svi``: weak references)."""
    svi = kept_caller(getattr(optim, "_svi", None), "optim", optim, depth=3)
    if svi is None:
        svi = calling_svi("optim", optim)
        optim._svi = None if svi is None else (weakref.ref(svi), weakref.ref(optim))
    return svi


class NGVI(PyroOptim):
    """
    Natural-gradient variational inference: the variational online-Newton (VON / VOGN)
    form of the Bayesian learning rule [1, 2] for the Gaussian sites of a guide
    (:class:`~pyro.infer.autoguide.AutoNormal`, ``AutoDiagonalNormal``,
    ``AutoMultivariateNormal``, :class:`~pyro_ngvi.KroneckerNormal`). Per site, in its
    unconstrained coordinates, :math:`q(u) = \\mathcal{N}(\\mu, \\lambda^{-1})`; with
    :math:`g, h` the gradient and diagonal curvature of the non-conjugate part of the
    negative log joint at :math:`u \\sim q` and :math:`(m_0, \\lambda_0)` a prior that
    enters conjugately,

    .. math::

        \\lambda' = (1 - \\beta)\\lambda + \\beta (\\lambda_0 + h / \\tau)\\;[+\\text{Lin et al.'s
        correction [3] where the target is} \\le 0], \\qquad
        \\mu' = \\mu - \\alpha \\, \\frac{\\bar g + \\lambda_0 (\\mu - m_0)}{\\lambda' + \\gamma},

    with :math:`\\bar g` the momentum average of :math:`g/\\tau` (:mod:`pyro_ngvi.update`).
    With ``Trace_ELBO`` the statistics are recovered from the ordinary gradients (Price's
    theorem [4]); :class:`~pyro_ngvi.CurvatureELBO` hands exact, Gauss-Newton or Fisher
    curvature and the conjugate prior. Under sampled curvature NGVI adds a control variate
    [5] (:mod:`~pyro_ngvi.variance`), adaptive steps (Polyak-Ruppert averaging once
    progress stalls, :mod:`~pyro_ngvi.policies`) and a trust region; statistics at the mean
    take the Newton-step safeguard [6] (:mod:`~pyro_ngvi.safeguards`). Parameters that are
    not Gaussian sites are trained by ``point_optim`` in the same step. The user guide,
    :doc:`/guide/update`, derives every piece and says how each default was chosen.

    :param lr: step :math:`\\alpha > 0` on the mean, or a callable of the guide's step count
        (default: None, per site by :func:`~pyro_ngvi.policies.defaults`)
    :param beta: step :math:`\\beta \\in (0, 1]` of the precision average, or a callable
        (default: None, per site)
    :param momentum: :math:`\\rho \\in [0, 1)` on the mean gradient (default: None, per site)
    :param damping: :math:`\\gamma \\ge 0` added to the precision in the mean step
        (default: None, per site: :math:`N h_0` for minibatch statistics of N examples)
    :param tau: temperature :math:`\\tau > 0`, or a callable for a warm-up (default: 1)
    :param max_step: trust radius of sampled (and damped Newton) mean steps, in standard
        deviations; ``None`` disables it and the precision's trust region (default: 3)
    :param bool warm_start: take the first positive curvature target whole (default: True)
    :param bool averaging: adaptive steps for sampled statistics (default: None, on
        exactly when neither ``lr`` nor ``beta`` is given)
    :param bool control_variate: the control variate where draws are known (default: True)
    :param bool safeguard: the Newton-step safeguard for statistics at the mean (default: True)
    :param point_optim: torch optimizer class for the other parameters (default: Adam)
    :param point_optim_args: its arguments, or a callable of the param name (default: :mod:`pyro_ngvi.point`)
    :param guide: the guide whose sites to update, when NGVI runs outside ``SVI``, its arguments
        bound (``functools.partial``) (default: None, the calling ``SVI``'s guide)
    :param bool compile: the mean-field update compiled by :func:`torch.compile`, the same
        step to a few ulps (:mod:`pyro_ngvi.update.fused`; default: False)

    :ivar int num_steps: updates taken. :ivar int num_skipped_steps: steps skipped for
        non-finite values. :ivar int num_rejected_steps: steps undone by the safeguard.
    :ivar sync_every: steps between the host's reads of the checks (:mod:`pyro_ngvi.checks`).

    **References**

    [1] `Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam`, Khan et al. (ICML 2018)
    [2] `Practical Deep Learning with Bayesian Principles`, Osawa et al. (NeurIPS 2019)
    [3] `Handling the Positive-Definite Constraint in the Bayesian Learning Rule`, Lin et al. (ICML 2020)
    [4] `The Variational Gaussian Approximation Revisited`, Opper and Archambeau (Neural Computation 2009)
    [5] `Reducing Reparameterization Gradient Variance`, Miller et al. (NeurIPS 2017)
    [6] `Damping Parameter in Marquardt's Method`, Nielsen (IMM-REP-1999-05, DTU, 1999)
    """

    #: :class:`~pyro_ngvi.CurvatureELBO` hands its statistics to an optimizer that says so.
    consumes_curvature = True
    # the hyperparameters, checked whenever set (None: the defaults, per site)
    lr = Checked(lambda name, v: check_schedule(name, v, 0.0, math.inf))
    beta = Checked(lambda name, v: check_schedule(name, v, 0.0, 1.0))
    tau = Checked(lambda name, v: check_schedule(name, v, 0.0, math.inf), optional=False)
    momentum = Checked(lambda name, v: number(name, v, 0.0, 1.0, "in [0, 1)", high_open=True))
    damping = Checked(lambda name, v: number(name, v, 0.0, math.inf, "a number"))
    max_step = Checked(lambda name, v: number(name, v, 0.0, math.inf, "a positive number or None", low_open=True))
    #: The host reads the finiteness and safeguard flags every this many steps
    #: (:mod:`pyro_ngvi.checks`; None: 16 on CUDA, 1 elsewhere).
    sync_every = Checked(lambda name, v: _whole_steps(v))
    #: The ELBO watch (:mod:`pyro_ngvi.monitor`) on; :func:`~pyro_ngvi.laplace` turns it off for its line search.
    watch_elbo = Checked(lambda name, v: _flag(name, v), optional=False)
    # the switches, checked when set too ("False" or 0.0 set between steps would be read as on or off)
    warm_start = Checked(lambda name, v: _flag(name, v), optional=False)
    averaging = Checked(lambda name, v: _flag(name, v), optional=False)
    control_variate = Checked(lambda name, v: _flag(name, v), optional=False)
    safeguard = Checked(lambda name, v: _flag(name, v), optional=False)
    compile = Checked(lambda name, v: _flag(name, v), optional=False)

    def __new__(cls, *args, **kwargs):
        """Refuses ``NGVI(params, ...)``, as Pyro's LR schedulers build their optimizer, before the
        arguments are bound (with ``optim_args={"lr": ...}`` Python's binding raised an obscure
        ``TypeError``: "got multiple values for argument 'lr'")."""
        first = args[0] if args else kwargs.get("lr")
        if isinstance(first, (list, tuple)) and first and all(torch.is_tensor(p) for p in first):
            raise ValueError("NGVI is not a torch optimizer and Pyro's LR schedulers (pyro.optim.ExponentialLR, "
                             "ReduceLROnPlateau, ...) cannot wrap it: give it a schedule, NGVI(lr=lambda t: ...), "
                             "or set optim.lr between steps (checked when set)")
        return super().__new__(cls)

    def __init__(self, lr: Optional[Schedule] = None, beta: Optional[Schedule] = None,
                 momentum: Optional[float] = None, damping: Optional[float] = None, tau: Schedule = 1.0,
                 max_step: Optional[float] = 3.0, warm_start: bool = True, averaging: Optional[bool] = None,
                 control_variate: bool = True, safeguard: bool = True, point_optim=torch.optim.Adam,
                 point_optim_args: Optional[Dict] = None, guide=None, compile: bool = False):
        # None: the defaults, resolved per site from its statistics (policies.defaults)
        self.lr, self.beta, self.momentum, self.damping, self.max_step = lr, beta, momentum, damping, max_step
        self.tau = tau
        if averaging is None:  # with the defaults; steps the user chose run as chosen
            averaging = lr is None and beta is None
        self.warm_start, self.averaging = warm_start, averaging
        self.control_variate, self.safeguard = control_variate, safeguard
        self.compile = compile
        self.sync_every: Optional[int] = None
        self.watch_elbo = True
        super().__init__(point_optim, check_point_optim(point_optim, point_optim_args))
        self._point_decay = point_optim is torch.optim.Adam and point_optim_args is None
        self._guide_parts = WeakIdKeyDictionary()  # params of guide parts not Gaussians (True: score-function)
        self._low_rank_locs = LowRankLocs()  # AutoLowRankMultivariateNormal locs: Adam in sd units
        self.guide = _checked_guide(guide)
        self.num_steps = 0
        self.num_skipped_steps = 0
        self.num_rejected_steps = 0
        self._pending_newton: List[Dict] = []  # Newton guards restored by set_state, not yet taken up
        self._states: Dict[int, SiteState] = {}  # id(loc) -> that site's state
        self._pending_states: Dict[str, Dict] = {}  # from set_state, by param name
        self._restored = frozenset()  # the site names set_state restored, until a guide's sites step
        self._plans = Plans()  # per guide structure (at most MAX_PLANS, the last used)
        self._spread_watch = SpreadWatch()  # means growing without bound (pyro_ngvi.monitor), per group
        self._point_checked = WeakIdKeyDictionary()  # params whose point-optimizer step was probed
        self._workspace = Workspace()  # scratch buffers of the element-wise pass (pyro_ngvi.groups)
        self._buffers = Buffers(self._workspace)  # the statistics recovered from gradients, per site
        self._draws = GuideDraws()  # several particles' draws, read as the guide runs
        if control_variate:  # (only the control variate and the coupled step read them)
            self._draws.watch(self.guide)
        self._loss_checked = False  # whether an SVI's loss function was warned about (once)


    @property
    def _options(self) -> Options:
        # a schedule the user wrote runs as written
        adaptive = self.averaging and not (callable(self.lr) or callable(self.beta))
        return Options(self.control_variate, self.warm_start, self.max_step, adaptive)

    def _settings(self, stats, lr: Optional[float], beta: Optional[float], dense: bool = False,
                  sampled: bool = False) -> Settings:
        """``lr``, ``beta``, momentum and damping for a site with statistics ``stats``."""
        return resolve(Settings(lr, beta, self.momentum, self.damping), stats, dense, sampled)

    # ---------------------------------------------------------------- the step
    def __call__(self, params, *args, **kwargs) -> None:
        """
        One step on the tensors ``SVI`` hands over, whole or not at all: everything that
        can refuse it is checked before the first write. A refused or failed step undoes
        the evaluation's registered side effects, as a skipped step does, and, under
        ``SVI`` (which zeroes gradients only after a step), drops the ``.grad``.
        """
        check_step_arguments(args)
        params = list(params)
        svi = _calling_svi(self)
        try:
            accepted = self._step(params, svi, *args, **kwargs)
        except BaseException:
            if svi is not None:
                for p in params:
                    p.grad = None
            end_handover(accepted=False)
            raise
        end_handover(accepted)

    def _step(self, params, svi, *args, **kwargs) -> bool:
        """Find the sites and their state, take their statistics and hand them to the chain of
        :func:`~pyro_ngvi.chain.take_step`."""
        plan = self._plan(params, svi)
        steady = plan.steady  # (the step after a steady one: its decisions kept, pyro_ngvi.steady)
        if steady is not None and steady.holds(self, svi) and not is_distributed():
            taken = steady.run(self, plan, svi, lambda point: self._point_step(point, *args, **kwargs))
            if taken is not None:
                return taken
        handed = None if steady is None else steady.handed  # (recovered by it over the gradients, not taken)
        plan.steady = None
        if not self._loss_checked and svi is not None:
            self._loss_checked = True
            warn_loss_function(svi)
        sites, others = plan.sites, plan.others
        check_pending(self._pending_states, sites)  # every saved entry checked before any is taken
        if self._restored and sites:  # (once: the first guide of Gaussian sites to step after set_state)
            warn_unmatched(self._restored, self._pending_states, sites)
            self._restored = frozenset()
        states = [self._state(site) for site in sites]  # may refuse: before any write
        check_point_states(self._state_waiting_to_be_consumed, self.optim_objs, others, self.pt_optim_constructor,
                           self._point_args)
        guide = _guide_of(self.guide, svi)
        draws = self._draws.take(svi if self.control_variate else None, guide, sites)  # (None: no hooks)
        analytic = analytic_locs(svi, guide, sites, plan.kl_sites)  # (TraceMeanField_ELBO: pyro_ngvi.mean_field_kl)
        if analytic and self.control_variate:
            analytic = move_prior_to_draws(sites, analytic, mean_field_elbo(svi).num_particles == 1, draws)
        stats = handed or step_statistics(sites, svi, self.control_variate, self._buffers, draws,  # (without
                                          frozenset(analytic))  # gradients)
        distributed = is_distributed()
        if distributed:  # each process draws its own
            stats = without_draws(stats, sites)
        learned = {id(p.unconstrained) for s in stats.values() if isinstance(s, SiteCurvature)
                   and (s.prior_loc_param is not None or s.prior_scale_param is not None)
                   for p in s.prior_params()}
        if learned:  # prior params set in closed form, not by the point optimizer
            others = [p for p in others if id(p) not in learned]
        if distributed:
            stats = all_reduce_stats(stats, others)
        config = Config(self.lr, self.beta, self.tau, self.momentum, self.damping, self._options, self.safeguard,
                        self.sync_every, self.compile, self.watch_elbo)
        taken = take_step(self, config, Request(plan, states, stats, others, bool(learned), svi, self._state,
                                                lambda point: self._point_step(point, *args, **kwargs)))
        if taken:
            plan.steady = SteadyStep.build(self, plan, config, states, stats, svi, others,
                                           not (draws or analytic or distributed or learned))
        return taken

    def _point_step(self, others: List[torch.Tensor], *args, **kwargs) -> None:
        """The point optimizer's step on the other parameters (probed once per parameter with a
        zero gradient of the same layout, so that it cannot fail after the guide was written)."""
        if not others:
            return
        for p in others:
            if p.grad is not None and p not in self.optim_objs and p not in self._point_checked:
                probe_point_step(p, self.pt_optim_constructor, self._point_args(p))
                self._point_checked[p] = True
        if self._point_decay:  # a low-rank guide's loc steps in units of its marginal sd, as it stood
            self._low_rank_locs.measure(others)
            clamp_gradients([p for p in self._low_rank_locs.others(others)  # (as Pyro's ClippedAdam, not a
                             if not self._guide_parts.get(p, False)])  # score-function estimate: pyro_ngvi.point)
        super().__call__(others, *args, **kwargs)

    def _point_args(self, p: torch.Tensor) -> Dict:
        """The point optimizer's arguments for ``p``: ``point_optim_args``, or what that callable
        returns for ``p``'s param name, asked as Pyro's optimizers ask it, and checked
        (:func:`~pyro_ngvi.point.check_point_args`)."""
        if not callable(self.pt_optim_args):
            return self.pt_optim_args
        what = f"point_optim_args({param_label(p)!r})"
        try:
            args = self._get_optim_args(p)
        except AssertionError:  # (Pyro's check that it returned a dict)
            raise ValueError(f"{what} must return a dict of {self.pt_optim_constructor.__name__}'s "
                             "arguments") from None
        return check_point_args(self.pt_optim_constructor, args, what)

    def _get_optim(self, param):
        """The point optimizer of ``param``; by default a guide part's sets its decaying step
        size before every step (:func:`~pyro_ngvi.point.decay_guide_part_lr`, also after a load)."""
        optimizer = super()._get_optim(param)
        if self._point_decay and param in self._guide_parts:
            optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: decay_guide_part_lr(optimizer))
            self._low_rank_locs.hook(param, optimizer)
        return optimizer

    # ---------------------------------------------------------------- sites and state
    def _plan(self, params, svi=None) -> "Plan":
        """The guide's sites and other parameters (:func:`~pyro_ngvi.family.split_params`), with
        what NGVI keeps per guide structure, remembered while the param store holds its tensors.
        A site with a tensor frozen (``requires_grad_(False)``) is no site here (:func:`_unfrozen`)."""
        guide = _guide_of(self.guide, svi)
        key = (id(guide), frozenset(map(id, params)), frozenset([id(p) for p in params if not p.requires_grad]))
        store = pyro.get_param_store()._params
        plan = self._plans.found(key, guide, store)
        if plan is not None:
            plan.reweigh(guide)  # (poutine.scale factors may change between steps: KL annealing)
            return plan
        sites, others, parts, score = _unfrozen(*split_params(guide, params))
        scored = {id(p) for p in score}
        self._guide_parts.update((p, id(p) in scored) for p in parts)  # (True: a score-function site's)
        self._low_rank_locs.note(guide_parts(guide))
        self._plans.make_room(key, store, self)  # (and plans whose tensors left the store leave no trace)
        self._forget_gone()
        plan = self._plans.add(key, Plan(sites, others, guide))
        plan.take_newton(self._pending_newton)
        for site in sites:  # (a guide moved to another dtype or device: its state follows)
            state = self._states.get(id(site.loc))
            if state is not None and state.loc() is site.loc:
                state.follow(site.loc)
        return plan

    def _forget_gone(self) -> None:
        """Drop what NGVI keeps of groups whose plan is gone and of sites whose ``loc`` is gone (an
        optimizer reused over many fits, each after ``pyro.clear_param_store()``, would keep them all)."""
        self._spread_watch.keep([g for plan in self._plans.values() for gs in plan.groups.values() for g in gs])
        self._states = {k: state for k, state in self._states.items() if state.loc() is not None}
        self._buffers.prune()

    def _state(self, site) -> SiteState:
        """The state of ``site`` (keyed by its ``loc`` tensor; new for a new tensor),
        taking a :meth:`set_state` entry of the same param name once."""
        state = self._states.get(id(site.loc))
        if state is not None and state.loc() is site.loc:
            return state
        pending = self._pending_states.get(site.key)
        raw, transform = (site.raw_scale, site._scale_transform) if isinstance(site, GaussianSite) else (None, None)
        if pending is None:
            state = SiteState(weakref.ref(site.loc), None if raw is None else weakref.ref(raw))
        else:  # (a refused entry stays pending: every retry is refused alike)
            state = SiteState.restored(site.loc, site.key, pending, raw, transform)
            del self._pending_states[site.key]
        self._states[id(site.loc)] = state
        return state

    def _restart_momentum(self, sites=None) -> None:
        """Forget the momentum of ``sites`` (default: every site; their next step starts the
        average at g)."""
        for state in self._states.values() if sites is None else map(self._state, sites):
            state.momentum = None

    def get_state(self) -> Dict:
        """
        Optimizer state: step counts, each site's state (keyed, as Pyro keys its
        optimizers' state, by the param-store name of the site's ``loc``) and the
        point optimizers'. Plain tensors, numbers and strings: it loads with
        ``torch.load(..., weights_only=True)``. A copy: later steps leave it as it is.
        """
        for plan in self._plans.values():  # the counts of steps whose checks the host has not read yet
            if len(plan.deferred):
                read_checks(self, plan, [], {}, [], [], [], [])
        store = pyro.get_param_store()
        sites = {}
        for state in self._states.values():
            loc = state.loc()
            name = None if loc is None else store.param_name(loc)
            if name is not None:
                sites[name] = state.saved(store)
        for name, pending in self._pending_states.items():  # restored, not seen since
            sites.setdefault(name, pending)
        newton = [entry for entry in (plan.newton.saved_state() for plan in self._plans.values()) if entry]
        return {
            "ngvi": {"num_steps": self.num_steps, "num_skipped_steps": self.num_skipped_steps,
                     "num_rejected_steps": self.num_rejected_steps, "sites": sites,
                     "newton": newton + copy.deepcopy(self._pending_newton)},
            # (torch's state_dict aliases live tensors; restored entries not loaded yet are kept)
            "point": copy.deepcopy({**self._state_waiting_to_be_consumed, **super().get_state()}),
        }

    def set_state(self, state_dict: Dict) -> None:
        """
        Restore a :meth:`get_state` dict (also after :meth:`load`); each site's entry is
        taken up when a site of that name next steps, each point parameter's when it next
        steps (also if it has stepped before).

        :raises ValueError: for a dict :meth:`get_state` does not produce (the optimizer is
            then unchanged). An entry that does not fit its site or parameter (a checkpoint
            of another model) is refused at the next step, before anything is written.
        """
        check_state(state_dict)
        ngvi, point = state_dict["ngvi"], state_dict["point"]
        self.num_steps = ngvi["num_steps"]
        self.num_skipped_steps = ngvi["num_skipped_steps"]
        self.num_rejected_steps = ngvi.get("num_rejected_steps", 0)
        self._pending_newton = copy.deepcopy(ngvi.get("newton", []))  # taken up by the plan of its sites
        self._states = {}
        self._plans = Plans()
        self._pending_states = {name: {"taken": ngvi["num_steps"], **entry} for name, entry in ngvi["sites"].items()}
        self._restored = frozenset(self._pending_states)
        store = pyro.get_param_store()
        restore_scales(self._pending_states.values(), store)  # (the fast path reads sigma before the first step)
        for p in [p for p in self.optim_objs if store.param_name(p) in point]:
            del self.optim_objs[p]  # restored, not kept: it loads the entry when it next steps
        super().set_state(copy.deepcopy(point))  # loading may alias them: steps would change ``point``

    def _arguments(self, memo=None) -> tuple:
        """The constructor's arguments that give these settings (schedules deep-copied into ``memo``)."""
        memo = {} if memo is None else memo
        return (copy.deepcopy(self.lr, memo), copy.deepcopy(self.beta, memo), self.momentum, self.damping,
                copy.deepcopy(self.tau, memo), self.max_step, self.warm_start, self.averaging, self.control_variate,
                self.safeguard, self.pt_optim_constructor, None if self._point_decay else self.pt_optim_args,
                None if self.guide is None else memo.get(id(self.guide), self.guide), self.compile)

    def __deepcopy__(self, memo) -> "NGVI":
        """A new optimizer with these settings and this state (:meth:`get_state`, taken up by
        param-store name at the copy's next steps); it watches the same guide (or its copy, when
        the guide is copied in the same call)."""
        copied = _rebuilt(type(self), self._arguments(memo), self.sync_every, self.watch_elbo, self.get_state())
        memo[id(self)] = copied
        return copied

    def __reduce__(self):
        """Pickled as its settings and :meth:`get_state`: unpickled, a new optimizer that takes the
        state up by param-store name, as a deep copy does (a schedule must itself pickle)."""
        return _rebuilt, (type(self), self._arguments(), self.sync_every, self.watch_elbo, self.get_state())

    def save(self, filename) -> None:
        """Save :meth:`get_state` to ``filename`` with ``torch.save``, as Pyro's ``PyroOptim.save``.

        :raises ValueError: (and ``TypeError``) unless ``filename`` is a path: Pyro's ``open(filename)``
            took ``True`` or ``1`` for a file descriptor, wrote the state to stdout and closed it."""
        check_load_arguments(filename, None)
        super().save(filename)

    def load(self, filename, map_location=None) -> None:
        """
        Restore a state saved by ``save`` (Pyro's ``PyroOptim.save``), loading it with
        ``torch.load(..., weights_only=True)``: only tensors, numbers, strings and
        containers are built, so a crafted file cannot run code (Pyro's
        :meth:`PyroOptim.load <pyro.optim.optim.PyroOptim.load>` would run it).

        :raises ValueError: when the file holds other objects (nothing from it has run),
            or is not an NGVI state.
        """
        self.set_state(safe_load(filename, map_location, what="NGVI state"))


def _rebuilt(cls, arguments: tuple, sync_every, watch_elbo: bool, state: Dict) -> NGVI:
    """An optimizer of class ``cls`` built with ``arguments`` (:meth:`NGVI._arguments`) and given ``state``."""
    optim = cls(*arguments)
    optim.sync_every, optim.watch_elbo = sync_every, watch_elbo
    optim.set_state(state)
    return optim


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):  # ("no" or "False" would be truthy: the watch silently on)
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _whole_steps(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"sync_every must be a whole number of steps >= 1, or None (16 on CUDA, "
                         f"1 elsewhere), got {value!r}")
    return int(value)


def _guide_of(given, svi=None):
    """The guide NGVI was ``given`` at construction, else the one of the ``SVI`` running this step.

    :raises ValueError: when both are given and differ (the SVI would train its own guide
        while NGVI looks for sites in the other)."""
    if given is not None:
        if svi is not None and svi.guide is not given:
            raise ValueError(
                f"NGVI was given guide={type(given).__name__} at construction, but the SVI "
                f"running this step trains another guide ({type(svi.guide).__name__}): pass the "
                "SVI's guide, or none (under SVI, NGVI reads the guide off the SVI)")
        return given
    if svi is None:
        raise RuntimeError(
            "NGVI reads which tensors form Gaussian sites off the guide, and found none: "
            "call it through pyro.infer.SVI(model, guide, NGVI(...), loss), or pass the "
            "guide, NGVI(..., guide=guide), when calling it yourself."
        )
    return svi.guide


def _unfrozen(sites, others, parts, score):
    """``split_params``' answer with the sites of which a tensor is frozen (``requires_grad_(False)``)
    taken out, as torch's optimizers leave a tensor without a gradient: one frozen whole stays as it
    is, and of one frozen in part (its scale, say) the rest is a guide part's param, which the point
    optimizer trains. Left in, a frozen tensor has no gradient and refused every step: a guide part
    frozen in an ``AutoGuideList`` stopped the training of the others, which Pyro's Adam trains."""
    frozen = [site for site in sites if not all(t.requires_grad for t in site.tensors)]
    if not frozen:
        return sites, others, parts, score
    out = {id(site) for site in frozen}
    rest = [t for site in frozen for t in site.tensors if t.requires_grad]
    partly = [site.name for site in frozen if any(t.requires_grad for t in site.tensors)]
    if partly:
        warnings.warn(f"the guide sites {', '.join(map(repr, partly))} have some of their params frozen "
                      "(requires_grad_(False)): NGVI's natural-gradient step moves a site's mean and scale "
                      "together, so their other params are trained by the point optimizer (Adam, as a guide "
                      "part's), which is slower. Freeze all of a site's params or none.", NGVIWarning, stacklevel=5)
    return [site for site in sites if id(site) not in out], others + rest, parts + rest, score


def _checked_guide(guide):
    """:raises ValueError: unless ``guide`` is None (SVI's) or a callable."""
    if guide is not None and not callable(guide):
        raise ValueError(f"guide must be the guide (a callable) NGVI steps, or None (SVI's), got {guide!r}")
    return guide
