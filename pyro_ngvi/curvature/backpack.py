"""
Gradient and diagonal curvature of a network's summed loss with BackPACK.

For a plain :class:`torch.nn.Module` :math:`f(x; w)` followed by a loss module
whose ``reduction="sum"`` gives the negative log-likelihood of a minibatch
(up to a per-example weight :math:`c`, see below),

.. math:: L(w) = c \\sum_{i=1}^B \\ell(f(x_i; w), y_i),

one backward pass under :class:`backpack.backpack` returns, for every parameter
tensor, the gradient :math:`\\nabla_w L` and one of these diagonals:

=========== ======================================================= ===================
source      curvature                                               BackPACK extension
=========== ======================================================= ===================
``ef``      :math:`c^2 \\sum_i (\\nabla_w \\ell_i)^2` (empirical       ``SumGradSquared``
            Fisher, VOGN's Gauss-Newton)
``ggn``     :math:`c \\,\\mathrm{diag} \\sum_i J_i^\\top H_i J_i`       ``DiagGGNExact``
            (:math:`J_i = \\partial f_i / \\partial w`,
            :math:`H_i = \\partial^2 \\ell_i / \\partial f_i^2`)
``ggn_mc``  the same with :math:`H_i` replaced by                   ``DiagGGNMC``
            :math:`\\frac1M\\sum_{m} \\nabla_f \\ell(f_i, \\tilde y_m)
            \\nabla_f \\ell(f_i, \\tilde y_m)^\\top`,
            :math:`\\tilde y_m \\sim p(y \\mid f_i)`
``kflr``    Kronecker factors of the ``ggn`` block of a             ``KFLR``
            ``Linear`` weight:
            :math:`[c \\sum_i G_i, \\tfrac1B\\sum_i a_i a_i^\\top]`
            (:math:`G_i` the GGN w.r.t. the layer's output,
            :math:`a_i` its input)
``kfac``    the same with :math:`G_i` from sampled targets          ``KFAC``
``reparam`` none (plain backward; the caller forms the Price/Stein  --
            estimate :math:`g\\,\\epsilon/\\sigma` itself)
``none``    none (plain backward)                                   --
=========== ======================================================= ===================

The output Hessians :math:`H_i` BackPACK uses, per loss module with
``reduction="sum"``:

* :class:`~torch.nn.CrossEntropyLoss` (Categorical, logits):
  :math:`\\mathrm{diag}(p) - p p^\\top`, :math:`p = \\mathrm{softmax}(f)`;
* :class:`~torch.nn.BCEWithLogitsLoss` (Bernoulli, logits, binary targets,
  output shape ``(B, 1)``): :math:`\\sigma(f)(1 - \\sigma(f))`;
* :class:`~torch.nn.MSELoss` (output shape ``(B, D)``):
  :math:`\\ell = \\|f - y\\|^2`, so :math:`H = 2 I`.

**Factors.** ``loss_scale`` is the per-example weight :math:`c`: the Gaussian
negative log-likelihood with noise scale :math:`\\sigma` is
:math:`\\|f - y\\|^2 / (2\\sigma^2) + \\text{const}`, i.e. ``MSELoss`` with
:math:`c = 1/(2\\sigma^2)`. Because :math:`c` multiplies every example's loss,
the gradient and the GGNs carry :math:`c` and the empirical Fisher carries
:math:`c^2`. BackPACK itself must see the unscaled loss (its second-order
extensions assume ``backward()`` starts at the loss module's output), so the
factor is applied afterwards. A *multiplicity* such as the full-data factor
:math:`N/B` is different: it multiplies every quantity, the empirical Fisher
included, once -- that is the caller's.

**BatchNorm.** A ``BatchNorm`` layer that normalises with the minibatch's
statistics (train mode) mixes the examples of a batch. The gradient stays the
exact one (through the statistics); every curvature is that of the network with
the statistics frozen at the minibatch's values, per-example separable (see
:mod:`pyro_ngvi.curvature.batch_norm`): ``ggn`` and ``ggn_mc`` pass the layer
with its frozen Jacobian, and ``ef`` then runs as a GGN backpropagation of the
observed per-example loss gradients instead of ``SumGradSquared``. The layer's
own parameters get the frozen network's curvature too. In eval mode (running
statistics) nothing changes.
"""

import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Union

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR, SumGradSquared
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.saved_quantities import SavedQuantities

from ..hot_path import same
from . import mlp
from .batch_norm import EmpiricalFisherBackprop, frozen_ggn, frozen_ggn_mc, has_batch_statistics
from .embedding import sparse_embedding_rule

_FIRST_LAYER_HOOK_WARNING = "Full backward hook is firing when gradients are computed"
#: BackPACK's first-order extensions warn, on every pass, of a container module they have no
#: extension for (a user's module whose forward its converter could not trace): its layers' own
#: hooks compute their quantities; a parameter that gets none is refused after the pass.
_CONTAINER_WARNING = r"Extension saving to \w+ does not have an extension for Module .* although the module has parameters"


