"""
Full-covariance NGVI (AutoMultivariateNormal) against mean-field NGVI and Adam:
time per step at D = 10, 100, 1000, and steps / time to the exact posterior.

Model: Bayesian linear regression with correlated features, ``N = 2 D`` data,
known noise 0.5, prior ``N(0, 1)``; its posterior is an exact correlated
Gaussian, which an AutoMultivariateNormal can represent exactly.

* **Step cost** (all D): median ms per ``svi.step`` for NGVI and Adam on
  AutoMultivariateNormal and on AutoNormal (``Trace_ELBO(num_particles=K)``), the
  methods interleaved in blocks after a warm-up, 1 thread; plus one full Newton
  step (``CurvatureELBO("ggn", deterministic=True)``, lr = beta = 1).
* **To tolerance** (D = 10 and 100 by default): a run has converged at the first
  step after which ``KL(q || p) <= TOL * D`` (p the exact posterior) holds for
  ``CONFIRM`` more steps. Methods on AutoMultivariateNormal: NGVI() defaults,
  NGVI with a decaying lr and beta (chosen on the test model, D = 3, N = 20, not
  on these), the Newton step above, Adam over a learning-rate grid and Pyro's
  own autoguide-test setting ``ClippedAdam(lr 0.05, lrd 0.1 ** (1 / 500))``; with
  ``--particles 1`` also NGVI() on a ``LowRankPrecisionNormal`` of rank D (with and without
  the one draw's control variate).
* **Pyro's autoguide-test models** (exact, batch, tree; D = 1, 3, 3): steps until
  the guide's moments are within Pyro's tolerance (mean 0.05 absolute, std 5 %
  relative; confirmed for ``CONFIRM`` steps), NGVI() against Pyro's ClippedAdam
  setting, 100 particles as in Pyro's tests.

NGVI()'s adaptive steps on sampled full-covariance curvature (``DENSE_SAMPLED``, the
floor 0.005, the drift test) were picked on the D = 10 regression and Pyro's "exact"
model, the precision's trust-region ratio (1.25) on the D = 100 regression, seed 0;
the batch and tree models and seeds 1-2 report them.

Usage::

    python benchmarks/full_covariance.py [--dims 10 100 1000] [--converge-dims 10 100]
        [--seeds 3] [--particles 16] [--max-steps 2000] [--out FILE.md]
"""

import argparse
import math
import statistics
import time
from typing import Dict, List, Optional

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO, LowRankPrecisionNormal

import measure
from measure import steps_until

DTYPE = torch.float64
TOL = 0.01  # KL(q || p) per latent dimension, nats
CONFIRM = 20


# ------------------------------------------------------------------ problems
class Regression:
    def __init__(self, dim: int, seed: int = 0, noise: float = 0.5, correlation: float = 0.5):
        g = torch.Generator().manual_seed(1000 + seed)
        n = 2 * dim
        base = torch.randn(n, dim, generator=g, dtype=DTYPE)
        self.x = (base + correlation * base[:, :1]) / (1 + correlation)
        self.y = self.x @ torch.randn(dim, generator=g, dtype=DTYPE) + noise * torch.randn(n, generator=g, dtype=DTYPE)
        self.noise, self.dim = noise, dim
        self.precision = torch.eye(dim, dtype=DTYPE) + self.x.T @ self.x / noise**2
        self.covariance = torch.cholesky_inverse(torch.linalg.cholesky(self.precision))
        self.mean = self.covariance @ self.x.T @ self.y / noise**2
        self.logdet_covariance = -torch.logdet(self.precision)

    def model(self, x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(self.dim, dtype=DTYPE), 1.0).to_event(1))
        mean = w @ x.T  # (..., 1, N) under vectorized particles: one matmul
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mean.squeeze(-2) if w.dim() > 1 else mean, self.noise), obs=y)

    @property
    def args(self):
        return self.x, self.y

    def kl(self, mean: torch.Tensor, factor: torch.Tensor) -> float:
        """KL(N(mean, factor factor^T) || posterior) (``factor`` None: a singular precision, infinite)."""
        if factor is None:
            return math.inf
        offset = mean - self.mean
        trace = (self.precision * (factor @ factor.T)).sum()
        logdet_q = 2 * factor.diagonal().log().sum()
        return float(0.5 * (trace - self.dim + offset @ self.precision @ offset
                            + self.logdet_covariance - logdet_q))


def guide_gaussian(guide):
    """(mean, lower Cholesky factor of the covariance) of either guide, detached."""
    with torch.no_grad():
        if isinstance(guide, AutoMultivariateNormal):
            posterior = guide.get_posterior()
            return posterior.loc.detach(), posterior.scale_tril.detach()
        if isinstance(guide, LowRankPrecisionNormal):  # S = L L^T: L^-T is a triangular square root of S^-1
            posterior = guide.get_posterior()
            lower, info = torch.linalg.cholesky_ex(posterior.precision_matrix)
            if info:  # numerically singular: a direction of (practically) infinite variance
                return posterior.loc.detach(), None
            eye = torch.eye(lower.shape[-1], dtype=lower.dtype)
            return posterior.loc.detach(), torch.linalg.solve_triangular(lower, eye, upper=False).T
        loc, scale = guide._get_loc_and_scale("w")
        return loc.detach(), torch.diag(scale.detach())


