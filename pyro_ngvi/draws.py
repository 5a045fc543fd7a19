"""
The draws of a guide's Gaussian sites, read as ``SVI`` runs the guide.

With one draw per step the draw of a mean-field site is recovered from its gradients
(:mod:`~pyro_ngvi.statistics`). Where the ELBO averages several particles
(``Trace_ELBO(num_particles=K)``, vectorised or not) it is not, yet the control variate and the
coupled mean step (:mod:`~pyro_ngvi.variance`) need the particles' means

.. math:: \\bar\\epsilon = \\frac1K \\sum_k \\epsilon_k, \\qquad
          \\overline{\\epsilon^2} = \\frac1K \\sum_k \\epsilon_k^2, \\qquad
          \\epsilon_k = (u_k - \\mu) / \\sigma.

Without them the element-wise steps contract a strongly correlated posterior's slow directions
by about :math:`1 - \\rho` per step, and the adaptive steps' averaging then stalls them (a
4-vector seen through its sum: 1.1-2.1 mean-field sd off after 1,000 steps of 8 particles).

A :class:`DrawRecorder` watches a guide that is a ``torch.nn.Module`` (the autoguides): each call
made with gradients on under a trace (as the ELBOs make theirs) runs under a messenger that adds
up :math:`\\epsilon` and :math:`\\epsilon^2` of every sample site drawn from a ``Normal`` whose
``loc`` is a param tensor itself (or its expansion over the vectorised particles). A step takes
them (:meth:`DrawRecorder.take`) only when they are this step's: the calls since the last step
drew exactly the ELBO's ``num_particles`` of each site, at its params as they are now (their
version unchanged since). A guide called by hand between steps, ``guide(x)`` to log its samples,
is not traced and not counted (its draw made the step's unknown: 4.5 mean-field sd off after 300
steps of 8 particles on a correlated regression, 0.03 without those calls). Anything else (a
guide traced by hand between steps with gradients on, a subsampled site, a guide that is no
module) leaves the draws unknown, as before. The sums (per param, since the draws at an older
version are stale) hold the memory of the params, however many calls; the hooks come off when
the recorder goes, and a pickled or copied guide takes inert ones along.
"""

import weakref
from typing import Dict, List, Optional, Tuple

import torch

import pyro.distributions as dist
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.trace_messenger import TraceMessenger
from torch.utils.weak import WeakIdKeyDictionary

from .family import GaussianSite
from .guide_trace import reading

#: ELBOs (exactly these classes: the Jit versions trace the guide once) whose gradients of a
#: Gaussian site are the mean over the particles of each draw's; TraceMeanField_ELBO's only on the
#: sites whose KL it does not integrate (an autoguide's, :mod:`~pyro_ngvi.mean_field_kl`): on a site
#: whose KL it takes in closed form, at the mean, the regression of the gradients on the draw points
#: (the coupled step's slope) misses by the prior's share, so its draws are not handed on there.
_PARTICLE_ELBOS = (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO)


class _Draws(Messenger):
    """Adds :math:`\\epsilon` of each Normal sample site whose ``loc`` is (a view of) a leaf to
    ``sums``, by ``id(leaf)``: ``[leaf, version, particles, sum eps, sum eps^2, usable]``, started
    afresh where the leaf's version moved since (the draws before are stale)."""

    def __init__(self, sums: Dict[int, list]):
        super().__init__()
        self.sums = sums

    def _pyro_post_sample(self, msg) -> None:
        if msg["is_observed"]:
            return
        fn = msg["fn"]
        while isinstance(fn, dist.Independent):
            fn = fn.base_dist
        if type(fn) not in (dist.Normal, torch.distributions.Normal):
            return
        loc = fn.loc
        leaf = loc if loc._base is None else loc._base
        if not (leaf.is_leaf and leaf.requires_grad) or msg["value"].shape != loc.shape:
            return
        entry = self.sums.get(id(leaf))
        if entry is None or entry[0] is not leaf or entry[1] != leaf._version:
            entry = self.sums[id(leaf)] = [leaf, leaf._version, 0, 0.0, 0.0, True]
        with torch.no_grad():
            eps = (msg["value"] - loc) / fn.scale
            if eps.shape[eps.dim() - leaf.dim():] != leaf.shape:
                entry[5] = False  # (draws of some elements only: not the leaf's)
                return
            flat = eps.reshape(-1, *leaf.shape)
            entry[2] += flat.shape[0]
            entry[3] = flat.sum(0) + entry[3]
            entry[4] = flat.square().sum(0) + entry[4]


