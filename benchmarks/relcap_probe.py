"""
Issue 26, third attempt (development probe): the noise limit relative to the weights' own signal.
The recipe's limit keeps each weight's sigma^2 <= v / (L n), the share v / L of a unit's signal variance
when the weights have variance 1 / n; here the signal is the layer's (or unit's) mean square weight
now, sigma^2 <= (v / L) mean(mu^2), rewritten into the model's floor after every step.

    TQDM_DISABLE=1 python benchmarks/relcap_probe.py TASK EPOCHS SEED MODE [--every 50]
MODE: recipe | layer | unit | weight (a weight's own mu^2; its bias per unit)
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from pyro_ngvi.nn.weights import fan_in  # noqa: E402


def relative_floors(method, mode, v=1.0):
    bnn = method.bnn
    layers = len({id(w.module) for w in bnn._latents if fan_in(w.module) is not None})
    with method.active(), torch.no_grad():
        locs = {site: method.guide._get_loc_and_scale(site)[0] for site in bnn.latent_sites}
    floors = []
    for w in bnn._latents:
        weight_site = w.site[: -len(w.param_name)] + "weight"
        mu = locs[weight_site]
        if mode == "weight" and w.param.shape == mu.shape:  # per weight: multiplicative noise, sigma^2 <= (v / L) mu^2
            floor = layers / (v * mu.square().clamp_min(1e-8))
        elif mode == "layer":
            ms = mu.square().mean()
            floor = (layers / (v * ms)).expand(w.param.shape)
        else:  # per output unit (row of the weight)
            ms = mu.square().reshape(mu.shape[0], -1).mean(1)
            floor = layers / (v * ms)
            floor = floor.reshape((-1,) + (1,) * (w.param.dim() - 1)).expand(w.param.shape)
        floors.append(floor.clone())
    bnn._noise_floor_cache = floors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("epochs", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("mode")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--v", type=float, default=1.0)
    args = parser.parse_args()
    start = time.time()
    with harness.probe(args.task, args.seed) as task:
        method = harness.ngvi_recipe(task, "ggn")
        if args.mode != "recipe":
            step = method.step
            relative_floors(method, args.mode, args.v)

            def relative_step(x, y):
                step(x, y)
                relative_floors(method, args.mode, args.v)

            method.step = relative_step

        def evaluate(m, epoch):
            scores = sd.score(task, m)
            post = m.posterior()
            ratio = []
            for site in m.bnn.latent_sites:
                floor = m.bnn._noise_floor()[m.bnn.latent_sites.index(site)]
                ratio.append((post[site][1] * floor.sqrt()).flatten())
            ratio = torch.cat(ratio)
            line = f"{args.task} s{args.seed} {args.mode} {epoch:4d} nll {sd.nll_of(task, scores):.4f}"
            line += (f" ece {scores['ece']:.4f} acc {scores['accuracy']:.3f}" if "ece" in scores
                     else f" rmse {scores['rmse']:.3f} cov90 {scores['coverage90']:.2f}")
            line += f" at-floor {float((ratio > 0.99).double().mean()):.2f}"
            weights = [s for s in m.bnn.latent_sites if s.endswith("weight")]
            line += " sig " + " ".join(f"{float(post[s][1].mean()):.3f}" for s in weights)
            print(line, f"[{time.time() - start:.0f} s]", flush=True)

        harness.fit_every(method, args.epochs, args.every, evaluate)


if __name__ == "__main__":
    main()
