"""
The step of an AutoLowRankMultivariateNormal's loc under NGVI() (issue 23; ``pyro_ngvi/point.py``),
against the variants measured while choosing it (``results/pyro_suite.md``):

- ``adopted``: Adam's step in the guide's marginal sds times max(1, sigma_i |m_i|), within one sd;
  at least alpha_t sigma_i (|m_i| / s_i - 0.23), s_i the gradient's draw noise (pyro_ngvi/point.py);
- ``trust3``: the same within 3 sds (NGVI's max_step);
- ``sd``: Adam's step in plain sd units, alpha_t sigma_i m / sqrt(v);
- ``const``: the same at a constant alpha = 0.1 (no decay);
- ``before``: Adam's step in the loc's own units, alpha_t m / sqrt(v).

Problems (float64, 1 thread, seeds 0..N-1):

- ``median``: Pyro's test_median_module body (``misses.py median``): seeds failing, of 100;
- ``regression``: 200 points, 5 coefficients, prior N(0, 10), one-draw steps: the largest |mean
  error| in posterior sds after 200 and 2,000 steps;
- ``big``: the same with 20,000 points (posterior sds 0.007, the guide starting 14x too wide);
- ``narrow``: a pure-noise site of sd 0.001 beside one of sd 1: |loc| in posterior sds after 20 steps;
- ``exact``: Pyro's test_exact body (500 steps, 100 particles): the largest |mean error|.

usage: python low_rank_loc.py {median,regression,big,narrow,exact} [--variant V] [--seeds N]
"""

import argparse
import warnings

import torch

import pyro
import pyro.distributions as dist
import pyro_ngvi.point as point
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal

from misses import median_error
from pyro_ngvi import NGVI
from pyro_ngvi.family import NotGaussianWarning


def plain_sd_units(self, optimizer, args, kwargs):
    """SdUnits.after without the distance estimate or the bound: alpha_t sigma_i m / sqrt(v)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p, start in zip(group["params"], self._start):
                if start is not None:
                    p.copy_(start + self.sd.to(p.dtype) * (p - start))
    self._start, self.sd = [], None


def use(variant: str) -> None:
    if variant == "before":
        point.low_rank_locs = lambda parts: {}
    elif variant == "trust3":
        point.LOW_RANK_LOC_TRUST = 3.0
    elif variant in ("sd", "const"):
        point.SdUnits.after = plain_sd_units
        if variant == "const":
            before = point.SdUnits.before

            def constant(self, optimizer, args, kwargs):
                for group in optimizer.param_groups:
                    group["lr"] = 0.1
                before(self, optimizer, args, kwargs)
            point.SdUnits.before = constant


def loc_and_sd(guide):
    loc, sd = guide._loc_scale()
    return loc.detach(), sd.detach()


def regression(n: int):
    X = torch.randn(n, 5)
    y = X @ torch.tensor([3.0, -2.0, 1.0, 0.5, -4.0]) + torch.randn(n)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(5), 10.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal(X @ w, 1.0), obs=y)

    covariance = torch.linalg.inv(X.T @ X + torch.eye(5) / 100)
    mean, sd = covariance @ X.T @ y, covariance.diag().sqrt()
    guide = AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    errors = []
    for t in range(2000):
        svi.step(X, y)
        if t + 1 in (200, 2000):
            errors.append(((loc_and_sd(guide)[0] - mean) / sd).abs().max().item())
    return errors


def narrow():
    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(0.0, 0.001))

    guide = AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    for _ in range(20):
        svi.step()
    return [abs(loc_and_sd(guide)[0][1].item()) / 0.001]


def exact():
    def model(data):
        loc = pyro.sample("loc", dist.Normal(0, 1))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(loc, 1), obs=data)

    data = torch.randn(3)
    guide = AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO(num_particles=100, vectorize_particles=True))
    for _ in range(500):
        svi.step(data)
    loc, sd = loc_and_sd(guide)
    return [abs(loc.item() - data.sum().item() / 4), abs(sd.item() / 0.5 - 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problem", choices=["median", "regression", "big", "narrow", "exact"])
    parser.add_argument("--variant", choices=["adopted", "trust3", "sd", "const", "before"], default="adopted")
    parser.add_argument("--seeds", type=int, default=None)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore", category=NotGaussianWarning)
    use(args.variant)
    seeds = args.seeds or {"median": 100, "regression": 3, "big": 2, "narrow": 5, "exact": 5}[args.problem]
    results = []
    for seed in range(seeds):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        if args.problem == "median":
            results.append([median_error(NGVI())])
        elif args.problem in ("regression", "big"):
            results.append(regression(200 if args.problem == "regression" else 20000))
        else:
            results.append(narrow() if args.problem == "narrow" else exact())
    if args.problem == "median":
        print(f"{args.variant}: {sum(r[0] > 0.1 for r in results)} of {seeds} seeds fail; "
              f"max error {max(r[0] for r in results):.3f}")
    elif args.problem == "exact":
        print(f"{args.variant}: largest mean error {max(r[0] for r in results):.3f}, "
              f"sd error {max(r[1] for r in results):.3f}")
    else:
        columns = list(zip(*results))
        print(f"{args.variant}: per seed {[[round(v, 1) for v in r] for r in results]}; "
              f"largest {' / '.join(f'{max(c):.1f}' for c in columns)}")


if __name__ == "__main__":
    main()
