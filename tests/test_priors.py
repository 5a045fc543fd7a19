"""Specification of the prior machinery: conjugacy (pyro_ngvi.priors), posterior-as-prior
(pyro_ngvi.continual) and prior swapping (pyro_ngvi.handlers)."""

import math

import pytest
import torch
import torch.distributions as td
from torch.distributions import biject_to, constraints

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_ngvi import PriorMessenger, conjugate_normal, posterior_as_prior, with_priors


def f64(x):
    return torch.as_tensor(x, dtype=torch.float64)


@pytest.fixture(autouse=True)
def fresh_pyro():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


def standard_normal():
    return dist.Normal(f64(0.0), f64(1.0))


def normal_through(transforms, loc=0.0, scale=1.0):
    return dist.TransformedDistribution(dist.Normal(f64(loc), f64(scale)), transforms)


def pullback_log_density(fn, support, u):
    """log p(T(u)) + log|det J_T(u)|, summed: the prior's density in u, by hand."""
    transform = biject_to(support)
    x = transform(u)
    return fn.log_prob(x).sum() + transform.log_abs_det_jacobian(u, x).sum()


def assert_gaussian_in_u(fn, support, result):
    """The recognised (m0, lam0) reproduces the prior's density in u at random points."""
    loc, precision = result
    for _ in range(3):
        u = loc + torch.randn_like(loc)
        expected = dist.Normal(loc, precision.rsqrt()).log_prob(u).sum()
        assert torch.allclose(pullback_log_density(fn, support, u), expected, rtol=1e-10)


# --------------------------------------------------------------------------- #
# conjugate_normal
# --------------------------------------------------------------------------- #


def test_conjugate_normal_recognises_normal_on_real_site():
    loc, scale = f64([0.5, -1.0, 2.0]), f64([0.1, 1.0, 3.0])
    prior = dist.Normal(loc, scale)
    result = conjugate_normal(prior)
    assert result is not None
    assert torch.equal(result[0], loc)
    assert torch.allclose(result[1], 1 / scale**2)
    assert_gaussian_in_u(prior, constraints.real, result)


def test_conjugate_normal_recognises_torch_normal():
    result = conjugate_normal(td.Normal(f64(1.0), f64(2.0)))
    assert result is not None and torch.allclose(result[1], f64(0.25))


def test_conjugate_normal_recognises_expanded_independent_normal():
    loc, scale = f64([0.5, -1.0, 2.0]), f64(2.0)
    prior = dist.Normal(loc, scale).expand([4, 3]).to_event(1)
    loc0, precision0 = conjugate_normal(prior)
    assert loc0.shape == precision0.shape == (4, 3)
    assert torch.equal(loc0, loc.expand(4, 3))
    assert torch.allclose(precision0, torch.full((4, 3), 0.25, dtype=torch.float64))
    assert_gaussian_in_u(prior, prior.support, (loc0, precision0))


def test_conjugate_normal_recognises_pyro_expanded_distribution():
    # ExpandedDistribution wrapper around a TransformedDistribution
    prior = dist.ExpandedDistribution(dist.LogNormal(f64(0.3), f64(0.7)), torch.Size([5]))
    loc0, precision0 = conjugate_normal(prior)
    assert loc0.shape == (5,)
    assert torch.allclose(precision0, torch.full((5,), 0.7**-2, dtype=torch.float64))


def test_conjugate_normal_recognises_lognormal_on_positive_site():
    loc, scale = f64([0.3, -2.0]), f64([0.7, 1.5])
    prior = dist.LogNormal(loc, scale)
    assert prior.support is constraints.positive
    result = conjugate_normal(prior)
    assert result is not None
    assert torch.equal(result[0], loc)
    assert torch.allclose(result[1], scale**-2)
    assert_gaussian_in_u(prior, constraints.positive, result)
    # as a vector site too
    assert conjugate_normal(prior.to_event(1)) is not None


def test_conjugate_normal_recognises_normal_through_biject_to_positive():
    bijection = biject_to(constraints.positive)
    assert bijection != td.ExpTransform()  # the trap: not equal, yet the same map
    prior = dist.TransformedDistribution(dist.Normal(f64([1.0, 2.0]), f64(0.5)), bijection)
    result = conjugate_normal(prior, support=constraints.positive)
    assert result is not None
    assert torch.allclose(result[0], f64([1.0, 2.0]))
    assert torch.allclose(result[1], f64([4.0, 4.0]))
    assert_gaussian_in_u(prior, constraints.positive, result)


def test_conjugate_normal_uses_the_reported_support_by_default():
    # torch reports the codomain of AffineTransform: real. In real coordinates
    # this prior is lognormal, not normal.
    prior = normal_through(biject_to(constraints.positive), 1.0, 0.5)
    assert prior.support.event_dim == 0 and str(prior.support) == "Real()"
    assert conjugate_normal(prior) is None


