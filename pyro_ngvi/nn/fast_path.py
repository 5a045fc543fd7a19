"""
The fast path of :class:`~pyro_ngvi.nn.BayesianNet`: what
:class:`~pyro_ngvi.CurvatureELBO` does for it and an
:class:`~pyro.infer.autoguide.AutoNormal` guide, without Pyro's tracing.

Sampled weights are copied into a BackPACK-extended twin of the plain network
(it shares the network's parameter and buffer dicts), one backward pass gives the
gradient and the per-example curvature of the likelihood for every weight tensor
(:func:`~pyro_ngvi.curvature.backpack.network_curvature`), and the result is handed
to :class:`~pyro_ngvi.NGVI` as a :class:`~pyro_ngvi.family.SiteCurvature` per site.
The model itself stays free of BackPACK's hooks, so its traced path (and
``torch.func`` on it) runs the plain network.
"""

import math
from copy import deepcopy
from functools import partial
from itertools import chain
from typing import List, Optional, Tuple

import torch
from torch import nn

import pyro

from backpack import extend

from ..curvature.backpack import network_curvature
from ..family import SiteCurvature, attach_curvature, scale_transform
from ..scales import known_scale, log_scale_sum
from ..kronecker import KroneckerCurvature, KroneckerNormal

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)

#: The BackPACK loss module of each likelihood (``reduction="sum"``).
LOSS_MODULES = {
    "categorical": nn.CrossEntropyLoss,
    "bernoulli": nn.BCEWithLogitsLoss,
    "gaussian": nn.MSELoss,
}


