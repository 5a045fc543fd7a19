"""Laplace approximation and evidence: closed forms, the NGVI-Newton equivalence, VI vs Laplace."""

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
from pyro.infer import SVI, Predictive
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal, init_to_value

from pyro_ngvi import BayesianNet, CurvatureELBO, NGVI
from pyro_ngvi.laplace import LaplaceWarning, laplace, optimize_prior_precision

NOISE = 0.3
PRIOR_LOC = (0.5, -1.0, 2.0, 0.0)
PRIOR_SCALE = (1.0, 0.5, 2.0, 0.1)


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)


def prior():
    return torch.tensor(PRIOR_LOC), torch.tensor(PRIOR_SCALE)


def regression(x, y):
    loc, scale = prior()
    w = pyro.sample("w", dist.Normal(loc, scale).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)


def orthogonal_design(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, 4, generator=g))
    x = q * torch.tensor([3.0, 5.0, 2.0, 7.0])
    y = x @ torch.randn(4, generator=g) + NOISE * torch.randn(n, generator=g)
    return x, y


def correlated_design(n=100, seed=1):
    g = torch.Generator().manual_seed(seed)
    cov = 0.5 * torch.eye(4) + 0.5
    x = torch.randn(n, 4, generator=g) @ torch.linalg.cholesky(cov).T
    y = x @ torch.tensor([1.0, -1.0, 0.5, 2.0]) + NOISE * torch.randn(n, generator=g)
    return x, y


def exact_posterior(x, y, prior_loc, prior_scale):
    """Posterior mean and precision matrix of the linear-Gaussian model."""
    precision = x.T @ x / NOISE**2 + torch.diag(prior_scale**-2)
    mean = torch.linalg.solve(precision, x.T @ y / NOISE**2 + prior_loc / prior_scale**2)
    return mean, precision


def exact_log_evidence(x, y, prior_loc, prior_scale):
    """log N(y; X m0, sigma^2 I + X S0 X^T)."""
    cov = NOISE**2 * torch.eye(len(x)) + (x * prior_scale**2) @ x.T
    return float(torch.distributions.MultivariateNormal(x @ prior_loc, cov).log_prob(y))


def linear_net(prior_loc, prior_scale):
    net = nn.Linear(4, 1, bias=False).double()
    return BayesianNet(
        net, "gaussian", num_data=40, prior={"weight": (prior_loc[None], prior_scale[None])}, noise_scale=NOISE
    )


# ---------------------------------------------------------------- (a) linear-Gaussian
@pytest.mark.parametrize(
    "kind,curvature",
    [("pyro", "hessian"), ("pyro", "ggn"), ("net", "ggn"), ("net", "hessian")],
)
def test_linear_gaussian_laplace_is_the_exact_posterior_and_evidence(kind, curvature):
    x, y = orthogonal_design()
    m0, s0 = prior()
    mean, precision = exact_posterior(x, y, m0, s0)
    assert torch.allclose(precision, torch.diag(precision.diagonal()), atol=1e-9)  # orthogonal design
    if kind == "pyro":
        model, site = regression, "w"
    else:  # the BackPACK fast path ("ggn"), or tracing the same model ("hessian")
        model, site = linear_net(m0, s0), "weight"
    res = laplace(model, x, y, curvature=curvature)
    assert res.converged and res.num_steps <= 2  # Newton lands in one step
    assert abs(res.log_evidence - exact_log_evidence(x, y, m0, s0)) < 1e-4
    assert torch.allclose(res.map[site].flatten(), mean, rtol=1e-9, atol=1e-12)
    std = precision.diagonal().rsqrt()
    assert torch.allclose(res.scale[site].flatten(), std, rtol=1e-9)
    loc, scale = res.guide._get_loc_and_scale(site)  # the guide holds the result
    assert torch.allclose(loc.flatten(), mean, rtol=1e-9, atol=1e-12)
    assert torch.allclose(scale.flatten(), std, rtol=1e-9)


# Models of one latent u, Gaussian in u, with some term hidden or reweighted; log p(y, u) on a grid.
Y5 = (-0.2, -1.9, -0.6, -1.4, 0.3)


