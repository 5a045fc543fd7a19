"""What an outsider trying the network API ran into: a BayesianNet with guides its fast path does
not take, the Laplace approximation of a net with a dense precision, a tied layer in a network of
a class of its own, and one-class logits."""

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO, laplace


@pytest.fixture(autouse=True)
def clean_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def linear_regression(n=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 + 0.5 * torch.randn(
        n, generator=generator, dtype=torch.float64)
    return x, y


@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_full_covariance_laplace_of_a_linear_gaussian_net_is_the_exact_posterior_and_evidence(curvature):
    """laplace(bnn, curvature="ggn", covariance="full") raised NotImplementedError ('the BayesianNet
    fast path needs an AutoNormal guide ... give SVI a wrapper'), though laplace makes the guide and
    the SVI itself; the traced path now serves the AutoMultivariateNormal: exact to 1e-10."""
    x, y = linear_regression()
    alpha, noise = 2.0, 0.5
    bnn = BayesianNet(nn.Linear(3, 1).double(), "gaussian", num_data=len(x), prior=alpha**-0.5, noise_scale=noise)
    result = laplace(bnn, x, y, curvature=curvature, covariance="full")

    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # (weight, bias)
    precision = alpha * torch.eye(4, dtype=x.dtype) + design.T @ design / noise**2
    mean = torch.linalg.solve(precision, design.T @ y / noise**2)
    marginal = dist.MultivariateNormal(torch.zeros(len(x), dtype=x.dtype),
                                       design @ design.T / alpha + noise**2 * torch.eye(len(x), dtype=x.dtype))
    assert result.converged and result.full_covariance
    (found,) = result.precision.values()
    torch.testing.assert_close(found, precision, rtol=1e-10, atol=1e-10)
    (mode,) = result.map.values()
    torch.testing.assert_close(mode, mean, rtol=1e-10, atol=1e-10)
    assert result.log_evidence == pytest.approx(marginal.log_prob(y).item(), abs=1e-10)


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam"])
def test_a_bayesian_net_trains_an_automultivariatenormal_as_its_wrapper_does(source):
    """SVI(bnn, AutoMultivariateNormal(bnn), NGVI(), CurvatureELBO(source)) raised for every fast-path
    source; it now takes the traced path, the steps a wrapper with the net's hints takes, bit for bit."""
    x, y = linear_regression(n=32)
    y = (y > 0).double()

    def run(wrap):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        bnn = BayesianNet(net, "bernoulli", num_data=64)
        model = bnn
        if wrap:
            def model(x, y=None):
                return bnn(x, y)
            model.statistics_hints = bnn.statistics_hints
        guide = AutoMultivariateNormal(model)
        svi = SVI(model, guide, NGVI(), CurvatureELBO(source))
        losses = [svi.step(x, y) for _ in range(4)]
        return losses, guide.loc.detach().clone(), guide.scale_tril.detach().clone()

    direct, wrapped = run(False), run(True)
    assert direct[0] == wrapped[0]
    assert torch.equal(direct[1], wrapped[1]) and torch.equal(direct[2], wrapped[2])


def test_laplace_refuses_dropout_in_training_mode_and_in_eval_mode_is_the_net_without_it():
    """A network fresh from its constructor is in training mode: laplace of one with Dropout searched
    a random log joint, halved lr to 8e-34 and reported an evidence of -507 (-275 in eval mode on
    200 digits) with the advice to raise num_steps. It is refused now, naming the module; in eval mode
    the result is that of the same net without the Dropout."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(60, 5, generator=generator, dtype=torch.float64)
    y = (x[:, 0] - x[:, 1] > 0).double()

    def fit(dropout, train):
        pyro.clear_param_store()
        torch.manual_seed(0)
        layers = [nn.Linear(5, 3), nn.Tanh()] + ([nn.Dropout(0.3)] if dropout else []) + [nn.Linear(3, 1)]
        bnn = BayesianNet(nn.Sequential(*layers).double(), "bernoulli", num_data=len(x))
        bnn.train(train)
        return laplace(bnn, x, y, curvature="ggn", tol=1e-3)

    with pytest.raises(ValueError, match=r"laplace: the model runs net\.2 \(Dropout\) in training mode.*eval\(\)"):
        fit(dropout=True, train=True)
    with_dropout, without = fit(dropout=True, train=False), fit(dropout=False, train=True)
    assert with_dropout.converged and without.converged
    assert with_dropout.log_evidence == pytest.approx(without.log_evidence, abs=1e-9)


def test_share_at_the_noise_limit_refuses_a_tolerance_of_one_or_more_and_other_guides():
    """share_at_noise_limit compared sigma^2 / cap^2 with (1 - tolerance)^2: a tolerance of 2 (every
    sigma within it) counted as one of 0 and gave 0.0 where 1.0 was meant. Tolerances outside (0, 1)
    are refused now, and so are guides it cannot read (a KroneckerNormal raised AttributeError)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    bnn = BayesianNet(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "categorical", num_data=32)
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))
    for _ in range(3):
        svi.step(x, y)
    at = total = 0
    for site in bnn.latent_sites:
        scale, cap = guide._get_loc_and_scale(site)[1].detach(), bnn.max_scale(site)
        at, total = at + int((scale >= 0.5 * cap).sum()), total + scale.numel()
    assert 0 < at < total
    assert bnn.share_at_noise_limit(guide, tolerance=0.5) == pytest.approx(at / total, abs=1e-12)
    for bad in (1.0, 2.0):
        with pytest.raises(ValueError, match=r"tolerance must lie in \(0, 1\)"):
            bnn.share_at_noise_limit(guide, tolerance=bad)
    with pytest.raises(TypeError, match="guide must be this net's mean-field guide"):
        bnn.share_at_noise_limit(AutoMultivariateNormal(bnn))


