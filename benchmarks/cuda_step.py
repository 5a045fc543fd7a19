"""
Time per step on a CUDA device (issue 24's GPU item): the sections of ``bnn_step.py`` that the
issue's targets name, with everything on the GPU.

* ``recipe``: MLP 784-W-W-10, minibatches of ``--batch``, synthetic data on the device; the
  documented recipe (``bnn.guide()``, ``NGVI()``, ``CurvatureELBO(source)``) with ``ef``,
  ``reparam`` and ``ggn`` (and ``NGVI(compile=True)`` with ``--compiled``: Triton), against the
  barest hand-written VOGN loop, ivon-opt and MAP Adam (``bnn_step.recipe_methods``);
* ``launches``: the recipe's methods at the first of ``--widths``, kernels launched per step and
  the host's time per step (torch.profiler over ``--block`` steps): where a method is bound by
  launches from Python, these say which one launches more;
* ``traced``: one ``AutoNormal`` site of ``--traced-size`` elements, ``Trace_ELBO``: NGVI's
  optimizer call and the whole ``SVI.step`` against ``pyro.optim.Adam``'s.

All methods live in one process (CUDA does not survive a fork) and step in interleaved blocks
of ``--block`` steps. A block is timed between two ``synchronize()``, so the time is
the device's queue drained, not the host's launches alone: ms/step is a block's time over its
steps, the median over blocks. The traced optimizer call is timed between two synchronisations
of its own (for NGVI and Adam alike). NGVI reads its checks back every 16 steps on CUDA
(``checks.SYNC_EVERY_CUDA``); blocks of a multiple of 16 steps hold the same number of reads.

Usage::

    python benchmarks/cuda_step.py [--sections recipe traced] [--widths 100 400 1600 4000]
        [--batch 128] [--steps 320] [--block 32] [--compiled] [--sections launches] [--traced-size 10000000] [--out FILE.md]
"""

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bnn_step  # noqa: E402  (puts examples/ on the path)
import harness  # noqa: E402
import pyro  # noqa: E402

from pyro_ngvi import NGVI, NGVIWarning  # noqa: E402
from pyro_ngvi.update.fused import CompileWarning  # noqa: E402


def synchronize():
    """Wait for the device's queue (nothing to wait for on the CPU, where ``--device cpu`` checks the script)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def on_device(task: harness.Task, device: torch.device) -> harness.Task:
    """``task`` with its data and its networks on ``device``."""
    split = harness.Split(*[t.to(device) for t in (task.split.x_train, task.split.y_train,
                                                    task.split.x_test, task.split.y_test)])
    make_net = task.make_net
    return replace(task, split=split, make_net=lambda: make_net().to(device))


def block_times(makers: Dict[str, Callable], step_of: Callable, steps: int, warmup: int, block: int):
    """Per method, the seconds per step of each timed block (methods interleaved block by block)."""
    methods = {}
    for name, make in makers.items():
        method = make()
        with method.active():
            for _ in range(warmup):
                step_of(method)
        synchronize()
        methods[name] = method
    times: Dict[str, List[float]] = {name: [] for name in makers}
    for _ in range(max(steps // block, 1)):
        for name, method in methods.items():
            with method.active():
                synchronize()
                start = time.perf_counter()
                for _ in range(block):
                    step_of(method)
                synchronize()
                times[name].append((time.perf_counter() - start) / block)
    return times, methods


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def ms(values: List[float]) -> float:
    return 1e3 * statistics.median(values)


def recipe(args, device) -> str:
    lines = [f"## The recipe on {device_name(device)}", "",
             f"MLP 784-W-W-10, batch {args.batch}, synthetic data (N = 4096) on the device; "
             f"median ms/step over blocks of {args.block} steps ({args.steps} steps per method).", ""]
    table = ["| width | method | ms/step |", "|---|---|---:|"]
    ratios = ["| width | NGVI `ef` / hand loop (<= 1.15) | NGVI `reparam` / ivon-opt (<= 1.0) | "
              "NGVI `ggn` / ivon-opt | NGVI `ef` / MAP Adam |", "|---|---:|---:|---:|---:|"]
    for width in args.widths:
        cpu_task = replace(bnn_step.mlp_task(width, args.seed), batch_size=args.batch)
        batches = [(x.to(device), y.to(device)) for x, y in bnn_step.fixed_batches(cpu_task, 16)]
        task = on_device(cpu_task, device)
        makers = bnn_step.recipe_methods(task, compiled=args.compiled)
        makers["NGVI() + CurvatureELBO('ggn'), bnn.guide()"] = lambda: harness.ngvi_recipe(task, "ggn")
        position = {"i": 0}

        def step_of(method):
            x, y = batches[position["i"] % len(batches)]
            position["i"] += 1
            method.step(x, y)

        times, _ = block_times(makers, step_of, args.steps, args.warmup, args.block)
        median = {name: ms(t) for name, t in times.items()}
        table += [f"| {width} | {name} | {value:.3f} |" for name, value in median.items()]
        for flag in [False, True] if args.compiled else [False]:
            ef, reparam = median[bnn_step.recipe_label("ef", flag)], median[bnn_step.recipe_label("reparam", flag)]
            ggn = median["NGVI() + CurvatureELBO('ggn'), bnn.guide()"]
            ivon = median.get(bnn_step.RECIPE_IVON, float("nan"))
            ratios.append(f"| {width}{' (compiled)' if flag else ''} | {ef / median[bnn_step.RECIPE_HAND]:.2f} | "
                          f"{reparam / ivon:.2f} | {ggn / ivon:.2f} | {ef / median[bnn_step.MAP_ADAM]:.2f} |")
        print("\n".join(ratios[-1:]), flush=True)
    return "\n".join(lines + ratios + [""] + table) + "\n"


def launches(args, device) -> str:
    """Kernels per step and host ms per step of each recipe method, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    width = args.widths[0]
    cpu_task = replace(bnn_step.mlp_task(width, args.seed), batch_size=args.batch)
    batches = [(x.to(device), y.to(device)) for x, y in bnn_step.fixed_batches(cpu_task, 16)]
    task = on_device(cpu_task, device)
    makers = bnn_step.recipe_methods(task, compiled=args.compiled)
    lines = [f"## Kernel launches per step on {device_name(device)} (width {width}, {args.block} steps profiled)", "",
             "| method | kernels / step | aten ops / step | host ms / step (profiled) | top host ops (self ms / step) |",
             "|---|---:|---:|---:|---|"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, make in makers.items():
        method = make()
        with method.active():
            for i in range(args.warmup):
                method.step(*batches[i % len(batches)])
            synchronize()
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                for i in range(args.block):
                    method.step(*batches[i % len(batches)])
                host = (time.perf_counter() - start) / args.block
                synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        aten = sum(e.count for e in events if e.key.startswith("aten::"))
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:4]
        ops = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / args.block:.2f}" for e in top)
        lines.append(f"| {name} | {kernels / args.block:.0f} | {aten / args.block:.0f} | {1e3 * host:.2f} | {ops} |")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def synchronised(optim):
    """``optim`` whose calls are timed between two device synchronisations (``optim.wall``)."""

    class Synchronised(type(optim)):
        def __call__(self, *args, **kwargs):
            synchronize()
            start = time.perf_counter()
            out = super().__call__(*args, **kwargs)
            synchronize()
            self.wall.append(time.perf_counter() - start)
            return out

    optim.__class__ = Synchronised
    optim.wall = []
    return optim


