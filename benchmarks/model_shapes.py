"""
How the cost of ``NGVI()``'s step scales with the shape of a plain Pyro model, against
``pyro.optim.Adam`` on the same model, guide and loss (``Trace_ELBO`` and ``AutoNormal`` unless
the case says otherwise): milliseconds per ``SVI.step`` (the fastest of ``--blocks`` blocks, the
two optimizers' blocks taking turns, one thread, Pyro's validation off) and Python and C
function calls per step (cProfile: they do not depend on the machine's load, times on a shared
machine do).

Cases: K scalar latent sites made in a Python loop (``loop``), in a sequential
``for i in pyro.plate("g", K)`` with a hand-written guide (AutoGuides refuse sequential plates;
``seqplate``), one vectorised site of K in a plate (``vecplate``), for K = 10, 100, 1,000; local
latents of a plate of 100,000 subsampled 100 at a time (AutoNormal with ``create_plates``, a new
index each step); a hierarchical model of nested plates (20 groups x 10 items x 5 replicates, 3
levels) under AutoNormal and AutoDiagonalNormal; AutoMultivariateNormal at D = 10, 100, 500;
AutoLowRankMultivariateNormal (rank 5) at D = 1,000; a 50-dim Bayesian logistic regression
(500 examples) with one particle, 8 vectorised particles, ``TraceMeanField_ELBO`` and, for NGVI,
``CurvatureELBO("hessian")`` (Adam: ``Trace_ELBO``); and a hand-written guide whose structure
changes at random between steps (each of 12 sites present or not; ``random structure``).

Usage::

    python benchmarks/model_shapes.py [--only NAME ...] [--blocks 3] [--out results/model_shapes.md]
"""

import argparse
import cProfile
import pstats
import time
import warnings
from typing import Callable, Dict

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import (AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoMultivariateNormal,
                                  AutoNormal)

from pyro_ngvi import NGVI, CurvatureELBO


# ----------------------------------------------------------------------------- models
def loop_sites(k: int):
    def model():
        zs = [pyro.sample(f"z{i}", dist.Normal(0.0, 1.0)) for i in range(k)]
        pyro.sample("obs", dist.Normal(torch.stack(zs), 1.0).to_event(1), obs=torch.ones(k))
    return model


def sequential_plate(k: int):
    def model():
        for i in pyro.plate("g", k):
            z = pyro.sample(f"z{i}", dist.Normal(0.0, 1.0))
            pyro.sample(f"x{i}", dist.Normal(z, 1.0), obs=torch.tensor(1.0))

    def guide():
        for i in pyro.plate("g", k):
            loc = pyro.param(f"m{i}", torch.tensor(0.0))
            scale = pyro.param(f"s{i}", torch.tensor(1.0), constraint=dist.constraints.positive)
            pyro.sample(f"z{i}", dist.Normal(loc, scale))
    return model, guide


def vectorised_plate(k: int):
    def model():
        with pyro.plate("g", k):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=torch.ones(k))
    return model


def subsampled(n: int = 100_000, b: int = 100):
    y = torch.randn(n, generator=torch.Generator().manual_seed(0))

    def model():
        with pyro.plate("data", n, subsample_size=b) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=y[idx])
    return model, lambda: pyro.plate("data", n, subsample_size=b)


def hierarchical(groups: int = 20, items: int = 10, replicates: int = 5):
    y = torch.randn(replicates, items, groups, generator=torch.Generator().manual_seed(0))

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("groups", groups, dim=-1):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
            with pyro.plate("items", items, dim=-2):
                b = pyro.sample("b", dist.Normal(a, 1.0))
                with pyro.plate("replicates", replicates, dim=-3):
                    pyro.sample("y", dist.Normal(b, 1.0), obs=y)
    return model


def gaussian(d: int):
    y = torch.randn(d, generator=torch.Generator().manual_seed(0))

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(d), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)
    return model


def logistic(d: int = 50, n: int = 500):
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, d, generator=generator), torch.randn(d, generator=generator)
    y = torch.bernoulli(torch.sigmoid(x @ w), generator=generator)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(d), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Bernoulli(logits=x @ w if w.dim() == 1 else w @ x.T), obs=y)
    return model


