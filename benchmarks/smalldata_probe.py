"""
Issue 26 probe (development; one task, one seed): a method on a ``harness.small_tasks`` (or
``harness.suite_tasks``) task, scored every ``--every`` epochs by the test NLL and ECE
(regression: -log-lik and 90 % coverage) of its predictive (32 draws), the share of weights
whose sigma sits at the noise limit's cap, and optionally:

* ``--kfac-laplace [ALPHA]``: the K-FAC Laplace approximation at the method's mean (for
  ``Linear`` / activation ``Sequential`` nets): per layer :math:`\\bar W = [W, b]` the
  generalised Gauss-Newton block :math:`\\approx G \\otimes A`, :math:`A = \\frac1N \\sum_n
  \\bar a_n \\bar a_n^\\top`, :math:`G = \\sum_n J_n^\\top H_n J_n` (the output Hessian's square
  root backpropagated, one pass per column), eigenvalues :math:`g_i a_j`, the prior precision
  :math:`\\alpha` per layer maximising the Laplace evidence
  :math:`\\log p(\\mathcal D \\mid \\mu) - \\frac{\\alpha}{2}\\lVert\\mu\\rVert^2 + \\frac12\\sum_{ij}
  \\log\\frac{\\alpha}{g_i a_j + \\alpha}` (MacKay's fixed point, Immer et al. 2021; or ALPHA
  given), and the test NLL of its linearised (GLM) predictive and of sampling the network;
* ``--evidence-prior BURN``: that evidence's :math:`\\alpha` written into the BayesianNet's
  prior (per layer, or one for the net with ``--pooled``) after every epoch from epoch BURN
  (mean-field guides only: a KroneckerNormal step keeps the prior it first read);
* ``--own-glm``: the GLM predictive of the method's own Gaussian (mean-field or K-FAC);
* ``--elbo``: the ELBO per datum on the training set (32 draws, closed-form KL to the model's
  prior); ``--samples``: the test NLL of 8, 32, 128 and 512 draws.

METHOD is a Python expression of ``task`` (and ``fan_in_prior``, ``recipe``), e.g.
``'recipe(task, 0.5)'`` (the recipe with prior N(0, 0.25)), ``'recipe(task, fan_in_prior(task, 2.0))'``
(prior variance 2 / fan-in), ``'harness.ngvi_kronecker(task, prior=0.5)'`` (noisy K-FAC),
``'harness.ngvi_recipe(task, "ggn", noise_limit=4.0)'``, ``'harness.MAP(task, prior_precision=4.0)'``.

Usage::

    TQDM_DISABLE=1 python benchmarks/smalldata_probe.py TASK EPOCHS SEED METHOD [--every 50] [options]
    e.g. python benchmarks/smalldata_probe.py synth4-200 300 0 'harness.ngvi_recipe(task, "ggn")' --kfac-laplace
"""

import argparse
import functools
import math
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from pyro_ngvi import NGVI, CurvatureELBO  # noqa: E402

import harness  # noqa: E402
import smalldata as sd  # noqa: E402


# ------------------------------------------------------------------ priors and methods
def fan_in_prior(task, c: float, bias=None):
    """Prior scale :math:`\\sqrt{c / n}` per ``Linear`` layer of fan-in :math:`n` (bias: the same, or ``bias``)."""
    prior = {}
    for name, module in task.make_net().named_modules():
        if isinstance(module, nn.Linear):
            scale = (c / module.in_features) ** 0.5
            prior[f"{name}.weight"], prior[f"{name}.bias"] = scale, scale if bias is None else bias
    return prior


def recipe(task, prior=None, **ngvi_args):
    """The recipe (``bnn.guide()``, ``NGVI(**ngvi_args)``, ``CurvatureELBO("ggn")``) with another prior."""
    return harness.PyroSVI(task, NGVI(**ngvi_args), CurvatureELBO("ggn"), None, "NGVI ggn", prior=prior)


# ------------------------------------------------------------------ K-FAC Laplace
def _bisect_precision(squared_norm: float, eigenvalues: torch.Tensor) -> float:
    """The root of :math:`\\alpha S = \\sum_k \\lambda_k / (\\lambda_k + \\alpha)` (bisection in log alpha)."""
    low, high = -30.0, 30.0
    for _ in range(100):
        middle = 0.5 * (low + high)
        alpha = math.exp(middle)
        if alpha * squared_norm > float((eigenvalues / (eigenvalues + alpha)).sum()):
            high = middle
        else:
            low = middle
    return math.exp(0.5 * (low + high))


