"""NGVI on Pyro's own SVI with Trace_ELBO: the reparameterisation curvature path."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

from pyro_ngvi import NGVI, NGVIWarning
from pyro_ngvi.family import GaussianSite, NotGaussianWarning, SiteCurvature
from pyro_ngvi.groups import Group
from pyro_ngvi.steps import Context, mean_field_group


DATA = torch.tensor([0.3, 1.2, -0.5])


def normal_normal(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


def normal_normal_exact(data):
    """Posterior N(sum x / (n+1), 1/(n+1)) and log evidence of N(0, I + 11^T)."""
    n = len(data)
    cov = torch.eye(n, dtype=torch.float64) + 1.0
    evidence = dist.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov).log_prob(data.double())
    return float(data.sum()) / (n + 1), (n + 1) ** -0.5, float(evidence)


def decaying(start, floor, halflife):
    return lambda t: max(start / (1.0 + t / halflife), floor)


@pytest.mark.parametrize("elbo", [Trace_ELBO, JitTrace_ELBO])
@pytest.mark.parametrize("seed", range(10))
def test_normal_normal_exact_within_200_steps(elbo, seed):
    pyro.set_rng_seed(seed)
    guide = AutoNormal(normal_normal)
    loss_fn = elbo(num_particles=100, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(normal_normal, guide, NGVI(lr=decaying(0.5, 0.05, 20), beta=0.1), loss_fn)
    for _ in range(200):
        svi.step(DATA)
    mean, std, evidence = normal_normal_exact(DATA)
    assert abs(pyro.param("AutoNormal.locs.loc").item() - mean) < 0.05
    assert abs(pyro.param("AutoNormal.scales.loc").item() / std - 1) < 0.05
    # the ELBO of the fitted guide, estimated with many particles, is the evidence
    loss = Trace_ELBO(num_particles=2000, vectorize_particles=True, max_plate_nesting=1).loss(
        normal_normal, guide, DATA
    )
    assert abs(-loss - evidence) < 0.01


def test_auto_diagonal_normal_same_family():
    guide = AutoDiagonalNormal(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(lr=decaying(0.5, 0.05, 20), beta=0.1),
              Trace_ELBO(num_particles=100, vectorize_particles=True, max_plate_nesting=1))
    for _ in range(200):
        svi.step(DATA)
    mean, std, _ = normal_normal_exact(DATA)
    assert abs(pyro.param("AutoDiagonalNormal.loc").item() - mean) < 0.05
    assert abs(pyro.param("AutoDiagonalNormal.scale").item() / std - 1) < 0.05


def make_regression(n=200, d=5, noise=0.5, correlation=0.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    cov = (1 - correlation) * torch.eye(d, dtype=dtype) + correlation
    x = torch.randn(n, d, generator=g, dtype=dtype) @ torch.linalg.cholesky(cov).T
    w = torch.randn(d, generator=g, dtype=dtype)
    y = x @ w + noise * torch.randn(n, generator=g, dtype=dtype)
    return x, y


def regression_model(x, y, noise=0.5, prior_scale=1.0):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype), prior_scale).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal((x * w).sum(-1), noise), obs=y)


def regression_posterior(x, y, noise=0.5, prior_scale=1.0):
    precision = x.T @ x / noise**2 + torch.eye(x.shape[1], dtype=x.dtype) / prior_scale**2
    mean = torch.linalg.solve(precision, x.T @ y / noise**2)
    return mean, precision


def test_linear_regression_reaches_mean_field_optimum():
    """Mean-field optimum: the exact posterior mean and precision diag(A)."""
    x, y = make_regression(correlation=0.3)
    mean, precision = regression_posterior(x, y)
    pyro.set_rng_seed(1)
    guide = AutoNormal(regression_model)
    svi = SVI(regression_model, guide, NGVI(lr=decaying(0.5, 0.02, 50), beta=decaying(0.2, 0.01, 50)),
              Trace_ELBO(num_particles=32, vectorize_particles=True, max_plate_nesting=1))
    for _ in range(400):
        svi.step(x, y)
    loc = pyro.param("AutoNormal.locs.w").detach()
    lam = pyro.param("AutoNormal.scales.w").detach() ** -2
    std = precision.diagonal().rsqrt()
    assert ((loc - mean).abs() < 0.1 * std).all()
    assert torch.allclose(lam, precision.diagonal(), rtol=0.05)


@pytest.mark.parametrize("seed", range(10))
def test_default_init_scale_does_not_trap(seed):
    """init_scale=0.1 (precision 100) against a true precision ~ 7,000 converges on every seed."""
    x, y = make_regression(n=1000, noise=0.4, correlation=0.2, seed=3)
    mean, precision = regression_posterior(x, y, noise=0.4)
    assert precision.diagonal().min() > 5000
    pyro.set_rng_seed(seed)
    guide = AutoNormal(lambda x, y: regression_model(x, y, noise=0.4))
    svi = SVI(guide.model, guide, NGVI(lr=0.1, beta=0.05),
              Trace_ELBO(num_particles=128, vectorize_particles=True, max_plate_nesting=1))
    for _ in range(150):
        svi.step(x, y)
    loc = pyro.param("AutoNormal.locs.w").detach()
    lam = pyro.param("AutoNormal.scales.w").detach() ** -2
    std = precision.diagonal().rsqrt()
    assert ((loc - mean).abs() < 0.5 * std).all()
    assert torch.allclose(lam, precision.diagonal(), rtol=0.25)


def gamma_poisson(counts):
    rate = pyro.sample("rate", dist.Gamma(3.0, 2.0))
    with pyro.plate("data", len(counts)):
        pyro.sample("obs", dist.Poisson(rate), obs=counts)


def best_gaussian_on_log_scale(counts, a=3.0, b=2.0):
    """Maximise the ELBO over N(m, s^2) on u = log(rate) by Gauss-Hermite quadrature."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    weights = weights / weights.sum()
    k, n = float(sum(counts)), len(counts)

    def negative_elbo(params):
        m, log_s = params
        u = m + np.exp(log_s) * nodes
        # log Gamma(e^u; a, b) + log|d e^u / du| + sum_i log Poisson(x_i; e^u), constants dropped
        log_joint = a * u - b * np.exp(u) + k * u - n * np.exp(u)
        return -(weights @ log_joint + log_s)

    result = optimize.minimize(negative_elbo, x0=[0.0, -1.0], method="Nelder-Mead",
                               options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 10000})
    return result.x[0], math.exp(result.x[1])


