"""
Gradient and diagonal curvature of a plain MLP in closed form: one forward and one
backward pass written out, no hooks.

For an :class:`torch.nn.Sequential` of ``Linear`` layers and element-wise
activations, :math:`f = W_L \\phi(\\cdots \\phi(W_1 a_0 + b_1) \\cdots) + b_L`, the quantities
:mod:`.backpack` asks BackPACK for have short closed forms. With :math:`a_{l-1}` the input of
layer :math:`l` and :math:`\\delta_l = \\partial \\ell / \\partial z_l` its output's gradient per
example (backpropagated as :math:`\\delta_{l-1} = (\\delta_l W_l) \\odot \\phi'(z_{l-1})`),

.. math::

    \\nabla_{W_l} L = \\sum_i \\delta_{l,i} a_{l-1,i}^\\top, \\qquad
    \\text{ef:}\\ \\sum_i (\\delta_{l,i} a_{l-1,i}^\\top)^{\\odot 2}
        = (\\delta_l^{\\odot 2})^\\top a_{l-1}^{\\odot 2},

and the exact Gauss-Newton diagonal backpropagates a square root :math:`S_i` of the loss
Hessian in the output (:math:`H_i = S_i S_i^\\top`) column by column,
:math:`M_{l-1} = (M_l W_l) \\odot \\phi'(z_{l-1})`, :math:`M_L = S^\\top` (one row per column of
:math:`S`):

.. math::

    \\text{ggn:}\\ \\mathrm{diag}\\, \\sum_i J_i^\\top H_i J_i \\big|_{W_l}
        = \\Big(\\sum_c M_{l,c}^{\\odot 2}\\Big)^\\top a_{l-1}^{\\odot 2},

with, per loss (``reduction="sum"``): cross-entropy :math:`\\nabla_f \\ell = p - e_y`,
:math:`S = \\mathrm{diag}(\\sqrt p) - p \\sqrt p^\\top` (so :math:`S S^\\top = \\mathrm{diag}(p) - p p^\\top`);
Bernoulli logits :math:`\\sigma(f) - y`, :math:`S = \\mathrm{diag}\\sqrt{\\sigma(1 - \\sigma)}`;
squared error :math:`2 (f - y)`, :math:`S = \\sqrt 2 I`; ``ggn_mc`` (BackPACK's ``DiagGGNMC``) takes
for :math:`S` the loss gradients at targets drawn from the likelihood (:func:`sampled_rows`). Where no layer further down needs the
rows of :math:`M`, only :math:`\\mathrm{diag}(W^\\top D H D W)` is formed (:class:`OutputHessian`). These are the same equations
BackPACK's ``SumGradSquared`` and ``DiagGGNExact`` evaluate (Dangel et al. 2020), without
the per-module hooks, which on a small network cost more than the arithmetic.

The Kronecker factors of ``KFLR`` / ``KFAC`` are :math:`G = \\sum_i M_i^\\top M_i` from the same rows
and :math:`A = \\frac1B \\sum_i a_i a_i^\\top`. :func:`plan` says whether a network is such an MLP
(anything else stays with BackPACK); :func:`mlp_curvature` runs the passes.
"""

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from backpack import hook_run_extensions, hook_store_io

from ..hot_path import no_grad, scalar

#: Sources computed here (the rest need BackPACK).
SOURCES = ("ef", "ggn", "ggn_mc", "kflr", "kfac", "reparam", "none")

