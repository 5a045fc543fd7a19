"""
Optimizer memory on the digits BNN (DESIGN §5: "at most three extra vectors of the
latent size").

Setting as in ``bnn_step.py`` (MLP 64-100-10, 7,510 weights, batch 128, prior N(0, 1)),
and a wide MLP 64-1000-1000-10 (1.07 M weights, ``reparam`` curvature: the update is the
same for every source). For each method, after 5 steps:

* **state**: the bytes the optimizer keeps between steps (``get_state()`` of
  :class:`~pyro_ngvi.NGVI` and of Pyro's Adam, ``state_dict()`` of ivon-opt's IVON),
  in units of one latent vector. The guide's own ``loc`` / ``scale``
  (or a network's weights) are the posterior, not optimizer memory, and are not counted;
  ivon-opt keeps its posterior precision (``hess``) in its state, so that counts there.
* **update peak**: the largest amount of memory the optimizer's update (``NGVI`` /
  Pyro's Adam as ``SVI`` calls it, ``IVON.step``) holds on top of what it started with,
  from :mod:`torch.profiler` (``profile_memory=True``: the running sum of every op's own
  allocations and frees, in time order), also in latent vectors. Temporaries, freed
  when the update returns.

Usage::

    python benchmarks/memory.py
"""

import os
import sys
import warnings
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import pyro  # noqa: E402

import harness  # noqa: E402  (examples/harness)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_bytes(method) -> int:
    optim = method.optim
    if hasattr(optim, "get_state"):  # NGVI and pyro.optim
        return tensor_bytes(optim.get_state())
    # ivon-opt keeps hess and momentum in its param groups: count all but the params
    state = optim.state_dict()
    return tensor_bytes(state["state"]) + tensor_bytes(
        [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    )


class PeakMemory:
    """Wraps a callable; each call records the peak of the running sum of the
    allocations and frees of its ops, in time order (CPU, :mod:`torch.profiler`).
    Other attributes are the callable's (``CurvatureELBO`` asks the optimizer it
    runs with whether it is NGVI)."""

    def __init__(self, fn):
        self.fn, self.peak = fn, 0

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = self.fn(*args, **kwargs)
        total = peak = 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            total += event.self_cpu_memory_usage
            peak = max(peak, total)
        self.peak = peak
        return out


def update_peak_bytes(method, x, y) -> int:
    """Peak extra memory of the optimizer's update alone, in one step."""
    if hasattr(method, "svi"):
        meter = method.svi.optim = PeakMemory(method.svi.optim)
    else:
        meter = method.optim.step = PeakMemory(method.optim.step)
    method.step(x, y)
    return meter.peak


def table(title: str, methods, x, y, latent: int) -> None:
    vector = latent * 4  # float32
    print(f"\n{title}: latent size {latent:,} ({vector / 2**20:.2f} MiB in float32), batch {len(x)}\n")
    print("| method | optimizer state (latent vectors) | update's peak extra memory (latent vectors) |")
    print("|---|---:|---:|")
    for name, make in methods.items():
        pyro.set_rng_seed(0)
        method = make()
        with method.active():
            for _ in range(5):
                method.step(x, y)
            state = state_bytes(method)
            peak = update_peak_bytes(method, x, y)
        print(f"| {name} | {state / vector:.2f} | {peak / vector:.1f} |", flush=True)


def main():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    warnings.filterwarnings("ignore", "Memory block of unknown size")
    task = harness.digits_mlp()
    x, y = task.split.x_train[:task.batch_size], task.split.y_train[:task.batch_size]
    has_ivon = harness.ivon_installed()

    def latent_size(task):
        return sum(p.numel() for p in task.make_net().parameters())

    methods = {
        "NGVI ef (momentum 0.9)": lambda: harness.ngvi(task, "ef", lr=0.03, momentum=0.9),
        "NGVI ef (no momentum)": lambda: harness.ngvi(task, "ef", lr=0.03, momentum=0.0),
        "NGVI ggn (momentum 0.9)": lambda: harness.ngvi(task, "ggn", lr=0.1, momentum=0.9, damping=30.0),
        "NGVI + Trace_ELBO (momentum 0.9)": lambda: harness.ngvi(task, None, lr=0.03, momentum=0.9),
        "Pyro SVI + Adam (BBB)": lambda: harness.bayes_by_backprop(task, lr=1e-2),
    }
    if has_ivon:
        methods["ivon-opt IVON"] = lambda: harness.IVON(task, lr=0.1, hess_init=0.5)
    table("Digits MLP 64-100-10 (4 sites, one flat update)", methods, x, y, latent_size(task))

    wide = replace(task, make_net=lambda: torch.nn.Sequential(
        torch.nn.Linear(64, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 1000), torch.nn.ReLU(),
        torch.nn.Linear(1000, 10)))
    methods = {
        "NGVI reparam (momentum 0.9)": lambda: harness.ngvi(wide, "reparam", lr=0.03, momentum=0.9),
        "Pyro SVI + Adam (BBB)": lambda: harness.bayes_by_backprop(wide, lr=1e-2),
    }
    if has_ivon:
        methods["ivon-opt IVON"] = lambda: harness.IVON(wide, lr=0.1, hess_init=0.5)
    table("Digits MLP 64-1000-1000-10 (the 1000 x 1000 weight updated alone)", methods, x, y, latent_size(wide))


if __name__ == "__main__":
    main()