def test_positive_latent_reaches_best_log_scale_gaussian():
    counts = torch.tensor([2.0, 0.0, 3.0, 1.0, 4.0, 2.0])
    m, s = best_gaussian_on_log_scale(counts.tolist())
    guide = AutoNormal(gamma_poisson)
    svi = SVI(gamma_poisson, guide, NGVI(lr=decaying(0.5, 0.01, 30), beta=decaying(0.2, 0.02, 30)),
              Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1))
    for _ in range(400):
        svi.step(counts)
    assert abs(pyro.param("AutoNormal.locs.rate").item() - m) < 0.1 * s
    assert abs(pyro.param("AutoNormal.scales.rate").item() / s - 1) < 0.05


def constrained_model():
    pyro.sample("p", dist.Beta(2.0, 3.0))
    pyro.sample("simplex", dist.Dirichlet(torch.tensor([1.0, 2.0, 3.0])))
    pyro.sample("scale", dist.HalfCauchy(1.0))


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_runs_on_bounded_simplex_and_positive_sites(guide_class):
    guide = guide_class(constrained_model)
    svi = SVI(constrained_model, guide, NGVI(lr=0.1, beta=0.05), Trace_ELBO(num_particles=16))
    losses = [svi.step() for _ in range(100)]
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-20:]) < np.mean(losses[:5])


def local_model(x, n, subsample_size=None):
    """Local latents z_i ~ N(0, 1), x_i ~ N(z_i, 0.5): posterior N(0.8 x_i, 0.2)."""
    with pyro.plate("rows", n, subsample_size=subsample_size) as idx:
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x[idx])


