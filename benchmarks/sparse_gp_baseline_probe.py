"""
Probe (not the package): other baselines ``b`` for the curvature's control variate
``h <- h - b eps / sigma`` of the adaptive steps, swapped in by wrapping
``pyro_ngvi.elementwise._prepare`` and ``adaptive_rates`` (eager mean-field passes whose sigma is known;
compiled passes and a large site's two passes are left as they are). Numbers:
``sparse_gp_seed0.md``, "The control variate's baseline (2026-11-29)".

Modes (``--mode``), per element, with ``r = 1/(n + 1)`` the drift's rate (n the adaptive count):

- ``main``: ``b = drift``, the running mean of g at rate r (what NGVI does).
- ``transport``: ``b = drift + c (mu - m)``, ``m`` the running mean of the means at the drift's rate and
  weights (the mean the drift's gradients stand for), ``c = lambda - lambda_0`` (clamped at 0).
- ``zero``: ``b = 0`` (the eps^2 - 1 term kept).
- ``line``: ``b = gbar + s (mu - wbar)``, the weighted least-squares line of the raw g on the past draw
  points ``w = mu + sigma eps`` (running means and co-moments at rate r; ``s = S_gw / S_ww``), taken at the
  current mean (from the third step; before it the drift). Options (environment): ``MISFIT=M`` restarts an
  element's line where it missed this step's g by more than M sds; ``SLOPEPOS=1`` clamps s at 0;
  ``LINEPHASE=1`` uses it only while n <= 1/beta; ``RIDGE=k`` takes ``s = S_gw / (S_ww + k sigma^2)``.
- ``select``: the line where its squared error in predicting the past steps' g at the draw (running mean
  at rate 0.3) was below the drift's (``drift + c sigma eps``), else the drift.

Usage::

    python benchmarks/sparse_gp_baseline_probe.py --mode line --problem gp --seeds 0 1 2 3 4
    python benchmarks/sparse_gp_baseline_probe.py --mode line --problem funnel --seeds 0 1 2 3 4
"""

import argparse
import os
import sys
import warnings

import torch

import pyro
import pyro.distributions as dist
import pyro_ngvi.elementwise as E
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI

MODE = "main"
_ANCHOR, _LINE, _ERR, _cur = {}, {}, {}, {}
_prepare, _adaptive_rates = E._prepare, E.adaptive_rates


def _slope(sww, sgw, fallback):
    return torch.where(sww > 1e-12, sgw / sww.clamp(min=1e-30), fallback)


def prepare(b, t, n, transform, w):
    if (MODE == "main" or not b.control_variate or b.rates != "adaptive" or b.prepared or t.drift is None
            or t.scale is None):
        return _prepare(b, t, n, transform, w)
    key = t.drift.data_ptr()
    _cur.clear()
    _cur.update(key=key, mean=t.mean.clone(), w=t.mean + t.scale * t.eps_mean, g=t.grad.clone(), sigma=t.scale.clone())
    anchor = _ANCHOR.get(key)
    if anchor is None:
        return _prepare(b, t, n, transform, w)
    precision = t.scale.pow(-2)
    c = precision if t.prior_precision is None else (precision - t.prior_precision).clamp(min=0)
    base, line = t.drift.clone(), _LINE.get(key)
    if MODE == "transport":
        base = t.drift + c * (t.mean - anchor)
    elif MODE == "zero":
        base = torch.zeros_like(t.drift)
    elif MODE in ("line", "select") and line is not None and line[0] >= 2:
        _, mw, mg, sww, sgw = line
        slope = _slope(sww, sgw, c)
        if MODE == "line" and os.environ.get("RIDGE"):
            slope = sgw / (sww + float(os.environ["RIDGE"]) * t.scale.square())
        if MODE == "line" and os.environ.get("SLOPEPOS"):
            slope = slope.clamp(min=0)
        at_mean = mg + slope * (t.mean - mw)
        if MODE == "line":
            base = at_mean
            if os.environ.get("LINEPHASE"):
                base = torch.where(t.count <= 1.0 / n.beta, base, t.drift)
        else:
            err = _ERR.get(key)
            if err is not None:
                base = torch.where(err[0] < err[1], at_mean, t.drift)
            _cur["pred"] = (mg + slope * (_cur["w"] - mw), t.drift + c * t.scale * t.eps_mean)
    return _prepare(b, t._replace(drift=base), n, transform, w)