#: Element-wise activations: module type -> (forward, derivative from the input ``z`` and
#: the output ``a``), the module's own settings read at call time.
ACTIVATIONS = {
    # (torch.relu: F.relu's own call, without its Python wrapper; a comparison into floats is slow on CPU)
    nn.ReLU: (lambda m, z: torch.relu(z), lambda m, z, a: a.sign()),
    nn.LeakyReLU: (lambda m, z: F.leaky_relu(z, m.negative_slope),
                   lambda m, z, a: torch.full_like(z, m.negative_slope).masked_fill_(z > 0, 1.0)),
    nn.Tanh: (lambda m, z: torch.tanh(z), lambda m, z, a: 1 - a * a),
    nn.Sigmoid: (lambda m, z: torch.sigmoid(z), lambda m, z, a: a * (1 - a)),
    nn.Identity: (lambda m, z: z, None),
    nn.ELU: (lambda m, z: F.elu(z, m.alpha), lambda m, z, a: torch.where(z > 0, 1.0, a + m.alpha)),
    nn.Softplus: (lambda m, z: F.softplus(z, m.beta, m.threshold),
                  lambda m, z, a: torch.where(z * m.beta > m.threshold, 1.0, torch.sigmoid(z * m.beta))),
    nn.SiLU: (lambda m, z: F.silu(z), lambda m, z, a: _silu_derivative(z)),
    nn.GELU: (lambda m, z: F.gelu(z, approximate=m.approximate), lambda m, z, a: _gelu_derivative(z, m.approximate)),
}