def random_structure(m: int = 12):
    def model(mask):
        for i in range(m):
            if mask[i]:
                z = pyro.sample(f"z{i}", dist.Normal(0.0, 1.0))
                pyro.sample(f"x{i}", dist.Normal(z, 1.0), obs=torch.tensor(1.0))

    def guide(mask):
        for i in range(m):
            if mask[i]:
                loc = pyro.param(f"m{i}", torch.tensor(0.0))
                scale = pyro.param(f"s{i}", torch.tensor(1.0), constraint=dist.constraints.positive)
                pyro.sample(f"z{i}", dist.Normal(loc, scale))
    generator = torch.Generator().manual_seed(0)
    return model, guide, lambda: ((torch.rand(m, generator=generator) < 0.5),)


# ----------------------------------------------------------------------------- cases
def cases() -> Dict[str, Callable]:
    """name -> make(optimizer) returning a step callable (no arguments)."""
    out = {}

    def add(name, model, make_guide=None, loss=Trace_ELBO, ngvi_loss=None, args=lambda: ()):
        def make(optim):
            guide = make_guide() if make_guide is not None else AutoNormal(model)
            chosen = ngvi_loss if ngvi_loss is not None and isinstance(optim, NGVI) else loss
            svi = SVI(model, guide, optim, chosen())
            return lambda: svi.step(*args())
        out[name] = make

    for k in (10, 100, 1000):
        add(f"loop K={k}", loop_sites(k))
    for k in (10, 100, 1000):
        model, guide = sequential_plate(k)
        add(f"seqplate K={k}", model, lambda g=guide: g)
    for k in (10, 100, 1000):
        add(f"vecplate K={k}", vectorised_plate(k))
    model, plates = subsampled()
    add("subsample 1e5 by 100", model, lambda m=model: AutoNormal(m, create_plates=plates))
    model = hierarchical()
    add("nested plates AutoNormal", model)
    add("nested plates AutoDiagonalNormal", model, lambda m=model: AutoDiagonalNormal(m))
    for d in (10, 100, 500):
        model_d = gaussian(d)
        add(f"AutoMultivariateNormal D={d}", model_d, lambda m=model_d: AutoMultivariateNormal(m))
    model = gaussian(1000)
    add("AutoLowRankMVN r=5 D=1000", model, lambda m=model: AutoLowRankMultivariateNormal(m, rank=5))
    model = logistic()
    add("logistic D=50", model)
    add("logistic D=50, 8 vectorised particles", model,
        loss=lambda: Trace_ELBO(num_particles=8, vectorize_particles=True))
    add("logistic D=50, TraceMeanField_ELBO", model, loss=TraceMeanField_ELBO)
    add("logistic D=50, CurvatureELBO(hessian)", model, ngvi_loss=lambda: CurvatureELBO("hessian"))
    model, guide, args = random_structure()
    add("random structure, 12 sites", model, lambda: guide, args=args)
    return out


def measure(make: Callable, blocks: int, block: int, warmup: int) -> Dict[str, tuple]:
    """ms per step (fastest block) and calls per step of NGVI() and Adam, their blocks taking turns."""
    store = pyro.get_param_store()
    steps, scopes = {}, {}
    for name, optim in (("ngvi", NGVI()), ("adam", pyro.optim.Adam({"lr": 0.01}))):
        pyro.set_rng_seed(0)
        with store.scope() as scope:
            steps[name] = make(optim)
            for _ in range(warmup):
                steps[name]()
        scopes[name] = scope
    best = {name: float("inf") for name in steps}
    for _ in range(blocks):
        for name, step in steps.items():
            with store.scope(scopes[name]):
                start = time.perf_counter()
                for _ in range(block):
                    step()
                best[name] = min(best[name], (time.perf_counter() - start) / block)
    calls = {}
    for name, step in steps.items():
        with store.scope(scopes[name]):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(block):
                step()
            profile.disable()
        calls[name] = pstats.Stats(profile).total_calls / block
    return {name: (1e3 * best[name], calls[name]) for name in steps}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    pyro.enable_validation(False)
    started = time.perf_counter()
    lines = ["| case | NGVI ms/step | Adam ms/step | ratio | NGVI calls/step | Adam calls/step | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for name, make in cases().items():
        if args.only and name not in args.only:
            continue
        big = "1000" in name and name.startswith(("loop", "seqplate"))
        block, warmup = (2, 2) if big else (20, 20 if name.startswith("random") else 5)
        result = measure(make, args.blocks, block, warmup)
        (n_ms, n_calls), (a_ms, a_calls) = result["ngvi"], result["adam"]
        line = (f"| {name} | {n_ms:.2f} | {a_ms:.2f} | {n_ms / a_ms:.2f} | {n_calls:.0f} | {a_calls:.0f} | "
                f"{n_calls / a_calls:.2f} |")
        lines.append(line)
        print(line, flush=True)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