#: Curvature sources: name -> factory ``mc_samples -> BackPACK extension``
#: (``None``: a plain backward pass, no curvature). Adding a source is adding
#: an entry; the extension's ``savefield`` says where BackPACK leaves it.
CURVATURE_EXTENSIONS: Dict[str, Optional[Callable[[int], BackpropExtension]]] = {
    "ef": lambda mc_samples: SumGradSquared(),
    "ggn": lambda mc_samples: frozen_ggn(),
    "ggn_mc": lambda mc_samples: frozen_ggn_mc(mc_samples),
    # Kronecker factors [G, A] of a Linear weight ([G] of its bias): exact GGN, sampled
    "kflr": lambda mc_samples: KFLR(),
    "kfac": lambda mc_samples: KFAC(mc_samples=mc_samples),
    "reparam": None,
    "none": None,
}

#: Sources computed differently for a net with ``BatchNorm`` on minibatch statistics
#: (:func:`~pyro_ngvi.curvature.batch_norm.has_batch_statistics`).
BATCH_STATISTICS_EXTENSIONS: Dict[str, Callable[[int], BackpropExtension]] = {
    "ef": lambda mc_samples: EmpiricalFisherBackprop(),
}

#: The sampled sources' exact counterparts: a network whose outputs are not finite (a
#: non-finite minibatch or weight) has no likelihood to draw targets from; the counterpart's
#: statistics are as non-finite as the sampled ones would be, and the step is skipped.
_EXACT_COUNTERPART = {"ggn_mc": "ggn", "kfac": "kflr"}

#: Per-source power of the per-example weight ``loss_scale`` in the curvature
#: (of the output factor G for Kronecker factors).
_LOSS_SCALE_POWER = {"ef": 2, "ggn": 1, "ggn_mc": 1, "kflr": 1, "kfac": 1}

#: Loss modules BackPACK has output Hessians for -> the likelihood they are.
LOSS_MODULES = {
    nn.CrossEntropyLoss: "categorical",
    nn.BCEWithLogitsLoss: "bernoulli",
    nn.MSELoss: "gaussian",
}


class NetworkCurvature(NamedTuple):
    """
    Result of :func:`network_curvature`, one entry per parameter of the net
    that requires a gradient (in ``net.parameters()`` order).

    :param torch.Tensor loss: the scaled summed loss :math:`L(w)` (detached).
    :param list grads: :math:`\\nabla_w L` per parameter.
    :param list curvatures: the curvature diagonal per parameter (for ``kflr`` /
        ``kfac`` the list of Kronecker factors ``[G, A]`` of a ``Linear`` weight,
        ``[G]`` of its bias, :math:`G` summed and :math:`A` averaged over the
        batch), ``None`` for every parameter under ``reparam`` and ``none``.
    :param inputs: when the closed form (:mod:`.mlp`) computed it, each ``Linear``
        weight's layer input (``None`` for a bias); ``None`` from BackPACK.
    """

    loss: torch.Tensor
    grads: List[torch.Tensor]
    curvatures: List[Optional[torch.Tensor]]
    inputs: Optional[List[Optional[torch.Tensor]]] = None


def _check_source(source: str) -> None:
    """:raises ValueError: unless ``source`` is a key of :data:`CURVATURE_EXTENSIONS`."""
    if source not in CURVATURE_EXTENSIONS:
        raise ValueError(
            f"Unknown curvature source {source!r} for a network; supported: "
            + ", ".join(repr(name) for name in CURVATURE_EXTENSIONS)
        )


def check_loss_module(loss_module: nn.Module) -> None:
    """:raises ValueError: unless ``loss_module`` is a supported loss with ``reduction="sum"``."""
    if type(loss_module) not in LOSS_MODULES:
        supported = ", ".join(
            f"{cls.__name__}(reduction='sum') ({likelihood})"
            for cls, likelihood in LOSS_MODULES.items()
        )
        raise ValueError(
            f"BackPACK curvature needs one of the loss modules {supported}; "
            f"got {type(loss_module).__name__}"
        )
    if loss_module.reduction != "sum":
        raise ValueError(
            f"{type(loss_module).__name__} must have reduction='sum' (the summed "
            f"negative log-likelihood); got reduction={loss_module.reduction!r}"
        )


