"""The prior scale and epoch of a BayesianNet chosen by a validation split (pyro_ngvi.nn.selection)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyro

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.nn.selection import _choose, log_predictive_densities, restore, select_by_validation, validation_nll


def classification(n=160, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    w = torch.randn(4, 3, generator=generator)
    y = (x @ w + 0.7 * torch.randn(n, 3, generator=generator)).argmax(-1)
    return x, y


def point_mass_guide(bnn, x, y, scale=1e-6):
    """The recipe's guide at the net's weights with standard deviations ``scale``: its predictive is the
    mean network's."""
    guide = bnn.guide(init_scale=scale)
    guide(x[:2], y[:2])
    return guide


@pytest.mark.parametrize("likelihood", ["categorical", "bernoulli", "gaussian"])
def test_validation_nll_of_a_point_mass_is_the_likelihood_of_the_mean_network(likelihood):
    pyro.clear_param_store()
    torch.manual_seed(0)
    x, y = classification()
    width = 3 if likelihood == "categorical" else 1
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, width))
    if likelihood == "bernoulli":
        y = (y == 0).float()
    if likelihood == "gaussian":
        y = x.sum(-1) + 0.3 * torch.randn(len(x))
    noise = 0.7 if likelihood == "gaussian" else None
    bnn = BayesianNet(net, likelihood, num_data=len(x), noise_scale=noise)
    guide = point_mass_guide(bnn, x, y)
    with torch.no_grad():
        f = net(x)
    if likelihood == "categorical":
        expected = F.cross_entropy(f, y)
    elif likelihood == "bernoulli":
        expected = F.binary_cross_entropy_with_logits(f.squeeze(-1), y)
    else:
        expected = -torch.distributions.Normal(f.squeeze(-1), noise).log_prob(y).mean()
    assert validation_nll(bnn, guide, x, y, num_samples=4) == pytest.approx(float(expected), rel=1e-4)


def test_validation_nll_averages_probabilities_not_log_probabilities():
    # two equally likely weight draws far apart: the mixture's NLL is below the mean NLL of the draws
    pyro.clear_param_store()
    torch.manual_seed(1)
    x, y = classification(40)
    net = nn.Sequential(nn.Linear(4, 3))
    bnn = BayesianNet(net, "categorical", num_data=len(x))
    guide = bnn.guide(init_scale=3.0)
    guide(x[:2], y[:2])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draws = pyro.infer.Predictive(bnn, guide=guide, num_samples=64, return_sites=("output",))(x)["output"]
    log_p = torch.distributions.Categorical(logits=draws).log_prob(y)  # (S, M)
    mixture = -(torch.logsumexp(log_p, 0) - math.log(64)).mean()
    assert validation_nll(bnn, guide, x, y, num_samples=64, seed=0) == pytest.approx(float(mixture), rel=1e-6)
    assert float(mixture) < float(-log_p.mean())


