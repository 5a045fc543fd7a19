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
made with gradients on runs under a messenger that keeps :math:`\\epsilon` of every sample site
drawn from a ``Normal`` whose ``loc`` is a param tensor itself (or its expansion over the
vectorised particles). A step takes them (:meth:`DrawRecorder.take`) only when they are this
step's: the calls since the last step drew exactly the ELBO's ``num_particles`` of each site, at
its params as they are now (their version unchanged since). Anything else (a guide called by
hand between steps, a subsampled site, a guide that is no module) leaves the draws unknown,
as before.
"""

import weakref
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch

import pyro.distributions as dist
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from torch.utils.weak import WeakIdKeyDictionary

from .family import GaussianSite

#: ELBOs (exactly these classes: the Jit versions trace the guide once) whose gradients of a
#: Gaussian site are the mean over the particles of each draw's. Not TraceMeanField_ELBO: its
#: analytic KL is taken at the mean, no draw, so the regression of the gradients on the draw points
#: (the coupled step's slope) misses by the prior's share, and on a posterior held in its slow
#: directions by the prior alone that made the coupled step indefinite (74 sd off at step 250).
_PARTICLE_ELBOS = (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO)


class _Draws(Messenger):
    """Keeps ``(loc, version, eps)`` of each Normal sample site whose ``loc`` is (a view of) a leaf."""

    def __init__(self, sink: List):
        super().__init__()
        self.sink = sink

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
        with torch.no_grad():
            eps = (msg["value"] - loc) / fn.scale
        self.sink.append((leaf, leaf._version, eps))


#: A recorder keeps the draws of at most this many calls (a guide called by hand many times
#: between steps, e.g. before the first, holds no more memory than that).
MAX_CALLS = 1024


class DrawRecorder:
    """The draws of one guide module's calls since the last step (module docstring)."""

    def __init__(self, guide: torch.nn.Module):
        self._calls: Deque[List] = deque(maxlen=MAX_CALLS)
        self._count = 0  # the calls since the last step, kept or not
        self._open: List[_Draws] = []
        this = weakref.ref(self)

        def enter(module, args):
            recorder = this()
            if recorder is None:
                return
            messenger = None
            if torch.is_grad_enabled():  # (a call under no_grad, e.g. Predictive, is no step's)
                recorder._calls.append([])
                recorder._count += 1
                messenger = _Draws(recorder._calls[-1])
                messenger.__enter__()
            recorder._open.append(messenger)

        def leave(module, args, output):
            recorder = this()
            messenger = recorder._open.pop() if recorder is not None and recorder._open else None
            if messenger is not None and messenger in _PYRO_STACK:  # (after an error: it and above)
                messenger.__exit__(*((None,) * 3 if _PYRO_STACK[-1] is messenger else (RuntimeError, None, None)))

        handles = (guide.register_forward_pre_hook(enter),
                   guide.register_forward_hook(leave, always_call=True))
        self.close = weakref.finalize(self, lambda: [handle.remove() for handle in handles])

    def take(self, locs: List[torch.Tensor], num_particles: int) -> Dict[int, Tuple[torch.Tensor, torch.Tensor, int]]:
        """:math:`(\\bar\\epsilon, \\overline{\\epsilon^2}, K)` by ``id(loc)`` for each of ``locs`` whose
        draws since the last call are exactly ``num_particles`` at its current version; forgets
        all draws."""
        calls, self._calls, count, self._count = self._calls, deque(maxlen=MAX_CALLS), self._count, 0
        if count != len(calls):
            return {}
        found: Dict[int, List[torch.Tensor]] = {}
        wanted = {id(loc): loc for loc in locs}
        for sink in calls:
            for leaf, version, eps in sink:
                if wanted.get(id(leaf)) is leaf and leaf._version == version:
                    found.setdefault(id(leaf), []).append(eps)
        means = {}
        for key, draws in found.items():
            loc = wanted[key]
            if any(e.shape[e.dim() - loc.dim():] != loc.shape for e in draws):
                continue
            flat = torch.cat([e.reshape(-1, *loc.shape) for e in draws])
            if flat.shape[0] == num_particles:
                means[key] = (flat.mean(0), flat.square().mean(0), num_particles)
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