def hidden_or_scaled(kind):
    """``(model, log joint at u)``: "masked prior": N(0, 0.5^2) under poutine.mask(False) (flat);
    "scaled prior": LogNormal(0, 0.5) under poutine.scale(0.1), u = log z (log|det J| = u, not
    scaled); "masked data": y_i ~ N(u, 1), the last two under poutine.mask(False)."""
    y, keep = torch.tensor(Y5), torch.tensor([True, True, True, False, False])

    def model(y):
        if kind == "scaled prior":
            with poutine.scale(scale=0.1):
                z = pyro.sample("z", dist.LogNormal(0.0, 0.5))
            u = z.log()
        else:
            with poutine.mask(mask=kind != "masked prior"):
                u = pyro.sample("z", dist.Normal(0.0, 0.5))
        with pyro.plate("data", len(y)), poutine.mask(mask=keep if kind == "masked data" else True):
            pyro.sample("obs", dist.Normal(u, 1.0), obs=y)

    def log_joint(u):
        log_lik = dist.Normal(u[:, None], 1.0).log_prob(y)
        if kind == "masked data":
            return dist.Normal(0.0, 0.5).log_prob(u) + (log_lik * keep).sum(-1)
        prior = 0.1 * (dist.Normal(0.0, 0.5).log_prob(u) - u) + u if kind == "scaled prior" else 0.0
        return prior + log_lik.sum(-1)

    return model, log_joint


@pytest.mark.parametrize("kind", ["masked prior", "scaled prior", "masked data"])
@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_laplace_of_a_masked_or_scaled_term_is_that_of_the_joint_pyro_scores(kind, curvature, covariance):
    """The joint each site's scale and mask weigh, as in Pyro's ELBO, integrated on a grid (exact:
    Gaussian in u). A masked prior was used (sd 0.35 for 0.5), a scaled one divided by its scale
    (precision 54.0 for 5.4, evidence -11.84 for -10.69), "ggn" counted masked examples."""
    model, log_joint = hidden_or_scaled(kind)
    grid = torch.linspace(-12.0, 12.0, 200001)
    log_probs = log_joint(grid)
    evidence = float(torch.logsumexp(log_probs, 0) + math.log(grid[1] - grid[0]))
    weights = (log_probs - log_probs.max()).exp()
    mean = float((weights * grid).sum() / weights.sum())
    variance = float((weights * (grid - mean) ** 2).sum() / weights.sum())
    res = laplace(model, torch.tensor(Y5), curvature=curvature, covariance=covariance)
    (u,), (precision,) = res.map.values(), res.precision.values()
    assert float(u) == pytest.approx(mean, abs=1e-6)
    assert float(precision) == pytest.approx(1 / variance, rel=1e-6)
    assert res.log_evidence == pytest.approx(evidence, abs=1e-6)


def test_empirical_fisher_precision_is_the_squared_per_example_gradients_at_the_mode():
    x, y = orthogonal_design()
    m0, s0 = prior()
    mean, _ = exact_posterior(x, y, m0, s0)
    res = laplace(regression, x, y, curvature="ef", tol=1e-12)  # ef-preconditioned steps: linear
    assert res.converged
    per_example = x * ((x @ mean - y) / NOISE**2).unsqueeze(-1)
    expected = s0**-2 + per_example.square().sum(0)
    assert torch.allclose(res.map["w"], mean, rtol=1e-9)
    assert torch.allclose(res.precision["w"], expected, rtol=1e-9)
    log_joint = float(
        torch.distributions.Normal(x @ mean, NOISE).log_prob(y).sum()
        + torch.distributions.Normal(m0, s0).log_prob(mean).sum()
    )
    assert res.log_evidence == pytest.approx(log_joint + 0.5 * float((2 * math.pi / expected).log().sum()), abs=1e-9)


# ----------------------------------------------------------------- (b) positive site
A, B = 3.0, 2.0
COUNTS = (2.0, 0.0, 3.0, 1.0, 4.0)


def gamma_poisson(counts):
    rate = pyro.sample("rate", dist.Gamma(A, B))
    with pyro.plate("data", len(counts)):
        pyro.sample("obs", dist.Poisson(rate), obs=counts)


