"""
Our own ports of the kinds of tests in Pyro's ``tests/infer/test_autoguide.py``
that train an :class:`~pyro.infer.autoguide.AutoMultivariateNormal` (exact
posterior, batched, tree-structured, transformed sites, a conditioned model),
with ``NGVI()`` and its defaults in place of Pyro's ``ClippedAdam`` / ``Adam``.
Pyro's step counts, particle counts and tolerances are kept.
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_ngvi import NGVI

NUM_STEPS = 500  # as Pyro's tests


def exact_model(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)
    return {"loc": loc}


def batch_model(data):
    with pyro.plate("data", len(data)):
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)
    return {"loc": loc}


def tree_model(data):
    x = pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        y = pyro.sample("y", dist.Normal(x, 1.0))
        pyro.sample("obs", dist.Normal(y, 1.0), obs=data)
    return {"x": x, "y": y}


def unobserved_exact_model(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(loc, 1.0))
    return {"loc": loc}


def conditioned_model(data):
    """The exact model with its observations given by ``poutine.condition``."""
    return poutine.condition(unobserved_exact_model, data={"obs": data})(data)


def exact_posterior(name, data):
    """Joint posterior (mean, covariance) of the latents in the guide's order, and the
    log evidence (the ELBO of the exact guide)."""
    n = len(data)
    if name == "batch":
        mean, covariance = data / 2, torch.eye(n) / 2
        evidence = dist.Normal(0.0, 2**0.5).log_prob(data).sum()
    elif name == "tree":
        precision = torch.tensor([[3.0, -1.0, -1.0], [-1.0, 2.0, 0.0], [-1.0, 0.0, 2.0]])
        covariance = torch.linalg.inv(precision)
        mean = covariance @ torch.cat([torch.zeros(1), data])
        evidence = dist.MultivariateNormal(torch.zeros(n), 2 * torch.eye(n) + 1).log_prob(data)
    else:  # exact, conditioned
        mean, covariance = data.sum().reshape(1) / (n + 1), torch.eye(1) / (n + 1)
        evidence = dist.MultivariateNormal(torch.zeros(n), torch.eye(n) + 1).log_prob(data)
    return mean, covariance, float(evidence)


MODELS = {"exact": exact_model, "batch": batch_model, "tree": tree_model,
          "conditioned": conditioned_model}


@pytest.mark.parametrize("name", list(MODELS))
def test_exact_posterior_with_ngvi_defaults(name):
    model = MODELS[name]
    data = torch.randn(2 if name == "tree" else 3)
    guide = AutoMultivariateNormal(model)
    elbo = JitTrace_ELBO(num_particles=100, vectorize_particles=True, ignore_jit_warnings=True)
    svi = SVI(model, guide, NGVI(), elbo)
    for _ in range(NUM_STEPS):
        svi.step(data)

    mean, covariance, evidence = exact_posterior(name, data)
    guide.requires_grad_(False)
    with torch.no_grad():
        vectorize = pyro.plate("particles", 10000, dim=-2)
        guide_trace = poutine.trace(vectorize(guide)).get_trace(data)
        samples = poutine.replay(vectorize(model), guide_trace)(data)
        draws = torch.cat([samples[k].reshape(10000, -1) for k in samples], -1)
        assert (draws.mean(0) - mean).abs().max() < 0.05
        assert (draws.std(0) / covariance.diagonal().sqrt() - 1).abs().max() < 0.05
        if name == "tree":  # the correlations a mean-field guide cannot hold
            correlation = torch.corrcoef(draws.T)
            exact = covariance / torch.outer(covariance.diagonal(), covariance.diagonal()).sqrt()
            assert (correlation - exact).abs().max() < 0.05
        loss = Trace_ELBO(num_particles=10000, vectorize_particles=True).loss(model, guide, data)
        assert abs(-loss - evidence) < 0.01


def transformed_model():
    pyro.sample("y", dist.LogNormal(0.0, 1.0))
    pyro.sample("z", dist.Beta(2.0, 2.0).expand([2]).to_event(1))
    pyro.sample("x", dist.Normal(0.0, 1.0))


def test_median_and_quantiles_of_transformed_sites_with_ngvi_defaults():
    """Pyro's test_median / test_quantiles: 100 steps, 100 particles."""
    guide = AutoMultivariateNormal(transformed_model)
    elbo = Trace_ELBO(num_particles=100, vectorize_particles=True)
    svi = SVI(transformed_model, guide, NGVI(), elbo)
    for _ in range(100):
        svi.step()

    median = guide.median()
    assert abs(median["x"].item()) < 0.1
    assert abs(median["y"].item() - 1.0) < 0.1
    assert (median["z"] - 0.5).abs().max() < 0.1

    posterior_scale = guide.get_posterior().variance[-1].sqrt()
    q = guide.quantiles([0.158655, 0.8413447])
    torch.testing.assert_close(0.5 * (q["x"][1] - q["x"][0]), posterior_scale, atol=1e-6, rtol=0)
    quantiles = {k: v.tolist() for k, v in guide.quantiles([0.1, 0.5, 0.9]).items()}
    assert -3.0 < quantiles["x"][0] and quantiles["x"][0] + 1.0 < quantiles["x"][1]
    assert quantiles["x"][1] + 1.0 < quantiles["x"][2] < 3.0
    assert 0.01 < quantiles["y"][0] and quantiles["y"][0] * 2.0 < quantiles["y"][1]
    assert quantiles["y"][1] * 2.0 < quantiles["y"][2] < 100.0
    for low, mid, high in zip(*quantiles["z"]):
        assert 0.01 < low and low + 0.1 < mid and mid + 0.1 < high < 0.99
