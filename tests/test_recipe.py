"""
The BayesianNet recipe (issue 19): NGVI's defaults resolved from what the
statistics say (full batch, or minibatch estimates for N examples), the guide's
data-relative start, the noise limit of the variational family; and the watches
that keep a run from failing silently (pyro_ngvi.monitor), each on a run built
to trigger it, and a healthy deep run that stays quiet.
"""

import math
import warnings

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, NGVIWarning, load_param_store
from pyro_ngvi import monitor
from pyro_ngvi.family import CURVATURE_PER_EXAMPLE, SiteCurvature, pop_curvature
from pyro_ngvi.chain import watch_elbo
from pyro_ngvi.optim import FULL_BATCH, MINIBATCH, defaults
from pyro_ngvi.plan import Plan


pytestmark = pytest.mark.usefixtures("one_thread")


def mlp(*widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def classification(n=1024, d=10, classes=4, seed=0):
    """Classes from a noisy linear map of Gaussian inputs."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator)
    w = torch.randn(d, classes, generator=generator)
    y = (x @ w + 0.5 * torch.randn(n, classes, generator=generator)).argmax(-1)
    return x, y


def train(svi, x, y, steps, batch=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        index = torch.randint(0, len(x), (batch,), generator=generator)
        losses.append(svi.step(x[index], y[index]))
    return losses


def accuracy(bnn, guide, x, y):
    with torch.no_grad():
        means = {site: pyro.param(f"{guide._pyro_name}.locs.{site}") for site in bnn.latent_sites}
        return float((torch.func.functional_call(bnn.net, means, (x,)).argmax(-1) == y).float().mean())


# ------------------------------------------------------------------ the defaults
def test_defaults_follow_the_kind_of_statistics():
    assert defaults() == FULL_BATCH
    resolved = defaults(500)
    assert (resolved.lr, resolved.beta, resolved.momentum) == (MINIBATCH.lr, MINIBATCH.beta, MINIBATCH.momentum)
    assert resolved.damping == 500 * CURVATURE_PER_EXAMPLE
    optim = NGVI(lr=0.2, damping=3.0)
    stats = SiteCurvature(torch.zeros(2), torch.zeros(2), num_data=500)
    assert optim._settings(stats, 0.2, None) == (0.2, MINIBATCH.beta, MINIBATCH.momentum, 3.0)
    assert optim._settings(SiteCurvature(torch.zeros(2), torch.zeros(2)), 0.2, None) == (
        0.2, FULL_BATCH.beta, FULL_BATCH.momentum, 3.0)


@pytest.mark.parametrize("source", ["ggn", "ef"])
def test_a_bayesian_net_step_follows_the_minibatch_recipe_elementwise(source):
    """One NGVI() step on a BayesianNet, against the update written out with the minibatch
    defaults: damping N, the warm start, the family's floor on the precision."""
    x, y = classification(n=64)
    bnn = BayesianNet(mlp(10, 8, 4).double(), "categorical", num_data=300)
    x = x.double()
    guide = bnn.guide()
    guide(x, y)
    loss = CurvatureELBO(source, deterministic=True)
    loss.loss_and_grads(bnn, guide, x, y)  # the statistics the step will see (at the mean)
    expected = {}
    lr, beta, _, damping = defaults(bnn.effective_num_data)
    for site in bnn.latent_sites:
        stats = pop_curvature(pyro.param(f"AutoNormal.locs.{site}").unconstrained())
        mu = pyro.param(f"AutoNormal.locs.{site}").detach()
        precision = pyro.param(f"AutoNormal.scales.{site}").detach() ** -2
        target = stats.curvature + stats.prior_precision
        new_precision = torch.where(target > precision, target, torch.lerp(precision, target, beta))
        new_precision = torch.maximum(new_precision, torch.tensor(bnn.max_scale(site) ** -2, dtype=torch.float64))
        step = (stats.grad + stats.prior_precision * (mu - stats.prior_loc)) / (new_precision + damping)
        expected[site] = (mu - lr * step, new_precision.rsqrt())
    SVI(bnn, guide, NGVI(), loss).step(x, y)
    for site, (mu, sigma) in expected.items():
        torch.testing.assert_close(pyro.param(f"AutoNormal.locs.{site}").detach(), mu, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(pyro.param(f"AutoNormal.scales.{site}").detach(), sigma, rtol=1e-9, atol=1e-12)


def test_the_traced_path_of_a_bayesian_net_hands_the_same_hints():
    """A source the fast path does not serve ("hessian") runs traced; the model's
    statistics_hints still reach NGVI: N, and the floor for sampled statistics only."""
    x, y = classification(n=16)
    bnn = BayesianNet(mlp(10, 6, 4).double(), "categorical", num_data=300)
    x = x.double()
    guide = bnn.guide()
    guide(x, y)
    for deterministic in (False, True):
        CurvatureELBO("hessian", deterministic=deterministic).loss_and_grads(bnn, guide, x, y)
        for site in bnn.latent_sites:
            stats = pop_curvature(pyro.param(f"AutoNormal.locs.{site}").unconstrained())
            assert stats.num_data == 300
            if deterministic:
                assert stats.min_precision is None
            else:
                torch.testing.assert_close(stats.min_precision,
                                           torch.full_like(stats.grad, bnn.max_scale(site) ** -2))


def test_traced_full_batch_steps_keep_their_own_defaults():
    """A model without a fast path hands full-batch statistics: NGVI() takes FULL_BATCH there."""
    x = torch.randn(20, dtype=torch.float64)

    def model(x):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=x)

    guide = AutoNormal(model)
    guide(x)
    elbo = CurvatureELBO("hessian", deterministic=True)
    elbo.loss_and_grads(model, guide, x)
    stats = pop_curvature(pyro.param("AutoNormal.locs.mu").unconstrained())
    assert stats.num_data is None and stats.min_precision is None
    mu = pyro.param("AutoNormal.locs.mu").detach()
    precision = pyro.param("AutoNormal.scales.mu").detach() ** -2
    target = stats.curvature + stats.prior_precision
    new_precision = torch.where(target > precision, target, torch.lerp(precision, target, FULL_BATCH.beta))
    new_mu = mu - FULL_BATCH.lr * (stats.grad + stats.prior_precision * mu) / new_precision
    SVI(model, guide, NGVI(), elbo).step(x)
    torch.testing.assert_close(pyro.param("AutoNormal.locs.mu").detach(), new_mu)


# ------------------------------------------------------------------ the guide and the noise limit
def test_guide_starts_at_the_network_with_a_data_relative_scale():
    net = mlp(10, 32, 32, 4)
    bnn = BayesianNet(net, "categorical", num_data=5000, prior=2.0)
    x, y = classification(n=8)
    guide = bnn.guide()
    guide(x, y)
    expected = (0.25 + 5000 * CURVATURE_PER_EXAMPLE) ** -0.5
    assert bnn.initial_scale() == pytest.approx(expected)
    for name, p in net.named_parameters():
        torch.testing.assert_close(pyro.param(f"AutoNormal.locs.{name}").detach(), p.detach())
        torch.testing.assert_close(pyro.param(f"AutoNormal.scales.{name}").detach(),
                                   torch.full_like(p, expected))
    small = BayesianNet(mlp(10, 32, 32, 4), "categorical", num_data=3)  # 1/sqrt(1 + 3) > the cap
    assert small.initial_scale() == pytest.approx(small.max_scale("4.weight"))


def test_noise_limit_caps_each_layer_by_its_fan_in_and_the_depth():
    bnn = BayesianNet(mlp(10, 32, 64, 4), "categorical", num_data=100, noise_limit=0.6)
    for site, fan_in in (("0.weight", 10), ("0.bias", 10), ("2.weight", 32), ("4.bias", 64)):
        assert bnn.max_scale(site) == pytest.approx(math.sqrt(0.6 / (3 * fan_in)))
    bnn.noise_limit = None
    assert bnn.max_scale("2.weight") is None and bnn._noise_floor() is None
    for bad in (0.0, -1.0, math.inf, "1"):
        with pytest.raises(ValueError, match="noise_limit"):
            BayesianNet(mlp(10, 4), "categorical", num_data=100, noise_limit=bad)


def test_training_keeps_every_scale_below_the_limit_and_without_it_they_pass_it():
    """Few data for many weights: the mean-field optimum puts most scales near the prior's
    (1), far above 1/sqrt(L n); the family's floor holds them at the limit."""
    x, y = classification(n=64)
    scales = {}
    for limit in (1.0, None):
        pyro.clear_param_store()
        bnn = BayesianNet(mlp(10, 64, 4), "categorical", num_data=64, noise_limit=limit)
        guide = bnn.guide()
        train(SVI(bnn, guide, NGVI(beta=0.2), CurvatureELBO("ggn")), x, y, 60, batch=64)
        scales[limit] = {site: pyro.param(f"AutoNormal.scales.{site}").detach() for site in bnn.latent_sites}
        if limit is not None:
            for site, scale in scales[limit].items():
                assert float(scale.max()) <= bnn.max_scale(site) * (1 + 1e-5)
                assert float(scale.max()) >= 0.99 * bnn.max_scale(site)  # the limit binds
    bnn.noise_limit = 1.0
    assert float(scales[None]["2.weight"].median()) > 3 * bnn.max_scale("2.weight")


def test_noise_limit_relative_to_the_means_keeps_each_weights_noise_below_its_own_mean():
    """noise_limit_mode="mean": sigma_ij^2 <= (v / L) max(mu_ij^2, 1 / n) at the means the step
    read (a bias: its unit's mean square weight), binding where the data leave the precision low;
    the weights larger than 1 / sqrt(n) get more noise than the fixed limit allows."""
    x, y = classification(n=64)
    bnn = BayesianNet(mlp(10, 64, 4), "categorical", num_data=64, noise_limit=0.8, noise_limit_mode="mean")
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(beta=0.2), CurvatureELBO("ggn"))
    train(svi, x, y, 30, batch=64)
    means = {site: pyro.param(f"AutoNormal.locs.{site}").detach().clone() for site in bnn.latent_sites}
    svi.step(x, y)  # its floor is the one of the means before it
    alpha, above_fixed = 0.8 / 2, 0
    for site in bnn.latent_sites:
        scale = pyro.param(f"AutoNormal.scales.{site}").detach()
        weight = means[site.replace("bias", "weight")]
        square = weight.square() if site.endswith("weight") else weight.square().mean(1)
        fan_in = weight.shape[1]
        bound = (alpha * square.clamp(min=1.0 / fan_in)).sqrt()
        assert bool((scale <= bound * (1 + 1e-5)).all()), site
        assert float((scale >= 0.99 * bound).double().mean()) > 0.5, site  # the limit binds for most
        above_fixed += int((scale > 1.01 * bnn.max_scale(site)).sum())
    assert above_fixed > 0
    watches = [plan.elbo_watch for plan in svi.optim._plans.values()]
    # not one family's ELBO: the watch is not fed (not even with SVI's loss)
    assert all(watch.count == 0 and watch.best is None for watch in watches)
    bnn.noise_limit_mode = "fan_in"
    svi.step(x, y)
    assert sum(watch.count for watch in watches) == 1  # (one family: watched)
    bnn.noise_limit_mode = "mean"
    with pytest.raises(ValueError, match="noise_limit_mode"):
        BayesianNet(mlp(10, 4), "categorical", num_data=100, noise_limit_mode="relative")
    with pytest.raises(NotImplementedError, match="fast path"):
        bnn.statistics_hints("0.weight")
    assert bnn.statistics_hints("0.weight", deterministic=True)["min_precision"] is None
    assert bnn.with_priors({}).noise_limit_mode == "mean"
    bnn.noise_limit_mode = "fan_in"
    assert float(bnn.statistics_hints("2.weight")["min_precision"].max()) == pytest.approx(2 * 64 / 0.8)


