"""
Steps (and seconds) to Pyro's own tolerances: ``NGVI()`` with no arguments against
``pyro.optim.ClippedAdam`` with Pyro's learning-rate decay, on ports of the kinds
of models Pyro's autoguide tests train.

Each model is a port (our own code) of a kind of test in Pyro 1.9's test suite,
with the guide, ELBO, number of particles, number of steps and tolerances that
test uses:

==============  ========================================================  =======================
model           Pyro test it follows                                      guide, particles, steps
==============  ========================================================  =======================
exact           ``test_autoguide.py::test_exact`` (Normal-Normal)         AutoNormal, 100, 500
exact_batch     ``test_autoguide.py::test_exact_batch`` (3 local latents) AutoNormal, 100, 500
exact_tree      ``test_autoguide.py::test_exact_tree`` (x, y[2])          AutoNormal, 100, 500
diag_gaussians  ``autoguide/test_inference.py::test_auto_diagonal_gaus..``  AutoDiagonalNormal, 1, 3501
transform       ``autoguide/test_inference.py::test_auto_transform``      AutoDiagonalNormal, 1, 3500
conditioned     a ``poutine.condition`` -ed Normal model, posterior far
                from the guide's start (``init_scale`` 0.1 vs std ~1)     AutoNormal, 1, 100
predictive      ``test_predictive.py::test_posterior_predictive_svi_``
                ``auto_diag_normal_guide`` (conditioned Binomial)         AutoDiagonalNormal, 1, 1000
==============  ========================================================  =======================

Tolerances are Pyro's (mean ``atol`` 0.05, std ``rtol`` 0.05, ELBO ``atol`` 0.01 for the
exact models; ``prec`` 0.05 / 0.08 and 0.04 for the diagonal and transformed
Gaussians; ``rtol`` 0.05 on the posterior predictive count), evaluated in closed form
from the guide's parameters (no sampling noise in the check): the ELBO gap is the
exact KL from the guide to the posterior, the predictive mean is computed by
Gauss-Hermite quadrature, and targets are the exact posterior (or, for the
predictive, the exact posterior predictive mean, so that the data draw cannot decide
the outcome). A run *reaches* the tolerance at the first step from which the check
holds at every later step of the test's run; runs that end outside count as the
test's step count + 1 ("never").

Adam: ``ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / num_steps)})`` (Pyro's decay, as
in ``test_exact``) for lr in a grid including the test's own; the table lists
the best setting per model (fewest median steps). ``NGVI()`` takes no argument.

Usage::

    python benchmarks/autoguide.py [--seeds 5] [--only NAME ...] [--out benchmarks/results/autoguide.md]

Imports only pyro, torch and pyro_ngvi (no shared harness).
"""

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_ngvi import NGVI

import measure

ADAM_LRS = (0.001, 0.01, 0.05, 0.1, 0.3)



def gauss_hermite(n: int = 64) -> Tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of E[f(Z)], Z ~ N(0, 1) (probabilists' Hermite, Golub-Welsch)."""
    k = torch.arange(1, n, dtype=torch.float64)
    jacobi = torch.diag(k.sqrt(), 1) + torch.diag(k.sqrt(), -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return nodes, vectors[0] ** 2


def normal_kl(m, s, m0, s0) -> torch.Tensor:
    """KL(N(m, s^2) || N(m0, s0^2)), summed."""
    return (torch.log(s0 / s) + (s**2 + (m - m0) ** 2) / (2 * s0**2) - 0.5).sum()


# ------------------------------------------------------------------ problems
@dataclass
class Problem:
    """A model, its data and guide, the test's ELBO settings and its check."""

    name: str
    model: Callable
    args: Tuple
    guide: Callable  # model -> guide
    particles: int
    steps: int
    adam_lr: float  # the learning rate the Pyro test uses
    check: Callable[[object], bool]  # guide -> within the test's tolerances


def exact_problem(seed: int) -> Problem:
    def model(data):
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)

    data = torch.randn(3, generator=torch.Generator().manual_seed(seed))
    mean = data.sum() / 4
    std = torch.tensor(0.5)

    def check(guide):
        loc, scale = _autonormal(guide, "loc")
        return bool((loc - mean).abs() < 0.05 and (scale / std - 1).abs() < 0.05
                    and normal_kl(loc, scale, mean, std) < 0.01)

    return Problem("exact", model, (data,), AutoNormal, 100, 500, 0.05, check)


def exact_batch_problem(seed: int) -> Problem:
    def model(data):
        with pyro.plate("data", len(data)):
            loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)

    data = torch.randn(3, generator=torch.Generator().manual_seed(seed))
    mean, std = data / 2, torch.full((3,), 0.5**0.5)

    def check(guide):
        loc, scale = _autonormal(guide, "loc")
        return bool(((loc - mean).abs() < 0.05).all() and ((scale / std - 1).abs() < 0.05).all()
                    and normal_kl(loc, scale, mean, std) < 0.01)

    return Problem("exact_batch", model, (data,), AutoNormal, 100, 500, 0.05, check)


