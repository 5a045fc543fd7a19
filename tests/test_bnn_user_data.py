"""What a user applying the documented BNN recipe to data sets of their own ran into: raw
(unstandardised) features and regression targets, on which the recipe diverges with advice about
lr and damping, and predictions with BatchNorm left in training mode."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from sklearn.datasets import load_breast_cancer, load_diabetes

import pyro
from pyro.infer import SVI, Predictive

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, NGVIWarning
from pyro_ngvi.nn.checks import UNIT_SCALE_LIMIT


@pytest.fixture(autouse=True)
def clean_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def standardised(a):
    return (a - a.mean(0)) / a.std(0)


def train(x, y, likelihood, epochs=1, batch_size=64, source="ggn", out=1):
    """The documented recipe; returns the net, its guide and every warning raised."""
    pyro.set_rng_seed(0)
    net = nn.Sequential(nn.Linear(x.shape[1], 32), nn.ReLU(), nn.Linear(32, out))
    bnn = BayesianNet(net, likelihood, num_data=len(x))
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), loss=CurvatureELBO(source))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for batch in torch.arange(len(x)).split(batch_size):
                svi.step(x[batch], y[batch])
    return bnn, guide, [w for w in caught if issubclass(w.category, NGVIWarning)]


def training_accuracy(bnn, guide, x, y):
    logits = Predictive(bnn, guide=guide, num_samples=8, return_sites=["output"])(x)["output"]
    return ((torch.sigmoid(logits).mean(0) > 0.5).float() == y).float().mean().item()


def scale_warnings(caught):
    return [str(w.message) for w in caught if "standardised data" in str(w.message)]


def test_raw_features_are_named_at_the_first_batch_and_the_recipe_diverges_on_them():
    """Breast cancer's raw features (up to 2,500) sent the recipe's means to a root mean square of
    ~250 within a few steps (test accuracy 0.63, the majority class's share; MAP 0.93) with only a warning to lower lr or raise
    damping; the net now says at the first batch which data are far from standardised, by how much
    (the largest feature's root mean square over the batch, here recomputed with numpy)."""
    x_np, y_np = load_breast_cancer(return_X_y=True)
    x, y = torch.tensor(x_np, dtype=torch.float32), torch.tensor(y_np, dtype=torch.float32)
    bnn, guide, caught = train(x, y, "bernoulli", epochs=2)
    (message,) = scale_warnings(caught)
    expected = np.sqrt((x_np[:64] ** 2).mean(0)).max()
    assert expected > 100 * UNIT_SCALE_LIMIT
    assert f"inputs x of root mean square {expected:.3g}" in message and "targets y of" not in message
    majority = max(y.mean().item(), 1 - y.mean().item())  # 0.627: one class for every example
    assert training_accuracy(bnn, guide, x, y) < majority + 0.01  # what the warning is for

    pyro.clear_param_store()
    bnn, guide, caught = train(standardised(x), y, "bernoulli", epochs=2)
    assert caught == []  # standardised: nothing to say, and the recipe fits
    assert training_accuracy(bnn, guide, standardised(x), y) > 0.9  # (0.92 after 18 steps)


def test_raw_regression_targets_are_named_at_the_first_batch():
    """Diabetes' raw targets (25-346) with standardised features: the recipe's first steps threw the
    means to 1e15 and raised 'NGVI skipped the last 50 steps in a row ... start again with a smaller
    lr or more damping'; the net now warns at the first batch, naming the targets' root mean square,
    and the error names standardised data with the recipe."""
    x_np, y_np = load_diabetes(return_X_y=True)
    x = torch.tensor(standardised(x_np), dtype=torch.float32)
    y = torch.tensor(y_np, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyro.set_rng_seed(0)
        bnn = BayesianNet(nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 1)), "gaussian", len(x))
        svi = SVI(bnn, bnn.guide(), NGVI(), loss=CurvatureELBO("ggn"))
        with pytest.warns(NGVIWarning, match="standardised data") as record:
            svi.step(x[:32], y[:32])
    (message,) = [str(w.message) for w in record if "standardised data" in str(w.message)]
    expected = np.sqrt((y_np[:32] ** 2).mean())
    assert f"targets y of root mean square {expected:.3g}" in message and "inputs x of" not in message
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="skipped the last 50 steps") as stuck:
        warnings.simplefilter("ignore")
        for step in range(1, 60):  # diverged by step 5, 50 skips in a row raise at step 55
            svi.step(x[step * 32 % 416:][:32], y[step * 32 % 416:][:32])
    assert "bnn.guide() on standardised inputs and Gaussian targets" in str(stuck.value)

    pyro.clear_param_store()
    _, _, caught = train(x, torch.tensor(standardised(y_np), dtype=torch.float32), "gaussian", epochs=2)
    assert caught == []


