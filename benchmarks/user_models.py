"""
Issue 23's two user models: steps to 0.1 posterior standard deviation of the exact means.

``regression``: a ``PyroModule[nn.Linear]`` Bayesian linear regression on the standardised
diabetes data (scikit-learn's ``load_diabetes``, 442 x 10, strongly correlated features),
weight ~ N(0, 1), bias ~ N(0, 10), a learned noise scale sigma ~ Uniform(0, 10) (as in Pyro's
Bayesian regression tutorial), an ``AutoNormal`` guide. Exact posterior means (and standard
deviations) of the weights, the bias and sigma's unconstrained coordinate u = logit(sigma / 10)
by quadrature over sigma of the conjugate posterior given sigma (one dimension; a 4,000-point
grid); with ``--nuts``, NUTS (``pyro.infer.MCMC``) as a second reference.

``hierarchical``: 1,000 groups, 5 observations each, theta_g ~ N(mu, 1), y ~ N(theta_g, 1),
mu ~ N(0, 10); minibatches of 100 groups (the plate subsampled by index, the guide
``AutoNormal(model, create_plates=...)`` on the same indices); data simulated from known
values. Exact Gaussian posterior in closed form.

Criterion: max over all latent coordinates of |guide mean - exact mean| / exact sd <= 0.1, from
the first step where it holds and keeps holding (checked every ``--every`` steps) up to
``--steps``. Optimizers: ``NGVI()`` with ``Trace_ELBO``; recipe (b), ``NGVI(lr=1, beta=1)`` with
``CurvatureELBO("hessian", deterministic=True)``; ``ClippedAdam`` with Pyro's decay
(``lrd = 0.1 ** (1 / steps)``) for each lr of a grid.

Usage::

    python benchmarks/user_models.py [--only regression hierarchical] [--steps 2000] [--nuts]
        [--out benchmarks/results/user_models.md]
"""

import argparse
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

from pyro_ngvi import NGVI, CurvatureELBO

import measure

ADAM_LRS = (0.003, 0.01, 0.03, 0.1, 0.3)


# ------------------------------------------------------------------ the regression
def diabetes() -> Tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float64)
    y = torch.tensor(y, dtype=torch.float64)
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


class Regression(PyroModule):
    """The user's model: a PyroModule linear layer with priors, and a noise scale."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](features, 1).double()
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(torch.tensor(0.0, dtype=x.dtype), 10.0))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


def regression_exact(x, y, grid: int = 4000) -> Tuple[torch.Tensor, torch.Tensor]:
    """Posterior means and sds of (weight (10), bias, u = logit(sigma / 10)) by quadrature over
    sigma of the Gaussian posterior of (weight, bias) given sigma (prior N(0, diag(1, 100))):
    p(sigma | y) from the marginal N(y; 0, X P X^T + sigma^2 I), whose eigen-decomposition is
    computed once."""
    n, d = x.shape
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    prior_var = torch.cat([torch.ones(d, dtype=x.dtype), torch.tensor([100.0], dtype=x.dtype)])
    gram, xty = design.T @ design, design.T @ y
    values, vectors = torch.linalg.eigh(design @ torch.diag(prior_var) @ design.T)
    rotated = (vectors.T @ y) ** 2
    sigmas = torch.linspace(0.5, 1.0, grid, dtype=x.dtype)  # the posterior sits near 0.7
    total = values[None, :] + sigmas[:, None] ** 2
    log_post = -0.5 * (total.log().sum(1) + (rotated / total).sum(1))  # Uniform prior: flat
    weights = (log_post - log_post.logsumexp(0)).exp()
    assert weights[0] < 1e-12 and weights[-1] < 1e-12, "the sigma grid does not cover the posterior"
    precisions = gram / sigmas[:, None, None] ** 2 + torch.diag(1 / prior_var)
    covs = torch.linalg.inv(precisions)
    means = (covs @ xty) / sigmas[:, None] ** 2
    mean = (weights[:, None] * means).sum(0)
    second = (weights[:, None] * (covs.diagonal(dim1=1, dim2=2) + means**2)).sum(0)
    u = torch.logit(sigmas / 10)
    u_mean = (weights * u).sum()
    u_sd = (weights * (u - u_mean) ** 2).sum().sqrt()
    return torch.cat([mean, u_mean[None]]), torch.cat([(second - mean**2).sqrt(), u_sd[None]])


def regression_nuts(x, y, samples: int = 1000) -> Tuple[torch.Tensor, torch.Tensor]:
    from pyro.infer import MCMC, NUTS

    pyro.set_rng_seed(0)
    model = Regression(x.shape[1])
    mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=samples, disable_progbar=True)
    mcmc.run(x, y)
    draws = mcmc.get_samples()
    flat = torch.cat([draws["linear.weight"].reshape(samples, -1), draws["linear.bias"].reshape(samples, -1),
                      torch.logit(draws["sigma"].reshape(samples, 1) / 10)], 1)
    return flat.mean(0), flat.std(0)


def regression_problem():
    x, y = diabetes()
    exact_mean, exact_sd = regression_exact(x, y)

    def make_model():
        return Regression(x.shape[1])

    def guide_means(guide):
        store = pyro.get_param_store()
        return torch.cat([store["AutoNormal.locs.linear.weight"].detach().reshape(-1),
                          store["AutoNormal.locs.linear.bias"].detach().reshape(-1),
                          store["AutoNormal.locs.sigma"].detach().reshape(-1)])

    return dict(make_model=make_model, args=lambda step: (x, y), guide=lambda m: AutoNormal(m),
                means=guide_means, exact=(exact_mean, exact_sd), data=(x, y))


# ------------------------------------------------------------------ the hierarchical model
GROUPS, PER_GROUP, BATCH = 1000, 5, 100


def hierarchical_model(y, idx):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), 10.0))
    with pyro.plate("groups", GROUPS, subsample=idx):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        with pyro.plate("obs", PER_GROUP, dim=-2):
            pyro.sample("y", dist.Normal(theta, 1.0), obs=y[:, idx])


def hierarchical_exact(y) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact posterior of (mu, theta) (all Gaussian): mu's from the group means'
    marginal N(mu, 1 + 1/J); theta_g's given mu by shrinkage, averaged over mu."""
    means = y.mean(0)
    var_bar = 1.0 + 1.0 / PER_GROUP
    mu_precision = 1 / 100.0 + GROUPS / var_bar
    mu_mean = (means.sum() / var_bar) / mu_precision
    shrink = 1.0 / (1.0 + PER_GROUP)  # weight of mu in E[theta | mu, y]: prior precision 1, data J
    theta_mean = shrink * mu_mean + (1 - shrink) * means
    theta_var = 1.0 / (1.0 + PER_GROUP) + shrink**2 / mu_precision
    mean = torch.cat([mu_mean[None], theta_mean])
    sd = torch.cat([torch.tensor([mu_precision**-0.5]), torch.full((GROUPS,), theta_var**0.5)]).double()
    return mean, sd


