"""
Time per step of Bayesian networks, NGVI against the loops it replaces (issues #3, #16).

Sections (``--sections``, default all):

* ``digits``: scikit-learn digits, MLP 64-100-10 (N = 1257), every method:
  NGVI on Pyro ``SVI`` with a :class:`~pyro_ngvi.BayesianNet` + ``AutoNormal`` and
  ``CurvatureELBO("ef" | "ggn" | "ggn_mc" | "reparam")`` (the BackPACK fast path), NGVI
  with a plain ``Trace_ELBO``, Pyro ``SVI`` + ``pyro.optim.Adam`` + ``Trace_ELBO``
  (Bayes-by-Backprop), VOGN written by hand in plain PyTorch + BackPACK (sampled weights
  copied into the net, ``SumGradSquared`` / ``DiagGGNExact`` / ``DiagGGNMC``, the same
  update in a few lines), MAP with ``torch.optim.Adam``, ``ivon.IVON`` (ivon-opt);
* ``widths``: MLP 784-W-W-10 on synthetic data (N = 4096 standard-normal inputs, random
  labels) for W in ``--widths`` (100 400 1600): NGVI with each BackPACK curvature, the
  hand-written VOGN of the same curvature, MAP;
* ``cnn``: the same methods on a small CNN (28 x 28 synthetic images, conv 5x5x16 - pool -
  conv 5x5x32 - pool - linear 512-10);
* ``recipe``: issue #24's table: MLP 784-W-W-10 on the same synthetic data for W in
  ``--widths``, the documented recipe (``bnn.guide()``, ``NGVI()``, ``CurvatureELBO(source)``)
  with ``ef`` and ``reparam`` against the barest hand-written VOGN loop (sample, BackPACK
  ``SumGradSquared``, precision average, floor, momentum, mean step; the recipe's settings),
  ivon-opt and MAP Adam, all interleaved in one run; with ``--compiled`` also
  ``NGVI(compile=True)`` (its compilation in the warm-up, not timed);
* ``traced``: a model with one 10^6-element latent site ``z ~ N(0, I)``,
  ``x ~ N(z, I)`` observed, ``AutoNormal`` and ``Trace_ELBO``: NGVI against
  ``pyro.optim.Adam``, the optimizer call alone (``SVI`` calls it with the tensors) and the
  whole ``SVI.step``.

Everything runs on one torch thread (``--threads``), minibatches of 128, Categorical
likelihood, prior N(0, 1). Within a section the methods step through the same fixed
batches; after a warm-up they run interleaved in blocks (so load from other processes hits
them alike); the tables give the median wall-clock time, its interquartile range and the
median CPU time (``time.process_time``, less sensitive to a busy machine) per step, and the
ratios of wall-clock medians. The load average is printed with each section.

Targets (issue #24, the ``recipe`` and ``traced`` sections): NGVI ``ef`` / the hand loop
<= 1.15 at widths 100, 400 and 1600; NGVI ``reparam`` / ivon-opt <= 1.0 at every width; the
traced optimizer call <= 2x Adam's. Earlier targets (issue #16): a BackPACK-path step <= 1.3x the hand-written VOGN step with the same extension
on digits and <= 1.15x at widths 400 and 1600 and on the CNN; the ``reparam`` paths
(``CurvatureELBO("reparam")`` and NGVI + ``Trace_ELBO``) <= 1.15x Pyro SVI + Adam on digits;
on the traced site NGVI's optimizer call <= 2x Adam's (issue #24; 1.5x in issue #16) and the whole step <= 1.1x.

Usage::

    python benchmarks/bnn_step.py [--sections digits widths recipe cnn traced] [--compiled] [--steps 400]
        [--warmup 50] [--block 50] [--widths 100 400 1600] [--traced-size 1000000]
        [--threads 1] [--no-validation] [--out FILE.md] [--profile METHOD]
"""

import argparse
import cProfile
import io
import multiprocessing
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
from pyro.infer import SVI, Trace_ELBO  # noqa: E402
from pyro.infer.autoguide import AutoNormal  # noqa: E402

