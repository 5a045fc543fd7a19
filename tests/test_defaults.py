"""
``NGVI()`` with no arguments on the kinds of models Pyro's own autoguide tests train
(issue 12, section 3), with the tolerances those tests use and at most their step
counts; the control variate, the adaptive steps and the Newton-step safeguard
(sections 3 and 4). The models are our own ports of the kinds of tests in Pyro 1.9's
``tests/infer/test_autoguide.py``, ``tests/infer/autoguide/test_inference.py`` and
``tests/infer/test_predictive.py``.
"""

import math
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO, NGVIWarning, NotGaussianWarning
import pyro_ngvi.point as point
from pyro_ngvi.family import pop_curvature


def train(model, guide, optim, loss, steps, *args):
    svi = SVI(model, guide, optim, loss)
    for _ in range(steps):
        svi.step(*args)
    return svi


def normal_kl(m, s, m0, s0):
    return float((torch.log(s0 / s) + (s**2 + (m - m0) ** 2) / (2 * s0**2) - 0.5).sum())


# ----------------------------------------------------------------- Pyro's test_exact kinds
def exact_model(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


@pytest.mark.parametrize("seed", range(3))
def test_exact_normal_normal_posterior_and_elbo(seed):
    """Pyro's test_exact: 500 steps of ClippedAdam(lr 0.05, decayed 10x), 100 particles;
    mean atol 0.05, std rtol 0.05, ELBO atol 0.01. NGVI() gets 60 steps."""
    data = torch.randn(3, generator=torch.Generator().manual_seed(seed))
    pyro.set_rng_seed(seed)
    guide = AutoNormal(exact_model)
    elbo = Trace_ELBO(num_particles=100, vectorize_particles=True)
    train(exact_model, guide, NGVI(), elbo, 60, data)
    mean, std = data.sum() / 4, torch.tensor(0.5)
    evidence = dist.MultivariateNormal(torch.zeros(3), torch.eye(3) + 1.0).log_prob(data)
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("loc"))
    assert abs(loc - mean) < 0.05
    assert abs(scale / std - 1) < 0.05
    assert abs(elbo.loss(exact_model, guide, data) + float(evidence)) < 0.01
    assert normal_kl(loc, scale, mean, std) < 0.01  # the same, without Monte-Carlo noise


def exact_batch_model(data):
    with pyro.plate("data", len(data)):
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)


@pytest.mark.parametrize("seed", range(3))
def test_exact_batch_local_latents(seed):
    """Pyro's test_exact_batch: three independent Normal-Normal rows, 500 steps there."""
    data = torch.randn(3, generator=torch.Generator().manual_seed(seed))
    pyro.set_rng_seed(seed)
    guide = AutoNormal(exact_batch_model)
    elbo = Trace_ELBO(num_particles=100, vectorize_particles=True)
    train(exact_batch_model, guide, NGVI(), elbo, 60, data)
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("loc"))
    std = torch.full((3,), 0.5**0.5)
    assert (loc - data / 2).abs().max() < 0.05
    assert (scale / std - 1).abs().max() < 0.05
    assert normal_kl(loc, scale, data / 2, std) < 0.01


def tree_model(data):
    x = pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        y = pyro.sample("y", dist.Normal(x, 1.0))
        pyro.sample("obs", dist.Normal(y, 1.0), obs=data)


@pytest.mark.parametrize("seed", range(3))
def test_exact_tree_means(seed):
    """Pyro's test_exact_tree checks a mean-field guide's means (atol 0.05): coupled sites."""
    data = 2.0 * torch.randn(2, generator=torch.Generator().manual_seed(seed))
    precision = torch.tensor([[3.0, -1.0, -1.0], [-1.0, 2.0, 0.0], [-1.0, 0.0, 2.0]])
    mean = torch.linalg.solve(precision, torch.cat([torch.zeros(1), data]))
    pyro.set_rng_seed(seed)
    guide = AutoNormal(tree_model)
    train(tree_model, guide, NGVI(), Trace_ELBO(num_particles=100, vectorize_particles=True), 60, data)
    locs = torch.cat([guide._get_loc_and_scale(s)[0].detach().reshape(-1) for s in ("x", "y")])
    assert (locs - mean).abs().max() < 0.05


# ----------------------------------------------------------------- one particle (Pyro's default)
def diagonal_gaussians():
    pyro.sample("x", dist.Normal(-0.2, 1.2))
    pyro.sample("y", dist.Normal(0.2, 0.7))


