"""
How a fused element-wise pass runs (:func:`run`): eagerly, its operations one kernel each
over the group's flat vectors (the default: nothing to compile), or compiled by
:func:`torch.compile` (inductor's C++ on the CPU, Triton on CUDA) into one or two loops
over the elements that read each state tensor once and write it once, as torch's fused
Adam does. The pass is a function of tensors, numbers and a static configuration (which
branches apply); a compiled function is made once per configuration and shape and kept for the process
(:data:`compiled_kernels`), and a configuration that fails to compile runs eagerly, with one
warning.

Compiling costs time once per configuration and process (on the 2-core CPU this was measured
on, 20-60 s for the first configuration and 5-15 s for each further one, less with inductor's
on-disk cache warm); it saves per step about one pass over memory per operation of the chain,
so it pays for large sites over many steps (``benchmarks/bnn_step.py --compiled`` measures when).
Hence compiling is opt-in: :class:`~pyro_ngvi.NGVI` ``(compile=True)``.
"""

import contextlib
import time
import warnings
from typing import Callable, Dict

import torch

from ..monitor import NGVIWarning

#: (kernel, configuration, shape) -> its compiled function (or the kernel itself, where compiling failed)
compiled_kernels: Dict[tuple, Callable] = {}
#: (kernel, configuration) -> seconds its first compiled call took (compilation included)
compile_seconds: Dict[tuple, float] = {}


class CompileWarning(NGVIWarning):
    """A pass could not be compiled and runs eagerly."""


def run(kernel: Callable, configuration, compiled: bool, *args):
    """``kernel(configuration, *args)``, compiled (one function per ``configuration``,
    a hashable static value, and shape of the elements) or not."""
    if not compiled:
        return kernel(configuration, *args)
    args = _detached(args)  # (views of parameters made without grad: autograd need not see them)
    key = (kernel, configuration)
    shaped = key + (_shape(args),)
    function = compiled_kernels.get(shaped)
    fresh = function is None
    if fresh:
        function = compiled_kernels[shaped] = _compile(kernel, configuration)
    start = time.perf_counter()
    try:
        with _quiet_compiler() if fresh else contextlib.nullcontext():
            result = function(*args)
    except Exception as error:  # noqa: BLE001  (inductor's errors have no common class; before any write)
        compiled_kernels[shaped] = _eager(kernel, configuration)
        warnings.warn(f"pyro_ngvi could not compile {kernel.__name__} for {configuration} "
                      f"({type(error).__name__}: {str(error)[:300]}); it runs eagerly", CompileWarning, stacklevel=2)
        return kernel(configuration, *args)
    if key not in compile_seconds:
        compile_seconds[key] = time.perf_counter() - start
    return result


def _shape(args) -> torch.Size:
    """The shape of the first tensor in ``args`` (a group's elements: every tensor of a pass has them)."""
    for value in args:
        if torch.is_tensor(value):
            return value.shape
        if isinstance(value, tuple):
            for item in value:
                if torch.is_tensor(item):
                    return item.shape
    return torch.Size()


@contextlib.contextmanager
def _quiet_compiler():
    """Around a first (compiling) call: the compiler's own deprecation warnings (inductor's use of
    ``torch.jit`` on torch 2.11) are not the user's; under warnings-as-errors they failed the compile."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _eager(kernel: Callable, configuration) -> Callable:
    def eager(*args):
        return kernel(configuration, *args)

    return eager


def _detached(value):
    """``value`` with every tensor in it (in tuples, named or not) detached."""
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, tuple):
        items = [_detached(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _compile(kernel: Callable, configuration) -> Callable:
    def bound(*args):
        with torch.no_grad():
            return kernel(configuration, *args)

    bound.__name__ = bound.__qualname__ = f"{kernel.__name__}_fused_{len(compiled_kernels)}"
    # a code object and a name of its own per configuration and shape: dynamo keeps at most
    # ``recompile_limit`` (8) graphs per code object (sharing one, the ninth configuration of a
    # process would fall back), and it remembers the shapes a function met by its name and line,
    # across code objects: a second shape under one name is compiled with symbolic sizes, which
    # torch 2.14's fake tensors refuse for views of a parameter (``aten.set_`` on a storage of
    # symbolic size; the recipe's first layer, then the flat rest of the net). The numbers
    # (rates that change every step) are inputs of the graph, not part of its key.
    bound.__code__ = bound.__code__.replace(co_name=bound.__name__, co_qualname=bound.__name__)
    return torch.compile(bound, fullgraph=True, dynamic=None)