# ------------------------------------------------------------------ deep nets: every source, no damping by hand
DEEP = (10, 32, 32, 32, 32, 4)


@pytest.mark.parametrize("source", ["ggn", "ggn_mc", "ef", "reparam"])
def test_a_four_hidden_layer_mlp_trains_quietly_with_the_defaults(source):
    """Issue 19, item 4: NGVI() with every source on a 4-hidden-layer MLP, no hand-picked
    damping, 450 steps (the ELBO watch sees four windows); pytest turns any NGVIWarning into
    an error, so this run is also the quiet run of every watch."""
    x, y = classification(n=1000)
    bnn = BayesianNet(mlp(*DEEP), "categorical", num_data=len(x))
    guide = bnn.guide()
    optim = NGVI()
    losses = train(SVI(bnn, guide, optim, CurvatureELBO(source)), x, y, 450, batch=64)
    assert optim.num_skipped_steps == 0
    assert sum(losses[-50:]) < 0.8 * sum(losses[:50])
    assert accuracy(bnn, guide, x, y) > 0.85
    largest = max(float(pyro.param(f"AutoNormal.locs.{s}").detach().abs().max()) for s in bnn.latent_sites)
    assert largest < 10


# ------------------------------------------------------------------ the watches, each on a run built to trigger it
def test_means_growing_without_bound_warn_once_then_a_stuck_guide_raises():
    """The failure of issue 19: Gauss-Newton curvature with no damping on a deep net (the old
    recipe without its hand-picked damping, at large steps). The means explode within a few
    steps, the watch says so once, then every draw is non-finite and NGVI raises."""
    x, y = classification(n=2000)
    bnn = BayesianNet(mlp(10, 64, 64, 64, 64, 4), "categorical", num_data=len(x))
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.1)
    optim = NGVI(lr=1.0, beta=0.5, momentum=0.0, damping=0.0)
    svi = SVI(bnn, guide, optim, CurvatureELBO("ggn"))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="in a row"):
        warnings.simplefilter("always")
        train(svi, x, y, 400)
    messages = [str(w.message) for w in caught if issubclass(w.category, NGVIWarning)]
    growing = [m for m in messages if "grow without bound" in m]
    skipped = [m for m in messages if "skipped step" in m]
    assert len(growing) == 1 and messages.index(growing[0]) == 0  # before the first skipped step
    assert "damping" in growing[0]
    assert len(skipped) == int(math.log2(monitor.SKIPS_IN_A_ROW - 1)) + 1  # at 1, 2, 4, ... only
    assert optim.num_skipped_steps == monitor.SKIPS_IN_A_ROW