def test_subsampled_local_latents():
    n, batch = 12, 4
    x = torch.linspace(-2, 2, n)
    pyro.set_rng_seed(3)
    guide = AutoNormal(local_model)
    svi = SVI(local_model, guide, NGVI(lr=decaying(0.6, 0.05, 30), beta=0.2),
              Trace_ELBO(num_particles=64, vectorize_particles=True, max_plate_nesting=1))
    svi.step(x, n, batch)  # initialise
    for _ in range(10):
        before_loc = pyro.param("AutoNormal.locs.z").detach().clone()
        before_scale = pyro.param("AutoNormal.scales.z").detach().clone()
        svi.step(x, n, batch)
        changed = (pyro.param("AutoNormal.locs.z") != before_loc)
        # exactly the minibatch rows change, the others are bit-identical
        assert int(changed.sum()) == batch
        assert torch.equal(pyro.param("AutoNormal.scales.z")[~changed], before_scale[~changed])
    for _ in range(600):
        svi.step(x, n, batch)
    loc = pyro.param("AutoNormal.locs.z").detach()
    scale = pyro.param("AutoNormal.scales.z").detach()
    assert torch.allclose(loc, 0.8 * x, atol=0.05)
    assert torch.allclose(scale, torch.full((n,), 0.2**0.5), rtol=0.05)


def test_subsampled_rows_get_the_full_batch_update():
    """A minibatch row's update is the full-data VON update of that row (s = N/B divided out)."""
    n, batch = 6, 3
    x = torch.linspace(-1, 1, n)
    guide = AutoNormal(local_model)
    guide(x, n, batch)
    mu = pyro.param("AutoNormal.locs.z").detach().clone()
    lam = pyro.param("AutoNormal.scales.z").detach().clone() ** -2
    pyro.set_rng_seed(5)
    trace = pyro.poutine.trace(guide).get_trace(x, n, batch)
    idx = trace.nodes["rows"]["value"]
    u = trace.nodes["z_unconstrained"]["value"].detach()
    pyro.set_rng_seed(5)
    SVI(local_model, guide, NGVI(lr=0.3, beta=0.2, warm_start=False), Trace_ELBO()).step(x, n, batch)
    # by hand: gradient and Price curvature of the full-data negative log joint of row i
    eps = (u - mu[idx]) * lam[idx].sqrt()
    grad = u + (u - x[idx]) / 0.25
    curvature = grad * eps * lam[idx].sqrt()
    lam_new = 0.8 * lam[idx] + 0.2 * curvature
    lam_new = torch.where(curvature < 0, lam_new + 0.04 * (lam[idx] - curvature) ** 2 / (2 * lam[idx]), lam_new)
    new_loc = pyro.param("AutoNormal.locs.z").detach()
    new_lam = pyro.param("AutoNormal.scales.z").detach() ** -2
    assert torch.allclose(new_lam[idx], lam_new, rtol=1e-4)
    assert torch.allclose(new_loc[idx], mu[idx] - 0.3 * grad / lam_new, rtol=1e-4, atol=1e-6)
    others = torch.ones(n, dtype=torch.bool)
    others[idx] = False
    assert torch.equal(new_loc[others], mu[others])


def model_with_point_params(x, y):
    noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
    offset = pyro.param("offset", torch.tensor(0.0))
    w = pyro.sample("w", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x + offset, noise), obs=y)


def test_point_parameters_trained_in_the_same_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, generator=g)
    y = 2.0 * x + 1.5 + 0.3 * torch.randn(500, generator=g)
    guide = AutoNormal(model_with_point_params)
    svi = SVI(model_with_point_params, guide,
              NGVI(lr=0.3, beta=0.1, point_optim_args={"lr": 0.05}), Trace_ELBO(num_particles=8))
    for _ in range(600):
        svi.step(x, y)
    assert abs(pyro.param("offset").item() - 1.5) < 0.05
    assert abs(pyro.param("noise").item() - 0.3) < 0.03
    assert abs(pyro.param("AutoNormal.locs.w").item() - 2.0) < 0.05