@pytest.mark.parametrize("factor", [5.0, 20.0])
def test_the_scale_warning_is_one_per_net_and_follows_its_limit(factor):
    """Standardised features times 5 (root mean square 5, below the limit of 10) pass; times 20
    warn once however many batches follow; 0/1 Bernoulli and integer class targets are not
    scored."""
    generator = torch.Generator().manual_seed(0)
    x = standardised(torch.randn(128, 3, generator=generator, dtype=torch.float64)).float() * factor
    y = (x[:, 0] > 0).float()
    for likelihood, target, out in (("bernoulli", y, 1), ("categorical", y.long(), 2)):
        pyro.clear_param_store()
        _, _, caught = train(x, target, likelihood, epochs=2, batch_size=128, source="ef", out=out)
        found = scale_warnings(caught)
        rms = x.double().pow(2).mean(0).sqrt().max().item()
        assert len(found) == (1 if rms > UNIT_SCALE_LIMIT else 0), (rms, found)


def test_predicting_with_batch_norm_in_training_mode_warns_once_and_eval_mode_does_not():
    """Predictive on a BatchNorm net left in training mode normalised each test batch by its own
    statistics (one example's class probabilities moved by up to 0.58 with the rest of its batch) and
    wrote the test data into the running statistics (eval-mode accuracy on digits 0.97 -> 0.89),
    silently, and the docs did not say to call eval(); the net now warns once."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    bnn = BayesianNet(net, "categorical", num_data=len(x))
    guide = bnn.guide()
    SVI(bnn, guide, NGVI(), loss=CurvatureELBO("ef")).step(x, y)
    before = net[1].running_mean.clone()
    predictive = Predictive(bnn, guide=guide, num_samples=2, return_sites=["output"])
    with pytest.warns(NGVIWarning, match=r"bnn.eval\(\) before predicting") as record:
        predictive(x + 3.0)
    assert len(record) == 1  # once, though the model ran once per sample
    assert not torch.equal(net[1].running_mean, before)  # what it warns of: test data in the statistics
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        predictive(x)  # warned once per net
        bnn.eval()
        after = net[1].running_mean.clone()
        fresh = BayesianNet(net, "categorical", num_data=len(x))
        Predictive(fresh, guide=guide, num_samples=2, return_sites=["output"])(x + 3.0)
        assert torch.equal(net[1].running_mean, after)  # eval mode: statistics untouched, no warning


def test_a_nan_in_one_example_skips_exactly_its_minibatches_and_the_warning_names_the_data():
    """One NaN feature in 64 examples: every minibatch holding it is skipped and the others train,
    so the run never makes the 50 skips in a row that raise; the skip warning said only 'non-finite
    gradient or curvature at <every site>'. It now names the data as a cause."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=generator)
    y = (x[:, 0] > 0).float()
    x[37, 1] = float("nan")
    pyro.set_rng_seed(0)
    bnn = BayesianNet(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), "bernoulli", num_data=len(x))
    optim = NGVI()
    svi = SVI(bnn, bnn.guide(), optim, loss=CurvatureELBO("ef"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for batch in torch.arange(len(x)).split(16):
                svi.step(x[batch], y[batch])
    assert (optim.num_steps, optim.num_skipped_steps) == (9, 3)  # batch 32:48 of each epoch
    skips = [str(w.message) for w in caught if "skipped step" in str(w.message)]
    assert len(skips) == 2  # at the 1st and 2nd skip
    assert all("A NaN or inf in the data" in message for message in skips)


@pytest.mark.parametrize("likelihood", ["bernoulli", "gaussian"])
def test_targets_of_shape_b_1_for_one_output_unit_name_the_networks_own_output_on_either_path(likelihood):
    """Targets (B, 1) for a net of one output unit: the model's path said 'for a network output of
    shape (8,)', the squeezed parameter, though the network returned (8, 1); both paths now give the
    network's own shape and why (B,) is expected."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    y = (x[:, :1] > 0).float()
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    bnn = BayesianNet(net, likelihood, num_data=len(x))
    expected = (f"targets y of shape (8, 1) for a network output of shape {tuple(net(x).shape)}; expected (8,) "
                "(an output (B, 1) is one scalar per example)")
    with pytest.raises(ValueError) as model_path:
        bnn(x, y)
    assert expected in str(model_path.value)
    svi = SVI(bnn, bnn.guide(), NGVI(), loss=CurvatureELBO("ef"))
    svi.step(x, y[:, 0])  # traced once; the next steps take the fast path
    with pytest.raises(ValueError) as fast_path:
        svi.step(x, y)
    assert expected in str(fast_path.value)