def test_a_guide_that_can_only_predict_non_finite_values_raises():
    x, y = classification(n=256)
    bnn = BayesianNet(mlp(10, 16, 4), "categorical", num_data=len(x))
    guide = bnn.guide()
    optim = NGVI()
    svi = SVI(bnn, guide, optim, CurvatureELBO("ef"))
    train(svi, x, y, 3)
    with torch.no_grad():
        pyro.param("AutoNormal.locs.2.weight").unconstrained().fill_(1e30)  # finite, overflows the logits
    before = pyro.param("AutoNormal.locs.0.weight").detach().clone()
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError) as error:
        warnings.simplefilter("always")
        train(svi, x, y, 100)
    assert "skipped the last 50 steps in a row" in str(error.value) and "1e+30" in str(error.value)
    assert "funnel" in str(error.value) and "num_particles=8" in str(error.value)  # (the remedy where one draw cannot follow)
    assert len([w for w in caught if "skipped step" in str(w.message)]) == 6  # 1, 2, 4, 8, 16, 32
    torch.testing.assert_close(pyro.param("AutoNormal.locs.0.weight").detach(), before)


def test_a_training_elbo_that_keeps_getting_worse_warns_once():
    """Targets that get noisier with every step: the model cannot follow and the negative
    ELBO rises window after window. The watch warns once (and the means stay finite and
    near the prior, so nothing else warns)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 5, generator=generator)
    w = torch.randn(5, 1, generator=generator)
    bnn = BayesianNet(nn.Linear(5, 1), "gaussian", num_data=256, noise_scale=1.0)
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(800):
            index = torch.randint(0, 256, (64,), generator=generator)
            noise = (1 + step / 100) * torch.randn(64, generator=generator)
            svi.step(x[index], (x[index] @ w).squeeze(-1) + noise)
    messages = [str(w.message) for w in caught if issubclass(w.category, NGVIWarning)]
    assert len(messages) == 1 and "training ELBO has got worse" in messages[0]


def test_a_stationary_noisy_elbo_never_warns():
    """The same regression with steady targets, many windows: minibatch noise alone does not
    set the ELBO watch off (pytest turns a warning into an error)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 5, generator=generator)
    y = (x @ torch.randn(5, generator=generator)) + torch.randn(256, generator=generator)
    bnn = BayesianNet(nn.Linear(5, 1), "gaussian", num_data=256, noise_scale=1.0)
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("reparam"))
    train(svi, x, y, 2000, batch=16, seed=1)


