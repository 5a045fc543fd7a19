"""
The BackPACK-extended twin of a :class:`~pyro_ngvi.BayesianNet`'s network, and its
loss module, whose ``reduction="sum"`` gives the minibatch's negative
log-likelihood up to a per-example weight :math:`c`:

.. math:: -\\sum_{i \\in B} \\log p(y_i \\mid f(x_i; w)) = c \\sum_{i \\in B} \\ell(f(x_i; w), y_i) + \\text{const}

(:math:`c = 1` for Categorical and Bernoulli, :math:`1/(2\\sigma^2)` for the Gaussian).
The twin shares the network's parameter and buffer dicts, so sampled weights
written into the network are the twin's; the model itself stays free of
BackPACK's hooks, so its traced path (and ``torch.func`` on it) runs the plain
network. One pass of :func:`~pyro_ngvi.curvature.backpack.network_curvature` on
the twin gives the gradient and the curvature.
"""

import warnings
from copy import deepcopy
from itertools import chain

import torch
from torch import nn

from backpack import extend
from backpack.context import CTX
from backpack.custom_module.branching import SumModule

#: The BackPACK loss module of each likelihood (``reduction="sum"``).
LOSS_MODULES = {
    "categorical": nn.CrossEntropyLoss,
    "bernoulli": nn.BCEWithLogitsLoss,
    "gaussian": nn.MSELoss,
}


class BackpackTwin:
    """
    A BackPACK-extended twin of ``net`` and its loss module.

    :param torch.nn.Module net: the plain network (its parameter and buffer dicts
        are shared, not copied).
    :param str likelihood: a key of :data:`LOSS_MODULES`.
    """

    def __init__(self, net: nn.Module, likelihood: str):
        twin = deepcopy(net, memo={id(t): t for t in chain(net.parameters(), net.buffers())})
        for twin_module, module in zip(twin.modules(), net.modules()):
            twin_module._parameters = module._parameters
            twin_module._buffers = module._buffers
        self.net = net  # the plain network: a pass that needs no extension runs it, without BackPACK's hooks
        self.module_pairs = list(zip(twin.modules(), net.modules()))
        self.twin = _extended(twin)
        if self.twin is not twin:  # (converted: a graph of the same layers, the container's mode kept too)
            self.module_pairs.append((self.twin, net))
        self.loss_module = extend(LOSS_MODULES[likelihood](reduction="sum"))
        self.refresh()
        # BackPACK's extend() records each hook's handle in a list of the process it never shortens:
        # drop those of modules gone (a BayesianNet per fit would keep a few handles each for ever)
        CTX.hook_handles = [h for h in CTX.hook_handles if h.hooks_dict_ref() is not None]

    def refresh(self) -> None:
        """Re-read the network's parameters, in its own order (after ``.to()`` put new tensors in
        the shared dicts)."""
        self.params = [p for p in self.net.parameters() if p.requires_grad]

    def loss_target(self, model, y: torch.Tensor) -> torch.Tensor:
        """``y`` in the form the BackPACK loss module expects: class indices, or
        floats shaped as the network output (``(B,)`` targets of a ``(B, 1)`` output)."""
        if model.likelihood == "categorical":
            return y.long()
        dtype = model._latents[0].param.dtype
        return (y.unsqueeze(-1) if y.dim() == 1 else y).to(dtype)

    def begin(self, model):
        """
        What every step needs first: the BatchNorm statistics kept until the step
        is accepted, the point estimates (read through
        ``pyro.param`` and copied into the net), the Gaussian noise scale, the
        per-example weight :math:`c` of the loss module (:math:`-\\log p = c\\,`MSE +
        const), and the twin's train/eval modes matched to the network's.
        """
        if model._running_stats.batch_norms:  # (nothing to keep without BatchNorm layers)
            model._running_stats.keep_until_accepted()
        points = [model._point_estimate(w) for w in model._point_estimates] if model._point_estimates else []
        noise_scale = model._noise_scale() if model.likelihood == "gaussian" else None
        for twin_module, module in self.module_pairs:
            if twin_module.training != module.training:
                twin_module.training = module.training
        if points:
            with torch.no_grad():
                for weight, value in zip(model._point_estimates, points):
                    weight.param.copy_(value)
        if noise_scale is None:
            loss_scale = 1.0
        elif isinstance(noise_scale, torch.Tensor):  # no .item(): no device sync
            loss_scale = 0.5 / noise_scale.detach() ** 2
        else:
            loss_scale = 0.5 / noise_scale**2
        return points, noise_scale, loss_scale


