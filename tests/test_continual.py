"""Continual learning: posteriors become priors (issue #5).

Specification of the task-to-task chain ``posterior_as_prior`` -> ``with_priors``
-> ``start_task``: exact on conjugate models, a BayesianNet stays a BayesianNet
(and keeps the BackPACK fast path), carrying the precision is an explicit choice.
"""

import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import BayesianNet, CurvatureELBO, KroneckerNormal, NGVI, PriorMessenger
from pyro_ngvi import posterior_as_prior, with_priors
from pyro_ngvi import start_task

NOISE = 0.4
D = 4
PRIOR_LOC = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
PRIOR_SCALE = torch.tensor([1.0, 0.5, 2.0, 0.3], dtype=torch.float64)


def f64(x):
    return torch.as_tensor(x, dtype=torch.float64)


def task_designs(num_tasks=3, n=30, seed=0):
    """
    ``num_tasks`` designs with orthogonal columns, ``X_t = Q_t diag(c_t)``
    (``Q_t`` orthonormal columns): each ``X_t^T X_t = diag(c_t^2)`` is diagonal,
    so the precision of all the data at once is diagonal too.
    """
    g = torch.Generator().manual_seed(seed)
    designs = []
    for _ in range(num_tasks):
        q, _ = torch.linalg.qr(torch.randn(n, D, generator=g, dtype=torch.float64))
        designs.append(q * (1.0 + 4.0 * torch.rand(D, generator=g, dtype=torch.float64)))
    return designs


def fit_one_step_per_task(model, tasks, carry):
    """The issue's loop: hessian curvature at the mean, NGVI(lr=1, beta=1), one step per task."""
    priors = None
    for args in tasks:
        if priors is not None:
            model_t = with_priors(model, priors)
        else:
            model_t = model
        guide = start_task(AutoNormal(model_t), priors, *args, carry=carry)
        svi = SVI(model_t, guide, NGVI(lr=1.0, beta=1.0), CurvatureELBO("hessian", deterministic=True))
        svi.step(*args)
        priors = posterior_as_prior(guide)
    return guide, priors


# --------------------------------------------------------------------------- #
# Exact chains on conjugate models
# --------------------------------------------------------------------------- #


def regression(x, y):
    w = pyro.sample("w", dist.Normal(PRIOR_LOC, PRIOR_SCALE).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)


def closed_form_posterior(x, y, prior_loc, prior_scale):
    """Bayesian linear regression, all the data at once: mean and precision matrix."""
    precision = x.T @ x / NOISE**2 + torch.diag(prior_scale**-2)
    mean = torch.linalg.solve(precision, x.T @ y / NOISE**2 + prior_loc / prior_scale**2)
    return mean, precision


@pytest.fixture
def regression_tasks():
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(D, generator=g, dtype=torch.float64)
    tasks = []
    for x in task_designs():
        tasks.append((x, x @ true_w + NOISE * torch.randn(len(x), generator=g, dtype=torch.float64)))
    return tasks


@pytest.mark.parametrize("carry", [True, False])
def test_linear_regression_task_by_task_ends_at_the_posterior_of_all_data(regression_tasks, carry):
    guide, priors = fit_one_step_per_task(regression, regression_tasks, carry)

    x = torch.cat([x for x, _ in regression_tasks])
    y = torch.cat([y for _, y in regression_tasks])
    mean, precision = closed_form_posterior(x, y, PRIOR_LOC, PRIOR_SCALE)
    assert torch.allclose(precision, torch.diag(precision.diagonal()), atol=1e-9)  # by design
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("w"))
    assert torch.allclose(loc, mean, rtol=1e-5)
    assert torch.allclose(scale, precision.diagonal().rsqrt(), rtol=1e-5)
    # the prior for a fourth task is that posterior
    assert torch.allclose(priors["w"].base_dist.loc, mean, rtol=1e-5)
    assert torch.allclose(priors["w"].base_dist.scale, precision.diagonal().rsqrt(), rtol=1e-5)

    # the test can tell: the last task on its own prior is far from it
    x_last, y_last = regression_tasks[-1]
    last_only, _ = closed_form_posterior(x_last, y_last, PRIOR_LOC, PRIOR_SCALE)
    assert not torch.allclose(last_only, mean, rtol=1e-2)


LOG_NOISE = 0.3
RATE_PRIOR = (f64([0.2, -0.5, 1.0, 0.0]), f64([1.0, 0.7, 0.4, 2.0]))  # LogNormal(loc, scale)


