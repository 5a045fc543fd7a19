"""
Validation of what a :class:`~pyro_ngvi.BayesianNet` is given: numbers
(:func:`positive_finite`), batches and targets (:class:`InputChecks`: the fast path
never evaluates the likelihood's ``log_prob``, so it checks the targets as that
would), and warnings: when the net runs inside another model that hides its
statistics hints from the ELBO, when the first batch with targets is far from
standardised (:data:`UNIT_SCALE_LIMIT`), and when it predicts with ``BatchNorm`` in
training mode.
"""

import math
import numbers
import sys
import warnings

import torch

import pyro.distributions as dist
from pyro.infer import SVI

from ..family import live_handover
from ..monitor import NGVIWarning

#: The largest root mean square :math:`\sqrt{\frac{1}{B}\sum_i x_{ij}^2}` of an input feature
#: :math:`j` (or of a Gaussian target) in the first batch with targets that passes without a
#: warning; standardised data has 1. (Breast cancer's raw features, up to 2,500, and diabetes'
#: raw targets, 25-346, make the recipe diverge; standardised ones times 10 train.)
UNIT_SCALE_LIMIT = 10.0


def positive_finite(name: str, value) -> float:
    """``value`` as a float, or a ValueError naming ``name`` unless it is a positive finite number."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        0 < value < math.inf
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class InputChecks:
    """
    The checks of :class:`~pyro_ngvi.BayesianNet` on its inputs (a mixin of the model:
    it reads ``likelihood`` and ``_likelihood_param``).
    """

    def _check_batch(self, x, y, step: bool = False) -> int:
        """An empty batch, or targets of another length, are refused (no device sync); for a
        training ``step``, also a batch larger than the data set it stands for. Returns the batch size."""
        if (x.__class__ is not torch.Tensor and not isinstance(x, torch.Tensor)) or (  # (a plain tensor: no call)
                y is not None and y.__class__ is not torch.Tensor and not isinstance(y, torch.Tensor)):
            bad = "x" if not torch.is_tensor(x) else "y"
            raise TypeError(f"BayesianNet: {bad} must be a torch.Tensor, got {type(x if bad == 'x' else y).__name__}")
        batch = x.shape[0] if x.ndim else len(x)  # (len: torch's own error for a 0-d x)
        if batch == 0:
            raise ValueError(
                "BayesianNet got an empty batch x: a minibatch needs at least one example "
                "(its log-likelihood is scaled by num_data / batch size)"
            )
        if y is not None and (y.ndim == 0 or y.shape[0] != batch):
            raise ValueError(
                f"BayesianNet: y holds {len(y) if y.dim() else 'no'} targets for a batch of "
                f"{batch} inputs"
            )
        if y is not None and not self._scale_checked:
            self._scale_checked = True
            self._warn_if_not_standardised(x, y)
        if step:  # (the fast path writes the draws into the tensors the model found at construction)
            for table, name, value, what in self._slots:
                if name not in table or table[name] is not value:
                    raise ValueError(
                        f"BayesianNet: the network's {what} was replaced after the BayesianNet was built: "
                        "its training step would write the draws into the old tensor. Copy new values in place (net.load_state_dict(...), or "
                        "p.copy_(...) under torch.no_grad()), or build a new BayesianNet and guide")
        if step and batch > self.effective_num_data:
            raise ValueError(
                f"BayesianNet: a training batch of {batch} examples for num_data={self.num_data} (the "
                f"data set's size; effective {self.effective_num_data}): the likelihood would be scaled "
                "down by num_data / batch size. Set bnn.num_data to the training set's size (a new "
                "task's too)"
            )
        return batch

    def _warn_if_not_standardised(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """
        Warn once (the first batch with targets) where a floating-point input feature, or a
        Gaussian target, has a root mean square over the batch above :data:`UNIT_SCALE_LIMIT`:
        the recipe's initial scale :math:`(\\lambda_0 + N)^{-1/2}`, its damping :math:`N` (an
        SGD step of ``lr`` per example) and the noise limit (relative to unit-variance inputs)
        assume standardised inputs, and the Gaussian likelihood's prior-scale weights and unit
        initial noise standardised targets. One device sync, once per net.
        """
        found = []
        for name, value in (("inputs x", x), ("targets y", y if self.likelihood == "gaussian" else None)):
            if value is None or not value.is_floating_point() or value.numel() == 0:
                continue
            rms = value.detach().float().pow(2).mean(0).sqrt().max().item()  # (float: MPS has no double)
            if rms > UNIT_SCALE_LIMIT:  # (not NaN: a non-finite batch is skipped, with its own warning)
                found.append(f"{name} of root mean square {rms:.3g} (standardised: 1)")
        if found:
            warnings.warn(
                f"BayesianNet: the first batch has {' and '.join(found)}. The recipe (bnn.guide()'s "
                "initial scale, NGVI()'s damping and the noise limit) is set for standardised data: on "
                "raw features or targets in the hundreds its steps diverge or its weight noise swamps "
                "the signal. Standardise with the training set's mean and standard deviation, "
                "(x - mean) / std (Gaussian targets too, scaling predictions back).",
                NGVIWarning, stacklevel=4)

    def _warn_if_predicting_in_training_mode(self) -> None:
        """
        Warn once when the model runs without targets (as ``Predictive`` runs it) while a
        ``BatchNorm`` layer is in training mode: it would normalise by the statistics of the
        batch being predicted (each prediction depending on the rest of the batch) and update
        its running statistics with them.
        """
        if self._predict_mode_warned or not any(
                isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in self.net.modules()):
            return
        self._predict_mode_warned = True
        warnings.warn(
            "BayesianNet predicts (no targets y) with BatchNorm layers in training mode: they normalise by "
            "the predicted batch's own statistics and update their running statistics with it. Call "
            "bnn.eval() before predicting (and bnn.train() before training again).",
            NGVIWarning, stacklevel=3)

    def _check_output(self, output: torch.Tensor, batch: int) -> None:
        """The network's output must be batch first, ``(B, ...)`` for a batch of ``B`` inputs."""
        if output.dim() == 0 or output.shape[0] != batch:
            raise ValueError(
                f"BayesianNet ({self.likelihood}): the network returned shape {tuple(output.shape)} for a batch "
                f"of {batch} inputs; it must return the batch first, (B, ...) (one input of shape (D,) is "
                "x.unsqueeze(0), a batch of one)")

    def _check_targets(self, y: torch.Tensor, output: torch.Tensor, values: bool = True, source: str = "") -> None:
        """
        Refuse targets the model's likelihood would refuse, for a path that does not
        evaluate its ``log_prob`` (the BackPACK fast path): the shape (the likelihood
        parameter's, class dimension dropped for ``categorical``) and dtype, checked
        once per distinct shape and dtype; and, while Pyro's validation is enabled
        (:func:`pyro.enable_validation`, as for a distribution's support), the values:
        class indices in ``[0, K)`` (integral, e.g. no ``-100``), Bernoulli
        targets in ``{0, 1}``. Gaussian targets are any real number (a non-finite
        one makes the step non-finite: the optimizer skips it). ``values=False``: the
        shape and dtype only (the model's own path, whose ``log_prob`` checks the values). The
        fast path's ``source`` ``ggn`` / ``ggn_mc`` needs class logits ``(B, K)``: one output per
        position, ``(B, T, K)``, is refused (``ef`` and ``reparam`` take it).
        """
        if source in ("ggn", "ggn_mc") and self.likelihood == "categorical" and output.dim() > 2:
            raise NotImplementedError(
                f"BayesianNet (categorical): the {source!r} curvature needs class logits of shape (B, K), the "
                f"network returned {tuple(output.shape)}; CurvatureELBO('ef') or CurvatureELBO('reparam') "
                "takes logits per position (B, ..., K)")
        param = self._likelihood_param(output)
        expected = param.shape[:-1] if self.likelihood == "categorical" else param.shape
        key = (y.shape, y.dtype, output.shape)
        if key not in self._checked_targets:
            self._check_output(output, len(y))
            if y.shape != expected:
                scalar = " (an output (B, 1) is one scalar per example)" if param.dim() < output.dim() else ""
                raise ValueError(
                    f"BayesianNet ({self.likelihood}): targets y of shape {tuple(y.shape)} for a "
                    f"network output of shape {tuple(output.shape)}; expected {tuple(expected)}{scalar}"
                )
            if y.dtype == torch.bool and self.likelihood != "bernoulli" or y.is_complex():
                raise ValueError(
                    f"BayesianNet ({self.likelihood}): targets y of dtype {y.dtype} are not "
                    "supported"
                )
            if self.likelihood == "bernoulli" and not y.is_floating_point():
                raise ValueError(
                    f"BayesianNet (bernoulli): targets y of dtype {y.dtype}; the likelihood's log_prob "
                    "takes floating-point 0 / 1 targets (pass y.float())"
                )
            self._checked_targets.add(key)
        if not values or self.likelihood == "gaussian" or y.dtype == torch.bool or not dist.is_validation_enabled():
            return
        top = param.shape[-1] - 1 if self.likelihood == "categorical" else 1
        low, high = torch.aminmax(y.detach())
        valid = low.tolist() >= 0 and high.tolist() <= top  # a device sync, as Pyro's support checks
        if valid and y.is_floating_point():
            valid = not bool(torch.any(y != y.round()))
        if not valid:
            valid = (y >= 0) & (y <= top) & (y == y.round())
            support = f"class indices in {{0, ..., {top}}}" if self.likelihood == "categorical" else "0 or 1"
            bad = y[~valid]
            raise ValueError(
                f"BayesianNet ({self.likelihood}): targets y must be {support}; got "
                f"{bad.numel()} others, e.g. {bad[:3].tolist()} (the fast path checks them "
                "while Pyro's validation is enabled, as the model's log_prob would)"
            )

    def _warn_if_inside_another_model(self) -> None:
        """
        Warn once when this net runs inside another model (a lambda, a bigger Pyro
        model, a poutine handler) under an ``SVI`` with :class:`~pyro_ngvi.NGVI` and
        :class:`~pyro_ngvi.CurvatureELBO`, and that model offers no
        ``statistics_hints``: the ELBO asks the model it is given for them, so NGVI
        would take its full-batch defaults and ignore :attr:`noise_limit`. Nothing to
        say when every setting the recipe resolves was given and there is no limit.
        Looked at once per ELBO evaluation.
        """
        if self._outer_model_warned or self._outer_model_checked == live_handover():
            return
        self._outer_model_checked = live_handover()  # once per ELBO evaluation
        svi = _calling_svi()
        if svi is None:
            return
        model, optim = svi.model, svi.optim
        elbo = getattr(svi.loss_and_grads, "__self__", None)
        if (model is self or getattr(model, "statistics_hints", None) is not None
                or not getattr(elbo, "produces_curvature", False)
                or not getattr(optim, "consumes_curvature", False)):
            return
        resolved = [name for name in ("lr", "beta", "momentum", "damping") if getattr(optim, name, 0) is None]
        if not resolved and self.noise_limit is None:
            return
        self._outer_model_warned = True
        lost = (f"NGVI resolves {', '.join(resolved)} for full-batch statistics (lr 1, beta 0.5, no damping: "
                "minibatch training with them diverges) instead of the minibatch recipe" if resolved else "")
        if self.noise_limit is not None:
            lost += (" and " if lost else "") + f"the noise limit ({self.noise_limit:g}) is not applied"
        warnings.warn(
            f"BayesianNet ({', '.join(self.latent_sites[:2])}, ...) runs inside another model ({model!r}) "
            f"that has no statistics_hints: CurvatureELBO reads the hints from the model SVI was given, "
            f"so {lost}. Give that model the net's hints, model.statistics_hints = bnn.statistics_hints "
            "(merged with other nets' for several), or train the BayesianNet itself.",
            NGVIWarning,
            stacklevel=3,
        )


def _calling_svi(depth: int = 64):
    """The :class:`pyro.infer.SVI` whose ``step`` (or ``evaluate_loss``) is on the call stack, or ``None``."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, SVI):
            return owner
        frame = frame.f_back
    return None