class BackpackStep:
    """
    A BackPACK-extended twin of ``net`` and its loss module; calling it runs one
    ELBO step of a :class:`~pyro_ngvi.nn.BayesianNet` (see :meth:`__call__`).

    :param torch.nn.Module net: the plain network (its parameter and buffer dicts
        are shared, not copied).
    :param str likelihood: a key of :data:`LOSS_MODULES`.
    """

    #: Curvature sources the fast path serves.
    sources = ("ef", "ggn", "ggn_mc", "reparam")

    def __init__(self, net: nn.Module, likelihood: str):
        twin = deepcopy(net, memo={id(t): t for t in chain(net.parameters(), net.buffers())})
        for twin_module, module in zip(twin.modules(), net.modules()):
            twin_module._parameters = module._parameters
            twin_module._buffers = module._buffers
        self.twin = extend(twin)
        self.loss_module = extend(LOSS_MODULES[likelihood](reduction="sum"))
        self.module_pairs = list(zip(twin.modules(), net.modules()))
        self._layer_inputs = {}  # id(net's Linear) -> [its latest input], for Kronecker factors
        self._kronecker_cache = None
        self._guide_names = {}  # id(guide) -> (its name, its loc names, its scale names)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the twin's parameters (after ``.to()`` put new tensors in the shared dicts)."""
        self.params = [p for p in self.twin.parameters() if p.requires_grad]

    def _loss_target(self, model, y: torch.Tensor) -> torch.Tensor:
        """``y`` in the form the BackPACK loss module expects: class indices, or
        floats shaped as the network output (``(B,)`` targets of a ``(B, 1)`` output)."""
        if model.likelihood == "categorical":
            return y.long()
        dtype = model._latents[0].param.dtype
        return (y.unsqueeze(-1) if y.dim() == 1 else y).to(dtype)

    def __call__(
        self,
        model,
        guide,
        x: torch.Tensor,
        y: torch.Tensor,
        curvature: str,
        num_particles: int = 1,
        deterministic: bool = False,
        mc_samples: int = 1,
    ) -> torch.Tensor:
        """:meth:`pyro_ngvi.nn.BayesianNet.curvature_step` of ``model`` (see there for the
        estimates and the value returned)."""
        if isinstance(guide, KroneckerNormal):
            return self._kronecker_step(model, guide, x, y, curvature, num_particles, deterministic, mc_samples)
        self._check_step(guide, y, curvature, deterministic)
        model._check_batch(x, y)
        locs, raws, stddevs = self._read_guide(model, guide, x, y)
        points, noise_scale, loss_scale = self._begin(model)
        prior = model._weight_prior()
        twin, loss_module = self.twin, self.loss_module
        target = self._loss_target(model, y)
        source = "none" if curvature == "reparam" else curvature
        grads: List[torch.Tensor] = []
        curvatures: List[torch.Tensor] = []
        point_grads: List[torch.Tensor] = []
        nll, log_ratio = 0.0, 0.0
        draws = None  # reparam: the sum over particles of eps and eps^2, for NGVI's control variate
        for particle in range(num_particles):
            noises = self._sample_into_net(model, locs, stddevs, deterministic)
            if curvature == "reparam":
                if draws is None:  # (one particle: the draws themselves, not changed below)
                    draws = [[n.clone() if num_particles > 1 else n for n in noises], [n.square() for n in noises]]
                else:
                    torch._foreach_add_(draws[0], noises)
                    torch._foreach_addcmul_(draws[1], noises, noises)
            result = network_curvature(
                twin, loss_module, x, target, source, mc_samples=mc_samples, loss_scale=loss_scale,
                params=self.params,
                check_output=partial(model._check_targets, y) if particle == 0 else None,
            )
            site_grads = [result.grads[w.index] for w in model._latents]
            if curvature == "reparam":
                site_curvatures = [g * e / s for g, e, s in zip(site_grads, noises, stddevs)]
            else:
                site_curvatures = [result.curvatures[w.index] for w in model._latents]
            site_point_grads = [result.grads[w.index] for w in model._point_estimates]
            if particle == 0:  # fresh tensors, ours to scale in place below
                grads, curvatures, point_grads = site_grads, site_curvatures, site_point_grads
            else:
                torch._foreach_add_(grads, site_grads)
                torch._foreach_add_(curvatures, site_curvatures)
                if point_grads:
                    torch._foreach_add_(point_grads, site_point_grads)
            nll = nll + result.loss
            if not deterministic:
                log_ratio = log_ratio + self._log_ratio(prior, model._latent_params, noises)

        # full-data scale N/B and particle average; hand g, h over on each loc
        factor = model.effective_num_data / len(x) / num_particles
        torch._foreach_mul_(grads, factor)
        torch._foreach_mul_(curvatures, factor)
        if draws is not None and num_particles > 1:
            for d in draws:
                torch._foreach_div_(d, num_particles)
        eps_means, eps_sq_means = draws if draws is not None else ([None] * len(locs), [None] * len(locs))
        nll = self._full_nll(model, nll / num_particles, loss_scale, noise_scale, target, len(x))
        log_scale = sum(log_scale_sum(raw, stddev) for raw, stddev in zip(raws, stddevs))
        if deterministic:
            loss = (nll + self._kl(prior, locs, stddevs, log_scale)).detach()
        else:  # the particle average of sum [lambda_0 (w - m_0)^2 - eps^2] / 2 - log sigma + log s_0
            log_ratio = log_ratio / num_particles - log_scale + prior.log_scale_total
            loss = (nll + log_ratio).detach()
        floors = None if deterministic else model._noise_floor()  # as statistics_hints says
        for j, (loc, grad, curv, stddev) in enumerate(zip(locs, grads, curvatures, stddevs)):
            stats = SiteCurvature(
                grad=grad,
                curvature=curv,
                prior_loc=prior.site_locs[j],
                prior_precision=prior.site_precisions[j],
                sampled=curvature == "reparam",
                nonnegative=curvature != "reparam",
                scale=stddev,
                prior_scale_param=None if prior.params is None else prior.params[j],
                eps_mean=eps_means[j],
                eps_sq_mean=eps_sq_means[j],
                num_data=model.effective_num_data,
                min_precision=None if floors is None else floors[j],
                loss=loss,
            )
            attach_curvature(loc, stats)
        for value, grad in zip(points, point_grads):
            _accumulate_grad(value.unconstrained(), grad.mul_(factor))

        return loss

    def _begin(self, model):
        """
        What every step needs first: the BatchNorm statistics kept until the step
        is accepted, the point estimates (read through
        ``pyro.param`` and copied into the net), the Gaussian noise scale, the
        per-example weight :math:`c` of the loss module (:math:`-\\log p = c\\,`MSE +
        const), and the twin's train/eval modes matched to the network's.
        """
        model._keep_running_stats_until_accepted()
        points = [model._point_estimate(w) for w in model._point_estimates]
        noise_scale = model._noise_scale() if model.likelihood == "gaussian" else None
        for twin_module, module in self.module_pairs:
            if twin_module.training != module.training:
                twin_module.training = module.training
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

    # ------------------------------------------------------------ Kronecker factors
    def _kronecker_step(self, model, guide, x, y, curvature, num_particles, deterministic, mc_samples):
        """
        :meth:`__call__` for a :class:`~pyro_ngvi.kronecker.KroneckerNormal` guide:
        per layer :math:`\\bar W = M + L_U Z L_V^\\top` (:math:`M` when
        ``deterministic``), written into the net as its weight and bias; one
        backward pass under BackPACK's ``KFLR`` (``curvature="ggn"``) or ``KFAC``
        (``"ggn_mc"``) gives :math:`\\nabla_{\\bar W}\\ell` and the output factor
        :math:`G`; the input factor :math:`\\hat A = \\frac1B \\sum_i \\bar a_i \\bar
        a_i^\\top` comes from the layer's inputs (with a column of ones for the
        bias). Both are scaled to the full data (:math:`N/B` on :math:`G` and the
        gradient), averaged over particles and attached to each layer's ``loc`` as
        a :class:`~pyro_ngvi.kronecker.KroneckerCurvature` with the layer's
        element-wise Normal prior. Returns the negative ELBO estimate (particle
        average of :math:`\\ell + \\log q - \\log p_0`; ``deterministic``:
        :math:`\\ell(M) + \\mathrm{KL}(q \\| p_0)`).
        """
        if curvature not in _KRONECKER_SOURCES:
            raise ValueError(
                f"A KroneckerNormal guide takes Kronecker factors: curvature 'ggn' (BackPACK KFLR) or "
                f"'ggn_mc' (KFAC), got {curvature!r}"
            )
        if y is None:
            raise ValueError("curvature_step needs the targets y")
        if model.learn_prior:
            raise NotImplementedError(
                "BayesianNet(learn_prior=True) learns its prior scales with an AutoNormal guide; "
                "a KroneckerNormal guide folds a fixed prior into its Kronecker factors"
            )
        model._check_batch(x, y)
        layers = self._kronecker_layers(model, guide, x, y)
        locs = [pyro.param(f"{guide._pyro_name}.locs.{layer.name}") for layer, _ in layers]
        points, noise_scale, loss_scale = self._begin(model)
        target = self._loss_target(model, y)
        source = _KRONECKER_SOURCES[curvature]
        with torch.no_grad():
            posteriors = [guide.get_layer(layer.name) for layer, _ in layers]
        sums = None
        nll, log_ratio = 0.0, 0.0
        for _ in range(num_particles):
            values, log_q = [], 0.0
            with torch.no_grad():
                for (layer, (weight, bias, _, _)), loc, posterior in zip(layers, locs, posteriors):
                    if deterministic:
                        value = loc.detach()
                    else:  # as MatrixNormal.rsample draws it
                        noise = torch.randn(loc.shape, dtype=loc.dtype, device=loc.device)
                        value = posterior.transform(noise)
                        log_q = log_q + posterior.noise_log_prob(noise)
                    weight.param.copy_(value[:, : layer.in_features])
                    if bias is not None:
                        bias.param.copy_(value[:, layer.in_features])
                    values.append(value)
            result = network_curvature(self.twin, self.loss_module, x, target, source,
                                       mc_samples=mc_samples, loss_scale=loss_scale, params=self.params)
            particle = []
            for layer, (weight, bias, inputs, _) in layers:
                grad = result.grads[weight.index]
                activations = inputs[0]
                if bias is not None:
                    grad = torch.cat([grad, result.grads[bias.index].unsqueeze(-1)], -1)
                    activations = torch.cat([activations, torch.ones_like(activations[:, :1])], -1)
                particle.append([grad, result.curvatures[weight.index][0],
                                 activations.T @ activations / len(x)])
            particle.append([result.grads[w.index] for w in model._point_estimates])
            sums = particle if sums is None else [[a + b for a, b in zip(s, p)] for s, p in zip(sums, particle)]
            nll = nll + result.loss
            if not deterministic:
                with torch.no_grad():
                    log_ratio = log_ratio + log_q - sum(prior.log_prob(value).sum()
                                                        for (_, (_, _, _, prior)), value in zip(layers, values))

        factor = model.effective_num_data / len(x) / num_particles
        for loc, (layer, (_, _, _, prior)), (grad, output_factor, input_factor) in zip(locs, layers, sums):
            attach_curvature(loc.unconstrained(), KroneckerCurvature(
                grad * factor, input_factor / num_particles, output_factor * factor,
                prior.loc.expand(grad.shape), prior.scale[0].pow(-2),
            ))
        for value, grad in zip(points, sums[-1]):
            _accumulate_grad(value.unconstrained(), grad.mul_(factor))
        nll = self._full_nll(model, nll / num_particles, loss_scale, noise_scale, target, len(x))
        if deterministic:
            with torch.no_grad():
                kl = sum(_matrix_normal_kl(posterior, prior) for posterior, (_, (_, _, _, prior))
                         in zip(posteriors, layers))
            return (nll + kl).detach()
        return (nll + log_ratio / num_particles).detach()

    def _kronecker_layers(self, model, guide, x, y):
        """``[(layer, (weight, bias, inputs, prior))]``: the model's :class:`_Weight` s of
        each layer of the guide, a list the twin's layer writes its input into (one
        forward pre-hook per layer, registered once) and the layer's prior as an
        element-wise ``Normal`` over :math:`\\bar W`, columns ``[W, b]``."""
        if guide.prototype_trace is None:
            guide(x, y)
        store = pyro.get_param_store()
        names = [f"{guide._pyro_name}.locs.{layer.name}" for layer in guide.layers]
        if not all(name in store for name in names):
            with guide._pyro_context:  # (re-)registers the guide's own tensors
                for layer in guide.layers:
                    guide.get_layer(layer.name)
        key = (id(model), id(guide))
        if self._kronecker_cache is not None and self._kronecker_cache[0] == key:
            return self._kronecker_cache[1]
        by_site = {w.site: (j, w) for j, w in enumerate(model._latents)}
        twin_of = {id(module): twin_module for twin_module, module in self.module_pairs}
        layers = []
        for layer in guide.layers:
            (j, weight), bias = by_site[layer.weight_site], by_site.get(layer.bias_site)
            inputs = self._layer_inputs.get(id(weight.module))
            if inputs is None:
                inputs = self._layer_inputs[id(weight.module)] = []
                twin_of[id(weight.module)].register_forward_pre_hook(_keep_input(inputs))
            locs, scales = [], []
            for index, width in ((j, layer.in_features), (None if bias is None else bias[0], 1)):
                if index is None:
                    continue
                loc, scale, _, _ = model._prior_buffers(index)
                if scale.numel() > 1 and not bool((scale == scale.reshape(-1)[0]).all()):
                    raise NotImplementedError(
                        f"KroneckerNormal folds the prior of layer '{layer.name}' into its Kronecker "
                        "factors, which needs one prior scale per weight site; "
                        f"'{model._latents[index].site}' has several. Use AutoNormal."
                    )
                shape = (layer.out_features, width)
                locs.append(loc.expand(model._latents[index].param.shape).reshape(shape))
                scales.append(scale.reshape(-1)[0].expand(shape))
            prior = torch.distributions.Normal(torch.cat(locs, -1), torch.cat(scales, -1))
            layers.append((layer, (weight, None if bias is None else bias[1], inputs, prior)))
        self._kronecker_cache = (key, layers)
        return layers

    def _read_guide(self, model, guide, x, y) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
        """
        The guide's unconstrained ``loc`` tensors, read by ``pyro.param``
        statements (which ``SVI.step`` records to hand them to the optimizer), its raw
        scale tensors, and
        :math:`\\sigma` of each site (detached, read-only): the one
        :class:`~pyro_ngvi.NGVI` remembers writing
        (:func:`~pyro_ngvi.scales.known_scale`), else the softplus of the raw
        scale, read from the param store directly (NGVI finds the raw tensors by
        name, and gets :math:`\\sigma` in the :class:`~pyro_ngvi.family.SiteCurvature`).
        """
        if guide.prototype_trace is None:
            guide(x, y)
        store = pyro.get_param_store()
        names = self._guide_names.get(id(guide))
        if names is None or names[0] != guide._pyro_name:
            prefix = guide._pyro_name
            names = self._guide_names[id(guide)] = (
                prefix, [f"{prefix}.locs.{w.site}" for w in model._latents],
                [f"{prefix}.scales.{w.site}" for w in model._latents])
        _, locs, scales = names
        params = store._params
        if not all(loc in params and scale in params for loc, scale in zip(locs, scales)):
            with guide._pyro_context:  # (re-)registers the guide's own tensors
                for w in model._latents:
                    guide._get_loc_and_scale(w.site)
        raws = [params[name] for name in scales]
        stddevs = []
        for name, raw in zip(scales, raws):
            stddev = known_scale(raw)
            if stddev is None:
                with torch.no_grad():
                    stddev = scale_transform(store._constraints[name])(raw.detach())
            stddevs.append(stddev)
        return [pyro.param(name).unconstrained() for name in locs], raws, stddevs

    def _sample_into_net(self, model, locs, stddevs, deterministic) -> Optional[List[torch.Tensor]]:
        """
        Draw :math:`\\epsilon` site by site, write :math:`w = \\mu + \\sigma\\epsilon`
        (:math:`\\mu` when ``deterministic``) straight into the net's weights; return
        the draws (``None`` when ``deterministic``).
        """
        with torch.no_grad():
            if deterministic:
                torch._foreach_copy_(model._latent_params, locs)
                return None
            noises = []
            for param, loc, stddev in zip(model._latent_params, locs, stddevs):
                noise = torch.empty_like(loc).normal_()
                torch.addcmul(loc, stddev, noise, out=param)
                noises.append(noise)
            return noises

    def _full_nll(self, model, nll, loss_scale, noise_scale, target, batch_size) -> torch.Tensor:
        """
        :math:`\\ell = \\frac{N}{B}(-\\sum_i \\log p(y_i \\mid f_i))` with constants, from the
        loss module's :math:`c \\cdot` batch sum ``nll``; for a learned Gaussian noise scale
        also sets its ``.grad`` to :math:`\\partial \\ell / \\partial` (unconstrained).
        """
        scale = model.effective_num_data / batch_size
        if noise_scale is None:
            return scale * nll
        # l = N/B [sse / (2 sigma^2) + B D (log sigma + log(2 pi) / 2)], sse = nll / c
        events = target.numel()
        if isinstance(noise_scale, torch.Tensor):
            sse = nll / loss_scale
            sigma_term = scale * (0.5 * sse / noise_scale**2 + events * noise_scale.log())
            if noise_scale.requires_grad:
                sigma_term.backward()
            sigma_term = sigma_term.detach()
        else:
            sigma_term = scale * (nll + events * math.log(noise_scale))
        return sigma_term + scale * events * _HALF_LOG_TWO_PI

    def _check_step(self, guide, y, curvature, deterministic):
        if curvature not in self.sources:
            raise ValueError(
                f"Curvature source {curvature!r} is not available on the BayesianNet "
                "fast path; supported: " + ", ".join(repr(c) for c in self.sources)
            )
        if curvature == "reparam" and deterministic:
            raise ValueError(
                "The 'reparam' curvature g * eps / sigma needs sampled weights; "
                "use deterministic=False or a curvature 'ef', 'ggn', 'ggn_mc'"
            )
        if y is None:
            raise ValueError("curvature_step needs the targets y")
        if not hasattr(guide, "_get_loc_and_scale") or not hasattr(guide, "prototype_trace"):
            raise NotImplementedError(
                f"The BayesianNet fast path needs an AutoNormal guide (or a KroneckerNormal), got "
                f"{type(guide).__name__}. For another guide, CurvatureELBO's traced path computes the "
                "statistics by autograd: give SVI a wrapper, model = lambda x, y=None: bnn(x, y), with "
                "model.statistics_hints = bnn.statistics_hints (the recipe's defaults and noise limit)"
            )

    @torch.no_grad()
    def _log_ratio(self, prior, weights, noises) -> torch.Tensor:
        """
        The sample-dependent part of :math:`\\log q(w) - \\log p_0(w)` at
        :math:`w = \\mu + \\sigma\\epsilon`, summed over sites:
        :math:`\\tfrac12 \\sum [\\lambda_0 (w - m_0)^2 - \\epsilon^2]`; the rest,
        :math:`\\sum [\\log s_0 - \\log\\sigma]`, does not depend on the sample.
        """
        if prior.norm_weights is not None:  # m_0 = 0, one lambda_0 per site: norms, one kernel each
            return prior.norm_weights.dot(torch.stack(torch._foreach_norm(list(weights) + noises)).square_())
        noise_square = torch.stack(torch._foreach_norm(noises)).square_().sum()
        total = sum(_quadratic(w, loc, precision) for w, (loc, precision) in zip(weights, prior.compact))
        return 0.5 * (total - noise_square)

    @torch.no_grad()
    def _kl(self, prior, locs, stddevs, log_scale) -> torch.Tensor:
        """
        :math:`\\sum_j \\mathrm{KL}(q_j \\| p_{0j})
        = \\sum [\\log(s_0/\\sigma) + \\lambda_0(\\sigma^2 + (\\mu - m_0)^2)/2 - 1/2]`
        over all sites; ``log_scale`` is :math:`\\sum \\log\\sigma`.
        """
        total, count = 0.0, 0
        for mean, stddev, (loc, precision) in zip(locs, stddevs, prior.compact):
            total = total + _quadratic(mean, loc, precision) + _quadratic(stddev, None, precision)
            count += mean.numel()
        return prior.log_scale_total - log_scale + 0.5 * (total - count)



