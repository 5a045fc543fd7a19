"""
Guide params frozen with ``requires_grad_(False)``: as torch's optimizers (and Pyro's Adam) leave a
tensor without a gradient, NGVI leaves a site frozen whole as it is and trains the rest of the guide
(it refused every step: "found no gradient for guide site"); of a site frozen in part, the point
optimizer trains the rest, with a warning.
"""

import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO, NGVIWarning

N, NOISE = 40, 0.5
X = torch.randn(N, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = X @ torch.tensor([1.0, -1.0], dtype=torch.float64) + NOISE * torch.randn(
    N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def model(x, y=None):
    a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("data", N):
        pyro.sample("obs", dist.Normal(a * x[:, 0] + b * x[:, 1], NOISE), obs=y)


def posterior_of_b(a):
    """The exact posterior of b given a (closed form): with a fixed, b's is the guide's optimum."""
    precision = 1.0 + X[:, 1].square().sum() / NOISE**2
    return ((Y - a * X[:, 0]) * X[:, 1]).sum() / NOISE**2 / precision, precision.rsqrt()


def two_parts(first):
    guide = AutoGuideList(model)
    guide.append(first(poutine.block(model, expose=["a"])))
    guide.append(AutoNormal(poutine.block(model, expose=["b"])))
    guide(X, Y)
    return guide


def frozen_part(how):
    """The guide, the tensors frozen, b's (loc, scale) and the value of a."""
    store = pyro.get_param_store()._params
    if how in ("AutoNormal part", "AutoDiagonalNormal part"):
        guide = two_parts(AutoNormal if how == "AutoNormal part" else AutoDiagonalNormal)
        guide[0].requires_grad_(False)
        return guide, list(guide[0].parameters()), lambda: guide[1]._get_loc_and_scale("b"), \
            lambda: guide[0].median()["a"]
    guide = AutoNormal(model)  # one guide, the site a's params frozen
    guide(X, Y)
    frozen = [store["AutoNormal.locs.a"], store["AutoNormal.scales.a"]]
    for p in frozen:
        p.requires_grad_(False)
    return guide, frozen, lambda: guide._get_loc_and_scale("b"), lambda: guide.median()["a"]


@pytest.mark.parametrize("how, loss", [("AutoNormal part", Trace_ELBO), ("AutoDiagonalNormal part", Trace_ELBO),
                                       ("site", Trace_ELBO), ("site", lambda: CurvatureELBO("hessian"))])
def test_a_guide_part_frozen_stays_and_the_others_reach_their_posterior(how, loss):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide, frozen, b_of, a_of = frozen_part(how)
    kept = [p.detach().clone() for p in frozen]
    svi = SVI(model, guide, NGVI(), loss())
    with warnings.catch_warnings():
        warnings.simplefilter("error", NGVIWarning)
        for _ in range(100):
            svi.step(X, Y)
    assert all(torch.equal(p, q) for p, q in zip(frozen, kept))
    mean, sd = posterior_of_b(a_of())
    loc, scale = (t.detach() for t in b_of())
    assert abs(float(loc - mean)) < 0.05 * float(sd)
    assert abs(float(scale / sd) - 1.0) < 0.02
    for p in frozen:  # thawed: NGVI steps it again
        p.requires_grad_(True)
    svi.step(X, Y)
    assert not all(torch.equal(p, q) for p, q in zip(frozen, kept))


def test_a_site_frozen_in_part_has_the_rest_trained_by_the_point_optimizer():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = two_parts(AutoNormal)
    guide(X, Y)
    scale = pyro.get_param_store()._params["AutoGuideList.1.scales.b"]
    scale.requires_grad_(False)
    kept = scale.detach().clone()
    mean, _ = posterior_of_b(guide[0].median()["a"])
    start = abs(float(guide[1].locs.b.detach() - mean))
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NGVIWarning, match="'b' have some of their params frozen"):
        svi.step(X, Y)
    for _ in range(100):
        svi.step(X, Y)
    assert torch.equal(scale.detach(), kept)
    assert abs(float(guide[1].locs.b.detach() - posterior_of_b(guide[0].median()["a"])[0])) < 0.5 * start
