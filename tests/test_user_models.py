"""
Issue 23's two user models, against exact posterior means (benchmarks/user_models.py runs them
at full size with ClippedAdam, recipe (b) and a NUTS reference):

* a ``PyroModule`` linear regression on the standardised diabetes data (10 correlated
  coefficients, a learned noise scale, ``AutoNormal``); exact means by quadrature over the noise
  scale of the conjugate posterior given it;
* a hierarchical model with subsampled local latents (groups in minibatches, ``AutoNormal`` with
  ``create_plates`` on the same indices); exact Gaussian posterior in closed form.

Criterion: every latent coordinate's guide mean within 0.1 exact posterior sd of its exact mean.
"""


import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

from pyro_ngvi import NGVI

F64 = torch.float64


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(F64)  # (conftest restores the default)


# ------------------------------------------------------------------ the regression
def diabetes():
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=F64), torch.tensor(y, dtype=F64)
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


class Regression(PyroModule):
    def __init__(self, features):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](features, 1).double()
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def regression_exact(x, y, grid=2000):
    """Means and sds of (weight, bias, logit(sigma / 10)): quadrature over sigma (flat prior)
    of the Gaussian posterior given sigma, p(sigma | y) from the marginal likelihood."""
    n, d = x.shape
    design = torch.cat([x, torch.ones(n, 1)], 1)
    prior_var = torch.cat([torch.ones(d), torch.tensor([100.0])])
    values, vectors = torch.linalg.eigh(design @ torch.diag(prior_var) @ design.T)
    rotated = (vectors.T @ y) ** 2
    sigmas = torch.linspace(0.5, 1.0, grid)
    total = values[None, :] + sigmas[:, None] ** 2
    log_post = -0.5 * (total.log().sum(1) + (rotated / total).sum(1))
    weights = (log_post - log_post.logsumexp(0)).exp()
    assert weights[0] < 1e-12 and weights[-1] < 1e-12
    covs = torch.linalg.inv(design.T @ design / sigmas[:, None, None] ** 2 + torch.diag(1 / prior_var))
    means = covs @ (design.T @ y) / sigmas[:, None] ** 2
    mean = (weights[:, None] * means).sum(0)
    var = (weights[:, None] * (covs.diagonal(dim1=1, dim2=2) + means**2)).sum(0) - mean**2
    u = torch.logit(sigmas / 10)
    u_mean = (weights * u).sum()
    u_var = (weights * (u - u_mean) ** 2).sum()
    return torch.cat([mean, u_mean[None]]), torch.cat([var, u_var[None]]).sqrt()


def regression_means():
    store = pyro.get_param_store()
    return torch.cat([store["AutoNormal.locs.linear.weight"].detach().reshape(-1),
                      store["AutoNormal.locs.linear.bias"].detach().reshape(-1),
                      store["AutoNormal.locs.sigma"].detach().reshape(-1)])


def test_regression_reference_is_the_conjugate_posterior_where_sigma_is_known():
    """The quadrature's inner posterior is the exact conjugate one: with the marginal weights
    concentrated, its mean is the conjugate mean at the posterior's sigma (to 1 % of an sd)."""
    x, y = diabetes()
    mean, sd = regression_exact(x, y)
    sigma = 10 * torch.sigmoid(mean[-1])
    design = torch.cat([x, torch.ones(len(x), 1)], 1)
    precision = design.T @ design / sigma**2 + torch.diag(torch.cat([torch.ones(10), torch.tensor([0.01])]))
    conjugate = torch.linalg.solve(precision, design.T @ y / sigma**2)
    assert ((mean[:-1] - conjugate) / sd[:-1]).abs().max() < 0.01
    assert 0.65 < sigma < 0.75  # the residual scale of a linear fit to diabetes (R^2 ~ 0.52)


def test_diabetes_regression_ngvi_reaches_the_exact_means():
    """NGVI() with no settings gets every mean within 0.1 posterior sd of the exact one (the
    mean step coupled by the cross terms' Hessian estimate: 750-1000 steps on 3 seeds, see
    benchmarks/results/user_models.md; the element-wise step was still 0.4-0.74 sd away after
    2,000, the best decayed ClippedAdam 0.30)."""
    x, y = diabetes()
    mean, sd = regression_exact(x, y)
    model = Regression(x.shape[1])
    svi = SVI(model, AutoNormal(model), NGVI(), Trace_ELBO())
    errors = []
    for step in range(1200):
        svi.step(x, y)
        if step % 100 == 99:
            errors.append(float(((regression_means() - mean) / sd).abs().max()))
    assert errors[-1] < 0.1 and errors[-2] < 0.1  # there and staying
    # ... and a slow problem at first: 100 steps are not enough (with the carried excess of the curvature
    # targets at most n lambda / 2, 0.18 sd at step 400, 0.1 from step ~600; 1.28 and ~1,000 before)
    assert errors[0] > 0.5