def hierarchical_problem():
    g = torch.Generator().manual_seed(0)
    mu_true = 3.0
    theta = mu_true + torch.randn(GROUPS, generator=g, dtype=torch.float64)
    y = theta + torch.randn(PER_GROUP, GROUPS, generator=g, dtype=torch.float64)
    exact_mean, exact_sd = hierarchical_exact(y)
    order = torch.Generator().manual_seed(1)
    batches: List[torch.Tensor] = []

    def args(step):
        while len(batches) <= step:  # epochs of a fixed random order, the same for every method
            batches.extend(torch.randperm(GROUPS, generator=order).split(BATCH))
        return y, batches[step]

    def guide(model):
        return AutoNormal(model, create_plates=lambda y, idx: pyro.plate("groups", GROUPS, subsample=idx))

    def guide_means(_):
        store = pyro.get_param_store()
        return torch.cat([store["AutoNormal.locs.mu"].detach().reshape(-1),
                          store["AutoNormal.locs.theta"].detach().reshape(-1)])

    return dict(make_model=lambda: hierarchical_model, args=args, guide=guide, means=guide_means,
                exact=(exact_mean, exact_sd), data=(y,))


# ------------------------------------------------------------------ runs
def run(problem, optim, elbo, steps: int, every: int, seed: int = 0) -> Tuple[Optional[int], float]:
    """Steps until max |mean - exact| / sd <= 0.1 holds and keeps holding (checked every
    ``every`` steps), and the final max error in sds."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = problem["make_model"]()
    guide = problem["guide"](model)
    svi = SVI(model, guide, optim, elbo)
    mean, sd = problem["exact"]
    entry, error = None, math.inf
    for step in range(steps):
        svi.step(*problem["args"](step))
        if (step + 1) % every == 0:
            error = float(((problem["means"](guide) - mean) / sd).abs().max())
            if error <= 0.1:
                entry = entry or step + 1
            else:
                entry = None
    return entry, error


def methods(steps: int) -> Dict[str, Callable]:
    found = {
        "NGVI() Trace_ELBO": lambda: (NGVI(), Trace_ELBO()),
        "recipe (b) hessian, lr = beta = 1": lambda: (NGVI(lr=1.0, beta=1.0),
                                                      CurvatureELBO("hessian", deterministic=True)),
    }
    for lr in ADAM_LRS:
        found[f"ClippedAdam lr {lr:g}"] = (lambda lr=lr: (pyro.optim.ClippedAdam(
            {"lr": lr, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO()))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["regression", "hierarchical"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nuts", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    started = time.perf_counter()
    problems = {"regression": regression_problem, "hierarchical": hierarchical_problem}
    lines = [f"Steps to max |mean - exact| / sd <= 0.1 (checked every {args.every} steps; '>{args.steps}': "
             f"never within {args.steps}), and the final max error in posterior sds.", ""]
    for name in args.only:
        problem = problems[name]()
        lines += [f"### {name}", ""]
        if name == "regression" and args.nuts:
            nuts_mean, nuts_sd = regression_nuts(*problem["data"])
            mean, sd = problem["exact"]
            lines += [f"NUTS (1000 + 1000) against quadrature: max |mean difference| / sd "
                      f"{float(((nuts_mean - mean) / sd).abs().max()):.3f}, sd ratio "
                      f"{float((nuts_sd / sd).min()):.3f} .. {float((nuts_sd / sd).max()):.3f}", ""]
        lines += ["| method | steps to 0.1 sd | final max error (sd) |", "|---|---|---|"]
        results = {}
        for label, make in methods(args.steps).items():
            optim, elbo = make()
            entry, error = run(problem, optim, elbo, args.steps, args.every)
            results[label] = (entry, error)
            shown = f">{args.steps}" if entry is None else str(entry)
            lines.append(f"| {label} | {shown} | {error:.3f} |")
            print(lines[-1], flush=True)
        lines.append("")
    measure.publish("\n".join(lines), started, args.out)


if __name__ == "__main__":
    main()