def network_curvature(
    net: nn.Module,
    loss_module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    source: str,
    mc_samples: int = 1,
    loss_scale: Union[float, torch.Tensor] = 1.0,
    params: Optional[List[torch.Tensor]] = None,
    check_output: Optional[Callable[[torch.Tensor], None]] = None,
    plans: Optional[Dict[int, tuple]] = None,
) -> NetworkCurvature:
    """
    Gradient and diagonal curvature of :math:`L(w) = c\\,\\mathrm{loss}(f(x; w), y)`
    at the weights the net's parameters hold now (see the module docstring for
    the sources and their factors).

    The net must be extended with :func:`backpack.extend` and its parameters
    hold the weights to evaluate at; the loss module is extended here. The
    ``.grad`` of every parameter of the net is consumed (left ``None``) and the
    BackPACK fields are removed, so calls do not accumulate.

    :param torch.nn.Module net: a plain, BackPACK-extended network with output
        ``(B, ...)``.
    :param torch.nn.Module loss_module: ``CrossEntropyLoss``, ``BCEWithLogitsLoss``
        or ``MSELoss``, all with ``reduction="sum"``.
    :param torch.Tensor x: inputs, batch first.
    :param torch.Tensor y: targets, in the form the loss module expects.
    :param str source: ``"ef"``, ``"ggn"``, ``"ggn_mc"``, ``"reparam"`` or ``"none"``.
    :param int mc_samples: samples of :math:`\\tilde y` per example for
        ``ggn_mc`` (default: 1).
    :param loss_scale: per-example weight :math:`c`, a number or a 0-d tensor
        (default: 1). Gradient and GGNs carry :math:`c`, the empirical Fisher
        :math:`c^2`.
    :param list params: the net's parameters that require a gradient, in
        ``net.parameters()`` order, when the caller has them at hand (default:
        found from ``net``).
    :param check_output: called with the network output before the loss (to
        refuse targets that do not fit it) (default: None).
    :param dict plans: where to keep the closed-form plan of ``net`` between calls
        (:func:`~pyro_ngvi.curvature.mlp.planned`; default: made anew every call).
    :rtype: NetworkCurvature
    :raises ValueError: for an unknown source or an unsupported loss module.
    :raises RuntimeError: when BackPACK produced no curvature for a parameter
        (the net, or one of its layers, is not extended or not supported).
    """
    _check_source(source)
    check_loss_module(loss_module)
    closed_form = None
    if source in mlp.SOURCES:
        closed_form = mlp.plan(net) if plans is None else mlp.planned(net, plans)
    if closed_form is not None and (params is None or params is closed_form.params or same(params, closed_form.params)):
        result = mlp.mlp_curvature(closed_form, loss_module, x, y, source, check_output, mc_samples)
        if result is not None:
            for p in closed_form.params:
                p.grad = None
            loss, grads, curvatures, inputs = result
            if loss_scale.__class__ is float and loss_scale == 1.0:  # (_scaled's own test, inline)
                return NetworkCurvature(loss, grads, curvatures, inputs)
            return _scaled(loss, grads, curvatures, source, loss_scale, inputs)
    extension = _extension(source, mc_samples, batch_statistics=source in BATCH_STATISTICS_EXTENSIONS
                           and has_batch_statistics(net))
    if params is None:
        params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = None

    with warnings.catch_warnings():
        # BackPACK's full backward hook on the first layer, whose input needs no
        # gradient, fires from the output gradient (as BackPACK expects); recent
        # torch warns about that on every backward pass.
        warnings.filterwarnings("ignore", _FIRST_LAYER_HOOK_WARNING, UserWarning)
        warnings.filterwarnings("ignore", _CONTAINER_WARNING, UserWarning)
        if extension is None:
            loss = loss_module(_checked(net(x), check_output, loss_module), y)
            loss.backward()
            curvatures: List[Optional[torch.Tensor]] = [None] * len(params)
        else:
            extend(loss_module)
            with backpack(extension):
                loss = loss_module(_checked(net(x), check_output, loss_module), y)
                try:
                    loss.backward()
                except NotImplementedError as error:  # (a module or loss BackPACK has no extension for)
                    instead = ("CurvatureELBO('reparam') (curvature from the ordinary gradients at one draw: no "
                               "extension) or Pyro's Trace_ELBO")
                    if source in ("kflr", "kfac"):  # (Kronecker factors: a KroneckerNormal guide's step)
                        instead = f"a KroneckerNormal guide needs them: train an AutoNormal guide with {instead}"
                    else:
                        instead = f"use {instead}"
                    why = str(error)
                    unconverted = getattr(net, "backpack_conversion_error", None)  # (twin.py: a container as it is)
                    if unconverted is not None:
                        why += f": its forward did not become a graph of its layers for BackPACK, {unconverted}"
                    raise NotImplementedError(
                        f"the {source!r} curvature needs BackPACK's {type(extension).__name__} for every "
                        f"module of this network and its loss, and BackPACK has none here ({why}); {instead}."
                    ) from error
                except AttributeError as error:  # (a module called twice: BackPACK kept one call's tensors)
                    if not any(f"attribute '{name}'" in str(error) for name in ("output", "input0")):
                        raise
                    raise NotImplementedError(
                        f"the {source!r} curvature is computed by BackPACK from each module's input and "
                        "output, which it keeps for one call only, and a module of this network ran more "
                        f"than once in the forward pass (a layer used twice: shared or tied weights; {error}): "
                        "use CurvatureELBO('reparam') (curvature from the ordinary gradients at one draw) "
                        "or Pyro's Trace_ELBO."
                    ) from error
                except AssertionError as error:  # (a second-order quantity lost on its way back)
                    if "expects a backpropagation quantity" not in str(error):
                        raise
                    raise NotImplementedError(
                        f"the {source!r} curvature is backpropagated by BackPACK through the network's "
                        "modules, and an operation between them is not a module it knows, so nothing "
                        f"reached a layer ({str(error).split('. Extension')[0]}): write activations and "
                        "reshapes as modules (nn.Tanh, nn.Flatten, not torch.tanh in forward), or use "
                        "CurvatureELBO('ef') or CurvatureELBO('reparam'), which need only the gradients."
                    ) from error
                except (RuntimeError, ValueError):  # (torch's sampler, or a distribution's validation)
                    if source not in _EXACT_COUNTERPART or torch.isfinite(loss.detach()).all():
                        raise
                    failed = True  # (drawing targets from non-finite probabilities)
                else:
                    failed = False
            if failed:  # the exact counterpart draws nothing: its non-finite curvature skips the step
                return network_curvature(net, loss_module, x, y, _EXACT_COUNTERPART[source], mc_samples,
                                         loss_scale, params, check_output)
            curvatures = [_pop_curvature(net, p, extension.savefield) for p in params]

    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    for p in params:
        p.grad = None
    return _scaled(loss.detach(), grads, curvatures, source, loss_scale)


