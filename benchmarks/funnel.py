"""
A scale that multiplies other latents, with data that barely identify them: one draw per step
against several. The model is y_k ~ N(exp(s) z_k, 1), k = 1..50, s ~ N(0, 3), z_k ~ N(0, 1),
the data drawn with exp(s) = 0.01 (the shape of a non-centred hierarchical model whose group
scale the data put near 0). Its mean-field ELBO is closed-form (E[exp(s)] and E[exp(2s)] of a
Gaussian), so the mean-field optimum is found exactly by L-BFGS; each run of NGVI() with the
default AutoNormal is scored against it: the error of s's mean in its mean-field standard
deviations, the ratio of s's scale and the range of the z scales' ratios, and NGVI's warnings.

Usage::

    python benchmarks/funnel.py [--particles 1 8] [--seeds 6] [--steps 1000]
"""

import argparse
import warnings

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, NGVIWarning

K = 50


def data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return 0.01 * torch.randn(K, generator=generator) + torch.randn(K, generator=generator)


def model(y):
    s = pyro.sample("s", dist.Normal(0.0, 3.0))
    with pyro.plate("k", K):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(s.exp() * z, 1.0), obs=y)


def mean_field_optimum(y: torch.Tensor):
    """(mean of s, sd of s, sds of z) maximising the closed-form mean-field ELBO (float64)."""
    y = y.double()
    params = torch.zeros(2 + 2 * K, dtype=torch.float64, requires_grad=True)

    def negative_elbo():
        m, v, a, b2 = params[0], params[1].exp(), params[2:2 + K], params[2 + K:].exp()
        likelihood = -0.5 * (y**2 - 2 * y * torch.exp(m + v / 2) * a + torch.exp(2 * m + 2 * v) * (a**2 + b2)).sum()
        prior = -(m**2 + v) / 18 - 0.5 * (a**2 + b2).sum()
        entropy = 0.5 * params[1] + 0.5 * params[2 + K:].sum()
        return -(likelihood + prior + entropy)

    lbfgs = torch.optim.LBFGS([params], max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                              line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        value = negative_elbo()
        value.backward()
        return value

    for _ in range(5):
        lbfgs.step(closure)
    with torch.no_grad():
        return params[0].item(), params[1].exp().sqrt().item(), params[2 + K:].exp().sqrt()


def run(y, particles: int, seed: int, steps: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    loss = Trace_ELBO(num_particles=particles, vectorize_particles=True) if particles > 1 else Trace_ELBO()
    svi = SVI(model, AutoNormal(model), NGVI(), loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(steps):
                svi.step(y)
        except RuntimeError:  # (every draw non-finite: diverged)
            pass
    store = pyro.get_param_store()
    found = [str(w.message).split(":")[1][:40] for w in caught if issubclass(w.category, NGVIWarning)]
    return store["AutoNormal.locs.s"].item(), store["AutoNormal.scales.s"].item(), \
        store["AutoNormal.scales.z"].detach().double(), found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    y = data()
    mean, sd, z_sd = mean_field_optimum(y)
    print(f"mean-field optimum: s {mean:.3f} (sd {sd:.3f}), z sd {z_sd.min():.3f}-{z_sd.max():.3f}; "
          f"{args.steps} steps of NGVI() from AutoNormal's default start\n")
    print("| draws | seed | s error (sd) | s scale ratio | z scale ratios | NGVI warnings |")
    print("|---:|---:|---:|---:|---|---|")
    for particles in args.particles:
        for seed in range(args.seeds):
            m, s, z, found = run(y, particles, seed, args.steps)
            ratios = z / z_sd
            print(f"| {particles} | {seed} | {(m - mean) / sd:+.2f} | {s / sd:.2f} | "
                  f"{ratios.min():.2f}-{ratios.max():.2f} | {'; '.join(found) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
