"""BayesianNet: the Pyro model it defines, and its fast path against autograd and Trace_ELBO."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal, biject_to, constraints
from torch.func import functional_call, grad, jacrev, vmap

import pyro
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO
from pyro_ngvi.family import pop_curvature
from pyro_ngvi.nn import BayesianNet

N, B, D_IN, HIDDEN = 20, 6, 4, 5
OUTPUTS = {"categorical": 3, "bernoulli": 1, "gaussian": 2}
NOISE = 0.7


@pytest.fixture(autouse=True)
def clean_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def make_data(likelihood, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    if likelihood == "categorical":
        y = torch.randint(0, OUTPUTS[likelihood], (B,))
    elif likelihood == "bernoulli":
        y = torch.randint(0, 2, (B,)).double()
    else:
        y = torch.randn(B, OUTPUTS[likelihood], dtype=torch.float64)
    return x, y


def make_bnn(likelihood, batch_norm=False, noise_scale=NOISE, prior=None, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(D_IN, HIDDEN)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(HIDDEN))
    layers += [nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS[likelihood])]
    net = nn.Sequential(*layers).double()
    if prior is None:  # per-element prior means and scales
        prior = {
            name: (0.3 * torch.randn_like(p), 0.5 + torch.rand_like(p))
            for name, p in net.named_parameters()
            if not name.startswith("1.") or not batch_norm
        }
    return BayesianNet(net, likelihood, num_data=N, prior=prior,
                       noise_scale=noise_scale if likelihood == "gaussian" else None)


def make_guide(bnn, x, y, seed=1):
    """An AutoNormal with random locs and scales, already set up (no RNG use later)."""
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn)
    guide(x, y)
    torch.manual_seed(seed)
    store = pyro.get_param_store()
    with torch.no_grad():
        for site in bnn.latent_sites:
            loc = store._params[f"AutoNormal.locs.{site}"]
            loc.add_(0.2 * torch.randn_like(loc))
            raw = store._params[f"AutoNormal.scales.{site}"]
            constraint = store._constraints[f"AutoNormal.scales.{site}"]
            raw.copy_(biject_to(constraint).inv(0.05 + 0.3 * torch.rand_like(raw)))
    return guide


def guide_loc_scale(bnn):
    store = pyro.get_param_store()
    return {
        s: (store[f"AutoNormal.locs.{s}"].detach(), store[f"AutoNormal.scales.{s}"].detach())
        for s in bnn.latent_sites
    }


def redraw(bnn, seed, deterministic=False):
    """The weights (and noises) curvature_step drew after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    weights, noises = {}, {}
    for site, (loc, scale) in guide_loc_scale(bnn).items():
        noises[site] = torch.zeros_like(loc) if deterministic else torch.randn_like(loc)
        weights[site] = loc + scale * noises[site]
    return weights, noises


def log_likelihood(likelihood, f, y, noise=NOISE):
    """log p(y_i | f_i) per example, from torch.distributions."""
    if likelihood == "categorical":
        return Categorical(logits=f).log_prob(y)
    if likelihood == "bernoulli":
        return Bernoulli(logits=f.squeeze(-1)).log_prob(y)
    return Normal(f, noise).log_prob(y.reshape(f.shape)).sum(-1)


