"""
The main demo's training time (issue 24: NGVI's at most ivon-opt's): the digits MLP 64-100-10
of ``examples/bnn_classification.py``, 100 epochs of minibatches of 128, seed 0, for the
recipe with each curvature source and for ivon-opt as the demo runs it. Each training runs in a
fresh forked process (the allocator state one method leaves decides how often the next
page-faults), the methods take turns round by round; only the steps are timed
(``harness.fit``'s step times). Prints the median seconds per method and its ratio to
ivon-opt's.

Usage::

    python benchmarks/demo_time.py [--rounds 3] [--epochs 100]
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pyro  # noqa: E402

import harness  # noqa: E402
from bnn_classification import digits_task  # noqa: E402

METHODS = {
    "NGVI ggn (the demo's)": lambda task: harness.ngvi_recipe(task, "ggn"),
    "NGVI ef": lambda task: harness.ngvi_recipe(task, "ef"),
    "NGVI reparam": lambda task: harness.ngvi_recipe(task, "reparam"),
    "ivon-opt": lambda task: harness.IVON(task, lr=0.1, hess_init=1.0),
}


def train_seconds(name: str, epochs: int) -> float:
    """Seconds of training steps of ``name``, in a forked process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child trains and reports
        os.close(read)
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        pyro.clear_param_store()
        harness.seed(0)
        with pyro.validation_enabled(False):
            history = harness.fit(METHODS[name](digits_task(0)), epochs)
        os.write(write, json.dumps(sum(history.step_times)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not harness.ivon_installed():
        raise SystemExit("ivon-opt is not installed: pip install -e '.[bench]'")
    seconds = {name: [] for name in METHODS}
    for _ in range(args.rounds):
        for name in METHODS:
            seconds[name].append(train_seconds(name, args.epochs))
    medians = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
    print(f"\nMain demo training, {args.epochs} epochs, median of {args.rounds} rounds (one thread)\n")
    print("| method | train s (median) | all rounds | / ivon-opt |")
    print("|---|---:|---|---:|")
    for name, value in medians.items():
        rounds = ", ".join(f"{v:.2f}" for v in seconds[name])
        print(f"| {name} | {value:.2f} | {rounds} | {value / medians['ivon-opt']:.2f} |")
    return medians


if __name__ == "__main__":
    main()
