"""
Issue 26, third attempt (development probe; one task, one seed): the recipe trained as usual (or
METHOD, a Python expression of ``task`` as in ``smalldata_probe.py``), and every ``--every``
epochs the test NLL / ECE (regression: -log-lik / 90 % coverage) of its own predictive (32 draws)
and of last-layer predictives at its guide (``--variants``):

* ``LL``: the hidden layers drawn from the guide, the last layer ``[W, b]`` (vectorised row-major)
  from the full-covariance Laplace-GGN Gaussian at the guide's mean, precision :math:`\\alpha I + G`,
  :math:`G = \\sum_n \\Lambda_n \\otimes \\bar\\phi_n \\bar\\phi_n^\\top` (:math:`\\Lambda_n` the
  output Hessian of the NLL, :math:`\\bar\\phi_n = [\\phi_n, 1]` the last layer's input) averaged over
  ``--ggn-draws`` draws of the hidden weights, :math:`\\alpha` by the layer's Laplace evidence
  (MacKay's fixed point :math:`\\alpha \\lVert m \\rVert^2 = \\sum_i g_i / (g_i + \\alpha)`, ``g`` the
  eigenvalues of ``G``) or ``--alpha``. Logits are linear in ``[W, b]`` given the features, so
  drawing the weights is the layer's linearised (GLM) predictive, exactly;
* ``LLmean``: the same with ``G`` at the hidden means, predicting with the hidden weights drawn
  and (``hid@mean``) at their means; ``LLa1``: ``LL`` with :math:`\\alpha = 1`, the model's prior;
* ``GLM``: the last layer re-fitted as a Bayesian GLM on the features (their means, or the
  draws: the expected NLL), mode and :math:`\\alpha` by MacKay's iteration (``--learn-noise``: a
  Gaussian likelihood's noise too), Laplace at the mode; ``mode``: the mode without its variance.

``--ll-prior BURN`` writes the last layer's ``LL`` evidence alpha into its prior (weight and
bias) after every epoch from epoch BURN (``--ll-prior-draws 0``: from the hidden means).

Usage::

    TQDM_DISABLE=1 python benchmarks/lastlayer_probe.py TASK EPOCHS SEED [METHOD] [--every 50]
        [--variants LL,GLM] [--ll-prior 10]
"""

import argparse
import functools
import math
import os
import sys
import time

import torch
from torch import nn
from torch.func import functional_call

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from smalldata_probe import _bisect_precision, method_of  # noqa: E402


def last_linear(net):
    """The name and module of the network's last ``Linear`` (taken as the output layer)."""
    name, module = [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear)][-1]
    return name, module


def features_and_outputs(net, weights, x):
    """The last layer's input (with a column of ones) and the network's output at ``weights``."""
    _, last = last_linear(net)
    kept = {}
    handle = last.register_forward_hook(lambda m, inp, out: kept.update(phi=inp[0]))
    try:
        out = functional_call(net, weights, (x,))
    finally:
        handle.remove()
    phi = kept["phi"]
    return torch.cat([phi, torch.ones_like(phi[:, :1])], -1), out