def output_hessian(likelihood, f, noise=NOISE):
    """Hessian of -log p(y | f) in f, per example: (B, K, K)."""
    if likelihood == "categorical":
        p = f.softmax(-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    if likelihood == "bernoulli":
        p = f.sigmoid()
        return (p * (1 - p)).unsqueeze(-1)
    return torch.eye(f.shape[-1], dtype=f.dtype).expand(len(f), -1, -1) / noise**2


# ----------------------------------------------------------------- the model


@pytest.mark.parametrize("likelihood", list(OUTPUTS))
def test_model_log_density_is_prior_plus_scaled_likelihood(likelihood):
    bnn = make_bnn(likelihood)
    x, y = make_data(likelihood)
    torch.manual_seed(3)
    weights = {name: torch.randn_like(p) for name, p in bnn.net.named_parameters()}
    trace = poutine.trace(poutine.condition(bnn, data=weights)).get_trace(x, y)
    expected = sum(
        Normal(*bnn.prior(name)).log_prob(w).sum() for name, w in weights.items()
    ) + N / B * log_likelihood(likelihood, functional_call(bnn.net, weights, (x,)), y).sum()
    assert torch.allclose(trace.log_prob_sum(), expected, rtol=1e-12)
    assert set(bnn.latent_sites) == set(weights)


def test_set_prior_replaces_the_prior_the_model_and_the_fast_path_use():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    bnn = BayesianNet(net, "bernoulli", num_data=10)
    x, y = torch.randn(5, 3), torch.ones(5)
    bnn._weight_prior()  # the cached views of the old prior
    bnn.set_prior({"0.weight": 0.5, "0.bias": 0.5, "2.weight": 2.0, "2.bias": 3.0})
    trace = poutine.trace(bnn).get_trace(x, y)
    for site, scale in {"0.weight": 0.5, "0.bias": 0.5, "2.weight": 2.0, "2.bias": 3.0}.items():
        assert float(bnn.prior(site)[1]) == scale
        value = trace.nodes[site]["value"]
        expected = Normal(0.0, scale).log_prob(value).sum()
        torch.testing.assert_close(trace.nodes[site]["fn"].log_prob(value), expected)
        precision = bnn._weight_prior().site_precisions[bnn.latent_sites.index(site)]
        torch.testing.assert_close(precision, torch.full_like(precision, scale**-2))


def test_model_works_with_svi_and_predictive():
    bnn = make_bnn("gaussian", batch_norm=True, noise_scale=None)
    x, y = make_data("gaussian")
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn)
    svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(5)]
    assert all(math.isfinite(loss) for loss in losses)
    store = pyro.get_param_store()
    assert {"1.weight", "1.bias", "noise_scale"} <= set(store.keys())
    bnn.eval()
    x_test = torch.randn(B + 3, D_IN, dtype=torch.float64)
    samples = Predictive(bnn, guide=guide, num_samples=4)(x_test)
    assert samples["obs"].shape == (4, B + 3, OUTPUTS["gaussian"])
    assert samples["output"].shape == (4, B + 3, OUTPUTS["gaussian"])


def test_scalar_output_is_squeezed():
    bnn = make_bnn("bernoulli", prior=1.0)
    x, y = make_data("bernoulli")
    assert bnn(x, y).shape == (B,)
    assert poutine.trace(bnn).get_trace(x).nodes["obs"]["value"].shape == (B,)


# ----------------------------------------------------------------- fast path


def reference(bnn, likelihood, x, y, weights, noise=NOISE):
    """Gradient, empirical Fisher and GGN of N/B * NLL at the given weights, by torch.func."""
    scale = N / B

    def nll(params, x, y):
        return -log_likelihood(likelihood, functional_call(bnn.net, params, (x,)), y, noise).sum()

    gradient = {k: scale * v for k, v in grad(nll)(weights, x, y).items()}
    per_example = vmap(grad(nll), in_dims=(None, 0, 0))(weights, x.unsqueeze(1), y.unsqueeze(1))
    ef = {k: scale * v.pow(2).sum(0) for k, v in per_example.items()}

    names, shapes = list(weights), [w.shape for w in weights.values()]
    sizes = [w.numel() for w in weights.values()]

    def output(theta):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return functional_call(bnn.net, params, (x,))

    theta = torch.cat([w.reshape(-1) for w in weights.values()])
    jac = jacrev(output)(theta)
    hess = output_hessian(likelihood, output(theta), noise)
    diag = scale * torch.einsum("bkp,bkl,blp->p", jac, hess, jac)
    ggn = {n: t.reshape(s) for n, t, s in zip(names, torch.split(diag, sizes), shapes)}
    return gradient, ef, ggn


def pop_all(bnn, prefix="AutoNormal"):
    store = pyro.get_param_store()
    return {s: pop_curvature(store._params[f"{prefix}.locs.{s}"]) for s in bnn.latent_sites}