def test_selection_keeps_the_best_checkpoint_and_leaves_the_callers_state_alone():
    pyro.clear_param_store()
    torch.manual_seed(0)
    x, y = classification(200)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    initial = [p.detach().clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    chosen = select_by_validation(net, "categorical", x[:120], y[:120], x[120:], y[120:], epochs=8,
                                  prior_scales=(1.0, 0.05), checkpoints=4, batch_size=64, num_samples=8)
    # every checkpoint scored; the chosen one is within a standard error of the best, and the
    # param store holds that guide
    table = [(nll, scale, epoch) for scale, rows in chosen.scores.items() for epoch, nll in rows]
    assert [e for _, s, e in table if s == 1.0] == [2, 4, 6, 8]
    best = min(table)
    assert chosen.best_nll == best[0]
    assert (chosen.valid_nll, chosen.prior_scale, chosen.epoch) in table
    assert best[0] <= chosen.valid_nll < best[0] + 0.05
    assert validation_nll(chosen.bnn, chosen.guide, x[120:], y[120:], 8) == pytest.approx(chosen.valid_nll, rel=1e-6)
    assert chosen.bnn.prior(chosen.bnn.latent_sites[0])[1].item() == pytest.approx(chosen.prior_scale)
    # a prior of scale 0.05 on every weight cannot fit the data: it is not chosen
    assert chosen.prior_scale == 1.0
    assert min(n for n, s, _ in table if s == 0.05) > best[0] + 0.05
    # the caller's network and random state are untouched
    assert all(torch.equal(a, b) for a, b in zip(initial, net.parameters()))
    assert torch.equal(torch.get_rng_state(), rng)


def densities(nll, noise, m=400, seed=0):
    """Per-example log densities with mean -nll: a shared part plus ``noise`` of their own."""
    shared = torch.randn(m, generator=torch.Generator().manual_seed(99))
    own = torch.randn(m, generator=torch.Generator().manual_seed(seed))
    values = shared + noise * own
    return values - values.mean() - nll


def test_the_recipe_as_given_is_kept_unless_the_validation_split_says_clearly_otherwise():
    given = 1.0
    # a checkpoint of another prior better by 0.005 nats, within its paired standard error (0.5 / 20 = 0.025):
    # the given prior at its last epoch is kept
    kept = [(given, 10, densities(0.500, 0.5, seed=1)), (given, 20, densities(0.503, 0.5, seed=2)),
            (0.5, 20, densities(0.498, 0.5, seed=3))]
    chosen = _choose(kept, given)
    assert chosen[:2] == (given, 20) and chosen[-1] == pytest.approx(0.498)
    # better by 0.1 nats, 4 standard errors: that prior is chosen
    kept[2] = (0.5, 20, densities(0.40, 0.5, seed=3))
    assert _choose(kept, given)[:2] == (0.5, 20)
    # an earlier epoch of the given prior clearly better than its last: the earlier epoch
    kept = [(given, 10, densities(0.40, 0.1, seed=1)), (given, 20, densities(0.50, 0.1, seed=2))]
    assert _choose(kept, given)[:2] == (given, 10)
    # the standard error is of the paired difference: identical noise makes 0.005 nats a clear difference
    kept = [(given, 20, densities(0.505, 0.0, seed=1)), (0.5, 20, densities(0.500, 0.0, seed=1))]
    assert _choose(kept, given)[:2] == (0.5, 20)
    with pytest.raises(RuntimeError, match="diverged"):
        _choose([(given, 1, torch.full((4,), -math.inf))], given)


def test_log_predictive_densities_are_what_validation_nll_averages():
    pyro.clear_param_store()
    x, y = classification(30)
    bnn = BayesianNet(nn.Linear(4, 3), "categorical", num_data=30)
    guide = bnn.guide(init_scale=0.5)
    guide(x[:2], y[:2])
    values = log_predictive_densities(bnn, guide, x, y, 8, seed=3)
    assert values.shape == (30,)
    assert validation_nll(bnn, guide, x, y, 8, seed=3) == pytest.approx(-float(values.mean()), rel=1e-6)


def test_a_restored_checkpoint_is_what_the_store_and_the_guide_hold():
    pyro.clear_param_store()
    torch.manual_seed(0)
    x, y = classification(64)
    bnn = BayesianNet(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "categorical", num_data=64)
    guide = bnn.guide()
    svi = pyro.infer.SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    svi.step(x, y)
    store = pyro.get_param_store()
    state = store.get_state()
    checkpoint = {name: value.detach().clone() for name, value in state["params"].items()}
    kept = {site: [t.detach().clone() for t in guide._get_loc_and_scale(site)] for site in bnn.latent_sites}
    before = validation_nll(bnn, guide, x, y, 8)
    for _ in range(5):
        svi.step(x, y)
    moved = {site: guide._get_loc_and_scale(site)[0].detach().clone() for site in bnn.latent_sites}
    assert not all(torch.equal(moved[s], kept[s][0]) for s in kept)
    restore(guide, checkpoint, state["constraints"], x[:1], y[:1])
    for site, (loc, scale) in kept.items():
        now = guide._get_loc_and_scale(site)  # the module's attributes, read outside a run
        torch.testing.assert_close(now[0], loc, rtol=0, atol=0)
        torch.testing.assert_close(now[1], scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(store[f"AutoNormal.locs.{site}"], loc, rtol=0, atol=0)
    assert validation_nll(bnn, guide, x, y, 8) == pytest.approx(before, rel=1e-6)


def test_default_candidates_are_the_given_prior_and_maps_weight_decays_per_datum():
    pyro.clear_param_store()
    x, y = classification(100)
    net = nn.Sequential(nn.Linear(4, 3))
    chosen = select_by_validation(net, "categorical", x[:50], y[:50], x[50:], y[50:], epochs=1, prior=2.0,
                                   num_samples=2)
    expected = [2.0] + [(rate * 50) ** -0.5 for rate in (1e-4, 1e-3, 1e-2)]
    assert list(chosen.scores) == pytest.approx(expected)


@pytest.mark.parametrize("name, value", [("epochs", 0), ("checkpoints", 0), ("batch_size", -1), ("epochs", 2.5),
                                         ("prior_scales", (1.0, -1.0)), ("prior_scales", ()),
                                         ("prior", -1.0), ("prior", float("nan")), ("prior", True),
                                         ("prior_scales", 0.5), ("prior_scales", "ab"), ("prior_scales", None),
                                         ("seed", "a"), ("seed", 1.5), ("seed", -1), ("num_samples", 0)])
def test_bad_arguments_are_refused_with_their_name(name, value):
    if name == "prior_scales" and value is None:  # (None is the default: given candidates of bad types)
        value = [1.0, "2"]
    x, y = classification(40)
    kwargs = dict(epochs=1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20], x[20:], y[20:], **kwargs)


def test_a_validation_split_without_matching_targets_is_refused():
    x, y = classification(40)
    with pytest.raises(ValueError, match="x_valid"):
        select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20], x[20:], y[21:], epochs=1)
    for short, long in ((x[:20], y[:19]), (x[:20], y[:21])):  # (a bare IndexError, or a silent truncation)
        with pytest.raises(ValueError, match="x and y must be non-empty and of one length"):
            select_by_validation(nn.Linear(4, 3), "categorical", short, long, x[20:], y[20:], epochs=1)
    # targets the likelihood refuses are refused before the first candidate trains (and named)
    with pytest.raises(ValueError, match="x_valid and y_valid.*class indices"):
        select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20], x[20:], y[20:] + 5, epochs=10 ** 6)
    with pytest.raises(ValueError, match="x and y.*shape"):
        select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20, None], x[20:], y[20:], epochs=10 ** 6)
    # inputs of another width than the net's raised torch's bare RuntimeError ("mat1 and mat2 shapes
    # cannot be multiplied"), naming neither argument
    with pytest.raises(ValueError, match="x_valid and y_valid: mat1 and mat2"):
        select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20], x[20:, :3], y[20:], epochs=10 ** 6)
    bnn = BayesianNet(nn.Linear(4, 3), "categorical", num_data=20)
    with pytest.raises(ValueError, match="num_samples"):
        validation_nll(bnn, bnn.guide(), x, y, num_samples=0)


