"""Real user paths on a device (``NGVI_TEST_DEVICE``, default ``cuda``; skipped without one): the
BNN recipe, dense guides, continual learning, Laplace, checkpoints, convnets with BatchNorm,
validation selection and subsampled plates, everything built on the device. Each path trains
past the deferred checks and the ELBO watch (read every 16 / 100 steps) and is checked against a
closed form or the same deterministic run on the CPU in float64. ``NGVI_TEST_DEVICE=cpu`` runs
them on the CPU. ``tests/test_cuda.py`` has the engine's Newton steps, the fast path's
deterministic steps, Laplace of a regression and the metrics."""

import math
import os

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from pyro_ngvi import (NGVI, BayesianNet, CurvatureELBO, KroneckerNormal, LowRankPrecisionNormal, laplace,
                       load_param_store, metrics, optimize_prior_precision, posterior_as_prior,
                       select_by_validation, start_task, with_priors)
from pyro_ngvi.nn.selection import validation_nll

DEVICE = os.environ.get("NGVI_TEST_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type
F64 = torch.float64

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def on_device(*tensors):
    for t in tensors:
        assert t.device.type == DEVICE_TYPE, t.device
        assert torch.isfinite(t).all()


def store_on_device():
    """Every param in the store lives on DEVICE and is finite."""
    store = pyro.get_param_store()
    assert len(store.keys()) > 0
    for name, value in store.items():
        assert value.device.type == DEVICE_TYPE, name
        assert torch.isfinite(value).all(), name


def store_copy():
    return {name: value.detach().cpu().clone() for name, value in pyro.get_param_store().items()}


def assert_same_store(got, expected, rtol, atol):
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name].to(expected[name].dtype), expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def classes(n, seed, dtype=torch.float32, device=DEVICE, features=6, num_classes=3, shift=0.0):
    """Inputs (standard normal plus ``shift``) and the classes of a fixed linear teacher."""
    teacher = torch.randn(features, num_classes, generator=torch.Generator().manual_seed(100), dtype=F64)
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed), dtype=F64) + shift
    return x.to(device, dtype), (x @ teacher).argmax(-1).to(device)


def regression_data(n, size, seed, device, correlation=0.6, noise=0.5):
    """A correlated design, its targets and the exact posterior (mean, covariance) under N(0, I)."""
    g = torch.Generator().manual_seed(seed)
    cov = correlation * torch.ones(size, size, dtype=F64) + (1 - correlation) * torch.eye(size, dtype=F64)
    x = torch.randn(n, size, generator=g, dtype=F64) @ torch.linalg.cholesky(cov).T
    y = x @ torch.randn(size, generator=g, dtype=F64) + noise * torch.randn(n, generator=g, dtype=F64)
    precision = x.T @ x / noise**2 + torch.eye(size, dtype=F64)
    mean = torch.linalg.solve(precision, x.T @ y / noise**2)
    return x.to(device), y.to(device), mean, torch.linalg.inv(precision)


def linear_model(noise=0.5):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype, device=x.device), 1.0).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(x @ w, noise), obs=y)
    return model


# ------------------------------------------------------------------ 1. the BNN recipe
@pytest.mark.parametrize("source, guide_kind", [("ggn", "autonormal"), ("ef", "autonormal"),
                                                ("reparam", "autonormal"), ("ggn", "kronecker")])
def test_bnn_recipe_trains_and_predicts_on_the_device(source, guide_kind):
    """The README's recipe in float32 on the device, 200 minibatch steps: no step skipped, the
    training loss falls, the guide stays on the device; Predictive and metrics there predict well."""
    x, y = classes(240, seed=1)
    x_test, y_test = classes(200, seed=2)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)).to(DEVICE)
    bnn = BayesianNet(net, "categorical", num_data=len(x), prior=1.0)
    guide = bnn.guide() if guide_kind == "autonormal" else KroneckerNormal(bnn)
    optim = NGVI()
    svi = SVI(bnn, guide, optim, loss=CurvatureELBO(source))
    epoch_losses = []
    for epoch in range(40):
        losses = [svi.step(x[batch], y[batch]) for batch in torch.randperm(len(x)).split(48)]
        epoch_losses.append(sum(losses) / len(losses))
    assert optim.num_steps == 200 and optim.num_skipped_steps == 0
    assert all(math.isfinite(v) for v in epoch_losses)
    assert sum(epoch_losses[-5:]) / 5 < 0.75 * epoch_losses[0], epoch_losses
    store_on_device()

    logits = Predictive(bnn, guide=guide, num_samples=16, return_sites=["output"])(x_test)["output"]
    assert logits.shape == (16, len(x_test), 3)
    probs = metrics.predictive_probs_from_logits(logits)
    on_device(logits, probs)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(x_test), device=DEVICE))
    accuracy, nll = metrics.accuracy(probs, y_test), metrics.nll(probs, y_test)
    ece = metrics.expected_calibration_error(probs, y_test)
    assert 0.85 < float(accuracy) <= 1 and 0 < float(nll) < 0.4 and 0 <= float(ece) < 0.2
    # the metrics of the device's predictive are those of its copy on the CPU
    probs_cpu, y_cpu = probs.cpu().double(), y_test.cpu()
    torch.testing.assert_close(nll.cpu().double(), metrics.nll(probs_cpu, y_cpu), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ece.cpu().double(), metrics.expected_calibration_error(probs_cpu, y_cpu),
                               rtol=1e-4, atol=1e-5)