@pytest.mark.parametrize("num_particles", [1, 3])
@pytest.mark.parametrize("source", ["ef", "ggn", "reparam"])
@pytest.mark.parametrize("likelihood", list(OUTPUTS))
def test_curvature_step_matches_autograd(likelihood, source, num_particles):
    bnn = make_bnn(likelihood)
    x, y = make_data(likelihood)
    guide = make_guide(bnn, x, y)
    torch.manual_seed(7)
    bnn.curvature_step(guide, x, y, source, num_particles=num_particles)
    stats = pop_all(bnn)

    torch.manual_seed(7)
    expected_g = {s: 0.0 for s in bnn.latent_sites}
    expected_h = {s: 0.0 for s in bnn.latent_sites}
    loc_scale = guide_loc_scale(bnn)
    for _ in range(num_particles):
        noises = {s: torch.randn_like(loc) for s, (loc, _) in loc_scale.items()}
        weights = {s: loc + scale * noises[s] for s, (loc, scale) in loc_scale.items()}
        gradient, ef, ggn = reference(bnn, likelihood, x, y, weights)
        for s in bnn.latent_sites:
            expected_g[s] = expected_g[s] + gradient[s] / num_particles
            curv = {
                "ef": ef[s],
                "ggn": ggn[s],
                "reparam": gradient[s] * noises[s] / loc_scale[s][1],
            }[source]
            expected_h[s] = expected_h[s] + curv / num_particles
    for site in bnn.latent_sites:
        assert torch.allclose(stats[site].grad, expected_g[site], rtol=1e-10, atol=1e-12)
        assert torch.allclose(stats[site].curvature, expected_h[site], rtol=1e-10, atol=1e-12)
        prior_loc, prior_scale = bnn.prior(site)
        assert torch.equal(stats[site].prior_loc, prior_loc)
        assert torch.allclose(stats[site].prior_precision, prior_scale.pow(-2))
        assert stats[site].mask is None
        assert stats[site].sampled == (source == "reparam")


def test_deterministic_step_evaluates_at_the_mean():
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    guide = make_guide(bnn, x, y)
    loss = bnn.curvature_step(guide, x, y, "ggn", deterministic=True)
    stats = pop_all(bnn)
    means = {s: loc for s, (loc, _) in guide_loc_scale(bnn).items()}
    gradient, _, ggn = reference(bnn, "categorical", x, y, means)
    for site in bnn.latent_sites:
        assert torch.allclose(stats[site].grad, gradient[site], rtol=1e-10, atol=1e-12)
        assert torch.allclose(stats[site].curvature, ggn[site], rtol=1e-10, atol=1e-12)
    # loss: N/B NLL at the mean + KL(q || p0)
    nll = -log_likelihood("categorical", functional_call(bnn.net, means, (x,)), y).sum()
    kl = sum(
        torch.distributions.kl_divergence(Normal(loc, scale), Normal(*bnn.prior(s))).sum()
        for s, (loc, scale) in guide_loc_scale(bnn).items()
    )
    assert torch.allclose(loss, N / B * nll + kl, rtol=1e-12)


def test_ggn_mc_step_is_unbiased_for_ggn():
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    guide = make_guide(bnn, x, y)
    torch.manual_seed(5)
    bnn.curvature_step(guide, x, y, "ggn_mc", deterministic=True, mc_samples=3000)
    stats = pop_all(bnn)
    means = {s: loc for s, (loc, _) in guide_loc_scale(bnn).items()}
    _, _, ggn = reference(bnn, "categorical", x, y, means)
    for site in bnn.latent_sites:
        # relative MC error ~ 1/sqrt(3000) per entry; a factor-2 error would fail
        atol = 1e-3 * ggn[site].max()
        assert torch.allclose(stats[site].curvature, ggn[site], rtol=0.2, atol=atol)


def conditioned_guide(guide, weights):
    return poutine.condition(guide, data={f"{s}_unconstrained": w for s, w in weights.items()})