class KFACLaplace:
    """The K-FAC Laplace approximation at ``weights`` (module docstring)."""

    def __init__(self, net, weights, x, y, likelihood, noise=None, num_data=None, alpha=None, pooled=False):
        self.net, self.means = net, {k: v.detach() for k, v in weights.items()}
        self.names = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
        factors, self.log_likelihood = self._factors(x, y, likelihood, noise, num_data or len(x))
        self.eig = []
        for a_factor, g_factor in factors:
            a, qa = torch.linalg.eigh(a_factor)
            g, qg = torch.linalg.eigh(g_factor)
            self.eig.append((a.clamp(min=0), qa, g.clamp(min=0), qg))
        eigenvalues = [(g[:, None] * a[None, :]).reshape(-1) for a, _, g, _ in self.eig]
        norms = [float(self.layer(n).double().square().sum()) for n in self.names]
        if alpha is None and pooled:
            alpha = _bisect_precision(sum(norms), torch.cat(eigenvalues))
        self.alphas = [alpha if alpha is not None else _bisect_precision(s, e) for s, e in zip(norms, eigenvalues)]
        self.log_evidence = self.log_likelihood + sum(
            -0.5 * al * s + 0.5 * float(torch.log(al / (e + al)).sum())
            for al, s, e in zip(self.alphas, norms, eigenvalues))

    def layer(self, name):
        return torch.cat([self.means[f"{name}.weight"], self.means[f"{name}.bias"].unsqueeze(-1)], -1)

    def _factors(self, x, y, likelihood, noise, num_data):
        weights = {k: v.clone().requires_grad_() for k, v in self.means.items()}
        kept, h = [], x
        for name, module in self.net.named_children():
            if isinstance(module, nn.Linear):
                z = F.linear(h, weights[f"{name}.weight"], weights[f"{name}.bias"])
                z.retain_grad()
                kept.append((h.detach(), z))
                h = z
            else:
                h = module(h)
        out = h
        if likelihood == "categorical":  # H = diag(p) - p p^T = L L^T, L = diag(sqrt p) - p sqrt(p)^T
            p = out.detach().softmax(-1)
            root = torch.diag_embed(p.sqrt()) - p.unsqueeze(-1) * p.sqrt().unsqueeze(-2)
            columns = [root[:, :, k] for k in range(p.shape[-1])]
            nll = F.cross_entropy(out, y, reduction="sum")
        elif likelihood == "bernoulli":
            p = out.detach().sigmoid()
            columns = [(p * (1 - p)).sqrt()]
            nll = F.binary_cross_entropy_with_logits(out.squeeze(-1), y, reduction="sum")
        else:
            columns = [torch.full_like(out, 1.0 / float(noise))]
            nll = (0.5 * ((y - out.squeeze(-1)) / noise) ** 2 + math.log(noise) + 0.5 * math.log(2 * math.pi)).sum()
        g_factors = [0.0] * len(kept)
        for column in columns:
            for _, z in kept:
                z.grad = None
            out.backward(column, retain_graph=True)
            g_factors = [g + z.grad.T @ z.grad for g, (_, z) in zip(g_factors, kept)]
        scale = num_data / len(x)
        factors = []
        for (a, _), g in zip(kept, g_factors):
            a = torch.cat([a, torch.ones_like(a[:, :1])], -1)
            factors.append(((a.T @ a / len(x)).double(), (g * scale).double()))
        return factors, -float(nll.detach()) * scale

    def draw(self, generator):
        """One draw of :math:`w - \\mu`, per layer :math:`Q_G (Z / \\sqrt{g a^\\top + \\alpha}) Q_A^\\top`."""
        deltas = {}
        for name, (a, qa, g, qg), alpha in zip(self.names, self.eig, self.alphas):
            z = torch.randn(len(g), len(a), generator=generator, dtype=torch.float64)
            delta = (qg @ (z / (g[:, None] * a[None, :] + alpha).sqrt()) @ qa.T).float()
            deltas[f"{name}.weight"], deltas[f"{name}.bias"] = delta[:, :-1], delta[:, -1]
        return deltas

    def outputs(self, x, samples, generator, linear=True):
        return perturbed_outputs(self.net, self.means, self.draw, x, samples, generator, linear)


def perturbed_outputs(net, means, draw, x, samples, generator, linear=True):
    """``(S, B, ...)`` outputs at ``means + draw(generator)``, or of the network linearised at the
    means (one forward-mode derivative per draw)."""
    names = list(means)
    fixed = {k: v.detach() for k, v in net.named_parameters() if k not in means}

    def f(*ws):
        return functional_call(net, {**fixed, **dict(zip(names, ws))}, (x,))

    primals = tuple(means[n] for n in names)
    outputs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(samples):
            delta = draw(generator)
            tangents = tuple(delta[n] for n in names)
            if linear:
                value, change = jvp(f, primals, tangents)
                outputs.append(value + change)
            else:
                outputs.append(f(*[p + t for p, t in zip(primals, tangents)]))
    return torch.stack(outputs)


def own_glm_outputs(method, x, samples, generator):
    """The GLM predictive of the method's own Gaussian: whole matrix-normal layers for K-FAC."""
    if isinstance(method, harness.KroneckerSVI):
        layers = method._layers()
        means = {}
        for layer, law in layers:
            means.update(method.guide._split(layer, law.loc.detach(), sample=False))

        def draw(g):
            deltas = {}
            for layer, law in layers:
                z = torch.randn(law.loc.shape, generator=g, dtype=law.loc.dtype)
                deltas.update(method.guide._split(layer, law.row_scale_tril @ z @ law.col_scale_tril.T, sample=False))
            return deltas
    else:
        posterior = method.posterior()
        means = {k: v[0] for k, v in posterior.items() if v[1] is not None}

        def draw(g):
            return {k: posterior[k][1] * torch.randn(posterior[k][0].shape, generator=g) for k in means}
    return perturbed_outputs(method.net, means, draw, x, samples, generator)


