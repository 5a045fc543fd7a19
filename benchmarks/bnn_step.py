"""
Time per step of a Bayesian MLP on scikit-learn digits (issue #3, DESIGN §5).

Setting: digits standardised, 70 % stratified training split (N = 1257),
MLP 64-100-10 (ReLU), minibatches of 128, Categorical likelihood, prior N(0, 1),
one torch thread for every method (``--threads``). Methods:

* NGVI on Pyro ``SVI`` with a :class:`~pyro_ngvi.BayesianNet` + ``AutoNormal`` and
  ``CurvatureELBO("ef" | "ggn" | "ggn_mc" | "reparam")`` (the BackPACK fast path);
* NGVI with a plain ``Trace_ELBO`` (curvature recovered from its gradients);
* Pyro ``SVI`` + ``pyro.optim.Adam`` + ``Trace_ELBO`` on the same model and guide
  (Bayes-by-Backprop), the reference of the ``reparam`` target;
* VOGN written by hand in plain PyTorch + BackPACK (sampled weights copied into
  the net, ``SumGradSquared`` / ``DiagGGNExact`` / ``DiagGGNMC``, the update in a
  few lines), the reference of the BackPACK target;
* MAP with ``torch.optim.Adam``; ``ivon.IVON`` (ivon-opt).

All methods step through the same fixed sequence of full minibatches. After a
warm-up they run interleaved in blocks of ``--block`` steps (so that load from
other processes hits them alike); the table gives the median wall-clock (and
CPU) time over ``--steps`` timed steps per method.

Targets (DESIGN §5): a BackPACK-path step <= 1.3x the hand-written VOGN step
with the same BackPACK extension; the ``reparam`` paths (``CurvatureELBO
("reparam")`` and NGVI + ``Trace_ELBO``) <= 1.15x Pyro SVI + Adam.

Usage::

    python benchmarks/bnn_step.py [--steps 400] [--warmup 50] [--block 50]
        [--threads 1] [--no-validation] [--out FILE.md] [--profile METHOD]
"""

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from dataclasses import replace
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import torch  # noqa: E402

import pyro  # noqa: E402

from pyro_ngvi import NGVIWarning  # noqa: E402

import harness  # noqa: E402  (examples/harness)

SVI_ADAM = "Pyro SVI + Adam (Trace_ELBO, BBB)"
VOGN_REF = "hand-written VOGN (SumGradSquared)"

# Settings that stay finite over the timed steps for every curvature source (the
# cost of a step does not depend on them; a non-finite step would take another
# code path, so NGVIWarning is an error here).
NGVI_ARGS = dict(lr=0.01, beta=0.05, momentum=0.9, damping=30.0)
VOGN_ARGS = NGVI_ARGS  # the same update (momentum included) by hand


def methods(task: harness.Task) -> Dict[str, Callable]:
    """Label -> factory of the method; all start from the same network."""
    return {
        "NGVI + CurvatureELBO('ef') (BackPACK)": lambda: harness.ngvi(task, "ef", **NGVI_ARGS),
        "NGVI + CurvatureELBO('ggn') (BackPACK)": lambda: harness.ngvi(task, "ggn", **NGVI_ARGS),
        "NGVI + CurvatureELBO('ggn_mc') (BackPACK)": lambda: harness.ngvi(task, "ggn_mc", **NGVI_ARGS),
        "NGVI + CurvatureELBO('reparam')": lambda: harness.ngvi(task, "reparam", **NGVI_ARGS),
        "NGVI + Trace_ELBO (reparam from grads)": lambda: harness.ngvi(task, None, **NGVI_ARGS),
        SVI_ADAM: lambda: harness.bayes_by_backprop(task, lr=1e-3),
        VOGN_REF: lambda: harness.HandVOGN(task, curvature="ef", **VOGN_ARGS),
        "hand-written VOGN (DiagGGNExact)": lambda: harness.HandVOGN(task, curvature="ggn", **VOGN_ARGS),
        "hand-written VOGN (DiagGGNMC)": lambda: harness.HandVOGN(task, curvature="ggn_mc", **VOGN_ARGS),
        "MAP Adam (plain torch)": lambda: harness.MAP(task, lr=1e-3),
        "ivon-opt IVON": lambda: harness.IVON(task, lr=0.1, hess_init=0.5),
    }


#: target: (method, reference, bound)
TARGETS = [
    ("NGVI + CurvatureELBO('ef') (BackPACK)", VOGN_REF, 1.3),
    ("NGVI + CurvatureELBO('ggn') (BackPACK)", "hand-written VOGN (DiagGGNExact)", 1.3),
    ("NGVI + CurvatureELBO('ggn_mc') (BackPACK)", "hand-written VOGN (DiagGGNMC)", 1.3),
    ("NGVI + CurvatureELBO('reparam')", SVI_ADAM, 1.15),
    ("NGVI + Trace_ELBO (reparam from grads)", SVI_ADAM, 1.15),
]


def fixed_batches(task: harness.Task, count: int):
    """``count`` full minibatches, drawn from successive shuffles of the data."""
    generator = torch.Generator().manual_seed(task.seed)
    out = []
    while len(out) < count:
        epoch = harness.minibatches(task.split.x_train, task.split.y_train, task.batch_size, generator)
        out += [(x, y) for x, y in epoch if len(x) == task.batch_size]
    return out[:count]