def _scaled(loss, grads, curvatures, source, loss_scale, inputs=None) -> NetworkCurvature:
    """The result with the per-example weight :math:`c` applied (see the module docstring), with the
    layers' ``inputs`` (the closed form's; ``None``: BackPACK's)."""
    if isinstance(loss_scale, torch.Tensor) or loss_scale != 1.0:
        loss = loss * loss_scale
        grads = [g * loss_scale for g in grads]
        factor = loss_scale ** _LOSS_SCALE_POWER.get(source, 0)
        curvatures = [h if h is None else [h[0] * factor, *h[1:]] if isinstance(h, list) else h * factor
                      for h in curvatures]
    return NetworkCurvature(loss, grads, curvatures, inputs)


def _checked(output: torch.Tensor, check_output, loss_module=None) -> torch.Tensor:
    """``output`` (checked by ``check_output``) as ``loss_module`` takes it: class logits ``(B, ..., K)``
    with the classes second, ``(B, K, ...)``, for a ``CrossEntropyLoss`` (per-position classes: a
    sequence's)."""
    if check_output is not None:
        check_output(output.detach())
    if isinstance(loss_module, nn.CrossEntropyLoss) and output.dim() > 2:
        return output.movedim(-1, 1)
    return output


_EXTENSION_CACHE: Dict[tuple, BackpropExtension] = {}


def _extension(source: str, mc_samples: int, batch_statistics: bool = False) -> Optional[BackpropExtension]:
    """The extension instance for a source, built once (building one costs a
    noticeable part of a small network's backward pass)."""
    make_extension = (BATCH_STATISTICS_EXTENSIONS if batch_statistics else CURVATURE_EXTENSIONS)[source]
    if make_extension is None:
        return None
    key = (source, make_extension, mc_samples)
    if key not in _EXTENSION_CACHE:
        _EXTENSION_CACHE[key] = sparse_embedding_rule(make_extension(mc_samples))
    extension = _EXTENSION_CACHE[key]
    # Quantities left over by a pass that raised (keyed by data_ptr) must not be
    # accumulated into this one.
    extension.saved_quantities = SavedQuantities()
    return extension


def _pop_curvature(net: nn.Module, param: torch.Tensor, savefield: str):
    value = getattr(param, savefield, None)
    if value is not None:
        delattr(param, savefield)
        return value
    module = next(
        (m for m in net.modules() if any(q is param for q in m.parameters(recurse=False))),
        "the network (the tensor is no longer one of its parameters)",
    )
    raise RuntimeError(
        f"BackPACK computed no {savefield!r} for a parameter of {module!r}. Extend "
        "the network with backpack.extend(net), use layers BackPACK supports (a "
        "PyroModule with PyroSample weights gets nothing from BackPACK) and only "
        "parameters the forward pass uses; a layer BackPACK has no extension for (e.g. LayerNorm) "
        "or a parameter used outside a layer: CurvatureELBO('reparam') (curvature from the ordinary "
        "gradients at one draw) or Pyro's Trace_ELBO."
    )
