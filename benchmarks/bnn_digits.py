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
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import pyro  # noqa: E402

from pyro_ngvi import NGVIWarning  # noqa: E402

from common import (  # noqa: E402
    History, IVONMethod, MAPAdam, bayes_by_backprop, load_digits, make_net, ngvi, train,
    trace_elbo_per_datum,
)

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


def build(kind: str, params: dict, net, num_data: int):
    params = dict(params)
    if kind == "ngvi":
        tau_warmup = params.pop("tau_warmup", 0)
        if tau_warmup:
            params["tau"] = lambda t, steps=tau_warmup: min(1.0, 0.1 + 0.9 * t / steps)
        decay = params.pop("lr_decay_steps", 0)
        if decay:
            params["lr"] = lambda t, lr=params["lr"], steps=decay: lr / (1 + t / steps)
        return ngvi("ngvi", net, num_data, **params)
    if kind == "bbb":
        return bayes_by_backprop("bbb", net, num_data, **params)
    if kind == "map":
        return MAPAdam(net, num_data, **params)
    if kind == "ivon":
        return IVONMethod(net, num_data, **params)
    raise ValueError(kind)


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
def mean_sd(values: List[float], fmt: str = "{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if any(math.isnan(v) for v in values):
        return "diverged"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


def at_epoch(history: History, epoch: int):
    return history.test[history.epochs.index(epoch)] if epoch in history.epochs else None


def first_epoch_below(history: History, target: float):
    for epoch, value in zip(history.epochs, history.neg_elbo):
        if epoch > 0 and value <= target:
            return epoch
    return None


def report(results: Dict[str, List[History]], epochs: int, seeds: List[int], args) -> str:
    bbb = results.get(BBB)
    targets = [statistics.mean(h.neg_elbo[-5:]) for h in bbb] if bbb else None
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
            f"{mean_sd(targets)} (per seed: {', '.join(f'{t:.3f}' for t in targets)}).",
            "",
        ]
    header = "| method | -ELBO/N at end | epoch reaching target | train time to it (s) | "
    header += " | ".join(f"NLL@{c} | acc@{c} | ECE@{c}" for c in checkpoints)
    header += " | ms/step | ratio to SVI+Adam |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for name, hs in results.items():
        reach_time = "—"
        if math.isnan(hs[0].neg_elbo[0]):
            elbo, reach = "—", "—"
        else:
            elbo = mean_sd([h.neg_elbo[-1] for h in hs])
            if targets is None or name == BBB:
                reach = "—" if name != BBB else f"{epochs} (defines it)"
                reach_time = mean_sd([h.wall[-1] for h in hs], "{:.1f}") if name == BBB else "—"
            else:
                found = [first_epoch_below(h, t) for h, t in zip(hs, targets)]
                reach = ", ".join(str(e) if e is not None else f">{h.epochs[-1]}" for e, h in zip(found, hs))
                if all(e is not None for e in found):
                    reach_time = mean_sd([h.wall[h.epochs.index(e)] for h, e in zip(hs, found)], "{:.1f}")
        cells = []
        for c in checkpoints:
            tests = [at_epoch(h, c) for h in hs]
            if any(t is None for t in tests):
                cells += ["—"] * 3
                continue
            cells += [mean_sd([t["nll"] for t in tests]), mean_sd([t["acc"] for t in tests]),
                      mean_sd([t["ece"] for t in tests])]
        ratio = f"{ms[name] / ms[BBB]:.2f}" if BBB in ms else "—"
        lines.append(f"| {name} | {elbo} | {reach} | {reach_time} | " + " | ".join(cells) + f" | {ms[name]:.2f} | {ratio} |")
    lines += ["", "Hyperparameters:", ""]
    for name in results:
        lines.append(f"- {name}: {METHODS[name][1]}")
    lines += ["", targets_text(results, targets, checkpoints, epochs)]
    return "\n".join(lines) + "\n"


def targets_text(results, targets, checkpoints, epochs) -> str:
    """DESIGN §5 targets, checked on the seed means."""
    out = ["Targets (DESIGN §5):", ""]
    ngvis = [n for n in results if n.startswith("NGVI")]

    def mean_metric(name, c, key):
        tests = [at_epoch(h, c) for h in results[name]]
        if any(t is None for t in tests):
            return math.nan
        return statistics.mean(t[key] for t in tests)

    for name in ngvis:
        if targets:
            found = [first_epoch_below(h, t) for h, t in zip(results[name], targets)]
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


