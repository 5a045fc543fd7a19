"""
Data-parallel and Monte-Carlo-sample-parallel :class:`~pyro_ngvi.NGVI` on
:mod:`torch.distributed`.

Launch one process per worker (``torchrun --nproc_per_node=K script.py``, or set
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` yourself) and initialise
the default process group (``gloo`` on CPU, ``nccl`` on GPU) before training.
Every rank builds the same model and guide from the same initial values, runs
:class:`~pyro.infer.SVI` with :class:`~pyro_ngvi.NGVI` on its own shard of the
data (:func:`shard`) and draws its own Monte-Carlo sample of the weights
(:func:`seed_rank`). Inside each step, :class:`~pyro_ngvi.NGVI` calls
:func:`all_reduce_stats`, which averages over the :math:`K` ranks

.. math:: g = \\frac{1}{K}\\sum_{r=1}^K g_r, \\qquad h = \\frac{1}{K}\\sum_{r=1}^K h_r

for every guide site, and the ``.grad`` of the point-estimated parameters, so
that all ranks take the identical update: :math:`K` ranks with one sample and a
batch of :math:`B` each take the step one process would take with
``num_particles=K`` and a batch of :math:`KB` (the ELBO's own per-site scaling
already makes each rank's :math:`g, h` a full-data estimate). Drawing a sample
per device is the "distributed training" of Osawa et al. [1]: it buys the
variance reduction of :math:`K` samples at the cost of one.

Without an initialised process group, or with one rank, nothing happens and
nothing is communicated: single-process users pay one function call.

**References**

[1] `Practical Deep Learning with Bayesian Principles`, Kazuki Osawa, Siddharth
    Swaroop, Anirudh Jain, Runa Eschenhagen, Richard E. Turner, Rio Yokota,
    Mohammad Emtiyaz Khan (NeurIPS 2019)
"""

import hashlib
import numbers
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

import pyro

from .family import SiteCurvature
from .kronecker import KroneckerSite
from .low_rank_guide import LowRankSite

__all__ = [
    "DistributedError",
    "all_reduce_stats",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "seed_rank",
    "shard",
]


class DistributedError(RuntimeError):
    """Raised when the ranks cannot agree on a step: a collective failed (another
    rank failed, left or timed out) or the ranks run different guides."""


#: whether torch was built with torch.distributed (fixed for the process: read once, not every step)
_AVAILABLE = dist.is_available()


