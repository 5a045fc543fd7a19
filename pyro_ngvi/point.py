"""
The point optimizer: parameters that are not Gaussian guide sites (``pyro.param`` values
of the model, BatchNorm weights, the values of ``AutoDelta`` parts) are trained inside
:class:`~pyro_ngvi.NGVI` by an ordinary torch optimizer, through
:class:`~pyro.optim.PyroOptim`'s per-parameter machinery. Everything that could make its
step fail is checked before NGVI writes anything.

The default point optimizer is Adam at step size 0.01 for the model's parameters. The
params of guide parts that are not Gaussians (an ``AutoDelta``, an
``AutoLowRankMultivariateNormal``, a hand-written guide's other sites) are a whole
variational family of their own, trained by it alone: there Adam's step size starts at
0.05 and decays with the number of steps :math:`t` it has taken on the parameter,

.. math:: \\alpha_t = \\alpha_0 / (1 + t / T), \\qquad \\alpha_0 = 0.05, \\quad T = 50,

as fast at the start as the Adam Pyro's own tests train such guides with (0.05) and settling
below the noise of a constant step (Robbins-Monro): at 0.0045 after 500 steps, below the 0.005
that Pyro's exactness tests end on (with T = 100, 0.0083, an AutoGaussian missed their 5 %
on 5 of 10 seeds; ``benchmarks/pyro_suite/misses.py tree``). Arguments given (``point_optim_args``)
run as given, for every parameter.
"""

import math
from typing import Dict, List

import torch

import pyro

#: Adam's step size for the model's parameters by default
POINT_LR = 0.01
#: :math:`\alpha_0` and :math:`T` of the decaying step size of guide parts' params by default
GUIDE_PART_LR = 0.05
GUIDE_PART_DECAY_STEPS = 50.0


def decay_guide_part_lr(optimizer: torch.optim.Optimizer) -> None:
    """Set each parameter group's step size to :math:`\\alpha_0 / (1 + t / T)`, with
    :math:`t` the steps the optimizer has taken on the group's parameters (Adam's ``step``)."""
    for group in optimizer.param_groups:
        steps = [optimizer.state[p].get("step", 0) for p in group["params"] if p in optimizer.state]
        t = float(max(steps)) if steps else 0.0
        group["lr"] = GUIDE_PART_LR / (1.0 + t / GUIDE_PART_DECAY_STEPS)


def check_point_optim(point_optim, point_optim_args) -> Dict:
    """
    The point optimizer's arguments, validated by building it on a probe tensor and
    taking one step with a zero gradient: a bad value or an unknown key is refused
    here, not at the first step (after the guide sites were updated).
    """
    if not (isinstance(point_optim, type) and issubclass(point_optim, torch.optim.Optimizer)):
        raise ValueError(f"point_optim must be a torch.optim.Optimizer class, got {point_optim!r}")
    if point_optim_args is None:
        point_optim_args = {"lr": POINT_LR}
    if not isinstance(point_optim_args, dict):
        raise ValueError(f"point_optim_args must be a dict of {point_optim.__name__}'s arguments, "
                         f"got {point_optim_args!r}")
    for key, value in point_optim_args.items():  # (a step with an infinite lr writes inf or nan)
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"point_optim_args[{key!r}] must be finite, got {value!r}")
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
    if not torch.isfinite(probe).all():
        raise ValueError(f"point_optim_args {point_optim_args!r}: a step of {point_optim.__name__} with a zero "
                         "gradient wrote a non-finite value")
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
