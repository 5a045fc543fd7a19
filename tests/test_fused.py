"""
The element-wise pass of a mean-field step (:mod:`pyro_ngvi.elementwise`) in its three forms:
the chain's own operations (eager, the default: bit for bit the step NGVI took before the pass
existed), the branch-free form a compiler traces, and that form compiled by ``torch.compile``
(:mod:`pyro_ngvi.update.fused`); the deferred finiteness checks (:mod:`pyro_ngvi.checks`)
whose masked write leaves the guide untouched; and, where a CUDA device is present, the same
on the GPU without a host synchronisation inside the optimizer's step.
"""

import copy
import itertools
import shutil
import warnings

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, NGVIWarning
from pyro_ngvi.elementwise import Branches, Inputs, Numbers, mean_field_pass
from pyro_ngvi.policies import NoiseState, noise_constants
from pyro_ngvi.scales import FastSoftplus
from pyro_ngvi.update import fused

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
COMPILER = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                              reason="torch.compile on the CPU needs a C++ compiler")
FLOATS = ("mean", "raw_scale", "scale", "momentum", "far", "spread")


def _inputs(b: Branches, n: int = 3000, sizes=None, dtype=torch.float32, device="cpu", seed=0) -> dict:
    """Random flat inputs for the branches ``b``: sigma across 1 (both forms of the raw scale),
    targets of both signs where the correction applies, masks, fresh and started elements."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device)

    def uniform(*shape):
        return torch.rand(*shape, generator=g, dtype=dtype).to(device)

    scale = torch.exp(normal(n) * 1.5 - 1.0)
    t = dict(mean=normal(n), raw_scale=FastSoftplus().inv(scale), grad=normal(n) * 10,
             curvature=normal(n) * 10 if b.correct else uniform(n) * 10, scale=scale if b.known_scale else None)
    if b.prior:
        t.update(prior_loc=normal(n) * 0.1, prior_precision=uniform(n) + 0.5)
    if b.mask:
        t["mask"] = uniform(n) > 0.3  # (bool; the other masks are 0 / 1 floats)
    if b.floor:
        t["floor"] = uniform(n) * 0.5 + (1.0 if b.at_most_one else 0.0)
    if b.control_variate:
        eps = normal(n)
        t.update(eps_mean=eps, eps_sq_mean=eps * eps)
        if b.rates != "adaptive":
            t["known"] = (uniform(n) > 0.2).to(dtype)
    if b.momentum in ("average", "mixed", "span"):
        t["momentum"] = normal(n) * 10
    if b.momentum == "span_first":
        t["momentum"] = torch.empty(n, dtype=dtype, device=device)
    if b.momentum == "mixed":
        t["started"] = (uniform(n) > 0.5).to(dtype)
    if b.rates == "warm":
        t["fresh"] = (uniform(n) > 0.5).to(dtype)
    if b.far:
        t["last_signs"] = (uniform(n) > 0.5).to(dtype)
    if b.rates == "adaptive":
        sizes = sizes or [n]
        t.update(count=torch.floor(uniform(n) * 40), drift=normal(n), hdrift=normal(n) * 0.1,
                 fresh=(uniform(n) > 0.9).to(dtype))
        t["noise"] = NoiseState(torch.full((len(sizes),), 3.0, dtype=dtype, device=device),
                                uniform(2, len(sizes), 2) + 0.1, **noise_constants(sizes, dtype, device))
    return t


def _copy(t: dict, branch_free: bool) -> Inputs:
    out = {}
    for key, value in t.items():
        if isinstance(value, NoiseState):
            value = NoiseState(*[v.clone() for v in value])
        elif value is not None:
            value = value.clone()
        out[key] = value
    return Inputs(**out)


def _numbers(b: Branches) -> Numbers:
    return Numbers(lr=0.3, beta=0.1, rho=0.9 if b.momentum != "none" else 0.0, damping=2.0, tau=0.7, max_step=3.0,
                   factor=2.0, first_count=0.0)


def _assert_same_step(out, ref, dtype, ulps: float):
    """Every output within ``ulps`` ulps of the larger magnitude of its tensor (a value computed by
    cancellation, such as a mean step near 0, keeps the absolute error of its operands)."""
    eps = torch.finfo(dtype).eps
    for name in FLOATS:
        a, c = getattr(ref, name), getattr(out, name)
        assert (a is None) == (c is None), name
        if a is None:
            continue
        a, c = a.double(), c.double()
        scale = a.abs().max().clamp(min=1.0)
        torch.testing.assert_close(c, a, rtol=ulps * eps, atol=ulps * eps * float(scale), msg=name)
    assert bool(out.clamped) == bool(ref.clamped)
    if ref.signs is not None:
        assert torch.equal(out.signs.bool(), ref.signs.bool())
    if ref.adaptive is not None:
        for name in ("beta", "lr", "count", "hdrift", "steps", "noise"):
            torch.testing.assert_close(getattr(out.adaptive, name).double(), getattr(ref.adaptive, name).double(),
                                       rtol=ulps * eps, atol=ulps * eps, msg=name)


def _configurations():
    """Every valid combination of the static branches that interact (the span forms of momentum
    aside: a span is one site, eager only); the tempering, the floor and whether sigma is known,
    which each act alone, take turns (each value with every other branch on and off)."""
    combinations = itertools.product(
        (False, True), (False, True), (False, True), ("none", "average", "mixed"), ("constant", "warm", "adaptive"),
        (False, True), (False, True), (None, "plain", "clip"), (False, True))
    for index, (control, prior, mask, momentum, rates, correct, trust, guard, signs) in enumerate(combinations):
        if guard and (trust or rates == "adaptive"):  # a guarded step is a Newton step at the mean
            continue
        if rates == "adaptive" and not signs:  # the adaptive steps are for sampled statistics
            continue
        yield Branches(tau=index % 2 == 0, control_variate=control, prior=prior, mask=mask, momentum=momentum,
                       rates=rates, correct=correct, trust=trust, floor=index % 3 != 0, damping=True,
                       guarded=guard is not None, guard_clip=guard == "clip", signs=signs, far=signs,
                       spread=prior and not mask, known_scale=index % 5 != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_branch_free_pass_is_the_chain_in_every_configuration(dtype):
    """The form a compiler traces (no branch on values: both forms of the raw scale selected
    element by element, float signs and counts) gives the chain's step to a few ulps in float32
    (the raw scale's two forms differ there) and exactly in float64 (torch's own kernels)."""
    ulps = 8.0 if dtype == torch.float32 else 0.0
    count = 0
    for b in _configurations():
        t = _inputs(b, n=257, dtype=dtype, seed=count)
        ref = mean_field_pass(b, _copy(t, False), _numbers(b), FastSoftplus())
        free = b._replace(branch_free=True)
        out = mean_field_pass(free, _copy(t, True), _numbers(b), FastSoftplus())
        _assert_same_step(out, ref, dtype, ulps)
        count += 1
    assert count > 600


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pass_in_the_workspace_is_the_pass_with_new_tensors(dtype):
    """Eagerly the pass writes its temporaries into the optimizer's workspace and its results into
    the tensors it is given (the momentum buffer, the adaptive steps' state, the out_* tensors):
    bit for bit the step it takes with new tensors, in every configuration, and the workspace
    holds nothing between calls (a second configuration after the first, same buffers)."""
    from pyro_ngvi.groups import Workspace
    from pyro_ngvi.steps import workspace_scratch

    workspace = Workspace()
    count = 0
    for b in _configurations():
        t = _inputs(b, n=257, dtype=dtype, seed=count)
        ref = mean_field_pass(b, _copy(t, False), _numbers(b), FastSoftplus())
        inputs = _copy(t, False)
        out = mean_field_pass(b, inputs, _numbers(b), FastSoftplus(), workspace_scratch(workspace, 257, inputs.grad))
        _assert_same_step(out, ref, dtype, 0.0)
        if b.momentum in ("average", "mixed"):  # written in place into the momentum buffer
            assert out.momentum is inputs.momentum
        if b.rates == "adaptive" and b.momentum == "none":
            assert out.adaptive.count is inputs.count and out.adaptive.hdrift is inputs.hdrift
        count += 1
    assert count > 600


def test_masked_pass_writes_only_when_ok():
    """A masked pass (a deferred check) returns its step where ``ok`` holds and exactly the old
    state where it does not: mean, raw scale, sigma, momentum, the adaptive steps' state."""
    b = Branches(control_variate=True, prior=True, momentum="average", rates="adaptive", trust=True, floor=True,
                 damping=True, signs=True, far=True, spread=True, masked=True)
    t = _inputs(b)
    for ok in (True, False):
        inputs = _copy(t, False)._replace(ok=torch.tensor(ok))
        out = mean_field_pass(b, inputs, _numbers(b), FastSoftplus())
        ref = mean_field_pass(b._replace(masked=False), _copy(t, False), _numbers(b), FastSoftplus())
        if ok:
            _assert_same_step(out, ref, torch.float32, 0.0)
            continue
        assert torch.equal(out.mean, t["mean"]) and torch.equal(out.raw_scale, t["raw_scale"])
        assert torch.equal(out.scale, t["scale"]) and torch.equal(out.momentum, t["momentum"])
        assert torch.equal(out.adaptive.count, t["count"]) and torch.equal(out.adaptive.hdrift, t["hdrift"])
        assert torch.equal(out.adaptive.noise, t["noise"].noise) and not bool(out.clamped)


#: A covering set for the compiled pass: each branch on and off at least once (compiling costs
#: seconds per configuration: every combination is checked in its eager branch-free form above).
COVERING = [
    Branches(prior=True, momentum="average", correct=False, floor=True, damping=True, spread=True,
             at_most_one=True),  # the BayesianNet recipe, ef / ggn
    Branches(tau=True, control_variate=True, prior=True, momentum="mixed", rates="warm", trust=True, floor=True,
             signs=True, far=True, known_scale=False),  # sampled, first steps
    Branches(control_variate=True, rates="adaptive", trust=True, signs=True, far=True, mask=True),  # NGVI() traced
    Branches(prior=True, guarded=True, guard_clip=True, correct=True, spread=True),  # Newton steps
]


@COMPILER
@pytest.mark.parametrize("b", COVERING, ids=["recipe", "sampled-first", "adaptive-masked", "guarded"])
def test_compiled_pass_is_the_chain(b):
    """The pass compiled by torch.compile (inductor's C++ loops) gives the chain's step to a few ulps."""
    t = _inputs(b, n=3000, seed=1)
    ref = mean_field_pass(b, _copy(t, False), _numbers(b), FastSoftplus())
    free = b._replace(branch_free=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused.CompileWarning)  # a fallback to eager would prove nothing
        out = fused.run(mean_field_pass, free, True, _copy(t, True), _numbers(b), None)
    assert (mean_field_pass, free) in fused.compile_seconds
    _assert_same_step(out, ref, torch.float32, 8.0)


@COMPILER
def test_ngvi_compiled_trains_as_eager(monkeypatch):
    """NGVI(compile=True) on a BayesianNet takes the eager steps to a few ulps, written into the
    guide's own tensors; a step's ulps move the next draws only by as much. Two groups of two
    sizes with one configuration (the recipe's first layer alone, the rest flat): one
    compilation each, none falling back to eager (dynamo once compiled the second size with
    symbolic sizes, which fails on views of a parameter: CompileWarning, an error here)."""
    from pyro_ngvi import groups, steps

    monkeypatch.setattr(steps, "COMPILE_MIN", 64)
    monkeypatch.setattr(groups, "FLAT_MAX", 200)  # the first weight (256) alone, the rest (131) flat
    fused.compiled_kernels.clear()
    results = []
    for compile in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
        bnn = BayesianNet(net, "categorical", num_data=64)
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        guide = bnn.guide()
        svi = SVI(bnn, guide, NGVI(momentum=0.0, warm_start=False, compile=compile), CurvatureELBO("reparam"))
        for _ in range(3):
            svi.step(x, y)
        results.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    assert sorted(key[2].numel() for key in fused.compiled_kernels) == [131, 256]
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-6)


