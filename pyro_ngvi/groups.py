"""
Mean-field sites updated together as one flat vector (one kernel per operation
rather than one per site and operation): which sites may share a group
(:func:`group_sites`), the group's views of their tensors and of their state
(:class:`Group`), and the flat-vector helpers the update uses.

Sites share a group when they share the scale constraint, dtype, device and the
kind of their statistics, are not masked, and together hold at most
:data:`FLAT_MAX` elements; a masked site (subsampled rows) or a large one is a group
of its own, whose flat tensors are views (no copies).
"""

from typing import Dict, List, NamedTuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import pyro

from .family import GaussianSite, SiteCurvature

#: Sites are concatenated into one update up to this many elements: that saves
#: per-operation overhead on small tensors and bounds the copies it costs.
FLAT_MAX = 1 << 16


def flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors, flattened and concatenated (no copy for a single contiguous one, nor for a single
    number broadcast to a shape: a prior's or the family's floor, which stays a broadcast view)."""
    if len(tensors) == 1:
        tensor = tensors[0]
        if tensor.dim() > 1 and not any(tensor.stride()):
            return tensor.as_strided((tensor.numel(),), (0,))
        return tensor.reshape(-1)
    if all(t.is_contiguous() for t in tensors):
        return _flatten_dense_tensors(tensors)  # one call: reshape and cat in C++
    return torch.cat([t.reshape(-1) for t in tensors])  # (an expanded prior: no copy before the cat)


def select(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """
    ``torch.where(condition, a, b)`` for finite ``a`` and ``b`` (broadcast), as
    ``torch.lerp(b, a, m)`` on the 0 / 1 mask ``m`` of ``condition``: exactly the same
    values (``lerp(b, a, 0) = b``, ``lerp(b, a, 1) = a``), without torch's CPU ``where``,
    which runs one element at a time (~4 ns an element against ~0.2-0.4 ns). ``a`` and ``b``
    have the same dtype.
    """
    return torch.lerp(b, a, condition.to(a.dtype))


def statistics_kind(stats: SiteCurvature) -> tuple:
    """What of a site's statistics decides its group and its update's code path."""
    return (stats.mask is None, stats.sampled, stats.nonnegative, stats.prior_precision is None,
            stats.eps_mean is None, stats.num_data, stats.min_precision is None)


def group_sites(sites: List[GaussianSite], stats: Dict[str, SiteCurvature]) -> List[List[GaussianSite]]:
    """
    Sites whose update can run as one flat vector: same scale constraint, dtype,
    device and kind of statistics (:func:`statistics_kind`), no mask, at most
    :data:`FLAT_MAX` elements together. A masked site or a large one is a group of its own.
    """
    groups: Dict[tuple, List[GaussianSite]] = {}
    sizes: Dict[tuple, int] = {}
    for site in sites:
        s = stats[site.key]
        if s.mask is not None or site.loc.numel() > FLAT_MAX:
            key = ("alone", site.key)
        else:
            constraint = id(pyro.get_param_store()._constraints[site.scale_name])
            key = (constraint, site.loc.dtype, site.loc.device) + statistics_kind(s)[1:]
            if sizes.get(key, 0) + site.loc.numel() > FLAT_MAX:  # start another group
                groups[key + (len(groups),)] = groups.pop(key)
                sizes[key] = 0
        groups.setdefault(key, []).append(site)
        sizes[key] = sizes.get(key, 0) + site.loc.numel()
    return list(groups.values())


class Group(NamedTuple):
    """Sites updated as one flat vector, with what the update needs of them every step."""

    sites: List[GaussianSite]
    sizes: List[int]
    locs: List[torch.Tensor]  # flat views of the sites' loc tensors, to write into
    raw_scales: List[torch.Tensor]  # and of their raw scale tensors
    transform: object  # raw scale -> sigma
    cache: Dict  # small constant tensors of the adaptive steps, by (dtype, device); kept flats (flat_of)

    @classmethod
    def of(cls, sites: List[GaussianSite]) -> "Group":
        with torch.no_grad():
            return cls(sites, [site.loc.numel() for site in sites],
                       [site.loc.view(-1) for site in sites],
                       [site.raw_scale.view(-1) for site in sites],
                       sites[0]._scale_transform, {})

    def flat_of(self, name: str, tensors: List[torch.Tensor]) -> torch.Tensor:
        """:func:`flat` of ``tensors``, kept while they are the same tensors, unchanged (a
        fixed prior and the family's floor are: their concatenation is not redone every
        step); the result is read-only."""
        if len(tensors) == 1:  # a view: nothing to keep
            return flat(tensors)
        versions = [t._version for t in tensors]
        kept = self.cache.get(("flat", name))
        if kept is not None and kept[1] == versions and all(a is b for a, b in zip(kept[0], tensors)):
            return kept[2]
        result = flat(tensors)
        self.cache[("flat", name)] = (list(tensors), versions, result)
        return result

    def least(self, name: str, tensors: List[torch.Tensor]) -> float:
        """The least value of ``tensors`` (a host number), kept while they are the same tensors,
        unchanged (the family's floor: read once, not every step)."""
        versions = [t._version for t in tensors]
        kept = self.cache.get(("least", name))
        if kept is not None and kept[1] == versions and all(a is b for a, b in zip(kept[0], tensors)):
            return kept[2]
        result = min(float(t.min()) for t in tensors)
        self.cache[("least", name)] = (list(tensors), versions, result)
        return result

    def cached(self, key, make):
        """``make()``, computed once per ``key`` for this group (small constant tensors)."""
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = make()
        return found

    # the sites' per-element state as flat vectors
    def fresh(self, states, name: str):
        """Where a site has no ``name`` buffer yet (flat bool), or ``None`` when all have."""
        if all(getattr(state, name) is not None for state in states):
            return None
        return flat([torch.full_like(site.loc, getattr(state, name) is None, dtype=torch.bool)
                     for site, state in zip(self.sites, states)])

    def buffer(self, states, name: str, fill: float) -> torch.Tensor:
        """The sites' ``name`` buffers as one flat vector (``fill`` for a site without one)."""
        values = [getattr(state, name) for state in states]
        if all(v is not None for v in values):
            return flat(values)
        return flat([torch.full_like(site.loc, fill) if v is None else v for site, v in zip(self.sites, values)])

    def keep(self, states, name: str, values: torch.Tensor) -> None:
        """Store the flat ``values`` as the sites' ``name`` buffers, each shaped like its loc."""
        for state, piece in zip(states, _unflatten_dense_tensors(values, [site.loc for site in self.sites])):
            setattr(state, name, piece)

    def started(self, states, value: bool) -> torch.Tensor:
        """Flat bool: the elements of sites whose ``started`` is ``value``."""
        return flat([torch.full_like(site.loc, state.started is value, dtype=torch.bool)
                     for site, state in zip(self.sites, states)])