class _Hooks:
    """The forward pre- and post-hooks a :class:`DrawRecorder` puts on its guide: a call made with
    gradients on runs under a :class:`_Draws` of the recorder's sums. The recorder is held weakly
    (gone, the hooks do nothing), the open messengers here (one opened is closed, whatever became
    of the recorder during the call: a collection then left it on Pyro's stack for good). Pickled
    or copied with the guide (``torch.save(guide)``: the hooks were local functions, which pickle
    refused), they come back inert: a copy's calls are no step's of this recorder."""

    def __init__(self, recorder: Optional["DrawRecorder"] = None):
        self.recorder = None if recorder is None else weakref.ref(recorder)
        self.open: List[Optional[_Draws]] = []
        self.handles: Tuple = ()  # (the pre-hook's, the post-hook's)

    def remove(self) -> None:
        """Take the hooks off the guide; the post-hook once the calls open now have left."""
        self.recorder = None
        for handle in self.handles[:1] if self.open else self.handles:
            handle.remove()

    def __reduce__(self):
        return _Hooks, ()

    def enter(self, module, args) -> None:
        recorder = None if self.recorder is None else self.recorder()
        messenger = None
        # (a call under no_grad, e.g. Predictive's, is no step's; nor one outside any trace: the ELBOs
        # trace the guide, a call by hand (samples to log) does not, and its draw made the step's unknown)
        # (nor NGVI's own run of the guide to read its structure: a 5th draw of 4 particles made the
        # first step's draws unknown, and a resumed run left the uninterrupted one's trajectory)
        traced = any(isinstance(m, TraceMessenger) for m in _PYRO_STACK)
        if recorder is not None and torch.is_grad_enabled() and traced and not reading():
            messenger = _Draws(recorder._sums)
            messenger.__enter__()
        self.open.append(messenger)

    def leave(self, module, args, output) -> None:
        messenger = self.open.pop() if self.open else None
        if messenger is not None and messenger in _PYRO_STACK:  # (after an error: it and above)
            messenger.__exit__(*((None,) * 3 if _PYRO_STACK[-1] is messenger else (RuntimeError, None, None)))
        if not self.open and self.recorder is None and self.handles:  # (removed during the call)
            self.handles[1].remove()


class DrawRecorder:
    """The draws of one guide module's calls since the last step (module docstring), kept as
    their sums per leaf: its memory is that of the guide's params, however many calls (a guide
    called by hand with gradients on, 1,000 times after training, held 1,000 calls' draws)."""

    def __init__(self, guide: torch.nn.Module):
        self._sums: Dict[int, list] = {}
        hooks = _Hooks(self)
        hooks.handles = (guide.register_forward_pre_hook(hooks.enter),
                         guide.register_forward_hook(hooks.leave, always_call=True))
        self.close = weakref.finalize(self, hooks.remove)

    def take(self, locs: List[torch.Tensor], num_particles: int) -> Dict[int, Tuple[torch.Tensor, torch.Tensor, int]]:
        """:math:`(\\bar\\epsilon, \\overline{\\epsilon^2}, K)` by ``id(loc)`` for each of ``locs`` whose
        draws since the last call are exactly ``num_particles`` at its current version; forgets
        all draws."""
        sums, self._sums = self._sums, {}
        means = {}
        for loc in locs:
            entry = sums.get(id(loc))
            if (entry is not None and entry[0] is loc and entry[1] == loc._version and entry[5]
                    and entry[2] == num_particles):
                means[id(loc)] = (entry[3] / num_particles, entry[4] / num_particles, num_particles)
        return means


def particles(svi) -> Optional[int]:
    """The number of particles whose draws a :class:`DrawRecorder` can hand ``svi``'s steps
    (``None``: none: one draw, whose draws are recovered, a Jit ELBO, another loss)."""
    elbo = getattr(getattr(svi, "loss_and_grads", None), "__self__", None)
    if type(elbo) not in _PARTICLE_ELBOS:
        return None
    k = getattr(elbo, "num_particles", 1)
    return k if k > 1 else None


class GuideDraws:
    """A :class:`DrawRecorder` per guide module (weakly keyed): set up by :meth:`watch` (NGVI's
    ``guide``) or at the guide's first step under an ELBO of several particles
    (:func:`particles`: that step's draws are unknown), and removed under any other loss."""

    def __init__(self):
        self._recorders = WeakIdKeyDictionary()

    def watch(self, guide) -> None:
        """Record ``guide``'s draws from its next call on (a module: else nothing to watch)."""
        if isinstance(guide, torch.nn.Module) and guide not in self._recorders:
            self._recorders[guide] = DrawRecorder(guide)

    def take(self, svi, guide, sites) -> Dict[int, Tuple[torch.Tensor, torch.Tensor, int]]:
        """This step's :math:`(\\bar\\epsilon, \\overline{\\epsilon^2}, K)` of the mean-field ``sites``
        of ``guide``, stepped by ``svi`` (``None``: called directly, no draws), by ``id(site.loc)``
        (empty where unknown)."""
        recorder = self._recorders.get(guide) if isinstance(guide, torch.nn.Module) else None
        k = None if svi is None else particles(svi)
        if k is None:
            if recorder is not None:  # (one draw, recovered; or another loss: no hooks to run)
                recorder.close()
                del self._recorders[guide]
            return {}
        if recorder is None:
            self.watch(guide)
            return {}
        return recorder.take([site.loc for site in sites if isinstance(site, GaussianSite)], k)
