"""
Full-size passes of one NGVI optimizer call on the traced site (issue 24): a 10^6-element
``AutoNormal`` site, ``z ~ N(0, I)``, ``x ~ N(z, I)`` observed, ``Trace_ELBO``. A dispatch mode sums,
over the aten ops (views aside) whose largest tensor has at least 2^17 elements, that length / 10^6
(an op on a span of 2^18 counts 0.26), with the time in them and a short stack of each; for
``NGVI()``, ``NGVI(lr=0.1, beta=0.05)`` and ``pyro.optim.Adam``. ``--verbose``: per op and place.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/traced_passes.py [--calls 3] [--verbose]
"""

import argparse
import collections
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro_ngvi import NGVI

SIZE = 10**6
#: ops on fewer elements than this are not counted (a span of the update is 2^18)
LEAST = 1 << 17
_A = torch.ops.aten
VIEWS = {_A.select.int, _A.new_full.default, _A.slice.Tensor, _A.view.default, _A.detach.default,
         _A.alias.default, _A._unsafe_view.default, _A.as_strided.default, _A.t.default, _A.expand.default,
         _A.unsqueeze.default, _A.squeeze.dim, _A.reshape.default}
_OURS = ("pyro_ngvi", "pyro/", "torch/optim")


class Passes(TorchDispatchMode):
    """Sums the passes (largest tensor's length / SIZE) and the time of the big ops dispatched,
    per op and the last three frames of ours that called it."""

    def __init__(self):
        super().__init__()
        self.passes = collections.Counter()
        self.seconds = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        largest = max([t.numel() for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)] or [0])
        if largest >= LEAST and func not in VIEWS:
            frames = [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                      if any(part in f.filename for part in _OURS)][-3:]
            key = (str(func), " < ".join(reversed(frames)))
            self.passes[key] += largest / SIZE
            self.seconds[key] += elapsed
        return out


def run(settings, calls: int, verbose: bool) -> None:
    """Count ``calls`` optimizer calls of NGVI(**settings) (Adam for ``None``) after 3 steps."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = torch.randn(SIZE, generator=torch.Generator().manual_seed(0))

    def model():
        z = pyro.sample("z", dist.Normal(data.new_zeros(()), 1.0).expand([SIZE]).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=data)

    guide = AutoNormal(model)
    guide()
    optim = pyro.optim.Adam({"lr": 1e-3}) if settings is None else NGVI(guide=guide, **settings)
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(3):
        svi.step()
    counter = Passes()

    class Counted(type(optim)):
        def __call__(self, *args, **kwargs):
            with counter:
                return super().__call__(*args, **kwargs)

    optim.__class__ = Counted  # (the same optimizer, its calls counted)
    for _ in range(calls):
        svi.step()
    print(f"== {settings}: {sum(counter.passes.values()) / calls:.1f} full-size passes per call (views "
          f"excluded; spans summed), {1e3 * sum(counter.seconds.values()) / calls:.2f} ms in them")
    if verbose:
        for key, seconds in counter.seconds.most_common():
            print(f"  {counter.passes[key] / calls:5.2f} {1e3 * seconds / calls:6.3f}ms {key[0]:32s} {key[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for settings in ({}, {"lr": 0.1, "beta": 0.05}, None):
        run(settings, args.calls, args.verbose)


if __name__ == "__main__":
    main()
