"""
The steady step (issue 24, :mod:`pyro_ngvi.steady`): once the recipe's guide has started, NGVI
replays the chain's decisions instead of taking them again, with far fewer Python calls per
step, and gives the chain's steps to the bit. The reference: the same run with NGVI's state saved
and restored before every step (``set_state(get_state())``), which makes every step a step of the
chain (a new plan, no steady step to replay).
"""

import cProfile
import pstats
import re
import warnings

import pytest
import torch
from torch import nn

import pyro
from pyro.infer import SVI

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO


pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(source: str, widths=(16, 32, 32, 4), n=512, seed=0):
    """The README's recipe on a small MLP and a synthetic classification task."""
    pyro.clear_param_store()
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    bnn = BayesianNet(nn.Sequential(*layers[:-1]), "categorical", num_data=n)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, widths[0], generator=generator)
    y = (x @ torch.randn(widths[0], widths[-1], generator=generator)).argmax(-1)
    optim = NGVI()
    return SVI(bnn, bnn.guide(), optim, CurvatureELBO(source)), optim, x, y


def _run(source: str, steps: int, through_chain: bool):
    """``steps`` steps of 128 examples; a non-finite batch at step 7 (skipped), ``lr`` set at step 10
    (a setting changed between steady steps). ``through_chain``: NGVI's state saved and restored
    before each step (every step a step of the chain)."""
    svi, optim, x, y = _recipe(source)
    losses = []
    with pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            if through_chain:
                optim.set_state(optim.get_state())
            xb, yb = x[(step * 128) % 384:][:128], y[(step * 128) % 384:][:128]
            if step == 7:
                xb = xb.clone()
                xb[0, 0] = float("nan")
            if step == 10:
                optim.lr = 0.1
            losses.append(svi.step(xb, yb))
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    return params, losses, optim


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam"])
def test_steady_steps_are_the_chains_to_the_bit(source):
    params, losses, optim = _run(source, 14, through_chain=False)
    # (replayed: the plan holds its steady step, pyro_ngvi.steady.SteadyStep, which has run)
    assert any(getattr(getattr(plan, "steady", None), "records", None) is not None for plan in optim._plans.values())
    reference, reference_losses, chain = _run(source, 14, through_chain=True)
    assert all(plan.steady is None or plan.steady.records is None for plan in chain._plans.values())  # (none ran)
    assert (optim.num_steps, optim.num_skipped_steps) == (chain.num_steps, chain.num_skipped_steps) == (13, 1)
    assert list(map(repr, losses)) == list(map(repr, reference_losses))  # (to the bit: repr round-trips; nan at 7)
    for name, value in reference.items():
        assert torch.equal(params[name], value), name


def _calls_per_step(source: str, warmup: int = 5, steps: int = 5, sync=None, recipe=None) -> float:
    svi, optim, x, y = recipe(source) if recipe else _recipe(source, widths=(64, 100, 10), n=1437)
    optim.sync_every = sync
    with pyro.validation_enabled(False):
        for _ in range(warmup):
            svi.step(x[:128], y[:128])
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            svi.step(x[:128], y[:128])
        profiler.disable()
    return sum(v[1] for v in pstats.Stats(profiler).stats.values()) / steps


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam"])
def test_a_steady_step_of_the_recipe_makes_at_most_500_python_calls(source):
    # (a count, not a time: the same on any machine; the main demo's MLP. Before the steady step:
    # 820-850, against ivon-opt's 225; benchmarks/step_overhead.py)
    assert _calls_per_step(source) <= 500


def _regression(source: str, seed=0, n=512, batch_norm=False):
    """The Gaussian regression recipe (the noise scale learned: a point parameter beside the
    Gaussian sites, ``pyro.param("noise_scale")``); ``batch_norm``: a categorical MLP with a BatchNorm
    layer instead (its affine weights point parameters)."""
    pyro.clear_param_store()
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=generator)
    if batch_norm:
        net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        bnn = BayesianNet(net, "categorical", num_data=n)
        y = (x @ torch.randn(16, 4, generator=generator)).argmax(-1)
    else:
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        bnn = BayesianNet(net, "gaussian", num_data=n)
        y = torch.sin(x[:, 0] * 2) + 0.1 * torch.randn(n, generator=generator)
    optim = NGVI()
    return SVI(bnn, bnn.guide(), optim, CurvatureELBO(source)), optim, x, y