def test_the_watches_ignore_a_tempered_objective():
    """At tau != 1 the handed loss is not the objective (the watch restarts)."""
    plan = Plan([], [])
    watch_elbo(plan, {"s": SiteCurvature(torch.zeros(1), torch.zeros(1), loss=torch.tensor(1.0))}, 0.5, None)
    assert plan.elbo_watch.count == 0
    watch = monitor.ElboWatch()
    flags = [watch.add(100.0 + k // monitor.ELBO_WINDOW) for k in range(4 * monitor.ELBO_WINDOW)]
    assert [f is not None and bool(f) for f in flags] == [False] * (4 * monitor.ELBO_WINDOW - 1) + [True]
    assert watch.message(1) and watch.message(2) is None  # once


def test_the_elbo_watch_reports_a_blow_up_at_once_and_not_noise():
    """A window mean above the best window's by more than its sd plus its size is reported at that
    window (the three-rises test would wait two more); a stationary noisy loss never is."""
    noise = torch.randn(20 * monitor.ELBO_WINDOW, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    steady = monitor.ElboWatch()
    assert not any(steady.add(1.0 + 30.0 * float(e)) for e in noise)  # (sd 30 around 1: windows far apart)
    watch = monitor.ElboWatch()
    losses = [50.0 + float(e) for e in noise[: 2 * monitor.ELBO_WINDOW]] + [200.0] * monitor.ELBO_WINDOW
    flags = [watch.add(loss) for loss in losses]
    assert [bool(f) for f in flags if f is not None] == [False, False, True]  # (the first: a loss not finite)
    message = watch.message(300)
    assert "(49.9804, 49.8476, 200; the best 4" in message


def test_a_run_that_blows_up_under_pyro_s_own_loss_warns():
    """Under Trace_ELBO the watch reads the loss SVI.step computed (it was fed by CurvatureELBO only).
    Constant Jacobi steps (lr = 1, no averaging, no trust region) on a correlated regression blow
    up within the first window (loss 6.8e3, then 2e13 from step ~100): warned at step 200 (the first
    step's loss counts as a best); NGVI() on the same model converges and stays quiet."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(200, 8, generator=generator)
    x = base + 2.0 * base[:, :1]
    y = x @ torch.randn(8, generator=generator) + 0.5 * torch.randn(200, generator=generator)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(8), 1.0).to_event(1))
        with pyro.plate("data", 200):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    for optim, warns in ((NGVI(lr=1.0, beta=0.5, averaging=False, max_step=None), True), (NGVI(), False)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, AutoNormal(model), optim, Trace_ELBO())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [svi.step(x, y) for _ in range(300)]
        messages = [str(w.message) for w in caught if issubclass(w.category, NGVIWarning)]
        assert any("training ELBO has got worse up to step 200" in m for m in messages) == warns, messages
        assert (losses[-1] > 1e10) == warns


# ------------------------------------------------------------------ probes of the recipe's surface
def test_recipe_arguments_set_later_and_given_to_the_guide_are_checked():
    bnn = BayesianNet(mlp(10, 8, 4), "categorical", num_data=100)
    for bad in ("no", 1, None):  # "no" would have switched the learned prior on
        with pytest.raises(ValueError, match="learn_prior"):
            bnn.learn_prior = bad
    for bad in (-1.0, 0.0, math.inf, "2"):
        with pytest.raises(ValueError, match="augmentation_factor"):
            bnn.augmentation_factor = bad
    assert bnn.learn_prior is False and bnn.effective_num_data == 100
    bnn.augmentation_factor = 2.5
    assert bnn.effective_num_data == 250
    for bad in (0.0, -1.0, math.inf, math.nan, "0.1"):
        with pytest.raises(ValueError, match="init_scale"):
            bnn.guide(init_scale=bad)
    x, y = classification(n=4)
    guide = bnn.guide(init_scale=1, init_loc_fn=lambda site: torch.zeros(site["fn"].shape()))
    guide(x, y)  # an int scale is a scale; an init_loc_fn given replaces the network's
    assert float(pyro.param("AutoNormal.scales.0.weight").detach().max()) == pytest.approx(1.0)
    assert float(pyro.param("AutoNormal.locs.0.weight").detach().abs().max()) == 0.0
    for method in (bnn.max_scale, bnn.prior):
        with pytest.raises(ValueError, match="'nope' is not a latent site"):
            method("nope")
    assert bnn.statistics_hints("nope") == {}  # another part of a bigger model: nothing to say
    for bad in (0, -5, 2.5, "a", True):
        with pytest.raises(ValueError, match="num_data"):
            defaults(bad)


def wrapped(bnn, kind):
    if kind == "lambda":
        return lambda x, y=None: bnn(x, y)

    def bigger(x, y=None):  # the net and another latent
        pyro.sample("temperature", dist.LogNormal(0.0, 0.1))
        return bnn(x, y)
    return bigger


@pytest.mark.parametrize("kind", ["lambda", "bigger"])
def test_a_net_inside_another_model_warns_that_it_loses_the_recipe_until_given_its_hints(kind):
    """Wrapped, the ELBO sees the outer model, which has no statistics_hints: NGVI() took its
    full-batch defaults (no damping) and the noise limit was lost, and the run diverged
    (accuracy 0.25, 50 skipped steps) with no word on why. Now the net says so, once; with
    the net's hints given to the outer model the run follows the recipe, quietly."""
    x, y = classification(n=512)
    bnn = BayesianNet(mlp(10, 16, 4), "categorical", num_data=len(x))
    model = wrapped(bnn, kind)
    guide = AutoNormal(model, init_loc_fn=bnn.init_loc_fn, init_scale=bnn.initial_scale())
    svi = SVI(model, guide, NGVI(), CurvatureELBO("ggn"))
    with pytest.warns(NGVIWarning, match="runs inside another model") as caught:
        train(svi, x, y, 3, batch=64)
    lost = [str(w.message) for w in caught if "inside another model" in str(w.message)]
    assert len(lost) == 1 and "statistics_hints" in lost[0] and "noise limit" in lost[0]

    pyro.clear_param_store()
    bnn = BayesianNet(mlp(10, 16, 4), "categorical", num_data=len(x))
    model = wrapped(bnn, kind)
    model.statistics_hints = bnn.statistics_hints
    guide = AutoNormal(model, init_loc_fn=bnn.init_loc_fn, init_scale=bnn.initial_scale())
    train(SVI(model, guide, NGVI(), CurvatureELBO("ggn")), x, y, 60, batch=64)  # quiet
    for site in bnn.latent_sites:  # the noise limit holds
        assert float(pyro.param(f"AutoNormal.scales.{site}").detach().max()) <= bnn.max_scale(site) * (1 + 1e-5)
    assert accuracy(bnn, guide, x, y) > 0.7  # chance 0.25, as the run without the hints ended


def test_no_warning_where_nothing_is_lost():
    """The bare net, Trace_ELBO (which reads no hints) and a wrapper whose every setting was given
    with no noise limit stay quiet (pytest turns warnings into errors)."""
    x, y = classification(n=256)
    bnn = BayesianNet(mlp(10, 8, 4), "categorical", num_data=len(x))
    train(SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ggn")), x, y, 2, batch=64)
    model = wrapped(bnn, "lambda")
    train(SVI(model, AutoNormal(model), NGVI(), Trace_ELBO()), x, y, 2, batch=64)
    pyro.clear_param_store()
    bnn.noise_limit = None
    explicit = NGVI(lr=0.3, beta=0.01, momentum=0.9, damping=256.0)
    train(SVI(model, AutoNormal(model), explicit, CurvatureELBO("ggn")), x, y, 2, batch=64)


def test_a_net_with_a_learned_prior_resumes_from_a_saved_param_store(tmp_path):
    """A loaded param store holds unpickled copies of constraints.positive, not the singleton:
    the learned prior scales were refused ("a learned prior scale of a BayesianNet is a positive
    param") at the first step after resuming. Now the resumed run is bit-identical."""
    x, y = classification(n=256)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(x), (64,), generator=generator) for _ in range(8)]

    def run(resume):
        pyro.clear_param_store()
        torch.manual_seed(0)
        bnn = BayesianNet(mlp(10, 8, 4), "categorical", num_data=len(x), learn_prior=True)
        guide, optim = bnn.guide(), NGVI()
        svi = SVI(bnn, guide, optim, CurvatureELBO("ef"))
        for k, index in enumerate(batches):
            if k == 4 and not resume:
                pyro.get_param_store().save(tmp_path / "params.pt")
                optim.save(tmp_path / "optim.pt")
                torch.save(torch.get_rng_state(), tmp_path / "rng.pt")
            if k == 4 and resume:
                pyro.clear_param_store()
                bnn = BayesianNet(mlp(10, 8, 4), "categorical", num_data=len(x), learn_prior=True)
                guide, optim = bnn.guide(), NGVI()
                load_param_store(tmp_path / "params.pt")
                guide(x[:2], y[:2])  # set the guide up before restoring the RNG: its first run samples
                optim.load(tmp_path / "optim.pt")
                torch.set_rng_state(torch.load(tmp_path / "rng.pt"))
                svi = SVI(bnn, guide, optim, CurvatureELBO("ef"))
            svi.step(x[index], y[index])
        return {name: value.detach().clone() for name, value in pyro.get_param_store().items()}

    uninterrupted, resumed = run(False), run(True)
    assert set(uninterrupted) == set(resumed) and "0.weight.prior_scale" in resumed
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_the_share_at_the_noise_limit_is_that_of_the_guide_s_scales():
    """share_at_noise_limit counts the weights whose sigma is at sqrt(v / (L n)) (within the
    tolerance), against the guide's scales read by hand; nan without a limit; bad tolerance named."""
    x, y = classification(n=64)
    bnn = BayesianNet(mlp(10, 16, 4), "categorical", num_data=64)
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    shares = []
    for steps in (1, 300):
        train(svi, x, y, steps, batch=64)
        at = total = 0
        for site in bnn.latent_sites:
            scale, cap = guide._get_loc_and_scale(site)[1].detach(), bnn.max_scale(site)
            if cap is not None:
                at, total = at + int((scale >= 0.99 * cap).sum()), total + scale.numel()
        shares.append(bnn.share_at_noise_limit(guide))
        assert shares[-1] == pytest.approx(at / total, abs=1e-12)
    assert shares[0] < 0.5 < shares[1]  # (64 examples: the cap binds after some training)
    assert bnn.share_at_noise_limit(guide, tolerance=0.5) >= shares[1]
    for bad in (0.0, -0.1, math.nan, "0.1"):
        with pytest.raises(ValueError, match="tolerance"):
            bnn.share_at_noise_limit(guide, tolerance=bad)
    bnn.noise_limit = None
    assert math.isnan(bnn.share_at_noise_limit(guide))