@pytest.mark.parametrize(
    "prior, support",
    [
        (dist.HalfCauchy(f64(1.0)), None),
        (dist.Gamma(f64(2.0), f64(1.0)), None),
        (dist.HalfNormal(f64(1.0)), None),
        (standard_normal(), constraints.positive),
        (standard_normal().mask(False), None),
        (normal_through([td.SigmoidTransform()]), constraints.positive),
        (normal_through([td.ExpTransform(), td.AffineTransform(0.0, 2.0)]), constraints.positive),
        (dist.LogNormal(f64(0.0), f64(1.0)), constraints.real),
    ],
    ids=[
        "HalfCauchy",
        "Gamma",
        "HalfNormal",
        "Normal-on-positive",
        "masked",
        "sigmoid",
        "exp-times-2",
        "LogNormal-on-real",
    ],
)
def test_conjugate_normal_rejects_non_gaussian_in_u(prior, support):
    assert conjugate_normal(prior, support) is None


def test_conjugate_normal_recognises_stick_breaking_normal_on_simplex():
    loc = torch.randn(4, 2, dtype=torch.float64)
    scale = torch.rand(4, 2, dtype=torch.float64) + 0.5
    prior = dist.TransformedDistribution(
        dist.Normal(loc, scale).to_event(1), td.StickBreakingTransform()
    )
    assert prior.batch_shape == (4,) and prior.event_shape == (3,)
    result = conjugate_normal(prior)
    assert result is not None
    assert result[0].shape == result[1].shape == (4, 2)
    assert torch.equal(result[0], loc)
    assert torch.allclose(result[1], scale**-2)
    assert_gaussian_in_u(prior, constraints.simplex, result)
    # a Dirichlet on the same site is not Gaussian in u
    assert conjugate_normal(dist.Dirichlet(torch.ones(4, 3, dtype=torch.float64))) is None


# --------------------------------------------------------------------------- #
# posterior_as_prior
# --------------------------------------------------------------------------- #


def rate_model(data):
    rate = pyro.sample("rate", dist.Gamma(f64(2.0), f64(1.0)))
    w = pyro.sample("w", standard_normal().expand([2]).to_event(1))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(w.sum(), rate.reciprocal()), obs=data)


def fitted_guide(model, *args, steps=3):
    guide = AutoNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return guide


def test_posterior_as_prior_positive_site_density_by_change_of_variables():
    data = f64([0.3, -0.2, 1.1])
    guide = fitted_guide(rate_model, data)
    loc, scale = (t.detach().clone() for t in guide._get_loc_and_scale("rate"))
    prior = posterior_as_prior(guide)["rate"]
    assert isinstance(prior, dist.TransformedDistribution)
    assert str(prior.support) == str(dist.Gamma(1.0, 1.0).support)

    x = f64([0.2, 1.0, 3.5])
    by_hand = dist.Normal(loc, scale).log_prob(x.log()) - x.log()
    assert torch.allclose(prior.log_prob(x), by_hand, rtol=1e-12)

    # the prior is a detached copy: moving the guide leaves it alone
    store = pyro.get_param_store()
    with torch.no_grad():
        store["AutoNormal.locs.rate"].unconstrained().add_(1.0)
        store["AutoNormal.scales.rate"].unconstrained().add_(1.0)
    new_loc, new_scale = guide._get_loc_and_scale("rate")
    assert not torch.allclose(new_loc, loc) and not torch.allclose(new_scale, scale)
    assert torch.allclose(prior.log_prob(x), by_hand, rtol=1e-12)
    assert not prior.base_dist.loc.requires_grad


def test_posterior_as_prior_is_conjugate_with_the_guide_natural_parameters():
    data = f64([0.3, -0.2, 1.1])
    guide = fitted_guide(rate_model, data)
    priors = posterior_as_prior(guide)
    for name in ("rate", "w"):
        loc, scale = guide._get_loc_and_scale(name)
        m0, lam0 = conjugate_normal(priors[name])
        assert torch.allclose(m0, loc.detach())
        assert torch.allclose(lam0, scale.detach() ** -2)


def test_posterior_as_prior_real_vector_site_is_plain_normal_to_event():
    guide = fitted_guide(rate_model, f64([0.3]))
    prior = posterior_as_prior(guide, sites=["w"])
    assert list(prior) == ["w"]
    assert isinstance(prior["w"], dist.Independent)
    assert isinstance(prior["w"].base_dist, dist.Normal)
    assert prior["w"].batch_shape == () and prior["w"].event_shape == (2,)


