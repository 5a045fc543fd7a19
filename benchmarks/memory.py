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
* **remembered scales**: the :math:`\\sigma` of every site NGVI keeps beside the guide's raw
  scales between steps (:mod:`pyro_ngvi.scales`), so that the next step reads no softplus; it
  is saved with NGVI's state (a copy in ``get_state()``), so the state column counts it too:
  what NGVI holds between steps is the state column;
* **scratch buffers kept**: NGVI's workspace (the element-wise pass's temporaries, rows of
  the longest group or span) and the statistics it recovers from gradients, made once and
  kept so that a step allocates nothing (their values do not outlive a step);
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
from pyro_ngvi import scales  # noqa: E402


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


def peak_memory(fn_owner, attribute: str):
    """Make ``fn_owner.<attribute>`` (a callable object, or a bound method) record, at each call,
    the peak of the running sum of the allocations and frees of its ops, in time order (CPU,
    :mod:`torch.profiler`), in ``.peak`` of the returned meter. An optimizer object keeps its
    identity (its class becomes a measuring subclass): ``SVI`` needs a ``PyroOptim``, and NGVI
    finds its ``SVI`` by the optimizer's identity."""
    meter = type("Meter", (), {"peak": 0})()

    def measured(call, *args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = call(*args, **kwargs)
        total = peak = 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            total += event.self_cpu_memory_usage
            peak = max(peak, total)
        meter.peak = peak
        return out

    target = getattr(fn_owner, attribute)
    if attribute == "optim":  # an optimizer object SVI calls
        class Measured(type(target)):
            def __call__(self, *args, **kwargs):
                return measured(super().__call__, *args, **kwargs)

        target.__class__ = Measured
    else:  # a bound method
        setattr(fn_owner, attribute, lambda *args, **kwargs: measured(target, *args, **kwargs))
    return meter


def update_peak_bytes(method, x, y) -> int:
    """Peak extra memory of the optimizer's update alone, in one step."""
    if hasattr(method, "svi"):
        meter = peak_memory(method.svi, "optim")
    else:
        meter = peak_memory(method.optim, "step")
    method.step(x, y)
    return meter.peak


def remembered_bytes(method) -> int:
    """Bytes of the scales NGVI remembers for the method's guide (:mod:`pyro_ngvi.scales`): a
    cache kept between steps beside the optimizer state (distinct storages counted once)."""
    if not hasattr(method, "guide"):
        return 0
    storages = {}
    with method.active():
        store = pyro.get_param_store()
        for name in store.keys():
            if ".scales." not in name:
                continue
            sigma = scales.known_scale(store._params[name])
            if sigma is not None:
                storage = sigma.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def workspace_bytes(method) -> int:
    """Bytes of NGVI's scratch buffers (:class:`~pyro_ngvi.groups.Workspace`, the element-wise
    pass's temporaries, and the statistics recovered from gradients, per site): made once and
    kept between steps so that a step allocates nothing; their values do not outlive a step."""
    optim = getattr(method, "optim", None)
    if not hasattr(optim, "_workspace"):
        return 0
    kept = [tensor for _, tensor in optim._buffers._kept.values()]
    return tensor_bytes(list(optim._workspace._buffers.values()) + kept)


def table(title: str, methods, x, y, latent: int) -> None:
    vector = latent * 4  # float32
    print(f"\n{title}: latent size {latent:,} ({vector / 2**20:.2f} MiB in float32), batch {len(x)}\n")
    print("| method | optimizer state (latent vectors) | of which the remembered scales (latent vectors) "
          "| update's peak extra memory (latent vectors) | scratch buffers kept (latent vectors) |")
    print("|---|---:|---:|---:|---:|")
    for name, make in methods.items():
        pyro.set_rng_seed(0)
        method = make()
        with method.active():
            for _ in range(5):
                method.step(x, y)
            state = state_bytes(method)
            peak = update_peak_bytes(method, x, y)
            cache = remembered_bytes(method)
            scratch = workspace_bytes(method)
        print(f"| {name} | {state / vector:.2f} | {cache / vector:.2f} | {peak / vector:.1f} | {scratch / vector:.1f} |",
              flush=True)


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