def test_positive_site_laplace_in_log_rate_coordinates():
    counts = torch.tensor(COUNTS)
    k, n = sum(COUNTS), len(COUNTS)
    u = math.log((A + k) / (B + n))  # mode of p(D, e^u) e^u, not log of the rate's mode
    rate = math.exp(u)
    log_prior = A * math.log(B) - math.lgamma(A) + (A - 1) * math.log(rate) - B * rate
    log_lik = sum(c * math.log(rate) - rate - math.lgamma(c + 1) for c in COUNTS)
    log_evidence = log_prior + log_lik + u + 0.5 * math.log(2 * math.pi / (A + k))

    res = laplace(gamma_poisson, counts, curvature="hessian")
    assert res.converged
    assert abs(res.map["rate"].item() - u) < 1e-10
    assert abs(res.precision["rate"].item() - (A + k)) < 1e-8
    assert abs(res.log_joint - (log_prior + log_lik + u)) < 1e-10
    assert abs(res.log_evidence - log_evidence) < 1e-10
    assert abs(res.guide.median()["rate"].item() - rate) < 1e-10
    assert abs(rate - (A + k - 1) / (B + n)) > 0.1  # the mode in u is not the mode in the rate

    samples = Predictive(gamma_poisson, guide=res.guide, num_samples=4000, parallel=True)(counts)["rate"].log()
    assert abs(samples.mean().item() - u) < 4 * (A + k) ** -0.5 / math.sqrt(4000)
    assert abs(samples.std().item() * math.sqrt(A + k) - 1) < 0.05


def test_laplace_evidence_of_gamma_poisson_is_close_to_the_exact_one():
    """A sanity bound: the exact evidence is a negative-binomial-like closed form."""
    counts = torch.tensor(COUNTS)
    k, n = sum(COUNTS), len(COUNTS)
    exact = (
        A * math.log(B) - math.lgamma(A) + math.lgamma(A + k) - (A + k) * math.log(B + n)
        - sum(math.lgamma(c + 1) for c in COUNTS)
    )
    res = laplace(gamma_poisson, counts, curvature="hessian")
    # Stirling's series: the Laplace error in log Gamma(a + k) is 1/(12 (a + k)) + O((a + k)^-3)
    assert abs(exact - res.log_evidence - 1 / (12 * (A + k))) < 1e-3


# ---------------------------------------------------- (c) one NGVI step is a Newton step
LOGISTIC_M0 = (0.2, -0.3, 0.1)
LOGISTIC_S0 = (1.0, 2.0, 0.7)


def logistic_data(n=30, seed=2):
    g = torch.Generator().manual_seed(seed)
    cov = torch.tensor([[1.0, 0.6, -0.4], [0.6, 1.0, 0.3], [-0.4, 0.3, 1.0]])
    x = torch.randn(n, 3, generator=g) @ torch.linalg.cholesky(cov).T
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -2.0, 0.5])), generator=g)
    return x, y