def test_posterior_as_prior_simplex_site():
    def model():
        pyro.sample("p", dist.Dirichlet(torch.ones(4, dtype=torch.float64)))

    guide = fitted_guide(model)
    prior = posterior_as_prior(guide)["p"]
    assert prior.event_shape == (4,) and str(prior.support) == "Simplex()"
    x = prior.sample()
    assert torch.allclose(x.sum(), f64(1.0))
    assert conjugate_normal(prior)[0].shape == (3,)


def test_conjugate_normal_refuses_what_is_not_a_distribution():
    with pytest.raises(ValueError, match="fn must be a distribution"):
        conjugate_normal(3)
    with pytest.raises(TypeError, match="support must be a constraint"):  # (a string: None, silently)
        conjugate_normal(dist.LogNormal(0.0, 2.0), "positive")


def test_posterior_as_prior_errors():
    guide = AutoNormal(rate_model)
    with pytest.raises(ValueError, match="run the guide"):
        posterior_as_prior(guide)
    guide(f64([0.3]))
    with pytest.raises(ValueError, match=r"'nope'.*\['rate', 'w'\]"):
        posterior_as_prior(guide, sites=["nope"])
    with pytest.raises(NotImplementedError, match="AutoNormal"):
        posterior_as_prior(AutoDiagonalNormal(rate_model))


# --------------------------------------------------------------------------- #
# with_priors
# --------------------------------------------------------------------------- #


def test_with_priors_swaps_the_site_distribution_in_a_trace():
    data = f64([0.3, -0.2])
    new_prior = dist.LogNormal(f64(1.0), f64(0.25))
    model = with_priors(rate_model, {"rate": new_prior})
    trace = poutine.trace(model).get_trace(data)
    trace.compute_log_prob()
    rate = trace.nodes["rate"]["value"]
    assert torch.allclose(trace.nodes["rate"]["log_prob"], new_prior.log_prob(rate))
    old_prior = dist.Gamma(f64(2.0), f64(1.0))
    assert not torch.allclose(trace.nodes["rate"]["log_prob"], old_prior.log_prob(rate))
    # other sites untouched
    w = trace.nodes["w"]["value"]
    assert torch.allclose(trace.nodes["w"]["log_prob"], standard_normal().log_prob(w).sum())


def test_with_priors_exports_a_messenger():
    with PriorMessenger({"rate": dist.LogNormal(f64(1.0), f64(0.25))}):
        trace = poutine.trace(rate_model).get_trace(f64([0.3]))
    assert isinstance(trace.nodes["rate"]["fn"].base_dist, dist.Normal)


