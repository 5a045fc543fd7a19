"""
Full-size passes of one NGVI optimizer call on the traced site (issue 24): a 10^6-element
``AutoNormal`` site, ``z ~ N(0, I)``, ``x ~ N(z, I)`` observed, ``Trace_ELBO``. A dispatch mode sums,
over the aten ops (views aside) whose largest tensor has at least 2^17 elements, that length / 10^6
(an op on a span of 2^18 counts 0.26), with the time in them and a short stack of each; for
``NGVI()``, ``NGVI(lr=0.1, beta=0.05)`` and ``pyro.optim.Adam``. ``-v``: per op and place.

Usage: ``S=3 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/traced_passes.py [-v]``
"""
import sys, traceback, collections, torch, pyro, pyro.distributions as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro_ngvi import NGVI
torch.set_num_threads(1)
N = 10**6
T = 1 << 17
VIEWS = {torch.ops.aten.select.int, torch.ops.aten.new_full.default, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default, torch.ops.aten.t.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.reshape.default}
class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.ops = collections.Counter(); self.tm = collections.Counter(); self.n = 0; self.ttot = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import time as _t; t0 = _t.perf_counter(); out = func(*args, **(kwargs or {})); dt = _t.perf_counter() - t0
        flat = tree_flatten((args, kwargs, out))[0]
        big = max([t.numel() for t in flat if isinstance(t, torch.Tensor)] or [0])
        if big >= T and func not in VIEWS:
            self.n += big / N
            st = [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                  if 'pyro_ngvi' in f.filename or 'pyro/' in f.filename or 'torch/optim' in f.filename][-3:]
            self.ops[(str(func), " < ".join(reversed(st)))] += big / N; self.tm[(str(func), " < ".join(reversed(st)))] += dt; self.ttot += dt
        return out
def run(kw, verbose):
    pyro.clear_param_store(); pyro.set_rng_seed(0)
    data = torch.randn(N, generator=torch.Generator().manual_seed(0))
    def model():
        z = pyro.sample("z", dist.Normal(data.new_zeros(()), 1.0).expand([N]).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=data)
    guide = AutoNormal(model); guide()
    opt = NGVI(guide=guide, **kw) if kw is not None else pyro.optim.Adam({"lr": 1e-3})
    svi = SVI(model, guide, opt, Trace_ELBO())
    for _ in range(3): svi.step()
    cls = type(opt); c = Count()
    class W(cls):
        def __call__(self, *a, **k):
            with c: return super().__call__(*a, **k)
    opt.__class__ = W
    S = int(__import__('os').environ.get('S', 3))
    for _ in range(S): svi.step()
    print(f"== {kw}: {c.n / S:.1f} full-size op passes per call (views excluded; spans summed), {1e3*c.ttot/S:.2f} ms in them")
    if verbose:
        for (f, st), n in sorted(c.ops.items(), key=lambda x: -c.tm[x[0]]):
            print(f"  {n/S:5.2f} {1e3*c.tm[(f, st)]/S:6.3f}ms {f:32s} {st}")
v = "-v" in sys.argv
for kw in [dict(), dict(lr=0.1, beta=0.05), None]:
    run(kw, v)
