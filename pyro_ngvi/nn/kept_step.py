"""
The ELBO side's kept step (issue 24): the straight-line replay of a
``fast_path.BackpackStep`` step once its branches are known, the analogue
of the optimizer's :class:`~pyro_ngvi.steady.SteadyStep`.

A step of the recipe (an AutoNormal guide, one particle at a draw, a closed-form MLP,
a categorical or Bernoulli likelihood, :math:`c = 1`, or the Gaussian one with its noise scale
:math:`s` learned or fixed, :math:`c = 1/(2s^2)`; no point estimates of the net, no ``BatchNorm``;
a fixed prior, a noise limit relative to the fan-in or none) computes, with
:math:`w = \\mu + \\sigma\\epsilon` written into the net and :math:`\\ell = c \\cdot` the loss
module's batch sum,

.. math::

    g = \\tfrac NB \\nabla_w \\ell, \\quad h = \\tfrac NB \\cdot
    \\{\\text{ef}\\ (c^2), \\text{ggn}, \\text{ggn\\_mc}\\ (c)\\}
    \\ \\text{or}\\ g\\,\\epsilon/\\sigma\\ (\\text{reparam}),
    \\qquad \\text{value} = \\text{nll} + \\tfrac12 \\sum [\\lambda_0 w^2 - \\epsilon^2]
    - \\sum \\log \\sigma + \\sum \\log s_0 ,

:math:`\\text{nll} = \\tfrac NB \\ell` (categorical, Bernoulli) or
:math:`\\tfrac NB [\\text{SSE}/(2s^2) + BD (\\log s + \\tfrac12 \\log 2\\pi)]` (Gaussian, whose
:math:`\\partial\\,\\text{nll} / \\partial` (unconstrained :math:`s`) goes into that param's ``.grad``).

:meth:`KeptStep.run` calls the same functions as the full path, in the same order
(the Gaussian's ``BackpackTwin.begin``, :func:`~pyro_ngvi.curvature.mlp.mlp_curvature`,
its ``_scaled`` by :math:`c`, ``value.log_ratio``,
``value.full_nll``, the value, :func:`~pyro_ngvi.handover.attach_curvatures`),
so its tensors are those of the full path to the bit. What it keeps of the full path's step
(:meth:`KeptStep.record`) and what guards each (checked first by :meth:`KeptStep.run`, identity and
value comparisons, no call but the plan's own check and the param store's lookup):

* the checks that passed (source, guide served, batch types, the scale warning done) and the
  decisions on the batch: the shapes, dtypes and devices of ``x`` and ``y``, ``N``, and the
  factor :math:`N/B` as a 0-d tensor; the net's weight slots are compared every step (a
  replaced tensor or layer, which the twin's plan does not see: the full path, which refuses it);
* the guide's reading (``BackpackStep._read``), guarded as the full path guards it, and each
  loc and raw scale's dtype and device (a tensor converted in place);
* the model's structure: its latents and point estimates (none), its likelihood (the Gaussian's
  noise scale is not kept: ``begin`` reads it every step by its ``pyro.param`` statement, with
  gradients on, as the full path does, so a param replaced in the store, a fixed scale set or
  unset by ``bnn.noise_scale = ...`` between steps, are this step's), no
  ``BatchNorm``, a fixed prior (``learn_prior`` off, the prior object itself), the noise-limit
  mode and limit, and the hints made of them (the floors of that limit, for the guarded dtypes);
* the closed-form plan of the net and the twin's parameter list (the plan's own
  ``mlp._unchanged`` runs every step);
* the step's buffers (the draws, the reparam curvature), made for the guarded shapes;
* no autocast on ``x``'s device (``torch.autocast`` around the step computes the net's
  gradients in a lower dtype, which the full path's buffers, its factor :math:`N/B` and its
  hand-over follow; none of these is kept under it).

The data-dependent checks run every step as on the full path: the targets' values while Pyro's
validation is enabled (``_check_targets``); their shape and dtype (checked once per shape) are
in the guard. The whole step runs with gradients off (one switch, not one per function).
"""

from functools import partial

import torch

import pyro
import pyro.distributions as dist

from ..curvature import mlp
from ..handover import attach_curvatures
from ..curvature.backpack import _scaled, network_curvature
from ..family import SiteCurvature
from ..hot_path import same
from ..scales import known_scales
from .value import full_nll, log_ratio