def test_point_optim_args_per_param_as_pyro_optimizers_take_them():
    """Pyro's own idiom, Adam(per_param_args) with lr 0 to hold some params fixed (Pyro's
    TestFixedModelGuide): the point optimizer asks the callable per param name; the Gaussian
    site still takes NGVI's steps and reaches the same answer as with a dict."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, generator=g)
    y = 2.0 * x + 1.5 + 0.3 * torch.randn(200, generator=g)
    asked = []

    def per_param(name):
        asked.append(name)
        return {"lr": 0.0} if name == "offset" else {"lr": 0.05}

    locs = []
    for args in (per_param, {"lr": 0.05}):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        pyro.param("offset", torch.tensor(1.5))
        svi = SVI(model_with_point_params, AutoNormal(model_with_point_params),
                  NGVI(lr=0.3, beta=0.1, point_optim_args=args), Trace_ELBO(num_particles=8))
        for _ in range(300):
            svi.step(x, y)
        locs.append(pyro.param("AutoNormal.locs.w").item())
        if args is per_param:
            assert pyro.param("offset").item() == 1.5  # held fixed, bit for bit
            assert abs(pyro.param("noise").item() - 1.0) > 0.3  # trained
    assert sorted(set(asked)) == ["noise", "offset"]
    assert abs(locs[0] - locs[1]) < 0.02 and abs(locs[0] - 2.0) < 0.1


@pytest.mark.parametrize("per_param, message", [
    (lambda name: 0.01, r"point_optim_args\('(noise|offset)'\) must return a dict"),
    (lambda name: {"lr": math.inf}, r"point_optim_args\('(noise|offset)'\)\['lr'\] must be finite"),
    (lambda name: {"lrr": 0.01}, r"point_optim_args\('(noise|offset)'\) \{'lrr': 0.01\} are not arguments Adam"),
])
def test_point_optim_args_per_param_refused_before_any_write(per_param, message):
    x, y = torch.randn(20), torch.randn(20)
    guide = AutoNormal(model_with_point_params)
    guide(x, y)  # (its params made)
    before = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    svi = SVI(model_with_point_params, guide, NGVI(point_optim_args=per_param), Trace_ELBO())
    with pytest.raises(ValueError, match=message):
        svi.step(x, y)
    after = dict(pyro.get_param_store().items())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def train(svi, steps, *args):
    return [svi.step(*args) for _ in range(steps)]


def test_state_round_trip_resumes_same_trajectory(tmp_path):
    x, y = make_regression(n=50, dtype=torch.float32)

    def new_svi(guide):  # (guide=: the draws of its particles are read from the first step on)
        optim = NGVI(lr=0.2, beta=0.1, momentum=0.5, point_optim_args={"lr": 0.01}, guide=guide)
        return SVI(model_with_point_params, guide, optim, Trace_ELBO(num_particles=4)), optim

    x1 = x[:, 0]
    pyro.set_rng_seed(7)
    guide = AutoNormal(model_with_point_params)
    svi, optim = new_svi(guide)
    train(svi, 10, x1, y)
    pyro.get_param_store().save(tmp_path / "params.pt")
    optim.save(tmp_path / "optim.pt")
    rng = pyro.util.get_rng_state()
    uninterrupted = train(svi, 10, x1, y)
    expected = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "params.pt")
    guide = AutoNormal(model_with_point_params)
    guide(x1, y)  # set the guide up before restoring the RNG: its first run samples
    svi, optim = new_svi(guide)
    optim.load(tmp_path / "optim.pt")
    pyro.util.set_rng_state(rng)
    resumed = train(svi, 10, x1, y)
    assert np.allclose(resumed, uninterrupted, rtol=1e-6)
    for k, v in pyro.get_param_store().items():
        assert torch.allclose(v, expected[k], rtol=1e-6, atol=1e-7), k


def test_a_deep_copy_of_a_used_optimizer_continues_its_trajectory(tmp_path):
    """copy.deepcopy(NGVI) after ten steps (it raised before: views of the workspace) steps on
    as the original does: its settings, its sites' states (adaptive step sizes, averages) and
    its point optimizers carried over."""
    x, y = make_regression(n=50, dtype=torch.float32)
    x1 = x[:, 0]
    pyro.set_rng_seed(3)
    guide = AutoNormal(model_with_point_params)
    optim = NGVI(momentum=0.5, point_optim_args={"lr": 0.01})
    train(SVI(model_with_point_params, guide, optim, Trace_ELBO()), 10, x1, y)
    copied = copy.deepcopy(optim)
    assert (copied.momentum, copied.num_steps, copied.pt_optim_args) == (0.5, 10, {"lr": 0.01})
    pyro.get_param_store().save(tmp_path / "params.pt")
    rng = pyro.util.get_rng_state()
    original = train(SVI(model_with_point_params, guide, optim, Trace_ELBO()), 10, x1, y)
    expected = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.get_param_store().load(tmp_path / "params.pt")
    pyro.util.set_rng_state(rng)
    continued = train(SVI(model_with_point_params, guide, copied, Trace_ELBO()), 10, x1, y)
    assert np.allclose(continued, original, rtol=1e-6)
    for k, v in pyro.get_param_store().items():
        assert torch.allclose(v, expected[k], rtol=1e-6, atol=1e-7), k


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"beta": 0.0}, "beta"),
        ({"beta": 1.5}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"damping": -1.0}, "damping"),
        ({"tau": 0.0}, "tau"),
        ({"max_step": 0.0}, "max_step"),
        ({"lr": "fast"}, "lr"),
        ({"point_optim": "adam"}, "point_optim"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NGVI(**kwargs)


@pytest.mark.parametrize("name, value", [("lr", math.nan), ("lr", -1.0), ("lr", "0.1"), ("beta", 1.5),
                                         ("tau", None), ("momentum", 1.0), ("damping", -1.0), ("max_step", 0.0),
                                         ("sync_every", 0)])
def test_a_hyperparameter_set_between_steps_is_checked_and_the_guide_keeps_its_values(name, value):
    """``optim.lr = ...`` between steps (the hand-written ReduceLROnPlateau): a NaN lr was taken and
    written NaN into the guide's mean, a negative one walked it 110 sd off, silently."""
    guide = AutoNormal(normal_normal)
    optim = NGVI(lr=0.3, beta=0.1)
    svi = SVI(normal_normal, guide, optim, Trace_ELBO())
    for _ in range(5):
        svi.step(DATA)
    before = pyro.param("AutoNormal.locs.loc").detach().clone()
    with pytest.raises(ValueError, match=name):
        setattr(optim, name, value)
    svi.step(DATA)
    assert torch.isfinite(pyro.param("AutoNormal.locs.loc")).all() and optim.num_skipped_steps == 0
    assert abs(float(pyro.param("AutoNormal.locs.loc").detach() - before)) < 1.0
    optim.lr, optim.momentum = 0.05, 0.5  # (valid values are taken)
    assert (optim.lr, optim.momentum) == (0.05, 0.5)