def _counting_model(bad_steps, size=80):
    """A conjugate model whose log density has a non-finite gradient at the given evaluations (counted);
    above CROSS_MAX elements (no cross terms, whose steps are checked at once)."""
    calls = [0]
    data = torch.randn(size, generator=torch.Generator().manual_seed(1))

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(size), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=data)
        calls[0] += 1
        if calls[0] - 1 in bad_steps:
            pyro.factor("broken", (z - z.detach()).abs().sqrt().sum())  # 0, with a NaN gradient

    return model


def _run(sync_every, bad_steps, steps=11):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _counting_model(bad_steps)
    guide = AutoNormal(model)
    optim = NGVI()
    optim.sync_every = sync_every
    svi = SVI(model, guide, optim, Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NGVIWarning)
        for step in range(steps):
            svi.step()
    store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return store, optim, [w for w in caught if issubclass(w.category, NGVIWarning)]


def test_deferred_checks_skip_a_nonfinite_step_as_a_checked_run_does():
    """With the checks read every 4 steps (as on CUDA), a step with a non-finite gradient writes
    nothing (masked), is counted and warned about at the next read, and the run ends where a run
    checked at every step (which skips it before any write) ends, bit for bit."""
    checked, checked_optim, checked_warnings = _run(1, {3})
    deferred, deferred_optim, deferred_warnings = _run(4, {3})
    for name in checked:
        assert torch.equal(deferred[name], checked[name]), name
    assert checked_optim.num_skipped_steps == deferred_optim.num_skipped_steps == 1
    assert checked_optim.num_steps == deferred_optim.num_steps == 10
    # the schedules' clock (each site's steps taken) is corrected at the read too
    assert [state.taken for state in deferred_optim._states.values()] == [10]
    assert len(checked_warnings) == len(deferred_warnings) == 1
    assert "non-finite" in str(deferred_warnings[0].message) and "'z'" in str(deferred_warnings[0].message)
    assert "steps late" in str(deferred_warnings[0].message)  # it was deferred
    clean, _, none = _run(4, set())
    reference, _, _ = _run(1, set())
    assert not none and all(torch.equal(clean[k], reference[k]) for k in clean)


