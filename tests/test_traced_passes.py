"""
The traced path's memory passes (issue 24): NGVI's call on one large ``AutoNormal`` site under
``Trace_ELBO`` costs what its passes over the site's elements cost. Counted here with a
dispatch mode (every aten op reading or writing a span or more, in units of the whole site),
on a site of 8 spans; and the pieces that removed passes checked against brute-force forms.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pyro_ngvi import NGVI
from pyro_ngvi import steps as chain
from pyro_ngvi.policies import innovations
from pyro_ngvi.safeguards import EXCESS_SHARE, clip_, clip_target
from pyro_ngvi.variance import control_variate

SIZE, SPAN = 8192, 1024
VIEWS = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default,
         torch.ops.aten.alias.default, torch.ops.aten.as_strided.default, torch.ops.aten.select.int,
         torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default, torch.ops.aten.new_full.default,
         torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default, torch.ops.aten.t.default}


class Passes(TorchDispatchMode):
    """Sums, over the ops that touch at least a span, their largest tensor's length / SIZE."""

    def __init__(self):
        super().__init__()
        self.passes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = max([t.numel() for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)] or [0])
        if big >= SPAN and func not in VIEWS:
            self.passes += big / SIZE
        return out


def _passes_per_call(monkeypatch, **options) -> float:
    monkeypatch.setattr(chain, "SPAN", SPAN)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = torch.randn(SIZE, generator=torch.Generator().manual_seed(0))

    def model():
        z = pyro.sample("z", dist.Normal(data.new_zeros(()), 1.0).expand([SIZE]).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=data)

    guide = AutoNormal(model)
    optim = NGVI(guide=guide, **options)
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(3):
        svi.step()
    counter = Passes()

    class Counted(type(optim)):
        def __call__(self, *args, **kwargs):
            with counter:
                return super().__call__(*args, **kwargs)

    optim.__class__ = Counted
    for _ in range(2):
        svi.step()
    return counter.passes / 2


@pytest.mark.parametrize("options, before, bound", [
    (dict(), 141, 123),  # the adaptive steps: two passes over the spans (125 before the count's copy
    #                      and the known mask's third pass went)
    (dict(lr=0.1, beta=0.05), 63, 60),  # constant steps (count_nonzero became two cheaper passes)
])
def test_the_traced_call_makes_fewer_passes(monkeypatch, options, before, bound):
    """Pyro's Adam makes 14 such passes on this site (7 per tensor); NGVI made ``before``."""
    passes = _passes_per_call(monkeypatch, **options)
    assert passes <= bound + 0.5, passes


def test_clip_with_both_bounds_is_min_then_max():
    g = torch.Generator().manual_seed(1)
    step, radius = torch.randn(4096, generator=g) * 2, torch.rand(4096, generator=g)
    step[::37], radius[::41], step[::53], radius[::59], step[::61] = float("nan"), float("nan"), float("inf"), \
        float("inf"), -float("inf")
    reference = torch.maximum(torch.minimum(step, radius), -radius)  # the old clip_
    out = clip_(step.clone(), radius.clone(), -radius)
    assert torch.equal(out.isnan(), reference.isnan())
    assert torch.equal(out.nan_to_num(7.0), reference.nan_to_num(7.0))
    assert torch.equal(out.signbit(), reference.signbit())
    sigma = torch.rand(4096, generator=g) + 0.1
    assert torch.equal(torch.mul(sigma, -2.5), torch.mul(sigma, 2.5).neg_())  # (rounding is symmetric)


def test_clip_target_in_place_equals_the_copying_form_in_fewer_passes():
    g = torch.Generator().manual_seed(2)
    precision = torch.rand(4096, generator=g) * 3 + 0.1
    target = precision * (1 + 20 * torch.randn(4096, generator=g))
    excess = torch.randn(4096, generator=g) * 5
    count = torch.rand(4096, generator=g) * 30
    ref_target, ref_excess = clip_target(target.clone(), precision, excess.clone(), out=None, count=count)
    work = (torch.empty(4096), torch.empty(4096))
    kept = excess.clone()
    counter, given = Passes(), target.clone()  # (counted in units of SIZE)
    with counter:
        new_target, new_excess = clip_target(given, precision, kept, out=kept, scratch=work, count=count)
    assert new_excess is kept
    assert counter.passes * SIZE / 4096 <= 9  # (it made 11: a copy of the target, the radius negated)
    assert torch.equal(new_target, ref_target) and torch.equal(new_excess, ref_excess)
    share = torch.mul(precision, count).mul_(EXCESS_SHARE)
    assert (ref_excess != 0).any() and (ref_excess.abs() == share).any()  # both clips bite


def test_innovations_unsquared_and_the_control_variates_sigma():
    g = torch.Generator().manual_seed(3)
    n = 4096
    precision, target, grad = torch.rand(n, generator=g) + 0.1, torch.randn(n, generator=g), torch.randn(n, generator=g)
    drift, hdrift = torch.randn(n, generator=g), torch.randn(n, generator=g)
    sigma = precision.rsqrt()
    innovation, squares = innovations(target, precision, grad, drift, hdrift, sigma, squared=False)
    assert squares is None and torch.equal(innovation, (target - precision) / precision)
    known = (torch.rand(n, generator=g) > 0.3).to(precision.dtype)
    eps, eps_sq = torch.randn(n, generator=g), torch.rand(n, generator=g) * 3
    grad_cv, curvature_cv = grad.clone(), target.clone()
    root = control_variate(grad_cv, curvature_cv, eps, eps_sq - 1, precision, None, known, None)
    assert torch.equal(root, precision.rsqrt())
    c = torch.clamp(precision, min=0.0) * known  # the clamped form it had
    assert torch.equal(grad_cv, grad - c * precision.rsqrt() * eps)
    assert torch.equal(curvature_cv, target - (eps_sq - 1) * c)