def lognormal_rates(x, y):
    """Positive rates; observations log-normal around ``x @ log(rate)``."""
    rate = pyro.sample("rate", dist.LogNormal(*RATE_PRIOR).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.LogNormal(x @ rate.log(), LOG_NOISE), obs=y)


@pytest.mark.parametrize("carry", [True, False])
def test_positive_site_task_by_task_ends_at_the_posterior_of_all_data(carry):
    g = torch.Generator().manual_seed(2)
    true_log_rate = torch.randn(D, generator=g, dtype=torch.float64)
    tasks = [
        (x, (x @ true_log_rate + LOG_NOISE * torch.randn(len(x), generator=g, dtype=torch.float64)).exp())
        for x in task_designs(seed=3)
    ]
    guide, priors = fit_one_step_per_task(lognormal_rates, tasks, carry)

    # independent reference: log y = x @ u + noise, u = log(rate) ~ N(m0, s0^2):
    # Gaussian linear regression in u, solved by hand on all the data at once
    x = torch.cat([x for x, _ in tasks])
    log_y = torch.cat([y for _, y in tasks]).log()
    m0, s0 = RATE_PRIOR
    precision = x.T @ x / LOG_NOISE**2 + torch.diag(s0**-2)
    mean = torch.linalg.solve(precision, x.T @ log_y / LOG_NOISE**2 + m0 / s0**2)
    assert torch.allclose(precision, torch.diag(precision.diagonal()), atol=1e-9)

    loc, scale = (t.detach() for t in guide._get_loc_and_scale("rate"))  # in u = log(rate)
    assert torch.allclose(loc, mean, rtol=1e-5)
    assert torch.allclose(scale, precision.diagonal().rsqrt(), rtol=1e-5)
    # the next prior is that law on the positive site: LogNormal(mean, sd), by density
    rate = f64([0.5, 1.0, 2.0, 3.0])
    expected = dist.LogNormal(mean, precision.diagonal().rsqrt()).log_prob(rate).sum()
    assert torch.allclose(priors["rate"].log_prob(rate), expected, rtol=1e-5)


# --------------------------------------------------------------------------- #
# start_task: carrying the precision is an explicit choice
# --------------------------------------------------------------------------- #


def two_sites(x, y):
    regression(x, y)
    pyro.sample("rate", dist.LogNormal(f64(0.0), f64(1.0)))


def store_loc_scale(site, prefix="AutoNormal"):
    store = pyro.get_param_store()
    return store[f"{prefix}.locs.{site}"].detach(), store[f"{prefix}.scales.{site}"].detach()


@pytest.fixture
def previous_posterior(regression_tasks):
    """A guide fitted on task 1 (left in the param store) and its posterior as priors."""
    x, y = regression_tasks[0]
    guide = AutoNormal(two_sites)
    svi = SVI(two_sites, guide, NGVI(lr=1.0, beta=1.0), CurvatureELBO("hessian", deterministic=True))
    svi.step(x, y)
    with torch.no_grad():  # make the positive site's posterior differ from its init
        pyro.get_param_store()["AutoNormal.locs.rate"].fill_(0.7)
    return posterior_as_prior(guide), regression_tasks[1]


def test_without_start_task_pyro_silently_warm_starts_a_new_guide(previous_posterior):
    """The trap start_task exists for: the param store outlives guides."""
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    guide = AutoNormal(model)
    guide(x, y)
    loc, scale = store_loc_scale("w")
    assert torch.equal(loc, priors["w"].base_dist.loc)
    assert not torch.allclose(scale, torch.full_like(scale, 0.1))  # not AutoNormal's init_scale


def test_start_task_carry_starts_the_guide_at_the_previous_posterior(previous_posterior):
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    pyro.clear_param_store()  # carry does not rely on what the store holds
    start_task(AutoNormal(model), priors, x, y, carry=True)
    loc, scale = store_loc_scale("w")
    assert torch.equal(loc, priors["w"].base_dist.loc)
    assert torch.allclose(scale, priors["w"].base_dist.scale, rtol=1e-12)
    rate_loc, rate_scale = store_loc_scale("rate")  # positive site, in u = log(rate)
    assert torch.allclose(rate_loc, f64(0.7), rtol=1e-12)
    assert torch.allclose(rate_scale, priors["rate"].base_dist.scale, rtol=1e-12)


