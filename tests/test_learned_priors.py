"""Priors learned by the evidence: conjugate priors whose loc / scale are pyro.params,
set by NGVI in closed form (type-II maximum likelihood of the ELBO)."""

import math
import warnings

import numpy as np
import pytest
import scipy.optimize
import torch
from torch import nn
from torch.distributions import constraints

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, with_priors
from pyro_ngvi.family import pop_curvature

D, N, NOISE = 6, 40, 0.5


def regression_data(orthogonal=False):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    if orthogonal:  # orthogonal columns of different lengths: the posterior is diagonal
        x = torch.linalg.qr(x).Q * torch.linspace(4.0, 10.0, D, dtype=torch.float64)
    w = 0.7 * torch.randn(D, generator=generator, dtype=torch.float64)
    y = x @ w + NOISE * torch.randn(N, generator=generator, dtype=torch.float64)
    return x, y


def regression_model(x, y):
    s = pyro.param("prior_scale", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
    w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))
    with pyro.plate("data", N):
        pyro.sample("obs", dist.Normal(x @ w, NOISE), obs=y)


def regression_bnn():
    net = nn.Linear(D, 1, bias=False).double()
    return BayesianNet(net, "gaussian", N, prior=1.0, noise_scale=NOISE, learn_prior=True)


def mean_field_type2_optimum(x, y):
    """argmax over (mu, sigma, s) of the closed-form mean-field ELBO, by scipy (BFGS)."""
    x, y = x.numpy(), y.numpy()

    def negative_elbo(theta):
        mu, log_sigma, log_s = theta[:D], theta[D:2 * D], theta[-1]
        variance, prior_variance = np.exp(2 * log_sigma), np.exp(2 * log_s)
        expected_sse = np.sum((y - x @ mu) ** 2) + np.sum(variance * np.sum(x**2, 0))
        kl = np.sum((mu**2 + variance) / (2 * prior_variance) + log_s - log_sigma - 0.5)
        return expected_sse / (2 * NOISE**2) + kl

    result = scipy.optimize.minimize(negative_elbo, np.zeros(2 * D + 1), method="BFGS",
                                     options={"gtol": 1e-10})
    return math.exp(result.x[-1])


def marginal_likelihood_maximiser(x, y):
    """argmax_s log N(y; 0, s^2 X X^T + noise^2 I), by scipy (bounded scalar search)."""
    x, y = x.numpy(), y.numpy()

    def negative_log_evidence(log_s):
        covariance = np.exp(2 * log_s) * x @ x.T + NOISE**2 * np.eye(N)
        _, logdet = np.linalg.slogdet(covariance)
        return 0.5 * (logdet + y @ np.linalg.solve(covariance, y))

    result = scipy.optimize.minimize_scalar(negative_log_evidence, bounds=(-5, 3), method="bounded",
                                            options={"xatol": 1e-12})
    return math.exp(result.x)


def train(model, elbo, steps, *args, optim=None):
    guide = AutoNormal(model)
    svi = SVI(model, guide, optim or NGVI(lr=1.0, beta=1.0, momentum=0.0, damping=0.0), elbo)
    for _ in range(steps):
        svi.step(*args)
    return guide, svi


@pytest.mark.parametrize("path", ["traced", "bayesian_net"])
def test_prior_scale_reaches_the_mean_field_evidence_optimum_in_a_few_steps(path):
    x, y = regression_data()
    expected = mean_field_type2_optimum(x, y)
    if path == "traced":
        model, elbo, name = regression_model, CurvatureELBO("hessian", deterministic=True), "prior_scale"
    else:  # the fast path (BackPACK) with the exact GGN of a linear model
        model, elbo, name = regression_bnn(), CurvatureELBO("ggn", deterministic=True), "weight.prior_scale"
    guide, svi = train(model, elbo, 5, x, y)
    assert pyro.param(name).item() == pytest.approx(expected, rel=1e-2)
    for _ in range(10):
        svi.step(x, y)
    # the mean update is a Jacobi iteration on a correlated design: 15 steps to 1e-4
    assert pyro.param(name).item() == pytest.approx(expected, rel=1e-4)


def test_orthogonal_design_reaches_the_marginal_likelihood_maximiser():
    # with a diagonal posterior the mean-field ELBO at its optimum is the log evidence
    x, y = regression_data(orthogonal=True)
    expected = marginal_likelihood_maximiser(x, y)
    train(regression_model, CurvatureELBO("hessian", deterministic=True), 10, x, y)
    assert pyro.param("prior_scale").item() == pytest.approx(expected, rel=1e-6)


