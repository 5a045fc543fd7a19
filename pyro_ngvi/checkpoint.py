"""
Loading checkpoints without running code from them.

``torch.load(..., weights_only=False)`` unpickles arbitrary objects, and a pickle
may name any callable to build one (``__reduce__`` returning ``exec`` and a
string): loading a crafted file runs its code. Pyro's
:meth:`PyroOptim.load <pyro.optim.optim.PyroOptim.load>` and
:meth:`ParamStoreDict.load <pyro.params.param_store.ParamStoreDict.load>` load
that way. Here both load with ``weights_only=True``, which builds only tensors,
numbers, strings, containers and the classes allowed explicitly:
:meth:`pyro_ngvi.NGVI.load` allows none (its state is plain), and
:func:`~pyro_ngvi.load_param_store` allows the constraint classes of
:mod:`torch.distributions.constraints` and :mod:`pyro.distributions.constraints`
(a param store records each parameter's constraint).
"""

import pickle
import struct
from typing import Iterable

import torch
from torch.distributions import constraints as torch_constraints

import pyro
from pyro.distributions import constraints as pyro_constraints

from .arguments import check_load_arguments

__all__ = ["load_param_store", "safe_load"]


def safe_load(filename, map_location=None, allowed: Iterable[type] = (), what: str = "checkpoint"):
    """
    ``torch.load(filename, map_location, weights_only=True)`` with the classes
    ``allowed`` besides tensors, numbers, strings and containers.

    :raises ValueError: naming the file, when it holds anything else (a crafted
        file, or one saved from objects this loader does not know); nothing in
        it has run. Also when it is empty, cut short or not written by ``torch.save``,
        and naming the argument for a ``filename`` that is not a path or a
        ``map_location`` torch cannot take (:func:`~pyro_ngvi.arguments.check_load_arguments`).
    """
    check_load_arguments(filename, map_location)
    with open(filename, "rb") as f, torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "Unsupported global" in line), None)
            if reason is None:  # (an operand the unpickler does not know: not a pickle of torch.save's)
                raise _unreadable(filename, what, next((line for line in lines if "Unsupported" in line),
                                                       repr(error))) from error
            raise ValueError(
                f"Refused to load {str(filename)!r} as a {what}: it holds objects other than "
                "tensors, numbers, strings and containers, and unpickling them could run "
                "code (as a crafted file does). Nothing from it was run. If you trust the "
                f"file, load it with torch.load(..., weights_only=False) yourself. Reason: {reason}"
            ) from error
        except (EOFError, RuntimeError) as error:  # (empty; torch's zip reader: cut short or not a zip)
            if isinstance(error, RuntimeError) and "PytorchStreamReader" not in str(error):
                raise
            raise _unreadable(filename, what, str(error).split(". ")[0] or "the file ends before any object") from error
        except (KeyError, IndexError, struct.error) as error:
            # (the weights-only unpickler reading text or other bytes as pickle opcodes: 'h', 'g', 'j' look up
            # a memo it never filled, '(' or 'K' pop an empty stack, 'G' unpacks a float of too few bytes)
            raise _unreadable(filename, what, f"{type(error).__name__} {error}: not a pickle") from error


def _unreadable(filename, what: str, reason: str) -> ValueError:
    return ValueError(f"Could not read {str(filename)!r} as a {what}: it is empty, cut short or not a file "
                      f"torch.save wrote (a corrupted copy, or another format). Reason: {reason}")


def _constraint_classes():
    classes = set()
    for module in (torch_constraints, pyro_constraints):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, torch_constraints.Constraint):
                classes.add(value)
            elif isinstance(value, torch_constraints.Constraint):
                classes.add(type(value))
    return sorted(classes, key=lambda cls: (cls.__module__, cls.__qualname__))


def load_param_store(filename, map_location=None) -> None:
    """
    What ``pyro.get_param_store().load(filename, map_location)`` does (restore
    the parameters and their constraints saved by
    ``pyro.get_param_store().save``), without running code from the file:
    it loads with ``weights_only=True``, allowing only the constraint classes of
    :mod:`torch.distributions.constraints` and :mod:`pyro.distributions.constraints`.

    :param filename: a file written by ``pyro.get_param_store().save``.
    :param map_location: as in :func:`torch.load` (default: None).
    :raises ValueError: when the file holds anything else; the param store is
        then unchanged.
    """
    state = safe_load(filename, map_location, _constraint_classes(), what="Pyro param store")
    if not (isinstance(state, dict) and set(state) == {"params", "constraints"}):
        raise ValueError(f"{str(filename)!r} is not a Pyro param store (saved by ParamStoreDict.save)")
    pyro.get_param_store().set_state(state)
