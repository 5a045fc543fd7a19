"""
Steps and time per step to the exact mean-field optimum on two conjugate models.

Every method runs on Pyro's own ``SVI`` with ``AutoNormal``. A run has *converged* at
the first step after which every coordinate of the guide satisfies
``|loc - m| < 0.01 * std`` and ``|scale / std - 1| < 0.01`` and keeps satisfying it for
the next ``CONFIRM`` steps; ``(m, std)`` is the exact mean-field optimum (the posterior
mean, and ``diag(posterior precision) ** -0.5``).

Models:

* Normal-Normal: ``loc ~ N(0, 1)``, three observations ``N(loc, 1)``.
* Linear regression, ``D = 5``, ``n = 200``, known noise 0.5, features with
  correlation 0.3, prior ``N(0, 1)``.

Methods: ``NGVI()`` with no arguments on the sampled path, with
``Trace_ELBO(num_particles=K, vectorize_particles=True)`` (the ``K`` of the Adam grid,
where no draw can be recovered from the averaged gradients) and with one particle
(the draw is recovered and the control variate applies), and with
``CurvatureELBO("reparam")`` (one draw, or one antithetic pair); NGVI with
``CurvatureELBO("hessian", deterministic=True)`` (exact curvature at the mean: diagonal
Newton steps, no sampling); ``pyro.optim.Adam`` over a learning-rate grid and
``pyro.optim.ClippedAdam`` with a learning-rate decay, with ``K`` particles (and the
best ClippedAdam setting with one). Time per step is measured separately, all methods
of a model interleaved in blocks (so that load from other processes hits them alike),
after a warm-up.

Usage::

    python benchmarks/conjugate.py [--seeds N] [--max-steps M] [--particles K] [--out FILE.md]
"""

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO

import measure
from measure import steps_until

TOLERANCE = 0.01  # 1 %
SKIPPED = -1  # seed not run: more than half the seeds already failed
CONFIRM = 20  # steps the criterion must keep holding after the first entry
DTYPE = torch.float64


# ------------------------------------------------------------------ models
@dataclass
class Problem:
    name: str
    model: Callable
    args: Tuple
    site: str
    mean: torch.Tensor  # mean-field optimum, flattened
    std: torch.Tensor