def output_hessian(likelihood, out, noise=None):
    """:math:`\\Lambda_n`, ``(N, K, K)``."""
    if likelihood == "categorical":
        p = out.softmax(-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    if likelihood == "bernoulli":
        p = out.sigmoid()
        return (p * (1 - p)).unsqueeze(-1)
    return torch.full((len(out), 1, 1), 1.0 / float(noise) ** 2)


def draw_hidden(posterior, last_name, generator, hidden_mean=False):
    weights = {}
    for k, (mu, sd_) in posterior.items():
        if k.startswith(last_name + ".") or sd_ is None or hidden_mean:
            weights[k] = mu
        else:
            weights[k] = mu + sd_ * torch.randn(mu.shape, generator=generator, dtype=mu.dtype)
    return weights


def last_layer_ggn(likelihood, phi, out, noise=None):
    """:math:`\\sum_n \\Lambda_n \\otimes \\bar\\phi_n \\bar\\phi_n^\\top`, ``(K (H+1), K (H+1))``, by matmuls."""
    if likelihood == "categorical":
        p = out.softmax(-1)
        K = p.shape[-1]
        blocks = torch.block_diag(*[(phi * p[:, k:k + 1]).T @ phi for k in range(K)])
        u = (p.unsqueeze(-1) * phi.unsqueeze(-2)).reshape(len(phi), -1)
        return blocks - u.T @ u
    if likelihood == "bernoulli":
        p = out[:, :1].sigmoid()
        return (phi * (p * (1 - p))).T @ phi
    return phi.T @ phi / float(noise) ** 2


class LastLayerLaplace:
    def __init__(self, net, posterior, x, y, likelihood, noise, num_data, ggn_draws=0, alpha=None, seed=1):
        self.net, self.posterior, self.likelihood = net, posterior, likelihood
        self.last_name, last = last_linear(net)
        self.m = torch.cat([posterior[f"{self.last_name}.weight"][0], posterior[f"{self.last_name}.bias"][0][:, None]],
                           -1).double()  # (K, H+1)
        K, H1 = self.m.shape
        g = torch.Generator().manual_seed(seed)
        reps = max(1, ggn_draws)
        phis, outs = [], []
        with torch.no_grad():
            for _ in range(reps):
                weights = draw_hidden(posterior, self.last_name, g, hidden_mean=ggn_draws == 0)
                phi, out = features_and_outputs(net, weights, x)
                phis.append(phi.double())
                outs.append(out.double())
        G = last_layer_ggn(likelihood, torch.cat(phis), torch.cat(outs), noise)
        G *= num_data / len(x) / reps
        e, Q = torch.linalg.eigh(G)
        self.e, self.Q = e.clamp(min=0), Q
        norm = float(self.m.square().sum())
        self.alpha = alpha if alpha is not None else _bisect_precision(norm, self.e)
        self.gamma = float((self.e / (self.e + self.alpha)).sum())
        self.shape = (K, H1)

    def draw_last(self, generator):
        z = torch.randn(len(self.e), generator=generator, dtype=torch.float64)
        w = self.m.reshape(-1) + self.Q @ (z / (self.e + self.alpha).sqrt())
        w = w.reshape(self.shape).float()
        return {f"{self.last_name}.weight": w[:, :-1], f"{self.last_name}.bias": w[:, -1]}

    @torch.no_grad()
    def outputs(self, x, samples, generator, hidden_mean=False):
        outs = []
        for _ in range(samples):
            weights = draw_hidden(self.posterior, self.last_name, generator, hidden_mean)
            weights.update(self.draw_last(generator))
            outs.append(functional_call(self.net, weights, (x,)))
        return torch.stack(outs)


def glm_terms(likelihood, w, phis, y, noise):
    """Objective (NLL averaged over the feature draws), gradient (K, H1) and GGN (P, P) of the last layer."""
    K, H1 = w.shape
    value, grad, ggn = 0.0, torch.zeros_like(w), torch.zeros(K * H1, K * H1, dtype=w.dtype)
    for phi in phis:
        out = phi @ w.T
        if likelihood == "categorical":
            logp = out.log_softmax(-1)
            value -= float(logp.gather(-1, y[:, None]).sum())
            p = logp.exp()
            r = p - torch.nn.functional.one_hot(y, K).to(p)
        elif likelihood == "bernoulli":
            f = out[:, 0]
            value += float(torch.nn.functional.binary_cross_entropy_with_logits(f, y.to(f), reduction="sum"))
            p = f.sigmoid()
            r = (p - y.to(p))[:, None]
        else:
            r = (out[:, 0] - y.to(out))[:, None] / noise**2
            value += float(0.5 * (r[:, 0] * noise).square().sum())
        grad += r.T @ phi
        lam = output_hessian(likelihood, out, noise).to(w.dtype)
        ggn += torch.einsum("nkl,nj,ni->kjli", lam, phi, phi).reshape(K * H1, K * H1)
    S = len(phis)
    return value / S, grad / S, ggn / S


class LastLayerGLM:
    """The last layer re-fitted as a Bayesian GLM on the features (hidden weights drawn from the
    recipe's Gaussian, ``draws`` of them, or at their means): the mode of the expected NLL plus
    alpha / 2 |w|^2, alpha by MacKay's fixed point, the Laplace-GGN precision at the mode."""

    def __init__(self, net, posterior, x, y, likelihood, noise, num_data, draws=8, seed=1, iters=100,
                 alpha=None, learn_noise=False):
        self.net, self.posterior, self.likelihood = net, posterior, likelihood
        self.last_name, _ = last_linear(net)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            phis = [features_and_outputs(net, draw_hidden(posterior, self.last_name, g, draws == 0), x)[0].double()
                    for _ in range(max(draws, 1))]
        w = torch.cat([posterior[f"{self.last_name}.weight"][0], posterior[f"{self.last_name}.bias"][0][:, None]],
                      -1).double()
        self.w0 = w.clone()
        y = y if likelihood == "categorical" else y.double()
        fixed_alpha = alpha is not None
        alpha = 1.0 if alpha is None else alpha
        noise = None if noise is None else float(noise)
        K, H1 = w.shape
        eye = torch.eye(K * H1, dtype=torch.float64)
        for it in range(iters):
            value, grad, ggn = glm_terms(likelihood, w, phis, y, noise)
            obj = value + 0.5 * alpha * float(w.square().sum())
            grad = grad + alpha * w
            step = torch.linalg.solve(ggn + alpha * eye, grad.reshape(-1)).reshape(K, H1)
            t = 1.0
            while t > 1e-4:
                new = w - t * step
                nv = glm_terms(likelihood, new, phis, y, noise)[0] + 0.5 * alpha * float(new.square().sum())
                if nv <= obj + 1e-10:
                    break
                t *= 0.5
            w = new
            e = torch.linalg.eigvalsh(ggn).clamp(min=0)
            if not fixed_alpha:
                alpha = _bisect_precision(float(w.square().sum()), e)
            gamma = float((e / (e + alpha)).sum())
            if learn_noise and likelihood == "gaussian":
                resid = sum(float((phi @ w[0] - y).square().sum()) for phi in phis) / len(phis)
                noise = math.sqrt(resid / max(len(y) - gamma, 1.0))
            if float(step.abs().max()) * t < 1e-6 and it > 5:
                break
        _, _, ggn = glm_terms(likelihood, w, phis, y, noise)
        e, Q = torch.linalg.eigh(ggn)
        self.e, self.Q, self.m, self.alpha, self.noise = e.clamp(min=0), Q, w, alpha, noise
        self.gamma = float((self.e / (self.e + alpha)).sum())
        self.shape = (K, H1)
        self.iters = it + 1

    draw_last = LastLayerLaplace.draw_last
    outputs = LastLayerLaplace.outputs


def last_layer_variants(args, task, m, metrics, gen):
    """The predictives of ``--variants`` at the method's guide now, as text."""
    split, posterior, text = task.split, m.posterior(), ""
    names = args.variants.split(",")

    def laplace(draws, alpha):
        return LastLayerLaplace(m.net, posterior, split.x_train, split.y_train, task.likelihood,
                                m.noise_scale, task.num_data, ggn_draws=draws, alpha=alpha)

    if "LL" in names:  # G averaged over draws of the hidden weights, alpha by the evidence (or --alpha)
        la = laplace(args.ggn_draws, args.alpha)
        text += (f" | LL@E{args.ggn_draws} a {la.alpha:.3g} g {la.gamma:.0f}: "
                 f"{metrics(la.outputs(split.x_test, 32, gen()))}")
    if "LLmean" in names:  # G at the hidden means; predicting with the hidden weights drawn, or at their means
        la = laplace(0, args.alpha)
        text += (f" | LL@mean a {la.alpha:.3g} g {la.gamma:.0f}: {metrics(la.outputs(split.x_test, 32, gen()))}"
                 f" hid@mean {metrics(la.outputs(split.x_test, 32, gen(), hidden_mean=True))}")
    if "LLa1" in names:  # alpha = 1, the model's own prior
        la = laplace(args.ggn_draws, 1.0)
        text += f" | LL a=1 g {la.gamma:.0f}: {metrics(la.outputs(split.x_test, 32, gen()))}"
    if "GLM" in names:  # the last layer re-fitted (mode and alpha by MacKay's iteration)
        for label, draws in (("GLM@mean", 0), (f"GLM@E{args.ggn_draws}", args.ggn_draws)):
            la = LastLayerGLM(m.net, posterior, split.x_train, split.y_train, task.likelihood, m.noise_scale,
                              task.num_data, draws=draws, alpha=args.alpha, learn_noise=args.learn_noise)
            shift = float((la.m - la.w0).norm() / la.w0.norm())
            text += f" | {label} a {la.alpha:.3g} g {la.gamma:.0f} it {la.iters} dw {shift:.2f}"
            if la.noise is not None:
                text += f" sig {la.noise:.3f}/{m.noise_scale:.3f}"
            text += f": {metrics(la.outputs(split.x_test, 32, gen()))}"
            if draws == 0:
                text += f" hid@mean {metrics(la.outputs(split.x_test, 32, gen(), hidden_mean=True))}"
            else:  # the re-fitted mode alone (no last-layer variance)
                e, la.e = la.e, la.e + 1e12
                text += f" mode {metrics(la.outputs(split.x_test, 32, gen()))}"
                la.e = e
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task")
    parser.add_argument("epochs", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("method", nargs="?", default='harness.ngvi_recipe(task, "ggn")')
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--ggn-draws", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None, help="fix alpha (default: the evidence's)")
    parser.add_argument("--learn-noise", action="store_true", help="GLM: the noise scale by MacKay's update too")
    parser.add_argument("--ll-prior", type=int, default=None, metavar="BURN",
                        help="write the last layer's evidence alpha into its prior every epoch from BURN")
    parser.add_argument("--ll-prior-draws", type=int, default=8, help="hidden draws of that evidence (0: means)")
    parser.add_argument("--variants", default="LL,GLM", help="comma-separated: LL, LLmean, LLa1, GLM")
    args = parser.parse_args()
    start = time.time()
    with harness.probe(args.task, args.seed) as task:
        method = method_of(args.method, task)
        split = task.split
        if args.ll_prior is not None:
            def set_prior(steps_taken):
                with method.active():
                    la = LastLayerLaplace(method.net, method.posterior(), split.x_train, split.y_train,
                                          task.likelihood, method.noise_scale, task.num_data,
                                          ggn_draws=args.ll_prior_draws, seed=steps_taken)
                prior = {site: method.bnn.prior(site) for site in method.bnn.latent_sites}
                prior[f"{la.last_name}.weight"] = prior[f"{la.last_name}.bias"] = la.alpha ** -0.5
                method.bnn.set_prior(prior)
                method.ll_alpha = la.alpha

            harness.after_epochs(method, task, args.ll_prior, set_prior)

        gen = functools.partial(sd.generator, task)
        metrics = functools.partial(sd.test_scores, task, method)

        def evaluate(m, epoch):
            with m.active():
                line = f"{args.task} s{args.seed} {epoch:4d} recipe {metrics(m.predict(split.x_test, 32, gen()))}"
                if hasattr(m, "ll_alpha"):
                    line += f" (prior alpha {m.ll_alpha:.3g})"
                line += last_layer_variants(args, task, m, metrics, gen)
                print(line, f"[{time.time() - start:.0f} s]", flush=True)

        harness.fit_every(method, args.epochs, args.every, evaluate)


if __name__ == "__main__":
    main()