def kronecker_damped_steps(device):
    """Deterministic steps of a KroneckerNormal with NGVI(damping=...) in float64."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double().to(device)
    x, y = classes(40, seed=3, dtype=F64, device=device)
    bnn = BayesianNet(net, "categorical", num_data=len(x))
    guide = KroneckerNormal(bnn)
    svi = SVI(bnn, guide, NGVI(lr=0.5, beta=0.5, damping=2.0), CurvatureELBO("ggn", deterministic=True))
    for _ in range(20):
        svi.step(x, y)
    if device == DEVICE:
        store_on_device()
    return store_copy()


def test_kronecker_guide_with_damping_on_the_device_takes_the_cpu_steps():
    """NGVI(damping=) on a KroneckerNormal adds damping * I to its factors (made on their device)."""
    expected, got = kronecker_damped_steps("cpu"), kronecker_damped_steps(DEVICE)
    assert_same_store(got, expected, rtol=1e-7, atol=1e-9)


# ------------------------------------------------------------------ 2. dense guides, Trace_ELBO
@pytest.mark.parametrize("guide_class", [AutoMultivariateNormal, LowRankPrecisionNormal])
def test_dense_guides_with_trace_elbo_reach_the_exact_posterior_mean_on_the_device(guide_class):
    """NGVI() and a one-draw Trace_ELBO, 600 steps, correlated regression (D = 5) in float64 on the
    device: the mean within 0.15 posterior sd of the exact one (0.006-0.04 on the CPU, seeds 0-13;
    LowRankPrecisionNormal's wide start takes 300-400 steps) and AutoMultivariateNormal's
    covariance within 20 %."""
    x, y, mean, covariance = regression_data(100, 5, seed=0, device=DEVICE)
    model = linear_model()
    guide = guide_class(model)
    optim = NGVI()
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(600):
        assert math.isfinite(svi.step(x, y))
    assert optim.num_skipped_steps == 0
    store_on_device()
    loc = guide.loc.detach()
    on_device(loc)
    sd = covariance.diagonal().sqrt()
    assert ((loc.cpu() - mean).abs() / sd).max() < 0.15
    if guide_class is AutoMultivariateNormal:
        tril = guide.scale_tril.detach() * guide.scale.detach()[:, None]
        on_device(tril)
        found = (tril @ tril.T).cpu()
        assert torch.linalg.matrix_norm(found - covariance) < 0.2 * torch.linalg.matrix_norm(covariance)
    draws = Predictive(model, guide=guide, num_samples=8, return_sites=["w"])(x)["w"]
    on_device(draws)


# ------------------------------------------------------------------ 3. continual learning
def test_conjugate_task_chain_on_the_device_ends_at_the_posterior_of_all_data():
    """The manual's chain (posterior_as_prior / with_priors / start_task, carry=True) on the device,
    120 Newton steps per task: the last prior is the exact posterior of both tasks' data."""
    size, noise = 3, 0.5
    g = torch.Generator().manual_seed(0)
    true_w = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    tasks = [(true_w + noise * torch.randn(n, size, generator=g, dtype=F64)).to(DEVICE) for n in (10, 30)]

    def model(data):
        w = pyro.sample("w", dist.Normal(torch.zeros(size, dtype=F64, device=DEVICE), 1.0).to_event(1))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(w, noise).to_event(1), obs=data)

    task_model, priors = model, None
    for data in tasks:
        guide = start_task(AutoNormal(task_model), priors, data, carry=True)
        svi = SVI(task_model, guide, NGVI(lr=1.0, beta=1.0), loss=CurvatureELBO("hessian", deterministic=True))
        for _ in range(120):
            svi.step(data)
        store_on_device()
        priors = posterior_as_prior(guide)
        task_model = with_priors(model, priors)
    all_data = torch.cat(tasks).cpu()
    precision = 1.0 + len(all_data) / noise**2
    on_device(priors["w"].mean, priors["w"].stddev)
    torch.testing.assert_close(priors["w"].mean.cpu(), all_data.sum(0) / noise**2 / precision, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(priors["w"].stddev.cpu(), torch.full([size], precision**-0.5, dtype=F64),
                               rtol=1e-10, atol=0)


def test_bayesian_net_continual_tasks_on_the_device():
    """Two tasks of the recipe (the same teacher, the second's inputs shifted), the first posterior
    as the second prior through bnn.with_priors: the model's prior is that posterior, the guide
    starts at it (carry=True) and stays on the device, and the network classifies both tasks."""
    x, y = classes(240, seed=4)
    tasks = [(x, y), classes(240, seed=9, shift=torch.tensor([1.5, -1.0, 0.0, 0.0, 1.0, 0.0], dtype=F64))]
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)).to(DEVICE)
    bnn = BayesianNet(net, "categorical", num_data=len(y), prior=1.0)
    priors = None
    for x_task, y_task in tasks:
        guide = start_task(bnn.guide(), priors, x_task[:2], y_task[:2], carry=True)
        if priors is not None:  # the model's prior and the new guide's start: the old posterior, on the device
            for site, prior in priors.items():
                prior_loc, prior_scale = bnn.prior(site)
                on_device(prior_loc, prior_scale)
                torch.testing.assert_close(prior_loc.expand_as(prior.mean), prior.mean, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(prior_scale.expand_as(prior.mean), prior.stddev, rtol=1e-6, atol=1e-7)
                loc, scale = guide._get_loc_and_scale(site)
                on_device(loc, scale, prior.mean)
                torch.testing.assert_close(loc.detach(), prior.mean, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(scale.detach(), prior.stddev, rtol=1e-5, atol=1e-7)
        optim = NGVI()
        svi = SVI(bnn, guide, optim, loss=CurvatureELBO("ggn"))
        for epoch in range(25):
            for batch in torch.randperm(len(y_task)).split(48):
                assert math.isfinite(svi.step(x_task[batch], y_task[batch]))
        assert optim.num_steps == 125 and optim.num_skipped_steps == 0
        store_on_device()
        priors = posterior_as_prior(guide)
        bnn = bnn.with_priors(priors)
        assert isinstance(bnn, BayesianNet)
    for x_task, y_task in tasks:
        logits = Predictive(bnn, guide=guide, num_samples=16, return_sites=["output"])(x_task)["output"]
        probs = metrics.predictive_probs_from_logits(logits)
        on_device(probs)
        assert float(metrics.accuracy(probs, y_task)) > 0.85


# ------------------------------------------------------------------ 4. Laplace of a network
def network_laplace(device):
    """laplace and optimize_prior_precision of a BayesianNet (fast path, ggn) in float64."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(25, 3, generator=g, dtype=F64).to(device)
    y = torch.randint(0, 3, (25,), generator=g).to(device)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double().to(device)
    bnn = BayesianNet(net, "categorical", num_data=25, prior=10.0**-0.5)
    res = laplace(bnn, x, y, curvature="ggn", num_steps=300, tol=1e-5)
    assert res.converged
    if device == DEVICE:
        on_device(*res.map.values(), *res.precision.values())
    converged = []
    first = (res.log_evidence, {k: v.detach().cpu() for k, v in res.map.items()},
             {k: v.detach().cpu() for k, v in res.precision.items()})
    best, evidence, search, _ = optimize_prior_precision(
        lambda alpha: BayesianNet(net, "categorical", num_data=25, prior=alpha**-0.5), [3.0, 10.0, 30.0], x, y,
        curvature="ggn", num_steps=1000, tol=1e-5, callback=lambda alpha, result: converged.append(result.converged))
    assert converged == [True] * 3
    if device == DEVICE:
        on_device(*search.map.values(), *search.precision.values())
        store_on_device()
    return first, (best, evidence, {k: v.detach().cpu() for k, v in search.map.items()})


def test_network_laplace_and_prior_precision_on_the_device_are_the_cpu_ones():
    """The same Newton steps on both (equal to rounding); the tolerances allow a line-search
    decision taken otherwise near the mode (each run stops within 1e-5 posterior sd of it)."""
    (ev_c, map_c, prec_c), (best_c, evs_c, smap_c) = network_laplace("cpu")
    (ev_d, map_d, prec_d), (best_d, evs_d, smap_d) = network_laplace(DEVICE)
    assert math.isfinite(ev_d) and ev_d == pytest.approx(ev_c, abs=1e-4)
    assert_same_store(map_d, map_c, rtol=0, atol=1e-4)
    assert_same_store(prec_d, prec_c, rtol=1e-4, atol=1e-6)
    assert best_d == best_c and evs_d.keys() == evs_c.keys()
    for alpha in evs_c:
        assert evs_d[alpha] == pytest.approx(evs_c[alpha], abs=1e-4)
    assert_same_store(smap_d, smap_c, rtol=0, atol=1e-4)


# ------------------------------------------------------------------ 5. checkpoints
def checkpoint_net(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double().to(device)
    return BayesianNet(net, "categorical", num_data=120, prior=1.0)


def train(bnn, optim, x, y, steps, deterministic):
    guide = bnn.guide()
    svi = SVI(bnn, guide, optim, CurvatureELBO("ggn", deterministic=deterministic))
    order = torch.Generator().manual_seed(7)
    for _ in range(steps // 3):
        for batch in torch.randperm(len(x), generator=order).split(40):
            svi.step(x[batch], y[batch])


@pytest.mark.parametrize("resume_on, deterministic", [(DEVICE, False), ("cpu", True)])
def test_a_checkpoint_saved_on_the_device_resumes_the_uninterrupted_run(tmp_path, resume_on, deterministic):
    """NGVI.save and the param store after 111 steps on the device; load_param_store and NGVI.load
    with map_location (the device, or the CPU with deterministic curvature), reseeded: the next 60
    steps are those of the optimizer that ran on. A fresh NGVI from the same params takes other
    steps. Both rebuild the net and guide, as after a restart (a new BayesianNet's first step is
    traced and draws other numbers than a running fast path would)."""
    x, y = classes(120, seed=5, dtype=F64)
    bnn, optim = checkpoint_net(DEVICE), NGVI()
    train(bnn, optim, x, y, 111, deterministic)
    saved = store_copy()
    pyro.get_param_store().save(tmp_path / "params.pt")
    optim.save(tmp_path / "optim.pt")
    pyro.set_rng_seed(11)
    train(checkpoint_net(DEVICE), optim, x, y, 60, deterministic)
    store_on_device()
    expected = store_copy()
    assert max(float((expected[k] - saved[k]).abs().max()) for k in saved) > 1e-3  # the 60 steps move

    def resume(load_state):
        pyro.clear_param_store()
        load_param_store(tmp_path / "params.pt", map_location=resume_on)
        resumed = NGVI()
        if load_state:
            resumed.load(tmp_path / "optim.pt", map_location=resume_on)
        pyro.set_rng_seed(11)
        train(checkpoint_net(resume_on), resumed, x.to(resume_on), y.to(resume_on), 60, deterministic)
        for name, value in pyro.get_param_store().items():
            assert value.device.type == torch.device(resume_on).type, name
        return store_copy()

    assert_same_store(resume(True), expected, rtol=1e-6, atol=1e-8)
    fresh = resume(False)
    assert max(float((fresh[k] - expected[k]).abs().max()) for k in expected) > 1e-3


# ------------------------------------------------------------------ 6. a convnet with BatchNorm
def convnet_steps(device):
    """110 deterministic steps (NGVI() defaults) of a Conv2d-BatchNorm-ReLU-pool BayesianNet in float64."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(3 * 4 * 4, 3)).double().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 1, 8, 8, generator=g, dtype=F64)
    y = (x[:, 0, :4].mean((1, 2)) > x[:, 0, 4:].mean((1, 2))).long() + (x[:, 0, :, :4].mean((1, 2)) > 0).long()
    x, y = x.to(device), y.to(device)
    bnn = BayesianNet(net, "categorical", num_data=40)
    guide = bnn.guide()
    optim = NGVI()
    svi = SVI(bnn, guide, optim, CurvatureELBO("ggn", deterministic=True))
    losses = [svi.step(x[batch], y[batch]) for _ in range(55) for batch in torch.arange(40).split(20)]
    assert optim.num_skipped_steps == 0 and losses[-1] < losses[0]
    if device == DEVICE:
        store_on_device()
        on_device(net[1].running_mean, net[1].running_var)
    return store_copy(), {"running_mean": net[1].running_mean.cpu(), "running_var": net[1].running_var.cpu()}


def test_batch_norm_convnet_on_the_device_takes_the_cpu_steps():
    """The BackPACK path (Conv2d, BatchNorm2d whose weights are point estimates): the device's
    steps, BatchNorm's running statistics included, are the CPU's."""
    (params_c, buffers_c), (params_d, buffers_d) = convnet_steps("cpu"), convnet_steps(DEVICE)
    assert any("1.weight" in name for name in params_c)  # BatchNorm's point estimates are in the store
    assert_same_store(params_d, params_c, rtol=1e-6, atol=1e-8)
    assert_same_store(buffers_d, buffers_c, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------ 7. validation selection
def test_select_by_validation_on_the_device():
    """Two prior scales, 30 epochs of 4 minibatches each on the device: the chosen guide lives on the
    device, its validation NLL is the one validation_nll recomputes, and it predicts well."""
    x, y = classes(128, seed=6)
    x_valid, y_valid = classes(64, seed=7)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(DEVICE)
    chosen = select_by_validation(net, "categorical", x, y, x_valid, y_valid, epochs=30, prior_scales=[1.0, 0.3],
                                  checkpoints=3, batch_size=32)
    assert chosen.prior_scale in (1.0, 0.3) and chosen.epoch in (10, 20, 30)
    assert sorted(chosen.scores) == [0.3, 1.0] and all(len(v) == 3 for v in chosen.scores.values())
    assert all(math.isfinite(nll) for v in chosen.scores.values() for _, nll in v)
    store_on_device()
    recomputed = validation_nll(chosen.bnn, chosen.guide, x_valid, y_valid, num_samples=32, seed=0)
    assert recomputed == pytest.approx(chosen.valid_nll, rel=1e-4, abs=1e-5)
    assert chosen.valid_nll < 0.5 * math.log(3)


def device_rng_state():
    return torch.cuda.get_rng_state(torch.device(DEVICE)) if DEVICE_TYPE == "cuda" else torch.get_rng_state()


def test_validation_nll_leaves_the_device_random_state_as_it_was():
    """validation_nll's docstring: the draws come from a seeded generator, 'the global random state
    is left as it was'; the draws of a guide on the device use the device's generator."""
    x, y = classes(32, seed=8)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DEVICE)
    bnn = BayesianNet(net, "categorical", num_data=32)
    guide = bnn.guide()
    guide(x, y)
    pyro.set_rng_seed(123)
    before = device_rng_state()
    first = validation_nll(bnn, guide, x, y, num_samples=4, seed=0)
    assert torch.equal(device_rng_state(), before)
    assert validation_nll(bnn, guide, x, y, num_samples=4, seed=0) == first  # seeded: the same draws


# ------------------------------------------------------------------ 9. subsampled plates
GROUPS, PER_GROUP, BATCH = 40, 5, 10


def hierarchical_model(y):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=F64, device=y.device), 10.0))
    with pyro.plate("groups", GROUPS, subsample_size=BATCH, device=y.device) as idx:
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        with pyro.plate("obs", PER_GROUP, dim=-2):
            pyro.sample("y", dist.Normal(theta, 1.0), obs=y[:, idx])


