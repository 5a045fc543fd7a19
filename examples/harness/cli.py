"""The command line every example shares, and the process-wide settings of one run."""

import argparse
import contextlib
import time
import warnings
from pathlib import Path

import torch

import pyro

from .tasks import small_tasks, suite_tasks


def make_parser(name: str, description: str, epochs: int, unit: str = "epochs") -> argparse.ArgumentParser:
    """The options every example has: ``--epochs`` (or steps), ``--quick``, ``--out``, ``--seed``, ``--threads``."""
    parser = argparse.ArgumentParser(
        prog=f"python examples/{name}.py",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=epochs, help=f"training {unit} per method")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: a few {unit}, few samples")
    parser.add_argument("--out", type=Path, default=Path("out") / name, help="folder for the figures")
    parser.add_argument("--seed", type=int, default=0, help="random seed (data split and training)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


def parse_bnn_args(name: str, description: str, argv, epochs: int, batch_size: int, samples: int):
    """
    The options of a Bayesian-network example: :func:`make_parser`'s and
    ``--batch-size``, ``--prior-scale``, ``--samples``; ``--quick`` keeps at most
    2 epochs and 8 samples.
    """
    parser = make_parser(name, description, epochs)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--prior-scale", type=float, default=1.0, help="prior standard deviation s0")
    parser.add_argument("--samples", type=int, default=samples, help="posterior samples per prediction")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = min(args.epochs, 2), min(args.samples, 8)
    return args


@contextlib.contextmanager
def session(args):
    """
    Seed, thread count, an empty param store and the output folder for one run;
    Pyro's argument validation is off inside (it costs ~25 % of a step) and the
    global settings are restored afterwards, so tests can call ``main`` in-process.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    seed(args.seed)
    try:
        with pyro.validation_enabled(False):
            yield
    finally:
        torch.set_num_threads(threads)


def seed(value: int) -> None:
    """An empty param store and every RNG seeded: each method starts alike."""
    pyro.clear_param_store()
    pyro.set_rng_seed(value)


def suite_args(description: str, argv, seeds: int, overrides: dict, ngvi_help: str, every: bool = False):
    """The command line of the task suites (``benchmarks/bnn_suite.py``, ``smalldata.py``): tasks,
    methods, seeds, epochs, development overrides of the recipe (``KEY=VALUE``, evaluated into
    ``overrides``) and where to write the tables; one torch thread from here on."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tasks", nargs="*", help="task names (default: all)")
    parser.add_argument("--methods", nargs="*", help="method labels (default: all)")
    parser.add_argument("--seeds", type=int, default=seeds)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, help="override every task's epochs (development)")
    if every:
        parser.add_argument("--every", type=int, default=20, help="score the trajectory every this many epochs")
    parser.add_argument("--ngvi", nargs="*", default=[], metavar="KEY=VALUE", help=ngvi_help)
    parser.add_argument("--out-md", help="write the table here")
    parser.add_argument("--out-json", help="write every run's scores here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    for item in args.ngvi:
        key, _, value = item.partition("=")
        overrides[key] = eval(value)  # development only: numbers, tuples, lambdas
    return args


def run_suite(tasks: dict, args, labels, run, describe) -> dict:
    """Every (task, seed, method) of a suite, Pyro's validation off, each from an empty param
    store: ``run(task, label, epochs)`` gives a result dict (``seconds``, ``warnings``), printed
    with ``describe(task, result)``; ``tasks`` maps a name to ``(make(seed), epochs)`` (the
    epochs run are written back). Returns ``{name: {label: [result per seed]}}``."""
    names = args.tasks or list(tasks)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    results = {name: {label: [] for label in labels} for name in names}
    start = time.perf_counter()
    with pyro.validation_enabled(False):
        for name in names:
            make, epochs = tasks[name]
            epochs = args.epochs or epochs
            tasks[name] = (make, epochs)
            for seed in seeds:
                for label in labels:
                    pyro.clear_param_store()
                    task = make(seed)
                    result = run(task, label, epochs)
                    results[name][label].append(result)
                    warned = result.get("warnings") or []
                    print(f"{name:18s} seed {seed} {label:14s} {describe(task, result)}  {result['seconds']:.1f} s"
                          + (f"  warnings {len(warned)}" if warned else "")
                          + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
                    for message in warned[:3]:
                        print("    " + message)
    return results


@contextlib.contextmanager
def probe(task_name: str, seed: int):
    """
    One run of a benchmark probe on a task of :func:`~harness.tasks.suite_tasks` or
    :func:`~harness.tasks.small_tasks` by name: one thread, BackPACK's hook warning
    silenced, an empty param store, Pyro's validation off inside; yields the task.
    """
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    make, _ = {**suite_tasks(), **small_tasks()}[task_name]
    pyro.clear_param_store()
    with pyro.validation_enabled(False):
        yield make(seed)