@pytest.mark.parametrize("prior", [None, 1.5])  # per-element, or one scale (the norms' shortcut)
@pytest.mark.parametrize("likelihood", list(OUTPUTS))
def test_loss_is_trace_elbo_loss_at_the_same_sample(likelihood, prior):
    bnn = make_bnn(likelihood, noise_scale=None if likelihood == "gaussian" else NOISE, prior=prior)
    x, y = make_data(likelihood)
    guide = make_guide(bnn, x, y)
    if likelihood == "gaussian":
        pyro.get_param_store()["noise_scale"] = torch.tensor(0.8, dtype=torch.float64)
    torch.manual_seed(11)
    loss = bnn.curvature_step(guide, x, y, "ef")
    weights, _ = redraw(bnn, 11)
    expected = Trace_ELBO().loss(bnn, conditioned_guide(guide, weights), x, y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_loss_has_the_expectation_of_trace_elbo_loss():
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    guide = make_guide(bnn, x, y)

    def fast_loss():
        loss = bnn.curvature_step(guide, x, y, "reparam")
        pop_all(bnn)  # the statistics an optimizer would take
        return loss

    fast = torch.stack([fast_loss() for _ in range(100)])
    traced = torch.tensor([Trace_ELBO().loss(bnn, guide, x, y) for _ in range(100)])
    tolerance = 4 * (fast.var() / len(fast) + traced.var() / len(traced)).sqrt()
    assert (fast.mean() - traced.mean()).abs() < tolerance


def test_point_estimated_params_get_gradients():
    bnn = make_bnn("gaussian", batch_norm=True, noise_scale=None)
    x, y = make_data("gaussian")
    guide = make_guide(bnn, x, y)
    store = pyro.get_param_store()
    store["noise_scale"] = torch.tensor(0.8, dtype=torch.float64)
    with torch.no_grad():
        store._params["1.weight"].add_(0.1)
    with poutine.trace(param_only=True) as capture:
        torch.manual_seed(13)
        bnn.curvature_step(guide, x, y, "ef")
    stats = pop_all(bnn)
    captured = set(capture.trace.nodes)
    assert {"1.weight", "1.bias", "noise_scale"} <= captured
    # the locs are read through pyro.param (SVI hands them to NGVI); each site's
    # scale travels in its SiteCurvature, equal to the guide's
    assert {f"AutoNormal.locs.{s}" for s in bnn.latent_sites} <= captured
    for site in bnn.latent_sites:
        expected = store[f"AutoNormal.scales.{site}"].detach()
        torch.testing.assert_close(stats[site].scale, expected, rtol=1e-15, atol=0)

    weights, _ = redraw(bnn, 13)
    names = ("1.weight", "1.bias", "noise_scale")
    raw = {name: store._params[name].detach().clone().requires_grad_() for name in names}
    ws = {k: w.clone().requires_grad_() for k, w in weights.items()}
    sigma = biject_to(constraints.positive)(raw["noise_scale"])
    f = functional_call(bnn.net, {**ws, "1.weight": raw["1.weight"], "1.bias": raw["1.bias"]}, (x,))
    nll = -N / B * Normal(f, sigma).log_prob(y).sum()
    grads = torch.autograd.grad(nll, list(raw.values()) + list(ws.values()))
    for name, g in zip(raw, grads):
        assert torch.allclose(store._params[name].grad, g, rtol=1e-10, atol=1e-12), name
    for site, g in zip(ws, grads[len(raw):]):
        assert torch.allclose(stats[site].grad, g, rtol=1e-10, atol=1e-12), site
        assert stats[site].curvature.ge(0).all()


def test_fast_path_follows_dtype_conversion_and_stays_quiet():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))
    bnn = BayesianNet(net, "categorical", num_data=N, prior=1.0).double()
    x, y = make_data("categorical")
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        svi.step(x, y)
        for source in BayesianNet.curvature_sources:
            loss = bnn.curvature_step(guide, x, y, source)
            assert loss.dtype == torch.float64 and torch.isfinite(loss)
            assert all(s.grad.dtype == torch.float64 for s in pop_all(bnn).values())