def test_start_task_fresh_starts_at_the_guide_initialisation_despite_the_store(previous_posterior):
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    init = f64([3.0, 3.0, 3.0, 3.0])
    guide = AutoNormal(model, init_loc_fn=lambda site: init if site["name"] == "w" else f64(2.0),
                       init_scale=0.25)
    start_task(guide, priors, x, y, carry=False)
    loc, scale = store_loc_scale("w")
    assert torch.equal(loc, init)
    assert torch.allclose(scale, torch.full_like(scale, 0.25), rtol=1e-12)
    rate_loc, rate_scale = store_loc_scale("rate")
    assert torch.allclose(rate_loc, f64(2.0).log(), rtol=1e-12)
    assert torch.allclose(rate_scale, f64(0.25), rtol=1e-12)


def test_start_task_clears_a_stale_site_that_only_shares_a_name():
    """A new task's head named like the old one, of another shape, starts afresh."""
    def head(size):
        def model():
            pyro.sample("head", dist.Normal(torch.zeros(size, dtype=torch.float64), 1.0).to_event(1))
        return model

    AutoNormal(head(3))()  # leaves AutoNormal.locs.head of shape (3,) in the store
    start_task(AutoNormal(head(5)), None, carry=True)
    loc, scale = store_loc_scale("head")
    assert loc.shape == (5,) and scale.shape == (5,)


@pytest.mark.parametrize("carry", [True, False])
def test_carried_precision_enters_the_first_update(previous_posterior, carry):
    """
    With beta < 1 and no warm start, one step gives
    lam_1 = (1 - beta) lam_start + beta (lam_0 + h): the start's precision is
    the previous posterior's (carry) or 1 / init_scale^2 (fresh).
    """
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    guide = start_task(AutoNormal(model, init_scale=0.5), priors, x, y, carry=carry)
    beta = 0.25
    svi = SVI(model, guide, NGVI(lr=1.0, beta=beta, warm_start=False),
              CurvatureELBO("hessian", deterministic=True))
    svi.step(x, y)
    prior_precision = priors["w"].base_dist.scale ** -2
    curvature = (x**2).sum(0) / NOISE**2  # exact Hessian diagonal of the likelihood
    start = prior_precision if carry else torch.full_like(prior_precision, 0.5**-2)
    expected = (1 - beta) * start + beta * (prior_precision + curvature)
    _, scale = store_loc_scale("w")
    assert torch.allclose(scale**-2, expected, rtol=1e-10)


def test_start_task_errors_name_the_site(previous_posterior):
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    with pytest.raises(ValueError, match=r"'nope'.*\['w', 'rate'\]"):
        start_task(AutoNormal(model), {"nope": dist.Normal(0.0, 1.0)}, x, y, carry=True)
    with pytest.raises(ValueError, match="'rate'.*not Normal in the site's unconstrained"):
        start_task(AutoNormal(model), {"rate": dist.Gamma(f64(2.0), f64(1.0))}, x, y, carry=True)
    wrong_shape = {"w": dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1)}
    with pytest.raises(ValueError, match=r"'w'.*\(3,\).*\(4,\)"):
        start_task(AutoNormal(model), wrong_shape, x, y, carry=True)
    nan = {"w": dist.Normal(torch.full((4,), math.nan, dtype=torch.float64), 1.0, validate_args=False).to_event(1)}
    with pytest.raises(ValueError, match="'w' has a non-finite loc"):
        start_task(AutoNormal(model), nan, x, y, carry=True)  # (the guide started at NaN)
    used = AutoNormal(model)
    used(x, y)
    with pytest.raises(ValueError, match="already been run"):
        start_task(used, priors, x, y, carry=True)
    with pytest.raises(TypeError, match="carry"):
        start_task(AutoNormal(model), priors, x, y, carry=None)
    with pytest.raises(TypeError):
        start_task(AutoNormal(model), priors, x, y)  # no default: the choice is explicit


def test_a_refused_start_task_leaves_the_store_as_it_was_and_may_be_retried(previous_posterior):
    priors, (x, y) = previous_posterior
    model = with_priors(two_sites, priors)
    store = pyro.get_param_store()
    before = {name: (store._params[name], store._constraints[name]) for name in store.keys()}
    guide = AutoNormal(model)
    wrong_shape = {"rate": priors["rate"], "w": dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1)}
    for refused in ({"nope": dist.Normal(0.0, 1.0)}, wrong_shape):  # (the second writes 'rate' before 'w' fails)
        with pytest.raises(ValueError):
            start_task(guide, refused, x, y, carry=True)
        assert {name: (store._params[name], store._constraints[name]) for name in store.keys()} == before
    start_task(guide, priors, x, y, carry=True)  # the same guide, the corrected call
    loc, scale = store_loc_scale("w")
    assert torch.equal(loc, priors["w"].base_dist.loc)
    assert torch.allclose(scale, priors["w"].base_dist.scale, rtol=1e-12)


