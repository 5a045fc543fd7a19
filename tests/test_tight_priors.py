"""A conjugate Normal prior far tighter, or far from the data, under CurvatureELBO("hessian"):
the mean-field and full-covariance steps against the closed-form posterior of a Normal mean."""

import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO


def fit(prior_scale, steps, guide_class=AutoNormal, num_data=50):
    """``steps`` of NGVI on loc ~ N(0, prior_scale), y_i ~ N(loc, 1), y_i ~ N(3, 1); returns
    the guide's mean and sd, the exact posterior's (precision 1/s0^2 + N, mean sum(y) / precision)
    and the warnings raised."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = torch.randn(num_data) + 3.0

    def model(data):
        loc = pyro.sample("loc", dist.Normal(0.0, prior_scale).expand([1]).to_event(1))
        with pyro.plate("data", num_data):
            pyro.sample("obs", dist.Normal(loc[0], 1.0), obs=data)

    guide = guide_class(model)
    svi = SVI(model, guide, NGVI(), loss=CurvatureELBO("hessian"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step(data)
    precision = prior_scale ** -2 + num_data
    exact = (data.double().sum().item() / precision, precision ** -0.5)
    if guide_class is AutoNormal:
        got = (pyro.param("AutoNormal.locs.loc").item(), pyro.param("AutoNormal.scales.loc").item())
    else:
        got = (pyro.param("AutoMultivariateNormal.loc").item(), pyro.param("AutoMultivariateNormal.scale").item())
    return got, exact, [str(w.message) for w in caught]


@pytest.mark.parametrize("prior_scale", [1e-6, 1e-3])
def test_a_tight_prior_is_reached_without_overshoot_or_warning(prior_scale):
    """The sampled curvature target lambda_0 + h is clipped to (1 +- 9) lambda around lambda_0, not
    around 0: clipped to 10 lambda, a guide of sd 0.1 under a prior of sd 1e-6 grew its precision
    5.5-fold a step while the prior's pull lambda_0 (mu - m_0) / lambda' was not clipped, the mean
    overshot to 1e6 and diverged to inf (RuntimeError after 50 skipped steps); at sd 1e-3 it jumped
    259 prior sd (a warning that the means grow without bound) and recovered. The jump to lambda_0
    is a transient, not noise: the noisy-curvature watch does not read it as one."""
    (mean, sd), (exact_mean, exact_sd), caught = fit(prior_scale, 260)
    assert abs(mean - exact_mean) < 1e-3 * exact_sd
    assert sd == pytest.approx(exact_sd, rel=1e-4)
    assert caught == []


def test_a_tight_prior_is_reached_by_a_full_covariance_guide():
    """The full-covariance adaptive step clamps the precision's eigenvalues to a factor 1.25 a step,
    up to the whitened prior precision's largest eigenvalue where that is more: clamped to 1.25, the
    same guide under a prior of sd 1e-3 overshot the prior mean 80-fold a step and diverged to inf
    (RuntimeError after 50 skipped steps)."""
    (mean, sd), (exact_mean, exact_sd), _ = fit(1e-3, 120, AutoMultivariateNormal)
    assert abs(mean - exact_mean) < 1e-3 * exact_sd
    assert sd == pytest.approx(exact_sd, rel=1e-4)


@pytest.mark.parametrize("guide_class, tolerance", [(AutoNormal, 1e-3), (AutoMultivariateNormal, 0.05)])
def test_a_prior_far_from_the_data_does_not_stop_the_mean_short(guide_class, tolerance):
    """A prior of sd 0.05 at 0, the data's mean 3 (the posterior 6.6 prior sd from the prior mean):
    the trust region clipped the likelihood's part of the mean step to 3 sd and not the prior's, so
    the rule stopped where the two met, 3.2 posterior sd short of the exact mean (mean-field and full
    covariance alike), and its stall tests, reading the likelihood's gradient alone, warned there.
    The whole step is clipped now (to 3 sd, or the prior's part where that is longer), and the stall
    tests read the whole gradient, 0 at the optimum."""
    (mean, sd), (exact_mean, exact_sd), caught = fit(0.05, 200, guide_class)
    assert abs(mean - exact_mean) < tolerance * exact_sd
    assert sd == pytest.approx(exact_sd, rel=1e-4)
    assert caught == []


def test_an_infinite_loss_with_finite_gradients_is_warned_about():
    """An observation outside a Uniform likelihood's support (validation off) makes the loss +inf at
    every draw while its gradient is 0: NGVI trained silently on the rest of the model. The guide is
    then the posterior of the other observations (here the prior N(0, 10) exactly, with curvature
    'hessian': a Uniform of a fixed width is flat in its location), and a warning says why."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    data = torch.randn(20) + 3.0
    data[0] = 100.0

    def model(data):
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Uniform(loc - 5.0, loc + 5.0), obs=data)

    svi = SVI(model, AutoNormal(model), NGVI(), loss=CurvatureELBO("hessian"))
    with pyro.validation_enabled(False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(101):  # (a window of 100 steps, read at the next step)
            assert svi.step(data) == float("inf")
    assert pyro.param("AutoNormal.locs.loc").item() == pytest.approx(0.0, abs=1e-5)
    assert pyro.param("AutoNormal.scales.loc").item() == pytest.approx(10.0, rel=1e-5)
    assert [str(w.message)[:37] for w in caught] == ["NGVI: the training loss is not finite"]