def normal_normal(data):
    loc = pyro.sample("loc", dist.Normal(torch.tensor(0.0, dtype=DTYPE), 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


def normal_normal_problem() -> Problem:
    data = torch.tensor([0.3, 1.2, -0.5], dtype=DTYPE)
    n = len(data)
    mean = data.sum() / (n + 1)  # posterior N(sum x / (n + 1), 1 / (n + 1))
    std = torch.tensor((n + 1) ** -0.5, dtype=DTYPE)
    return Problem("Normal-Normal", normal_normal, (data,), "loc", mean.reshape(1), std.reshape(1))


def linear_regression(x, y, noise=0.5):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal((x * w).sum(-1), noise), obs=y)


def regression_problem(n=200, d=5, noise=0.5, correlation=0.3, seed=0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    cov = (1 - correlation) * torch.eye(d, dtype=DTYPE) + correlation
    x = torch.randn(n, d, generator=g, dtype=DTYPE) @ torch.linalg.cholesky(cov).T
    w = torch.randn(d, generator=g, dtype=DTYPE)
    y = x @ w + noise * torch.randn(n, generator=g, dtype=DTYPE)
    precision = x.T @ x / noise**2 + torch.eye(d, dtype=DTYPE)  # prior N(0, 1)
    mean = torch.linalg.solve(precision, x.T @ y / noise**2)
    std = precision.diagonal().rsqrt()  # mean-field optimum: diag(precision) ** -0.5
    return Problem(f"Linear regression (D={d})", linear_regression, (x, y), "w", mean, std)


# ------------------------------------------------------------------ methods
def trace_elbo(particles: int) -> Callable:
    return lambda: Trace_ELBO(num_particles=particles, vectorize_particles=particles > 1, max_plate_nesting=1)


# Exact curvature at the mean ("OGN" mode): a diagonal Newton step on a quadratic. On a
# single site lr = 1 is exact; on the correlated design it is a Jacobi iteration, stable for
# lr < 2 / lambda_max(D^-1 A) (about 0.9 here), fastest near 2 / (lambda_min + lambda_max).
NEWTON_LR = 0.7
NEWTON_LABEL = f"NGVI + CurvatureELBO('hessian', deterministic=True), lr {NEWTON_LR}, beta 1"


def methods(particles: int) -> Dict[str, Tuple[Callable, Callable]]:
    """Label -> (optimizer factory, loss factory); NGVI's rows first (NGVI() has no arguments)."""
    found = {
        f"NGVI() + Trace_ELBO (K = {particles})": (NGVI, trace_elbo(particles)),
        "NGVI() + Trace_ELBO (K = 1)": (NGVI, trace_elbo(1)),
        "NGVI() + CurvatureELBO('reparam') (K = 1)": (
            NGVI, lambda: CurvatureELBO("reparam", max_plate_nesting=1)),
        "NGVI() + CurvatureELBO('reparam', antithetic=True) (1 pair)": (
            NGVI, lambda: CurvatureELBO("reparam", antithetic=True, max_plate_nesting=1)),
        NEWTON_LABEL: (
            lambda: NGVI(lr=NEWTON_LR, beta=1.0),
            lambda: CurvatureELBO("hessian", deterministic=True, max_plate_nesting=1),
        ),
    }
    for lr in (0.001, 0.01, 0.1):
        found[f"Adam lr={lr} (K = {particles})"] = (lambda lr=lr: pyro.optim.Adam({"lr": lr}), trace_elbo(particles))
    for lr in (0.01, 0.1):
        found[f"ClippedAdam lr={lr}, lrd=0.999 (K = {particles})"] = (
            lambda lr=lr: pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.999}), trace_elbo(particles))
    found["ClippedAdam lr=0.01, lrd=0.999 (K = 1)"] = (
        lambda: pyro.optim.ClippedAdam({"lr": 0.01, "lrd": 0.999}), trace_elbo(1))
    return found


def is_ngvi(label: str) -> bool:
    return label.startswith("NGVI")


# ------------------------------------------------------------------ measuring
def make_svi(problem: Problem, method: Tuple[Callable, Callable]) -> SVI:
    make_optim, make_loss = method
    return SVI(problem.model, AutoNormal(problem.model), make_optim(), make_loss())


def within_tolerance(problem: Problem) -> bool:
    store = pyro.get_param_store()
    with torch.no_grad():
        loc = store[f"AutoNormal.locs.{problem.site}"].reshape(-1)
        scale = store[f"AutoNormal.scales.{problem.site}"].reshape(-1)
        return bool(
            ((loc - problem.mean).abs() < TOLERANCE * problem.std).all()
            and ((scale / problem.std - 1).abs() < TOLERANCE).all()
        )