def test_pyros_lr_schedulers_wrapping_ngvi_get_a_clear_error():
    scheduler = pyro.optim.ExponentialLR({"optimizer": NGVI, "optim_args": {}, "gamma": 0.9})
    with pytest.raises(ValueError, match="not a torch optimizer.*cannot wrap it.*optim.lr"):
        SVI(normal_normal, AutoNormal(normal_normal), scheduler, Trace_ELBO()).step(DATA)


def test_schedule_returning_invalid_value_raises():
    guide = AutoNormal(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(beta=lambda t: 2.0), Trace_ELBO())
    with pytest.raises(ValueError, match="beta"):
        svi.step(DATA)


@pytest.mark.parametrize("guide_class", [AutoDelta, AutoLowRankMultivariateNormal])
def test_guide_without_gaussian_sites_is_trained_by_the_point_optimizer_with_a_warning(guide_class):
    guide = guide_class(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="point optimizer"):
        svi.step(DATA)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi.step(DATA)
    assert any(not torch.equal(before[k], v.detach()) for k, v in pyro.get_param_store().items())


def test_hand_written_delta_guide_is_trained_by_the_point_optimizer_with_a_warning():
    def guide(data):
        m = pyro.param("m", torch.tensor(0.0))
        pyro.sample("loc", dist.Delta(m))

    svi = SVI(normal_normal, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="'loc' \\(it is a Delta"):
        svi.step(DATA)
    assert pyro.param("m").item() != 0.0


def two_site_model(data):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(a + torch.sqrt(b), 1.0), obs=data)


def test_non_finite_gradient_skips_whole_step_and_names_site():
    guide = AutoNormal(two_site_model)
    optim = NGVI(lr=0.1, beta=0.1)
    svi = SVI(two_site_model, guide, optim, Trace_ELBO())
    pyro.param("AutoNormal.locs.b", torch.tensor(-5.0))  # sqrt of a negative: NaN for b only
    guide(DATA)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.warns(NGVIWarning, match="'b'") as record, pyro.validation_enabled(False):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Encountered NaN")
            svi.step(DATA)
    assert len([w for w in record if issubclass(w.category, NGVIWarning)]) == 1
    assert optim.num_skipped_steps == 1 and optim.num_steps == 0
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v, before[k]), k  # site 'a' saw finite values and is untouched too


