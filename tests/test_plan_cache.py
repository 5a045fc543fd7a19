"""A guide whose structure changes at random between steps (each of M sites present or not: up to
2**M structures, a new one nearly every step): NGVI keeps at most ``MAX_PLANS`` plans, the least
recently used dropped (it kept one per structure without bound: 60 steps of 8 such sites, 54
plans, the tensors alive growing by ~57 a step, and every new plan checked all the others), a
dropped plan's deferred checks are read (its skipped step counted), and each site still reaches
its exact posterior, N(x / 2, 1 / 2) for z ~ N(0, 1), x ~ N(z, 1)."""

import gc

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO

from pyro_ngvi import NGVI
from pyro_ngvi.plan import MAX_PLANS

M = 8
X = torch.linspace(-1.0, 2.0, M)


def model(mask, x=X):
    for i in range(len(mask)):
        if mask[i]:
            z = pyro.sample(f"z{i}", dist.Normal(0.0, 1.0))
            pyro.sample(f"x{i}", dist.Normal(z, 1.0), obs=x[i])


def guide(mask, x=X):
    for i in range(len(mask)):
        if mask[i]:
            loc = pyro.param(f"m{i}", torch.tensor(0.0))
            scale = pyro.param(f"s{i}", torch.tensor(1.0), constraint=dist.constraints.positive)
            pyro.sample(f"z{i}", dist.Normal(loc, scale))


def _masks(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(M, generator=generator) < 0.5 for _ in range(n)]


def _tensors_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_a_guide_of_random_structure_keeps_a_bounded_number_of_plans_and_fits():
    pyro.enable_validation(False)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    masks = _masks(60)
    alive = []
    for step, mask in enumerate(masks, 1):
        svi.step(mask)
        assert len(svi.optim._plans) <= MAX_PLANS
        if step in (30, 60):
            alive.append(_tensors_alive())
    assert alive[1] - alive[0] < 300  # (kept without bound: +1,701 over these 30 steps)
    seen = torch.stack(masks).sum(0)
    assert bool((seen >= 20).all())
    for i in range(M):  # the exact posterior of z_i: mean x_i / 2, sd 0.5 ** 0.5
        sd = 0.5 ** 0.5
        assert abs(pyro.param(f"m{i}").item() - X[i].item() / 2) < 0.15 * sd
        assert abs(pyro.param(f"s{i}").item() / sd - 1) < 0.25


def test_a_dropped_plan_has_its_deferred_checks_read():
    pyro.enable_validation(False)
    optim = NGVI()
    optim.sync_every = 1000  # (the host reads a plan's checks at get_state, or when the plan is dropped)
    svi = SVI(model, guide, optim, Trace_ELBO())
    size = MAX_PLANS + 1
    one_site = torch.eye(size, dtype=torch.bool)  # MAX_PLANS + 1 structures of one site each (checks deferred)
    data = torch.ones(size)
    for _ in range(3):
        svi.step(one_site[0], data)
    with pytest.warns(UserWarning):
        svi.step(one_site[0], torch.full((size,), float("nan")))  # a non-finite step, its check deferred
        assert optim.num_skipped_steps == 0
        for mask in one_site[1:]:  # MAX_PLANS new structures: the first plan dropped
            svi.step(mask, data)
    assert len(optim._plans) == MAX_PLANS
    assert optim.num_skipped_steps == 1 and optim.num_steps == 3 + MAX_PLANS