# ------------------------------------------------------------------ methods
def decaying(t: int) -> float:
    """Picked on the test model (D = 3, N = 20): 0.5 / (1 + t / 20), floor 0.01."""
    return max(0.5 / (1 + t / 20), 0.01)


def trace_elbo(particles):
    return lambda: Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)


def newton_elbo():
    return CurvatureELBO("ggn", deterministic=True, max_plate_nesting=1)


def convergence_methods(particles: int) -> Dict[str, tuple]:
    """Label -> (guide class, optimizer factory, loss factory)."""
    found = {
        "NGVI() defaults": (AutoMultivariateNormal, lambda: NGVI(), trace_elbo(particles)),
        "NGVI decaying lr, beta": (AutoMultivariateNormal, lambda: NGVI(lr=decaying, beta=decaying),
                                   trace_elbo(particles)),
        "NGVI Newton (ggn, deterministic, lr = beta = 1)": (
            AutoMultivariateNormal, lambda: NGVI(lr=1.0, beta=1.0), newton_elbo),
    }
    if particles == 1:  # (LowRankPrecisionNormal's Price curvature needs the one draw it recorded)
        full_rank = lambda model: LowRankPrecisionNormal(model, rank=model.__self__.dim)  # noqa: E731
        found["NGVI() defaults, LowRankPrecisionNormal of rank D"] = (full_rank, lambda: NGVI(),
                                                                      trace_elbo(particles))
        found["the same without the control variate"] = (full_rank, lambda: NGVI(control_variate=False),
                                                         trace_elbo(particles))
    for lr in (0.001, 0.01, 0.1):
        found[f"Adam lr={lr}"] = (AutoMultivariateNormal, lambda lr=lr: pyro.optim.Adam({"lr": lr}),
                                  trace_elbo(particles))
    found["ClippedAdam lr=0.05, lrd=0.1^(1/500) (Pyro's tests)"] = (
        AutoMultivariateNormal, lambda: pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.1 ** (1 / 500)}),
        trace_elbo(particles))
    return found


def timing_methods(particles: int) -> Dict[str, tuple]:
    return {
        "NGVI, AutoMultivariateNormal": (AutoMultivariateNormal, lambda: NGVI(), trace_elbo(particles)),
        "Adam, AutoMultivariateNormal": (AutoMultivariateNormal, lambda: pyro.optim.Adam({"lr": 0.01}),
                                         trace_elbo(particles)),
        "NGVI, AutoNormal (mean-field)": (AutoNormal, lambda: NGVI(), trace_elbo(particles)),
        "Adam, AutoNormal (mean-field)": (AutoNormal, lambda: pyro.optim.Adam({"lr": 0.01}),
                                          trace_elbo(particles)),
        "NGVI Newton step, AutoMultivariateNormal": (AutoMultivariateNormal, lambda: NGVI(lr=1.0, beta=1.0),
                                                     newton_elbo),
    }


def make_svi(problem, method):
    guide_class, make_optim, make_loss = method
    return SVI(problem.model, guide_class(problem.model), make_optim(), make_loss())


# ------------------------------------------------------------------ measuring
def steps_to_kl(problem, method, seed, max_steps) -> Optional[int]:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svi = make_svi(problem, method)
    return steps_until(lambda: svi.step(*problem.args),
                       lambda: problem.kl(*guide_gaussian(svi.guide)) <= TOL * problem.dim, max_steps, CONFIRM)


def ms_per_step(problem, methods, warmup, rounds, block) -> Dict[str, float]:
    """Median wall-clock ms/step per method, the methods interleaved (:func:`measure.ms_per_step`)."""
    return measure.ms_per_step({name: (lambda m=method: make_svi(problem, m)) for name, method in methods.items()},
                               problem.args, warmup, rounds, block)[0]


