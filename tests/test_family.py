"""
Which tensors NGVI treats as Gaussian sites: read off the guide's structure, never
off parameter names a user chooses (issue 12, sections 1, 2 and 4; issue 13, state
keyed by the site's tensor).
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal
from pyro.nn import PyroModule, PyroParam

from pyro_ngvi import NGVI
from pyro_ngvi.family import NotGaussianWarning, gaussian_sites

X = torch.linspace(-1.0, 1.0, 40, dtype=torch.float64)


def data(loc=2.0, scale=3.0, sigma=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return loc + scale * X + sigma * torch.randn(len(X), generator=g, dtype=torch.float64)


def named_like_a_guide(x, y):
    """The user's own parameters are called ``loc`` and ``scale``; only ``sigma`` is latent."""
    loc = pyro.param("loc", torch.tensor(0.0, dtype=torch.float64))
    scale = pyro.param("scale", torch.tensor(1.0, dtype=torch.float64), constraint=dist.constraints.positive)
    sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(loc + scale * x, sigma), obs=y)


def run(model, guide, optim, *args, steps):
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)
    return svi


def test_model_params_named_loc_and_scale_are_point_estimates_not_a_gaussian():
    y = data()
    guide = AutoNormal(named_like_a_guide)
    guide(X, y)
    assert [site.name for site in gaussian_sites(guide)] == ["sigma"]
    optim = NGVI(point_optim_args={"lr": 0.05})
    run(named_like_a_guide, guide, optim, X, y, steps=600)
    # least squares with this design: loc ~ 2, scale ~ 3, and sigma's posterior near 0.5
    assert pyro.param("loc").item() == pytest.approx(2.0, abs=0.15)
    assert pyro.param("scale").item() == pytest.approx(3.0, abs=0.25)
    assert guide.median()["sigma"].item() == pytest.approx(0.5, abs=0.15)


def test_point_parameters_take_exactly_the_point_optimizers_steps():
    """The model's ``loc``/``scale`` follow Adam's trajectory, bit for bit, beside NGVI's site."""
    y = data()
    trajectories = []
    for optim in (NGVI(point_optim_args={"lr": 0.05}), None):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide = AutoNormal(named_like_a_guide)
        if optim is None:  # the reference: Adam on the model's params, the guide held fixed
            guide(X, y)
            optim = pyro.optim.Adam({"lr": 0.05})
            model = named_like_a_guide
            svi = SVI(model, poutine.block(guide, hide_types=["param"]), optim, Trace_ELBO())
        else:
            svi = SVI(named_like_a_guide, guide, optim, Trace_ELBO())
        svi.step(X, y)
        trajectories.append((pyro.param("loc").item(), pyro.param("scale").item()))
    assert trajectories[0] == pytest.approx(trajectories[1], rel=1e-12)


def delta_model(y):
    loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(loc, scale), obs=y)


def test_autodelta_with_sites_named_loc_and_scale_is_a_point_estimate_with_a_warning():
    """Names are no evidence: an AutoDelta's sites 'loc' and 'scale' get the point optimizer
    (issue 23: trained, with one NotGaussianWarning naming them), never a Gaussian step."""
    y = data().float()
    guide = AutoDelta(delta_model)
    guide(y)
    svi = SVI(delta_model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="'loc' \\(it is a Delta.*'scale' \\(it is a Delta"):
        svi.step(y)
    assert gaussian_sites(guide, y) == []


def test_autoguidelist_of_autonormal_and_autodelta_parts():
    """NGVI for the Gaussian part, the point optimizer (MAP) for the AutoDelta part."""
    y = torch.tensor([0.3, 1.2, -0.5, 0.8, 0.1])
    guide = AutoGuideList(delta_model)
    guide.append(AutoNormal(poutine.block(delta_model, expose=["loc"])))
    guide.append(AutoDelta(poutine.block(delta_model, expose=["scale"])))
    guide(y)
    assert [site.name for site in gaussian_sites(guide, y)] == ["loc"]
    optim = NGVI(lr=0.2, beta=0.1, point_optim_args={"lr": 0.05})
    with pytest.warns(NotGaussianWarning, match="'scale' \\(it is a Delta"):
        run(delta_model, guide, optim, y, steps=1500)
    # scale by MAP given loc; loc's posterior given that scale is N(sum y / (n + s^2/100), ...)
    scale = pyro.param("AutoGuideList.1.scale").item()
    n = len(y)
    loc_mean = float(y.sum()) / (n + scale**2 / 100)
    assert pyro.param("AutoGuideList.0.locs.loc").item() == pytest.approx(loc_mean, abs=0.1)
    assert pyro.param("AutoGuideList.0.scales.loc").item() == pytest.approx(scale / n**0.5, rel=0.2)
    assert 0.3 < scale < 0.8  # the spread of y, pulled down a little by the LogNormal prior


def no_latent_model(x, y):
    a = pyro.param("a", torch.tensor(0.0))
    b = pyro.param("b", torch.tensor(1.0), constraint=dist.constraints.positive)
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(a * x, b), obs=y)


def test_model_without_latent_sites_trains_as_with_adam():
    x, y = X.float(), data().float()
    results = []
    for optim in (NGVI(point_optim_args={"lr": 0.05}), pyro.optim.Adam({"lr": 0.05})):
        pyro.clear_param_store()
        run(no_latent_model, AutoNormal(no_latent_model), optim, x, y, steps=50)
        results.append((pyro.param("a").item(), pyro.param("b").item()))
    assert results[0] == results[1]
    assert results[0][0] > 1.0  # and it did train