def log_normal():
    pyro.sample("x", dist.LogNormal(0.2, 0.7))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("model, loc, scale, tol", [
    (diagonal_gaussians, [-0.2, 0.2], [1.2, 0.7], (0.05, 0.08)),  # test_auto_diagonal_gaussians
    (log_normal, [0.2], [0.7], (0.04, 0.04)),  # test_auto_transform: a Gaussian through exp
])
def test_one_particle_diagonal_normal(seed, model, loc, scale, tol):
    """Pyro trains these with one-particle Trace_ELBO for 3500 steps; NGVI() gets 150."""
    pyro.set_rng_seed(seed)
    guide = AutoDiagonalNormal(model)
    train(model, guide, NGVI(), Trace_ELBO(), 150)
    fitted_loc, fitted_scale = (t.detach() for t in guide._loc_scale())
    assert (fitted_loc - torch.tensor(loc)).abs().max() < tol[0]
    assert (fitted_scale - torch.tensor(scale)).abs().max() < tol[1]


@pytest.mark.parametrize("seed", range(3))
def test_conditioned_model_far_from_the_guides_start(seed):
    """A ``poutine.condition``-ed model whose posterior (mean ~5, std ~1) is far from
    AutoNormal's start (0, 0.1): 100 steps, one particle, within 10 %."""
    def generative():
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        return pyro.sample("obs", dist.Normal(loc, 1.0))

    obs = 5.0 + torch.randn((), generator=torch.Generator().manual_seed(seed))
    model = poutine.condition(generative, data={"obs": obs})
    pyro.set_rng_seed(seed)
    guide = AutoNormal(model)
    train(model, guide, NGVI(), Trace_ELBO(), 100)
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("loc"))
    assert abs(loc / (obs / 1.01) - 1) < 0.1
    assert abs(scale / 1.01**-0.5 - 1) < 0.1


def binomial_model(num_trials):
    with pyro.plate("data", num_trials.size(0)):
        phi = pyro.sample("phi", dist.Uniform(0.0, 1.0))
        return pyro.sample("obs", dist.Binomial(num_trials, phi))


@pytest.mark.parametrize("seed", range(3))
def test_posterior_predictive_of_a_conditioned_model(seed):
    """Pyro's test_posterior_predictive_svi_auto_diag_normal_guide: 1000 steps of Adam,
    predictive counts within 5 %; here of the exact posterior predictive, after 50 steps."""
    num_trials = torch.full((5,), 1000.0)
    successes = torch.binomial(num_trials, torch.full((5,), 0.7), generator=torch.Generator().manual_seed(seed))
    conditioned = poutine.condition(binomial_model, data={"obs": successes})
    pyro.set_rng_seed(seed)
    guide = AutoDiagonalNormal(conditioned)
    train(conditioned, guide, NGVI(), Trace_ELBO(), 50, num_trials)
    predicted = Predictive(binomial_model, guide=guide, num_samples=10000, parallel=True)(num_trials)["obs"]
    exact = num_trials * (successes + 1) / (num_trials + 2)
    assert ((predicted.mean(0) - exact).abs() < 0.05 * exact).all()


# ----------------------------------------------------------------- the mechanisms
def test_one_draw_control_variate_is_exact_on_a_gaussian_posterior():
    """With one particle the draw is recovered (eps = sigma h / g) and the control
    variate leaves no Monte-Carlo noise where the log joint is quadratic: the guide
    lands on the exact posterior, where a constant-step Price estimate keeps a noise
    floor of its own size."""
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.3, 1.2, -0.5])
    guide = AutoNormal(exact_model)
    train(exact_model, guide, NGVI(), Trace_ELBO(), 200, data)
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("loc"))
    assert float(loc) == pytest.approx(float(data.sum() / 4), abs=1e-6)
    assert float(scale) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("loss", [TraceGraph_ELBO, lambda: TraceEnum_ELBO(strict_enumeration_warning=False),
                                  TraceMeanField_ELBO], ids=["TraceGraph_ELBO", "TraceEnum_ELBO", "TraceMeanField_ELBO"])
def test_one_draw_elbos_beyond_trace_elbo_land_on_the_exact_posterior(loss):
    """TraceGraph_ELBO, TraceEnum_ELBO and (on an autoguide, whose Gaussian it draws:
    pyro_ngvi.mean_field_kl) TraceMeanField_ELBO at one particle take one draw per step as
    Trace_ELBO does: the draw is recovered and the guide lands on the exact posterior (the
    test above; TraceMeanField_ELBO was 1e-4 off); without the control variate the noise floor
    of the Price estimate stays, 100 times larger."""
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.3, 1.2, -0.5])
    errors = {}
    for control_variate in (True, False):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(exact_model)
        train(exact_model, guide, NGVI(control_variate=control_variate), loss(), 200, data)
        loc, scale = (t.detach() for t in guide._get_loc_and_scale("loc"))
        errors[control_variate] = max(abs(float(loc) - float(data.sum() / 4)), abs(float(scale) - 0.5))
    assert errors[True] < 1e-6
    assert errors[False] > 1e-4