# --------------------------------------------------------------------------- #
# BayesianNet: the chain keeps the fast path
# --------------------------------------------------------------------------- #

N_NET, IN, HIDDEN, OUT = 24, 3, 5, 3


@pytest.fixture
def net_task():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()
    x = torch.randn(N_NET, IN, dtype=torch.float64)
    y = torch.randint(0, OUT, (N_NET,))
    return net, x, y


def fitted_bnn_guide(net, x, y, steps=5):
    bnn = BayesianNet(net, "categorical", num_data=N_NET, prior=1.0)
    guide = start_task(AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.05), None, x, y,
                       carry=False)
    svi = SVI(bnn, guide, NGVI(lr=0.3, beta=0.3), CurvatureELBO("ggn"))
    for _ in range(steps):
        svi.step(x, y)
    return bnn, guide


def test_with_priors_on_a_bayesian_net_gives_a_bayesian_net_whose_priors_are_the_posterior(net_task):
    net, x, y = net_task
    bnn, guide = fitted_bnn_guide(net, x, y)
    bnn_2 = with_priors(bnn, posterior_as_prior(guide))
    assert isinstance(bnn_2, BayesianNet)
    assert bnn_2.net is bnn.net
    assert bnn_2.latent_sites == bnn.latent_sites
    assert (bnn_2.likelihood, bnn_2.num_data) == (bnn.likelihood, bnn.num_data)
    for site in bnn.latent_sites:
        loc, scale = guide._get_loc_and_scale(site)
        prior_loc, prior_scale = bnn_2.prior(site)
        assert torch.equal(prior_loc, loc.detach())
        assert torch.equal(prior_scale, scale.detach())
        assert torch.equal(bnn.prior(site)[1], torch.ones((), dtype=torch.float64))  # the old model is unchanged


def test_with_priors_on_a_bayesian_net_keeps_the_other_sites_priors(net_task):
    net, x, y = net_task
    bnn, guide = fitted_bnn_guide(net, x, y)
    bnn_2 = with_priors(bnn, posterior_as_prior(guide, sites=["0.weight", "0.bias"]))
    assert torch.equal(bnn_2.prior("0.weight")[0], guide._get_loc_and_scale("0.weight")[0].detach())
    for site in ("2.weight", "2.bias"):
        assert torch.equal(bnn_2.prior(site)[0], bnn.prior(site)[0])
        assert torch.equal(bnn_2.prior(site)[1], bnn.prior(site)[1])


def test_bayesian_net_with_priors_defines_the_model_prior_messenger_defines(net_task):
    """Same log joint as the generic effect handler at the same weights."""
    net, x, y = net_task
    bnn, guide = fitted_bnn_guide(net, x, y)
    priors = posterior_as_prior(guide, sites=["0.weight", "2.bias"])
    torch.manual_seed(4)
    weights = {name: torch.randn_like(p) for name, p in net.named_parameters()}

    def log_joint(model):
        return poutine.trace(poutine.condition(model, data=weights)).get_trace(x, y).log_prob_sum()

    fast, generic = with_priors(bnn, priors), PriorMessenger(priors)(bnn)
    assert torch.allclose(log_joint(fast), log_joint(generic), rtol=1e-12)
    assert not torch.allclose(log_joint(fast), log_joint(bnn), rtol=1e-3)


def likelihood_gradient_and_ggn(net, weights, x, y):
    """
    Gradient and exact GGN diagonal of -sum_i log Categorical(y_i | f(x_i; w)),
    by hand: J_i from torch.func.jacrev, H_i = diag(p_i) - p_i p_i^T.
    """
    names = list(weights)

    def logits(*values):
        return functional_call(net, dict(zip(names, values)), (x,))

    values = tuple(weights.values())
    f = logits(*values)
    jacobians = jacrev(logits, argnums=tuple(range(len(names))))(*values)  # (B, K, *shape)
    p = f.softmax(-1)
    residual = p - F.one_hot(y, f.shape[-1]).to(p.dtype)
    hessian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    result = {}
    for name, jac in zip(names, jacobians):
        flat = jac.flatten(2)  # (B, K, P)
        grad = torch.einsum("bk,bkp->p", residual, flat)
        ggn = torch.einsum("bkp,bkl,blp->p", flat, hessian, flat)
        result[name] = (grad.reshape(jac.shape[2:]), ggn.reshape(jac.shape[2:]))
    return result