#: Curvature source of a Kronecker guide -> BackPACK source.
_KRONECKER_SOURCES = {"ggn": "kflr", "ggn_mc": "kfac"}


def _keep_input(inputs: list):
    """A forward pre-hook that keeps the layer's (detached) input in ``inputs[0]``."""
    def hook(module, args):
        inputs[:] = [args[0].detach()]
    return hook


def _matrix_normal_kl(posterior, prior) -> torch.Tensor:
    """:math:`\\mathrm{KL}(\\mathcal{MN}(M, U, V) \\| \\prod \\mathcal{N}(m_{0}, s_0^2))
    = \\tfrac12 \\sum [\\lambda_0 (U_{ii} V_{jj} + (M - m_0)^2) - 1 + \\log(s_0^2)]
    - \\tfrac12 (p \\log\\det U + n \\log\\det V)`."""
    n, p = posterior.event_shape
    row_var = posterior.row_scale_tril.square().sum(-1)
    col_var = posterior.col_scale_tril.square().sum(-1)
    precision = prior.scale.pow(-2)
    second = torch.outer(row_var, col_var) + (posterior.loc - prior.loc).square()
    log_det = (2 * p * posterior.row_scale_tril.diagonal().log().sum()
               + 2 * n * posterior.col_scale_tril.diagonal().log().sum())
    return 0.5 * ((precision * second).sum() - n * p + 2 * prior.scale.log().sum() - log_det)


def _quadratic(w: torch.Tensor, loc: Optional[torch.Tensor], precision: torch.Tensor) -> torch.Tensor:
    """:math:`\\sum \\lambda_0 (w - m_0)^2` over a weight tensor, :math:`m_0` (``None``: 0)
    and :math:`\\lambda_0` broadcast to it: one dot product for a scalar prior."""
    deviation = w if loc is None else w - loc
    if precision.numel() == 1:
        flat = deviation.reshape(-1)
        return flat.dot(flat) * precision.reshape(())
    return deviation.square().mul_(precision).sum()


def _accumulate_grad(tensor: torch.Tensor, grad: torch.Tensor) -> None:
    if tensor.grad is None:
        tensor.grad = grad
    else:
        tensor.grad += grad

