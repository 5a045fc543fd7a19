"""One-draw NGVI on a correlated linear-Gaussian regression with AutoMultivariateNormal, against
the exact posterior: the precision's trust region must not turn the averaging of noisy Price
estimates into a random walk (it froze the mean 8 posterior sd away at D = 50, 22 at D = 100)."""
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_ngvi import NGVI


def correlated_regression(d, noise=0.5):
    """w ~ N(0, I_d), y ~ N(x w, noise^2), n = 2d rows 0.8-correlated with the first column; the
    exact posterior N(m, P^{-1}), P = I + x^T x / noise^2, m = P^{-1} x^T y / noise^2."""
    g = torch.Generator().manual_seed(d)
    base = torch.randn(2 * d, d, generator=g)
    x = base + 0.8 * base[:, :1]
    y = x @ torch.randn(d, generator=g) + noise * torch.randn(2 * d, generator=g)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(d), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(x @ w, noise).to_event(1), obs=y)

    xd = x.double()
    cov = torch.linalg.inv(torch.eye(d, dtype=torch.float64) + xd.T @ xd / noise ** 2)
    return model, cov @ xd.T @ y.double() / noise ** 2, cov


def test_one_draw_dense_steps_reach_the_exact_posterior_at_d50():
    d = 50
    model, mean, cov = correlated_regression(d)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(700):
            svi.step()
    posterior = guide.get_posterior()
    sd = cov.diagonal().sqrt()
    error = ((posterior.loc.detach().double() - mean).abs() / sd).max()
    ratio = posterior.covariance_matrix.detach().double().diagonal().sqrt() / sd
    assert error < 0.3, error  # (before: 7.3 posterior sd at step 700, 2.2 at step 2,000)
    assert 0.85 < float(ratio.min()) and float(ratio.max()) < 1.15, ratio