def test_chained_bayesian_net_runs_the_fast_path_with_the_new_priors(net_task, monkeypatch):
    net, x, y = net_task
    bnn, guide = fitted_bnn_guide(net, x, y)
    priors = posterior_as_prior(guide)
    bnn_2 = with_priors(bnn, priors)

    calls = []
    fast_step = BayesianNet.curvature_step

    def counting(self, *args, **kwargs):
        calls.append(self)
        return fast_step(self, *args, **kwargs)

    monkeypatch.setattr(BayesianNet, "curvature_step", counting)
    # start away from the prior (carry=False) so that its mean enters the step
    init_scale, lr, beta = 0.2, 0.5, 0.5
    guide_2 = start_task(AutoNormal(bnn_2, init_loc_fn=bnn_2.init_loc_fn, init_scale=init_scale),
                         priors, x, y, carry=False)
    start = {site: guide_2._get_loc_and_scale(site)[0].detach().clone() for site in bnn.latent_sites}
    svi = SVI(bnn_2, guide_2, NGVI(lr=lr, beta=beta, momentum=0.0, damping=0.0, warm_start=False),
              CurvatureELBO("ggn", deterministic=True))
    svi.step(x, y)
    assert calls == [bnn_2]  # CurvatureELBO dispatched to BayesianNet.curvature_step

    # one VON step at the mean (DESIGN.md section 2), by hand, with the task-1 posterior as prior
    reference = likelihood_gradient_and_ggn(net, start, x, y)  # N / B = 1
    for site in bnn.latent_sites:
        prior_loc = priors[site].base_dist.loc
        prior_precision = priors[site].base_dist.scale ** -2
        grad, ggn = reference[site]
        precision = (1 - beta) * init_scale**-2 + beta * (prior_precision + ggn)
        mean = start[site] - lr * (grad + prior_precision * (start[site] - prior_loc)) / precision
        loc, scale = (t.detach() for t in guide_2._get_loc_and_scale(site))
        assert torch.allclose(loc, mean, rtol=1e-9, atol=1e-12), site
        assert torch.allclose(scale**-2, precision, rtol=1e-9), site
        assert not torch.allclose(mean, start[site] - lr * grad / precision)  # the prior mattered


def test_bayesian_net_chain_over_three_tasks_runs_on_the_fast_path(net_task, monkeypatch):
    net, x, y = net_task
    calls = []
    fast_step = BayesianNet.curvature_step
    monkeypatch.setattr(
        BayesianNet, "curvature_step",
        lambda self, *a, **k: calls.append(self) or fast_step(self, *a, **k),
    )
    model = BayesianNet(net, "categorical", num_data=N_NET, prior=1.0)
    priors = None
    for task in range(3):
        guide = start_task(AutoNormal(model, init_loc_fn=model.init_loc_fn), priors, x, y, carry=True)
        svi = SVI(model, guide, NGVI(lr=0.3, beta=0.3), CurvatureELBO("ef"))
        losses = [svi.step(x, y) for _ in range(3)]
        assert all(math.isfinite(loss) for loss in losses)
        priors = posterior_as_prior(guide)
        model = with_priors(model, priors)
        assert isinstance(model, BayesianNet)
    assert len(calls) == 9 and all(isinstance(m, BayesianNet) for m in calls)