class KeptStep:
    """What one full step of ``step`` (a ``fast_path.BackpackStep``) decided,
    and its straight-line replay (see the module docstring). Made by :meth:`record` after a full
    step, run before each later one (which it declines where a guard fails)."""

    __slots__ = ("model", "guide", "curvature", "mc_samples", "x_key", "y_key", "num_data", "read",
                 "latent_params", "point_estimates", "latents", "slots", "entries", "prior", "mode",
                 "limit", "hints", "plan", "snapshot", "params", "net", "loss_module",
                 "by", "batch", "noise", "curvature_buffers", "transforms", "name", "long_targets", "value",
                 "gaussian", "device_type")

    @classmethod
    def record(cls, step, model, guide, x, y, curvature, num_particles, deterministic, mc_samples, in_order,
               points, loss_scale, by, batch, value):
        """The kept step of the full step just run, or ``None`` where it is not the recipe's
        (more particles, at the mean, point estimates, a learned prior,
        ``noise_limit_mode="mean"``, BatchNorm, a net that is no closed-form MLP, mixed dtypes).
        ``value``: the function of the step's value (``fast_path._value``, without its grad switch)."""
        gaussian = model.likelihood == "gaussian"  # (c = 1 / (2 s^2), read by begin at each step)
        if (num_particles != 1 or deterministic or not in_order or points
                or (not gaussian and (loss_scale.__class__ is not float or loss_scale != 1.0)) or model.learn_prior
                or model.noise_limit_mode == "mean" or model._running_stats.batch_norms
                or not isinstance(by, torch.Tensor) or x.__class__ is not torch.Tensor
                or y.__class__ is not torch.Tensor or step._read is None or step._read.guide is not guide
                or torch.is_autocast_enabled(x.device.type)):  # (autocast: the full path's casts, every step)
            return None
        source = "none" if curvature == "reparam" else curvature
        net = step.net if source == "none" else step.twin
        entry = step._plans.get(id(net))
        if entry is None or entry[0] is not net or not mlp._unchanged(entry[2], entry[1].params) \
                or not (step.params is entry[1].params or same(step.params, entry[1].params)):
            return None
        kept = cls()
        kept.model, kept.guide, kept.curvature = model, guide, curvature
        kept.x_key = (x.shape, x.dtype, x.device)
        kept.device_type = x.device.type
        kept.y_key = (y.shape, y.dtype, y.device)
        kept.num_data, kept.batch, kept.by = model.effective_num_data, batch, by
        kept.read = step._read
        kept.name = step._read.name
        kept.transforms = step._read.transforms
        kept.latent_params, kept.point_estimates, kept.latents = (model._latent_params, model._point_estimates,
                                                                  model._latents)
        kept.slots = model._slots
        kept.entries = [(t, t.dtype, t.device) for entry in step._read.entries for t in entry[1::2]]
        if any(t.dtype is not by.dtype or t.device != by.device for t, _, _ in kept.entries):
            return None  # (a net converted after its guide was made: the full path casts per site)
        kept.prior = model._weight_prior()
        if kept.prior.params is not None:
            return None
        kept.mode, kept.limit = model.noise_limit_mode, model.noise_limit
        kept.hints = model._sites_hints(False)
        kept.plan, kept.snapshot, kept.params, kept.net = entry[1], entry[2], step.params, net
        kept.loss_module = step._plain_loss if source == "none" else step.loss_module
        kept.noise = step._buffers.get("noise")
        kept.curvature_buffers = step._buffers.get("curvature")
        kept.long_targets = model.likelihood == "categorical" and y.dtype is torch.int64
        kept.mc_samples, kept.value, kept.gaussian = mc_samples, value, gaussian
        return kept

    def run(self, step, model, guide, x, y, curvature, num_particles, deterministic, mc_samples):
        """The step, straight-line: the full path's functions in its order (see the module docstring), or
        ``None`` (nothing done) where a decision kept no longer stands (the guards, inline: no call)."""
        if (model is not self.model or guide is not self.guide or curvature != self.curvature or num_particles != 1
                or deterministic or step._served is not guide or step._read is not self.read
                or x.__class__ is not torch.Tensor or y.__class__ is not torch.Tensor
                or (x.shape, x.dtype, x.device) != self.x_key or (y.shape, y.dtype, y.device) != self.y_key
                or model._effective_num_data != self.num_data or not model._scale_checked
                or model._latent_params is not self.latent_params or model._latents is not self.latents
                or model._point_estimates is not self.point_estimates or model._slots is not self.slots
                or model._learn_prior or model._running_stats.batch_norms
                or model._flat_prior_cache is not self.prior or model._noise_limit_mode != self.mode
                or model._noise_limit != self.limit
                or step.params is not self.params or guide._pyro_name != self.name
                or guide.prototype_trace is None or mc_samples != self.mc_samples
                or torch.is_autocast_enabled(self.device_type)):
            return None
        for table, name, value, _ in self.slots:  # (a replaced weight: the full path refuses it)
            if name not in table or table[name] is not value:
                return None
        store = pyro.get_param_store()
        params, constraints = store._params, store._constraints
        for name, tensor, constraint, weight in self.read.entries:  # (as BackpackStep._read_guide)
            if (name not in params or params[name] is not tensor or constraints[name] is not constraint
                    or tensor.shape != weight.shape):
                return None
        for tensor, dtype, device in self.entries:
            if tensor.dtype is not dtype or tensor.device != device:
                return None
        if not mlp._unchanged(self.snapshot, self.plan.params):
            return None

        read = self.read
        names, raws, transforms, exps = read.loc_names, read.raws, read.transforms, read.exps
        prior = self.prior
        enabled = torch.is_grad_enabled()
        if enabled:
            torch._C._set_grad_enabled(False)
        try:
            stddevs = known_scales(raws)
            j = 0
            for stddev in stddevs:
                if stddev is None:
                    stddevs[j] = transforms[j][1](raws[j].detach())
                j += 1
            locs = list(names)  # (written over below: no call for the length)
            j = 0
            for name in names:  # (pyro.param statements, as read_params: SVI's trace records them)
                locs[j] = pyro.param(name).unconstrained()
                j += 1
            gaussian, noise_scale, loss_scale = self.gaussian, None, 1.0
            if gaussian:  # (its noise scale's pyro.param statement, with gradients on as on the full path: a
                # learned scale's graph, which full_nll backpropagates)
                torch._C._set_grad_enabled(enabled)
                _, noise_scale, loss_scale = step.begin(model)
                torch._C._set_grad_enabled(False)
            # (else BackpackStep.begin has nothing to do without BatchNorm, point estimates or a noise scale; the
            # twin's train/eval modes, which the closed form does not read, are matched by the next full step)
            target = y if self.long_targets else step.loss_target(model, y)
            # the draws into the net (as BackpackStep._sample_into_net)
            noises = self.noise
            for noise in noises:
                noise.normal_()
            params = model._latent_params
            torch._foreach_copy_(params, locs)
            torch._foreach_addcmul_(params, stddevs, noises)
            draws = [noises, torch._foreach_mul(noises, noises)] if curvature == "reparam" else None
            check = partial(model._check_targets, y, source=curvature) if dist.is_validation_enabled() else None
            source = "none" if curvature == "reparam" else curvature
            result = mlp.mlp_curvature.__wrapped__(self.plan, self.loss_module, x, target, source, check,
                                                   self.mc_samples)
            if result is None:  # (not expected under the guards: the full path's network_curvature)
                step._kept = None
                torch._C._set_grad_enabled(enabled)
                result = network_curvature(self.net, self.loss_module, x, target, source, mc_samples=self.mc_samples,
                                           loss_scale=loss_scale, params=self.params, check_output=check,
                                           plans=step._plans)
                torch._C._set_grad_enabled(False)
            else:
                for p in self.plan.params:
                    p.grad = None
                if not (loss_scale.__class__ is float and loss_scale == 1.0):  # (as network_curvature: times c)
                    result = _scaled(result[0], result[1], result[2], source, loss_scale)
            loss, grads, curvatures = result[0], result[1], result[2]
            if curvature == "reparam":  # h = g eps / sigma
                curvatures = self.curvature_buffers
                torch._foreach_copy_(curvatures, grads)
                torch._foreach_mul_(curvatures, noises)
                torch._foreach_div_(curvatures, stddevs)
            ratio = log_ratio.__wrapped__(prior, params, noises)
            torch._foreach_mul_(grads + curvatures, self.by)
            if gaussian:  # (a learned scale's gradient: a backward, with gradients on as on the full path)
                torch._C._set_grad_enabled(enabled)
                nll = full_nll(self.num_data, loss, loss_scale, noise_scale, target, self.batch)
                torch._C._set_grad_enabled(False)
            else:
                nll = full_nll(self.num_data, loss, 1.0, None, target, self.batch)
            value = self.value(nll, ratio, raws, locs, stddevs, exps, prior, 1, False)
            hints, sampled = self.hints, curvature == "reparam"
            handed = list(locs)
            j = 0
            for loc in locs:  # (as BackpackStep._hand_over)
                handed[j] = SiteCurvature(
                    grad=grads[j], curvature=curvatures[j], prior_loc=prior.site_locs[j],
                    prior_precision=prior.site_precisions[j], sampled=sampled, nonnegative=not sampled,
                    scale=stddevs[j], prior_scale_param=None, eps_mean=None if draws is None else draws[0][j],
                    eps_sq_mean=None if draws is None else draws[1][j], loss=value, watched=True, fitted=True,
                    **hints[j])
                j += 1
            attach_curvatures(locs, handed)
            return value
        finally:
            if enabled:
                torch._C._set_grad_enabled(True)