def test_sampled_curvature_learns_the_prior_in_closed_form_too():
    x, y = regression_data()
    expected = mean_field_type2_optimum(x, y)
    guide, svi = train(regression_model, CurvatureELBO("reparam", num_particles=4), 100, x, y,
                       optim=NGVI(lr=0.2, beta=0.2))
    values = []
    for _ in range(100):  # average out the Monte-Carlo noise of the guide
        svi.step(x, y)
        values.append(pyro.param("prior_scale").item())
    assert np.mean(values) == pytest.approx(expected, rel=0.01)


def test_with_trace_elbo_the_prior_param_is_a_point_estimate():
    # Trace_ELBO hands NGVI no model trace: the prior is inside g, h and the param
    # takes the point optimizer's (Adam's) steps, about lr per step
    x, y = regression_data()
    guide = AutoNormal(regression_model)
    svi = SVI(regression_model, guide, NGVI(point_optim_args={"lr": 1e-3}), Trace_ELBO())
    svi.step(x, y)
    assert abs(pyro.param("prior_scale").item() - 1.0) == pytest.approx(1e-3, rel=1e-3)


def test_local_latents_under_subsampling_learn_loc_and_scale_exactly():
    # z_i ~ N(m, s^2), y_i ~ N(z_i, 1): type-II ML is m = mean(y), s^2 = var(y) - 1,
    # and the mean-field posterior of each z_i is exact
    rows = 40
    generator = torch.Generator().manual_seed(0)
    y = 1.5 + 2.0 * torch.randn(rows, generator=generator, dtype=torch.float64)

    def model(y):
        m = pyro.param("m", torch.tensor(0.0, dtype=torch.float64))
        s = pyro.param("s", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
        with pyro.plate("rows", rows, subsample_size=10) as index:
            z = pyro.sample("z", dist.Normal(m, s))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y[index])

    train(model, CurvatureELBO("hessian", deterministic=True), 200, y)
    assert pyro.param("m").item() == pytest.approx(y.mean().item(), rel=1e-9)
    assert pyro.param("s").item() == pytest.approx((y.var(unbiased=False) - 1).sqrt().item(), rel=1e-9)