def test_score_function_terms_of_other_guide_sites_leave_the_draw_recoverable():
    """Under TraceGraph_ELBO a guide's non-reparameterised site (a Bernoulli, trained by the
    point optimizer with its score-function gradient) adds terms the Gaussian site's
    gradients do not see: its draw is still recovered, and it lands on its exact posterior."""
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.3, 1.2, -0.5])

    def model(data):
        exact_model(data)
        z = pyro.sample("z", dist.Bernoulli(0.3))
        pyro.sample("flag", dist.Normal(2.0 * z, 1.0), obs=torch.tensor(1.5))

    def guide(data):
        loc = pyro.param("loc_loc", torch.tensor(0.0))
        scale = pyro.param("loc_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
        pyro.sample("loc", dist.Normal(loc, scale))
        pyro.sample("z", dist.Bernoulli(pyro.param("z_p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)))

    pyro.set_rng_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGaussianWarning)
        train(model, guide, NGVI(), TraceGraph_ELBO(), 200, data)
    assert pyro.param("loc_loc").item() == pytest.approx(float(data.sum() / 4), abs=1e-6)
    assert pyro.param("loc_scale").item() == pytest.approx(0.5, rel=1e-6)


def test_antithetic_pairs_give_the_gradient_at_the_mean_of_a_quadratic():
    """CurvatureELBO("reparam", antithetic=True): for a quadratic log likelihood the
    pair's mean gradient is the gradient at the mean, exactly, and the draws it hands
    NGVI have mean 0."""
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.3, 1.2, -0.5])

    def likelihood_only(data):  # a flat prior: the whole log joint is the likelihood
        loc = pyro.sample("loc", dist.Normal(0.0, 1e6))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)

    guide = AutoNormal(likelihood_only, init_loc_fn=lambda site: torch.tensor(2.0))
    elbo = CurvatureELBO("reparam", num_particles=3, antithetic=True)
    guide(data)
    elbo.loss_and_grads(likelihood_only, guide, data)
    stats = pop_curvature(pyro.param("AutoNormal.locs.loc"))
    assert float(stats.grad) == pytest.approx(float((2.0 - data).sum()), rel=1e-12)
    assert float(stats.eps_mean) == pytest.approx(0.0, abs=1e-12)
    assert float(stats.eps_sq_mean) > 0


def test_averaging_removes_the_noise_floor_of_many_particles():
    """Sixteen particles without their draws (no control variate): the adaptive steps average
    the noisy targets once progress stalls, so the error keeps shrinking where constant steps
    (NGVI's former defaults) keep a floor."""
    data = torch.tensor([0.3, 1.2, -0.5])
    mean, std = float(data.sum() / 4), 0.5
    errors = {}
    for label, optim in (("adaptive", lambda: NGVI(control_variate=False)),
                         ("constant", lambda: NGVI(lr=0.1, beta=0.05, averaging=False, control_variate=False))):
        total = 0.0
        for seed in range(4):
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            guide = AutoNormal(exact_model)
            train(exact_model, guide, optim(), Trace_ELBO(num_particles=16, vectorize_particles=True), 400, data)
            loc, scale = (float(t.detach()) for t in guide._get_loc_and_scale("loc"))
            total += abs(loc - mean) / std + abs(scale / std - 1)
        errors[label] = total / 4
    assert errors["adaptive"] < 0.02
    assert errors["adaptive"] < errors["constant"] / 2


def test_state_memory_is_at_most_four_latent_size_vectors():
    """The mean-field update's adaptive steps keep four latent-size vectors per site: the count,
    the running means of the two innovations (the first doubles as the momentum buffer) and the
    curvature clipped off the targets, carried over (besides the site's exact sigma, which the
    guide's raw scale holds to an ulp or two). DESIGN asks for three: the fourth is what keeps a
    heavy-tailed curvature's average unbiased
    (``test_defaults_hold_the_mean_field_optimum_of_non_centred_eight_schools``)."""
    for momentum in (0.0, 0.9):
        pyro.clear_param_store()
        guide = AutoNormal(exact_batch_model)
        optim = NGVI(momentum=momentum)
        train(exact_batch_model, guide, optim, Trace_ELBO(), 5, torch.ones(7))
        (site,) = optim.get_state()["ngvi"]["sites"].values()
        vectors = [v for k, v in site.items() if torch.is_tensor(v) and v.numel() == 7 and k != "scale"]
        assert len(vectors) == 4 and site["scale"].numel() == 7


