"""
Mean-field sites updated together as one flat vector (one kernel per operation
rather than one per site and operation): which sites may share a group
(:func:`group_sites`), the group's views of their tensors and the flat buffers that
hold their state between steps (:class:`Group`), the scratch buffers a step's
temporaries go into (:class:`Workspace`), and the flat-vector helpers the update uses.

Sites share a group when they share the map to sigma (the scale constraint), dtype, device and the
kind of their statistics, are not masked, and together hold at most
:data:`FLAT_MAX` elements; a masked site (subsampled rows) or a large one is a group
of its own, whose flat tensors are views (no copies).

**No allocation in a step.** On the CPU a new tensor of more than ~128 KiB comes from
the system, and the first touch of each of its pages costs a page fault: a fresh
temporary of a large site can cost ten times the arithmetic written into it (measured:
0.8 ms per MiB in a virtual machine). So a group keeps its per-element state (the
remembered :math:`\\sigma`, the momentum, the signs of the stall test, the adaptive
steps' buffers) in flat buffers made once, which the sites' own state tensors view, and
the element-wise pass writes its temporaries into a :class:`Workspace` made once per
optimizer: a step of an unchanged guide allocates no element-sized tensor.
"""

from typing import Dict, List, Optional

import torch
from torch._utils import _flatten_dense_tensors

import pyro

from .family import GaussianSite, SiteCurvature
from .hot_path import same

#: Sites are concatenated into one update up to this many elements: that saves
#: per-operation overhead on small tensors and bounds the copies it costs.
FLAT_MAX = 1 << 16