def steps_to_tolerance(problem, method, seed, max_steps) -> Optional[int]:
    """First step from which the criterion holds for CONFIRM more steps; None if never."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svi = make_svi(problem, method)
    return steps_until(lambda: svi.step(*problem.args), lambda: within_tolerance(problem), max_steps, CONFIRM)


def ms_per_step(problem, makers: Dict[str, Callable], warmup=30, rounds=20, block=15):
    """Median wall-clock and CPU ms/step per method, the methods interleaved in short blocks."""
    return measure.ms_per_step({name: (lambda m=method: make_svi(problem, m)) for name, method in makers.items()},
                               problem.args, warmup, rounds, block)


# ------------------------------------------------------------------ report
def median_steps(steps: List[Optional[int]]) -> float:
    # a skipped seed counts as converging at once: the median is '>cap' all the same
    return statistics.median([math.inf if s is None else 0 if s == SKIPPED else s for s in steps])


def fmt_steps(value: float, max_steps: int) -> str:
    return f">{max_steps}" if math.isinf(value) else f"{value:g}"


def report(problem, results, timing, cpu_timing, max_steps) -> Tuple[List[str], str]:
    medians = {name: median_steps(steps) for name, steps in results.items()}
    adams = [name for name in results if not is_ngvi(name)]
    best = min(adams, key=lambda name: (medians[name], timing[name]))
    best_steps = medians[best]
    rows = []
    for name, steps in results.items():
        if math.isinf(best_steps):
            step_ratio = "n/a" if math.isinf(medians[name]) else f"<{medians[name] / max_steps:.3g}"
        elif math.isinf(medians[name]):
            step_ratio = f">{max_steps / best_steps:.3g}"
        else:
            step_ratio = f"{medians[name] / best_steps:.3g}"
        per_seed = ", ".join(
            "-" if s == SKIPPED else fmt_steps(math.inf if s is None else s, max_steps) for s in steps
        )
        rows.append(
            f"| {problem.name} | {name}{' (best Adam)' if name == best else ''} "
            f"| {fmt_steps(medians[name], max_steps)} | {per_seed} | {timing[name]:.2f} "
            f"| {step_ratio} | {timing[name] / timing[best]:.2f} | {cpu_timing[name]:.2f} |"
        )
    verdict = []
    for label in filter(is_ngvi, results):
        ngvi_steps, time_ratio = medians[label], timing[label] / timing[best]
        if math.isinf(ngvi_steps):
            fewer, steps_text = False, f"did not converge within {max_steps} steps"
        elif math.isinf(best_steps):  # Adam > max_steps: a lower bound on the ratio
            fewer = 10 * ngvi_steps <= max_steps
            steps_text = f">{max_steps / ngvi_steps:.1f}x fewer steps than every Adam setting"
        else:
            fewer = 10 * ngvi_steps <= best_steps
            steps_text = f"{best_steps / ngvi_steps:.1f}x fewer steps than {best}"
        met = fewer and time_ratio <= 1.15
        verdict.append(
            f"**{problem.name}**, {label}: target '>= 10x fewer steps than the best Adam "
            f"setting at <= 1.15x its time per step' {'MET' if met else 'NOT MET'} "
            f"({steps_text}; time/step {time_ratio:.2f}x)."
        )
    verdict = "\n\n".join(verdict)
    return rows, verdict


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10000)
    parser.add_argument("--particles", type=int, default=16,
                        help="K of the Adam grid and of the first NGVI row")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pyro.enable_validation(False)  # time the step, not Pyro's argument checks (same for all)
    makers = methods(args.particles)
    header = [
        "K: particles per step (Trace_ELBO vectorized; CurvatureELBO draws them one by one); "
        f"converged = all coordinates within {TOLERANCE:.0%} (mean: of the posterior std; "
        f"scale: relative) and staying there {CONFIRM} more steps; steps are medians over "
        f"{args.seeds} seeds (cap {args.max_steps}); ms/step is the median over "
        "interleaved timed steps after a warm-up (time.perf_counter; CPU ms/step: "
        "time.process_time, less sensitive to other processes), 1 thread, Pyro validation off; "
        "ratios are method / best Adam setting; '-': seed not run, the median was already "
        "over the cap.",
        "",
        "| model | method | steps to 1 % (median) | per seed | ms/step | steps ratio vs best Adam "
        "| time/step ratio vs best Adam | CPU ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines, verdicts = list(header), []
    started = time.perf_counter()
    for problem in (normal_normal_problem(), regression_problem()):
        results = {}
        for name, method in makers.items():
            results[name] = []
            for seed in range(args.seeds):
                if results[name].count(None) >= (args.seeds + 1) // 2:
                    results[name].append(SKIPPED)  # the median is '>cap' whatever it gives
                    continue
                results[name].append(steps_to_tolerance(problem, method, seed, args.max_steps))
            print(f"  {problem.name} | {name}: {results[name]}", flush=True)
        timing, cpu_timing = ms_per_step(problem, makers)
        rows, verdict = report(problem, results, timing, cpu_timing, args.max_steps)
        lines += rows
        verdicts.append(verdict)
    lines += [""] + verdicts
    measure.publish("\n".join(lines), started, args.out)


if __name__ == "__main__":
    main()
