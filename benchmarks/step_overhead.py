"""
The fixed cost of one step (issue 24), counted rather than timed: per ``SVI.step`` of the
recipe (``bnn.guide()``, ``NGVI()``, ``CurvatureELBO(source)``) the torch operations dispatched
from Python, the casts among them (``aten::_to_copy``: a Python number cast to a tensor's dtype,
3-4 us each on the CPU) and the Python and C function calls (cProfile), against ivon-opt's loop;
beside them the fastest of ``--blocks`` blocks of ``--block`` steps, the methods' blocks taking
turns (a minimum: the least disturbed by other processes on a shared machine). The counts do not depend on the machine's
load; run the script in two checkouts to compare them.

Tasks: the main demo's digits MLP 64-100-10 (``digits``) and the MLP 784-100-100-10 on synthetic
data of ``bnn_step.py --sections recipe`` (``w100``); minibatches of 128, one thread, Pyro's
validation off, after ``--warmup`` steps.

Usage::

    python benchmarks/step_overhead.py [--tasks digits w100] [--blocks 12] [--block 25]
"""

import argparse
import cProfile
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyro  # noqa: E402

import harness  # noqa: E402
from bnn_classification import digits_task  # noqa: E402

SOURCES = ("ggn", "ef", "reparam", "ivon-opt")


class _Dispatched(TorchDispatchMode):
    """Counts the operations dispatched from Python."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def make(task_name: str, source: str):
    if task_name == "digits":
        task, hess_init = digits_task(0), 1.0
    else:
        import bnn_step
        task, hess_init = bnn_step.mlp_task(int(task_name[1:])), 0.5
    if source == "ivon-opt":
        return harness.IVON(task, lr=0.1, hess_init=hess_init)
    return harness.ngvi_recipe(task, source)


def counts(method, x, y) -> dict:
    """The operations, casts and function calls of one step of ``method`` (after its warm-up)."""
    with _Dispatched() as dispatched:
        method.step(x, y)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(10):
            method.step(x, y)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        method.step(x, y)
    profiler.disable()
    return {"ops": dispatched.count, "casts": sum(1 for e in trace.events() if e.name == "aten::_to_copy") / 10,
            "calls": sum(v[1] for v in pstats.Stats(profiler).stats.values()) / 10}


def measure(task_name: str, warmup: int, blocks: int, block: int) -> dict:
    """Per method: :func:`counts`, and the fastest of ``blocks`` blocks of ``block`` steps, the
    methods' blocks taking turns (so that the machine's load hits them alike)."""
    rows, methods = {}, {}
    for source in SOURCES:
        pyro.clear_param_store()
        harness.seed(0)
        methods[source] = method = make(task_name, source)
        x, y = method.task.split.x_train[:128], method.task.split.y_train[:128]
        with pyro.validation_enabled(False), method.active():
            for _ in range(warmup):
                method.step(x, y)
            rows[source] = counts(method, x, y)
            rows[source]["times"] = []
    for _ in range(blocks):
        for source, method in methods.items():
            x, y = method.task.split.x_train[:128], method.task.split.y_train[:128]
            with pyro.validation_enabled(False), method.active():
                start = time.perf_counter()
                for _ in range(block):
                    method.step(x, y)
                rows[source]["times"].append((time.perf_counter() - start) / block)
    for row in rows.values():
        row["ms"] = min(row.pop("times")) * 1e3
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=["digits", "w100"])
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--block", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    if not harness.ivon_installed():
        raise SystemExit("ivon-opt is not installed: pip install -e '.[bench]'")
    print(f"\nFixed cost per step (one thread; load average {os.getloadavg()[0]:.2f} at the end)\n")
    print("| task | method | ops dispatched | casts | Python/C calls | fastest block ms/step | / ivon-opt |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for task_name in args.tasks:
        rows = measure(task_name, args.warmup, args.blocks, args.block)
        for source, row in rows.items():
            label = source if source == "ivon-opt" else f"NGVI `{source}`"
            print(f"| {task_name} | {label} | {row['ops']} | {row['casts']:.0f} | {row['calls']:.0f} | "
                  f"{row['ms']:.3f} | {row['ms'] / rows['ivon-opt']['ms']:.2f} |")


if __name__ == "__main__":
    main()
