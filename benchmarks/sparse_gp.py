"""
Pyro's sparse variational GP (``pyro.contrib.gp.models.VariationalSparseGP``) with the RBF
kernel's lengthscale and variance under LogNormal(0, 1) priors and Normal autoguides, as in
Pyro's GP tutorial: the two hyperparameters are NGVI's Gaussian sites (in log space), the
inducing points, ``u_loc``, ``u_scale_tril`` and the noise its point optimizer's. The data are
the tutorial's: 100 points, x ~ U(0, 5), y = 0.5 sin(3x) + N(0, 0.2^2), 10 inducing points at
0, 0.5, ..., 4.5, jitter 1e-4. Each run reports the -ELBO after training (the mean of 5 x 200
draws) and the log-lengthscale's mean, or the step at which the model raised (a run whose
guide draws a lengthscale of e^5 or more makes Kuu's Cholesky fail).

Usage::

    python benchmarks/sparse_gp.py [--seeds 0 1 2 3 4] [--steps 2000] [--methods ngvi cadam]

Results: ``results/sparse_gp_seed0.md``.
"""

import argparse
import time
import warnings

import torch

import pyro
import pyro.contrib.gp as gp
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroSample

from pyro_ngvi import NGVI


def data(n: int = 100):
    """The tutorial's data, drawn from their own seed (the global RNG left as it was)."""
    state = torch.get_rng_state()
    torch.manual_seed(0)
    x = dist.Uniform(0.0, 5.0).sample((n,))
    y = 0.5 * torch.sin(3 * x) + dist.Normal(0.0, 0.2).sample((n,))
    torch.set_rng_state(state)
    return x, y


def build(inducing: int = 10):
    pyro.clear_param_store()
    x, y = data()
    kernel = gp.kernels.RBF(input_dim=1)
    kernel.lengthscale = PyroSample(dist.LogNormal(0.0, 1.0))
    kernel.variance = PyroSample(dist.LogNormal(0.0, 1.0))
    kernel.autoguide("lengthscale", dist.Normal)
    kernel.autoguide("variance", dist.Normal)
    return gp.models.VariationalSparseGP(x, y, kernel, Xu=torch.arange(float(inducing)) / 2,
                                         likelihood=gp.likelihoods.Gaussian(), jitter=1e-4)


def run(method: str, seed: int, steps: int):
    pyro.set_rng_seed(seed)
    model = build()
    optim = NGVI() if method == "ngvi" else pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.1 ** (1 / steps)})
    svi = SVI(model.model, model.guide, optim, Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):
            try:
                svi.step()
            except (RuntimeError, ValueError) as error:  # (torch.linalg.LinAlgError is a RuntimeError)
                return f"raised at step {step}: {type(error).__name__}"
        with torch.no_grad():
            loss = sum(Trace_ELBO(num_particles=200).loss(model.model, model.guide) for _ in range(5)) / 5
    return f"-ELBO {loss:.2f}, log-lengthscale {model.kernel.lengthscale_loc.item():.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--methods", nargs="+", default=["ngvi", "cadam"], choices=["ngvi", "cadam"])
    args = parser.parse_args(argv)
    for method in args.methods:
        for seed in args.seeds:
            start = time.time()
            print(f"{method} seed {seed}: {run(method, seed, args.steps)} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