def plot(results: Dict[str, List[History]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for index, (name, hs) in enumerate(results.items()):
        style = dict(label=name, color=f"C{index}")
        epochs = hs[0].epochs
        wall = [statistics.mean(h.wall[i] for h in hs) for i in range(len(epochs))]
        elbo = [statistics.mean(h.neg_elbo[i] for h in hs) for i in range(len(epochs))]
        nll = [statistics.mean(h.test[i]["nll"] for h in hs) for i in range(len(epochs))]
        if not math.isnan(elbo[0]):
            axes[0, 0].plot(epochs, elbo, **style)
            axes[0, 1].plot(wall[1:], elbo[1:], **style)  # (epoch 0 is at time 0: off a log axis)
        axes[1, 0].plot(epochs, nll, **style)
        axes[1, 1].plot(wall[1:], nll[1:], **style)
        if name == BBB:
            target = statistics.mean(statistics.mean(h.neg_elbo[-5:]) for h in hs)
            for ax in axes[0]:
                ax.axhline(target, color="0.5", linestyle="--", linewidth=0.8)
    for ax in axes[0]:
        ax.set_ylabel("-ELBO / N (train)")
        ax.set_yscale("log")
    for ax in axes[1]:
        ax.set_ylabel("test NLL (predictive)")
        ax.set_yscale("log")
    for ax in axes[:, 0]:
        ax.set_xlabel("epoch")
    for ax in axes[:, 1]:
        ax.set_xlabel("training wall time (s)")
        ax.set_xscale("log")
    axes[1, 0].legend()  # every method has a test NLL (MAP has no ELBO)
    fig.suptitle("Digits BNN 64-100-10: mean over seeds (dashed: Pyro SVI + Adam's final -ELBO/N)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    if args.from_json:
        with open(args.from_json) as f:
            results = {name: [History(**h) for h in hs] for name, hs in json.load(f).items()}
        runs = len(next(iter(results.values())))
        return write(results, args.epochs, list(range(args.first_seed, args.first_seed + runs)), args)
    data = load_digits()
    results: Dict[str, List[History]] = {name: [] for name in names}
    eval_net = make_net(0)
    start = time.perf_counter()
    for seed in seeds:
        for name in names:
            kind, params = METHODS[name]
            pyro.set_rng_seed(seed)
            method = build(kind, params, make_net(seed), data.num_train)
            history = train(method, data, args.epochs, seed, eval_net, eval_every=args.eval_every)
            results[name].append(history)
            skipped = getattr(getattr(method, "optim", None), "num_skipped_steps", 0)
            print(f"seed {seed} {name:24s} -ELBO/N {history.neg_elbo[-1]:8.3f}  test NLL "
                  f"{history.test[-1]['nll']:.3f}  acc {history.test[-1]['acc']:.3f}  ECE "
                  f"{history.test[-1]['ece']:.3f}  {1e3 * statistics.median(history.step_times):.2f} ms/step"
                  + (f"  ({skipped} skipped steps)" if skipped else "")
                  + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
            if seed == seeds[0] and name == BBB:
                posterior = method.posterior()
                check = trace_elbo_per_datum(seed, posterior, data.x_train, data.y_train)
                print(f"  cross-check: Pyro Trace_ELBO(64 particles) -ELBO/N {check:.3f} vs ours "
                      f"{history.neg_elbo[-1]:.3f}", flush=True)
    write(results, args.epochs, seeds, args)


def write(results: Dict[str, List[History]], epochs: int, seeds: List[int], args) -> None:
    """Print the table; write it, the histories and the figure into ``args.out``."""
    text = report(results, epochs, seeds, args)
    print()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    md = args.out_md or os.path.join(args.out, "bnn_digits.md")
    with open(md, "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bnn_digits.json"), "w") as f:
        json.dump({name: [h.__dict__ for h in hs] for name, hs in results.items()}, f)
    if not args.no_plot:
        plot(results, os.path.join(args.out, "bnn_digits.png"))
    print(f"wrote {md} and {args.out}/bnn_digits.{{json,png}}")


if __name__ == "__main__":
    main()