def test_a_schedule_the_user_writes_runs_as_written():
    """Callables for lr and beta override the adaptive steps: the update is the plain
    one with exactly the scheduled values (no per-element counts are kept)."""
    seen = []
    guide = AutoNormal(exact_model)
    optim = NGVI(lr=lambda t: seen.append(t) or 0.2, beta=lambda t: 0.1)
    train(exact_model, guide, optim, Trace_ELBO(), 3, torch.ones(3))
    assert seen == [0, 1, 2]
    (site,) = optim.get_state()["ngvi"]["sites"].values()
    assert site["count"] is None


# ----------------------------------------------------------------- section 4
def gmm_data():
    g = torch.Generator().manual_seed(0)
    return torch.cat([0.5 * torch.randn(30, generator=g) - 2.0, 0.5 * torch.randn(30, generator=g) + 3.0])


@config_enumerate
def gmm(data):
    locs = pyro.sample("locs", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with pyro.plate("data", len(data)):
        z = pyro.sample("z", dist.Categorical(torch.tensor([0.5, 0.5])))
        pyro.sample("obs", dist.Normal(locs[z], 0.5), obs=data)


def test_curvature_elbo_refuses_an_enumerated_site_and_names_the_way_that_works():
    data = gmm_data()
    guide = AutoNormal(poutine.block(gmm, hide=["z"]), init_loc_fn=lambda site: torch.tensor([-1.0, 1.0]))
    with pytest.raises(NotImplementedError, match="'z'.*TraceEnum_ELBO"):
        SVI(gmm, guide, NGVI(), CurvatureELBO("hessian")).step(data)
    assert pop_curvature(pyro.param("AutoNormal.locs.locs")) is None  # nothing handed over
    # the way the error names: NGVI with TraceEnum_ELBO sums z out
    train(gmm, guide, NGVI(), TraceEnum_ELBO(max_plate_nesting=1), 150, data)
    assert torch.allclose(guide.locs.locs.detach(), torch.tensor([-2.0, 3.0]), atol=0.25)


def test_curvature_elbo_refuses_any_other_unguided_latent():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    guide = AutoNormal(poutine.block(model, hide=["b"]))
    with pytest.raises(NotImplementedError, match="'b' has none"):
        SVI(model, guide, NGVI(), CurvatureELBO("hessian")).step()


def diabetes():
    from sklearn.datasets import load_diabetes

    x, y = (torch.tensor(a) for a in load_diabetes(return_X_y=True))
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def diabetes_regression(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w, 0.7), obs=y)


def test_newton_safeguard_on_the_diabetes_regression():
    """Recipe (b), NGVI(lr=1, beta=1) + exact curvature at the mean, is a diagonal
    Newton (Jacobi) iteration, stable only for lr < 2 / lambda_max(D^-1 H) = 0.497 here:
    without the safeguard it diverges to inf; with it, steps that raise F are undone
    (with a warning), the step is damped, and it converges to the posterior mean."""
    torch.set_default_dtype(torch.float64)
    x, y = diabetes()
    precision = x.T @ x / 0.49 + torch.eye(10)
    mean = torch.linalg.solve(precision, x.T @ y / 0.49)
    d = precision.diagonal()
    assert 2 / torch.linalg.eigvalsh(precision / d.sqrt().outer(d.sqrt())).max() < 0.5

    guide = AutoNormal(diabetes_regression)
    unguarded = NGVI(lr=1.0, beta=1.0, safeguard=False)
    with pytest.warns(NGVIWarning, match="grow without bound"):  # the watch on diverging means
        train(diabetes_regression, guide, unguarded, CurvatureELBO("hessian", deterministic=True), 40, x, y)
    assert (guide.locs.w.detach() - mean).abs().max() > 1e6  # diverging (inf after ~200 steps)

    pyro.clear_param_store()
    guide = AutoNormal(diabetes_regression)
    optim = NGVI(lr=1.0, beta=1.0)
    with pytest.warns(NGVIWarning, match="undid step"):
        train(diabetes_regression, guide, optim, CurvatureELBO("hessian", deterministic=True), 400, x, y)
    assert optim.num_rejected_steps > 0
    assert (guide.locs.w.detach() - mean).abs().max() < 0.05
    assert torch.allclose(guide._get_loc_and_scale("w")[1].detach(), d.rsqrt(), rtol=1e-6)