def test_hand_written_guide_with_names_like_an_autonormal_is_read_by_what_it_computes():
    """'q.loc' and 'q.scale' look like an AutoNormal's names, but the scale is exp of a real
    param, not the softplus of a positive one: read off the trace, 'w' is a Gaussian whose sigma
    is exp('q.scale'), and NGVI's steps reach the exact posterior (a reader by names would take
    AutoNormal's softplus and write wrong scales)."""
    def model(y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(w, 0.5), obs=y)

    def guide(y):
        loc = pyro.param("q.loc", torch.tensor(0.0))
        log_scale = pyro.param("q.scale", torch.tensor(0.0))  # a log scale, not a scale
        pyro.sample("w", dist.Normal(loc, log_scale.exp()))

    y = torch.ones(3)
    (site,) = gaussian_sites(guide, y)
    assert site.scale_name == "q.scale" and site.scale_map == "exp"
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    for _ in range(200):
        svi.step(y)
    precision = 1.0 + len(y) / 0.25
    assert abs(pyro.param("q.loc").item() - len(y) / 0.25 / precision) < 0.05 * precision**-0.5
    assert abs(pyro.param("q.scale").exp().item() * precision**0.5 - 1) < 0.02


def test_autoguidelist_with_a_part_that_is_not_a_gaussian():
    """The AutoNormal part gets NGVI's steps, the hand-written part (a fixed scale) the point
    optimizer's, with one warning naming it."""
    def model(y):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(a + w, 0.5), obs=y)

    def w_guide(y):
        pyro.sample("w", dist.Normal(pyro.param("w_loc", torch.tensor(0.0)), 0.1))

    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=["a"])))
    guide.append(w_guide)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="'w' \\(its scale is neither a positive pyro.param.*'w_loc'"):
        svi.step(torch.ones(3))
    assert [site.name for site in gaussian_sites(guide, torch.ones(3))] == ["a"]
    assert pyro.param("w_loc").item() != 0.0  # trained by the point optimizer


class EmpiricalBayes(PyroModule):
    """A PyroModule whose own prior hyperparameters are called ``loc`` and ``scale``."""

    def __init__(self):
        super().__init__()
        self.loc = PyroParam(torch.tensor(0.0))
        self.scale = PyroParam(torch.tensor(1.0), constraint=dist.constraints.positive)

    def forward(self, y):
        with pyro.plate("groups", y.shape[0]):
            theta = pyro.sample("theta", dist.Normal(self.loc, self.scale))
            with pyro.plate("obs_plate", y.shape[1]):
                pyro.sample("obs", dist.Normal(theta, 1.0), obs=y.T)


def test_pyro_module_params_named_loc_and_scale_are_trained_as_points():
    g = torch.Generator().manual_seed(0)
    theta = 1.5 + 2.0 * torch.randn(30, 1, generator=g)
    y = theta + torch.randn(30, 10, generator=g)
    model = EmpiricalBayes()
    guide = AutoNormal(model)
    run(model, guide, NGVI(point_optim_args={"lr": 0.05}), y, steps=600)
    assert [site.name for site in gaussian_sites(guide)] == ["theta"]
    # empirical Bayes: loc -> mean of the group means, scale -> their spread minus noise
    group_means = y.mean(1)
    assert model.loc.item() == pytest.approx(float(group_means.mean()), abs=0.15)
    expected_scale = float((group_means.var() - 0.1).sqrt())
    assert model.scale.item() == pytest.approx(expected_scale, rel=0.2)


def conjugate(y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(w, 1.0), obs=y)


def test_one_ngvi_for_two_guides_keeps_their_states_apart():
    """Momentum and warm start belong to each site's tensor, not to the site's name."""
    ys = [torch.tensor([0.3, 1.2]), torch.tensor([-2.0, -1.5, -2.5])]

    def two_guides(optims):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guides = []
        for k, y in enumerate(ys):
            guide = AutoNormal(conjugate)
            guide._pyro_name = f"guide{k}"  # two guides in one store: same site name 'w'
            guides.append(guide)
        svis = [SVI(conjugate, guide, optim, Trace_ELBO()) for guide, optim in zip(guides, optims)]
        for _ in range(30):
            for svi, y in zip(svis, ys):
                svi.step(y)
        return [pyro.param(f"guide{k}.locs.w").item() for k in range(2)]

    shared = NGVI(momentum=0.9)
    assert two_guides([shared, shared]) == two_guides([NGVI(momentum=0.9), NGVI(momentum=0.9)])


def test_reuse_after_clear_param_store_equals_a_fresh_optimizer():
    y = torch.tensor([0.3, 1.2, -0.5])

    def fit(optim):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        run(conjugate, AutoNormal(conjugate), optim, y, steps=20)
        return pyro.param("AutoNormal.locs.w").item(), pyro.param("AutoNormal.scales.w").item()

    reused = NGVI(momentum=0.9)
    fit(reused)
    assert fit(reused) == fit(NGVI(momentum=0.9))


def test_outside_svi_the_guide_must_be_given():
    y = torch.tensor([0.3, 1.2, -0.5])
    guide = AutoNormal(conjugate)
    loss = Trace_ELBO().differentiable_loss(conjugate, guide, y)
    loss.backward()
    params = [pyro.param("AutoNormal.locs.w").unconstrained(), pyro.param("AutoNormal.scales.w").unconstrained()]
    with pytest.raises(RuntimeError, match="guide=guide"):
        NGVI()(params)
    before = params[0].item()
    NGVI(guide=guide)(params)
    assert params[0].item() != before