def _silu_derivative(z: torch.Tensor) -> torch.Tensor:
    """:math:`\\frac{d}{dz} z\\,s(z) = s(z)\\,(1 + z(1 - s(z)))`, :math:`s` the logistic sigmoid."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _gelu_derivative(z: torch.Tensor, approximate: str) -> torch.Tensor:
    """:math:`\\frac{d}{dz} z\\,\\Phi(z) = \\Phi(z) + z\\,\\varphi(z)`; with ``approximate="tanh"``,
    :math:`\\frac{d}{dz} \\frac z2 (1 + t)` for :math:`t = \\tanh(c(z + k z^3))`,
    :math:`c = \\sqrt{2/\\pi}`, :math:`k = 0.044715`: :math:`\\frac12(1 + t) + \\frac z2 (1 - t^2)\\,c\\,(1 + 3 k z^2)`."""
    if approximate == "tanh":
        c, k = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(c * (z + k * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * k * z * z)
    return 0.5 * (1 + torch.erf(z * math.sqrt(0.5))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


#: ``reduction="sum"`` as torch's loss functions pass it on
_SUM = torch.nn._reduction.get_enum("sum")


class Plan(NamedTuple):
    """The layers of an MLP in order: ``("flatten", module)`` (first only), ``("linear",
    module)`` or ``("activation", module)``; ``params`` in ``net.parameters()`` order; per
    layer, a ``Linear``'s weight and bias as ``(weight, bias, position of the weight in params,
    of the bias or None)``, an activation's ``(forward, derivative)`` of :data:`ACTIVATIONS`;
    ``linears``: the positions of the ``Linear`` layers; ``steps``: the pairs of ``layers`` and
    ``parts``; ``backward``: the positions from the last layer down to the first ``Linear``; ``count``:
    the number of params."""

    layers: List[Tuple[str, nn.Module]]
    params: List[torch.Tensor]
    parts: List[Optional[tuple]]
    linears: List[int]
    steps: List[tuple]
    backward: List[int]
    count: int


#: Hooks that may be skipped: BackPACK's own, which store inputs for its extensions.
_BACKPACK_HOOKS = (hook_store_io, hook_run_extensions)


def _no_foreign_hooks(module: nn.Module) -> bool:
    """No hooks but BackPACK's and input captures whose owner reads the inputs this module
    returns instead (marked ``closed_form_reads_inputs``)."""
    return all(hook in _BACKPACK_HOOKS or getattr(hook, "closed_form_reads_inputs", False)
               for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                             module._backward_pre_hooks)
               for hook in hooks.values())


def _flat_layers(module: nn.Module) -> Optional[list]:
    if type(module) is nn.Sequential:  # (exactly: a subclass may have its own forward)
        if module._parameters or not _no_foreign_hooks(module):
            return None
        layers = []
        for child in module:
            inner = _flat_layers(child)
            if inner is None:
                return None
            layers += inner
        return layers
    if not _no_foreign_hooks(module):
        return None
    kind = type(module)
    if kind is nn.Linear:
        return [("linear", module)] if module._parameters.keys() <= {"weight", "bias"} else None
    if module._parameters:
        return None
    if kind is nn.Flatten:
        return [("flatten", module)]
    if kind in ACTIVATIONS:
        return [("activation", module)]
    return None


def plan(net: nn.Module) -> Optional[Plan]:
    """
    The :class:`Plan` of ``net`` if it is an MLP this module computes exactly: a
    ``Linear``, or an ``nn.Sequential`` (nested ones flattened) of ``Linear`` layers and the activations of
    :data:`ACTIVATIONS`, ``Flatten`` only before the first ``Linear``, ending in a
    ``Linear`` or an activation, every parameter requiring a gradient, and no hooks but
    BackPACK's; otherwise ``None``.
    """
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks \
            or nn.modules.module._global_backward_hooks:
        return None
    layers = _flat_layers(net)
    if not layers or not any(kind == "linear" for kind, _ in layers):
        return None
    first_linear = next(k for k, (kind, _) in enumerate(layers) if kind == "linear")
    if any(kind == "flatten" for kind, _ in layers[first_linear:]):
        return None
    params = [p for kind, m in layers if kind == "linear" for p in (m.weight, m.bias) if p is not None]
    if not all(p.requires_grad for p in params) or len(set(map(id, params))) != len(params):
        return None  # (a frozen layer, or one layer twice: its parameters would be listed once)
    parts, position = [], 0
    for kind, module in layers:
        if kind == "linear":
            bias = None if module.bias is None else position + 1
            parts.append((module.weight, module.bias, position, bias))
            position += 1 if bias is None else 2
        else:
            parts.append(ACTIVATIONS[type(module)] if kind == "activation" else None)
    return Plan(layers, params, parts, [k for k, (kind, _) in enumerate(layers) if kind == "linear"],
                list(zip(layers, parts)), list(range(len(layers) - 1, first_linear - 1, -1)), len(params))


def planned(net: nn.Module, kept: Dict[int, tuple]) -> Optional[Plan]:
    """
    :func:`plan` of ``net``, made once and kept in ``kept`` (the caller's: ``id(net) -> (net, plan,
    what the plan read)``) while nothing it read has changed: no global hook, and each module it
    visited of the same class, with the same children, the same parameter tensors (each still
    requiring a gradient) and the same hooks (compared by identity: a hook added or removed, a
    layer or a parameter replaced makes the plan anew). A network that is no such MLP (``None``)
    is asked again every time.
    """
    entry = kept.get(id(net))
    if entry is not None and entry[0] is net and _unchanged(entry[2], entry[1].params):
        return entry[1]
    found = plan(net)
    if found is not None:
        kept[id(net)] = (net, found, _snapshot(net))
    return found


def _hooks(module: nn.Module) -> tuple:
    return (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)


def _snapshot(module: nn.Module) -> list:
    """What :func:`plan` read of ``module`` and the modules below it (a planned MLP: containers
    and layers of torch's own classes), copied."""
    kept = [(module, type(module), dict(module._modules), list(module._parameters.items()),
             tuple(dict(hooks) for hooks in _hooks(module)))]
    for child in module._modules.values():
        kept += _snapshot(child)
    return kept


def _unchanged(snapshot: list, params: List[torch.Tensor]) -> bool:
    """Whether the modules of ``snapshot`` (:func:`_snapshot`) are as they were, and ``params``
    still require a gradient."""
    module_hooks = nn.modules.module
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks \
            or module_hooks._global_backward_hooks:
        return False
    for module, kind, children, parameters, hooks in snapshot:
        if module.__class__ is not kind or module._modules != children or (  # (_hooks, inline: no call per module)
                module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                module._backward_pre_hooks) != hooks \
                or len(module._parameters) != len(parameters):
            return False
        for name, tensor in parameters:
            if name not in module._parameters or module._parameters[name] is not tensor:
                return False
    for p in params:
        if not p.requires_grad:
            return False
    return True


def output_gradient_and_hessian(loss_module: nn.Module, f: torch.Tensor, y: torch.Tensor, need_hessian: bool = True
                                ) -> Optional[Tuple[torch.Tensor, torch.Tensor, Optional["OutputHessian"]]]:
    """
    The summed loss, :math:`\\nabla_f \\ell` per example and the :class:`OutputHessian` (``None``
    unless ``need_hessian``);
    ``None`` for a loss or target form not covered here (class weights, label smoothing,
    soft targets).
    """
    kind = type(loss_module)
    if kind is nn.CrossEntropyLoss:
        buffers = loss_module._buffers  # (its class weights, a buffer: read without Module.__getattr__'s call)
        if (buffers["weight"] if "weight" in buffers else loss_module.weight) is not None \
                or loss_module.label_smoothing != 0.0 or f.ndim != 2 \
                or y.ndim != 1 or y.dtype != torch.long:
            return None
        if f.__class__ is torch.Tensor and y.__class__ is torch.Tensor:  # (no subclass: F.cross_entropy's own call)
            loss = torch._C._nn.cross_entropy_loss(f, y, None, _SUM, loss_module.ignore_index, 0.0)
        else:
            loss = F.cross_entropy(f, y, reduction="sum", ignore_index=loss_module.ignore_index)
        p = torch.softmax(f, dim=-1)
        grad = p.scatter_add(1, y.unsqueeze(1), p.new_full((y.shape[0], 1), -1.0))
        return loss, grad, OutputHessian(p, categorical=True) if need_hessian else None
    if kind is nn.BCEWithLogitsLoss:
        if loss_module.weight is not None or loss_module.pos_weight is not None or f.shape != y.shape \
                or f.dim() != 2:
            return None
        loss = F.binary_cross_entropy_with_logits(f, y, reduction="sum")
        s = torch.sigmoid(f)
        return loss, s - y, OutputHessian(s * (1 - s)) if need_hessian else None
    if kind is nn.MSELoss:
        if f.shape != y.shape or f.dim() != 2:
            return None
        diff = f - y
        return diff.square().sum(), 2 * diff, OutputHessian(torch.full_like(f, 2.0)) if need_hessian else None
    return None


def sampled_rows(loss_module: nn.Module, f: torch.Tensor, mc_samples: int) -> torch.Tensor:
    """
    ``ggn_mc``'s rows :math:`M_L` (``(B, mc_samples, D)``): per example the loss gradients in
    the output at targets drawn from the likelihood itself, :math:`r_m = \\nabla_f \\ell(f,
    \\tilde y_m) / \\sqrt{M}`, whose :math:`\\sum_m r_m r_m^\\top` has mean :math:`H` (the Fisher
    of the likelihood): :math:`p - e_{\\tilde y}`, :math:`\\tilde y \\sim \\mathrm{Cat}(p)`;
    :math:`\\sigma(f) - \\tilde y`, :math:`\\tilde y \\sim \\mathrm{Bern}(\\sigma(f))`; and for the
    squared error :math:`2 (f - \\tilde y) = \\sqrt 2\\,\\xi`, :math:`\\tilde y \\sim \\mathcal N(f, I/2)`.
    """
    kind = type(loss_module)
    batch, size = f.shape
    # (targets drawn from finite probabilities: a non-finite output's rows stay non-finite and
    # skip the step, where the draw itself would raise)
    if kind is nn.CrossEntropyLoss:
        p = torch.softmax(f, dim=-1)
        drawn = torch.multinomial(p.nan_to_num(nan=1.0, posinf=1.0, neginf=0.0), mc_samples, replacement=True)
        rows = p.unsqueeze(1).expand(batch, mc_samples, size).clone()
        rows.scatter_add_(2, drawn.unsqueeze(-1), rows.new_full((batch, mc_samples, 1), -1.0))
    elif kind is nn.BCEWithLogitsLoss:
        s = torch.sigmoid(f).unsqueeze(1)
        rows = s - torch.bernoulli(s.nan_to_num(nan=0.5).expand(batch, mc_samples, size))
    else:
        rows = torch.randn(batch, mc_samples, size, dtype=f.dtype, device=f.device).mul_(2.0**0.5)
    return rows / mc_samples**0.5


class OutputHessian:
    """
    The loss Hessian in the network output per example, backpropagated through the layers
    for the Gauss-Newton diagonal: :math:`D H D` with :math:`D = \\mathrm{diag}(s)` the
    activations' derivatives met so far, :math:`H = \\mathrm{diag}(p) - p p^\\top` (cross-entropy,
    ``categorical``) or :math:`\\mathrm{diag}(h)`; after a ``Linear`` layer :math:`W`,
    :math:`W^\\top D H D W`, kept as its diagonal when no layer below needs more, else as the rows
    :math:`M = S^\\top D W` of a square root (:math:`S S^\\top = H`).
    """

    def __init__(self, p: torch.Tensor, categorical: bool = False, rows: Optional[torch.Tensor] = None):
        self.p, self.categorical = p, categorical
        self.diagonal = None  # diag(W^T D H D W), the last layer's input side
        self.rows = rows  # M (B, columns, units); given: a sampled square root (ggn_mc)
        self.scale = None  # s (B, units), pending

    def activation(self, derivative: torch.Tensor) -> None:
        """Through an element-wise activation: :math:`D \\leftarrow D\\,\\mathrm{diag}(\\phi'(z))`."""
        self.scale = derivative if self.scale is None else self.scale * derivative

    def root_rows(self) -> None:
        """Hold the rows :math:`S^\\top` of the output's square root from the start (the Kronecker
        factors need :math:`\\sum_i M_i^\\top M_i` at every layer, not only its diagonal)."""
        if self.rows is None:
            root = self.p.sqrt()
            self.rows = (torch.diag_embed(root) - root.unsqueeze(-1) * self.p.unsqueeze(-2) if self.categorical
                         else torch.diag_embed(root))

    def output_factor(self) -> torch.Tensor:
        """:math:`G = \\sum_i M_i^\\top M_i` (``(units, units)``), with the pending :math:`D` applied."""
        rows = self.rows if self.scale is None else self.rows * self.scale.unsqueeze(1)
        flat = rows.reshape(-1, rows.shape[-1])
        return flat.T @ flat

    def column_square(self) -> torch.Tensor:
        """:math:`\\mathrm{diag}(D H D)` per example, ``(B, units)``: the layer's output side."""
        if self.rows is not None:
            square = self.rows.square().sum(1)
        elif self.diagonal is not None:
            square = self.diagonal
        else:
            # (1 - p with 1 a 0-d tensor of p's dtype: no cast of a Python number)
            square = self.p * (scalar(1.0, self.p) - self.p) if self.categorical else self.p
        return square if self.scale is None else square * self.scale.square()

    def linear(self, weight: torch.Tensor, last: bool) -> None:
        """Through a ``Linear`` layer's weight (``last``: no ``Linear`` layer below needs more than the diagonal)."""
        s, p = self.scale, self.p
        if self.rows is not None:
            self.rows = (self.rows if s is None else self.rows * s.unsqueeze(1)) @ weight
        elif last:  # diag(W^T D H D W) = (p s^2) W^2 - ((p s) W)^2, or (h s^2) W^2
            ps = p if s is None else p * s
            square = weight.square()
            self.diagonal = (ps if s is None else ps * s) @ square
            if self.categorical:
                self.diagonal -= (ps @ weight).square()
        elif self.categorical:  # rows of S^T D W, S^T = diag(sqrt p) - sqrt(p) p^T
            ps = p if s is None else p * s
            sw = weight if s is None else s.unsqueeze(-1) * weight
            self.rows = p.sqrt().unsqueeze(-1) * (sw - (ps @ weight).unsqueeze(1))
        else:  # S = diag(sqrt h)
            root = p.sqrt() if s is None else p.sqrt() * s
            self.rows = root.unsqueeze(-1) * weight
        self.scale = None


@no_grad
def mlp_curvature(mlp: Plan, loss_module: nn.Module, x: torch.Tensor, y: torch.Tensor, source: str,
                  check_output: Optional[Callable[[torch.Tensor], None]] = None, mc_samples: int = 1):
    """
    ``(loss, grads, curvatures, inputs)`` of the summed loss at the weights the net holds
    (the equations of the module docstring; ``ggn_mc`` with the rows of :func:`sampled_rows`,
    its ``mc_samples`` targets per example; ``kflr`` / ``kfac`` the Kronecker factors
    :math:`[G, A]`, :math:`G = \\sum_i M_i^\\top M_i` from the exact / sampled rows and
    :math:`A = \\frac1B \\sum_i a_i a_i^\\top`, ``[G]`` for a bias, as BackPACK's ``KFLR`` / ``KFAC``;
    ``curvatures`` ``None`` per parameter for ``reparam`` / ``none``; ``inputs`` each weight's
    layer input :math:`a`, ``None`` for a bias), or ``None`` when the loss or the input's
    form is not covered (the caller then asks BackPACK).
    """
    h = x
    saved = {}  # per layer: its input (and an activation's output)
    k = 0  # (a counter: no enumerate call)
    for (kind, module), part in mlp.steps:
        if kind == "flatten":
            h = module(h)
        elif kind == "linear":
            if h.ndim != 2:  # (an attribute: no call)
                return None
            saved[k] = h
            h = F.linear(h, part[0], part[1])
        else:
            out = part[0](module, h)
            saved[k] = (h, out)
            h = out
        k += 1
    if check_output is not None:
        check_output(h)
    result = output_gradient_and_hessian(loss_module, h, y, need_hessian=source in ("ggn", "kflr"))
    if result is None:
        return None
    loss, delta, hessian = result
    if source in ("ggn_mc", "kfac"):  # (the same backward as ggn / kflr, from sampled rows)
        hessian = OutputHessian(None, rows=sampled_rows(loss_module, h, mc_samples))
        source = "ggn" if source == "ggn_mc" else "kflr"
    elif source == "kflr":
        hessian.root_rows()
    second_order = source in ("ggn", "kflr")
    count = mlp.count
    grads, curvatures, inputs = [None] * count, [None] * count, [None] * count  # (in the order of params)
    linears = mlp.linears
    for k in mlp.backward:
        kind, module = mlp.layers[k]
        if kind == "activation":
            derivative = mlp.parts[k][1]
            if derivative is not None:
                d = derivative(module, *saved[k])
                delta = delta * d
                if second_order:
                    hessian.activation(d)
            continue
        a = saved[k]
        weight, bias, at, bias_at = mlp.parts[k]
        inputs[at] = a
        grads[at] = delta.t() @ a
        if bias is not None:
            grads[bias_at] = delta.sum(0)
        if source == "kflr":  # [G, A]: G summed, A averaged over the batch ([G] for the bias)
            output_factor = hessian.output_factor()
            curvatures[at] = [output_factor, a.T @ a / len(a)]
            if bias is not None:
                curvatures[bias_at] = [output_factor]
        elif source in ("ef", "ggn"):
            column_square = delta.square() if source == "ef" else hessian.column_square()
            curvatures[at] = column_square.t() @ a.square()
            if bias is not None:
                curvatures[bias_at] = column_square.sum(0)
        if k > linears[0]:
            delta = delta @ weight
            if second_order:
                hessian.linear(weight, last=source == "ggn" and k == linears[1])
    return loss, grads, curvatures, inputs