def eight_schools(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", 8):
        theta = pyro.sample("theta", dist.Normal(mu, tau))  # centred
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def test_newton_safeguard_on_centred_eight_schools():
    """One undamped Newton step sends log tau to about -48 (the curvature there is
    nearly flat), where F is ~1e40: the safeguard undoes it, warns, and from then on
    every step it keeps lowers F; the guide stays finite."""
    torch.set_default_dtype(torch.float64)
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    guide = AutoNormal(eight_schools)
    optim = NGVI(lr=1.0, beta=1.0)
    svi = SVI(eight_schools, guide, optim, CurvatureELBO("hessian", deterministic=True))
    svi.step(y, sigma)
    assert guide.locs.tau.item() < -40  # the step the issue describes
    with pytest.warns(NGVIWarning, match="undid step 1"):
        svi.step(y, sigma)
    assert guide.locs.tau.item() == 0.0  # back at the start
    merits = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NGVIWarning)
        for _ in range(10):
            rejected = optim.num_rejected_steps
            svi.step(y, sigma)
            if optim.num_rejected_steps == rejected:
                merits.append(next(iter(optim._plans.values())).newton.reference)
    assert all(torch.isfinite(p).all() for p in pyro.get_param_store().values())
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(merits, merits[1:]))
    assert guide.locs.tau.item() > -20


def test_point_optimizer_default_fits_a_noise_scale():
    """The point optimizer's default lr (0.01): a noise scale and an offset (pyro.param)
    reach their maximum-likelihood values in 400 steps (Adam at the former 1e-3 needs
    ~1500 steps to move the offset that far)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, generator=g)
    y = 1.5 + 2.0 * x + 0.3 * torch.randn(300, generator=g)

    def model(x, y):
        offset = pyro.param("offset", torch.tensor(0.0))
        noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(offset + w * x, noise), obs=y)

    design = torch.stack([torch.ones_like(x), x], 1)
    coef = torch.linalg.lstsq(design, y[:, None]).solution.squeeze()
    residual = (y - design @ coef).square().mean().sqrt()
    train(model, AutoNormal(model), NGVI(), Trace_ELBO(), 400, x, y)
    assert abs(float(pyro.param("offset").detach()) - float(coef[0])) < 0.05
    assert abs(float(pyro.param("noise").detach()) / float(residual) - 1) < 0.05


def _model_with_a_delta_part(y):
    offset = pyro.param("offset", torch.tensor(0.0))
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(offset + w + b, 1.0), obs=y)


def _guide_with_a_delta_part(y):
    loc = pyro.param("w_loc", torch.tensor(0.0))
    scale = pyro.param("w_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
    pyro.sample("w", dist.Normal(loc, scale))
    pyro.sample("b", dist.Delta(pyro.param("b_value", torch.tensor(0.0))))


@pytest.mark.parametrize("given", [None, {"lr": 0.01}])
def test_point_optimizer_step_sizes_model_params_and_guide_parts(given):
    """By default the model's params step with Adam at 0.01 and a guide part that is not a
    Gaussian (a Delta) at 0.05 / (1 + t / 50) after t steps; arguments given run as given."""
    y = torch.tensor([0.5, 1.5, 1.0])
    optim = NGVI(point_optim_args=given)
    svi = SVI(_model_with_a_delta_part, _guide_with_a_delta_part, optim, Trace_ELBO())
    store = pyro.get_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGaussianWarning)
        for step in range(1, 101):
            svi.step(y)
            lrs = {name: optim.optim_objs[store.get_param(name).unconstrained()].param_groups[0]["lr"]
                   for name in ("offset", "b_value")}
            assert lrs["offset"] == 0.01
            assert lrs["b_value"] == (0.01 if given else pytest.approx(0.05 / (1 + (step - 1) / 50), rel=1e-12))
    assert store.get_param("w_loc").unconstrained() not in optim.optim_objs  # the Gaussian site: NGVI's step


def test_a_resumed_run_keeps_the_guide_parts_decaying_step_size(tmp_path):
    """The guide part's step size follows its optimizer's own step count, also after
    NGVI.save / load: a resumed run takes the uninterrupted run's steps exactly."""
    y = torch.tensor([0.5, 1.5, 1.0])

    def run(steps, optim):
        svi = SVI(_model_with_a_delta_part, _guide_with_a_delta_part, optim, Trace_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGaussianWarning)
            for _ in range(steps):
                svi.step(y)

    pyro.set_rng_seed(3)
    optim = NGVI()
    run(30, optim)
    pyro.get_param_store().save(tmp_path / "params.pt")
    optim.save(tmp_path / "optim.pt")
    rng = pyro.util.get_rng_state()
    run(30, optim)
    expected = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "params.pt")
    resumed = NGVI()
    resumed.load(tmp_path / "optim.pt")
    pyro.util.set_rng_state(rng)
    run(30, resumed)
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), expected[name]), name
    b_value = pyro.get_param_store().get_param("b_value").unconstrained()
    assert resumed.optim_objs[b_value].param_groups[0]["lr"] == pytest.approx(0.05 / (1 + 59 / 50), rel=1e-12)


