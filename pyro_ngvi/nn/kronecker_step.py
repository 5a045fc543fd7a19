"""
The fast path of a :class:`~pyro_ngvi.BayesianNet` with a
:class:`~pyro_ngvi.kronecker.KroneckerNormal` guide: per layer

.. math:: \\bar W = M + L_U Z L_V^\\top \\ (M \\text{ when deterministic}), \\qquad
          G = \\tfrac{N}{B} \\sum_i G_i, \\qquad
          \\hat A = \\tfrac1B \\sum_i \\bar a_i \\bar a_i^\\top,

:math:`\\bar W = [W, b]` written into the net, one backward pass under BackPACK's
``KFLR`` (``curvature="ggn"``) or ``KFAC`` (``"ggn_mc"``) (on a plain MLP the same factors in closed
form, :mod:`pyro_ngvi.curvature.mlp`) giving
:math:`\\nabla_{\\bar W}\\ell` and the output factor :math:`G`, the input factor from
the layer's inputs (a column of ones for the bias); averaged over particles and
attached to each layer's ``loc`` as a
:class:`~pyro_ngvi.kronecker.KroneckerCurvature` with the layer's element-wise
Normal prior.
"""

import torch

import pyro

from ..curvature.backpack import network_curvature
from ..family import attach_curvature
from ..kronecker import KroneckerCurvature
from .twin import accumulate_grad
from .value import full_nll, matrix_normal_kl

#: Curvature source of a Kronecker guide -> BackPACK source.
KRONECKER_SOURCES = {"ggn": "kflr", "ggn_mc": "kfac"}


class KroneckerStep:
    """
    One ELBO step of a :class:`~pyro_ngvi.BayesianNet` with a KroneckerNormal guide,
    on the network's BackPACK twin (``BackpackTwin`` (``pyro_ngvi.nn.twin``)).
    """

    def __init__(self, twin):
        self.twin = twin
        self._layer_inputs = {}  # id(net's Linear) -> [its latest input], for Kronecker factors
        self._cache = None

    def __call__(self, model, guide, x, y, curvature, num_particles, deterministic, mc_samples) -> torch.Tensor:
        """:meth:`pyro_ngvi.BayesianNet.curvature_step` for a KroneckerNormal guide; returns
        the negative ELBO estimate (particle average of :math:`\\ell + \\log q - \\log p_0`;
        ``deterministic``: :math:`\\ell(M) + \\mathrm{KL}(q \\| p_0)`)."""
        if curvature not in KRONECKER_SOURCES:
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
        model._check_batch(x, y, step=True)
        twin = self.twin
        layers = self._layers(model, guide, x, y)
        # the param store's tensors (a store restored in place too: the guide takes them up, wrapping
        # plain tensors as Parameters, before the locs are read)
        with torch.no_grad(), guide._pyro_context:
            posteriors = [guide.get_layer(layer.name) for layer, _ in layers]
        locs = [pyro.param(f"{guide._pyro_name}.locs.{layer.name}") for layer, _ in layers]
        points, noise_scale, loss_scale = twin.begin(model)
        target = twin.loss_target(model, y)
        source = KRONECKER_SOURCES[curvature]
        sums = None
        nll, log_ratio = 0.0, 0.0
        for _ in range(num_particles):
            values, log_q = self._sample_into_net(layers, locs, posteriors, deterministic)
            result = network_curvature(twin.twin, twin.loss_module, x, target, source,
                                       mc_samples=mc_samples, loss_scale=loss_scale, params=twin.params)
            particle = []
            for layer, (weight, bias, inputs, _) in layers:
                grad = result.grads[weight.index]
                # (the closed form of a plain MLP returns the inputs; BackPACK's pass fires the hook)
                activations = inputs[0] if result.inputs is None else result.inputs[weight.index]
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
            accumulate_grad(value.unconstrained(), grad.mul_(factor))
        nll = full_nll(model.effective_num_data, nll / num_particles, loss_scale, noise_scale, target, len(x))
        if deterministic:
            with torch.no_grad():
                kl = sum(matrix_normal_kl(posterior, prior) for posterior, (_, (_, _, _, prior))
                         in zip(posteriors, layers))
            return (nll + kl).detach()
        return (nll + log_ratio / num_particles).detach()

    @torch.no_grad()
    def _sample_into_net(self, layers, locs, posteriors, deterministic):
        """Draw each layer's :math:`\\bar W` (as ``MatrixNormal.rsample`` draws it; ``M``
        when ``deterministic``) into the net; return the draws and :math:`\\sum \\log q`."""
        values, log_q = [], 0.0
        for (layer, (weight, bias, _, _)), loc, posterior in zip(layers, locs, posteriors):
            if deterministic:
                value = loc.detach()
            else:
                noise = torch.randn(loc.shape, dtype=loc.dtype, device=loc.device)
                value = posterior.transform(noise)
                log_q = log_q + posterior.noise_log_prob(noise)
            weight.param.copy_(value[:, : layer.in_features])
            if bias is not None:
                bias.param.copy_(value[:, layer.in_features])
            values.append(value)
        return values, log_q

    def _layers(self, model, guide, x, y):
        """``[(layer, (weight, bias, inputs, prior))]``: the model's
        :class:`~pyro_ngvi.nn.weights.Weight` s of each layer of the guide, a list the
        twin's layer writes its input into (one forward pre-hook per layer, registered
        once) and the layer's prior as an element-wise ``Normal`` over :math:`\\bar W`,
        columns ``[W, b]``."""
        if guide.prototype_trace is None:
            guide(x, y)
        store = pyro.get_param_store()
        names = [f"{guide._pyro_name}.locs.{layer.name}" for layer in guide.layers]
        if not all(name in store for name in names):
            with guide._pyro_context:  # (re-)registers the guide's own tensors
                for layer in guide.layers:
                    guide.get_layer(layer.name)
        key = (id(model), id(guide), model._prior_version)  # (a new prior: set_prior, .to(), ...)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        by_site = {w.site: (j, w) for j, w in enumerate(model._latents)}
        twin_of = {id(module): twin_module for twin_module, module in self.twin.module_pairs}
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
        self._cache = (key, layers)
        return layers


def _keep_input(inputs: list):
    """A forward pre-hook that keeps the layer's (detached) input in ``inputs[0]`` (the closed
    form of a plain MLP, which runs no module, may skip it: the step then reads the inputs it
    returns, :attr:`~pyro_ngvi.curvature.backpack.NetworkCurvature.inputs`)."""
    def hook(module, args):
        inputs[:] = [args[0].detach()]
    hook.closed_form_reads_inputs = True
    return hook