def flat(tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensors, flattened and concatenated (no copy for a single contiguous one, nor for a single
    number broadcast to a shape: a prior's or the family's floor, which stays a broadcast view);
    concatenated into ``out`` where given."""
    if len(tensors) == 1:
        tensor = tensors[0]
        if tensor.dim() > 1 and not any(tensor.stride()):
            return tensor.as_strided((tensor.numel(),), (0,))
        return tensor.reshape(-1)
    if out is not None:
        return torch.cat([t.reshape(-1) for t in tensors], out=out)
    if all(t.is_contiguous() for t in tensors):
        return _flatten_dense_tensors(tensors)  # one call: reshape and cat in C++
    return torch.cat([t.reshape(-1) for t in tensors])  # (an expanded prior: no copy before the cat)


def select(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """
    ``torch.where(condition, a, b)`` for finite ``a`` and ``b`` (broadcast), as
    ``torch.lerp(b, a, m)`` on the 0 / 1 mask ``m`` of ``condition``: exactly the same
    values (``lerp(b, a, 0) = b``, ``lerp(b, a, 1) = a``), without torch's CPU ``where``,
    which runs one element at a time (~4 ns an element against ~0.2-0.4 ns). ``a`` and ``b``
    have the same dtype. ``weight``: a buffer for the mask, ``out``: for the result (either
    may be ``a`` or ``b`` themselves; default: new tensors).
    """
    if condition.dtype == a.dtype:  # (a 0 / 1 mask already)
        mask = condition
    else:
        mask = condition.to(a.dtype) if weight is None else weight.copy_(condition)
    return torch.lerp(b, a, mask, out=out)


def statistics_kind(stats: SiteCurvature) -> tuple:
    """What of a site's statistics decides its group and its update's code path."""
    return (stats.mask is None, stats.sampled, stats.nonnegative, stats.prior_precision is None,
            stats.eps_mean is None, stats.eps_sq_mean is None, stats.num_data, stats.min_precision is None,
            stats.gradients, stats.draws)


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
            constraint = id(pyro.get_param_store()._constraints[site.scale_name]), site.scale_map
            key = (constraint, site.loc.dtype, site.loc.device) + statistics_kind(s)[1:]
            if sizes.get(key, 0) + site.loc.numel() > FLAT_MAX:  # start another group
                groups[key + (len(groups),)] = groups.pop(key)
                sizes[key] = 0
        groups.setdefault(key, []).append(site)
        sizes[key] = sizes.get(key, 0) + site.loc.numel()
    return list(groups.values())


def _unchanged(kept: List[torch.Tensor], versions: List[int], tensors: List[torch.Tensor]) -> bool:
    """Whether ``tensors`` are the ``kept`` ones, not written since (their ``versions`` then)."""
    if len(kept) != len(tensors):
        return False
    for a, version, b in zip(kept, versions, tensors):
        if a is not b or b._version != version:
            return False
    return True


class Group:
    """Sites updated as one flat vector, with what the update needs of them every step and
    the flat buffers that hold their per-element state."""

    __slots__ = ("sites", "sizes", "locs", "raw_scales", "transform", "cache", "numel", "like", "loc_tensors",
                 "raw_tensors")

    def __init__(self, sites: List[GaussianSite], sizes, locs, raw_scales, transform, cache):
        self.sites, self.sizes = sites, sizes
        self.locs = locs  # flat views of the sites' loc tensors, to write into
        self.raw_scales = raw_scales  # and of their raw scale tensors
        self.transform = transform  # raw scale -> sigma
        self.cache = cache  # small constant tensors, kept flats (flat_of), the state buffers
        self.numel = sum(sizes)
        self.like = locs[0]
        self.loc_tensors = [site.loc for site in sites]  # (the sites' own, as shaped)
        self.raw_tensors = [site.raw_scale for site in sites]

    @classmethod
    def of(cls, sites: List[GaussianSite]) -> "Group":
        with torch.no_grad():
            return cls(sites, [site.loc.numel() for site in sites],
                       [site.loc.view(-1) for site in sites],
                       [site.raw_scale.view(-1) for site in sites],
                       sites[0]._scale_transform, {})

    @property
    def one(self) -> bool:
        """A group of one site: its flat tensors are views of the site's."""
        return len(self.sites) == 1

    def flat_of(self, name: str, tensors: List[torch.Tensor]) -> torch.Tensor:
        """:func:`flat` of ``tensors``, kept while they are the same tensors, unchanged (a
        fixed prior and the family's floor are: their concatenation is not redone every
        step; nor, for one tensor, its flat view: making it is an operation); the result is read-only."""
        kept = self.cache.get(("flat", name))
        if kept is not None and _unchanged(kept[0], kept[1], tensors):
            return kept[2]
        result = flat(tensors)
        self.cache[("flat", name)] = (list(tensors), [t._version for t in tensors], result)
        return result

    def least(self, name: str, tensors: List[torch.Tensor]) -> float:
        """The least value of ``tensors`` (a host number), kept while they are the same tensors,
        unchanged (the family's floor: read once, not every step)."""
        kept = self.cache.get(("least", name))
        if kept is not None and _unchanged(kept[0], kept[1], tensors):
            return kept[2]
        result = min(float(t.min()) for t in tensors)
        self.cache[("least", name)] = (list(tensors), [t._version for t in tensors], result)
        return result

    def cached(self, key, make):
        """``make()``, computed once per ``key`` for this group (small constant tensors)."""
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = make()
        return found

    # ------------------------------------------------ per-element state, held flat
    def pieces(self, name: str, flat_tensor: torch.Tensor) -> List[torch.Tensor]:
        """``flat_tensor`` split into the sites' flat pieces: kept where it is the group's own ``name``
        buffer (:meth:`owned`, made once), else split anew."""
        if flat_tensor is self.cache.get(("owned", name)):
            return self.cached(("pieces", name), lambda: flat_tensor.split_with_sizes(self.sizes))
        return flat_tensor.split_with_sizes(self.sizes)

    def views(self, flat_tensor: torch.Tensor) -> List[torch.Tensor]:
        """``flat_tensor`` (the group's length) cut into views shaped like the sites' locs."""
        return [piece.view_as(site.loc) for piece, site in zip(flat_tensor.split(self.sizes), self.sites)]

    def state(self, states, name: str, fill: Optional[float] = None, dtype=None) -> Optional[torch.Tensor]:
        """
        The sites' ``name`` state as one flat buffer that their state tensors are views of:
        made once (the sites' values copied in), then the same tensor every step, written in
        place. A site without one yet gets ``fill`` (``None``: the buffer is made only once
        every site has one, else ``None`` is returned).
        """
        values = [getattr(state, name) for state in states]
        kept = self.cache.get(("state", name))
        if kept is not None and same(values, kept[1]):
            return kept[0]
        if fill is None and any(v is None for v in values):
            return None
        buffer = torch.empty(self.numel, dtype=dtype or self.like.dtype, device=self.like.device)
        views = self.views(buffer)
        for state, value, view in zip(states, values, views):
            view.copy_(value if value is not None else torch.full((), fill, dtype=view.dtype))
            setattr(state, name, view)
        self.cache[("state", name)] = (buffer, views)
        return buffer

    def sigma(self, scales: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """The sites' sigma (``scales``, one each) as one flat vector: the group's own buffer when
        every site's is the view of it that it remembers (the sigma the update wrote last), else
        copied into that buffer; ``None`` when a site's is unknown (``None``)."""
        for scale in scales:
            if scale is None:
                return None
        own = self.owned("scale")
        views = self.cached("scale views", lambda: self.views(own))
        if same(scales, views):
            return own
        if self.one:
            return flat(scales)
        if any(scale.untyped_storage().data_ptr() == own.untyped_storage().data_ptr() for scale in scales):
            # (some sites' sigma still views this buffer, others' another group's: a guide whose
            # structure changes between steps; torch refuses a cat into memory it reads from)
            return own.copy_(flat(scales))
        return flat(scales, out=own)

    def owned(self, name: str, dtype=None) -> torch.Tensor:
        """A flat buffer of the group's length that the group alone holds (made once)."""
        key = ("owned", name)
        buffer = self.cache.get(key)
        if buffer is None:
            buffer = self.cache[key] = torch.empty(self.numel, dtype=dtype or self.like.dtype,
                                                   device=self.like.device)
        return buffer

    def gather(self, name: str, tensors: List[torch.Tensor]) -> torch.Tensor:
        """:func:`flat` of the sites' ``tensors`` (one each): a view for a group of one, else
        concatenated into a buffer the group holds (``name``), overwritten at the next gather."""
        if self.one:
            return flat(tensors)
        buffer = self.owned(name, tensors[0].dtype)
        torch._foreach_copy_(self.cached(("views", name), lambda: self.views(buffer)), tensors)
        return buffer

    def flags(self, values: List[bool]) -> torch.Tensor:
        """Flat 0 / 1 in the sites' dtype: each site's elements set to its value (kept per pattern)."""
        key = ("flags", tuple(values))
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = flat([torch.full_like(site.loc, float(value)) for site, value in
                                            zip(self.sites, values)])
        return found

    def fresh(self, states, name: str):
        """Where a site has no ``name`` buffer yet (flat 0 / 1), or ``None`` when all have."""
        values = [getattr(state, name) is None for state in states]
        return self.flags(values) if any(values) else None

    def started(self, states, value: bool) -> torch.Tensor:
        """Flat 0 / 1: the elements of sites whose ``started`` is ``value``."""
        return self.flags([state.started is value for state in states])


class Workspace:
    """
    Scratch buffers for a step's temporaries, made once per optimizer and device and grown
    when a longer group comes (a large site runs in spans, so their length is bounded):
    :meth:`take` hands out ``count`` flat views of ``n`` elements, which the element-wise
    pass overwrites (their values do not outlive the call that took them).
    """

    def __init__(self):
        self._buffers: Dict[tuple, torch.Tensor] = {}
        self._views: Dict[tuple, List[torch.Tensor]] = {}  # (dtype, device, count, n) -> the views handed out

    def take(self, n: int, like: torch.Tensor, count: int, dtype=None) -> List[torch.Tensor]:
        """``count`` flat buffers of ``n`` elements like ``like`` (or of ``dtype``)."""
        dtype = dtype or like.dtype
        key = (dtype, like.device, count)
        views = self._views.get(key + (n,))
        if views is not None:
            return views
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[1] < n:
            # rows of a multiple of 64 bytes: each starts aligned as a new tensor does (a reduction
            # over a row then sums in the same order, to the bit)
            width = -(-n * dtype.itemsize // 64) * 64 // dtype.itemsize
            buffer = self._buffers[key] = torch.empty((count, width), dtype=dtype, device=like.device)
            self._views = {k: v for k, v in self._views.items() if k[:3] != key}  # (views of the old one)
        views = self._views[key + (n,)] = list(buffer[:, :n].unbind(0))
        return views

    def rows(self, n: int, like: torch.Tensor, count: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the buffers :meth:`take` hands out, as one ``(stop - start, n)`` view."""
        self.take(n, like, count)
        return self._buffers[(like.dtype, like.device, count)][start:stop, :n]

    def kept(self, n: int, like: torch.Tensor, count: int, name: str, make):
        """``make()`` (views of the buffers :meth:`take` hands out: a step's scratch set), made once
        per ``name`` and length and kept while those buffers are (a longer group's grows them anew)."""
        key = (like.dtype, like.device, count, name, n)
        found = self._views.get(key)
        if found is None:
            found = make()
            self._views[key] = found  # (after make: a buffer it grew dropped the views of the old one)
        return found
