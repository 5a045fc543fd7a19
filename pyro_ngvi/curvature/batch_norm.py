"""
Per-example curvature of networks with ``BatchNorm`` layers that normalise with
the statistics of the minibatch (train mode, or ``track_running_stats=False``).

Such a layer maps example :math:`i` to
:math:`\\gamma (z_i - \\bar z_B) / \\sqrt{s_B^2 + \\epsilon} + \\beta`, with the
minibatch's mean :math:`\\bar z_B` and (biased) variance :math:`s_B^2`: every
output depends on every example of the batch, so the per-example terms the
empirical Fisher and the GGN sum over are not separate functions of the
weights, and BackPACK refuses the layer (``ggn``, ``ggn_mc``) or mixes
examples silently (``ef``). The seeds keep the ``BatchNorm`` parameters
point-estimated; what a curvature source needs is the curvature of the
likelihood in the *other* weights. Here it is computed for the **network with
frozen statistics**: each such layer normalises with :math:`\\bar z_B` and
:math:`s_B^2` of the current minibatch held as constants,

.. math:: f_i^{\\text{frozen}}(w) = f(x_i; w \\mid \\bar z_B, s_B^2 \\text{ fixed}),

which has the same value as the train-mode network at the current weights, is
per-example separable, and is what an eval-mode ``BatchNorm`` whose running
statistics were the batch's computes. For :math:`\\ell_i = -\\log p(y_i \\mid f_i)`
and a minibatch of :math:`B` of :math:`N` examples, each source gives:

=========== ===================================================================
``g``       the exact gradient :math:`\\nabla_w \\frac{N}{B} \\sum_i \\ell_i` of the
            train-mode network, through the statistics (what ``Trace_ELBO``
            differentiates): every source, every path
``ef``      :math:`\\frac{N}{B} \\sum_i (\\nabla_w \\ell_i(f_i^{\\text{frozen}}))^2`
``ggn``     :math:`\\frac{N}{B} \\sum_i \\mathrm{diag}(J_i^\\top H_i J_i)`,
            :math:`J_i = \\partial f_i^{\\text{frozen}} / \\partial w`
``ggn_mc``  the same with :math:`H_i` from targets drawn from the model
``reparam`` :math:`g\\,\\epsilon/\\sigma` with the exact :math:`g` (no change)
``hessian`` the exact Hessian diagonal of the train-mode objective (traced path)
=========== ===================================================================

The frozen Jacobians leave out the paths through :math:`\\bar z_B` and
:math:`s_B^2` (each of order :math:`1/B` per example): an approximation of the
same kind as the GGN's. In eval mode with running statistics nothing changes:
the network is per-example separable and every source is exact.

Two implementations compute the same numbers:

* **BackPACK** (the :class:`~pyro_ngvi.BayesianNet` fast path, one backward
  pass): the layer runs as in train mode (the exact gradient, the running
  statistics updated once), and the rule BackPACK uses to pass curvature
  through it, :class:`FrozenStatisticsBatchNorm`, is the frozen layer's
  Jacobian :math:`\\mathrm{diag}(\\gamma / \\sqrt{s_B^2 + \\epsilon})`.
  ``ggn`` and ``ggn_mc`` use it inside BackPACK's ``DiagGGNExact`` /
  ``DiagGGNMC``; ``ef`` cannot use BackPACK's first-order ``SumGradSquared``
  (which squares each layer's batch-coupled output gradient), so it runs
  :class:`EmpiricalFisherBackprop`: the GGN machinery with the loss Hessian's
  square root replaced by the observed per-example gradient of the loss, whose
  squared Jacobian-transposed products are the per-example gradients squared.
* **autograd** (:class:`~pyro_ngvi.CurvatureELBO` on a traced model, a
  ``PyroModule`` or any model calling ``nn.BatchNorm*`` / ``F.batch_norm``):
  when the likelihood's graph holds a batch-statistics ``batch_norm``
  (:func:`uses_batch_statistics`), the model is run a second time, replaying
  the same latent values and random state, under :func:`frozen_batch_statistics`,
  and the per-example curvature is taken from that run.
"""

