"""
Issue 26, third attempt: the candidates of ``lastlayer_probe.py`` over tasks and seeds, one JSON line
per (task, seed, training, epoch) with the test NLL (regression: -log-lik) and ECE of each predictive.

    TQDM_DISABLE=1 python benchmarks/lastlayer_eval.py --tasks T ... --seeds 3 --training recipe llprior
        --out FILE.jsonl [--epochs 100 200 300]

``--training``: ``recipe``; ``llprior`` (the last layer's prior precision set to its Laplace evidence's
alpha, ``lastlayer_probe.LastLayerLaplace`` with 8 draws of the hidden weights, every epoch from epoch 10);
``llprior@K`` (the same every K steps); ``llprior0`` (alpha from the features at the hidden means);
``kfacprior`` (one alpha for the net, the K-FAC Laplace evidence of ``smalldata_probe.py``, every epoch
from epoch 10); ``relcap`` (``relcap_probe.relative_floors`` after every step). Each checkpoint scores the
recipe's predictive and ``LL``, the last-layer Laplace predictive at the guide's mean.
"""
import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import pyro  # noqa: E402

import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from lastlayer_probe import LastLayerLaplace  # noqa: E402
from relcap_probe import relative_floors  # noqa: E402
from smalldata_probe import KFACLaplace, method_means  # noqa: E402


def run(name, seed, training, epochs, out, draws=8):
    make, task_epochs = harness.small_tasks()[name]
    epochs = epochs or [task_epochs // 3, 2 * task_epochs // 3, task_epochs]
    pyro.clear_param_store()
    task = make(seed)
    split = task.split
    method = harness.ngvi_recipe(task, "ggn")
    relcap = "relcap" in training
    if relcap:
        relative_floors(method, "layer")
    if training.startswith(("llprior", "kfacprior")) or relcap:
        per_epoch, taken, step = math.ceil(task.num_data / task.batch_size), [0], method.step

        def step_and_set_prior(x, y):
            step(x, y)
            taken[0] += 1
            if relcap:
                relative_floors(method, "layer")
            if "@" in training:  # every this many steps (NGVI's memory 1 / beta = 100)
                due = taken[0] % int(training.split("@")[1]) == 0
            else:
                due = taken[0] % per_epoch == 0 and taken[0] // per_epoch >= 10
            if training.startswith("kfacprior") and due:  # one alpha for the net (the second attempt's)
                with method.active():
                    laplace = KFACLaplace(method.net, method_means(method), split.x_train, split.y_train,
                                          task.likelihood, method.noise_scale, task.num_data, pooled=True)
                method.bnn.set_prior(laplace.alphas[0] ** -0.5)
                method.ll_alpha = laplace.alphas[0]
            if training.startswith("llprior") and due:
                with method.active():
                    la = LastLayerLaplace(method.net, method.posterior(), split.x_train, split.y_train,
                                          task.likelihood, method.noise_scale, task.num_data,
                                          ggn_draws=0 if training.startswith("llprior0") else draws, seed=taken[0])
                prior = {site: method.bnn.prior(site) for site in method.bnn.latent_sites}
                prior[f"{la.last_name}.weight"] = prior[f"{la.last_name}.bias"] = la.alpha ** -0.5
                method.bnn.set_prior(prior)
                method.ll_alpha = la.alpha

        method.step = step_and_set_prior
    start = time.time()

    def gen():
        return torch.Generator().manual_seed(task.seed)

    def scores(outputs):
        s = harness.predictive_metrics(task.likelihood, outputs, split.y_test, method.noise_scale)
        return {"nll": sd.nll_of(task, s), "ece": s.get("ece"), "acc": s.get("accuracy")}

    def evaluate(m):
        epoch = evaluate.epochs.pop(0)
        with m.active():
            row = {"task": name, "seed": seed, "training": training, "epoch": epoch,
                   "alpha_prior": getattr(m, "ll_alpha", None)}
            row["recipe"] = scores(m.predict(split.x_test, 32, gen()))
            row.update(sd.bounds(m))
            la = LastLayerLaplace(m.net, m.posterior(), split.x_train, split.y_train, task.likelihood,
                                  m.noise_scale, task.num_data, ggn_draws=draws)
            row["LL"] = scores(la.outputs(split.x_test, 32, gen()))
            row["LL"].update(alpha=la.alpha, gamma=la.gamma)
        row["seconds"] = time.time() - start
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(name, seed, training, epoch, f"recipe {row['recipe']['nll']:.4f} LL {row['LL']['nll']:.4f}",
              f"[{row['seconds']:.0f} s]", flush=True)
        return {}

    evaluate.epochs = list(epochs)
    harness.fit(method, max(epochs), evaluate, list(epochs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--training", nargs="+", default=["recipe"])
    parser.add_argument("--epochs", nargs="+", type=int, help="checkpoints (default: a third, two thirds and "
                        "all of the task's epochs)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    with open(args.out, "a") as out, pyro.validation_enabled(False):
        for name in args.tasks:
            for training in args.training:
                for seed in range(args.seeds):
                    run(name, seed, training, args.epochs, out)


if __name__ == "__main__":
    main()