def exact_tree_problem(seed: int) -> Problem:
    def model(data):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(data)):
            y = pyro.sample("y", dist.Normal(x, 1.0))
            pyro.sample("obs", dist.Normal(y, 1.0), obs=data)

    data = torch.randn(2, generator=torch.Generator().manual_seed(seed))
    # joint precision of (x, y1, y2) given the data; the mean-field optimum has the exact means
    precision = torch.tensor([[3.0, -1.0, -1.0], [-1.0, 2.0, 0.0], [-1.0, 0.0, 2.0]])
    mean = torch.linalg.solve(precision, torch.cat([torch.zeros(1), data]))

    def check(guide):  # Pyro checks the means only for a mean-field guide
        x, _ = _autonormal(guide, "x")
        y, _ = _autonormal(guide, "y")
        return bool((torch.cat([x.reshape(1), y]) - mean).abs().max() < 0.05)

    return Problem("exact_tree", model, (data,), AutoNormal, 100, 500, 0.05, check)


def diag_gaussians_problem(seed: int) -> Problem:
    def model():
        pyro.sample("x", dist.Normal(-0.2, 1.2))
        pyro.sample("y", dist.Normal(0.2, 0.7))

    def check(guide):
        loc, scale = _diagonal(guide)
        return bool((loc - torch.tensor([-0.2, 0.2])).abs().max() < 0.05
                    and (scale - torch.tensor([1.2, 0.7])).abs().max() < 0.08)

    return Problem("diag_gaussians", model, (), AutoDiagonalNormal, 1, 3501, 0.001, check)


def transform_problem(seed: int) -> Problem:
    def model():
        pyro.sample("x", dist.LogNormal(0.2, 0.7))

    def check(guide):
        loc, scale = _diagonal(guide)
        return bool((loc - 0.2).abs().max() < 0.04 and (scale - 0.7).abs().max() < 0.04)

    return Problem("transform", model, (), AutoDiagonalNormal, 1, 3500, 0.001, check)


def conditioned_problem(seed: int) -> Problem:
    def generative():
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        return pyro.sample("obs", dist.Normal(loc, 1.0))

    obs = 5.0 + torch.randn((), generator=torch.Generator().manual_seed(seed))
    model = poutine.condition(generative, data={"obs": obs})
    precision = 1.0 + 1.0 / 100
    mean, std = obs / precision, torch.tensor(precision**-0.5)

    def check(guide):  # within 10 % of the posterior mean and std
        loc, scale = _autonormal(guide, "loc")
        return bool((loc - mean).abs() < 0.1 * mean.abs() and (scale / std - 1).abs() < 0.1)

    return Problem("conditioned", model, (), AutoNormal, 1, 100, 0.1, check)


def predictive_problem(seed: int) -> Problem:
    def generative(num_trials):
        with pyro.plate("data", num_trials.size(0)):
            phi = pyro.sample("phi", dist.Uniform(0.0, 1.0))
            return pyro.sample("obs", dist.Binomial(num_trials, phi))

    num_trials = torch.full((5,), 1000.0)
    gen = torch.Generator().manual_seed(seed)
    successes = torch.binomial(num_trials, torch.full((5,), 0.7), generator=gen)
    model = poutine.condition(generative, data={"obs": successes})
    exact = num_trials * (successes + 1) / (num_trials + 2)  # Beta(k + 1, n - k + 1) mean
    nodes, weights = gauss_hermite()

    def check(guide):  # E[n sigmoid(u)] under the guide, against the exact predictive mean
        loc, scale = _diagonal(guide)
        u = loc.double()[:, None] + scale.double()[:, None] * nodes
        predicted = num_trials.double() * (torch.sigmoid(u) @ weights)
        return bool(((predicted - exact).abs() < 0.05 * exact).all())

    return Problem("predictive", model, (num_trials,), AutoDiagonalNormal, 1, 1000, 0.1, check)


PROBLEMS = {
    "exact": exact_problem,
    "exact_batch": exact_batch_problem,
    "exact_tree": exact_tree_problem,
    "diag_gaussians": diag_gaussians_problem,
    "transform": transform_problem,
    "conditioned": conditioned_problem,
    "predictive": predictive_problem,
}


