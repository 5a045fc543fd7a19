"""
The point optimizer: parameters that are not Gaussian guide sites (``pyro.param`` values
of the model, BatchNorm weights, the values of ``AutoDelta`` parts) are trained inside
:class:`~pyro_ngvi.NGVI` by an ordinary torch optimizer, through
:class:`~pyro.optim.PyroOptim`'s per-parameter machinery. Everything that could make its
step fail is checked before NGVI writes anything.
"""

from typing import Dict, List

import torch

import pyro


def check_point_optim(point_optim, point_optim_args) -> Dict:
    """
    The point optimizer's arguments, validated by building it on a probe tensor and
    taking one step with a zero gradient: a bad value or an unknown key is refused
    here, not at the first step (after the guide sites were updated).
    """
    if not (isinstance(point_optim, type) and issubclass(point_optim, torch.optim.Optimizer)):
        raise ValueError(f"point_optim must be a torch.optim.Optimizer class, got {point_optim!r}")
    if point_optim_args is None:
        point_optim_args = {"lr": 0.01}
    if not isinstance(point_optim_args, dict):
        raise ValueError(f"point_optim_args must be a dict of {point_optim.__name__}'s arguments, "
                         f"got {point_optim_args!r}")
    probe = torch.zeros(1, requires_grad=True)
    try:
        optimizer = point_optim([probe], **point_optim_args)
        probe.grad = torch.zeros(1)
        optimizer.step()
    except Exception as error:
        raise ValueError(
            f"point_optim_args {point_optim_args!r} are not arguments {point_optim.__name__} "
            f"can run with (SVI calls its step() without a closure): {error}"
        ) from error
    return dict(point_optim_args)


def check_point_states(waiting: Dict, known, others: List[torch.Tensor], constructor, args: Dict) -> None:
    """Refuse, before any write, a restored point-optimizer state whose tensors do
    not fit the parameter it would be loaded into (a checkpoint of another model):
    ``waiting`` holds the restored entries not yet loaded, by param name; ``known`` the
    parameters that have their optimizer already."""
    if not waiting:
        return
    store = pyro.get_param_store()
    for p in others:
        name = store.param_name(p)
        if p in known or name not in waiting:
            continue
        probe = torch.zeros_like(p, requires_grad=True)
        optimizer = constructor([probe], **args)
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
        template = {key: value.shape for key, value in optimizer.state[probe].items() if torch.is_tensor(value)}
        for per_param in waiting[name]["state"].values():
            for key, value in per_param.items():
                if torch.is_tensor(value) and key in template and value.shape != template[key]:
                    raise ValueError(
                        f"NGVI's point-optimizer state for '{name}' holds {key!r} of shape "
                        f"{tuple(value.shape)}, the parameter has {tuple(p.shape)}: the "
                        "checkpoint belongs to another model"
                    )


def probe_point_step(p: torch.Tensor, constructor, args: Dict) -> None:
    """
    Probe the point optimizer (``constructor``) on a zero gradient of ``p``'s layout.

    :raises ValueError: when it cannot step ``p`` (e.g. a sparse gradient for an optimizer
        without sparse support), before anything is written.
    """
    probe = torch.zeros_like(p, requires_grad=True)
    probe.grad = torch.zeros_like(p).to_sparse() if p.grad.is_sparse else torch.zeros_like(p)
    try:
        constructor([probe], **args).step()
    except Exception as error:
        raise ValueError(
            f"NGVI's point optimizer {constructor.__name__} cannot update "
            f"'{param_label(p)}' ({error}); nothing was changed. Pass point_optim that supports "
            "it (e.g. torch.optim.SparseAdam for nn.Embedding(sparse=True)).") from error


def param_label(p: torch.Tensor) -> str:
    """The param-store name of ``p``, or its shape."""
    return pyro.get_param_store().param_name(p) or f"tensor of shape {tuple(p.shape)}"