def is_distributed() -> bool:
    """``True`` when a default process group with more than one rank is initialised."""
    return _AVAILABLE and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def seed_rank(seed: int) -> int:
    """
    Seed Pyro's, torch's, numpy's and Python's generators with ``seed + rank``, so
    that each rank draws its own Monte-Carlo samples, reproducibly. Call it after
    building the model and the guide from a common seed (their initial values must
    be the same on every rank) and before training.

    :returns: the seed this rank uses.
    :raises ValueError: unless ``seed`` is a whole number with every rank's seed in
        :math:`[0, 2^{32})` (a float was truncated: ``seed_rank(0.5)`` seeded 0).
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= 2**32 - get_world_size():
        raise ValueError(f"seed must be a whole number in [0, 2**32 - {get_world_size()}] (each rank seeds "
                         f"seed + rank), got {seed!r}")
    rank_seed = int(seed) + get_rank()
    pyro.set_rng_seed(rank_seed)
    return rank_seed


def shard(num_examples: int) -> torch.Tensor:
    """
    This rank's indices ``rank, rank + K, rank + 2K, ...`` into a data set of
    ``num_examples``, every shard of the same length (the last ``num_examples % K``
    examples are dropped), so that all ranks take the same number of steps: a rank
    that takes one step more waits for the others until the group times out.

    :raises ValueError: unless ``num_examples`` is a whole number of at least :math:`K`
        (a float gave float indices, ``shard(2.5)`` was ``tensor([0., 1.])``; fewer
        examples than ranks, empty shards).
    """
    world = get_world_size()
    if isinstance(num_examples, bool) or not isinstance(num_examples, numbers.Integral) or num_examples < world:
        raise ValueError(f"num_examples must be a whole number of examples, at least the {world} rank(s), "
                         f"got {num_examples!r}")
    return torch.arange(get_rank(), num_examples - num_examples % world, world)


# ---------------------------------------------------------------------- the hook
def without_draws(stats: Dict, sites) -> Dict:
    """The statistics of ``sites`` for averaging across processes: each rank draws its own
    :math:`\\epsilon`, so no control variate (the draws dropped). Kronecker and low-rank sites are
    refused (their factors are not averaged yet). A no-op (returning ``stats``) without a process
    group, as :func:`all_reduce_stats` is."""
    if not is_distributed():
        return stats
    if any(isinstance(site, (KroneckerSite, LowRankSite)) for site in sites):
        raise NotImplementedError("NGVI does not average Kronecker or low-rank factors across processes yet")
    return {key: replace(s, eps_mean=None, eps_sq_mean=None, draws=False) if isinstance(s, SiteCurvature) else s
            for key, s in stats.items()}


def all_reduce_stats(
    stats: Dict[str, SiteCurvature], others: Sequence[torch.Tensor]
) -> Dict[str, SiteCurvature]:
    """
    Average every site's :class:`~pyro_ngvi.handover.SiteCurvature` and the ``.grad``
    of the point-estimated parameters ``others`` across the ranks of the default
    process group; a no-op (returning ``stats``) without one. Called by
    :class:`~pyro_ngvi.NGVI` before its finiteness check.

    - ``grad`` and ``curvature``: the mean over ranks.
    - ``mask`` (subsampled local latents): a row is touched if any rank touched it
      and gets the mean over the ranks that touched it (each rank's touched rows
      are full-data estimates); ``prior_loc`` and ``prior_precision`` of such a
      site are taken from those ranks too. A rank without a mask touched all rows.
    - ``.grad`` of ``others``: the mean over all ranks, ``None`` counting as
      zero, as in :class:`~torch.nn.parallel.DistributedDataParallel`; it stays
      ``None`` only where it is ``None`` on every rank.

    Values in rows a rank did not touch never leave it. Every rank ends with
    bit-identical tensors, so a non-finite value on any rank makes every rank skip
    the step. All ranks must run the same model and guide: every step first
    compares a fingerprint of the sites' and parameters' names, shapes and dtypes
    across ranks (a rank cannot know whether another's changed), and a mismatch
    raises on every rank, naming it. Communication: that all-reduce of two
    integers, one small all-reduce of a header (which sites carry masks or
    conjugate priors, which parameters have gradients; reading the two is the
    step's device syncs) and one flattened all-reduce per dtype and device.

    :param dict stats: site name -> :class:`~pyro_ngvi.handover.SiteCurvature`.
    :param others: the point-estimated parameters (unconstrained, in the param store).
    :returns: the averaged stats (new objects; the inputs are not modified).
    :raises DistributedError: when a collective fails or times out (another rank
        failed), or the ranks' sites or parameters differ (on every rank).
    """
    if not is_distributed():
        return stats
    world = dist.get_world_size()
    names = sorted(stats)
    sites = [stats[name] for name in names]
    # SVI hands its parameters over as a set: order them the same way on all ranks
    others = sorted(others, key=_param_key)
    device = sites[0].grad.device if sites else (others[0].device if others else torch.device("cpu"))
    _check_layout(names, sites, others, device)  # then the header has one length on all ranks

    header = []
    for s in sites:
        header += [s.mask is not None, s.prior_precision is not None]
    for p in others:
        header += [p.grad is not None]
    header = torch.tensor(header, dtype=torch.int64, device=device)
    _all_reduce(header)
    header = header.tolist()
    site_header, other_header = header[: 2 * len(sites)], header[2 * len(sites):]
    _check_header(names, site_header, world)

    buffers = _Buffers()
    plan: List[Tuple] = []
    for j, s in enumerate(sites):
        any_mask, has_prior = site_header[2 * j] > 0, site_header[2 * j + 1] > 0
        if not any_mask:
            plan.append((buffers.add(s.grad), buffers.add(s.curvature), None, None, None))
            continue
        mask = s.mask if s.mask is not None else torch.ones_like(s.grad, dtype=torch.bool)
        pieces = [_masked(s.grad, mask), _masked(s.curvature, mask)]
        count = mask.to(s.grad.dtype)
        if has_prior:
            pieces += [_masked(s.prior_loc, mask), _masked(s.prior_precision, mask)]
        slots = [buffers.add(t) for t in pieces]
        prior_slots = (slots[2], slots[3]) if has_prior else (None, None)
        plan.append((slots[0], slots[1], buffers.add(count), *prior_slots))
    point_slots = [buffers.add(p.grad if p.grad is not None else torch.zeros_like(p))
                   if other_header[i] > 0 else None for i, p in enumerate(others)]

    buffers.all_reduce(world)  # every flat buffer now holds the sums divided by K

    reduced = {}
    for name, s, (g, h, count, prior_loc, prior_precision) in zip(names, sites, plan):
        grad, curvature = buffers.get(g), buffers.get(h)
        if count is None:
            reduced[name] = replace(s, grad=grad, curvature=curvature)
            continue
        # count holds (ranks that touched the row) / K: divide the means by it
        count = buffers.get(count)
        divisor = count.clamp(min=1.0 / world)
        update = dict(grad=grad / divisor, curvature=curvature / divisor, mask=count > 0)
        if prior_loc is not None:
            update.update(prior_loc=buffers.get(prior_loc) / divisor,
                          prior_precision=buffers.get(prior_precision) / divisor)
        reduced[name] = replace(s, **update)
    for p, slot in zip(others, point_slots):
        if slot is None:
            continue
        p.grad = buffers.get(slot)
    return {name: reduced[name] for name in stats}


class _Buffers:
    """Tensors packed into one flat buffer per (dtype, device), all-reduced at once."""

    def __init__(self):
        self._pieces: Dict[Tuple, List[torch.Tensor]] = {}
        self._sizes: Dict[Tuple, int] = {}
        self._flat: Dict[Tuple, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor) -> Tuple:
        key = (tensor.dtype, tensor.device)
        offset = self._sizes.get(key, 0)
        self._pieces.setdefault(key, []).append(tensor.detach().reshape(-1))
        self._sizes[key] = offset + tensor.numel()
        return key, offset, tensor.shape

    def all_reduce(self, world: int) -> None:
        # the same keys in the same order on every rank: the header fixed the layout
        for key, pieces in self._pieces.items():
            flat = torch.cat(pieces)
            _all_reduce(flat)
            self._flat[key] = flat.div_(world)

    def get(self, slot: Tuple) -> torch.Tensor:
        key, offset, shape = slot
        return self._flat[key][offset: offset + shape.numel()].view(shape)


def _masked(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``tensor`` where ``mask``, else 0 (also where ``tensor`` is not finite)."""
    return torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def _param_key(p: torch.Tensor):
    name = pyro.get_param_store().param_name(p)
    return (name is None, name or "", tuple(p.shape))


def _all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    try:
        dist.all_reduce(tensor, op=op)
    except RuntimeError as error:  # gloo and nccl raise RuntimeError subclasses
        raise DistributedError(
            f"NGVI could not all-reduce gradient and curvature on rank {dist.get_rank()} "
            f"of {dist.get_world_size()}: another rank has failed or left (its log holds "
            "the cause), or the process group's timeout expired. Original error: "
            f"{error}"
        ) from error


def _check_layout(names, sites, others, device) -> None:
    """
    Raise :class:`DistributedError` on every rank unless all ranks hand over the
    same sites and parameters (names, shapes, dtypes): one all-reduce (maximum)
    of a 63-bit fingerprint and its negation gives the largest and the smallest
    fingerprint on every rank; only when they differ are the layouts gathered,
    to name the difference.
    """
    layout = [f"site '{name}' {tuple(s.grad.shape)} {s.grad.dtype}" for name, s in zip(names, sites)]
    layout += [f"parameter {_param_key(p)[1]!r} {tuple(p.shape)} {p.dtype}" for p in others]
    digest = hashlib.blake2b("\n".join(layout).encode(), digest_size=8).digest()
    fingerprint = int.from_bytes(digest, "little") >> 1  # fits an int64
    extremes = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    _all_reduce(extremes, op=dist.ReduceOp.MAX)
    largest, negated_smallest = extremes.tolist()
    if largest == -negated_smallest:
        return
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    everywhere, anywhere = set.intersection(*map(set, layouts)), set.union(*map(set, layouts))
    differences = []
    for rank, entries in enumerate(layouts):
        extra = [e for e in entries if e not in everywhere]
        missing = sorted(anywhere - set(entries))
        parts = ([f"has {', '.join(extra)}"] if extra else []) + ([f"lacks {', '.join(missing)}"] if missing else [])
        if parts:
            differences.append(f"rank {rank} " + " and ".join(parts))
    raise DistributedError(
        "NGVI's ranks hand over different guide sites or parameters (every rank must run "
        "the same model and guide, with the same names, shapes and dtypes): "
        + "; ".join(differences)
    )


def _check_header(names, site_header, world) -> None:
    """The same decision on every rank: all see the same summed header."""
    problems = [f"site '{name}' has a conjugate prior on some ranks only"
                for j, name in enumerate(names) if site_header[2 * j + 1] not in (0, world)]
    if problems:
        raise DistributedError(
            "NGVI's ranks disagree on the guide (every rank must run the same model and "
            "guide): " + "; ".join(problems)
        )