def traced(args, device) -> str:
    configurations = dict(bnn_step.TRACED_NGVI)
    if args.compiled:
        configurations["NGVI(compile=True) (adaptive steps)"] = dict(compile=True)
    makers = {name: (lambda a=a: bnn_step.TracedSite(args.traced_size, lambda guide: synchronised(NGVI(guide=guide, **a)),
                                                    device=device))
              for name, a in configurations.items()}
    adam = "Pyro Adam + Trace_ELBO"
    makers[adam] = lambda: bnn_step.TracedSite(args.traced_size, lambda guide: synchronised(pyro.optim.Adam({"lr": 1e-3})),
                                               device=device)
    steps, methods = block_times(makers, lambda method: method.step(), args.steps, args.warmup, args.block)
    # the optimizer calls of the timed blocks (each between two synchronisations of its own)
    calls = {name: ms(method.optim.wall[args.warmup:]) for name, method in methods.items()}
    lines = [f"## Traced path on {device_name(device)}: one AutoNormal site of "
             f"{args.traced_size:,} elements, Trace_ELBO", "",
             "| optimizer | SVI.step ms | / Adam's | optimizer call ms (synchronised) | / Adam's (<= 2) |",
             "|---|---:|---:|---:|---:|"]
    for name in makers:
        lines.append(f"| {name} | {ms(steps[name]):.3f} | {ms(steps[name]) / ms(steps[adam]):.2f} | "
                     f"{calls[name]:.3f} | {calls[name] / calls[adam]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=["recipe", "traced"], choices=["recipe", "traced", "launches"])
    parser.add_argument("--widths", type=int, nargs="*", default=[100, 400, 1600, 4000])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--compiled", action="store_true", help="also NGVI(compile=True) (compiled in the warm-up)")
    parser.add_argument("--traced-size", type=int, default=10**7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    parser.add_argument("--out", help="write the markdown tables here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_step.py needs a CUDA device (torch.cuda.is_available() is False)")
    pyro.enable_validation(False)
    warnings.simplefilter("error", NGVIWarning)  # a diverging run would time another code path
    warnings.simplefilter("always", CompileWarning)  # said, and the eager pass timed
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parts = [f"# Time per step on CUDA\n\ntorch {torch.__version__}, pyro {pyro.__version__}, "
             f"{device_name(device)}; Pyro validation off.\n"]
    print(parts[0], flush=True)
    for section in args.sections:
        text = {"recipe": recipe, "traced": traced, "launches": launches}[section](args, device)
        print(text, flush=True)
        parts.append(text)
    if args.out:
        Path(args.out).write_text("\n".join(parts))


if __name__ == "__main__":
    main()