def _run_every_step_chained(source: str, steps: int, sync, steady: bool, nan_at=(7,), recipe=_recipe):
    """``steps`` steps of the recipe with the checks read every ``sync`` steps (``NGVI.sync_every``, the
    default on CUDA): non-finite batches at ``nan_at``, ``lr`` set at step 10. Unless ``steady``, the plans'
    steady steps are dropped before every step (each step a step of the chain, its deferred checks kept:
    ``set_state(get_state())`` would read them). Returns the params, losses, counts after every step and
    the warnings."""
    svi, optim, x, y = recipe(source)
    optim.sync_every = sync
    losses, counts, ran = [], [], False
    with pyro.validation_enabled(False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            for plan in optim._plans.values():
                ran = ran or getattr(getattr(plan, "steady", None), "records", None) is not None
                if not steady:
                    plan.steady = None
            xb, yb = x[(step * 128) % 384:][:128], y[(step * 128) % 384:][:128]
            if step in nan_at:
                xb = xb.clone()
                xb[0, 0] = float("nan")
            if step == 10:
                optim.lr = 0.1
            losses.append(svi.step(xb, yb))
            counts.append((optim.num_steps, optim.num_skipped_steps))
        state = optim.get_state()  # (reads the checks still deferred)
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    # (where they point: the same place; the names listed sorted: SVI hands NGVI its params as a set, so
    # the point parameters' order, which the skip warning follows, is the order of their ids in that run)
    caught = [(re.sub(r"at ('[^;]*);", lambda m: "at " + ", ".join(sorted(m.group(1).split(", "))) + ";",
                      str(w.message)), w.filename, w.lineno) for w in caught]
    return params, losses, counts, caught, state["ngvi"]["num_steps"], ran


@pytest.mark.parametrize("source,sync", [("ggn", 16), ("ef", 16), ("reparam", 16), ("ggn", 4)])
def test_steady_steps_with_deferred_checks_are_the_chains_to_the_bit(source, sync):
    # sync_every > 1: the default on CUDA (checks.SYNC_EVERY_CUDA); the NaN steps' masked writes
    # and their skips counted when read, 4 or 16 steps late, as the chain does
    params, losses, counts, caught, taken, ran = _run_every_step_chained(source, 22, sync, True, (7, 8))
    assert ran  # (the steady step ran)
    reference, ref_losses, ref_counts, ref_caught, ref_taken, ref_ran = _run_every_step_chained(
        source, 22, sync, False, (7, 8))
    assert not ref_ran
    assert counts == ref_counts and taken == ref_taken == 20
    assert any("steps late" in message for message, _, _ in ref_caught)
    assert caught == ref_caught
    assert list(map(repr, losses)) == list(map(repr, ref_losses))
    for name, value in reference.items():
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam"])
def test_a_steady_step_with_deferred_checks_makes_at_most_520_python_calls(source):
    # (checks read every 16 steps, the default on CUDA: 16 steps, one read among them. Before: 740-764,
    # every step through the chain; read at once: 415-439)
    assert _calls_per_step(source, steps=16, sync=16) <= 520


@pytest.mark.parametrize("source,sync,batch_norm", [("ggn", None, False), ("ef", None, False), ("reparam", None, False),
                                                   ("ggn", 16, False), ("ggn", None, True), ("ef", 16, True)])
def test_steady_steps_with_point_parameters_are_the_chains_to_the_bit(source, sync, batch_norm):
    # point parameters beside the Gaussian sites: the learned noise scale of the Gaussian recipe, a
    # BatchNorm's weights; the point optimizer steps as in the chain (its checks read at once, also
    # with sync_every > 1, as the chain reads them)
    def recipe(source):
        return _regression(source, batch_norm=batch_norm)

    params, losses, counts, caught, taken, ran = _run_every_step_chained(source, 16, sync, True, (7,), recipe)
    assert ran
    reference, ref_losses, ref_counts, ref_caught, ref_taken, ref_ran = _run_every_step_chained(
        source, 16, sync, False, (7,), recipe)
    assert not ref_ran
    assert counts == ref_counts and taken == ref_taken == 15
    assert any("non-finite" in message for message, _, _ in ref_caught)
    assert caught == ref_caught
    assert list(map(repr, losses)) == list(map(repr, ref_losses))
    assert ("noise_scale" in reference) != batch_norm and len(reference) == len(params)
    for name, value in reference.items():
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize("source,sync", [("ggn", None), ("ef", None), ("reparam", None), ("ggn", 16)])
def test_a_steady_step_of_the_gaussian_recipe_makes_at_most_800_python_calls(source, sync):
    # (the learned noise scale: Adam's step on it within the steady step. Before, every step through the
    # chain: 1084-1102 calls; now 731-746, of which Adam's step is ~300)
    assert _calls_per_step(source, steps=16, sync=sync, recipe=_regression) <= 800
