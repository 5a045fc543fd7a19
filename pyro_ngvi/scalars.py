"""
Python numbers as 0-d tensors of a tensor's dtype and device, made once and kept.

An operation between a ``float32`` tensor and a Python ``float`` (``x * 0.5``,
``torch._foreach_mul_(xs, factor)``) wraps the number as a 0-d ``float64`` tensor and casts it
to ``float32`` on every call (TensorIterator's type promotion: a copy, 3-4 us on the CPU, more
than the kernel on a small tensor). The same operation with the number already a 0-d tensor of
the operand's dtype computes the same values, to the bit (the number is rounded to the dtype
either way), without the cast.
"""

from typing import Dict, Tuple

import torch

#: at most this many numbers are kept (the step's constants; a schedule's changing values
#: would otherwise grow the table without bound): beyond, the table starts afresh
KEPT = 256

_kept: Dict[Tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype and device (read-only: shared)."""
    key = (value, like.dtype, like.device)
    found = _kept.get(key)
    if found is None:
        if len(_kept) >= KEPT:
            _kept.clear()
        found = _kept[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return found