def test_no_warnings_in_normal_use():
    guide = AutoNormal(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(momentum=0.5, damping=1.0), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(svi, 20, DATA)


def test_tau_callable_and_lr_callable_receive_the_step_count():
    seen = []
    guide = AutoNormal(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(lr=lambda t: seen.append(t) or 0.1, tau=lambda t: 1.0),
              Trace_ELBO())
    train(svi, 3, DATA)
    assert seen == [0, 1, 2]


def test_tau_tempers_the_posterior():
    """With tau, the reparam path targets q proportional to p(x, z)^(1/tau)."""
    tau = 4.0
    guide = AutoNormal(normal_normal)
    svi = SVI(normal_normal, guide, NGVI(lr=decaying(0.5, 0.05, 20), beta=0.1, tau=tau),
              Trace_ELBO(num_particles=100, vectorize_particles=True, max_plate_nesting=1))
    train(svi, 200, DATA)
    mean, std, _ = normal_normal_exact(DATA)
    assert abs(pyro.param("AutoNormal.locs.loc").item() - mean) < 0.05
    assert abs(pyro.param("AutoNormal.scales.loc").item() / (std * tau**0.5) - 1) < 0.05


@settings(max_examples=200, deadline=None)
@given(
    beta=st.floats(min_value=1e-6, max_value=1.0),
    precision=st.floats(min_value=1e-6, max_value=1e6),
    curvature=st.floats(min_value=-1e6, max_value=1e6),
    first=st.booleans(),
)
def test_precision_stays_positive_and_finite(beta, precision, curvature, first):
    pyro.clear_param_store()
    loc = pyro.param("g.locs.x", torch.zeros(1, dtype=torch.float64))
    pyro.param("g.scales.x", torch.full((1,), precision ** -0.5, dtype=torch.float64),
               constraint=dist.constraints.softplus_positive)
    store = pyro.get_param_store()
    site = GaussianSite("x", store._params["g.locs.x"], store._params["g.scales.x"], "g.scales.x")
    optim = NGVI(lr=1.0, beta=beta, warm_start=first)
    stats = SiteCurvature(torch.ones(1, dtype=torch.float64), torch.full((1,), curvature, dtype=torch.float64))
    context = Context(optim._options, 0, {}, optim._spread_watch, None)
    mean_field_group(context, Group.of([site]), [stats], stats.grad, stats.curvature,
                     optim._settings(stats, 1.0, beta), 1.0, [optim._state(site)])
    new = site.precision
    assert torch.isfinite(new).all() and (new > 0).all()
    assert torch.isfinite(loc).all()


@pytest.mark.parametrize("flat_max", [1 << 16, 7, 4])
def test_sites_updated_together_follow_the_update_equations_elementwise(monkeypatch, flat_max):
    """
    Sites of different shapes, with and without a conjugate prior, sampled or
    not, one with a row mask, momentum on: two NGVI steps equal the update of the
    class docstring written out element by element for each site on its own,
    whether the sites are concatenated into one update or (small ``FLAT_MAX``)
    split into several groups or updated alone.
    """
    import pyro_ngvi.groups
    from pyro_ngvi.family import attach_curvature

    monkeypatch.setattr(pyro_ngvi.groups, "FLAT_MAX", flat_max)

    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (3, 2), "b": (4,), "c": (2, 2), "d": (5,), "e": (3,)}
    config = {  # name: (has prior, sampled, masked)
        "a": (True, False, False), "b": (True, False, False),
        "c": (False, True, False), "d": (True, False, True), "e": (True, False, False),
    }

    def model():
        for name, shape in shapes.items():
            pyro.sample(name, dist.Normal(torch.zeros(shape), 1.0).to_event(len(shape)))

    guide = AutoNormal(model)
    guide()
    store = pyro.get_param_store()
    for name, shape in shapes.items():
        store[f"AutoNormal.locs.{name}"] = torch.randn(shape, generator=g)
        store[f"AutoNormal.scales.{name}"] = torch.rand(shape, generator=g) + 0.2
    params = [store._params[n] for n in store.keys()]
    lr, beta, rho, damping, max_step = 0.7, 0.3, 0.8, 0.1, 0.5
    # averaging=False: constant steps (the adaptive ones are checked in test_defaults.py)
    optim = NGVI(lr=lr, beta=beta, momentum=rho, damping=damping, max_step=max_step, averaging=False, guide=guide)
    reference = {n: (store[f"AutoNormal.locs.{n}"].detach().clone(), store[f"AutoNormal.scales.{n}"].detach().pow(-2))
                 for n in shapes}
    buffers, started = {}, set()
    for _ in range(2):
        for name, shape in shapes.items():
            prior, sampled, masked = config[name]
            grad = torch.randn(shape, generator=g) * 3
            curvature = torch.randn(shape, generator=g) * 4 + 1  # some negative
            mask = torch.tensor([True, False, True, True, False]) if masked else None
            m0, lam0 = (torch.randn(shape, generator=g), torch.rand(shape, generator=g) + 0.5) if prior else (None, None)
            attach_curvature(store._params[f"AutoNormal.locs.{name}"],
                             SiteCurvature(grad, curvature, m0, lam0, mask=mask, sampled=sampled))
            # the reference, element by element
            mu, lam = reference[name]
            target = curvature + (lam0 if prior else 0)
            b = torch.where(target > lam, 1.0, beta) if name not in started else torch.full_like(lam, beta)
            target = torch.maximum(target, (1 - 1 / b) * lam)  # (where Lin's correction stops being monotone)
            lam_new = (1 - b) * lam + b * target
            lam_new = torch.where(target <= 0, lam_new + b**2 * (lam - target) ** 2 / (2 * lam), lam_new)
            gbar = grad if name not in buffers else rho * buffers[name] + (1 - rho) * grad
            if mask is not None and name in buffers:
                gbar = torch.where(mask, gbar, buffers[name])
            if sampled:  # the trust region: the precision moves by at most a factor 4
                lam_new = torch.minimum(torch.maximum(lam_new, lam / 4), 4 * lam)
            step = lr * gbar / (lam_new + damping)
            if sampled:
                step = step.clamp(-max_step * lam.rsqrt(), max_step * lam.rsqrt())
            if prior:
                step = step + lr * lam0 * (mu - m0) / (lam_new + damping)
            mu_new = mu - step
            if mask is not None:
                mu_new, lam_new = torch.where(mask, mu_new, mu), torch.where(mask, lam_new, lam)
            reference[name] = (mu_new, lam_new)
            buffers[name] = gbar
            started.add(name)
        optim(params)
        for name in shapes:
            mu, lam = reference[name]
            assert torch.allclose(store[f"AutoNormal.locs.{name}"].detach(), mu, rtol=1e-10, atol=1e-12), name
            assert torch.allclose(store[f"AutoNormal.scales.{name}"].detach().pow(-2), lam, rtol=1e-8), name


