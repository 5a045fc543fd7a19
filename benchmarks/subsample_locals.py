"""
Subsampled local latents with one draw: z_i ~ N(0, 1), x_i ~ N(z_i, 1), i = 1..1000, a plate
subsampled to B per step, AutoNormal + Trace_ELBO + NGVI(). The exact posterior is
N(x_i / 2, 1/2), so each element's error is in exact posterior sds. With ``g``, a global mean
mu ~ N(0, 10) with w_i ~ N(mu, 1) joins the model (the variant where single elements run away).
Prints, every 200 steps, how many elements are beyond 3 sd, the largest error and the largest
ratio of a guide sd to the exact one (findings: results/mean_field_one_draw_locals.md).

Usage::

    python benchmarks/subsample_locals.py [B] [g|-] [seeds, comma separated]
"""

import sys
import warnings

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI

N = 1000


def main(batch: int, with_global: bool, seeds) -> None:
    generator = torch.Generator().manual_seed(0)
    x = 1.0 + torch.randn(N, generator=generator) * 1.5
    w = 2.0 + torch.randn(N, generator=generator)

    def model():
        if with_global:
            mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", N, subsample_size=batch) as idx:
            if with_global:
                pyro.sample("w", dist.Normal(mu, 1.0), obs=w[idx])
            pyro.sample("x", dist.Normal(pyro.sample("z", dist.Normal(0.0, 1.0)), 1.0), obs=x[idx])

    every = 2 * 10 * N // batch
    for seed in seeds:
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoNormal(model, create_plates=lambda: pyro.plate("data", N, subsample_size=batch))
        svi = SVI(model, guide, NGVI(), Trace_ELBO())
        out = []
        for step in range(1, 3 * every + 1):
            svi.step()
            if step % every == 0:
                loc, scale = pyro.param("AutoNormal.locs.z").detach(), pyro.param("AutoNormal.scales.z").detach()
                error = (loc - x / 2).abs() / 0.5**0.5
                out.append(f"step {step}: >3sd {int((error > 3).sum())}, max err {float(error.max()):.1f} sd, "
                           f"max sd ratio {float(scale.max() / 0.5**0.5):.1f}")
        print("seed", seed, "|", " | ".join(out), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    pyro.enable_validation(False)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100, len(sys.argv) > 2 and sys.argv[2] == "g",
         [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0, 1, 2])