def test_ngvi_follows_a_scale_replaced_in_the_param_store():
    """NGVI remembers how SVI's tensors pair into sites (the fast path hands it the
    locs only); a scale replaced in the param store must be the one it updates."""
    from pyro_ngvi import CurvatureELBO, NGVI

    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    guide = make_guide(bnn, x, y)
    store = pyro.get_param_store()

    def run(optim, replace):
        svi = SVI(bnn, guide, optim, CurvatureELBO("ggn", deterministic=True))
        if replace:
            svi.step(x, y)
            name = "AutoNormal.scales.0.weight"
            store[name] = 2 * store[name].detach()  # a new raw tensor in the store
        start = copy.deepcopy(store.get_state())  # get_state holds the live tensors
        svi.step(x, y)
        return start, {k: v.detach().clone() for k, v in store.items()}

    start, after = run(NGVI(lr=0.5, beta=0.5, momentum=0.0, warm_start=False), replace=True)
    store.set_state(start)
    _, reference = run(NGVI(lr=0.5, beta=0.5, momentum=0.0, warm_start=False), replace=False)  # nothing cached
    for name, value in reference.items():
        # the other sites' sigma is the one NGVI remembers writing in the first run and
        # recomputed from the raw scale in the second: equal up to rounding (float64 here)
        torch.testing.assert_close(after[name], value, rtol=1e-13, atol=0, msg=name)


# ----------------------------------------------------------------- errors


def test_unknown_likelihood_lists_supported_ones():
    with pytest.raises(ValueError, match="'categorical', 'bernoulli', 'gaussian'"):
        BayesianNet(nn.Linear(2, 1), "poisson", num_data=10)


@pytest.mark.parametrize("likelihood", ["categorical", "bernoulli"])
@pytest.mark.parametrize("argument", [{"noise_scale": 0.1}, {"init_noise_scale": 2.0}])
def test_a_noise_scale_for_a_likelihood_without_noise_is_refused(likelihood, argument):
    # (it was stored and never used: a user who believed it applied got no sign it did not)
    with pytest.raises(ValueError, match=f"{next(iter(argument))} is the scale of the 'gaussian' likelihood"):
        BayesianNet(nn.Linear(2, 1), likelihood, num_data=10, **argument)
    assert BayesianNet(nn.Linear(2, 1), "gaussian", num_data=10, **argument).likelihood == "gaussian"


@pytest.mark.parametrize("curvature", ["hessian", "none", "fisher"])
def test_unsupported_curvature_lists_supported_ones(curvature):
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    guide = make_guide(bnn, x, y)
    with pytest.raises(ValueError, match="'ef', 'ggn', 'ggn_mc', 'reparam'"):
        bnn.curvature_step(guide, x, y, curvature)


def test_reparam_needs_a_sample():
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    with pytest.raises(ValueError, match="reparam"):
        bnn.curvature_step(AutoNormal(bnn), x, y, "reparam", deterministic=True)


def test_fast_path_needs_autonormal():
    bnn = make_bnn("categorical")
    x, y = make_data("categorical")
    with pytest.raises(NotImplementedError, match="AutoNormal"):
        bnn.curvature_step(AutoDiagonalNormal(bnn), x, y, "ef")


def test_prior_errors():
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    with pytest.raises(ValueError, match="missing"):
        BayesianNet(net, "gaussian", num_data=5, prior={"0.weight": 1.0})
    with pytest.raises(ValueError, match="broadcast"):
        prior = {n: torch.ones(7) for n, _ in net.named_parameters()}
        BayesianNet(net, "gaussian", num_data=5, prior=prior)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"^prior: the scale of site '0.weight' must be positive"):
            BayesianNet(net, "gaussian", num_data=5, prior=bad)  # (names the argument)
    with pytest.raises(ValueError, match="'0.weight'.*numbers or tensors"):
        BayesianNet(net, "gaussian", num_data=5, prior=(0.0, "x"))
    # numpy scalars are numbers (a scale, or in a pair)
    for prior in (np.float32(2.0), np.int64(2), (np.float64(0.0), np.float32(2.0))):
        bnn = BayesianNet(net, "gaussian", num_data=5, prior=prior)
        assert bnn._prior_scale(0).eq(2.0).all()


