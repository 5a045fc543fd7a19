"""
The draws of several particles, read as SVI runs an autoguide (pyro_ngvi.draws): exactly the
draws the ELBO's gradients came from (checked against the closed form of a conjugate model's
gradient), never stale ones, and what they buy: the coupled mean step on a correlated posterior
under Trace_ELBO(num_particles=8), where the element-wise steps stalled 1.1-2.1 sd off.
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_ngvi import NGVI
from pyro_ngvi.draws import GuideDraws

D, N, NOISE = 4, 8, 0.5


def seen_through_its_sum(obs):
    """A 4-vector seen only through its sum: posterior correlation 0.99."""
    t = pyro.sample("t", dist.Normal(0.0, 2.0).expand([D]).to_event(1))
    with pyro.plate("obs", N):
        pyro.sample("o", dist.Normal(t.sum(-1), NOISE), obs=obs)


def exact_posterior(obs):
    precision = torch.eye(D) / 4 + torch.ones(D, D) * N / NOISE**2
    mean = torch.linalg.solve(precision, torch.ones(D) * obs.sum() / NOISE**2)
    return mean, precision


OBS = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.5 + 3.0


@pytest.mark.parametrize("vectorize", [True, False])
def test_draws_read_are_those_the_gradients_came_from(vectorize):
    """On a Gaussian log joint the particles' mean gradient is H (mu + sigma eps_bar - m): the
    recorded eps_bar must solve it to round-off (and eps^2's mean is that of the same draws)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    guide = AutoNormal(seen_through_its_sum)
    guide(OBS)
    draws = GuideDraws()
    draws.watch(guide)
    elbo = Trace_ELBO(num_particles=5, vectorize_particles=vectorize, max_plate_nesting=1)
    with torch.no_grad():  # (a call under no_grad, as Predictive's, is no step's)
        guide(OBS)
    elbo.loss_and_grads(seen_through_its_sum, guide, OBS)
    loc, scale = guide.locs.t, guide.scales.t.detach()
    ((eps, eps_sq, count),) = draws._recorders[guide].take([loc], 5).values()
    assert count == 5
    mean, precision = exact_posterior(OBS)
    expected = torch.linalg.solve(precision, loc.grad) + mean - loc.detach()  # sigma eps_bar
    torch.testing.assert_close(scale * eps, expected, rtol=0.0, atol=2e-4)  # (float32 solve)
    assert bool((eps_sq >= eps.square() - 1e-6).all()) and float(eps_sq.mean()) > 0.2


def test_draws_of_other_calls_are_never_taken():
    """A guide called by hand with gradients on between steps adds a call: that step's draws are
    unknown (None), not mixed; params changed since the draws make them stale too."""
    pyro.clear_param_store()
    guide = AutoNormal(seen_through_its_sum)
    guide(OBS)
    draws = GuideDraws()
    draws.watch(guide)
    recorder = draws._recorders[guide]
    elbo = Trace_ELBO(num_particles=3)
    loc = guide.locs.t
    elbo.loss_and_grads(seen_through_its_sum, guide, OBS)
    assert list(recorder.take([loc], 3)) == [id(loc)]
    elbo.loss_and_grads(seen_through_its_sum, guide, OBS)
    guide(OBS)  # one call too many
    assert recorder.take([loc], 3) == {}
    elbo.loss_and_grads(seen_through_its_sum, guide, OBS)
    with torch.no_grad():
        loc.add_(0.1)  # the params moved after the draws
    assert recorder.take([loc], 3) == {}


def test_one_draw_removes_the_hooks_and_the_mean_field_elbo_is_not_read():
    """Under one particle the draws are recovered from the gradients: no hook stays on the guide.
    TraceMeanField_ELBO's analytic KL is no draw: its particles are not read either."""
    for loss in (Trace_ELBO(), TraceMeanField_ELBO(num_particles=4)):
        pyro.clear_param_store()
        guide = AutoNormal(seen_through_its_sum)
        svi = SVI(seen_through_its_sum, guide, NGVI(guide=guide), loss)
        assert guide._forward_pre_hooks
        svi.step(OBS)
        assert not guide._forward_pre_hooks and not guide._forward_hooks


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_several_particles_take_the_coupled_step_on_a_correlated_posterior(guide_class):
    """Trace_ELBO(num_particles=8): 600 steps reach the exact posterior mean within 0.5 mean-field
    sd (the element-wise steps alone, without the draws, were 1.1-2.1 sd off after 1,000 steps:
    ``python benchmarks/coupled.py``), the scales the mean-field optimum's."""
    mean, precision = exact_posterior(OBS)
    scale = precision.diagonal().rsqrt()
    for seed in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = guide_class(seen_through_its_sum)
        elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
        svi = SVI(seen_through_its_sum, guide, NGVI(), elbo)
        for _ in range(600):
            svi.step(OBS)
        loc, found = guide._loc_scale() if guide_class is AutoDiagonalNormal else guide._get_loc_and_scale("t")
        assert float(((loc.detach() - mean).abs() / scale).max()) < 0.5
        torch.testing.assert_close(found.detach(), scale, rtol=0.05, atol=0.0)


def test_predictive_between_steps_leaves_the_draws_known():
    """Predictive draws from the guide under no_grad: it is no step's call, and the next step
    still reads its own particles' draws."""
    pyro.clear_param_store()
    guide = AutoNormal(seen_through_its_sum)
    optim = NGVI(guide=guide)
    svi = SVI(seen_through_its_sum, guide, optim, Trace_ELBO(num_particles=4))
    svi.step(OBS)
    Trace_ELBO(num_particles=4).loss_and_grads(seen_through_its_sum, guide, OBS)
    Predictive(seen_through_its_sum, guide=guide, num_samples=3)(OBS)
    assert list(optim._draws._recorders[guide].take([guide.locs.t], 4)) == [id(guide.locs.t)]


def test_nothing_is_recorded_where_no_step_takes_draws():
    """NGVI(guide=...) called directly, without SVI (laplace's and the BayesianNet's own loops do):
    no step reads draws, and the hooks go at its first step (they held every call's draws)."""
    pyro.clear_param_store()
    guide = AutoNormal(seen_through_its_sum)
    guide(OBS)
    optim = NGVI(guide=guide)
    assert guide._forward_pre_hooks
    Trace_ELBO().differentiable_loss(seen_through_its_sum, guide, OBS).backward()
    params = [p.unconstrained() for p in pyro.get_param_store().values()]
    optim(params)
    assert not guide._forward_pre_hooks and not guide._forward_hooks