def test_with_priors_svi_and_predictive_continual_learning():
    data = f64([0.3, -0.2, 1.1, 0.4])
    guide = fitted_guide(rate_model, data)
    model_t2 = with_priors(rate_model, posterior_as_prior(guide))
    guide_t2 = AutoNormal(model_t2)
    svi = SVI(model_t2, guide_t2, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    losses = [svi.step(data) for _ in range(5)]
    assert all(math.isfinite(loss) for loss in losses)
    # the swapped prior keeps the site positive in the new guide
    assert (guide_t2.median()["rate"] > 0).all()
    assert biject_to(guide_t2.prototype_trace.nodes["rate"]["fn"].support)(f64(-5.0)) > 0

    for parallel in (False, True):
        samples = Predictive(model_t2, guide=guide_t2, num_samples=7, parallel=parallel)(data)
        assert samples["obs"].shape == (7, 4)
    prior_samples = Predictive(model_t2, num_samples=7, return_sites=["rate"])(data)
    assert (prior_samples["rate"] > 0).all()


def test_with_priors_accepts_same_bijection_supports():
    # Gamma's support is nonnegative, LogNormal's positive: the same u = log x
    swapped = with_priors(rate_model, {"rate": dist.LogNormal(f64(0.0), f64(1.0))})
    trace = poutine.trace(swapped).get_trace(f64([0.1]))
    assert trace.nodes["rate"]["value"] > 0
    # a Normal through biject_to(positive) reports real support; it is recognised
    # as positive by what its transform does
    prior = normal_through(biject_to(constraints.positive))
    trace = poutine.trace(with_priors(rate_model, {"rate": prior})).get_trace(f64([0.1]))
    fn = trace.nodes["rate"]["fn"]
    assert str(fn.support) == str(dist.Gamma(1.0, 1.0).support)
    assert conjugate_normal(fn) is not None


@pytest.mark.parametrize(
    "priors, match",
    [
        ({"nope": standard_normal()}, r"never sampled.*'nope'"),
        ({"obs": standard_normal()}, r"'obs' is observed"),
        ({"rate": standard_normal()}, r"'rate' has support"),
        ({"rate": dist.HalfCauchy(f64(1.0)).expand([2]).to_event(1)}, r"'rate' has event shape"),
        ({"w": standard_normal().expand([3]).to_event(1)}, r"'w' has event shape"),
        ({"w": standard_normal().expand([5, 2]).to_event(1)}, r"'w' has batch shape"),
        ({"w": standard_normal().expand([2])}, r"'w' has event shape"),
    ],
    ids=["unknown", "observed", "support", "event-shape", "event-size", "batch", "not-to-event"],
)
def test_with_priors_errors_name_the_site(priors, match):
    model = with_priors(rate_model, priors)
    with pytest.raises(ValueError, match=match):
        model(f64([0.3, 0.1]))


def test_with_priors_unused_check_does_not_mask_model_errors():
    def broken():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        raise KeyError("inside the model")

    with pytest.raises(KeyError, match="inside the model"):
        with_priors(broken, {"b": dist.Normal(0.0, 1.0)})()


def test_with_priors_allows_sites_that_appear_on_this_run_only():
    def model(flag):
        if flag:
            pyro.sample("a", dist.Normal(0.0, 1.0))

    swapped = with_priors(model, {"a": dist.Normal(3.0, 1.0)})
    swapped(True)
    with pytest.raises(ValueError, match="'a'"):
        swapped(False)
    swapped(True)  # state is reset on each call


# --------------------------------------------------------------------------- #
# subsampled local latents
# --------------------------------------------------------------------------- #

N = 6


def local_model(data, subsample=None, subsample_size=None):
    with pyro.plate("data", N, subsample=subsample, subsample_size=subsample_size) as idx:
        z = pyro.sample("z", standard_normal())
        s = pyro.sample("s", dist.Gamma(f64(2.0), f64(2.0)))
        pyro.sample("obs", dist.Normal(z, s), obs=data[idx])


def full_size_priors():
    loc = torch.arange(N, dtype=torch.float64)
    scale = 0.5 + torch.arange(N, dtype=torch.float64) / 10
    return {
        "z": dist.Normal(loc, scale),
        "s": dist.LogNormal(loc / 10, scale),
    }


def test_with_priors_indexes_full_size_priors_by_the_subsample():
    data = torch.randn(N, dtype=torch.float64)
    priors = full_size_priors()
    rows = torch.tensor([4, 1])
    trace = poutine.trace(with_priors(local_model, priors)).get_trace(data, subsample=rows)
    trace.compute_log_prob()
    for name in ("z", "s"):
        value = trace.nodes[name]["value"]
        assert value.shape == (2,)
        # the full prior, evaluated at a full-size point holding the values at `rows`
        full = priors[name]
        x = torch.ones(N, dtype=torch.float64)
        x[rows] = value
        expected = full.log_prob(x)[rows]
        assert torch.allclose(trace.nodes[name]["unscaled_log_prob"], expected)
    # the mean of the z prior at row 4 is 4, at row 1 it is 1
    assert torch.equal(trace.nodes["z"]["fn"].loc, f64([4.0, 1.0]))


def test_with_priors_subsampled_posterior_as_prior_runs_in_svi():
    data = torch.randn(N, dtype=torch.float64)
    guide = fitted_guide(local_model, data, None, 3)
    priors = posterior_as_prior(guide)
    z_loc = priors["z"].loc.clone()
    assert priors["z"].batch_shape == (N,) and priors["s"].batch_shape == (N,)
    model_t2 = with_priors(local_model, priors)
    guide_t2 = AutoNormal(model_t2)
    svi = SVI(model_t2, guide_t2, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(4):
        assert math.isfinite(svi.step(data, None, 3))
    guide_trace = poutine.trace(guide_t2).get_trace(data, None, 3)
    replayed = poutine.replay(model_t2, trace=guide_trace)
    model_trace = poutine.trace(replayed).get_trace(data, None, 3)
    rows = model_trace.nodes["data"]["value"]
    assert torch.equal(model_trace.nodes["z"]["fn"].loc, priors["z"].loc[rows])
    assert torch.equal(model_trace.nodes["s"]["fn"].base_dist.loc, priors["s"].base_dist.loc[rows])
    # guide_t2 shares guide's param names ("AutoNormal.locs.z") and trained them;
    # the priors are copies and did not move
    assert torch.equal(priors["z"].loc, z_loc)
    assert not torch.equal(guide._get_loc_and_scale("z")[0].detach(), z_loc)


def test_with_priors_rejects_a_prior_of_the_wrong_plate_size():
    priors = {"z": dist.Normal(torch.zeros(N - 1, dtype=torch.float64), 1.0)}
    model = with_priors(local_model, priors)
    with pytest.raises(ValueError, match=r"'z' has size 5 along plate 'data'"):
        model(torch.randn(N, dtype=torch.float64), subsample_size=3)
