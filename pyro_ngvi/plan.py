"""
What :class:`~pyro_ngvi.NGVI` keeps per guide structure (a guide and the tensors ``SVI`` hands
over): a :class:`Plan` of its sites and other parameters, built once and reused while the param
store holds those tensors.
"""

import operator
from typing import Dict, List, Optional

import torch

from .checks import DeferredChecks, read_checks
from .family import FullCovarianceSite, GaussianSite, SiteCurvature, calling_step, gaussian_sites
from .groups import Group, group_sites, statistics_kind
from .guide_trace import subsampling
from .hot_path import reference
from .kronecker import KroneckerSite
from .low_rank_guide import LowRankSite
from .monitor import ElboWatch
from .safeguards import NewtonGuard, Safeguards


#: The most guide structures whose :class:`Plan` NGVI keeps (:class:`Plans`); beyond, the least
#: recently used is dropped. A guide whose sites change at random between steps (a branch per
#: site) has a new structure nearly every step: kept without bound, 800 steps of 12 such sites
#: held 725 plans (14 MB, 67,511 tensors), and every new plan checked all the others, the step's
#: cost growing with the steps taken.
MAX_PLANS = 16


class Plans(dict):
    """NGVI's plans by key (the guide and the tensors SVI hands over), at most :data:`MAX_PLANS`."""

    def __init__(self):
        super().__init__()
        self.calls = 0  # look-ups: when each plan was last used (Plan.used)

    def found(self, key, guide, store) -> Optional["Plan"]:
        """The plan of ``key`` if it is ``guide``'s and the param ``store`` still holds its tensors
        (:meth:`Plan.stored`), else ``None``."""
        self.calls += 1
        plan = self.get(key)
        if plan is None or plan.guide() is not guide or not plan.stored(store):
            return None
        plan.used = self.calls
        return plan

    def make_room(self, key, store, optim) -> None:
        """Drop the plan of ``key``, the plans whose tensors left the param ``store``
        (``pyro.clear_param_store()``) and, while :data:`MAX_PLANS` - 1 remain, the least recently
        used, whose deferred checks and last flags ``optim`` reads first (counted and reported as at
        its next step: :func:`~pyro_ngvi.checks.read_checks`)."""
        for k in [k for k, plan in self.items() if k == key or not plan.stored(store)]:
            del self[k]
        while len(self) >= MAX_PLANS:
            plan = self.pop(min(self, key=lambda k: self[k].used))
            if len(plan.deferred) or plan.safeguards or plan.elbo_flag is not None:
                read_checks(optim, plan, [], {}, [], [], [], [])

    def add(self, key, plan: "Plan") -> "Plan":
        """Keep ``plan`` under ``key``, as just used."""
        plan.used = self.calls
        self[key] = plan
        return plan


class Plan:
    """What NGVI keeps per guide structure (a guide and the tensors SVI hands over): its sites
    and other parameters, its groups by kind of statistics, the stall test's signs, the Newton
    guard, the ELBO watch and the flags of its last step (read at its next step's sync), and how
    much the model subsamples its data (:func:`~pyro_ngvi.guide_trace.subsampling`, read once)."""

    def __init__(self, sites, others, guide=None):
        self.sites, self.others = sites, others
        self.guide = reference(guide)  # (NGVI keys plans by id(guide): a new guide may get a freed one's id)
        found = None if guide is None or not sites else calling_step(guide)
        self.subsampling = 0.0 if found is None or found.model is None else \
            subsampling(found.model, *found.args, **found.kwargs)
        self.mean_field = [site for site in sites if isinstance(site, GaussianSite)]
        self.weighted = any(site.weight != 1.0 for site in self.mean_field)  # (read once: reweigh)
        self.dense_sites = [site for site in sites if isinstance(site, (FullCovarianceSite, KroneckerSite, LowRankSite))]
        self.groups: Dict[tuple, List[Group]] = {}
        self.signs: Dict = {}  # id(group) -> (group, g > 0 at its last sampled step)
        self.newton = NewtonGuard()
        self.safeguards: List[Safeguards] = []
        self.elbo_watch = ElboWatch()  # a training ELBO that keeps getting worse
        self.elbo_flag: Optional[torch.Tensor] = None
        self.skips_in_a_row = 0
        self.used = 0  # Plans.calls when NGVI last took this plan (the least recently used is dropped)
        self.deferred = DeferredChecks()  # steps whose checks the host has not read yet
        self.steady = None  # the step after a steady one, replayed (pyro_ngvi.steady.SteadyStep)
        self.kl_sites: Dict = {}  # TraceMeanField_ELBO: the leaves it draws, per model (pyro_ngvi.mean_field_kl)
        self.tensors = [pair for site in sites for pair in stored_tensors(site)]  # (name, tensor): stored
        # where their values live: guide.to(torch.float64) or .to(device) gives a param new storage under
        # the same tensor object, and the groups' views would still show the old one (a new plan is made)
        located = [site.loc for site in sites] + [t for _, t in self.tensors]
        self._names, self._stored = [name for name, _ in self.tensors], [t for _, t in self.tensors]
        self._located, self._pointers = located, [t.data_ptr() for t in located]

    def stored(self, store) -> bool:
        """Whether the param store (its dict of tensors) still holds the sites' tensors under their names,
        in the storage they had (not moved to another dtype or device since). (Looked up and compared
        by ``map``: a call for all, not one per tensor; at every step.)"""
        return (all(map(operator.is_, map(store.get, self._names), self._stored))
                and list(map(torch.Tensor.data_ptr, self._located)) == self._pointers)

    def take_newton(self, pending: List[Dict]) -> None:
        """Take the first of the ``pending`` Newton guards (restored by :meth:`~pyro_ngvi.NGVI.set_state`) that is
        of these sites, off the list."""
        for entry in pending:
            if self.newton.restore(entry, self.mean_field):
                pending.remove(entry)
                return

    def reweigh(self, guide) -> None:
        """Read the ``poutine.scale`` factors of the sites again, if any was not 1 (a factor passed
        to the guide as an argument, changed between steps: KL annealing), off a run of the guide
        that leaves the random streams as they were (:func:`~pyro_ngvi.guide_trace.trace_guide`).
        Sites of weight 1 cost nothing here."""
        if not self.weighted:
            return
        found = calling_step(guide)
        args, kwargs = (found.args, found.kwargs) if found is not None else ((), {})
        weights = {site.key: site.weight for site in gaussian_sites(guide, *args, **kwargs)
                   if isinstance(site, GaussianSite)}
        for site in self.mean_field:
            site.weight = weights.get(site.key, site.weight)

    def groups_for(self, sites: List[GaussianSite], stats: Dict[str, SiteCurvature]) -> List[Group]:
        """:func:`~pyro_ngvi.groups.group_sites` for these sites and kinds of statistics, remembered."""
        key = tuple([statistics_kind(stats[site.key]) for site in sites])
        groups = self.groups.get(key)
        if groups is None:
            groups = self.groups[key] = [Group.of(group) for group in group_sites(sites, stats)]
        return groups


def stored_tensors(site) -> list:
    """The tensors of ``site`` the param store holds, with their names: ``(name, tensor)``."""
    if isinstance(site, KroneckerSite):
        return [(site.row_name, site.raw_row_scale_tril), (site.col_name, site.raw_col_scale_tril)]
    pairs = [(site.scale_name, site.raw_scale)]
    if isinstance(site, FullCovarianceSite):
        pairs.append((site.scale_tril_name, site.raw_scale_tril))
    return pairs