def test_subsampled_hierarchical_model_on_the_device_reaches_the_exact_means():
    """pyro.plate(subsample_size=10 of 40 groups, device=...) in the model and AutoNormal's guide,
    NGVI() and Trace_ELBO, 600 steps on the device: every mean within 0.3 exact posterior sd (at most
    0.11 on the CPU, seeds 0-7; the global mean is the slowest)."""
    g = torch.Generator().manual_seed(0)
    y = 3.0 + torch.randn(GROUPS, generator=g, dtype=F64) + torch.randn(PER_GROUP, GROUPS, generator=g, dtype=F64)
    precision = torch.zeros(GROUPS + 1, GROUPS + 1, dtype=F64)
    precision[0, 0] = 1 / 100 + GROUPS
    precision[0, 1:] = precision[1:, 0] = -1.0
    precision[1:, 1:] = torch.eye(GROUPS, dtype=F64) * (1.0 + PER_GROUP)
    covariance = torch.linalg.inv(precision)
    mean, sd = covariance @ torch.cat([torch.zeros(1, dtype=F64), y.sum(0)]), covariance.diagonal().sqrt()

    y = y.to(DEVICE)
    guide = AutoNormal(hierarchical_model,
                       create_plates=lambda y: pyro.plate("groups", GROUPS, subsample_size=BATCH, device=y.device))
    optim = NGVI()
    svi = SVI(hierarchical_model, guide, optim, Trace_ELBO())
    for _ in range(600):
        assert math.isfinite(svi.step(y))
    assert optim.num_skipped_steps == 0
    store_on_device()
    store = pyro.get_param_store()
    found = torch.cat([store["AutoNormal.locs.mu"].detach().reshape(1), store["AutoNormal.locs.theta"].detach()])
    assert found.shape == (GROUPS + 1,)
    assert ((found.cpu() - mean) / sd).abs().max() < 0.3