def adaptive_rates(grad, direction, drift, pull, target, precision, count, hdrift, fresh, *args, **kwargs):
    if MODE != "main" and "key" in _cur:
        key, mean, rate = _cur["key"], _cur["mean"], 1.0 / (count + 1.0)
        a = _ANCHOR.get(key)
        a = mean.clone() if a is None else torch.lerp(a, mean, rate)
        _ANCHOR[key] = a if fresh is None else torch.lerp(a, mean, fresh)
        if "pred" in _cur:
            e = torch.stack([(_cur["g"] - p).square() for p in _cur["pred"]])
            old = _ERR.get(key)
            _ERR[key] = e if old is None else torch.lerp(old, e, 0.3)
        point, g, line = _cur["w"], _cur["g"], _LINE.get(key)
        if line is None:
            _LINE[key] = [1, point, g, torch.zeros_like(g), torch.zeros_like(g)]
        else:
            k, mw, mg, sww, sgw = line
            dw, dg = point - mw, g - mg
            new = [k + 1, mw + rate * dw, mg + rate * dg, (sww + rate * dw * dw) * (1 - rate),
                   (sgw + rate * dg * dw) * (1 - rate)]
            misfit = float(os.environ.get("MISFIT", "inf"))
            if misfit < float("inf") and k >= 2:
                far = (g - mg - _slope(sww, sgw, torch.zeros_like(sww)) * dw).abs() * _cur["sigma"] > misfit
                fresh_line = [point, g, torch.zeros_like(g), torch.zeros_like(g)]
                new = [k + 1] + [torch.where(far, f, v) for f, v in zip(fresh_line, new[1:])]
            _LINE[key] = new
        _cur.clear()
    return _adaptive_rates(grad, direction, drift, pull, target, precision, count, hdrift, fresh, *args, **kwargs)


def funnel(seed: int, steps: int = 1000) -> str:
    """tests/test_hardening.py's funnel, one draw, 1,000 steps: the -ELBO of 2,000 draws after it."""
    generator = torch.Generator().manual_seed(0)
    y = 0.01 * torch.randn(50, generator=generator) + torch.randn(50, generator=generator)

    def model(y):
        s = pyro.sample("s", dist.Normal(0.0, 3.0))
        with pyro.plate("k", 50):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(s.exp() * z, 1.0), obs=y)

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            svi.step(y)
    with torch.no_grad():
        pyro.set_rng_seed(100)
        loss = Trace_ELBO(num_particles=2000, vectorize_particles=True).loss(model, guide, y)
    return f"{loss:.2f} (s {pyro.param('AutoNormal.locs.s').item():.2f}, sd {pyro.param('AutoNormal.scales.s').item():.3f})"


def main(argv=None):
    global MODE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="main", choices=["main", "transport", "zero", "line", "select"])
    parser.add_argument("--problem", default="gp", choices=["gp", "funnel"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    MODE = args.mode
    E._prepare, E.adaptive_rates = prepare, adaptive_rates
    for seed in args.seeds:
        _ANCHOR.clear(), _LINE.clear(), _ERR.clear(), _cur.clear()
        if args.problem == "gp":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import sparse_gp
            print(f"{MODE} seed {seed}: {sparse_gp.run('ngvi', seed, args.steps or 2000)}", flush=True)
        else:
            print(f"{MODE} funnel seed {seed}: {funnel(seed, args.steps or 1000)}", flush=True)


if __name__ == "__main__":
    main()