def test_broadcast_params_get_the_maximiser_over_the_elements_they_reach():
    # a per-row scale (R, 1) broadcast over the columns of W, and a LogNormal prior on a
    # positive site (Normal in u = log x) with learned loc and scale
    rows, cols = 3, 4
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(20, cols, generator=generator, dtype=torch.float64)
    y = torch.randn(20, rows, generator=generator, dtype=torch.float64)

    def model(x, y):
        row_scale = pyro.param("row_scale", torch.ones(rows, dtype=torch.float64),
                               constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, row_scale.unsqueeze(-1)).expand([rows, cols]).to_event(2))
        m = pyro.param("log_loc", torch.tensor(0.0, dtype=torch.float64))
        s = pyro.param("log_scale", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
        noise = pyro.sample("noise", dist.LogNormal(m, s).expand([rows]).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("obs", dist.Normal(x @ w.T, noise).to_event(1), obs=y)

    guide, _ = train(model, CurvatureELBO("hessian"), 1, x, y, optim=NGVI(lr=0.5, beta=0.5))
    store = pyro.get_param_store()
    mu_w, sigma_w = store["AutoNormal.locs.w"].detach(), store["AutoNormal.scales.w"].detach()
    expected_rows = (mu_w.square() + sigma_w.square()).mean(-1).sqrt()
    torch.testing.assert_close(pyro.param("row_scale").detach(), expected_rows, rtol=1e-12, atol=0)
    mu_u, sigma_u = store["AutoNormal.locs.noise"].detach(), store["AutoNormal.scales.noise"].detach()
    expected_loc = mu_u.mean()  # one prior scale for all: the precision-weighted mean is the mean
    expected_scale = ((mu_u - expected_loc).square() + sigma_u.square()).mean().sqrt()
    assert pyro.param("log_loc").item() == pytest.approx(expected_loc.item(), rel=1e-12)
    assert pyro.param("log_scale").item() == pytest.approx(expected_scale.item(), rel=1e-12)


def test_learned_prior_stays_conjugate_and_away_from_the_point_optimizer():
    x, y = regression_data()
    guide = AutoNormal(regression_model)
    optim = NGVI(lr=1.0, beta=1.0)
    svi = SVI(regression_model, guide, optim, CurvatureELBO("hessian", deterministic=True))
    svi.step(x, y)
    s = pyro.param("prior_scale").detach()
    # run the ELBO alone: the site's prior is handed over as conjugate, naming the param
    CurvatureELBO("hessian", deterministic=True).loss_and_grads(regression_model, guide, x, y)
    stats = pop_curvature(pyro.get_param_store()._params["AutoNormal.locs.w"])
    torch.testing.assert_close(stats.prior_precision, s.pow(-2).expand(D), rtol=1e-15, atol=0)
    assert stats.prior_scale_param.name == "prior_scale" and stats.prior_loc_param is None
    assert torch.equal(stats.prior_scale_param.index, torch.zeros(D, dtype=torch.long))
    assert not optim.optim_objs  # the point optimizer never made an optimizer for it


def test_a_prior_param_used_elsewhere_is_trained_by_its_gradient_with_a_warning():
    x, y = regression_data()

    def model(x, y):
        s = pyro.param("s", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("obs", dist.Normal(x @ w, s), obs=y)  # s is the noise scale too

    guide = AutoNormal(model)
    elbo = CurvatureELBO("hessian", deterministic=True)
    svi = SVI(model, guide, NGVI(lr=1.0, beta=1.0, point_optim_args={"lr": 1e-3}), elbo)
    with pytest.warns(UserWarning, match="'s' also enter"):
        svi.step(x, y)
    assert abs(pyro.param("s").item() - 1.0) == pytest.approx(1e-3, rel=1e-3)  # one Adam step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        svi.step(x, y)
        elbo.loss_and_grads(model, guide, x, y)
    stats = pop_curvature(pyro.get_param_store()._params["AutoNormal.locs.w"])
    assert stats.prior_precision is None and not stats.prior_params()


def test_a_function_of_a_param_is_an_ordinary_prior():
    x, y = regression_data()

    def model(x, y):
        precision = pyro.param("precision", torch.tensor(1.0, dtype=torch.float64),
                               constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, precision.rsqrt()).expand([D]).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("obs", dist.Normal(x @ w, NOISE), obs=y)

    guide = AutoNormal(model)
    guide(x, y)
    CurvatureELBO("hessian").loss_and_grads(model, guide, x, y)
    stats = pop_curvature(pyro.get_param_store()._params["AutoNormal.locs.w"])
    assert stats.prior_precision is None  # inside g, h; the param gets a gradient
    assert pyro.get_param_store()._params["precision"].grad is not None


def test_a_learned_value_is_clipped_into_the_param_constraint():
    x, y = regression_data()

    def model(x, y):
        s = pyro.param("s", torch.tensor(0.15, dtype=torch.float64), constraint=constraints.interval(0.1, 0.2))
        w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("obs", dist.Normal(x @ w, NOISE), obs=y)

    train(model, CurvatureELBO("hessian", deterministic=True), 3, x, y)
    value = pyro.param("s").item()  # the unconstrained optimum (~0.54) lies above the interval
    assert 0.2 - 1e-12 < value < 0.2


# --------------------------------------------------------------------------- BayesianNet


def small_classifier(learn_prior=True, prior=1.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    # no noise limit: a traced function (no BayesianNet) carries none, and the paths are compared
    return BayesianNet(net, "categorical", num_data=30, prior=prior, learn_prior=learn_prior, noise_limit=None)


def classification_data():
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(30, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (30,), generator=generator))


@pytest.mark.parametrize("source", ["ef", "ggn", "reparam"])
def test_bayesian_net_fast_and_traced_paths_learn_the_same_prior(source):
    x, y = classification_data()
    values = {}
    for path in ("fast", "traced"):
        pyro.clear_param_store()
        bnn = small_classifier()
        model = bnn if path == "fast" else (lambda x, y: bnn(x, y))  # no fast path offered
        guide = AutoNormal(model, init_loc_fn=bnn.init_loc_fn, init_scale=0.1)
        deterministic = source != "reparam"
        # the same update on both paths: a traced function carries no BayesianNet defaults
        # (minibatch statistics take no control variate)
        optim = NGVI(lr=0.5, beta=0.5, momentum=0.0, damping=0.0, control_variate=False)
        svi = SVI(model, guide, optim, CurvatureELBO(source, deterministic=deterministic))
        torch.manual_seed(3)
        for _ in range(3):
            svi.step(x, y)
        values[path] = {site: pyro.param(f"{site}.prior_scale").detach().clone() for site in bnn.latent_sites}
    assert values["fast"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for site, value in values["fast"].items():
        assert value.shape == ()  # one prior scale per weight tensor
        torch.testing.assert_close(value, values["traced"][site], rtol=1e-9, atol=0)
        assert value.item() != pytest.approx(1.0, abs=1e-3)  # it moved


def test_bayesian_net_learned_scale_is_the_maximiser_for_each_weight_tensor():
    x, y = classification_data()
    bnn = small_classifier(prior={"0.weight": torch.ones(5, 1), "0.bias": 1.0, "2.weight": 1.0, "2.bias": 1.0})
    guide, _ = train(bnn, CurvatureELBO("ggn"), 2, x, y, optim=NGVI(lr=0.3, beta=0.3))
    store = pyro.get_param_store()
    for site in bnn.latent_sites:
        mu, sigma = store[f"AutoNormal.locs.{site}"].detach(), store[f"AutoNormal.scales.{site}"].detach()
        second_moment = mu.square() + sigma.square()
        expected = second_moment.mean(-1, keepdim=True) if site == "0.weight" else second_moment.mean()
        torch.testing.assert_close(pyro.param(f"{site}.prior_scale").detach(), expected.sqrt(),
                                   rtol=1e-12, atol=0)
    assert pyro.param("0.weight.prior_scale").shape == (5, 1)  # one scale per row, as given
    _, scale = bnn.prior("0.weight")
    torch.testing.assert_close(scale, pyro.param("0.weight.prior_scale").detach())


def test_with_priors_of_a_learned_prior_net_fixes_the_priors():
    x, y = classification_data()
    bnn = small_classifier()
    train(bnn, CurvatureELBO("ggn"), 2, x, y, optim=NGVI(lr=0.3, beta=0.3))
    fixed = with_priors(bnn, {})
    assert isinstance(fixed, BayesianNet) and not fixed.learn_prior
    for site in bnn.latent_sites:
        torch.testing.assert_close(fixed.prior(site)[1], bnn.prior(site)[1], rtol=0, atol=0)


def test_learn_prior_must_be_a_bool():
    with pytest.raises(ValueError, match="learn_prior"):
        small_classifier(learn_prior="yes")


def test_bayesian_net_prior_learning_can_start_after_a_warm_up():
    x, y = classification_data()
    bnn = small_classifier(learn_prior=False)
    guide, svi = train(bnn, CurvatureELBO("ggn"), 2, x, y, optim=NGVI(lr=0.3, beta=0.3))
    assert not any(name.endswith("prior_scale") for name in pyro.get_param_store().keys())
    bnn.learn_prior = True
    svi.step(x, y)
    store = pyro.get_param_store()
    for site in bnn.latent_sites:  # created at the given scale, then set by the M-step
        mu, sigma = store[f"AutoNormal.locs.{site}"].detach(), store[f"AutoNormal.scales.{site}"].detach()
        expected = (mu.square() + sigma.square()).mean().sqrt()
        torch.testing.assert_close(pyro.param(f"{site}.prior_scale").detach(), expected, rtol=1e-12, atol=0)


def test_a_kronecker_guide_refuses_a_learned_prior():
    from pyro_ngvi import KroneckerNormal

    x, y = classification_data()
    bnn = small_classifier()
    guide = KroneckerNormal(bnn, init_scale=0.1)
    with pytest.raises(NotImplementedError, match="learn_prior"):
        CurvatureELBO("ggn").loss_and_grads(bnn, guide, x, y)


def test_a_net_converted_to_float64_mid_training_keeps_learning_its_prior():
    # bnn.double() after some steps: the guide's params and the learned prior scales stay
    # float32 in the param store; the value of the sampled step mixes the two (it raised a
    # bare dtype error in the norms' dot product)
    torch.manual_seed(0)
    x = torch.randn(64, 10)
    y = x[:, 0] - x[:, 1]
    bnn = BayesianNet(nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)), "gaussian", num_data=64,
                      learn_prior=True)
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ggn"))
    for _ in range(5):
        svi.step(x, y)
    bnn.double()
    before = pyro.param("0.weight.prior_scale").detach().clone()
    losses = [svi.step(x.double(), y.double()) for _ in range(5)]
    assert all(math.isfinite(loss) for loss in losses)
    assert not torch.equal(pyro.param("0.weight.prior_scale").detach(), before)  # still learned, in closed form