def make_logistic(prior_kind):
    m0, s0 = torch.tensor(LOGISTIC_M0), torch.tensor(LOGISTIC_S0)
    weight_prior = dist.Normal(m0, s0) if prior_kind == "normal" else dist.StudentT(4.0, m0, s0)

    def model(x, y):
        w = pyro.sample("w", weight_prior.to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    def negative_log_joint(w):  # by hand, independent of Pyro
        logits = x_y[0] @ w
        nll = -(x_y[1] * nn.functional.logsigmoid(logits) + (1 - x_y[1]) * nn.functional.logsigmoid(-logits)).sum()
        z = (w - m0) / s0
        if prior_kind == "normal":
            prior_term = 0.5 * z.square() + s0.log() + 0.5 * math.log(2 * math.pi)
        else:
            nu = 4.0
            prior_term = (
                -math.lgamma((nu + 1) / 2) + math.lgamma(nu / 2) + 0.5 * math.log(nu * math.pi)
                + s0.log() + (nu + 1) / 2 * torch.log1p(z.square() / nu)
            )
        return nll + prior_term.sum()

    x_y = logistic_data()
    return model, negative_log_joint, x_y


def one_ngvi_step(model, start, *args):
    start = {name: value.clone() for name, value in start.items()}  # the guide adopts the tensor
    guide = AutoNormal(model, init_loc_fn=init_to_value(values=start))
    svi = SVI(model, guide, NGVI(lr=1.0, beta=1.0), CurvatureELBO("hessian", deterministic=True))
    svi.step(*args)
    return guide


@pytest.mark.parametrize("prior_kind", ["normal", "student_t"])
def test_one_ngvi_step_is_one_diagonal_newton_step(prior_kind):
    model, f, (x, y) = make_logistic(prior_kind)
    start = torch.tensor([0.8, 0.4, -0.6])
    grad, hess = jacobian(f, start), hessian(f, start)
    off_diagonal = hess - torch.diag(hess.diagonal())
    assert off_diagonal.abs().max() > 0.5  # a genuinely correlated problem
    assert (hess.diagonal() > 0).all()
    guide = one_ngvi_step(model, {"w": start}, x, y)
    loc, scale = guide._get_loc_and_scale("w")
    assert torch.allclose(loc, start - grad / hess.diagonal(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(scale, hess.diagonal().rsqrt(), rtol=1e-10)
    full_newton = start - torch.linalg.solve(hess, grad)
    assert not torch.allclose(loc, full_newton, atol=1e-3)  # diagonal != full Newton here


RATE_A = (3.0, 1.5, 6.0)
RATE_B = (2.0, 0.5, 1.0)
RATE_COUNTS = ((2.0, 0.0, 3.0, 1.0), (7.0, 9.0, 4.0, 5.0), (0.0, 1.0, 0.0, 0.0))


def independent_rates(counts):
    rate = pyro.sample("rate", dist.Gamma(torch.tensor(RATE_A), torch.tensor(RATE_B)).to_event(1))
    with pyro.plate("data", counts.shape[0]):
        pyro.sample("obs", dist.Poisson(rate).to_event(1), obs=counts)


def test_one_ngvi_step_is_a_full_newton_step_when_the_hessian_is_diagonal():
    counts = torch.tensor(RATE_COUNTS).T  # (4, 3): four observations of three rates
    a, b = torch.tensor(RATE_A), torch.tensor(RATE_B)

    def f(u):  # -log Gamma(e^u) - u - sum log Poisson, by hand
        rate = u.exp()
        log_prior = a * b.log() - torch.lgamma(a) + (a - 1) * u - b * rate
        log_lik = (counts * u - rate - torch.lgamma(counts + 1)).sum(0)
        return -(log_prior + u + log_lik).sum()

    start = torch.tensor([1.2, -0.7, 0.3])
    grad, hess = jacobian(f, start), hessian(f, start)
    assert torch.equal(hess, torch.diag(hess.diagonal()))
    guide = one_ngvi_step(independent_rates, {"rate": start.exp()}, counts)
    loc, scale = guide._get_loc_and_scale("rate")
    assert torch.allclose(loc, start - torch.linalg.solve(hess, grad), rtol=1e-10)
    assert torch.allclose(scale, hess.diagonal().rsqrt(), rtol=1e-10)


# ---------------------------------------------- (d) diagonal Laplace vs mean-field ELBO
# Gaps below the exact log evidence on correlated_design(): the diagonal Laplace
# evidence and the optimal mean-field ELBO both equal log p(y, mu*) + d/2 log 2 pi
# - 1/2 sum log A_ii, i.e. the gap is 1/2 (sum log A_ii - log det A) for both.
EVIDENCE_GAP = 0.632577  # nats; the exact log evidence is -211.965966


def mean_field_elbo(x, y, loc, scale, prior_loc, prior_scale):
    """E_q[log p(y | w)] + E_q[log p(w)] + H[q] for q = N(loc, diag(scale^2)), closed form."""
    var = scale.square()
    residual = y - x @ loc
    expected_lik = (
        -0.5 * len(y) * math.log(2 * math.pi * NOISE**2)
        - 0.5 * (residual.square().sum() + (x.square() @ var).sum()) / NOISE**2
    )
    expected_prior = (
        -0.5 * math.log(2 * math.pi) - prior_scale.log()
        - 0.5 * ((loc - prior_loc).square() + var) / prior_scale.square()
    ).sum()
    entropy = (0.5 * math.log(2 * math.pi * math.e) + scale.log()).sum()
    return float(expected_lik + expected_prior + entropy)


def test_diagonal_laplace_and_mean_field_elbo_are_below_the_exact_evidence():
    x, y = correlated_design()
    m0, s0 = prior()
    mean, precision = exact_posterior(x, y, m0, s0)
    exact = exact_log_evidence(x, y, m0, s0)

    res = laplace(regression, x, y, curvature="hessian", num_steps=500, tol=1e-10)  # lr = 1 diverges
    print(f"\nlaplace: {res.num_steps} NGVI steps")
    assert res.converged
    assert torch.allclose(res.map["w"], mean, rtol=1e-8, atol=1e-10)
    assert torch.allclose(res.precision["w"], precision.diagonal(), rtol=1e-10)

    pyro.clear_param_store()
    guide = AutoNormal(regression)
    svi = SVI(regression, guide, NGVI(lr=0.5, beta=1.0), CurvatureELBO("hessian", deterministic=True))
    for _ in range(200):
        svi.step(x, y)
    loc, scale = (t.detach() for t in guide._get_loc_and_scale("w"))
    elbo = mean_field_elbo(x, y, loc, scale, m0, s0)

    laplace_gap, elbo_gap = exact - res.log_evidence, exact - elbo
    hadamard_gap = 0.5 * float(precision.diagonal().log().sum() - torch.logdet(precision))
    print(f"\nexact log evidence {exact:.6f}; gap of the diagonal Laplace evidence {laplace_gap:.6f}, "
          f"of the mean-field ELBO {elbo_gap:.6f}, 1/2 (sum log A_ii - log det A) {hadamard_gap:.6f}")
    assert res.log_evidence < exact and elbo < exact
    assert exact == pytest.approx(-211.965966, abs=1e-6)
    assert laplace_gap == pytest.approx(EVIDENCE_GAP, abs=1e-6)
    assert elbo_gap == pytest.approx(EVIDENCE_GAP, abs=1e-6)
    assert laplace_gap == pytest.approx(hadamard_gap, abs=1e-8)
    assert elbo_gap == pytest.approx(laplace_gap, abs=1e-8)


# ------------------------------------------------------------------ BackPACK network
def test_network_laplace_matches_torch_func_reference():
    """Tiny MLP, fast path: zero gradient at the MAP, GGN + prior precision, evidence formula."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(25, 3, generator=g), torch.randint(0, 3, (25,), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    alpha = 10.0
    bnn = BayesianNet(net, "categorical", num_data=25, prior=alpha**-0.5)
    res = laplace(bnn, x, y, curvature="ggn", num_steps=300)
    assert res.converged

    names = [k for k, _ in net.named_parameters()]
    theta = {k: res.map[k] for k in names}
    flat = torch.cat([t.flatten() for t in theta.values()])

    def unflatten(v):
        out, i = {}, 0
        for k in names:
            n = theta[k].numel()
            out[k] = v[i: i + n].view_as(theta[k])
            i += n
        return out

    def log_joint(v):
        logits = functional_call(net, unflatten(v), (x,))
        log_lik = torch.distributions.Categorical(logits=logits).log_prob(y).sum()
        return log_lik + torch.distributions.Normal(0.0, alpha**-0.5).log_prob(v).sum()

    grad = jacobian(log_joint, flat)
    scales = torch.cat([res.scale[k].flatten() for k in names])
    assert (grad.abs() * scales).max() < 1e-6  # a mode, in posterior std units
    # GGN diagonal: sum_i diag(J_i^T (diag p_i - p_i p_i^T) J_i)
    jac = jacobian(lambda v: functional_call(net, unflatten(v), (x,)), flat)  # (N, K, D)
    probs = torch.softmax(functional_call(net, unflatten(flat), (x,)), -1)
    output_hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    ggn = torch.einsum("nkd,nkl,nld->d", jac, output_hessian, jac)
    lam = torch.cat([res.precision[k].flatten() for k in names])
    assert torch.allclose(lam, ggn + alpha, rtol=1e-8)
    expected = float(log_joint(flat)) + 0.5 * float((2 * math.pi / lam).log().sum())
    assert res.log_evidence == pytest.approx(expected, abs=1e-8)


# --------------------------------------------------------------- prior precision
def test_prior_precision_by_evidence_picks_the_exact_argmax():
    x, y = orthogonal_design()  # diagonal posterior precision: the Laplace evidence is exact
    candidates = [0.01, 0.1, 1.0, 10.0, 100.0]

    def make_model(alpha):
        def model(x, y):
            w = pyro.sample("w", dist.Normal(0.0, alpha**-0.5).expand([4]).to_event(1))
            with pyro.plate("data", len(x)):
                pyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)

        return model

    def exact(alpha):
        return exact_log_evidence(x, y, torch.zeros(4), torch.full((4,), alpha**-0.5))

    best, evidence, res, chosen = optimize_prior_precision(make_model, candidates, x, y, curvature="hessian")
    for alpha in candidates:
        assert evidence[alpha] == pytest.approx(exact(alpha), abs=1e-6)
    assert best == max(candidates, key=exact) == 1.0
    mean, precision = exact_posterior(x, y, torch.zeros(4), torch.full((4,), best**-0.5))
    loc, scale = res.guide._get_loc_and_scale("w")  # the store holds the best candidate
    assert torch.allclose(loc, mean, rtol=1e-8)
    assert torch.allclose(scale, precision.diagonal().rsqrt(), rtol=1e-8)
    # the returned model is the one with the chosen prior
    trace = pyro.poutine.trace(chosen).get_trace(x, y)
    assert torch.allclose(trace.nodes["w"]["fn"].base_dist.scale, torch.full((4,), best**-0.5))

    # refit=False: one mean (the first candidate's mode), precision alpha + diag(X^T X) / s^2
    best_fixed, fixed_evidence, fixed, _ = optimize_prior_precision(
        make_model, candidates, x, y, curvature="ggn", refit=False
    )
    first_mean, _ = exact_posterior(x, y, torch.zeros(4), torch.full((4,), candidates[0] ** -0.5))
    assert torch.allclose(fixed.map["w"], first_mean, rtol=1e-8)
    assert torch.allclose(fixed.precision["w"], (x**2).sum(0) / NOISE**2 + best_fixed, rtol=1e-10)
    assert fixed_evidence[candidates[0]] == pytest.approx(evidence[candidates[0]], abs=1e-8)
    assert fixed_evidence[100.0] < evidence[100.0] - 1  # the evidence away from the mode is lower


def test_per_site_prior_precision_finds_the_product_grid_argmax():
    """
    Two sites, w1 (the columns of scale 3, 5) and w2 (2, 7), each with its own
    prior precision. With an orthogonal design the exact evidence is a sum of
    one term per coordinate, so one coordinate-ascent sweep must find the
    maximum over all 5 x 5 pairs, and every evidence must be exact.
    """
    x, _ = orthogonal_design()
    noise = NOISE * torch.randn(len(x), generator=torch.Generator().manual_seed(5))
    y = x @ torch.tensor([3.0, -2.0, 0.05, 0.02]) + noise  # w1 large, w2 small
    candidates = [0.01, 0.1, 1.0, 10.0, 100.0]

    def make_model(alphas):
        def model(x, y):
            w1 = pyro.sample("w1", dist.Normal(0.0, alphas["w1"] ** -0.5).expand([2]).to_event(1))
            w2 = pyro.sample("w2", dist.Normal(0.0, alphas["w2"] ** -0.5).expand([2]).to_event(1))
            with pyro.plate("data", len(x)):
                pyro.sample("y", dist.Normal(x[:, :2] @ w1 + x[:, 2:] @ w2, NOISE), obs=y)

        return model

    def exact(a1, a2):
        scale = torch.tensor([a1, a1, a2, a2]) ** -0.5
        return exact_log_evidence(x, y, torch.zeros(4), scale)

    best, evidence, res, chosen = optimize_prior_precision(
        make_model, candidates, x, y, curvature="hessian", sites=["w1", "w2"]
    )
    grid_best = max(((a1, a2) for a1 in candidates for a2 in candidates), key=lambda a: exact(*a))
    assert (best["w1"], best["w2"]) == grid_best
    assert grid_best[0] != grid_best[1]  # the test means something: the sites differ
    assert len(evidence) < 25  # fewer fits than the product grid
    for (a1, a2), value in evidence.items():
        assert value == pytest.approx(exact(a1, a2), abs=1e-6)
    assert res.log_evidence == pytest.approx(exact(*grid_best), abs=1e-6)
    trace = pyro.poutine.trace(chosen).get_trace(x, y)
    assert float(trace.nodes["w2"]["fn"].base_dist.scale[0]) == pytest.approx(best["w2"] ** -0.5)


# -------------------------------------------------------------------- behaviour
def test_stopping_early_warns_and_reports_it():
    x, y = correlated_design()
    with pytest.warns(LaplaceWarning, match="Newton step"):
        res = laplace(regression, x, y, curvature="hessian", num_steps=2)
    assert not res.converged and res.newton_step > 1e-6


def _eight_schools(y, s):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = pyro.sample("tau", dist.HalfCauchy(1.0))
    with pyro.plate("J", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, s), obs=y)


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_a_model_without_a_mode_is_reported_with_the_site_that_ran_off(covariance):
    """Centred eight schools: with the log-Jacobian, F falls without bound as log tau -> -inf (a
    funnel). The diagonal search stopped at log tau = -38.9 (precision 4e34) advising more steps; the
    full one died in Pyro's validation of Normal(theta, 0) naming neither the site nor the cause."""
    y = torch.tensor([2.8, 0.8, -0.3, 0.7, -0.1, 0.1, 1.8, 1.2], dtype=torch.float64)
    s = torch.tensor([1.5, 1.0, 1.6, 1.1, 0.9, 1.1, 1.0, 1.8], dtype=torch.float64)
    if covariance == "diagonal":
        with pytest.warns(LaplaceWarning, match=r"The mean of 'tau' is beyond \|u\| = 30.*funnel"):
            result = laplace(_eight_schools, y, s)
        assert not result.converged and result.map["tau"] < -30
    else:
        with pytest.raises(ValueError, match=r"(?s)cannot be evaluated at the current mean.*The mean of 'tau'"):
            laplace(_eight_schools, y, s, covariance="full")


def test_num_steps_zero_takes_the_guide_mean_as_given():
    x, y = orthogonal_design()
    guide = AutoNormal(regression, init_loc_fn=init_to_value(values={"w": torch.ones(4)}))
    res = laplace(regression, x, y, curvature="ggn", guide=guide, num_steps=0)
    assert torch.equal(res.map["w"], torch.ones(4)) and res.num_steps == 0 and not res.converged


def test_error_cases():
    x, y = orthogonal_design()
    with pytest.raises(ValueError, match="reparam"):
        laplace(regression, x, y, curvature="reparam")
    with pytest.raises(ValueError, match="curvature must be one of"):
        laplace(regression, x, y, curvature="kfac")
    with pytest.raises(NotImplementedError, match="AutoNormal"):
        laplace(regression, x, y, guide=AutoDiagonalNormal(regression))
    with pytest.raises(ValueError, match="covariance='full' needs an AutoMultivariateNormal"):
        laplace(regression, x, y, guide=AutoNormal(regression), covariance="full")
    for candidates in ([], [1.0, -2.0], [math.nan], "ab", None, [1.0, "2"], True):
        with pytest.raises(ValueError, match="candidates"):
            optimize_prior_precision(lambda alpha: regression, candidates, x, y)
    for name, value in (("refit", "no"), ("callback", 3)):  # (refused before any fit)
        with pytest.raises(ValueError, match=name):
            optimize_prior_precision(lambda alpha: regression, [1.0], x, y, **{name: value})
    with pytest.raises(ValueError, match="curvature must be one of"):
        laplace(regression, x, y, curvature=["ggn"])
    with pytest.raises(ValueError, match="line_search"):
        laplace(regression, x, y, line_search="yes")
    with pytest.raises(ValueError, match=r"momentum must be a finite number in \[0.0, 1.0\)"):
        laplace(regression, x, y, momentum=1.0)

    def local(x, idx):
        with pyro.plate("rows", len(x), subsample=idx):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=x[idx])

    with pytest.raises(NotImplementedError, match="subsampled"):
        laplace(local, y, torch.arange(5))

    def heavy_tailed(y):  # the Hessian is negative far from the data
        w = pyro.sample("w", dist.Normal(0.0, 100.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.StudentT(1.0, w, 0.1), obs=y)

    far = AutoNormal(heavy_tailed, init_loc_fn=init_to_value(values={"w": torch.tensor(5.0)}))
    with pytest.raises(ValueError, match="not positive"):
        laplace(heavy_tailed, torch.zeros(3), guide=far, num_steps=0)


def test_numpy_scalars_are_numbers():
    x, y = orthogonal_design()
    result = laplace(regression, x, y, curvature="hessian", lr=np.float32(1.0), tol=np.float64(1e-6),
                     num_steps=np.int64(5))
    pyro.clear_param_store()
    reference = laplace(regression, x, y, curvature="hessian", lr=1.0, tol=1e-6, num_steps=5)
    assert torch.equal(result.map["w"], reference.map["w"])


def test_a_per_site_search_for_a_site_the_model_has_not_is_refused():
    x, y = orthogonal_design()
    with pytest.raises(ValueError, match=r"sites: \['W'\] are not latent sites.*\['w'\]"):
        optimize_prior_precision(lambda alpha: regression, [1.0, 2.0], x, y, sites=["W"])


@pytest.mark.parametrize("sites", [[], ["w", "w"], [3], -1.0, True])  # (a number: TypeError "not iterable")
def test_per_site_search_rejects_bad_site_lists(sites):
    x, y = orthogonal_design()
    with pytest.raises(ValueError, match="sites"):
        optimize_prior_precision(lambda a: regression, [1.0], x, y, sites=sites)


def test_laplace_on_a_network_raises_no_warning_of_ngvi_s_elbo_watch():
    """laplace's line search judges its steps by F; the deterministic ELBO's loss (F plus a KL that
    grows with the precision) rose over the run and set off NGVI's warning to lower an lr the user
    never chose."""
    import warnings

    from pyro_ngvi import NGVIWarning

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(60, 5, generator=generator, dtype=torch.float64)
    y = x[:, 0] * 0.7 - x[:, 1] + 0.3 * torch.randn(60, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    bnn = BayesianNet(net, "gaussian", num_data=60, prior=0.8, noise_scale=0.7)
    pyro.clear_param_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        laplace(bnn, x, y, curvature="ggn", num_steps=1000)
    assert not [w for w in caught if issubclass(w.category, NGVIWarning) and "ELBO" in str(w.message)]


def test_laplace_of_a_subset_of_a_bayesian_nets_data_warns_and_scales_to_num_data():
    """A BayesianNet scales its minibatch likelihood by num_data / len(x): laplace on 20 of its 40
    rows is the Laplace approximation of that scaled likelihood, not of the data set (said, not silent)."""
    x, y = orthogonal_design()
    torch.manual_seed(0)
    bnn = BayesianNet(nn.Linear(x.shape[1], 1, bias=False).double(), "gaussian", num_data=len(x), prior=2.0,
                      noise_scale=0.5)
    pyro.clear_param_store()
    with pytest.warns(LaplaceWarning, match=f"x has 20 rows, the model's num_data is {len(x)}"):
        subset = laplace(bnn, x[:20], y[:20], curvature="ggn", num_steps=50)
    # the precision of the scaled subset: 1/s0^2 + (N/B) x_B^T x_B / sigma^2
    expected = 1 / 2.0 ** 2 + (len(x) / 20) * (x[:20] ** 2).sum(0) / 0.5 ** 2
    assert torch.allclose(next(iter(subset.precision.values())).reshape(-1), expected, rtol=1e-6)
    pyro.clear_param_store()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", LaplaceWarning)
        laplace(bnn, x, y, curvature="ggn", num_steps=50)  # the whole data set: no warning


def test_laplace_of_a_net_that_learns_its_prior_converges_to_the_evidence_s_stationary_prior():
    """With learn_prior the prior's closed-form update moves F between steps; the line search (which
    compares F at one prior) halved lr to nothing and warned 'not converged' after every step."""
    import warnings

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 0.2, 0.0]) + 0.5 * torch.randn(40, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    bnn = BayesianNet(nn.Linear(4, 1, bias=False).double(), "gaussian", num_data=40, prior=2.0,
                      noise_scale=0.5, learn_prior=True)
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LaplaceWarning)
        result = laplace(bnn, x, y, curvature="ggn", num_steps=200)
    assert result.converged
    mean, precision = next(iter(result.map.values())), next(iter(result.precision.values()))
    # d log Z / d alpha = 0 at the mode: alpha = P / (|mu|^2 + tr Sigma), Sigma the diagonal posterior
    alpha = mean.numel() / (mean.square().sum() + precision.reciprocal().sum())
    assert torch.allclose(pyro.param("weight.prior_scale").detach() ** -2, alpha, rtol=1e-4)
    # and the precision is the GGN at that prior: alpha + x^T x / sigma^2
    assert torch.allclose(precision.reshape(-1), alpha + (x ** 2).sum(0) / 0.5 ** 2, rtol=1e-4)


def test_a_prior_precision_search_whose_models_ignore_alpha_warns():
    """make_model(alpha) that never puts alpha into the prior gives every candidate one evidence: the
    search picked the first, silently."""
    x, y = orthogonal_design()

    def make_model(alpha):  # (the bug: a fixed prior scale)
        def model(x, y):
            w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
            with pyro.plate("data", len(x)):
                pyro.sample("y", dist.Normal(x @ w, NOISE), obs=y)
        return model

    with pytest.warns(LaplaceWarning, match="all 3 candidates gave the same evidence"):
        optimize_prior_precision(make_model, [0.1, 1.0, 10.0], x, y, curvature="hessian")
