"""
Cheaper forms of two torch idioms for what runs at every step (issue 24: a small network's
step is mostly fixed cost).

* :func:`scalar`: a Python number as a 0-d tensor of a tensor's dtype and device, made once and
  kept. An operation between a ``float32`` tensor and a Python ``float`` (``x * 0.5``,
  ``torch._foreach_mul_(xs, factor)``) wraps the number as a 0-d ``float64`` tensor and casts it
  to ``float32`` on every call (TensorIterator's type promotion: a copy, 3-4 us on the CPU, more
  than the kernel on a small tensor). With the number already a 0-d tensor of the operand's
  dtype the operation computes the same values, to the bit (the number is rounded to the dtype
  either way), without the cast.
* :func:`no_grad`: ``torch.no_grad()`` as a decorator at the cost of a flag: torch's makes two
  context-manager objects per call (~6 us on the CPU); this one reads the grad mode, and sets and
  restores it only where it is on.

And :func:`same`, the check by identity that a step's plan (made once, kept while the guide's
structure stands) still holds, as a plain loop: ``all(a is b for a, b in zip(...))`` runs a
generator frame per element; :func:`reference`, what a cache keyed by ``id()`` keeps to
tell its object from a later one at the same address; and :func:`kept_caller`, the SVI that
called last step confirmed at the calling frame, without walking the stack.
"""

import functools
import sys
import weakref
from typing import Callable, Dict, Sequence, Tuple, TypeVar

import torch

#: at most this many numbers are kept (the step's constants; a schedule's changing values
#: would otherwise grow the table without bound): beyond, the table starts afresh
KEPT = 256

_kept: Dict[Tuple[float, torch.dtype, torch.device], torch.Tensor] = {}

F = TypeVar("F", bound=Callable)


def scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype and device (read-only: shared)."""
    key = (value, like.dtype, like.device)
    found = _kept.get(key)
    if found is None:
        if len(_kept) >= KEPT:
            _kept.clear()
        found = _kept[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return found


def no_grad(function: F) -> F:
    """``function`` run with gradients off, as under ``@torch.no_grad()`` (the grad mode is
    restored after it, also when it raises)."""
    @functools.wraps(function)
    def without_grad(*args, **kwargs):
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        torch._C._set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)
    return without_grad


def same(objects: Sequence, others: Sequence) -> bool:
    """Whether the two sequences hold the same objects (identity, not ``==``: tensors), in order."""
    if len(objects) != len(others):
        return False
    for a, b in zip(objects, others):
        if a is not b:
            return False
    return True


def reference(obj) -> Callable:
    """A weak reference to ``obj`` (``ref() is obj`` while it lives; ``None`` after), or, for an
    object that takes none, a callable returning it: what a cache keyed by ``id(obj)`` keeps to
    tell ``obj`` from a later object that got its freed id."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def kept_caller(kept, attribute: str, value, depth: int = 2):
    """
    The SVI of ``kept`` (``(weak reference to it, weak reference to its optimizer)``, or ``None``)
    when it is the ``self`` of the frame ``depth`` up (2: the caller's caller), still has that
    optimizer, and its ``attribute`` is ``value``; else ``None``. What
    :func:`~pyro_ngvi.family.calling_svi` found last step, confirmed at the first frame it would
    look at (no walk of the stack, which costs a call per frame).
    """
    if kept is None:
        return None
    caller = sys._getframe(depth).f_locals
    owner = caller["self"] if "self" in caller else None
    if owner is not None and owner is kept[0]() and owner.optim is kept[1]() and getattr(owner, attribute) == value:
        return owner
    return None