@pytest.mark.parametrize("loss", ["trace", "curvature"])
def test_targets_of_a_dtype_the_likelihood_refuses_get_one_error_on_either_path(loss):
    x = torch.randn(16, 4)
    bnn = BayesianNet(nn.Linear(4, 1), "bernoulli", num_data=16)
    elbo = pyro.infer.Trace_ELBO() if loss == "trace" else CurvatureELBO("ggn")
    svi = SVI(bnn, bnn.guide(), NGVI(), elbo)
    for y in (torch.randint(0, 2, (16,)), torch.randint(0, 2, (16,)).bool()):
        with pytest.raises(ValueError, match=f"targets y of dtype {y.dtype}.*floating-point 0 / 1"):
            svi.step(x, y)
    categorical = BayesianNet(nn.Linear(4, 3), "categorical", num_data=16)
    svi = SVI(categorical, categorical.guide(), NGVI(), elbo)
    with pytest.raises(ValueError, match="targets y of shape"):
        svi.step(x, torch.randint(0, 3, (16, 1)))


def test_network_without_a_weight_to_be_bayesian_about():
    frozen = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no weight to put a prior on"):
        BayesianNet(nn.Sequential(nn.BatchNorm1d(2), frozen), "gaussian", num_data=5)


def test_name_prefixes_every_site_and_param():
    torch.manual_seed(0)
    layers = [nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2)]
    net = nn.Sequential(*layers)
    bnn = BayesianNet(net.double(), "gaussian", num_data=N, name="bnn")
    x, y = make_data("gaussian")
    trace = poutine.trace(bnn).get_trace(x, y)
    assert bnn.latent_sites == ["bnn.0.weight", "bnn.0.bias", "bnn.3.weight", "bnn.3.bias"]
    assert {"bnn.obs", "bnn.output", "bnn.data"} <= set(trace.nodes)
    assert {"bnn.1.weight", "bnn.1.bias", "bnn.noise_scale"} <= set(pyro.get_param_store().keys())
    guide = AutoNormal(bnn)
    bnn.curvature_step(guide, x, y, "ef")
    assert all(stats is not None for stats in pop_all(bnn).values())


# ----------------------------------------------------------------- data augmentation


def test_augmentation_factor_is_the_effective_data_size_of_the_plate():
    bnn = make_bnn("categorical")
    bnn.augmentation_factor = 2.5
    assert bnn.effective_num_data == 50
    x, y = make_data("categorical")
    trace = poutine.trace(bnn).get_trace(x, y)
    trace.compute_log_prob()
    obs = trace.nodes["obs"]
    assert obs["scale"] == pytest.approx(2.5 * N / B)
    expected = 2.5 * N / B * Categorical(logits=trace.nodes["output"]["value"]).log_prob(y).sum()
    assert obs["log_prob_sum"].item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("source", ["ef", "ggn", "reparam"])