from pyro_ngvi import NGVI, NGVIWarning  # noqa: E402

import harness  # noqa: E402  (examples/harness)

SVI_ADAM = "Pyro SVI + Adam (Trace_ELBO, BBB)"
VOGN_REF = "hand-written VOGN (SumGradSquared)"
MAP_ADAM = "MAP Adam (plain torch)"

# Settings that stay finite over the timed steps for every curvature source (the
# cost of a step does not depend on them; a non-finite step would take another
# code path, so NGVIWarning is an error here).
NGVI_ARGS = dict(lr=0.01, beta=0.05, momentum=0.9, damping=30.0)
VOGN_ARGS = NGVI_ARGS  # the same update (momentum included) by hand

#: curvature source -> the hand-written step with the same BackPACK extension
HAND = {"ef": VOGN_REF, "ggn": "hand-written VOGN (DiagGGNExact)", "ggn_mc": "hand-written VOGN (DiagGGNMC)"}


def ngvi_label(curvature: str) -> str:
    return f"NGVI + CurvatureELBO('{curvature}') (BackPACK)"


def methods(task: harness.Task) -> Dict[str, Callable]:
    """Label -> factory of the method; all start from the same network (digits section)."""
    makers = {ngvi_label(c): (lambda c=c: harness.ngvi(task, c, **NGVI_ARGS)) for c in HAND}
    makers.update({
        "NGVI + CurvatureELBO('reparam')": lambda: harness.ngvi(task, "reparam", **NGVI_ARGS),
        "NGVI + Trace_ELBO (reparam from grads)": lambda: harness.ngvi(task, None, **NGVI_ARGS),
        SVI_ADAM: lambda: harness.bayes_by_backprop(task, lr=1e-3),
    })
    makers.update({HAND[c]: (lambda c=c: harness.HandVOGN(task, curvature=c, **VOGN_ARGS)) for c in HAND})
    makers[MAP_ADAM] = lambda: harness.MAP(task, lr=1e-3)
    if harness.ivon_installed():
        makers["ivon-opt IVON"] = lambda: harness.IVON(task, lr=0.1, hess_init=0.5)
    return makers


def curvature_methods(task: harness.Task) -> Dict[str, Callable]:
    """NGVI with each BackPACK curvature, the hand-written step of the same curvature, MAP."""
    makers = {ngvi_label(c): (lambda c=c: harness.ngvi(task, c, **NGVI_ARGS)) for c in HAND}
    makers.update({HAND[c]: (lambda c=c: harness.HandVOGN(task, curvature=c, **VOGN_ARGS)) for c in HAND})
    makers[MAP_ADAM] = lambda: harness.MAP(task, lr=1e-3)
    return makers


#: target: (method, reference, bound), digits section
TARGETS = [(ngvi_label(c), HAND[c], 1.3) for c in HAND] + [
    ("NGVI + CurvatureELBO('reparam')", SVI_ADAM, 1.15),
    ("NGVI + Trace_ELBO (reparam from grads)", SVI_ADAM, 1.15),
]