def _extended(twin: nn.Module) -> nn.Module:
    """``twin`` extended by BackPACK; a container of a class of its own (a user's ``nn.Module``
    whose ``forward`` calls its layers; not an ``nn.Sequential``) converted first to a graph of the
    same layer objects (BackPACK's ``torch.fx`` converter), whose curvature BackPACK backpropagates
    layer by layer, as through an ``nn.Sequential``. The graph is the ``forward`` traced once: what
    it does in Python besides tensor operations (a branch on ``self.training``, a counter) is read at
    that trace, in training mode. A ``forward`` that ``torch.fx`` cannot trace (control flow on
    values, a layer called twice) stays as it is: then only sources that need no pass through the
    container run, and the converter's reason is kept as ``backpack_conversion_error`` (what the
    refusal of the others cites)."""
    if (type(twin).__module__.startswith("torch.") or isinstance(twin, nn.Sequential)
            or not any(True for _ in twin.children())):
        return extend(twin)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = extend(activations_as_modules(torch.fx.symbolic_trace(twin)), use_converter=True)
    except Exception as error:  # (a forward torch.fx cannot trace, a layer called twice)
        twin.backpack_conversion_error = f"{type(error).__name__}: {error}"
        return extend(twin)
    return extend(twin) if _sums_a_number(converted) else converted


def _sums_a_number(graph: torch.fx.GraphModule) -> bool:
    """Whether BackPACK's converter made a sum of tensors (``SumModule``, which takes tensors
    only) of an addition with a number (``h + 0.1`` in ``forward``): that graph cannot run."""
    return any(node.op == "call_module" and isinstance(graph.get_submodule(node.target), SumModule)
               and not all(isinstance(arg, torch.fx.Node) for arg in node.args) for node in graph.graph.nodes)


#: Activations called as functions or tensor methods, and the module BackPACK knows for each
#: (with the keyword of its one setting, read from the call).
_ACTIVATIONS = {
    torch.tanh: (nn.Tanh, None), nn.functional.tanh: (nn.Tanh, None), "tanh": (nn.Tanh, None),
    torch.relu: (nn.ReLU, None), nn.functional.relu: (nn.ReLU, None), "relu": (nn.ReLU, None),
    torch.sigmoid: (nn.Sigmoid, None), nn.functional.sigmoid: (nn.Sigmoid, None), "sigmoid": (nn.Sigmoid, None),
    nn.functional.elu: (nn.ELU, "alpha"), nn.functional.selu: (nn.SELU, None),
    nn.functional.leaky_relu: (nn.LeakyReLU, "negative_slope"), nn.functional.logsigmoid: (nn.LogSigmoid, None),
}


def activations_as_modules(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The traced ``graph`` with each activation called as a function (``torch.tanh(h)``,
    ``F.relu(h)``, ``h.sigmoid()``; :data:`_ACTIVATIONS`) replaced by a call of the same
    activation's module (``nn.Tanh()``, ...): the same function, and one BackPACK can
    backpropagate a second-order quantity through (it passes none through a function).
    A call with settings other than the module's one is left as it is."""
    for node in list(graph.graph.nodes):
        key = node.target if node.op in ("call_function", "call_method") else None
        try:
            found = _ACTIVATIONS.get(key)
        except TypeError:  # (an unhashable target)
            found = None
        if found is None or not node.args:
            continue
        module, setting = found
        extra = dict(node.kwargs)
        extra.pop("inplace", None)
        values = list(node.args[1:2]) + ([extra.pop(setting)] if setting in extra else [])
        if extra or len(node.args) > 2 or (values and setting is None):
            continue
        taken = {name for name, _ in graph.named_modules()}
        name = next(f"activation_{i}" for i in range(len(taken) + 1) if f"activation_{i}" not in taken)
        graph.add_submodule(name, module(*values))
        with graph.graph.inserting_after(node):
            replacement = graph.graph.call_module(name, (node.args[0],))
        node.replace_all_uses_with(replacement)
        graph.graph.erase_node(node)
    graph.recompile()
    return graph


def accumulate_grad(tensor: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``tensor.grad`` (set it when there is none)."""
    if tensor.grad is None:
        tensor.grad = grad
    else:
        tensor.grad += grad
