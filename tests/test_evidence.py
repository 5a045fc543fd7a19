"""pyro_ngvi.evidence: the Laplace-GGN evidence of the prior precision against closed forms (issue 26)."""

import math

import pytest
import torch
from torch import nn

import pyro
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import BayesianNet
from pyro_ngvi.evidence import EvidencePrior, diagonal_ggn, evidence_precision, log_evidence


def orthogonal_regression(n=40, d=4, noise=0.5, seed=0):
    """y = X w + noise with orthogonal columns of X (X^T X diagonal, unequal norms)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    x = q * torch.tensor([3.0, 1.0, 0.5, 2.0], dtype=torch.float64)[:d]
    w = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w + noise * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def exact_log_marginal(x, y, alpha, noise):
    cov = noise**2 * torch.eye(len(y), dtype=x.dtype) + x @ x.T / alpha
    return float(torch.distributions.MultivariateNormal(torch.zeros_like(y), cov).log_prob(y))


def map_and_curvature(x, y, alpha, noise):
    h = (x.square().sum(0)) / noise**2  # the GGN diagonal = the exact Hessian of -log p(y | w)
    mu = torch.linalg.solve(x.T @ x / noise**2 + alpha * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y / noise**2)
    log_lik = float(torch.distributions.Normal(x @ mu, noise).log_prob(y).sum())
    return mu, h, log_lik


@pytest.mark.parametrize("alpha", [0.1, 1.0, 7.0])
def test_laplace_ggn_evidence_of_a_linear_gaussian_model_is_the_exact_marginal_likelihood(alpha):
    x, y = orthogonal_regression()
    mu, h, log_lik = map_and_curvature(x, y, alpha, 0.5)
    ours = log_evidence(log_lik, [mu], [torch.zeros(())], [alpha], [h])
    assert ours == pytest.approx(exact_log_marginal(x, y, alpha, 0.5), abs=1e-9)


def test_evidence_precision_solves_mackays_fixed_point_and_maximises_the_exact_evidence():
    x, y = orthogonal_regression()
    alpha = 1.0
    for _ in range(200):  # MacKay's iteration: refit the mode, then the closed-form precision
        mu, h, _ = map_and_curvature(x, y, alpha, 0.5)
        alpha = float(evidence_precision(mu.square().sum(), h))
    mu, h, _ = map_and_curvature(x, y, alpha, 0.5)
    gamma = float((h / (alpha + h)).sum())
    assert alpha * float(mu.square().sum()) == pytest.approx(gamma, rel=1e-9)
    grid = torch.logspace(-2, 2, 801, dtype=torch.float64)
    best = float(grid[torch.tensor([exact_log_marginal(x, y, float(a), 0.5) for a in grid]).argmax()])
    assert math.log(alpha) == pytest.approx(math.log(best), abs=0.01)  # the grid's step: 0.0115 in log alpha


def test_evidence_precision_is_the_root_at_fixed_mean_and_curvature():
    h = torch.tensor([0.0, 0.5, 3.0, 100.0], dtype=torch.float64)
    alpha = float(evidence_precision(torch.tensor(2.0), h))
    assert alpha * 2.0 == pytest.approx(float((h / (alpha + h)).sum()), rel=1e-10)


def test_diagonal_ggn_of_a_bayesian_net_is_the_brute_force_gauss_newton_diagonal():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 4, (30,))
    bnn = BayesianNet(net, "categorical", num_data=60)
    weights = [torch.randn_like(p) * 0.5 for p in net.parameters()]
    log_lik, ggn = diagonal_ggn(bnn, weights, x, y)
    names = [k for k, _ in net.named_parameters()]

    def logits(*ws):
        return torch.func.functional_call(net, dict(zip(names, ws)), (x,))

    jac = torch.func.jacrev(logits, argnums=tuple(range(len(weights))))(*weights)
    probs = torch.softmax(logits(*weights), -1)
    hess = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]  # (n, K, K)
    for j, (weight, h) in enumerate(zip(weights, ggn)):
        jj = jac[j].reshape(30, 4, -1)
        exact = torch.einsum("nkp,nkl,nlp->p", jj, hess, jj).reshape(weight.shape)
        assert torch.allclose(h, 2.0 * exact, rtol=1e-8, atol=1e-12)  # scaled to N = 60 from 30
    exact_log_lik = -torch.nn.functional.cross_entropy(logits(*weights), y, reduction="sum")
    assert log_lik == pytest.approx(2.0 * float(exact_log_lik), rel=1e-10)


def test_evidence_prior_sets_each_layers_prior_and_ngvi_reads_it():
    pyro.clear_param_store()
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(50, 4)
    y = (x[:, 0] > 0).float()
    bnn = BayesianNet(net, "bernoulli", num_data=50)
    guide = bnn.guide()
    guide(x, y)
    evidence = EvidencePrior(bnn, guide)
    alphas = evidence.update(x, y)
    assert set(alphas) == set(bnn.latent_sites)
    assert alphas["0.weight"] == alphas["0.bias"] and alphas["2.weight"] == alphas["2.bias"]  # per layer
    for site, alpha in alphas.items():
        assert float(bnn.prior(site)[1]) == pytest.approx(alpha**-0.5, rel=1e-6)
        assert float(bnn._weight_prior().site_precisions[bnn.latent_sites.index(site)].flatten()[0]) == \
            pytest.approx(alpha, rel=1e-5)
    assert math.isfinite(evidence.log_evidence)