# --------------------------------------------------------------------------- tasks
def synthetic_task(name: str, make_net: Callable[[], nn.Module], shape: Tuple[int, ...], num_data: int = 4096,
                   seed: int = 0) -> harness.Task:
    """Standard-normal inputs of ``shape`` and uniformly random labels of 10 classes (the cost of
    a step does not depend on the data)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((num_data,) + shape, generator=generator)
    y = torch.randint(0, 10, (num_data,), generator=generator)
    split = harness.Split(x, y, x[:256], y[:256])
    return harness.Task(name, split, make_net, "categorical", seed=seed)


def mlp_task(width: int, seed: int = 0) -> harness.Task:
    return synthetic_task(f"MLP 784-{width}-{width}-10", lambda: harness.mlp(784, width, width, 10), (784,),
                          seed=seed)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 10),
    )


def cnn_task(seed: int = 0) -> harness.Task:
    return synthetic_task("CNN 1x28x28: conv5x5x16-pool-conv5x5x32-pool-linear512x10", small_cnn, (1, 28, 28),
                          seed=seed)


def latent_size(task: harness.Task) -> int:
    return sum(p.numel() for p in task.make_net().parameters())


# --------------------------------------------------------------------------- timing
def fixed_batches(task: harness.Task, count: int):
    """``count`` full minibatches, drawn from successive shuffles of the data."""
    generator = torch.Generator().manual_seed(task.seed)
    out = []
    while len(out) < count:
        epoch = harness.minibatches(task.split.x_train, task.split.y_train, task.batch_size, generator)
        out += [(x, y) for x, y in epoch if len(x) == task.batch_size]
    return out[:count]


def _worker(connection, make, batches, warmup: int, seed: int, threads: int) -> None:
    """One method in a process of its own: built, warmed up, then blocks of timed steps on request."""
    torch.set_num_threads(threads)
    pyro.set_rng_seed(seed)
    method = make()
    position = 0
    with method.active():
        for _ in range(warmup):
            method.step(*batches[position % len(batches)])
            position += 1
        connection.send("ready")
        while True:
            count = connection.recv()
            if count is None:
                break
            wall, cpu = [], []
            for _ in range(count):
                batch = batches[position % len(batches)]
                position += 1
                start, cpu_start = time.perf_counter(), time.process_time()
                method.step(*batch)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
            connection.send((wall, cpu, method.timed_parts() if hasattr(method, "timed_parts") else None))
    connection.close()


def time_steps(makers: Dict[str, Callable], batches, steps: int, warmup: int, block: int, seed: int,
               parts_out: Optional[Dict] = None):
    """
    Per-step wall and CPU times (s) per method. Each method runs in a process of its own
    (forked, so it shares nothing with the others: on the CPU the allocator's state, which
    one method's large temporaries change, decides how often another's page-fault), and the
    processes take turns in blocks of ``block`` steps (so that load from other processes hits
    them alike); only one runs at a time.
    """
    context = multiprocessing.get_context("fork")
    workers = {}
    for name, make in makers.items():
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, make, batches, warmup, seed, torch.get_num_threads()))
        process.start()
        if parent.recv() != "ready":
            raise RuntimeError(f"{name} did not start")
        workers[name] = (process, parent)
    times: Dict[str, List[float]] = {name: [] for name in makers}
    cpu_times: Dict[str, List[float]] = {name: [] for name in makers}
    parts: Dict[str, List] = {name: [] for name in makers}
    try:
        while min(len(t) for t in times.values()) < steps:
            for name, (_, connection) in workers.items():
                connection.send(block)
                wall, cpu, part = connection.recv()
                times[name] += wall
                cpu_times[name] += cpu
                parts[name].append(part)
    finally:
        for process, connection in workers.values():
            connection.send(None)
            process.join()
    if parts_out is not None:
        parts_out.update(parts)
    return times, cpu_times


def profile(method, batches, steps: int, top: int = 25) -> str:
    """cProfile of ``steps`` steps: the functions with the largest cumulative time."""
    profiler = cProfile.Profile()
    with method.active():
        profiler.enable()
        for i in range(steps):
            method.step(*batches[i % len(batches)])
        profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats(os.environ.get("PROFILE_SORT", "cumulative"))
    stats.print_stats(top)
    return stream.getvalue()


def summary(times: List[float]) -> Tuple[float, float]:
    """Median and interquartile range, in ms."""
    quartiles = statistics.quantiles(times, n=4)
    return 1e3 * statistics.median(times), 1e3 * (quartiles[2] - quartiles[0])


def load() -> str:
    return "load average {:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())


# --------------------------------------------------------------------------- reports
def digits_report(times, cpu_times, args, num_data) -> str:
    ms = {name: summary(t)[0] for name, t in times.items()}
    base, vogn = ms[SVI_ADAM], ms[VOGN_REF]
    lines = [
        "## Digits MLP 64-100-10, batch 128, prior N(0, 1)",
        "",
        f"N = {num_data}, median of {args.steps} steps after {args.warmup} warm-up steps (blocks of "
        f"{args.block}); {load()} at the end.",
        "",
        "| method | ms/step | IQR (ms) | CPU ms/step | ratio to Pyro SVI + Adam | ratio to hand-written VOGN (ef) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in times:
        median, spread = summary(times[name])
        cpu = summary(cpu_times[name])[0]
        lines.append(f"| {name} | {median:.2f} | {spread:.2f} | {cpu:.2f} | {median / base:.2f} | {median / vogn:.2f} |")
    lines += ["", "| target | ratio | bound | met |", "|---|---:|---:|---|"]
    for name, reference, bound in TARGETS:
        ratio = ms[name] / ms[reference]
        lines.append(f"| {name} vs {reference} | {ratio:.2f} | <= {bound} | {'yes' if ratio <= bound else 'NO'} |")
    return "\n".join(lines) + "\n"


def curvature_report(title: str, times, cpu_times, steps: int, bound: float, size: int) -> Tuple[str, List]:
    """A section's table (NGVI vs hand-written VOGN of the same curvature, MAP) and its target rows."""
    ms = {name: summary(t)[0] for name, t in times.items()}
    lines = [
        f"## {title}",
        "",
        f"{size:,} weights, batch 128; median of {steps} steps; {load()} at the end.",
        "",
        "| method | ms/step | IQR (ms) | CPU ms/step | ratio to hand-written VOGN (same curvature) | ratio to MAP |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for name in times:
        median, spread = summary(times[name])
        cpu = summary(cpu_times[name])[0]
        reference = next((HAND[c] for c in HAND if name in (ngvi_label(c), HAND[c])), None)
        ratio = "" if reference is None else f"{median / ms[reference]:.2f}"
        lines.append(f"| {name} | {median:.2f} | {spread:.2f} | {cpu:.2f} | {ratio} | {median / ms[MAP_ADAM]:.2f} |")
    for curvature, hand in HAND.items():
        cpu_ratio = summary(cpu_times[ngvi_label(curvature)])[0] / summary(cpu_times[hand])[0]
        rows.append((title, curvature, ms[ngvi_label(curvature)], ms[hand], ms[ngvi_label(curvature)] / ms[hand],
                     cpu_ratio, bound))
    return "\n".join(lines) + "\n", rows


def scaling_table(rows) -> str:
    lines = [
        "## Scaling: NGVI (BackPACK fast path) over the hand-written VOGN step of the same curvature",
        "",
        "| network | curvature | NGVI ms | hand ms | ratio (wall) | ratio (CPU) | bound | met |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for title, curvature, ngvi_ms, hand_ms, ratio, cpu_ratio, bound in rows:
        lines.append(f"| {title} | {curvature} | {ngvi_ms:.2f} | {hand_ms:.2f} | {ratio:.2f} | {cpu_ratio:.2f} | "
                     f"<= {bound} | {'yes' if ratio <= bound else 'NO'} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the recipe (issue #24)
RECIPE_HAND = "hand-written VOGN (SumGradSquared), the recipe's update"
RECIPE_IVON = "ivon-opt IVON"


def recipe_label(curvature: str, compiled: bool = False) -> str:
    return f"NGVI{'(compile=True)' if compiled else '()'} + CurvatureELBO('{curvature}'), bnn.guide()"


def recipe_methods(task: harness.Task, compiled: bool = False) -> Dict[str, Callable]:
    """The recipe with ``ef`` and ``reparam`` (and compiled), the hand-written loop with the recipe's settings
    (``policies.MINIBATCH``: lr 0.3, beta 0.01, momentum 0.9, damping N, the noise-limit floor), ivon-opt, MAP."""
    from pyro_ngvi.policies import MINIBATCH

    makers = {}
    for flag in (False, True) if compiled else (False,):
        for curvature in ("ef", "reparam"):
            args = {"compile": True} if flag else {}
            makers[recipe_label(curvature, flag)] = lambda c=curvature, a=args: harness.ngvi_recipe(task, c, **a)
    makers[RECIPE_HAND] = lambda: harness.HandVOGN(task, curvature="ef", lr=MINIBATCH.lr, beta=MINIBATCH.beta,
                                                   momentum=MINIBATCH.momentum,
                                                   damping=task.num_data * MINIBATCH.damping)
    if harness.ivon_installed():
        makers[RECIPE_IVON] = lambda: harness.IVON(task, lr=0.1, hess_init=0.5)
    makers[MAP_ADAM] = lambda: harness.MAP(task, lr=1e-3)
    return makers


def recipe_report(results, compiled: bool) -> str:
    """Issue #24's table: per width, the ratios of wall-clock medians measured in one interleaved run."""
    lines = [
        "## Issue #24: the recipe against the barest hand loop, ivon-opt and MAP Adam",
        "",
        "MLP 784-W-W-10, batch 128, synthetic data (N = 4096), one torch thread; every method of a width in one "
        f"interleaved run; {load()} at the end.",
        "",
    ]
    variants = [False, True] if compiled else [False]
    header = "| width | weights | NGVI `ef` / hand loop (<= 1.15) | NGVI `reparam` / ivon-opt (<= 1.0) | NGVI `ef` / MAP Adam |"
    lines += [header, "|---|---:|---:|---:|---:|"]
    for width, size, times, _ in results:
        ms = {name: summary(t)[0] for name, t in times.items()}
        for flag in variants:
            ef, reparam = ms[recipe_label("ef", flag)], ms[recipe_label("reparam", flag)]
            ivon = ms.get(RECIPE_IVON)
            tag = " (compiled)" if flag else ""
            lines.append(f"| {width}{tag} | {size:,} | {ef / ms[RECIPE_HAND]:.2f} | "
                         f"{'-' if ivon is None else f'{reparam / ivon:.2f}'} | {ef / ms[MAP_ADAM]:.2f} |")
    lines += ["", "| width | method | ms/step | IQR (ms) | CPU ms/step |", "|---|---|---:|---:|---:|"]
    for width, _, times, cpu_times in results:
        for name, t in times.items():
            median, spread = summary(t)
            lines.append(f"| {width} | {name} | {median:.2f} | {spread:.2f} | {summary(cpu_times[name])[0]:.2f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- traced site
def timed(optim):
    """``optim`` with its calls timed (wall and CPU, lists ``optim.wall`` / ``optim.cpu``): its class
    becomes a subclass whose ``__call__`` measures (SVI needs a ``PyroOptim``, and NGVI finds its
    ``SVI`` by the optimizer's identity)."""

    class Timed(type(optim)):
        def __call__(self, *args, **kwargs):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = super().__call__(*args, **kwargs)
            self.wall.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu_start)
            return out

    optim.__class__ = Timed
    optim.wall, optim.cpu = [], []
    return optim


class TracedSite:
    """``z ~ N(0, I_n)``, ``x ~ N(z, I)`` observed, an ``AutoNormal`` guide, ``Trace_ELBO``, and an
    optimizer, in a param-store scope of its own."""

    def __init__(self, size: int, make_optim: Callable, seed: int = 0, device="cpu"):
        self.data = torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(device)
        self.guide = AutoNormal(self.model)
        self._store = {"params": {}, "constraints": {}}
        with self.active():
            self.guide()
            self.optim = timed(make_optim(self.guide))
            self.svi = SVI(self.model, self.guide, self.optim, Trace_ELBO())

    def model(self):
        z = pyro.sample("z", dist.Normal(self.data.new_zeros(()), 1.0).expand([len(self.data)]).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=self.data)

    def active(self):
        return pyro.get_param_store().scope(self._store)

    def step(self, *batch):
        self.svi.step()

    def timed_parts(self) -> Tuple[List[float], List[float]]:
        """The optimizer calls' wall and CPU times since the last call."""
        out = (list(self.optim.wall), list(self.optim.cpu))
        self.optim.wall.clear()
        self.optim.cpu.clear()
        return out


#: NGVI configurations of the traced section: its defaults (the adaptive steps, a whole-site update: their
#: noise is pooled over the site) and chosen constant steps (the update in spans, control variate included)
TRACED_NGVI = {
    "NGVI() (adaptive steps)": dict(),
    "NGVI(lr=0.1, beta=0.05) (constant steps)": dict(lr=0.1, beta=0.05),
}


def traced(size: int, steps: int, warmup: int, block: int, compiled: bool = False) -> str:
    adam = "Pyro Adam + Trace_ELBO"
    configurations = dict(TRACED_NGVI)
    if compiled:
        configurations.update({name.replace("NGVI(", "NGVI(compile=True, ").replace(", )", ")"): dict(args, compile=True)
                               for name, args in TRACED_NGVI.items()})
    makers = {name: (lambda args=args: TracedSite(size, lambda guide: NGVI(guide=guide, **args)))
              for name, args in configurations.items()}
    makers[adam] = lambda: TracedSite(size, lambda guide: pyro.optim.Adam({"lr": 1e-3}))
    parts: Dict[str, List] = {}
    step_wall, step_cpu = time_steps(makers, [()], steps, warmup, block, 0, parts)
    optim_wall = {name: [t for wall, _ in blocks for t in wall] for name, blocks in parts.items()}
    optim_cpu = {name: [t for _, cpu in blocks for t in cpu] for name, blocks in parts.items()}
    rows = []
    for ngvi in configurations:
        rows += [
            (ngvi, "optimizer call", optim_wall[ngvi], optim_wall[adam], optim_cpu[ngvi], optim_cpu[adam], 2.0),
            (ngvi, "whole SVI.step", step_wall[ngvi], step_wall[adam], step_cpu[ngvi], step_cpu[adam], 1.1),
        ]
    lines = [
        f"## Traced path: one AutoNormal site of {size:,} elements, Trace_ELBO",
        "",
        f"`z ~ N(0, I)`, `x ~ N(z, I)` observed; NGVI against `pyro.optim.Adam`; "
        f"median of {steps} steps; {load()} at the end.",
        "",
        "| NGVI | what | NGVI ms (IQR) | Adam ms (IQR) | ratio (wall) | CPU ms NGVI / Adam | ratio (CPU) | bound | met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for ngvi, what, ngvi_wall, adam_wall, ngvi_cpu, adam_cpu, bound in rows:
        (n, n_iqr), (a, a_iqr) = summary(ngvi_wall), summary(adam_wall)
        nc, ac = summary(ngvi_cpu)[0], summary(adam_cpu)[0]
        lines.append(f"| {ngvi} | {what} | {n:.2f} ({n_iqr:.2f}) | {a:.2f} ({a_iqr:.2f}) | {n / a:.2f} | "
                     f"{nc:.2f} / {ac:.2f} | {nc / ac:.2f} | <= {bound} | {'yes' if n / a <= bound else 'NO'} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="*", default=["digits", "widths", "recipe", "cnn", "traced"],
                        choices=["digits", "widths", "recipe", "cnn", "traced"])
    parser.add_argument("--compiled", action="store_true",
                        help="recipe, traced: also NGVI(compile=True) (compiled in the warm-up, not timed)")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per method on digits (default 400)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--widths", type=int, nargs="*", default=[100, 400, 1600])
    parser.add_argument("--sweep-steps", type=int, nargs="*", default=[200, 100, 40],
                        help="timed steps per method at each width (the last repeats), and on the CNN the first")
    parser.add_argument("--traced-size", type=int, default=10**6)
    parser.add_argument("--traced-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-validation", action="store_true",
                        help="pyro.enable_validation(False) (default: Pyro's default, on)")
    parser.add_argument("--only", nargs="*", help="digits: time only these methods (substring match)")
    parser.add_argument("--profile", metavar="METHOD", help="digits: also cProfile this method (substring of its label)")
    parser.add_argument("--out", help="write the markdown tables here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.no_validation:
        pyro.enable_validation(False)
    warnings.simplefilter("error", NGVIWarning)  # a diverging run would time another code path
    warnings.filterwarnings("ignore", "Full backward hook is firing")  # BackPACK's first layer
    header = (
        f"# Time per step\n\ntorch {torch.__version__}, pyro {pyro.__version__}, {torch.get_num_threads()} "
        f"thread(s), Pyro validation {'on' if pyro.infer.util.is_validation_enabled() else 'off'}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {load()} at the start. "
        "Wall-clock medians; CPU time (`time.process_time`) beside it is less sensitive to other "
        "processes. Ratios are of wall-clock medians unless marked CPU.\n"
    )
    print(header, flush=True)
    parts, rows = [header], []

    def emit(text):
        print(text, flush=True)
        parts.append(text)

    if "digits" in args.sections:
        task = replace(harness.digits_mlp(), seed=args.seed)
        batches = fixed_batches(task, 50)
        makers = methods(task)
        if args.only:
            keep = {SVI_ADAM, VOGN_REF} | {n for n in makers if any(s in n for s in args.only)}
            keep |= {reference for name, reference, _ in TARGETS if name in keep}
            makers = {n: m for n, m in makers.items() if n in keep}
        times, cpu_times = time_steps(makers, batches, args.steps, args.warmup, args.block, args.seed)
        if not args.only:
            emit(digits_report(times, cpu_times, args, task.num_data))
            ms = {name: summary(t)[0] for name, t in times.items()}
            for curvature, hand in HAND.items():
                name = ngvi_label(curvature)
                rows.append(("digits MLP 64-100-10", curvature, ms[name], ms[hand], ms[name] / ms[hand],
                             summary(cpu_times[name])[0] / summary(cpu_times[hand])[0], 1.3))
        else:
            emit("\n".join(f"{n}: {summary(t)[0]:.2f} ms" for n, t in times.items()) + "\n")
        if args.profile:
            name = next(n for n in makers if args.profile in n)
            print(f"### cProfile, {name}, {args.steps} steps\n")
            pyro.set_rng_seed(args.seed)
            method = makers[name]()
            with method.active():
                for i in range(args.warmup):
                    method.step(*batches[i % len(batches)])
            print(profile(method, batches, args.steps))
    sweep = []
    if "widths" in args.sections:
        sweep += [(mlp_task(width, args.seed), 1.3 if width < 400 else 1.15) for width in args.widths]
    if "cnn" in args.sections:
        sweep.append((cnn_task(args.seed), 1.15))
    for index, (task, bound) in enumerate(sweep):
        steps = args.sweep_steps[min(index, len(args.sweep_steps) - 1)]
        if task.name.startswith("CNN"):
            steps = args.sweep_steps[0]
        block = max(steps // 10, 1)
        batches = fixed_batches(task, 16)
        times, cpu_times = time_steps(curvature_methods(task), batches, steps, max(block // 2, 3), block, args.seed)
        text, section_rows = curvature_report(task.name, times, cpu_times, steps, bound, latent_size(task))
        emit(text)
        rows += section_rows
    if rows:
        emit(scaling_table(rows))
    if "recipe" in args.sections:
        results = []
        for index, width in enumerate(args.widths):
            task = mlp_task(width, args.seed)
            steps = args.sweep_steps[min(index, len(args.sweep_steps) - 1)]
            block = max(steps // 10, 1)
            times, cpu_times = time_steps(recipe_methods(task, args.compiled), fixed_batches(task, 16), steps,
                                          max(block // 2, 3), block, args.seed)
            results.append((width, latent_size(task), times, cpu_times))
            print(f"width {width}: " + ", ".join(f"{n}: {summary(t)[0]:.2f} ms" for n, t in times.items()), flush=True)
        emit(recipe_report(results, args.compiled))
    if "traced" in args.sections:
        emit(traced(args.traced_size, args.traced_steps, 5, max(args.traced_steps // 6, 1), args.compiled))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))


if __name__ == "__main__":
    main()
