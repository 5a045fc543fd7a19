"""
Checks of the public functions' arguments that are not numbers (those are in
:mod:`~pyro_ngvi.policies`): a model or a guide that is not one, priors that are not a dict of
distributions, a file name that is not a path. Each raises :class:`ArgumentError` naming the
argument and what it must be, before anything is run or written.
"""

import os

import torch

__all__ = ["ArgumentError", "check_callable", "check_guide", "check_load_arguments", "check_priors"]


class ArgumentError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` (its type) that is also the ``ValueError``
    every bad argument of the package raises."""


def check_callable(value, name: str, what: str) -> None:
    """:raises ArgumentError: unless ``value`` is callable (``name``: the argument, ``what``: what it must be)."""
    if not callable(value):
        raise ArgumentError(f"{name} must be {what}, got {type(value).__name__} {value!r:.60}")


def check_guide(guide, where: str, supported: str) -> None:
    """Refuse a ``guide`` argument that is no guide at all (not callable: a number, a tensor, a list).
    A guide of a kind ``where`` does not support is the caller's ``NotImplementedError``, saying
    what is (``supported``).

    :raises ArgumentError: naming ``guide``."""
    check_callable(guide, f"{where}: guide", f"a guide ({supported})")


def check_priors(priors, where: str, allow_none: bool = False) -> dict:
    """``priors`` as a dict: it must map site names (strings) to
    :class:`~torch.distributions.Distribution` objects (or be ``None``, read as ``{}``, where
    ``allow_none``).

    :raises ArgumentError: naming ``priors`` (and the entry) and what it must be."""
    if priors is None and allow_none:
        return {}
    if not isinstance(priors, dict):
        extra = " or None" if allow_none else ""
        raise ArgumentError(f"{where}: priors must be a dict {{site name: Distribution}}{extra}, got "
                            f"{type(priors).__name__} {priors!r:.60}")
    for name, prior in priors.items():
        if not isinstance(name, str):
            raise ArgumentError(f"{where}: priors must be keyed by site names (strings), got the key {name!r}")
        if not isinstance(prior, torch.distributions.Distribution):
            raise ArgumentError(f"{where}: priors[{name!r}] (the prior for site '{name}') must be a Distribution, "
                                f"got {type(prior).__name__}")
    return priors


def check_load_arguments(filename, map_location) -> None:
    """The arguments of a load: ``filename`` a path (``str``, ``bytes``, ``os.PathLike``: an int would be
    opened as a file descriptor, 0 the process's stdin, and closed after) and ``map_location`` what
    :func:`torch.load` takes (``None``, a device or a name torch reads as one, a dict from location tags
    to such names, a function).

    :raises ArgumentError: naming the argument."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        raise ArgumentError(f"filename must be a path (str or os.PathLike), got {type(filename).__name__} "
                            f"{filename!r:.60}")
    names = list(map_location.values()) if isinstance(map_location, dict) else \
        [map_location] if isinstance(map_location, str) else []
    if not (map_location is None or isinstance(map_location, (str, torch.device, dict)) or callable(map_location)) \
            or not all(isinstance(name, str) and _is_device_name(name) for name in names):
        raise ArgumentError("map_location must be None, a device (or its name), a dict of them (location tag -> "
                            "device name) or a function, as torch.load takes, got "
                            f"{type(map_location).__name__} {map_location!r:.60}")


def _is_device_name(name: str) -> bool:
    """Whether torch reads ``name`` as a device (``"cpu"``, ``"cuda:1"``, ``"meta"``; not ``"gpu"``)."""
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True