def _autonormal(guide, site):
    loc, scale = guide._get_loc_and_scale(site)
    return loc.detach(), scale.detach()


def _diagonal(guide):
    loc, scale = guide._loc_scale()
    return loc.detach(), scale.detach()


# ------------------------------------------------------------------ running
def methods(problem: Problem, ngvi_only: bool = False, ngvi_args: Optional[Dict] = None) -> Dict[str, Callable]:
    found = {"NGVI()": lambda: NGVI(**(ngvi_args or {}))}
    if ngvi_only:
        return found
    lrs = sorted(set(ADAM_LRS) | {problem.adam_lr})
    for lr in lrs:
        own = " (test's lr)" if lr == problem.adam_lr else ""
        found[f"ClippedAdam lr {lr}{own}"] = (
            lambda lr=lr: pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / problem.steps)}))
    return found


def steps_to_tolerance(problem: Problem, make_optim: Callable, seed: int) -> Tuple[int, float]:
    """First step from which the check holds to the end of the test's run; and seconds."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = problem.guide(problem.model)
    elbo = Trace_ELBO(num_particles=problem.particles, vectorize_particles=problem.particles > 1,
                      max_plate_nesting=1)
    svi = SVI(problem.model, guide, make_optim(), elbo)
    reached, seconds, elapsed = None, 0.0, 0.0
    for step in range(1, problem.steps + 1):
        start = time.perf_counter()
        svi.step(*problem.args)
        elapsed += time.perf_counter() - start
        if problem.check(guide):
            if reached is None:
                reached, seconds = step, elapsed
        else:
            reached = None
    if reached is None:
        return problem.steps + 1, elapsed
    return reached, seconds


def fmt(steps: float, cap: int) -> str:
    return f">{cap}" if steps > cap else f"{steps:g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--ngvi-only", action="store_true", help="skip the Adam runs (a quick look)")
    parser.add_argument("--ngvi", default="", help="NGVI keyword arguments, e.g. lr=0.5,beta=0.2 "
                        "(for experiments; the table is about NGVI())")
    args = parser.parse_args()
    ngvi_args = {k: float(v) for k, v in (kv.split("=") for kv in args.ngvi.split(",") if kv)}
    torch.set_num_threads(1)
    pyro.enable_validation(False)

    lines = [
        f"Steps to Pyro's tolerances (median over seeds 0-{args.seeds - 1}; per seed in brackets) "
        "and wall-clock seconds to reach them (median); '>N': still outside at the test's last "
        "step N. Best Adam: the ClippedAdam learning rate with the fewest median steps "
        "(Pyro's decay lrd = 0.1 ** (1 / steps)). Ratio: NGVI() steps / best Adam steps.",
        "",
        "| model | guide, particles, steps | NGVI() steps | NGVI() s | best ClippedAdam | its steps "
        "| its s | Adam at the test's lr | steps ratio | target <= 0.5 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    for name in args.only:
        results = {}
        for label, make in methods(PROBLEMS[name](0), args.ngvi_only, ngvi_args).items():
            runs = [steps_to_tolerance(PROBLEMS[name](seed), make, seed) for seed in range(args.seeds)]
            results[label] = runs
            print(f"  {name} | {label}: {[r[0] for r in runs]}", flush=True)
        problem = PROBLEMS[name](0)
        median = {label: statistics.median(r[0] for r in runs) for label, runs in results.items()}
        secs = {label: statistics.median(r[1] for r in runs) for label, runs in results.items()}
        adams = [label for label in results if label != "NGVI()"]
        if not adams:
            continue
        best = min(adams, key=lambda label: (median[label], secs[label]))
        own = next(label for label in adams if "test's lr" in label)
        ratio = median["NGVI()"] / median[best]
        cap = problem.steps
        per_seed = ", ".join(fmt(r[0], cap) for r in results["NGVI()"])
        best_seed = ", ".join(fmt(r[0], cap) for r in results[best])
        lines.append(
            f"| {name} | {problem.guide.__name__}, {problem.particles}, {cap} "
            f"| {fmt(median['NGVI()'], cap)} ({per_seed}) | {secs['NGVI()']:.2f} "
            f"| {best.replace(' (test' + chr(39) + 's lr)', '')} | {fmt(median[best], cap)} ({best_seed}) "
            f"| {secs[best]:.2f} | {fmt(median[own], cap)} | {ratio:.2f} "
            f"| {'met' if ratio <= 0.5 else 'NOT met'} |"
        )
    measure.publish("\n".join(lines), started, args.out)


if __name__ == "__main__":
    main()
