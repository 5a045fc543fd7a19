"""
How NGVI's default ``lr`` and ``beta`` (and the adaptive-step thresholds) were picked:
steps to the mean-field optimum on a *tuning* set of small models that are not the
ones ``benchmarks/autoguide.py`` and ``benchmarks/conjugate.py`` report on.

Models (all with a mean-field optimum computed by Gauss-Hermite quadrature and
L-BFGS, so the reference has no Monte-Carlo noise):

* ``gamma_poisson``: rate ~ Gamma(3, 2), six Poisson counts (positive site, log scale);
* ``beta_binomial``: p ~ Beta(2, 2), 7 successes of 20 (interval site, logit scale);
* ``normal_unknown_scale``: loc ~ N(0, 5), sigma ~ LogNormal(0, 1), 20 observations;
* ``logistic``: logistic regression with two weights, prior N(0, 1), 40 points.

Each runs with ``AutoNormal`` and ``Trace_ELBO`` with K = 1 (600 steps) and K = 16
(200 steps), seeds 0-2. A run reaches the optimum at the first step from which every
coordinate stays within 0.1 optimal standard deviations (mean) and 10 % (scale) to the
end of the run. The score of a setting is the geometric mean of the steps over all
runs (a run that never reaches it counts as its length + 1).

Usage::

    python benchmarks/tune_defaults.py [--lr 0.1 0.3 ...] [--beta 0.05 0.1 ...] [--seeds 3]
"""

import argparse
import itertools
import math
import time
from typing import Callable, Dict, List, Tuple

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI

torch.set_default_dtype(torch.float64)
NODES = 24


