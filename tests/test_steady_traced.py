"""
The steady step on the plain Pyro user's path (:mod:`pyro_ngvi.steady`'s traced path): ``AutoNormal``,
``Trace_ELBO``, ``NGVI()`` with its adaptive steps and control variate. Past the second step every
decision of the chain is the step before's (the stall test has its signs, every site has started),
so NGVI replays them and recovers only the statistics anew; its steps are the chain's to the bit.
The reference: the same run with the plan's steady step cleared before every step (every step a step
of the chain), a non-finite step skipped at step 9 and ``lr`` set at step 14.
"""

import cProfile
import pstats
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(kind: str):
    """One vectorised site of 100 (no cross terms: more than CROSS_MAX elements), or nested plates
    (three sites of 1, 20 and 200: a group of one and a gathered group)."""
    y = torch.randn(5, 10, 20, generator=torch.Generator().manual_seed(0))

    def vecplate(bad=False):
        with pyro.plate("g", 100):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            obs = torch.full((100,), float("nan")) if bad else torch.ones(100)
            pyro.sample("x", dist.Normal(z, 1.0), obs=obs)

    def nested(bad=False):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("groups", 20, dim=-1):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
            with pyro.plate("items", 10, dim=-2):
                b = pyro.sample("b", dist.Normal(a, 1.0))
                with pyro.plate("replicates", 5, dim=-3):
                    pyro.sample("y", dist.Normal(b, 1.0), obs=y * float("nan") if bad else y)
    return vecplate if kind == "vecplate" else nested


def _run(kind: str, steps: int, through_chain: bool):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _model(kind)
    optim = NGVI()
    svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
    losses, steady = [], 0
    with pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            plans = list(optim._plans.values())
            steady += bool(plans and plans[0].steady is not None)
            if through_chain:
                for plan in plans:
                    plan.steady = None
            if step == 14:
                optim.lr = 0.3
            losses.append(svi.step(bad=step == 9))
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    return losses, params, optim.get_state(), optim.num_skipped_steps, steady


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("kind", ["vecplate", "nested"])
def test_steady_steps_of_the_traced_path_are_the_chains_to_the_bit(kind):
    ours, chained = _run(kind, 24, False), _run(kind, 24, True)
    assert ours[3] == chained[3] == 1  # the non-finite step skipped in both
    assert ours[4] >= 20  # a steady step ready before each step but the first (and the one after the skip)
    assert _equal(ours[0], chained[0])
    assert _equal(ours[1], chained[1])
    assert _equal(ours[2], chained[2])


def test_a_steady_step_of_the_traced_path_makes_fewer_python_calls():
    """NGVI's call at a steady step of ``vecplate`` against the chain's (cProfile counts)."""
    counts = []
    for chained in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = _model("vecplate")
        optim = NGVI()
        svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
        with pyro.validation_enabled(False):
            for _ in range(5):
                svi.step()
            profile = cProfile.Profile()
            for _ in range(5):
                if chained:
                    for plan in optim._plans.values():
                        plan.steady = None
                profile.enable()
                svi.step()
                profile.disable()
        counts.append(pstats.Stats(profile).total_calls / 5)
    assert counts[0] < 0.8 * counts[1], counts
