"""
Every method side by side on a Bayesian MLP for scikit-learn digits (issue #4,
part 3; DESIGN §5), one run, several seeds.

Setting: digits, stratified 70/30 train/test split (``random_state=0``),
standardised with the training set's statistics; MLP 64-100-10 (ReLU);
minibatches of 128 (a fresh permutation per epoch, the same for every method of
a seed); Categorical likelihood; prior N(0, 1) on every weight; every method
starts from the same PyTorch initialisation of the network (seeded).

Methods (hyperparameters in :data:`METHODS`, overridable with ``--set``):

* NGVI ``ef`` / ``ggn``: Pyro ``SVI`` + :class:`~pyro_ngvi.NGVI` +
  ``CurvatureELBO("ef" | "ggn")`` on a :class:`~pyro_ngvi.BayesianNet` with
  ``AutoNormal`` (the BackPACK fast path);
* Pyro SVI + Adam: ``pyro.optim.Adam`` + ``Trace_ELBO`` on the same model and
  guide (Bayes-by-Backprop);
* MAP Adam on the plain network (weight decay = the prior);
* ivon-opt's ``IVON`` (``ess = N``, ``weight_decay = 1/N``).

Reported, mean ± sd over seeds:

* ``-ELBO / N`` on the training set, evaluated identically for every Bayesian
  method from its mean and standard deviation: 8 weight samples (the same draws
  for every method and epoch) for the expected log-likelihood plus the
  closed-form KL to the prior (ivon: ``std = 1 / sqrt(ess (hess + weight_decay))``).
  The target is the value Pyro SVI + Adam has after the last epoch (mean of its
  last five epochs, per seed); for every other method the first epoch at
  which it is at or below that seed's target.
* Test NLL, accuracy and ECE (15 bins) of the posterior predictive (32 weight
  samples; MAP: the point estimate) at epochs 10, 50 and the last.
* Median ms per training step and its ratio to Pyro SVI + Adam (training
  only: evaluation is not timed).

Writes ``bnn_digits.md``, ``bnn_digits.png`` (``-ELBO/N`` and test NLL against
epochs and against training wall time) and ``bnn_digits.json`` (all histories)
into ``--out`` (default ``out/bench``).

Usage::

    python benchmarks/bnn_digits.py [--epochs 200] [--seeds 3] [--out out/bench]
        [--methods "NGVI ggn" ...] [--set "NGVI ggn.lr=0.05" ...] [--threads 1]
        [--from-json OUT/bnn_digits.json]   (re-report a previous run, no training)
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import torch  # noqa: E402

import pyro  # noqa: E402

from pyro_ngvi import NGVIWarning  # noqa: E402

import harness  # noqa: E402  (examples/harness)
from harness import History  # noqa: E402

BBB = "Pyro SVI + Adam (BBB)"
CHECKPOINTS = (10, 50, 200)

#: label -> (factory, hyperparameters). Chosen on seed 0 (see benchmarks/README.md).
METHODS: Dict[str, tuple] = {
    "NGVI ef": ("ngvi", dict(curvature="ef", lr=0.03, beta=0.05, momentum=0.9, damping=0.0,
                             num_particles=1, init_scale=0.1)),
    "NGVI ggn": ("ngvi", dict(curvature="ggn", lr=0.1, beta=0.1, momentum=0.8, damping=30.0,
                              num_particles=16, init_scale=0.1)),
    BBB: ("bbb", dict(lr=1e-2, init_scale=0.1)),
    "MAP Adam": ("map", dict(lr=3e-3)),
    "ivon-opt": ("ivon", dict(lr=0.3, hess_init=0.003, beta2=0.9999)),
}


def build(kind: str, params: dict, task: harness.Task) -> harness.Method:
    params = dict(params)
    if kind == "ngvi":
        tau_warmup = params.pop("tau_warmup", 0)
        if tau_warmup:
            params["tau"] = lambda t, steps=tau_warmup: min(1.0, 0.1 + 0.9 * t / steps)
        decay = params.pop("lr_decay_steps", 0)
        if decay:
            params["lr"] = lambda t, lr=params["lr"], steps=decay: lr / (1 + t / steps)
        return harness.ngvi(task, **params)
    factory = {"bbb": harness.bayes_by_backprop, "map": harness.MAP, "ivon": harness.IVON}[kind]
    return factory(task, **params)


def parse_overrides(items: List[str], methods: Dict[str, tuple]):
    for item in items or []:
        target, _, value = item.partition("=")
        label, _, key = target.rpartition(".")
        if label not in methods:
            raise SystemExit(f"--set: unknown method {label!r}; one of {list(methods)}")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        methods[label][1][key] = value


# ------------------------------------------------------------------ report
def neg_elbo_per_datum(history: History, num_data: int) -> List[float]:
    """-ELBO / N at every scored epoch (empty for a point estimate)."""
    return [-value / num_data for value in history.scores.get("elbo", [])]


def first_epoch_below(history: History, target: float, num_data: int):
    for epoch, value in zip(history.epoch, neg_elbo_per_datum(history, num_data)):
        if epoch > 0 and value <= target:
            return epoch
    return None


def report(results: Dict[str, List[History]], epochs: int, seeds: List[int], num_data: int) -> str:
    bbb = results.get(BBB)
    targets = [statistics.mean(neg_elbo_per_datum(h, num_data)[-5:]) for h in bbb] if bbb else None
    ms = {name: 1e3 * statistics.median([t for h in hs for t in h.step_times]) for name, hs in results.items()}
    checkpoints = [c for c in CHECKPOINTS if c < epochs] + [epochs]
    lines = [
        f"## Digits BNN (64-100-10, batch 128, prior N(0, 1)): {len(seeds)} seed(s), {epochs} epochs",
        "",
        f"torch {torch.__version__}, pyro {pyro.__version__}, {torch.get_num_threads()} thread(s). "
        "mean ± sd over seeds. -ELBO/N: training set, 8 common weight samples + closed-form KL.",
        "",
    ]
    if targets:
        lines += [
            f"Target: Pyro SVI + Adam's -ELBO/N after {epochs} epochs (mean of its last 5 epochs): "
            f"{harness.mean_sd(targets)} (per seed: {', '.join(f'{t:.3f}' for t in targets)}).",
            "",
        ]
    header = "| method | -ELBO/N at end | epoch reaching target | train time to it (s) | "
    header += " | ".join(f"NLL@{c} | acc@{c} | ECE@{c}" for c in checkpoints)
    header += " | ms/step | ratio to SVI+Adam |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for name, hs in results.items():
        reach_time = "—"
        if "elbo" not in hs[0].scores:
            elbo, reach = "—", "—"
        else:
            elbo = harness.mean_sd([neg_elbo_per_datum(h, num_data)[-1] for h in hs])
            if targets is None or name == BBB:
                reach = "—" if name != BBB else f"{epochs} (defines it)"
                reach_time = harness.mean_sd([h.time[-1] for h in hs], ".1f") if name == BBB else "—"
            else:
                found = [first_epoch_below(h, t, num_data) for h, t in zip(hs, targets)]
                reach = ", ".join(str(e) if e is not None else f">{h.epoch[-1]}" for e, h in zip(found, hs))
                if all(e is not None for e in found):
                    reach_time = harness.mean_sd([h.time[h.epoch.index(e)] for h, e in zip(hs, found)], ".1f")
        cells = []
        for c in checkpoints:
            scores = [h.at(c) for h in hs]
            if any(s is None for s in scores):
                cells += ["—"] * 3
                continue
            cells += [harness.mean_sd([s[key] for s in scores]) for key in ("nll", "accuracy", "ece")]
        ratio = f"{ms[name] / ms[BBB]:.2f}" if BBB in ms else "—"
        lines.append(f"| {name} | {elbo} | {reach} | {reach_time} | " + " | ".join(cells)
                     + f" | {ms[name]:.2f} | {ratio} |")
    lines += ["", "Hyperparameters:", ""]
    for name in results:
        lines.append(f"- {name}: {METHODS[name][1]}")
    lines += ["", targets_text(results, targets, checkpoints, epochs, num_data)]
    return "\n".join(lines) + "\n"


def targets_text(results, targets, checkpoints, epochs, num_data) -> str:
    """DESIGN §5 targets, checked on the seed means."""
    out = ["Targets (DESIGN §5):", ""]
    ngvis = [n for n in results if n.startswith("NGVI")]

    def mean_metric(name, c, key):
        scores = [h.at(c) for h in results[name]]
        if any(s is None for s in scores):
            return math.nan
        return statistics.mean(s[key] for s in scores)

    for name in ngvis:
        if targets:
            found = [first_epoch_below(h, t, num_data) for h, t in zip(results[name], targets)]
            ok = all(e is not None and e <= 20 for e in found)
            out.append(f"- {name} reaches SVI+Adam's {epochs}-epoch ELBO in <= 20 epochs: "
                       f"{'yes' if ok else 'NO'} (epochs: {found})")
        for other in (BBB, "ivon-opt", "MAP Adam"):
            if other not in results:
                continue
            keys = ("ece",) if other == "MAP Adam" else ("nll", "ece")
            for key in keys:
                rows = []
                for c in checkpoints:
                    a, b = mean_metric(name, c, key), mean_metric(other, c, key)
                    rows.append(f"@{c}: {a:.3f} vs {b:.3f} {'ok' if a <= b else 'WORSE'}")
                out.append(f"- {name} {key.upper()} <= {other}: " + "; ".join(rows))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="*", help="labels of the methods to run (default: all)")
    parser.add_argument("--set", nargs="*", dest="overrides", metavar="METHOD.KEY=VALUE",
                        help='override a hyperparameter, e.g. "NGVI ggn.lr=0.05"')
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    parser.add_argument("--out-md", help="markdown file (default OUT/bnn_digits.md)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--from-json", metavar="FILE",
                        help="no training: rewrite the table and figure from a previous run's bnn_digits.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    warnings.simplefilter("ignore", NGVIWarning)  # skipped steps are counted and printed
    parse_overrides(args.overrides, METHODS)
    names = args.methods or list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    task = harness.digits_mlp()
    if args.from_json:
        with open(args.from_json) as f:
            results = {name: [History(**h) for h in hs] for name, hs in json.load(f).items()}
        runs = len(next(iter(results.values())))
        return write(results, args.epochs, list(range(args.first_seed, args.first_seed + runs)), task, args)
    results: Dict[str, List[History]] = {name: [] for name in names}
    eval_epochs = [0, *range(args.eval_every, args.epochs + 1, args.eval_every), args.epochs]
    start = time.perf_counter()
    for seed in seeds:
        seeded = replace(task, seed=seed)  # the split stays; initial weights and minibatch order change
        for name in names:
            kind, params = METHODS[name]
            method = build(kind, params, seeded)
            history = harness.fit(method, args.epochs, harness.evaluator(seeded, seed=seed), eval_epochs)
            results[name].append(history)
            last = history.at(args.epochs)
            skipped = getattr(method.optim, "num_skipped_steps", 0)
            elbo = f"-ELBO/N {-last['elbo'] / task.num_data:8.3f}" if "elbo" in last else " " * 16
            print(f"seed {seed} {name:24s} {elbo}  test NLL {last['nll']:.3f}  acc {last['accuracy']:.3f}  "
                  f"ECE {last['ece']:.3f}  {1e3 * history.seconds_per_step:.2f} ms/step"
                  + (f"  ({skipped} skipped steps)" if skipped else "")
                  + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
            if seed == seeds[0] and name == BBB:
                check = -harness.trace_elbo(seeded, method.posterior()) / task.num_data
                print(f"  cross-check: Pyro Trace_ELBO(64 particles) -ELBO/N {check:.3f} vs ours "
                      f"{-last['elbo'] / task.num_data:.3f}", flush=True)
    write(results, args.epochs, seeds, task, args)


def write(results: Dict[str, List[History]], epochs: int, seeds: List[int], task: harness.Task, args) -> None:
    """Print the table; write it, the histories and the figure into ``args.out``."""
    text = report(results, epochs, seeds, task.num_data)
    print()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    md = args.out_md or os.path.join(args.out, "bnn_digits.md")
    with open(md, "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bnn_digits.json"), "w") as f:
        json.dump({name: [h.__dict__ for h in hs] for name, hs in results.items()}, f)
    if not args.no_plot:
        bbb = results.get(BBB)
        target = statistics.mean(-statistics.mean(h.scores["elbo"][-5:]) / task.num_data for h in bbb) if bbb else None
        harness.plot_training(results, "nll", "test NLL (predictive)", os.path.join(args.out, "bnn_digits.png"),
                              num_data=task.num_data, target=target,
                              title="Digits BNN 64-100-10: mean over seeds (dashed: Pyro SVI + Adam's final -ELBO/N)")
    print(f"wrote {md} and {args.out}/bnn_digits.{{json,png}}")


if __name__ == "__main__":
    main()
