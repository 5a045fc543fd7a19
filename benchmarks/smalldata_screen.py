"""
Issue 26 screen (development): one method on several ``harness.small_tasks`` tasks and seeds,
one line per run with the test NLL (regression: -log-lik) every ``--every`` epochs, the test ECE
at the end, and the training NLL per datum and accuracy of the predictive (32 draws) at the end.
METHOD is a Python expression of ``task``, as in ``smalldata_probe.py``.

Usage::

    TQDM_DISABLE=1 OMP_NUM_THREADS=1 python benchmarks/smalldata_screen.py METHOD --tasks T... [--seeds 0 1 2]
        [--epochs 300] [--every 100]
"""

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from pyro_ngvi import elementwise  # noqa: E402

import harness  # noqa: E402
import smalldata as sd  # noqa: E402
from smalldata_probe import method_of  # noqa: E402


def train_scores(task, method):
    """Training NLL per datum (regression: -log-lik) and accuracy of the predictive (32 draws)."""
    split = task.split
    with method.active():
        outputs = method.predict(split.x_train, 32, torch.Generator().manual_seed(task.seed))
        scores = harness.predictive_metrics(task.likelihood, outputs, split.y_train, method.noise_scale)
    return sd.nll_of(task, scores), scores.get("accuracy", float("nan"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("method")
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    for name in args.tasks:
        finals = []
        for seed in args.seeds:
            start = time.time()
            if hasattr(elementwise, "_H26"):  # (the state of results/smalldata_fifth_attempt.patch, if applied)
                elementwise._H26.clear()
            with harness.probe(name, seed) as task:
                method = method_of(args.method, task)
                nlls = []

                def evaluate(m, epoch):
                    scores = sd.score(task, m)
                    nlls.append(sd.nll_of(task, scores))
                    if epoch == args.epochs:
                        nlls.append(scores.get("ece", float("nan")))

                harness.fit_every(method, args.epochs, args.every, evaluate)
                train_nll, train_acc = train_scores(task, method)
            finals.append(nlls[-2])
            print(f"{name} seed {seed}: nll " + " ".join(f"{v:.4f}" for v in nlls[:-1])
                  + f" ece {nlls[-1]:.4f} | train nll {train_nll:.4f} acc {train_acc:.3f} [{time.time() - start:.0f} s]",
                  flush=True)
        if len(finals) > 1:
            print(f"{name} mean of {len(finals)}: {statistics.mean(finals):.4f}", flush=True)


if __name__ == "__main__":
    main()