# ------------------------------------------------------------------ Pyro's autoguide-test models
def exact_model(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


def batch_model(data):
    with pyro.plate("data", len(data)):
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


def tree_model(data):
    x = pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        y = pyro.sample("y", dist.Normal(x, 1.0))
        pyro.sample("obs", dist.Normal(y, 1.0), obs=data)


def pyro_test_posterior(name, data):
    n = len(data)
    if name == "batch":
        return data / 2, torch.full((n,), 0.5)
    if name == "tree":
        covariance = torch.linalg.inv(torch.tensor([[3.0, -1.0, -1.0], [-1.0, 2.0, 0.0], [-1.0, 0.0, 2.0]]))
        return covariance @ torch.cat([torch.zeros(1), data]), covariance.diagonal()
    return data.sum().reshape(1) / (n + 1), torch.full((1,), 1.0 / (n + 1))


def steps_to_pyro_tolerance(name, model, make_optim, seed, max_steps) -> Optional[int]:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    data = torch.randn(2 if name == "tree" else 3)
    mean, variance = pyro_test_posterior(name, data)
    guide = AutoMultivariateNormal(model)
    svi = SVI(model, guide, make_optim(), Trace_ELBO(num_particles=100, vectorize_particles=True))

    @torch.no_grad()
    def within_pyro_tolerance():
        posterior = guide.get_posterior()
        return bool((posterior.loc - mean).abs().max() < 0.05
                    and (posterior.variance.sqrt() / variance.sqrt() - 1).abs().max() < 0.05)

    return steps_until(lambda: svi.step(data), within_pyro_tolerance, max_steps, CONFIRM)


# ------------------------------------------------------------------ report
def median_steps(steps: List[Optional[int]]) -> float:
    return statistics.median([math.inf if s is None else s for s in steps])


def fmt(value: float, cap: int) -> str:
    return f">{cap}" if math.isinf(value) else f"{value:g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--converge-dims", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--pyro-seeds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    started = time.perf_counter()
    lines = []

    # ---- step cost
    lines += [
        f"### Time per step (ms, median; K = {args.particles} particles; 1 thread)", "",
        "| D | " + " | ".join(timing_methods(args.particles)) + " | full / mean-field NGVI | full NGVI / full Adam |",
        "|---|" + "---|" * (len(timing_methods(args.particles)) + 2),
    ]
    step_ms = {}
    for dim in args.dims:
        problem = Regression(dim)
        small = dim <= 100
        timing = ms_per_step(problem, timing_methods(args.particles), warmup=10 if small else 2,
                             rounds=10 if small else 3, block=10 if small else 2)
        step_ms[dim] = timing
        ratio = timing["NGVI, AutoMultivariateNormal"] / timing["NGVI, AutoNormal (mean-field)"]
        adam_ratio = timing["NGVI, AutoMultivariateNormal"] / timing["Adam, AutoMultivariateNormal"]
        lines.append(f"| {dim} | " + " | ".join(f"{t:.2f}" for t in timing.values())
                     + f" | {ratio:.2f} | {adam_ratio:.2f} |")
        print(lines[-1], flush=True)

    # ---- to tolerance
    lines += ["", f"### Steps and time to KL(q || p) <= {TOL} D (AutoMultivariateNormal; K = {args.particles}; "
              f"median over {args.seeds} seeds, cap {args.max_steps}; confirmed {CONFIRM} steps)", "",
              "| D | method | steps (median) | per seed | ms/step | time to tolerance (s) |",
              "|---|---|---|---|---|---|"]
    for dim in args.converge_dims:
        problem = Regression(dim, seed=1)
        methods = convergence_methods(args.particles)
        timing = ms_per_step(problem, methods, warmup=5, rounds=5, block=5)
        for name, method in methods.items():
            steps = []
            for seed in range(args.seeds):
                if steps.count(None) >= (args.seeds + 1) // 2:
                    break
                steps.append(steps_to_kl(problem, method, seed, args.max_steps))
            median = median_steps(steps + [None] * (args.seeds - len(steps)))
            seconds = "-" if math.isinf(median) else f"{median * timing[name] / 1e3:.2f}"
            per_seed = ", ".join(fmt(math.inf if s is None else s, args.max_steps) for s in steps)
            lines.append(f"| {dim} | {name} | {fmt(median, args.max_steps)} | {per_seed} "
                         f"| {timing[name]:.2f} | {seconds} |")
            print(lines[-1], flush=True)

    # ---- Pyro's autoguide-test models
    lines += [] if not args.pyro_seeds else ["", f"### Pyro's autoguide-test models: steps to Pyro's tolerance (AutoMultivariateNormal, "
              f"100 particles, median over {args.pyro_seeds} seeds, cap 1000)", "",
              "| model | NGVI() | ClippedAdam (Pyro's test setting) | per seed NGVI | per seed ClippedAdam |",
              "|---|---|---|---|---|"]
    optims = {"ngvi": lambda: NGVI(),
              "adam": lambda: pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.1 ** (1 / 500)})}
    for name, model in (("exact", exact_model), ("batch", batch_model), ("tree", tree_model)) if args.pyro_seeds else ():
        steps = {key: [steps_to_pyro_tolerance(name, model, make, seed, 1000) for seed in range(args.pyro_seeds)]
                 for key, make in optims.items()}
        lines.append(f"| {name} | {fmt(median_steps(steps['ngvi']), 1000)} | {fmt(median_steps(steps['adam']), 1000)} | "
                     + " | ".join(", ".join(fmt(math.inf if s is None else s, 1000) for s in steps[k])
                                  for k in ("ngvi", "adam")) + " |")
        print(lines[-1], flush=True)

    print()
    measure.publish("\n".join(lines), started, args.out)


if __name__ == "__main__":
    main()