import inspect
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, einsum, nn
from torch.overrides import TorchFunctionMode

from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.extensions import DiagGGNExact, DiagGGNMC
from backpack.extensions.secondorder.diag_ggn import DiagGGN
from backpack.extensions.secondorder.diag_ggn.diag_ggn_base import DiagGGNBaseModule
from backpack.extensions.secondorder.hbp import LossHessianStrategy

from ..graph import graph_nodes


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_LOSSES = (nn.CrossEntropyLoss, nn.BCEWithLogitsLoss, nn.MSELoss)


def uses_batch_norm_statistics(module: nn.Module) -> bool:
    """Whether a ``BatchNorm`` module normalises with its input's statistics
    (train mode, or no running statistics to use)."""
    return module.training or module.running_var is None


def has_batch_statistics(net: nn.Module) -> bool:
    """Whether any ``BatchNorm`` layer of ``net`` normalises with minibatch statistics."""
    return any(isinstance(m, BATCH_NORMS) and uses_batch_norm_statistics(m) for m in net.modules())


# --------------------------------------------------------------------------- #
# BackPACK: the frozen layer's Jacobian, and the empirical Fisher by backprop
# --------------------------------------------------------------------------- #


class _FrozenStatisticsDerivatives(BatchNormNdDerivatives):
    """
    Derivatives of a ``BatchNorm`` layer with the statistics its forward pass
    used (the minibatch's, or the running ones in eval mode) held fixed: an
    element-wise affine map, Jacobian :math:`\\mathrm{diag}(\\gamma/\\sqrt{s^2+\\epsilon})`
    per channel, zero second derivative. Its parameters' Jacobians are
    BackPACK's (they already hold the statistics fixed).
    """

    def hessian_is_zero(self, module) -> bool:
        return True

    def _check_parameters(self, module) -> None:
        pass

    def _get_normalized_input_and_var(self, module):
        input = module.input0
        if uses_batch_norm_statistics(module):
            dims = self._get_free_axes(module, index_batch=0)
            mean, var = input.mean(dim=dims), input.var(dim=dims, unbiased=False)
        else:
            mean, var = module.running_mean, module.running_var
        mean = self._unsqueeze_free_axis(module, mean, 0)
        var_expanded = self._unsqueeze_free_axis(module, var, 0)
        return (input - mean) / (var_expanded + module.eps).sqrt(), var

    def _jac_t_mat_prod(self, module, g_inp, g_out, mat: Tensor, subsampling=None) -> Tensor:
        _, var = self._get_normalized_input_and_var(module)
        factor = (var + module.eps).rsqrt()
        if module.weight is not None:
            factor = factor * module.weight
        return einsum("c,vnc...->vnc...", factor, mat)

    def _jac_mat_prod(self, module, g_inp, g_out, mat: Tensor) -> Tensor:
        return self._jac_t_mat_prod(module, g_inp, g_out, mat)


class FrozenStatisticsBatchNorm(DiagGGNBaseModule):
    """
    The rule by which BackPACK's diagonal-GGN extensions pass the square root of
    the curvature through a ``BatchNorm`` layer, with its statistics frozen (see
    the module docstring), in train and eval mode alike; its own ``weight`` and
    ``bias`` get the frozen layer's diagonal too.
    """

    def __init__(self):
        super().__init__(_FrozenStatisticsDerivatives(), ["weight", "bias"], sum_batch=True)


class _ObservedGradientLoss(DiagGGNBaseModule):
    """
    The start of :class:`EmpiricalFisherBackprop` at the loss: instead of a
    square root of the loss Hessian, each example's gradient of the loss in the
    network output, :math:`\\nabla_f \\ell(f_i, y_i)` (the loss module's input
    gradient under ``reduction="sum"``), as a single column.
    """

    def __init__(self):
        super().__init__(derivatives=None)

    def backpropagate(self, ext, module, grad_inp, grad_out, backproped):
        return grad_inp[0].detach().unsqueeze(0)


