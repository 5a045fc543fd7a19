"""A hand-written guide whose structure changes between steps (a site present on every other
step): the step of the larger structure copies its sites' sigma into its own buffer, which one of
them may still view (torch refused the concatenation with a RuntimeError on the third step), and
both sites reach their exact posteriors."""

import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO

from pyro_ngvi import NGVI

N = 40


def test_site_present_on_every_other_step():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, generator=generator)
    y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(N, generator=generator)
    z = 0.7 + 0.5 * torch.randn(10, generator=generator)

    def model(flag):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("d", N):
            pyro.sample("obs", dist.Normal((x * w).sum(-1), 0.5), obs=y)
        if flag:
            off = pyro.sample("off", dist.Normal(0.0, 1.0))
            with pyro.plate("e", 10):
                pyro.sample("obs2", dist.Normal(off, 0.5), obs=z)

    def guide(flag):
        loc = pyro.param("wl", torch.zeros(2))
        scale = pyro.param("ws", torch.full((2,), 0.3), constraint=dist.constraints.positive)
        pyro.sample("w", dist.Normal(loc, scale).to_event(1))
        if flag:
            off_loc = pyro.param("ol", torch.tensor(0.0))
            off_scale = pyro.param("os", torch.tensor(0.3), constraint=dist.constraints.positive)
            pyro.sample("off", dist.Normal(off_loc, off_scale))

    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    for step in range(400):
        svi.step(step % 2 == 0)
    precision = torch.eye(2) + x.T @ x / 0.25
    mean = torch.linalg.solve(precision, x.T @ y / 0.25)
    sd = precision.diagonal() ** -0.5  # the mean-field optimum's
    assert ((pyro.param("wl").detach() - mean).abs() / sd).max() < 0.1
    torch.testing.assert_close(pyro.param("ws").detach(), sd, rtol=0.05, atol=0.0)
    off_precision = 1 + 10 / 0.25
    off_mean = z.sum() / 0.25 / off_precision
    assert abs(pyro.param("ol").item() - off_mean.item()) * off_precision**0.5 < 0.1
    assert abs(pyro.param("os").item() * off_precision**0.5 - 1) < 0.05