def _low_rank_median_errors(unit, seeds=5, steps=20):
    """Pyro's test_median_module without its model param, in units scaled by ``unit``: a site
    with prior N(2, 0.1) and no data, under AutoLowRankMultivariateNormal (init_scale 0.1, both
    scaled); the largest |median - 2| after ``steps`` one-draw steps, per seed, in prior sds."""
    def model():
        pyro.sample("x", dist.Normal(1.0 * unit, 0.1 * unit))
        pyro.sample("y", dist.Normal(2.0 * unit, 0.1 * unit))

    errors = []
    for seed in range(seeds):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoLowRankMultivariateNormal(model, init_scale=0.1 * unit)
        svi = SVI(model, guide, NGVI(), Trace_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGaussianWarning)
            for _ in range(steps):
                svi.step()
        median = guide.median()
        errors.append(max(abs(float(median["x"]) / unit - 1.0), abs(float(median["y"]) / unit - 2.0)) / 0.1)
    return errors


def test_low_rank_guide_loc_steps_in_its_own_marginal_sds():
    """An AutoLowRankMultivariateNormal's loc takes Adam's step in units of the guide's marginal
    sd (issue 23): a pure-noise site stays within its prior sd for 20 steps, whatever the
    model's units (with Adam's step in the loc's own units, 0.05 at first, a site of sd 0.001
    wandered tens of sds; and at sd 0.1 Pyro's test_median_module failed for 5 of 100 seeds)."""
    errors = _low_rank_median_errors(1.0)
    assert max(errors) < 1.0
    assert _low_rank_median_errors(0.01) == pytest.approx(errors, rel=1e-3, abs=1e-3)


def test_low_rank_guide_loc_still_travels_many_sds():
    """The loc's step in sd units grows with the natural-gradient distance estimate
    sigma_i^2 |m_i| (within one sd a step): a regression's posterior mean, about 70 posterior sds
    from the prior's median, is within about 10 of them after 500 steps, as with Adam's step in
    the loc's own units (10.6). Adam's step in plain sd units, 0.05 / (1 + t / 50) sd, travels
    at most 2.5 log(1 + t / 50) sds: it was still 69 sds away."""
    torch.manual_seed(0)
    X = torch.randn(200, 3)
    y = X @ torch.tensor([3.0, -2.0, 1.0]) + torch.randn(200)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 10.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(X @ w, 1.0), obs=y)

    precision = X.T @ X + torch.eye(3) / 100
    covariance = torch.linalg.inv(precision)
    mean, sd = covariance @ X.T @ y, covariance.diag().sqrt()
    guide = AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGaussianWarning)
        svi.step(X, y)
        start = ((guide.loc.detach() - mean) / sd).abs().max()
        for _ in range(499):
            svi.step(X, y)
    assert start > 60
    assert ((guide.loc.detach() - mean) / sd).abs().max() < 20


def test_low_rank_guide_started_narrower_than_the_posterior_reaches_its_mean():
    """A conjugate model, x ~ N(0, 1) with 20 observations N(x, 1) (posterior N(sum / 21, 1 / 21),
    sd 0.218, its mean about 10 sds from the prior's median) beside z ~ N(1, 0.5), under
    AutoLowRankMultivariateNormal(init_scale=0.08): the loc's distance estimate sigma_i^2 |m_i|
    was (sigma_guide / sigma_post)^2 too short and Adam's sqrt(v) remembered the early large
    gradients, so x's loc was still 3.5 posterior sds off after 300 steps (1.0 after 1,500); the
    gradient's signal-to-noise ratio m_i / s_i measures the distance in guide sds at any width."""
    torch.manual_seed(123)
    data = 2.4 + torch.randn(20)
    mean, sd = data.sum().item() / 21, 21 ** -0.5

    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.sample("z", dist.Normal(1.0, 0.5))
        with pyro.plate("data", 20):
            pyro.sample("obs", dist.Normal(x, 1.0), obs=data)

    errors = []
    for seed in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoLowRankMultivariateNormal(model, init_scale=0.08)
        svi = SVI(model, guide, NGVI(), Trace_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGaussianWarning)
            for _ in range(300):
                svi.step()
        errors.append(abs(guide.loc[0].item() - mean) / sd)
    assert max(errors) < 0.5