# ------------------------------------------------------------------ the hierarchical model
GROUPS, PER_GROUP, BATCH = 40, 5, 10


def hierarchical_model(y, idx):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("groups", GROUPS, subsample=idx):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        with pyro.plate("obs", PER_GROUP, dim=-2):
            pyro.sample("y", dist.Normal(theta, 1.0), obs=y[:, idx])


def hierarchical_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = 3.0 + torch.randn(GROUPS, generator=g, dtype=F64)
    return theta + torch.randn(PER_GROUP, GROUPS, generator=g, dtype=F64)


def hierarchical_exact(y):
    """The exact posterior of (mu, theta), from the dense precision of the joint Gaussian."""
    precision = torch.zeros(GROUPS + 1, GROUPS + 1)
    precision[0, 0] = 1 / 100 + GROUPS
    precision[0, 1:] = precision[1:, 0] = -1.0
    precision[1:, 1:] = torch.eye(GROUPS) * (1.0 + PER_GROUP)
    covariance = torch.linalg.inv(precision)
    rhs = torch.cat([torch.zeros(1), y.sum(0)])
    return covariance @ rhs, covariance.diagonal().sqrt()


def test_hierarchical_subsampled_ngvi_reaches_the_exact_means():
    """Minibatches of 10 of 40 groups (each local latent updated one step in four): NGVI() at its
    defaults puts every mean within 0.1 sd of the exact posterior's (0.056 sd after 400 steps,
    below 0.1 from step 300 on; at full size, 1,000 groups by 100, from step 1,830:
    benchmarks/user_models.py)."""
    y = hierarchical_data()
    mean, sd = hierarchical_exact(y)
    guide = AutoNormal(hierarchical_model, create_plates=lambda y, idx: pyro.plate("groups", GROUPS, subsample=idx))
    svi = SVI(hierarchical_model, guide, NGVI(), Trace_ELBO())
    order = torch.Generator().manual_seed(1)
    for _ in range(100):  # epochs of 4 minibatches
        for idx in torch.randperm(GROUPS, generator=order).split(BATCH):
            svi.step(y, idx)
    store = pyro.get_param_store()
    found = torch.cat([store["AutoNormal.locs.mu"].detach().reshape(1), store["AutoNormal.locs.theta"].detach()])
    assert ((found - mean) / sd).abs().max() < 0.1


@pytest.mark.parametrize("minibatch", ["subsample_size", "poutine.scale"])
def test_a_regression_minibatched_by_subsample_size_settles_on_its_posterior(minibatch):
    """Pyro's own minibatching, ``pyro.plate("data", N, subsample_size=B)``, of a model with global
    latents only: a minibatch adds a gradient noise of about N / B - 1 of the variance of one draw's
    (in standard deviations), which the adaptive steps' noise levels were capped below, so every
    minibatch read as a drift: the count fell back to 1 / beta again and again and the means
    wandered 1.2-5.4 sd from the exact ones for good (scales 0.4-3.4 times theirs). The plan reads
    N / B off the model (pyro_ngvi.guide_trace.subsampling) and the noise may be that large. A
    minibatch weighted by N / B by hand (``poutine.scale``, the same ELBO gradients) was not read
    as one: 1.3-5 sd off after 2,000 steps, scales 0.46-1.65 times the exact ones."""
    n, size, noise = 2000, 3, 0.5
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, size, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + noise * torch.randn(n, generator=g)
    precision = torch.eye(size) + x.T @ x / noise**2
    exact, sd = torch.linalg.solve(precision, x.T @ y / noise**2), precision.diagonal() ** -0.5

    def model(x, y, batch):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([size]).to_event(1))
        if minibatch == "poutine.scale":
            idx = torch.randperm(n)[:batch]
            with pyro.plate("data", batch), poutine.scale(scale=n / batch):
                pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), noise), obs=y[idx])
            return
        with pyro.plate("data", n, subsample_size=batch) as idx:
            pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), noise), obs=y[idx])

    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    errors, ratios = [], []
    for step in range(1, 1201):
        svi.step(x, y, 100)
        if step % 300 == 0:
            errors.append(float(((guide.locs.w.detach() - exact) / sd).abs().max()))
            ratios.append(guide.scales.w.detach() / sd)
    assert max(errors[1:]) < 0.8, errors  # (0.31, 0.30, 0.41 at steps 600, 900, 1200)
    assert all(((r > 0.8) & (r < 1.25)).all() for r in ratios[1:]), ratios


