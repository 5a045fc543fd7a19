"""
A strongly correlated posterior under the losses that let NGVI couple its mean steps and
those that do not. The model: a 4-vector t ~ N(0, 4 I) seen only through its sum, 8
observations o ~ N(sum(t), 0.5^2); the posterior precision I/4 + 32 * 11^T (correlation 0.99
between the elements). Mean-field VI recovers the exact posterior mean and the scales
diag(precision)^-1/2, so each run is scored against them: the largest error of a mean in
mean-field standard deviations, and the scales' ratios. Element-wise (Jacobi) steps contract
the directions the prior alone holds by about 0.25 / 32.25 per step; NGVI's coupled mean step
(the cross terms of its control variate) removes that, where the draws are known: one draw
per step under Trace_ELBO, CurvatureELBO or TraceMeanField_ELBO (which draws an autoguide's
Gaussian: pyro_ngvi.mean_field_kl), or several particles of an autoguide, whose draws NGVI reads
as the guide runs (pyro_ngvi.draws).

Usage::

    python benchmarks/coupled.py [--steps 1000] [--seeds 3] [--only TraceMeanField]
"""

import argparse
import warnings

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO, NGVIWarning

D, N, NOISE = 4, 8, 0.5


def model(obs):
    t = pyro.sample("t", dist.Normal(0.0, 2.0).expand([D]).to_event(1))
    with pyro.plate("obs", N):
        pyro.sample("o", dist.Normal(t.sum(-1), NOISE), obs=obs)  # (sum(-1): particle-vectorisable)


LOSSES = {
    "Trace_ELBO()": lambda: Trace_ELBO(),
    "CurvatureELBO('reparam')": lambda: CurvatureELBO("reparam"),
    "Trace_ELBO(num_particles=8)": lambda: Trace_ELBO(num_particles=8),
    "Trace_ELBO(num_particles=8, vectorize_particles=True)": lambda: Trace_ELBO(num_particles=8,
                                                                               vectorize_particles=True),
    "CurvatureELBO('reparam', num_particles=8)": lambda: CurvatureELBO("reparam", num_particles=8),
    "TraceMeanField_ELBO()": lambda: TraceMeanField_ELBO(),
    "TraceMeanField_ELBO(num_particles=8)": lambda: TraceMeanField_ELBO(num_particles=8),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the losses whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    obs = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.5 + 3.0
    precision = torch.eye(D) / 4 + torch.ones(D, D) * N / NOISE**2
    mean = torch.linalg.solve(precision, torch.ones(D) * obs.sum() / NOISE**2)
    scale = precision.diagonal().rsqrt()
    print(f"{args.steps} steps of NGVI() from AutoNormal's default start; exact mean {mean[0]:.4f} "
          f"in every element, mean-field scale {scale[0]:.4f}\n")
    print("| loss | seed | largest mean error (mean-field sd) | scale ratios | NGVI warnings |")
    print("|---|---:|---:|---|---|")
    for name, make in LOSSES.items():
        if args.only not in name:
            continue
        for seed in range(args.seeds):
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            guide = AutoNormal(model)
            svi = SVI(model, guide, NGVI(), make())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(args.steps):
                    svi.step(obs)
            loc, found = (t.detach() for t in guide._get_loc_and_scale("t"))
            ratios = found / scale
            warned = sum(issubclass(w.category, NGVIWarning) for w in caught)
            print(f"| `{name}` | {seed} | {float(((loc - mean).abs() / scale).max()):.2f} | "
                  f"{float(ratios.min()):.2f}-{float(ratios.max()):.2f} | {warned} |", flush=True)


if __name__ == "__main__":
    main()