def test_low_rank_loc_gradient_noise_is_the_averaged_half_squared_change():
    """gradient_noise's s^2 is the bias-corrected average, at rate beta, of (g_k - g_(k-1))^2 / 2
    (against the sum written out), none before LOW_RANK_NOISE_COUNT changes, and about the draws'
    variance for independent draws."""
    torch.manual_seed(0)
    grads = torch.randn(30, 3) * torch.tensor([0.1, 1.0, 10.0]) + 5.0
    state, beta = {}, point.LOW_RANK_NOISE_BETA
    noises = [point.gradient_noise(state, g) for g in grads]
    assert all(noise is None for noise in noises[:point.LOW_RANK_NOISE_COUNT])
    noise = noises[-1]
    weights = beta ** torch.arange(28, -1, -1.0)
    expected = (weights[:, None] * (grads[1:] - grads[:-1]).pow(2) / 2).sum(0) * (1 - beta) / (1 - beta ** 29)
    assert noise == pytest.approx(expected.sqrt(), rel=1e-5)
    many = torch.randn(3000, 3) * torch.tensor([0.1, 1.0, 10.0])
    state = {}
    for g in many:
        noise = point.gradient_noise(state, g)
    assert noise == pytest.approx(torch.tensor([0.1, 1.0, 10.0]), rel=0.25)


@pytest.mark.parametrize("given", [None, {"lr": 0.05}])
def test_low_rank_guide_first_loc_step_is_within_one_marginal_sd(given):
    """The first step (Adam's is alpha_t sign(g)) moves the loc by at most one marginal sd of the
    guide, sigma_i = s_i (1 + sum_j W_ij^2)^(1/2), and by alpha_0 sigma_i max(1, sigma_i |g_i|);
    with point_optim_args given, Adam's step runs as given (0.05 on each coordinate)."""
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(4), 0.001).to_event(1))

    guide = AutoLowRankMultivariateNormal(model, init_scale=0.01)
    svi = SVI(model, guide, NGVI(point_optim_args=given), Trace_ELBO())
    guide()
    start = guide.loc.detach().clone()
    sigma = (guide.scale * (1 + guide.cov_factor.pow(2).sum(-1)).sqrt()).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGaussianWarning)
        svi.step()
    moved = (guide.loc.detach() - start).abs()
    if given:
        assert moved == pytest.approx(torch.full((4,), 0.05), rel=1e-4)
    else:
        assert (moved <= sigma * (1 + 1e-5)).all() and (moved > 0).all()
        assert (moved < 0.05).all()


def test_skipped_step_warnings_count_attempted_steps():
    def model():
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(torch.sqrt(b), 1.0), obs=torch.tensor(1.0))

    guide = AutoNormal(model)
    pyro.param("AutoNormal.locs.b", torch.tensor(-5.0))  # sqrt of a negative: NaN
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NGVIWarning) as record, pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Encountered NaN")
        for _ in range(5):
            svi.step()
    messages = [str(w.message) for w in record if issubclass(w.category, NGVIWarning)]
    # warned at the 1st, 2nd, 4th, ... skipped step
    assert [m.split(":")[0] for m in messages] == [f"NGVI skipped step {n} (0 taken)" for n in (1, 2, 4)]
    assert svi.optim.num_skipped_steps == 5
    assert math.isfinite(pyro.param("AutoNormal.locs.b").item())


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_adaptive_steps_do_not_depend_on_how_sites_are_grouped(monkeypatch, momentum):
    """The adaptive steps keep per-element counts and per-site pooled noise: sites of
    several shapes (one masked, with and without known draws and a conjugate prior)
    take the same steps whether they are updated as one flat vector, in small groups,
    or alone."""
    import pyro_ngvi.optim
    from pyro_ngvi.family import attach_curvature
    from pyro_ngvi.family import SiteCurvature

    torch.set_default_dtype(torch.float64)
    shapes = {"a": (3, 2), "b": (4,), "c": (2, 2), "d": (5,), "e": (3,), "f": (2,)}
    config = {"a": (False, True, False), "b": (True, True, False), "c": (False, True, False),
              "d": (True, True, True), "e": (False, True, False), "f": (False, False, False)}
    # name: (conjugate prior, known draws, masked); a, c, e form one group when flat_max allows

    def model():
        for name, shape in shapes.items():
            pyro.sample(name, dist.Normal(torch.zeros(shape), 1.0).to_event(len(shape)))

    results = []
    for flat_max in (1 << 16, 7, 4):
        monkeypatch.setattr(pyro_ngvi.groups, "FLAT_MAX", flat_max)
        pyro.clear_param_store()
        g = torch.Generator().manual_seed(3)
        guide = AutoNormal(model)
        guide()
        store = pyro.get_param_store()
        params = [store._params[n] for n in store.keys()]
        optim = NGVI(momentum=momentum, guide=guide)
        for _ in range(12):
            for name, shape in shapes.items():
                prior, known, masked = config[name]
                eps = torch.randn(shape, generator=g)
                curvature = torch.rand(shape, generator=g) * 4 + 0.5
                grad = torch.randn(shape, generator=g) + curvature * eps * 0.3
                mask = torch.tensor([True, False, True, True, False]) if masked else None
                m0, lam0 = (torch.zeros(shape), torch.full(shape, 2.0)) if prior else (None, None)
                attach_curvature(store._params[f"AutoNormal.locs.{name}"], SiteCurvature(
                    grad, curvature * eps.square(), m0, lam0, mask=mask, sampled=True,
                    eps_mean=eps if known else None, eps_sq_mean=eps.square() if known else None))
            optim(params)
        results.append({k: v.detach().clone() for k, v in store.items()})
    for other in results[1:]:
        for key, value in results[0].items():
            assert torch.allclose(other[key], value, rtol=1e-12, atol=1e-14), key


