"""
The tensors of a plain network as :class:`~pyro_ngvi.BayesianNet` sees them: each
parameter that requires a gradient is a latent weight :math:`w_j` (one Pyro site)
or, in a ``BatchNorm`` layer, a point estimate (a ``pyro.param``); the fan-in
:math:`n` of a layer bounds its weights' noise (:mod:`.noise_limit`); the running
statistics of train-mode ``BatchNorm`` layers are kept until the optimizer accepts
the step (:class:`RunningStatistics`).
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from ..family import live_handover, on_rejected

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class Weight(NamedTuple):
    """One parameter tensor of the network and where it lives."""

    site: str  # Pyro site (latent) or param (point estimate) name
    module: nn.Module
    param_name: str  # the parameter's name inside ``module``
    key: str  # the parameter's name inside the network, for functional_call
    index: int  # position among the network's parameters that require a gradient

    @property
    def param(self) -> torch.Tensor:
        return self.module._parameters[self.param_name]


def network_weights(net: nn.Module, prefix: str) -> Tuple[List[Weight], List[Weight]]:
    """The latent weights and the point-estimated (``BatchNorm``) parameters of ``net``,
    named ``prefix + `` their name in the network; parameters with
    ``requires_grad=False`` stay fixed.

    :raises ValueError: when there is no latent weight.
    """
    latents, point_estimates = [], []
    trainable = [(k, p) for k, p in net.named_parameters() if p.requires_grad]
    for index, (key, param) in enumerate(trainable):
        path, _, param_name = key.rpartition(".")
        module = net.get_submodule(path)
        weight = Weight(prefix + key, module, param_name, key, index)
        if isinstance(module, BATCH_NORMS):
            point_estimates.append(weight)
        else:
            latents.append(weight)
    if not latents:
        raise ValueError(
            "BayesianNet found no weight to put a prior on: the network needs a "
            "parameter with requires_grad=True outside BatchNorm layers."
        )
    return latents, point_estimates


def weight_slots(net: nn.Module, weights: List[Weight]) -> List[Tuple[dict, str, object, str]]:
    """Where each of ``weights`` is found from ``net``: ``(dict, name, object, what it is)``
    for each module on its path (its parent's ``_modules``) and for the tensor (its module's
    ``_parameters``). While every ``dict[name] is object``, the weights are the network's own: a
    layer or a Parameter assigned anew (``net[0] = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``)
    breaks one, an in-place copy (``load_state_dict``) none."""
    slots = {}
    for w in weights:
        module, names = net, w.key.split(".")[:-1]
        for depth, name in enumerate(names):
            child = module._modules[name]
            what = f"module {'.'.join(names[:depth + 1])!r}"
            slots.setdefault((id(module._modules), name), (module._modules, name, child, what))
            module = child
        what = f"parameter {w.key!r}"
        slots.setdefault((id(module._parameters), w.param_name), (module._parameters, w.param_name, w.param, what))
    return list(slots.values())


def call_with(net: nn.Module, params: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``net(x)`` with ``params`` (by their names in the network) in place of its own tensors, as
    :func:`torch.func.functional_call`, and every module's own tensors put back afterwards.
    ``functional_call`` alone does not put them back where one module is registered under two
    names (``nn.Sequential(layer, act, layer)``, a block repeated): it left the values drawn for
    that layer in the network as plain tensors, so that the network lost its Parameters and
    the steps after the first trained that layer on one stale draw, unwarned."""
    held = [(module._parameters, name, value) for module in net.modules()
            for name, value in module._parameters.items()]
    try:
        return functional_call(net, params, (x,))
    finally:
        for parameters, name, value in held:
            if parameters.get(name) is not value:
                parameters[name] = value


def fan_in(module: nn.Module) -> Optional[int]:
    """The fan-in of a layer with a weight of two or more dimensions (``Linear``, ``Conv*``:
    the inputs each output sums over), else ``None``."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or isinstance(module, nn.Embedding):
        return None
    return weight[0].numel()


class RunningStatistics:
    """The running statistics of a network's ``BatchNorm`` layers, restored should the
    optimizer reject the step that changed them (skip it, or the step fail)."""

    def __init__(self, net: nn.Module):
        self.batch_norms = [m for m in net.modules() if isinstance(m, BATCH_NORMS)]
        self.handover = None  # the hand-over whose forward saved them

    def keep_until_accepted(self) -> None:
        """
        Save the running statistics of the train-mode layers once per ELBO evaluation
        (hand-over), for the optimizer to restore should it reject the step: a
        skipped or failed step leaves no trace in them.
        """
        handover = live_handover()
        if self.handover == handover:
            return
        buffers = [buffer for m in self.batch_norms if m.training and m.track_running_stats
                   for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
                   if buffer is not None]
        if not buffers:
            return
        self.handover = handover
        saved = [buffer.clone() for buffer in buffers]
        on_rejected(lambda: torch._foreach_copy_(buffers, saved))
