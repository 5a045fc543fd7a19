"""The engine on a CUDA device takes the CPU's steps (float64, deterministic curvature, so no
random draw differs between the devices); skipped without a device. Each check runs a function
of ``device`` twice, on the CPU and on CUDA, and compares what the guide holds."""

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Predictive
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, KroneckerNormal, laplace, metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, D = 40, 4


def data(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    x = x + 0.8 * x[:, :1]
    y = x @ torch.randn(D, generator=g, dtype=torch.float64) + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=x.dtype, device=x.device), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)


def exact(x, y):
    precision = torch.eye(D, dtype=x.dtype) + x.T @ x / 0.25
    return torch.linalg.solve(precision, x.T @ y / 0.25), precision


def newton_steps(device, guide_class, curvature):
    """Three deterministic NGVI steps (lr = beta = 1: Newton steps) from the guide's default start."""
    pyro.clear_param_store()
    x, y = data(device)
    guide = guide_class(regression)
    svi = SVI(regression, guide, NGVI(lr=1.0, beta=1.0), CurvatureELBO(curvature, deterministic=True))
    for _ in range(3):
        svi.step(x, y)
    return {name: value.detach().cpu() for name, value in pyro.get_param_store().items()}


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoMultivariateNormal])
@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_newton_steps_on_cuda_are_the_cpu_steps_and_land_on_the_posterior(guide_class, curvature):
    cpu, gpu = newton_steps("cpu", guide_class, curvature), newton_steps("cuda", guide_class, curvature)
    assert cpu.keys() == gpu.keys()
    for name in cpu:
        torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-10, atol=1e-12)
    mean, precision = exact(*data("cpu"))
    if guide_class is AutoMultivariateNormal:  # the exact posterior, in one step
        torch.testing.assert_close(gpu["AutoMultivariateNormal.loc"], mean, rtol=0, atol=1e-8)
        tril = gpu["AutoMultivariateNormal.scale_tril"] * gpu["AutoMultivariateNormal.scale"][:, None]
        torch.testing.assert_close(tril @ tril.T, torch.linalg.inv(precision), rtol=0, atol=1e-8)
    else:  # mean-field Newton: the precision is the Hessian's diagonal
        torch.testing.assert_close(gpu["AutoNormal.scales.w"], precision.diagonal().rsqrt(), rtol=1e-8, atol=0)


def network_steps(device, source, guide_kind):
    """Four deterministic steps of a BayesianNet's guide through the fast path, from one start."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 3)).double().to(device)
    bnn = BayesianNet(net, "categorical", num_data=N)
    x, _ = data(device)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    guide = bnn.guide() if guide_kind == "autonormal" else KroneckerNormal(bnn)
    guide(x, y)
    svi = SVI(bnn, guide, NGVI(lr=0.5, beta=0.5), CurvatureELBO(source, deterministic=True))
    for _ in range(4):
        svi.step(x, y)
    return {name: value.detach().cpu() for name, value in pyro.get_param_store().items()}


@pytest.mark.parametrize("source, guide_kind", [("ggn", "autonormal"), ("ef", "autonormal"),
                                                ("hessian", "autonormal"), ("ggn", "kronecker")])
def test_network_fast_path_on_cuda_takes_the_cpu_steps(source, guide_kind):
    cpu, gpu = network_steps("cpu", source, guide_kind), network_steps("cuda", source, guide_kind)
    assert cpu.keys() == gpu.keys() and cpu
    for name in cpu:
        torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-8, atol=1e-10)


def test_trace_elbo_training_on_cuda_reaches_the_posterior_and_predicts():
    """The default recipe (NGVI(), Trace_ELBO through SVI, random draws on the device) converges on
    CUDA to the mean-field optimum; Predictive samples on the device."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = data("cuda")
    guide = AutoNormal(regression)
    svi = SVI(regression, guide, NGVI(), pyro.infer.Trace_ELBO())
    for _ in range(1500):
        svi.step(x, y)
    mean, precision = exact(*data("cpu"))
    loc = pyro.param("AutoNormal.locs.w").detach()
    assert loc.device.type == "cuda"
    sd = precision.diagonal().rsqrt()  # the mean-field optimum: the exact mean, precision diag(A)
    assert ((loc.cpu() - mean).abs() < 0.1 * sd).all()
    torch.testing.assert_close(pyro.param("AutoNormal.scales.w").detach().cpu(), sd, rtol=0.1, atol=0)
    draws = Predictive(regression, guide=guide, num_samples=8, return_sites=["w"])(x, None)["w"]
    assert draws.device.type == "cuda" and draws.shape[0] == 8 and draws.shape[-1] == D


def seen_through_its_sum(obs):
    """A 4-vector seen only through its sum (posterior correlation 0.99)."""
    t = pyro.sample("t", dist.Normal(obs.new_zeros(D), 2.0).to_event(1))
    with pyro.plate("obs", len(obs)):
        pyro.sample("o", dist.Normal(t.sum(-1), 0.5), obs=obs)


def test_several_particles_draws_are_read_on_cuda_and_take_the_coupled_step():
    """Trace_ELBO(num_particles=8, vectorised) on CUDA: the guide's draws are read on the device
    (pyro_ngvi.draws) and the coupled mean step reaches the exact mean of a 0.99-correlated
    posterior within 0.25 mean-field sd (without the draws the element-wise steps stall 1-2 sd off)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    obs = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 0.5 + 3.0
    guide = AutoNormal(seen_through_its_sum)
    optim = NGVI(guide=guide)
    elbo = pyro.infer.Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(seen_through_its_sum, guide, optim, elbo)
    svi.step(obs.cuda())
    loc_param = pyro.param("AutoNormal.locs.t")
    elbo.loss_and_grads(seen_through_its_sum, guide, obs.cuda())
    assert list(optim._draws._recorders[guide].take([loc_param], 8)) == [id(loc_param)]
    for param in pyro.get_param_store().values():
        param.grad = None
    for _ in range(1200):
        svi.step(obs.cuda())
    precision = torch.eye(D) / 4 + torch.ones(D, D) * len(obs) / 0.25
    mean = torch.linalg.solve(precision, torch.ones(D) * obs.sum() / 0.25)
    loc = pyro.param("AutoNormal.locs.t").detach()
    assert loc.device.type == "cuda"
    assert float(((loc.cpu() - mean).abs() * precision.diagonal().sqrt()).max()) < 0.25


def test_laplace_and_metrics_on_cuda_are_the_cpu_ones():
    results = {}
    for device in ("cpu", "cuda"):
        pyro.clear_param_store()
        x, y = data(device)
        res = laplace(regression, x, y, curvature="ggn", covariance="full")
        probs = torch.softmax(torch.stack([x[:, 0], x[:, 1], -x[:, 0]], -1), -1)
        labels = (x[:, 0] > 0).long()
        results[device] = (res.log_evidence, next(iter(res.map.values())).cpu(), metrics.nll(probs, labels).cpu(),
                           metrics.expected_calibration_error(probs, labels).cpu())
    (ev_c, map_c, nll_c, ece_c), (ev_g, map_g, nll_g, ece_g) = results["cpu"], results["cuda"]
    assert abs(ev_c - ev_g) < 1e-8
    torch.testing.assert_close(map_g, map_c, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nll_g, nll_c, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ece_g, ece_c, rtol=1e-10, atol=1e-12)
    mean, _ = exact(*data("cpu"))
    torch.testing.assert_close(map_g, mean, rtol=0, atol=1e-6)
