"""
Continual learning on digits, several seeds: NGVI posterior-as-prior against VCL
(Bayes-by-Backprop with Adam), fine-tuning and MAP with an L2 pull.

The experiments, methods and metrics are those of
``examples/continual_learning.py`` (imported from there, not copied): permuted
digits (5 tasks, single head, MLP 64-100-10) and split digits (5 two-class tasks,
multi-head). Each seed changes the train/test split, the permutations, the
initialisation and the minibatch order; all methods of a seed share them.

``--tune`` instead runs the grid below (one knob changed from the defaults
per row) on permuted digits with ``--tune-seed`` (default 0), the seed the
settings were explored on; the reported seeds default to 1, 2, 3, never used
while tuning.

**How the defaults were found** (seed 0, permuted digits, 1 thread on a loaded
2-core machine; accuracy = average over the 5 tasks after the last one):

* First task alone, 5 epochs, prior N(0, 1), untempered: NGVI's mean step
  ``lr * g / (precision + damping)`` overshoots wherever the diagonal curvature
  is small (most first-layer weights): ``ggn`` diverged at lr 0.03-0.3 with or
  without damping 30-300; ``ef`` reached 82-96 % but oscillated between epochs.
  Momentum 0.9 removed the oscillation (ef, lr 0.03, damping 30: 88 -> 94 %
  monotonically). Bayes-by-Backprop with init_scale 1e-3 reached 97 %, its
  scales barely moving from their initial value.
* Untempered (kl_weight 1) or prior N(0, 1), the true mean-field posterior is
  wide (first-layer standard deviations 0.3-0.9) and both chains forget or fail
  to learn: NGVI 25-52 %. Tempering the likelihood (kl_weight 0.005, the same
  for NGVI and VCL) and a N(0, 0.1^2) first prior: NGVI 51-59 % over lr
  {0.003, 0.01, 0.03}, beta {0.01, 0.03, 0.1}, epochs {5, 10, 15}, ef/ggn.
* What forgets is task 1 after task 2 (97 % -> ~30 %): the diagonal curvature
  of a fitted task is small, so the next task moves the shared weights by
  several posterior standard deviations. A small init_scale (0.01) with a slow
  precision average (beta 0.01, 0.003) keeps the precision closer to its
  initial 1e4 and forgets less: 62.4 % (beta 0.01), 63.1 % (beta 0.003).
  We keep beta 0.01, where the curvature still sets about two thirds of the
  precision in each task. VCL's best: init_scale 0.01 (60.6 %; 1e-3: 45 %, it
  cannot learn new tasks; 0.05: 52-53 %), lr 3e-3 or 1e-2 (60.4 %).
* The ``--tune`` table (seed 0) then: every NGVI knob within about 2 points
  of the defaults except beta >= 0.03, init_scale 0.003 / 0.1, 5 epochs and no
  tempering; carrying the precision (``start_task(carry=True)``) or resetting
  it (``carry=False``) made no difference beyond that noise (62.4 vs 62.8 %).
  The L2 pull was weakest at the strength first used (1e-2: 55.2 %; 0.1:
  59.9 %), so the baseline uses 0.1. VCL with 10 epochs instead of 20: 59.2 %
  in half the time.

Usage::

    python benchmarks/continual.py [--seeds 1 2 3] [--experiments permuted split]
        [--out out/continual_benchmark] [--threads 1] [--set FIELD=VALUE ...]
    python benchmarks/continual.py --tune [--tune-seed 0] [--out ...]
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Dict, List

import torch
from tqdm.auto import tqdm

_EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples",
                        "continual_learning.py")


def load_example():
    """``examples/continual_learning.py`` as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("continual_learning", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cl = load_example()
sys.path.insert(0, os.path.dirname(_EXAMPLE))
import harness  # noqa: E402  (examples/harness)

NGVI, VCL, FINE_TUNING = "NGVI (ours)", "VCL (BBB, Adam)", "Fine-tuning (MAP)"

# The grid around the chosen defaults (one knob changed per row), run by
# ``--tune`` on a seed that is not reported. (label, method, Config overrides)
TUNING_GRID = [
    ("defaults", NGVI, {}),
    ("curvature ggn", NGVI, {"ngvi_curvature": "ggn"}),
    ("carry=False (mean kept, precision reset to init)", NGVI, {"ngvi_carry": False}),
    ("lr 0.003", NGVI, {"ngvi_lr": 0.003}),
    ("lr 0.03", NGVI, {"ngvi_lr": 0.03}),
    ("beta 0.003", NGVI, {"ngvi_beta": 0.003}),
    ("beta 0.03", NGVI, {"ngvi_beta": 0.03}),
    ("beta 0.1", NGVI, {"ngvi_beta": 0.1}),
    ("init_scale 0.003", NGVI, {"ngvi_init_scale": 0.003}),
    ("init_scale 0.1", NGVI, {"ngvi_init_scale": 0.1}),
    ("damping 0", NGVI, {"ngvi_damping": 0.0}),
    ("momentum 0", NGVI, {"ngvi_momentum": 0.0}),
    ("epochs 5", NGVI, {"ngvi_epochs": 5}),
    ("epochs 15", NGVI, {"ngvi_epochs": 15}),
    ("batch 64", NGVI, {"ngvi_batch_size": 64}),
    ("kl_weight 0.02", NGVI, {"kl_weight": 0.02}),
    ("kl_weight 1 (untempered)", NGVI, {"kl_weight": 1.0}),
    ("prior_scale 1", NGVI, {"prior_scale": 1.0}),
    ("defaults", VCL, {}),
    ("init_scale 1e-3", VCL, {"vcl_init_scale": 1e-3}),
    ("init_scale 0.05", VCL, {"vcl_init_scale": 0.05}),
    ("lr 1e-2", VCL, {"vcl_lr": 1e-2}),
    ("epochs 10", VCL, {"vcl_epochs": 10}),
    ("kl_weight 0.02", VCL, {"kl_weight": 0.02}),
    ("defaults", FINE_TUNING, {}),
    ("strength 1e-3", "MAP + L2 pull", {"l2_strength": 1e-3}),
    ("strength 1e-2", "MAP + L2 pull", {"l2_strength": 1e-2}),
    ("strength 0.1 (default)", "MAP + L2 pull", {}),
    ("strength 1", "MAP + L2 pull", {"l2_strength": 1.0}),
]


def summary_table(results) -> str:
    """Mean ± standard deviation over seeds, per experiment and method."""
    lines = [
        "| experiment | method | avg. accuracy (%) | forgetting (pts) | train time (s) | time / VCL |",
        "|---|---|---:|---:|---:|---:|",
    ]
    groups: Dict[tuple, List] = {}
    for r in results:
        groups.setdefault((r.experiment, r.method), []).append(r)
    for (experiment, method), runs in groups.items():
        reference = {r.config["seed"]: r.train_seconds for r in results
                     if r.experiment == experiment and r.method == VCL}
        ratios = [r.train_seconds / reference[r.config["seed"]] for r in runs
                  if r.config["seed"] in reference]
        ratio = f"{statistics.mean(ratios):.2f}" if ratios else "-"
        lines.append(
            f"| {experiment} | {method} | {harness.mean_sd([100 * r.average_accuracy for r in runs], '.1f')} | "
            f"{harness.mean_sd([100 * r.forgetting for r in runs], '.1f')} | "
            f"{harness.mean_sd([r.train_seconds for r in runs], '.1f')} | {ratio} |"
        )
    return "\n".join(lines)


def target_check(results) -> str:
    """The issue's target on permuted digits, per seed and on the seed means."""
    runs = {(r.method, r.config["seed"]): r for r in results if r.experiment == "permuted"}
    seeds = sorted({seed for _, seed in runs})
    if not all((m, s) in runs for m in (NGVI, VCL, FINE_TUNING) for s in seeds) or not seeds:
        return ""

    def avg(method):
        return statistics.mean(100 * runs[(method, s)].average_accuracy for s in seeds)

    def seconds(method):
        return statistics.mean(runs[(method, s)].train_seconds for s in seeds)

    ngvi, vcl, fine = avg(NGVI), avg(VCL), avg(FINE_TUNING)
    ratio = seconds(NGVI) / seconds(VCL)
    checks = [
        (f"NGVI avg. accuracy >= VCL's: {ngvi:.1f} vs {vcl:.1f} ({ngvi - vcl:+.1f} pts)", ngvi >= vcl),
        (f"NGVI >= fine-tuning + 5: {ngvi:.1f} vs {fine:.1f} + 5 ({ngvi - fine - 5:+.1f} pts)",
         ngvi >= fine + 5),
        (f"NGVI wall time <= 1/3 of VCL's: ratio {ratio:.2f}", ratio <= 1 / 3),
    ]
    lines = [f"Target (permuted digits, mean over seeds {seeds}):", ""]
    lines += [f"- [{'x' if ok else ' '}] {text}" for text, ok in checks]
    per_seed = ", ".join(
        f"seed {s}: {100 * (runs[(NGVI, s)].average_accuracy - runs[(VCL, s)].average_accuracy):+.1f} / "
        f"{100 * (runs[(NGVI, s)].average_accuracy - runs[(FINE_TUNING, s)].average_accuracy):+.1f} / "
        f"{runs[(NGVI, s)].train_seconds / runs[(VCL, s)].train_seconds:.2f}"
        for s in seeds
    )
    lines += ["", f"Per seed (NGVI - VCL pts / NGVI - fine-tuning pts / time ratio): {per_seed}"]
    return "\n".join(lines)


def run_seeds(args) -> None:
    results = []
    start = time.perf_counter()
    for seed in tqdm(args.seeds, desc="seeds", file=sys.stderr):
        cfg = replace(cl.Config(), seed=seed, **cl.parse_overrides(args.set))
        for experiment in args.experiments:
            results += cl.run_experiment(experiment, cfg, args.methods, quiet=args.quiet)
    os.makedirs(args.out, exist_ok=True)
    first = [r for r in results if r.config["seed"] == args.seeds[0]]
    cl.write_outputs(first, args.out)  # figures and table of the first seed
    defaults = cl.Config()
    report = "\n\n".join(
        part for part in (
            f"Continual learning on digits: {defaults.tasks} tasks, seeds {args.seeds}, "
            f"{torch.get_num_threads()} torch thread(s); total {time.perf_counter() - start:.0f} s.",
            summary_table(results),
            target_check(results),
            "Per-seed tables, accuracy matrices: see results.md and the PNGs (first seed).",
        ) if part
    )
    with open(os.path.join(args.out, "benchmark.md"), "w") as f:
        f.write(report + "\n")
    print(report)


def run_tuning(args) -> None:
    rows = ["| method | setting | avg. accuracy (%) | forgetting (pts) | train time (s) |",
            "|---|---|---:|---:|---:|"]
    tasks = None
    for label, method, overrides in tqdm(TUNING_GRID, desc="tuning", file=sys.stderr):
        cfg = replace(cl.Config(), seed=args.tune_seed, **overrides)
        if tasks is None or cfg.tasks != len(tasks):
            tasks = cl.load_tasks("permuted", cfg)
        r = cl.run_method("permuted", method, cfg, tasks, quiet=True)
        rows.append(f"| {method} | {label} | {100 * r.average_accuracy:.1f} | "
                    f"{100 * r.forgetting:.1f} | {r.train_seconds:.1f} |")
    report = (f"Tuning on permuted digits, seed {args.tune_seed}; "
              "one knob changed from the defaults per row.\n\n" + "\n".join(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tuning.md"), "w") as f:
        f.write(report + "\n")
    print(report)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--experiments", nargs="+", choices=cl.EXPERIMENTS, default=list(cl.EXPERIMENTS))
    parser.add_argument("--methods", nargs="+", choices=cl.METHODS, default=list(cl.METHODS))
    parser.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="override example Config fields for every run")
    parser.add_argument("--out", default=os.path.join("out", "continual_benchmark"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tune", action="store_true", help="run the tuning grid instead")
    parser.add_argument("--tune-seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tune:
        run_tuning(args)
    else:
        run_seeds(args)


if __name__ == "__main__":
    main()