@pytest.mark.parametrize("sites", [3, 1.5, True])
def test_posterior_as_prior_names_sites_that_are_not_names(sites):
    """posterior_as_prior(guide, sites=3) raised TypeError "'int' object is not iterable", naming
    nothing; it names sites now. A name or a list of names still works (the guide's own numbers)."""
    from pyro_ngvi import posterior_as_prior
    x, y = linear_regression(n=16)
    bnn = BayesianNet(nn.Linear(3, 1).double(), "gaussian", num_data=16, noise_scale=0.5)
    guide = bnn.guide()
    guide(x, y)
    with pytest.raises(TypeError, match="posterior_as_prior: sites must be a site name or a list"):
        posterior_as_prior(guide, sites=sites)
    loc, scale = guide._get_loc_and_scale("weight")
    prior = posterior_as_prior(guide, sites="weight")["weight"]
    assert torch.equal(prior.mean, loc.detach()) and torch.equal(prior.stddev, scale.detach())


class PerPosition(nn.Module):
    """Class logits per position of a sequence: (B, T, 4) -> (B, T, 3)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


@pytest.mark.parametrize("kind", ["own class", "sequential"])
@pytest.mark.parametrize("source", ["ef", "reparam"])
def test_categorical_logits_per_position_take_the_fast_path_with_first_order_sources(kind, source):
    """A categorical net with logits (B, T, K) and targets (B, T), which the model and the traced path
    take, crashed on the fast path with every source (CrossEntropyLoss: 'Expected target size [8, 3],
    got [8, 5]': the classes go second there); ef and reparam now get g and h of autograd's per-example
    (per-sequence) gradients at the same draw (to 1e-10); ggn / ggn_mc, which need (B, K), say so."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    net = (PerPosition() if kind == "own class" else nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    bnn = BayesianNet(net.double(), "categorical", num_data=20)
    x, y = torch.randn(8, 6, 4, dtype=torch.float64), torch.randint(0, 3, (8, 6))
    guide = bnn.guide()
    guide(x, y)
    loc_scale = {site: tuple(t.detach() for t in guide._get_loc_and_scale(site)) for site in bnn.latent_sites}
    torch.manual_seed(1)
    bnn.curvature_step(guide, x, y, source, deterministic=source == "ef")
    torch.manual_seed(1)
    noises = {s: torch.zeros_like(m) if source == "ef" else torch.randn_like(m) for s, (m, _) in loc_scale.items()}
    weights = {s: m + sd * noises[s] for s, (m, sd) in loc_scale.items()}

    def nll(params, x, y):
        return -dist.Categorical(logits=functional_call(bnn.net, params, (x,))).log_prob(y).sum()

    scale = 20 / 8
    gradient = grad(nll)(weights, x, y)
    per_example = vmap(grad(nll), in_dims=(None, 0, 0))(weights, x.unsqueeze(1), y.unsqueeze(1))
    store = pyro.get_param_store()
    from pyro_ngvi.family import pop_curvature
    for site, (_, sd) in loc_scale.items():
        stats = pop_curvature(store[f"AutoNormal.locs.{site}"])
        curvature = (scale * per_example[site].pow(2).sum(0) if source == "ef"
                     else scale * gradient[site] * noises[site] / sd)
        torch.testing.assert_close(stats.grad, scale * gradient[site], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(stats.curvature, curvature, rtol=1e-10, atol=1e-10)
    pyro.clear_param_store()
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ggn"))
    with pytest.raises(NotImplementedError, match=r"'ggn' curvature needs class logits of shape \(B, K\).*'ef'"):
        svi.step(x, y)