# --------------------------------------------------------------------------- CUDA
@CUDA
def test_cuda_pass_is_the_cpu_pass():
    """The eager pass on CUDA (torch's own softplus kernels) gives the CPU step in float64."""
    for b in COVERING:
        t = _inputs(b, n=999, dtype=torch.float64)
        cpu = mean_field_pass(b, _copy(t, False), _numbers(b), FastSoftplus())
        gpu_inputs = {k: (NoiseState(*[x.cuda() for x in v]) if isinstance(v, NoiseState) else
                          None if v is None else v.cuda()) for k, v in t.items()}
        gpu = mean_field_pass(b, _copy(gpu_inputs, False), _numbers(b), FastSoftplus())
        gpu = gpu._replace(**{name: getattr(gpu, name).cpu() for name in FLOATS + ("signs", "clamped")
                              if getattr(gpu, name) is not None})
        if gpu.adaptive is not None:
            gpu = gpu._replace(adaptive=gpu.adaptive._replace(**{k: v.cpu() for k, v in gpu.adaptive._asdict().items()
                                                                 if v is not None}))
        _assert_same_step(gpu, cpu, torch.float64, 1e3)


@CUDA
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_step_has_no_host_synchronisation(compile):
    """On CUDA, NGVI's step of a BayesianNet's guide reads nothing back to the host between its
    deferred checks (torch.cuda's sync debug mode raises on any synchronisation)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    net = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 3)).cuda()
    bnn = BayesianNet(net, "categorical", num_data=64)
    x, y = torch.randn(64, 8, device="cuda"), torch.randint(0, 3, (64,), device="cuda")
    guide = bnn.guide()
    guide(x, y)
    optim = NGVI(guide=guide, compile=compile)
    elbo = CurvatureELBO("ggn")
    for step in range(6):
        elbo.loss_and_grads(bnn, guide, x, y)
        params = [pyro.param(name).unconstrained() for name in pyro.get_param_store().keys()]
        if 2 <= step < 6:  # (the first steps read the family's floor once; the 16th reads the checks)
            torch.cuda.set_sync_debug_mode("error")
        try:
            optim(params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert optim.num_steps == 6 and all(torch.isfinite(v).all() for v in pyro.get_param_store().values())


@COMPILER
@pytest.mark.parametrize("args, kept", [(dict(), "count"), (dict(lr=0.1, beta=0.05, momentum=0.9), "momentum")],
                         ids=["adaptive", "constant-with-momentum"])
def test_compiled_traced_site_steps_as_eager(monkeypatch, args, kept):
    """A traced AutoNormal site updated by the compiled pass (the momentum and the adaptive counts
    written into their buffers by the pass's own loop) takes the eager step from the same guide and
    optimizer state, to a few ulps, at the first steps and later ones. (Each step starts both from
    the compiled run's state: over several steps the Price estimate's cancellation would grow the
    ulps of one step into the next draws.)"""
    from pyro_ngvi import steps

    monkeypatch.setattr(steps, "COMPILE_MIN", 64)
    data = torch.randn(300, generator=torch.Generator().manual_seed(2))

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(300), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=data)

    params = optim_state = None
    for step in range(4):
        runs = []
        for compile in (False, True):
            pyro.clear_param_store()
            if params is not None:  # (Pyro's set_state keeps the tensors it is given: the step writes them)
                pyro.get_param_store().set_state(copy.deepcopy(params))
            optim = NGVI(compile=compile, **args)
            if optim_state is not None:
                optim.set_state(optim_state)
            svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
            pyro.set_rng_seed(step)
            with warnings.catch_warnings():
                warnings.simplefilter("error", fused.CompileWarning)  # (a fallback to eager would prove nothing)
                svi.step()
            runs.append((pyro.get_param_store().get_state(), optim.get_state()))
        (eager_params, eager_state), (params, optim_state) = runs
        for name, value in eager_params["params"].items():
            torch.testing.assert_close(params["params"][name], value, rtol=1e-5, atol=1e-6)
        (site, eager_site), = eager_state["ngvi"]["sites"].items()
        compiled_site = optim_state["ngvi"]["sites"][site]
        assert eager_site[kept] is not None
        for key, value in eager_site.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(compiled_site[key], value, rtol=1e-5, atol=1e-6)


def _scaled(configuration, x):
    return x * int(configuration)


@COMPILER
def test_more_configurations_than_dynamo_keeps_per_code_object_all_compile():
    """Each configuration compiles into a function of its own: dynamo keeps at most 8 graphs per
    code object, and a process that meets a ninth configuration (other branches, other sites)
    must not fall back to eager."""
    import torch._dynamo

    x = torch.arange(4.0)
    limit = torch._dynamo.config.recompile_limit
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused.CompileWarning)
        for configuration in range(1, limit + 3):
            assert torch.equal(fused.run(_scaled, str(configuration), True, x), x * configuration)
    assert all((_scaled, str(c)) in fused.compile_seconds for c in range(1, limit + 3))