@pytest.mark.parametrize(
    "priors, error, match",
    [
        ({"1.weight": dist.Normal(0.0, 1.0)}, ValueError, r"'1\.weight' is not a latent site.*'0\.weight'"),
        ({"0.weight": dist.Normal(torch.zeros(HIDDEN, 2), 1.0).to_event(2)}, ValueError,
         r"'0\.weight'.*event shape \(5, 2\).*\(5, 3\)"),
        ({"0.bias": dist.Normal(torch.zeros(2, HIDDEN), 1.0).to_event(1)}, ValueError,
         r"'0\.bias'.*batch shape \(2,\)"),
        ({"0.bias": dist.LogNormal(torch.zeros(HIDDEN), 1.0).to_event(1)}, ValueError,
         r"'0\.bias'.*support"),
        ({"2.bias": dist.Laplace(torch.zeros(OUT), 1.0).to_event(1)}, ValueError,
         r"'2\.bias'.*Independent.*Normal"),
        ({"2.bias": (torch.zeros(OUT), torch.ones(OUT))}, TypeError, r"'2\.bias'.*Distribution"),
    ],
    ids=["unknown-site", "event-shape", "batch-shape", "support", "not-normal", "not-a-distribution"],
)
def test_with_priors_on_a_bayesian_net_errors_name_the_site(net_task, priors, error, match):
    net, _, _ = net_task
    bnn = BayesianNet(net.float(), "categorical", num_data=N_NET)
    with pytest.raises(error, match=match):
        with_priors(bnn, priors)


def test_with_priors_on_a_bayesian_net_names_batch_norm_params():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    bnn = BayesianNet(net, "gaussian", num_data=4, noise_scale=1.0)
    with pytest.raises(ValueError, match=r"'1\.weight'.*BatchNorm"):
        with_priors(bnn, {"1.weight": dist.Normal(torch.zeros(3), 1.0).to_event(1)})


# --------------------------------------------------------------------------- #
# The example
# --------------------------------------------------------------------------- #


def load_example():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "continual_learning.py")
    spec = importlib.util.spec_from_file_location("continual_learning_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_quick_run_writes_table_and_figures(tmp_path, capsys):
    example = load_example()
    num_threads = torch.get_num_threads()
    try:
        table = example.main(["--quick", "--quiet", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(num_threads)
    for name in ("results.md", "permuted_accuracy.png", "split_accuracy.png", "average_accuracy.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    written = (tmp_path / "results.md").read_text()
    assert table in written and table in capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| permuted") or line.startswith("| split")]
    assert len(rows) == 2 * len(example.METHODS)
    for row in rows:
        accuracy = float(row.split("|")[3].strip().rstrip(" %"))
        assert 0.0 <= accuracy <= 100.0


def test_posterior_as_prior_of_another_guide_names_both_guides_it_reads():
    """The message said 'supports AutoNormal guides' though an AutoMultivariateNormal of one site is read too."""
    bnn = BayesianNet(nn.Linear(3, 2), "categorical", 8)
    with pytest.raises(NotImplementedError, match="AutoNormal and AutoMultivariateNormal .*got KroneckerNormal"):
        posterior_as_prior(KroneckerNormal(bnn))


@pytest.mark.parametrize("prior", [
    dist.MultivariateNormal(torch.tensor([float("nan"), 0.0]), torch.eye(2), validate_args=False),
    dist.MultivariateNormal(torch.tensor([float("inf"), 0.0]), torch.eye(2), validate_args=False),
    dist.Normal(torch.zeros(2), torch.tensor([0.0, 1.0]), validate_args=False).to_event(1),
    dist.Normal(torch.zeros(2), torch.tensor([float("inf"), 1.0]), validate_args=False).to_event(1),
], ids=["nan-mean", "inf-mean", "zero-scale", "inf-scale"])
def test_start_task_full_covariance_refuses_unusable_prior(prior):
    """start_task(AutoMultivariateNormal, carry=True) wrote a NaN / inf prior mean into the guide
    unrefused (its AutoNormal path refuses it), and a zero or infinite prior scale raised torch's
    LinAlgError, not a ValueError naming the site. A good prior still sets the guide's block."""
    from pyro.infer.autoguide import AutoMultivariateNormal

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal((x * w).sum(-1), 0.5), obs=y)

    pyro.clear_param_store()
    x, y = torch.randn(5, 2), torch.randn(5)
    guide = AutoMultivariateNormal(model)
    with pytest.raises(ValueError, match="site 'w' has a non-finite mean or a precision"):
        start_task(guide, {"w": prior}, x, y, carry=True)
    assert guide.prototype_trace is None and not list(pyro.get_param_store().keys())
    good = dist.MultivariateNormal(torch.tensor([0.5, -1.0]), torch.tensor([[2.0, 0.6], [0.6, 1.0]]))
    start_task(guide, {"w": good}, x, y, carry=True)  # the refused call left the guide retriable
    posterior = guide.get_posterior()
    torch.testing.assert_close(posterior.loc.detach(), good.mean)
    torch.testing.assert_close(posterior.covariance_matrix.detach(), good.covariance_matrix)