def minibatched(how, n=2000, batch=100):
    """A regression on 3 weights whose rows are minibatched ``how``, and its data."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    x = x + 0.9 * x[:, :1]  # (correlated weights: the coupled step reads the plan's N / B)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(n, generator=g)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        if how == "poutine.scale":
            idx = torch.randperm(n)[:batch]
            with pyro.plate("data", batch), poutine.scale(scale=n / batch):
                pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), 0.5), obs=y[idx])
        elif how == "both":  # (a subsampled plate, and a likelihood tempered by hand)
            with pyro.plate("data", n, subsample_size=batch) as idx, poutine.scale(scale=2.0):
                pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), 0.5), obs=y[idx])
        else:
            with pyro.plate("data", n, subsample_size=batch if how == "subsample_size" else None) as idx:
                pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), 0.5), obs=y[idx])
    return model, x, y


@pytest.mark.parametrize("how, expected", [("subsample_size", 19.0), ("poutine.scale", 19.0), ("both", 39.0),
                                           ("none", 0.0)])
def test_the_plan_reads_n_over_b_of_a_minibatch_once(how, expected):
    """N / B - 1 of a minibatch, read off the model: a subsampled plate's own N / B was counted twice
    (the site's scale holds it already: 399 for 100 of 2,000); a scale set by hand on top multiplies."""
    from pyro_ngvi.guide_trace import subsampling

    model, x, y = minibatched(how)
    assert subsampling(model, x, y) == pytest.approx(expected)


def test_the_guide_given_to_ngvi_leaves_the_minibatch_read():
    """NGVI(guide=guide) takes NGVI()'s steps on a minibatched model (one draw: nothing else differs);
    its own step's frame was taken for SVI.step's, no model was found and N / B was read as 1."""
    model, x, y = minibatched("subsample_size")
    found = []
    for given in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        svi = SVI(model, guide, NGVI(guide=guide) if given else NGVI(), Trace_ELBO())
        for _ in range(60):
            svi.step(x, y)
        found.append(guide.locs.w.detach().clone())
    torch.testing.assert_close(found[1], found[0], rtol=0, atol=0)


def test_a_model_with_obs_mask_trains_and_its_flat_entries_stay_finite():
    """Pyro's obs_mask: the guide's ``y_unobserved`` latent holds an entry for every row, and the
    model depends only on the missing ones. The others have no curvature and no prior, so their
    precision falls towards 0; at sigma ~ 1e19 a draw overflowed the masked log density to NaN,
    every step was skipped and the run stopped with an error after 220 steps. The precision stays
    >= eps^2 now: no step is skipped, the shared mean is the exact posterior mean and the missing
    entries' scale the predictive sd."""
    n = 300
    generator = torch.Generator().manual_seed(0)
    data = 2.0 + torch.randn(n, generator=generator)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:3] = False

    def model(data, mask):
        mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        with pyro.plate("rows", n):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=data, obs_mask=mask)

    precision = 0.25 + int(mask.sum())
    exact = float(data[mask].sum()) / precision
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    optim = NGVI()
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(400):
        svi.step(data, mask)
    assert optim.num_skipped_steps == 0
    assert abs(float(guide.locs.mu.detach()) - exact) < 0.2 * precision ** -0.5
    scales = guide.scales.y_unobserved.detach()
    assert torch.allclose(scales[:3], torch.full((3,), (1 + 1 / precision) ** 0.5), rtol=0.1)
    assert torch.isfinite(scales).all() and scales.max() <= 1.001 / torch.finfo(scales.dtype).eps


def test_a_kl_weight_that_changes_between_steps_is_read_at_every_step():
    """KL annealing as in Pyro's VAE tutorial: poutine.scale(beta) on the latent in model and guide,
    beta a step argument. NGVI read a site's factor once, when it first saw the guide: after beta
    went from 0.5 to 1 the guide sat at 0.8x the exact sd (a ramp from 0.1 stopped the run). The
    factor is read again at every step for a guide whose factors are not 1."""
    torch.manual_seed(0)
    data = torch.randn(20) + 1.5

    def model(data, beta):
        with poutine.scale(scale=beta):
            mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        with pyro.plate("data", len(data)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=data)

    def guide(data, beta):
        loc = pyro.param("loc", torch.tensor(0.0))
        scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
        with poutine.scale(scale=beta):
            pyro.sample("mu", dist.Normal(loc, scale))

    precision = 0.25 + len(data)  # beta = 1: the exact posterior
    mean, sd = data.sum() / precision, precision**-0.5
    pyro.set_rng_seed(0)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    for step in range(600):
        svi.step(data, min(1.0, 0.1 + step / 300))
    assert abs(float(pyro.param("loc").detach()) - mean) / sd < 0.05
    assert abs(float(pyro.param("scale").detach()) / sd - 1) < 0.05