def test_autodiagonalnormal_pools_each_latents_noise_apart():
    """An AutoDiagonalNormal is one flat site over all latents; its adaptive steps pool noise per
    latent (one latent's noise says nothing of another's). With a log-normal latent beside a
    Gaussian block, the block reaches its exact posterior N(y / 2, 1 / 2) as under AutoNormal;
    pooled over the whole site, the log-normal latent's noise looked like drift, its mean
    wandered, and the cross terms carried it into the block (0.6 posterior sd off at step 600)."""
    torch.set_default_dtype(torch.float64)
    y = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))

    def model(y):
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        with pyro.plate("p", 4):
            w = pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
            pyro.sample("y", dist.Normal(w, 1.0).to_event(2), obs=y)
        pyro.sample("t", dist.Normal(s, 0.5), obs=torch.tensor(1.3))

    pyro.set_rng_seed(0)
    guide = AutoDiagonalNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    errors = []
    for step in range(1, 601):
        svi.step(y)
        if step % 100 == 0:
            posterior = guide.get_posterior()
            errors.append(float((posterior.mean.detach()[1:] - y.reshape(-1) / 2).abs().max()))
    assert max(errors[2:]) < 0.02  # from step 300 on
    assert float((posterior.stddev.detach()[1:] - 0.5**0.5).abs().max()) < 0.01


def non_centred_eight_schools(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", 8):
        theta_raw = pyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(mu + tau * theta_raw, sigma), obs=y)


#: The mean-field optimum of the non-centred eight schools (mu, log tau, theta_raw): ClippedAdam
#: (lr 0.02, lrd 0.9995) on Trace_ELBO with 256 vectorised particles, 8,000 steps, seed 0
#: (the means of its last 4,000 steps agree to 0.03 sd).
EIGHT_SCHOOLS_LOC = [4.529, 0.81, 0.29, 0.094, -0.074, 0.056, -0.17, -0.076, 0.348, 0.073]
EIGHT_SCHOOLS_SCALE = [3.155, 0.73, 0.968, 0.934, 0.97, 0.945, 0.918, 0.945, 0.932, 0.979]


@pytest.mark.parametrize("seed", [0, 1])
def test_defaults_hold_the_mean_field_optimum_of_non_centred_eight_schools(seed):
    """The curvature of log tau is heavy-tailed: clipped alone, its targets biased tau's scale 25 %
    wide, and single draws reset the adaptive counts, so the means wandered up to 2.3 sds from the
    optimum between steps 1,000 and 2,000. With the clipped part carried over and a drift halving
    the count, every mean stays within 0.5 sds of it and every scale within 10 %."""
    pyro.set_rng_seed(seed)
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    loc, scale = torch.tensor(EIGHT_SCHOOLS_LOC), torch.tensor(EIGHT_SCHOOLS_SCALE)
    guide = AutoNormal(non_centred_eight_schools)
    svi = SVI(non_centred_eight_schools, guide, NGVI(), Trace_ELBO())
    errors, ratios = [], []
    for step in range(1, 2001):
        svi.step(y, sigma)
        if step >= 1000 and step % 50 == 0:
            locs = torch.cat([guide.locs.mu.reshape(1), guide.locs.tau.reshape(1), guide.locs.theta_raw]).detach()
            scales = torch.cat([guide.scales.mu.reshape(1), guide.scales.tau.reshape(1),
                                guide.scales.theta_raw]).detach()
            errors.append(((locs - loc) / scale).abs())
            ratios.append(scales / scale)
    assert torch.stack(errors).max() < 0.5
    assert (torch.stack(ratios).mean(0) - 1).abs().max() < 0.1