def time_steps(makers: Dict[str, Callable], batches, steps: int, warmup: int, block: int, seed: int):
    """Per-step wall and CPU times (s) per method, methods interleaved in blocks."""
    runs = {}
    pyro.set_rng_seed(seed)
    for name, make in makers.items():
        method = make()
        with method.active():
            for i in range(warmup):
                method.step(*batches[i % len(batches)])
        runs[name] = method
    times: Dict[str, List[float]] = {name: [] for name in makers}
    cpu_times: Dict[str, List[float]] = {name: [] for name in makers}
    position = {name: warmup for name in makers}
    while min(len(t) for t in times.values()) < steps:
        for name, method in runs.items():
            with method.active():
                for _ in range(block):
                    batch = batches[position[name] % len(batches)]
                    position[name] += 1
                    start, cpu_start = time.perf_counter(), time.process_time()
                    method.step(*batch)
                    times[name].append(time.perf_counter() - start)
                    cpu_times[name].append(time.process_time() - cpu_start)
    return runs, times, cpu_times


def profile(method, batches, steps: int, top: int = 25) -> str:
    """cProfile of ``steps`` steps: the functions with the largest cumulative time."""
    profiler = cProfile.Profile()
    with method.active():
        profiler.enable()
        for i in range(steps):
            method.step(*batches[i % len(batches)])
        profiler.disable()
    import io

    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats(os.environ.get("PROFILE_SORT", "cumulative"))
    stats.print_stats(top)
    return stream.getvalue()


def report(times, cpu_times, args, num_data) -> str:
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    cpu_ms = {name: 1e3 * statistics.median(t) for name, t in cpu_times.items()}
    spread = {
        name: 1e3 * (statistics.quantiles(t, n=4)[2] - statistics.quantiles(t, n=4)[0])
        for name, t in times.items()
    }
    base, vogn = ms[SVI_ADAM], ms[VOGN_REF]
    lines = [
        "## BNN step time: digits MLP 64-100-10, batch 128, prior N(0, 1)",
        "",
        f"torch {torch.__version__}, pyro {pyro.__version__}, {torch.get_num_threads()} thread(s), "
        f"Pyro validation {'on' if pyro.infer.util.is_validation_enabled() else 'off'}, "
        f"N = {num_data}, median of {args.steps} steps after {args.warmup} warm-up steps "
        f"(blocks of {args.block}), {platform.processor() or platform.machine()}.",
        "",
        "Wall-clock medians; CPU time (``time.process_time``) is shown next to it because it is less "
        "sensitive to other processes on a busy machine. Ratios are of wall-clock medians.",
        "",
        "| method | ms/step | IQR (ms) | CPU ms/step | ratio to Pyro SVI + Adam | ratio to hand-written VOGN |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in times:
        lines.append(
            f"| {name} | {ms[name]:.2f} | {spread[name]:.2f} | {cpu_ms[name]:.2f} | {ms[name] / base:.2f} "
            f"| {ms[name] / vogn:.2f} |"
        )
    lines += ["", "| target | ratio | bound | met |", "|---|---:|---:|---|"]
    for name, reference, bound in TARGETS:
        ratio = ms[name] / ms[reference]
        lines.append(
            f"| {name} vs {reference} | {ratio:.2f} | <= {bound} | {'yes' if ratio <= bound else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per method (default 400)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-validation", action="store_true",
                        help="pyro.enable_validation(False) (default: Pyro's default, on)")
    parser.add_argument("--only", nargs="*", help="time only these methods (substring match)")
    parser.add_argument("--profile", metavar="METHOD",
                        help="also cProfile this method (substring of its label)")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.no_validation:
        pyro.enable_validation(False)
    warnings.simplefilter("error", NGVIWarning)  # a diverging run would time another code path
    warnings.filterwarnings("ignore", "Full backward hook is firing")  # BackPACK's first layer
    task = replace(harness.digits_mlp(), seed=args.seed)
    batches = fixed_batches(task, 50)
    makers = methods(task)
    if args.only:
        keep = {SVI_ADAM, VOGN_REF}
        keep |= {n for n in makers if any(s in n for s in args.only)}
        keep |= {reference for name, reference, _ in TARGETS if name in keep}
        makers = {n: m for n, m in makers.items() if n in keep}
    runs, times, cpu_times = time_steps(makers, batches, args.steps, args.warmup, args.block, args.seed)
    if args.only:
        text = report_subset(times, args, task.num_data)
    else:
        text = report(times, cpu_times, args, task.num_data)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.profile:
        name = next(n for n in makers if args.profile in n)
        print(f"### cProfile, {name}, {args.steps} steps\n")
        print(profile(runs[name], batches, args.steps))


def report_subset(times, args, num_data):
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return "\n".join(
        f"{name}: {ms[name]:.2f} ms ({ms[name] / ms[SVI_ADAM]:.2f}x SVI+Adam, {ms[name] / ms[VOGN_REF]:.2f}x VOGN)"
        for name in times
    ) + "\n"


if __name__ == "__main__":
    main()