def test_momentum_state_is_shaped_like_each_site():
    def model():
        pyro.sample("a", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    optim = NGVI(momentum=0.9)
    svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
    for _ in range(3):
        svi.step()
    shapes = {k: tuple(v["momentum"].shape) for k, v in optim.get_state()["ngvi"]["sites"].items()}
    assert shapes == {"AutoNormal.locs.a": (3, 2), "AutoNormal.locs.b": ()}


def _wide_model(data):
    shift = pyro.sample("shift", dist.Normal(0.0, 1.0))
    z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([len(data)]).to_event(1))
    pyro.sample("obs", dist.Normal(z + shift, 1.0).to_event(1), obs=data)


@pytest.mark.parametrize("size", [10, 5000])  # 5000: past statistics.RECOVER_IN_PASS, recovered in the pass
def test_own_loop_leaves_the_gradients_as_the_elbo_made_them(size):
    # Under SVI.step NGVI may turn a site's gradients into its statistics in place (SVI zeroes
    # them next); called from a loop of one's own it works on copies: the .grad untouched.
    data = torch.linspace(-2.0, 2.0, size)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(_wide_model)
    optim = NGVI(guide=guide)
    for _ in range(3):
        with pyro.poutine.trace(param_only=True) as capture:
            Trace_ELBO().loss_and_grads(_wide_model, guide, data)
        params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
        grads = {p: p.grad.clone() for p in params}
        optim(params)
        for p in params:
            assert torch.equal(p.grad, grads[p])
            p.grad = None
    assert optim.num_steps == 3
    loc = pyro.param("AutoNormal.locs.z").detach()
    assert float((loc * data).sum()) > 0  # the means moved towards the data