def test_a_bad_prior_beside_given_candidates_and_non_finite_training_data_are_refused():
    """``prior`` went unchecked where ``prior_scales`` were given (nan, -1, 'a' trained as if
    valid), and a training split of inf targets (a Gaussian likelihood's support takes them) trained
    every candidate on steps all skipped, returning the untrained guide; both are refused, named,
    before any training."""
    x, y = classification(40)
    for prior in (float("nan"), -1.0, "a", None):
        with pytest.raises(ValueError, match="prior must be"):
            select_by_validation(nn.Linear(4, 3), "categorical", x[:20], y[:20], x[20:], y[20:],
                                 epochs=1, prior_scales=[1.0], prior=prior)
    targets = torch.randn(40, generator=torch.Generator().manual_seed(0))
    for bad in (float("inf"), float("nan")):
        broken = targets.clone()
        broken[3] = bad
        with pytest.raises(ValueError, match="x and y must be finite"):
            select_by_validation(nn.Linear(4, 1), "gaussian", x[:20], broken[:20], x[20:], targets[20:],
                                 epochs=1, noise_scale=1.0)
        inputs = x.clone()
        inputs[5, 1] = bad
        with pytest.raises(ValueError, match="x and y must be finite"):
            select_by_validation(nn.Linear(4, 3), "categorical", inputs[:20], y[:20], x[20:], y[20:], epochs=1)