def gauss_hermite(n: int = NODES) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of E[f(Z)], Z ~ N(0, 1) (Golub-Welsch)."""
    k = torch.arange(1, n, dtype=torch.float64)
    nodes, vectors = torch.linalg.eigh(torch.diag(k.sqrt(), 1) + torch.diag(k.sqrt(), -1))
    return nodes, vectors[0] ** 2


# ---------------------------------------------------------------- tuning models
# each: (pyro model, args, {site: size}, log joint in unconstrained coordinates u[..., D])
def gamma_poisson():
    counts = torch.tensor([2.0, 0.0, 3.0, 1.0, 4.0, 2.0])

    def model(counts):
        rate = pyro.sample("rate", dist.Gamma(3.0, 2.0))
        with pyro.plate("data", len(counts)):
            pyro.sample("obs", dist.Poisson(rate), obs=counts)

    def log_joint(u):
        rate = u[..., 0].exp()
        return (dist.Gamma(3.0, 2.0).log_prob(rate) + u[..., 0]
                + dist.Poisson(rate.unsqueeze(-1)).log_prob(counts).sum(-1))

    return model, (counts,), {"rate": 1}, log_joint


def beta_binomial():
    def model():
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        pyro.sample("obs", dist.Binomial(20, p), obs=torch.tensor(7.0))

    def log_joint(u):
        p = torch.sigmoid(u[..., 0])
        jacobian = torch.nn.functional.logsigmoid(u[..., 0]) + torch.nn.functional.logsigmoid(-u[..., 0])
        return dist.Beta(2.0, 2.0).log_prob(p) + jacobian + dist.Binomial(20, p).log_prob(torch.tensor(7.0))

    return model, (), {"p": 1}, log_joint


def normal_unknown_scale():
    y = 1.5 + 0.8 * torch.randn(20, generator=torch.Generator().manual_seed(11))

    def model(y):
        loc = pyro.sample("loc", dist.Normal(0.0, 5.0))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(loc, sigma), obs=y)

    def log_joint(u):
        loc, log_sigma = u[..., 0], u[..., 1]
        sigma = log_sigma.exp()
        return (dist.Normal(0.0, 5.0).log_prob(loc) + dist.Normal(0.0, 1.0).log_prob(log_sigma)
                + dist.Normal(loc.unsqueeze(-1), sigma.unsqueeze(-1)).log_prob(y).sum(-1))

    return model, (y,), {"loc": 1, "sigma": 1}, log_joint


def logistic():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 2, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -1.0])), generator=g)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Bernoulli(logits=(w * x).sum(-1)), obs=y)

    def log_joint(u):
        logits = u @ x.T
        return (dist.Normal(0.0, 1.0).log_prob(u).sum(-1)
                + dist.Bernoulli(logits=logits).log_prob(y).sum(-1))

    return model, (x, y), {"w": 2}, log_joint


MODELS = {f.__name__: f for f in (gamma_poisson, beta_binomial, normal_unknown_scale, logistic)}


def mean_field_optimum(log_joint: Callable, dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """argmax over (m, s) of E_q[log p(u)] + sum log s, q = prod N(m_i, s_i^2), by tensor-product
    Gauss-Hermite quadrature (NODES per dimension) and L-BFGS."""
    nodes, weights = gauss_hermite()
    grid = torch.cartesian_prod(*[nodes] * dim).reshape(-1, dim)
    w = torch.ones(()) if dim == 0 else torch.cartesian_prod(*[weights] * dim).reshape(-1, dim).prod(-1)
    m = torch.zeros(dim, requires_grad=True)
    log_s = torch.full((dim,), -1.0, requires_grad=True)
    opt = torch.optim.LBFGS([m, log_s], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -((w * log_joint(m + log_s.exp() * grid)).sum() + log_s.sum())
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return m.detach(), log_s.exp().detach()


# ---------------------------------------------------------------- runs
def steps_to_optimum(name: str, make_optim: Callable, particles: int, steps: int, seed: int,
                     optimum) -> int:
    model, args, sizes, _ = MODELS[name]()
    m_star, s_star = optimum
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    svi = SVI(model, guide, make_optim(),
              Trace_ELBO(num_particles=particles, vectorize_particles=particles > 1, max_plate_nesting=1))
    reached = None
    for step in range(1, steps + 1):
        svi.step(*args)
        with torch.no_grad():
            locs, scales = zip(*(guide._get_loc_and_scale(site) for site in sizes))
            loc = torch.cat([t.reshape(-1) for t in locs])
            scale = torch.cat([t.reshape(-1) for t in scales])
            ok = bool(((loc - m_star).abs() < 0.1 * s_star).all() and ((scale / s_star - 1).abs() < 0.1).all())
        if ok and reached is None:
            reached = step
        elif not ok:
            reached = None
    return steps + 1 if reached is None else reached


# ---------------------------------------------------------------- the point optimizer's lr
def point_models():
    """Tuning models for the point optimizer (``pyro.param`` values beside a Gaussian site):
    a noise scale and an offset; a Poisson intercept. Each with its maximum-likelihood
    values (reference: 3000 steps of Adam lr 0.01 from the same start)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, generator=g)
    y = 0.7 - 1.3 * x + 0.4 * torch.randn(200, generator=g)
    counts = torch.poisson((0.5 + 0.8 * x).exp(), generator=g)

    def noise_offset(x, y):
        offset = pyro.param("offset", torch.tensor(0.0))
        noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
        slope = pyro.sample("slope", dist.Normal(0.0, 5.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(offset + slope * x, noise), obs=y)

    def poisson_intercept(x, counts):
        intercept = pyro.param("intercept", torch.tensor(0.0))
        slope = pyro.sample("slope", dist.Normal(0.0, 5.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Poisson((intercept + slope * x).exp()), obs=counts)

    return {"noise_offset": (noise_offset, (x, y), ("offset", "noise")),
            "poisson_intercept": (poisson_intercept, (x, counts), ("intercept",))}


def point_steps(model, args, names, point_lr, seed, reference, steps=1500, tolerance=0.05) -> int:
    """Steps until every point parameter stays within ``tolerance`` (of max(1, |value|)) of
    ``reference`` to the end of the run."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    svi = SVI(model, guide, NGVI(point_optim_args={"lr": point_lr}), Trace_ELBO())
    reached = None
    for step in range(1, steps + 1):
        svi.step(*args)
        ok = all(abs(float(pyro.param(n)) - reference[n]) < tolerance * max(1.0, abs(reference[n]))
                 for n in names)
        reached = (reached or step) if ok else None
    return steps + 1 if reached is None else reached


def tune_point_lr(lrs, seeds):
    for name, (model, args, names) in point_models().items():
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        svi = SVI(model, guide, NGVI(point_optim_args={"lr": 0.01}),
                  Trace_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=1))
        for _ in range(3000):
            svi.step(*args)
        reference = {n: float(pyro.param(n).detach()) for n in names}
        print(f"{name}: reference {reference}")
        for lr in lrs:
            runs = [point_steps(model, args, names, lr, seed, reference) for seed in range(seeds)]
            print(f"  point lr {lr}: steps to 5 % {runs}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--lr", type=float, nargs="*", default=[0.1, 0.3, 0.5, 1.0])
    parser.add_argument("--beta", type=float, nargs="*", default=[0.05, 0.1, 0.2, 0.3, 0.5])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--point", type=float, nargs="*",
                        help="instead: tune the point optimizer's lr over these values")
    parser.add_argument("--set", nargs="*", default=[],
                        help="pyro_ngvi.optim module constants to override, e.g. _STALL_Z2=2")
    args = parser.parse_args()
    import pyro_ngvi.optim

    if args.point:
        tune_point_lr(args.point, args.seeds)
        return
    for assignment in args.set:
        name, value = assignment.split("=")
        setattr(pyro_ngvi.optim, name, float(value))
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    optima = {}
    for name in args.models:
        _, _, sizes, log_joint = MODELS[name]()
        optima[name] = mean_field_optimum(log_joint, sum(sizes.values()))
        print(f"{name}: mean-field optimum m = {optima[name][0].tolist()}, s = {optima[name][1].tolist()}")
    started = time.perf_counter()
    scores: Dict[Tuple[float, float], float] = {}
    for lr, beta in itertools.product(args.lr, args.beta):
        results: List[int] = []
        line = []
        for name in args.models:
            for particles, steps in ((1, 600), (16, 200)):
                runs = [steps_to_optimum(name, lambda: NGVI(lr=lr, beta=beta, averaging=True), particles, steps, seed,
                                         optima[name]) for seed in range(args.seeds)]
                results += runs
                line.append(f"{name}/K{particles}: {runs}")
        scores[(lr, beta)] = math.exp(sum(math.log(r) for r in results) / len(results))
        print(f"lr {lr}, beta {beta}: geometric mean {scores[(lr, beta)]:.1f} steps | " + "; ".join(line),
              flush=True)
    best = min(scores, key=scores.get)
    print(f"\nbest: lr {best[0]}, beta {best[1]} ({scores[best]:.1f} steps; "
          f"total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