def method_means(method):
    posterior = method.posterior()
    if posterior is None:
        return {k: v.detach() for k, v in method.net.named_parameters()}
    return {k: v[0] for k, v in posterior.items()}


# ------------------------------------------------------------------ the probe
def method_of(expression: str, task) -> harness.Method:
    """The method a probe's command line names (a Python expression over ``harness``, ``task``,
    :func:`recipe` and :func:`fan_in_prior`)."""
    return eval(expression, {"harness": harness, "task": task, "recipe": recipe, "fan_in_prior": fan_in_prior})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task")
    parser.add_argument("epochs", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("method")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--kfac-laplace", nargs="?", const="evidence", default=None, metavar="ALPHA")
    parser.add_argument("--evidence-prior", type=int, default=None, metavar="BURN")
    parser.add_argument("--pooled", action="store_true")
    parser.add_argument("--own-glm", action="store_true")
    parser.add_argument("--elbo", action="store_true")
    parser.add_argument("--samples", action="store_true")
    args = parser.parse_args()
    start = time.time()
    with harness.probe(args.task, args.seed) as task:
        method = method_of(args.method, task)
        split = task.split
        if args.evidence_prior is not None:
            def set_prior(steps_taken):
                laplace = KFACLaplace(method.net, method_means(method), split.x_train, split.y_train,
                                      task.likelihood, method.noise_scale, task.num_data, pooled=args.pooled)
                method.bnn.set_prior({f"{n}.{p}": a ** -0.5 for n, a in zip(laplace.names, laplace.alphas)
                                      for p in ("weight", "bias")})
                method.alphas = laplace.alphas

            harness.after_epochs(method, task, args.evidence_prior, set_prior)

        generator = functools.partial(sd.generator, task)
        metrics = functools.partial(sd.test_scores, task, method)

        def evaluate(m, epoch):
            scores, bounds = sd.score(task, m), sd.bounds(m)
            line = f"{args.task} {epoch:4d} nll {sd.nll_of(task, scores):.4f}"
            line += (f" ece {scores['ece']:.4f} acc {scores['accuracy']:.3f}" if "ece" in scores
                     else f" rmse {scores['rmse']:.3f} cov90 {scores['coverage90']:.2f}")
            line += f" ood {scores['ood_auroc']:.3f}" if "ood_auroc" in scores else ""
            line += f" cap {bounds['at_cap']:.2f} sigma/cap {bounds['sigma_over_cap']:.2f}" if bounds else ""
            line += " alpha " + " ".join(f"{a:.3g}" for a in m.alphas) if hasattr(m, "alphas") else ""
            with m.active():
                if args.elbo and m.posterior() is not None:
                    outputs = m.predict(split.x_train, 32, torch.Generator().manual_seed(1))
                    log_lik = -float(harness.nll(task.likelihood, outputs, split.y_train, m.noise_scale).sum()) / 32
                    kl = 0.0
                    for site, (mu, sigma) in m.posterior().items():
                        if sigma is not None:
                            m0, s0 = m.bnn.prior(site)
                            r = (sigma / s0).square()
                            kl += float((0.5 * (r + ((mu - m0) / s0).square() - 1 - r.log())).sum())
                    line += f" elbo/N {(log_lik - kl) / task.num_data:.4f} (kl/N {kl / task.num_data:.4f})"
                print(line, f"[{time.time() - start:.0f} s]", flush=True)
                if args.samples:
                    print("    samples " + " ".join(f"{s}: {metrics(m.predict(split.x_test, s, generator()))}"
                                                for s in (8, 32, 128, 512)), flush=True)
                if args.own_glm:
                    print(f"    own GLM {metrics(own_glm_outputs(m, split.x_test, 32, generator()))}", flush=True)
                if args.kfac_laplace:
                    alpha = None if args.kfac_laplace == "evidence" else float(args.kfac_laplace)
                    laplace = KFACLaplace(m.net, method_means(m), split.x_train, split.y_train, task.likelihood,
                                          m.noise_scale, task.num_data, alpha=alpha, pooled=args.pooled)
                    print(f"    K-FAC Laplace: GLM {metrics(laplace.outputs(split.x_test, 32, generator()))}; "
                          f"sampled net {metrics(laplace.outputs(split.x_test, 32, generator(), linear=False))}; "
                          f"log evidence {laplace.log_evidence:.1f}; alpha "
                          + " ".join(f"{a:.3g}" for a in laplace.alphas), flush=True)

        harness.fit_every(method, args.epochs, args.every, evaluate)


if __name__ == "__main__":
    main()