class EmpiricalFisherBackprop(DiagGGN):
    """
    The diagonal empirical Fisher :math:`\\sum_i (J_i^\\top \\nabla_f \\ell_i)^{\\odot 2}
    = \\sum_i (\\nabla_w \\ell_i)^{\\odot 2}` computed by BackPACK's GGN
    backpropagation (one column per example), so that layers which are
    per-example separable only through a rule of their own
    (:class:`FrozenStatisticsBatchNorm`) get per-example gradients; without
    such layers it equals ``SumGradSquared``. Saved as ``empirical_fisher_diag``.
    """

    def __init__(self):
        super().__init__(loss_hessian_strategy=LossHessianStrategy.EXACT,
                         savefield="empirical_fisher_diag")
        for loss in _LOSSES:
            self.set_module_extension(loss, _ObservedGradientLoss(), overwrite=True)
        freeze_batch_norm(self)


def freeze_batch_norm(extension):
    """Make a diagonal-GGN BackPACK extension pass ``BatchNorm`` layers with their
    statistics frozen (:class:`FrozenStatisticsBatchNorm`); returns it."""
    for cls in BATCH_NORMS:
        extension.set_module_extension(cls, FrozenStatisticsBatchNorm(), overwrite=True)
    return extension


def frozen_ggn() -> DiagGGNExact:
    """BackPACK's ``DiagGGNExact``, passing ``BatchNorm`` layers with frozen statistics."""
    return freeze_batch_norm(DiagGGNExact())


def frozen_ggn_mc(mc_samples: int) -> DiagGGNMC:
    """BackPACK's ``DiagGGNMC``, passing ``BatchNorm`` layers with frozen statistics."""
    return freeze_batch_norm(DiagGGNMC(mc_samples=mc_samples))


# --------------------------------------------------------------------------- #
# autograd: find batch statistics in a graph, and rerun with them frozen
# --------------------------------------------------------------------------- #


def uses_batch_statistics(tensors: Iterable[Tensor]) -> bool:
    """
    Whether the autograd graph of ``tensors`` holds a ``batch_norm`` that
    normalised with its input's statistics (its backward node saved
    ``training=True``): one walk over the graph's nodes.
    """
    return any("BatchNorm" in type(node).__name__ and getattr(node, "_saved_training", False)
               for node in graph_nodes(tensors))


_BATCH_NORM_SIGNATURE = inspect.signature(F.batch_norm)


class frozen_batch_statistics(TorchFunctionMode):
    """
    A context in which every ``torch.nn.functional.batch_norm`` that would
    normalise with its input's statistics (``nn.BatchNorm*`` in train mode, or
    without running statistics) normalises with those statistics detached, as
    constants, and leaves the running statistics alone: the network with frozen
    statistics of the module docstring. The increment of ``num_batches_tracked``
    that ``nn.BatchNorm*`` makes just before is undone, so a second run of a
    model inside this context leaves no trace in the modules' buffers.
    """

    def __init__(self):
        super().__init__()
        self._counter: Optional[Tensor] = None  # a 0-d int64 tensor just incremented by one

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self._batch_norm(*args, **kwargs)
        counter = self._counter
        self._counter = None
        result = func(*args, **kwargs)
        if func is Tensor.add_ and _is_increment(args, kwargs):
            self._counter = args[0]
        elif func is Tensor.__float__ and counter is not None:
            self._counter = counter  # BatchNorm with momentum=None reads the count
        return result

    def _batch_norm(self, *args, **kwargs):
        bound = _BATCH_NORM_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        counter, self._counter = self._counter, None
        if not a["training"]:
            return F.batch_norm(**a)
        if counter is not None:
            with torch.no_grad():
                counter.sub_(1)
        x = a["input"]
        dims = [d for d in range(x.dim()) if d != 1]
        with torch.no_grad():
            mean, var = x.mean(dims), x.var(dims, unbiased=False)
        return F.batch_norm(x, mean, var, a["weight"], a["bias"], False, 0.0, a["eps"])


def _is_increment(args, kwargs) -> bool:
    """``counter.add_(1)`` on a 0-d integer tensor (``num_batches_tracked``)."""
    if len(args) != 2 or kwargs or not isinstance(args[0], Tensor):
        return False
    counter, other = args
    return counter.dim() == 0 and not counter.is_floating_point() and isinstance(other, int) and other == 1