def test_augmentation_factor_scales_gradient_and_curvature(source):
    """g and h of rho * N examples: rho times those of N (the prior is not scaled), the
    same as a net told num_data = rho * N."""
    x, y = make_data("categorical")
    results = {}
    for factor, num_data in ((1.0, N), (3.0, N), (1.0, 3 * N)):
        pyro.clear_param_store()
        bnn = make_bnn("categorical")
        bnn.num_data, bnn.augmentation_factor = num_data, factor
        guide = make_guide(bnn, x, y)
        torch.manual_seed(7)
        bnn.curvature_step(guide, x, y, source)
        results[factor, num_data] = pop_all(bnn)
    for site in results[1.0, N]:
        plain, augmented, larger = results[1.0, N][site], results[3.0, N][site], results[1.0, 3 * N][site]
        torch.testing.assert_close(augmented.grad, 3 * plain.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(augmented.curvature, 3 * plain.curvature, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(augmented.prior_precision, plain.prior_precision, rtol=0, atol=0)
        torch.testing.assert_close(augmented.curvature, larger.curvature, rtol=1e-12, atol=1e-14)


def test_augmentation_factor_is_kept_by_with_priors_and_checked():
    bnn = BayesianNet(nn.Linear(2, 1), "gaussian", num_data=10, augmentation_factor=4)
    assert bnn.effective_num_data == 40
    assert bnn.with_priors({}).augmentation_factor == 4.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="augmentation_factor"):
            BayesianNet(nn.Linear(2, 1), "gaussian", num_data=10, augmentation_factor=bad)


class CustomMLP(nn.Module):
    """A network as PyTorch users write one: a class of its own whose forward calls its layers."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("source", ["ggn", "ef", "ggn_mc"])
def test_a_network_of_a_class_of_its_own_takes_the_steps_of_the_same_layers_in_a_sequential(source):
    """BackPACK has no extension for a user's container class: ggn and ggn_mc were refused ("needs
    BackPACK's DiagGGNExact for every module"), ef warned on every step. The twin is converted to a
    graph of the same layers (BackPACK's torch.fx converter) and takes the Sequential's steps."""
    torch.manual_seed(0)
    custom = CustomMLP().double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    results = []
    for net in (custom, nn.Sequential(*copy.deepcopy([custom.fc1, custom.act, custom.fc2]))):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        bnn = BayesianNet(net, "categorical", num_data=32)
        svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(source))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no BackPACK warning either)
            for _ in range(3):
                svi.step(x, y)
        results.append([value.detach().clone() for value in pyro.get_param_store().values()])
    for found, expected in zip(*results):
        assert torch.allclose(found, expected, rtol=1e-9, atol=1e-12)


def test_a_kronecker_guide_of_a_network_of_a_class_of_its_own_trains():
    from pyro_ngvi import KroneckerNormal

    torch.manual_seed(0)
    bnn = BayesianNet(CustomMLP(), "categorical", num_data=32)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    guide = KroneckerNormal(bnn)
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    losses = [svi.step(x, y) for _ in range(20)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_vectorised_draws_are_refused_with_what_to_use_instead():
    bnn = BayesianNet(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), "categorical", num_data=8)
    guide = bnn.guide()
    x = torch.randn(5, 4)
    guide(x, torch.randint(0, 3, (5,)))
    assert Predictive(bnn, guide=guide, num_samples=4, return_sites=["output"])(x)["output"].shape == (4, 5, 3)
    with pytest.raises(NotImplementedError, match=r"one draw of the weights at a time.*parallel=False"):
        Predictive(bnn, guide=guide, num_samples=4, return_sites=["output"], parallel=True)(x)


def test_a_network_returning_a_tuple_is_refused_on_either_path():
    bnn = BayesianNet(nn.LSTM(4, 5, batch_first=True), "categorical", num_data=8)
    x, y = torch.randn(8, 3, 4), torch.randint(0, 5, (8,))
    for loss in (CurvatureELBO("ef"), Trace_ELBO()):
        pyro.clear_param_store()
        with pytest.raises(ValueError, match="must return one tensor.*returned a tuple"):
            SVI(bnn, bnn.guide(), NGVI(), loss).step(x, y)


def test_a_network_converted_after_training_predicts_from_its_guide():
    """.double() after the guide was made and trained: the fast path writes the float32 draws into
    the float64 network; the model's own path (Predictive) does the same (it raised a dtype error)."""
    torch.manual_seed(0)
    bnn = BayesianNet(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), "categorical", num_data=16)
    guide = bnn.guide()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    svi.step(x, y)
    bnn.double()
    svi.step(x.double(), y)
    output = Predictive(bnn, guide=guide, num_samples=2, return_sites=["output"])(x.double())["output"]
    assert output.dtype == torch.float64 and torch.isfinite(output).all()
