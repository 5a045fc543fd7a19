"""
Gaussian sites read off a guide's trace (issue 23): hand-written guides, autoguides inside
poutine handlers, partials and PyroModule containers, AutoGuideList with AutoCallable
parts; everything else trained by the point optimizer with one NotGaussianWarning.
"""

import functools
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.distributions.testing import fakes
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import (
    AutoCallable,
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuide,
    AutoGuideList,
    AutoHierarchicalNormalMessenger,
    AutoIAFNormal,
    AutoLowRankMultivariateNormal,
    AutoNormal,
    AutoMultivariateNormal,
    AutoNormalMessenger,
    AutoStructured,
)
from pyro.infer.reparam import LocScaleReparam
from pyro.nn import PyroModule, PyroParam

from pyro_ngvi import NGVI
from pyro_ngvi.family import NotGaussianWarning, guide_view, split_params
from pyro_ngvi.guide_trace import read_trace, trace_guide



@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)


# ------------------------------------------------------------------ conjugate models
def means_model(y):
    """Independent Normal means (3 of them) and a log-scale site: the exact posterior is
    diagonal, so the mean-field family holds it exactly."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 2.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(w, 0.5).to_event(1), obs=y[:, :3])
        pyro.sample("pos", dist.LogNormal(s.log(), 1.0), obs=y[:, 3])


def means_data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, 4, generator=g)
    y[:, :3] = torch.tensor([1.0, -0.5, 2.0]) + 0.5 * y[:, :3]
    y[:, 3] = (0.7 + y[:, 3]).exp()
    return y


def means_posterior(y):
    """Means and standard deviations of w (3) and of u = log s, in closed form."""
    n = y.shape[0]
    precision_w = 1 / 4 + n / 0.25
    mean_w = (y[:, :3].sum(0) / 0.25) / precision_w
    precision_u = 1.0 + n
    mean_u = y[:, 3].log().sum() / precision_u
    return mean_w, precision_w**-0.5, mean_u, precision_u**-0.5


#: One draw per step holds every sd within 0.2 % of the exact one from a median of 141 steps on
#: (seeds 0-11 of the hand-written guide: 109-336; the code before 2026-11-27's monotone precision
#: step took a median of 170, and the 150 steps used here then passed by one trajectory's luck).
STEPS_TO_0_2_PERCENT = 350


def hand_written_guide(y, constraint=constraints.positive):
    """A mean-field Gaussian written by hand: w in one .to_event(1) site, s through its log
    (a Gaussian on u and a Delta on exp(u), as AutoNormal does)."""
    w_loc = pyro.param("w_loc", torch.zeros(3))
    w_scale = pyro.param("w_scale", torch.ones(3), constraint=constraint)
    pyro.sample("w", dist.Normal(w_loc, w_scale).to_event(1))
    u_loc = pyro.param("u_loc", torch.tensor(0.0))
    u_scale = pyro.param("u_scale", torch.tensor(1.0), constraint=constraint)
    u = pyro.sample("u", dist.Normal(u_loc, u_scale), infer={"is_auxiliary": True})
    pyro.sample("s", dist.Delta(u.exp(), log_density=-u))


@pytest.mark.parametrize("constraint", [constraints.positive, constraints.softplus_positive],
                         ids=["exp", "softplus"])
def test_hand_written_gaussian_guide_matches_the_exact_posterior(constraint):
    y = means_data()
    guide = functools.partial(hand_written_guide, constraint=constraint)
    svi = SVI(means_model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NotGaussianWarning: every part is a Gaussian
        for _ in range(STEPS_TO_0_2_PERCENT):
            svi.step(y)
    mean_w, sd_w, mean_u, sd_u = means_posterior(y)  # (0.13 sd and 4 % off after 50 steps)
    assert ((pyro.param("w_loc") - mean_w) / sd_w).abs().max() < 0.01
    assert (pyro.param("w_scale") / sd_w - 1).abs().max() < 0.002
    assert abs((pyro.param("u_loc") - mean_u) / sd_u) < 0.01
    assert abs(pyro.param("u_scale") / sd_u - 1) < 0.002


def test_hand_written_guide_takes_natural_gradient_steps_not_adam_steps():
    """Ten NGVI steps from a far start land near the exact posterior: Newton-like steps,
    which Adam's (at most lr each) cannot be."""
    y = means_data()
    svi = SVI(means_model, hand_written_guide, NGVI(), Trace_ELBO(num_particles=64, vectorize_particles=True))
    view = guide_view(hand_written_guide, (y,))
    assert sorted(site.name for site in view.sites) == ["u", "w"] and view.others == []
    for _ in range(10):
        svi.step(y)
    mean_w, sd_w, _, _ = means_posterior(y)
    # from 10 sd away (Adam, lr 0.01, moves at most 0.1 in 10 steps: 0.6 sd)
    assert ((pyro.param("w_loc") - mean_w) / sd_w).abs().max() < 0.3


# ------------------------------------------------------------------ handlers
class Marker(poutine.messenger.Messenger):
    """A messenger that marks params on their way, as Pyro's forecaster does."""

    def _postprocess_message(self, msg):
        if msg["type"] == "param":
            msg["value"].unconstrained()._marked = True


class GuideModule(PyroModule):
    """The hand-written guide as a PyroModule container."""

    def __init__(self):
        super().__init__()
        self.w_loc = PyroParam(torch.zeros(3))
        self.w_scale = PyroParam(torch.ones(3), constraint=constraints.positive)

    def forward(self, y):
        pyro.sample("w", dist.Normal(self.w_loc, self.w_scale).to_event(1))


def view_of(guide, *args):
    store = pyro.get_param_store()
    return [(site.name, store.param_name(site.loc), site.scale_name, site.weight)
            for site in guide_view(guide, args).sites]


WRAPPERS = {
    "messenger": lambda g: Marker()(g),
    "block": lambda g: poutine.block(g, hide=["obs"]),
    "condition": lambda g: poutine.condition(g, data={"obs": torch.zeros(3)}),
    "reparam": lambda g: poutine.reparam(g, config={"obs": LocScaleReparam(0.0)}),
    "partial": lambda g: functools.partial(g),
    "nested": lambda g: Marker()(poutine.block(functools.partial(g), hide=["obs"])),
}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_a_hand_written_guide_in_a_handler_is_read_as_the_bare_one(wrap):
    y = means_data()
    bare = view_of(hand_written_guide, y)
    assert [name for name, *_ in bare] == ["w", "u"]
    assert view_of(WRAPPERS[wrap](hand_written_guide), y) == bare


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_an_autonormal_in_a_handler_is_read_as_the_bare_one(wrap):
    """The bare AutoNormal is read from its structure, the wrapped one off its trace."""
    y = means_data()
    guide = AutoNormal(means_model)
    guide(y)
    bare = view_of(guide, y)
    assert [name for name, *_ in bare] == ["w", "s"]
    assert view_of(WRAPPERS[wrap](guide), y) == bare


def _multivariate_steps(wrap, steps=20):
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    y = means_data()
    guide = AutoMultivariateNormal(means_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGaussianWarning)
        svi = SVI(means_model, wrap(guide), NGVI(), Trace_ELBO())
        for _ in range(steps):
            svi.step(y)
    return {name: value.detach().clone() for name, value in pyro.get_param_store().items()}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_an_automultivariatenormal_in_a_handler_takes_the_bare_ones_full_covariance_steps(wrap):
    """Read off its trace (its site ``_AutoMultivariateNormal_latent``, built from its three params
    as pyro builds it), the wrapped guide takes the bare one's natural-gradient steps exactly; it
    was trained by the point optimizer (0.2 posterior sd off after 1,500 steps of a regression)."""
    bare, wrapped = _multivariate_steps(lambda g: g), _multivariate_steps(WRAPPERS[wrap])
    assert bare.keys() == wrapped.keys() == {f"AutoMultivariateNormal.{p}" for p in ("loc", "scale", "scale_tril")}
    for name in bare:
        assert torch.equal(bare[name], wrapped[name]), name
    assert not torch.equal(bare["AutoMultivariateNormal.scale_tril"], torch.eye(2))  # (it moved)


def test_an_automultivariatenormal_under_poutine_scale_is_trained_by_the_point_optimizer_with_the_reason():
    y = means_data()
    guide = AutoMultivariateNormal(means_model)
    svi = SVI(means_model, poutine.scale(guide, scale=0.5), NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match=r"_AutoMultivariateNormal_latent.*not on one under poutine.scale"):
        svi.step(y)


def test_poutine_scale_on_the_guide_is_read_with_its_weight():
    y = means_data()
    bare = view_of(hand_written_guide, y)
    scaled = view_of(poutine.scale(hand_written_guide, scale=2.0), y)
    assert scaled == [(name, loc, scale, 2.0) for name, loc, scale, _ in bare]


@pytest.mark.parametrize("weight", [0.5, 3.0])
def test_a_guide_weighted_by_poutine_scale_reaches_the_optimum_of_its_weighted_objective(weight):
    """poutine.scale(guide, w) weighs the guide's log density, its entropy and AutoNormal's
    log-Jacobian (the Delta's log density) included, by w. In u = log s the objective is
    E[log p(u)] - (1 - w) E[u] + w H[q]: for a Gaussian posterior N(m, s^2) its optimum is
    N(m - (1 - w) s^2, w s^2) (for w, whose guide has no Jacobian, N(m, w s^2))."""
    y = means_data()
    guide = AutoNormal(means_model)
    svi = SVI(means_model, poutine.scale(guide, scale=weight), NGVI(), Trace_ELBO())
    for _ in range(150):
        svi.step(y)
    mean_w, sd_w, mean_u, sd_u = means_posterior(y)
    store = pyro.get_param_store()
    assert ((store["AutoNormal.locs.w"] - mean_w) / sd_w).abs().max() < 0.01
    assert (store["AutoNormal.scales.w"] / (weight**0.5 * sd_w) - 1).abs().max() < 0.005
    assert abs((store["AutoNormal.locs.s"] - (mean_u - (1 - weight) * sd_u**2)) / sd_u) < 0.01
    assert abs(store["AutoNormal.scales.s"] / (weight**0.5 * sd_u) - 1) < 0.005


def test_a_model_and_guide_scaled_alike_reach_the_unscaled_posterior():
    """Scaling the whole ELBO by 2 moves no optimum (and, with NGVI's statistics divided by the
    guide's weight, changes no step: with the raw ones the mean step was twice Newton's and the
    scales were 25 % off after 300 steps)."""
    y = means_data()
    guide = AutoNormal(means_model)
    svi = SVI(poutine.scale(means_model, scale=2.0), poutine.scale(guide, scale=2.0), NGVI(), Trace_ELBO())
    for _ in range(150):
        svi.step(y)
    mean_w, sd_w, mean_u, sd_u = means_posterior(y)
    store = pyro.get_param_store()
    assert ((store["AutoNormal.locs.w"] - mean_w) / sd_w).abs().max() < 0.01
    assert (store["AutoNormal.scales.w"] / sd_w - 1).abs().max() < 0.005
    assert abs((store["AutoNormal.locs.s"] - mean_u) / sd_u) < 0.01
    assert abs(store["AutoNormal.scales.s"] / sd_u - 1) < 0.005


class ModuleGuide(PyroModule):
    """The hand-written guide of both sites as a PyroModule, locs plain nn.Parameters."""

    def __init__(self):
        super().__init__()
        self.w_loc = torch.nn.Parameter(torch.zeros(3))
        self.w_scale = PyroParam(torch.ones(3), constraint=constraints.positive)
        self.u_loc = torch.nn.Parameter(torch.tensor(0.0))
        self.u_scale = PyroParam(torch.tensor(1.0), constraint=constraints.softplus_positive)

    def forward(self, y):
        pyro.sample("w", dist.Normal(self.w_loc, self.w_scale).to_event(1))
        u = pyro.sample("u", dist.Normal(self.u_loc, self.u_scale), infer={"is_auxiliary": True})
        pyro.sample("s", dist.Delta(u.exp(), log_density=-u))


def test_a_pyro_module_guide_matches_the_exact_posterior():
    y = means_data()
    guide = ModuleGuide()
    svi = SVI(means_model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every part is a Gaussian
        for _ in range(STEPS_TO_0_2_PERCENT):
            svi.step(y)
    mean_w, sd_w, mean_u, sd_u = means_posterior(y)
    assert ((guide.w_loc - mean_w) / sd_w).abs().max() < 0.01
    assert (guide.w_scale / sd_w - 1).abs().max() < 0.002
    assert abs((guide.u_loc - mean_u) / sd_u) < 0.01
    assert abs(guide.u_scale / sd_u - 1) < 0.002


def test_a_pyro_module_guide_is_read_off_its_trace():
    y = means_data()
    guide = GuideModule()
    (site,) = guide_view(guide, (y,)).sites
    assert site.name == "w" and site.loc is pyro.get_param_store()._params["w_loc"]
    assert site.scale_name == "w_scale"


def subsampled_model(y, idx):
    with pyro.plate("groups", 10, subsample=idx, dim=-2):
        with pyro.plate("items", 6, subsample_size=3, dim=-1) as items:
            theta = pyro.sample("theta", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(theta, 1.0), obs=y[idx][:, items])


@pytest.mark.parametrize("wrap", [None, "messenger"])
def test_subsampled_autonormal_is_read_off_its_trace_like_its_structure(wrap):
    """Rows picked by two subsampling plates: the trace finds the whole params."""
    y = torch.randn(10, 6)
    guide = AutoNormal(subsampled_model)
    idx = torch.tensor([1, 4, 7])
    guide(y, idx)
    store = pyro.get_param_store()
    structural = [(store.param_name(s.loc), s.scale_name) for s in guide_view(guide, (y, idx)).sites]
    traced = WRAPPERS[wrap](guide) if wrap else guide
    blocks, others = read_trace(trace_guide(traced, y, idx))
    assert [(b.loc, b.scale) for b in blocks] == structural == [("AutoNormal.locs.theta", "AutoNormal.scales.theta")]
    assert blocks[0].subsampled and blocks[0].weight == 1.0 and others == []


# ------------------------------------------------------------------ AutoGuideList, AutoCallable
def median_model():
    pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.LogNormal(0.0, 1.0))
    pyro.sample("z", dist.Beta(2.0, 2.0))


def callable_guide_list(model):
    """Pyro's own idiom (tests/infer/test_autoguide.py, auto_guide_callable)."""
    def guide_x():
        x_loc = pyro.param("x_loc", torch.tensor(1.0))
        x_scale = pyro.param("x_scale", torch.tensor(0.1), constraint=constraints.positive)
        pyro.sample("x", dist.Normal(x_loc, x_scale))

    def median_x():
        return {"x": pyro.param("x_loc", torch.tensor(1.0))}

    guide = AutoGuideList(model)
    guide.append(AutoCallable(model, guide_x, median_x))
    guide.append(AutoDiagonalNormal(poutine.block(model, hide=["x"])))
    return guide


class GuideX(AutoGuide):
    def __init__(self, model):
        super().__init__(model)
        self.x_loc = torch.nn.Parameter(torch.tensor(1.0))
        self.x_scale = PyroParam(torch.tensor(0.1), constraint=constraints.positive)

    def forward(self, *args, **kwargs):
        return {"x": pyro.sample("x", dist.Normal(self.x_loc, self.x_scale))}

    def median(self, *args, **kwargs):
        return {"x": self.x_loc.detach()}


def module_guide_list(model):
    """Pyro's auto_guide_module_callable: an AutoGuide subclass with its own params."""
    guide = AutoGuideList(model)
    guide.custom = GuideX(model)
    guide.diagnorm = AutoDiagonalNormal(poutine.block(model, hide=["x"]))
    return guide


@pytest.mark.parametrize("make", [callable_guide_list, module_guide_list], ids=["callable", "module"])
def test_autoguidelist_with_a_callable_part_gets_natural_gradients_everywhere(make):
    guide = make(median_model)
    elbo = Trace_ELBO(num_particles=100, vectorize_particles=True)
    svi = SVI(median_model, guide, NGVI(), elbo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every part is a Gaussian: no warning
        for _ in range(100):  # Pyro's test_median: 100 steps, tolerance 0.1
            svi.step()
        names = sorted(site.name for site in guide_view(guide).sites)
    assert len(names) == 2 and "x" in names  # x (read off the trace) and the diagonal part
    median = guide.median()
    assert abs(median["x"].item()) < 0.1
    assert abs(median["y"].item() - 1.0) < 0.1
    assert abs(median["z"].item() - 0.5) < 0.1


def test_an_autonormalmessenger_is_read_as_gaussians_in_the_unconstrained_coordinates():
    """AutoNormalMessenger samples TransformedDistribution(Normal(loc, scale), biject_to(support)):
    a Gaussian on u; its hierarchical sibling computes its loc from the prior (not one)."""
    median_model()
    guide = AutoNormalMessenger(median_model)
    guide()
    view = guide_view(guide, (), {}, median_model)
    assert [site.name for site in view.sites] == ["x", "y", "z"] and view.others == []
    store = pyro.get_param_store()
    assert [store.param_name(site.loc) for site in view.sites] == ["locs.x", "locs.y", "locs.z"]
    pyro.clear_param_store()
    guide = AutoHierarchicalNormalMessenger(median_model)
    guide()
    view = guide_view(guide, (), {}, median_model)
    assert view.sites == [] and [o.site for o in view.others] == ["x", "y", "z"]
    assert all("computed" in o.reason for o in view.others)


def test_a_model_run_inside_the_guide_adds_no_part():
    """AutoNormalMessenger runs the model inside the guide: the model's observed site and its own
    param ('noise') appear in the guide's trace, but they are the model's, not guide parts."""
    def model(y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        noise = pyro.param("noise", torch.tensor(1.0), constraint=constraints.positive)
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(w, noise), obs=y)

    y = torch.randn(4)
    guide = AutoNormalMessenger(model)
    guide(y)
    view = guide_view(guide, (y,), {}, model)
    assert [site.name for site in view.sites] == ["w"] and view.others == []


class SharedParamsModel(PyroModule):
    """Pyro's test_median_module model: its prior reads params named like the guide's."""

    def __init__(self):
        super().__init__()
        self.x_loc = torch.nn.Parameter(torch.tensor(1.0))
        self.x_scale = PyroParam(torch.tensor(0.1), constraints.positive)

    def forward(self):
        x = pyro.sample("x", dist.Normal(self.x_loc, self.x_scale))
        pyro.sample("y", dist.Normal(2.0, 0.1))
        pyro.sample("z", dist.Normal(1.0, 0.1), obs=x)


def test_a_guide_param_the_model_reads_too_is_not_a_gaussian_of_the_guide():
    """The guide's x_loc and x_scale are the model's prior params (the same param-store names):
    an NGVI step on them would ignore the prior's dependence on them. They get the point
    optimizer (as Adam trains them in Pyro's test), the other part its natural gradient."""
    model = SharedParamsModel()
    guide = callable_guide_list(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="'x' \\(its param 'x_loc' is read by the model too"):
        svi.step()
    sites = guide_view(guide, (), {}, model).sites
    assert [type(s).__name__ for s in sites] == ["GaussianSite"] and sites[0].name == "AutoGuideList.1"
    for _ in range(19):
        svi.step()
    median = guide.median()  # Pyro's tolerances after its 20 steps
    assert abs(median["x"].item() - 1.0) < 0.1 and abs(median["y"].item() - 2.0) < 0.1


# ------------------------------------------------------------------ what is not a Gaussian
class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)

    def forward(self, y):
        return self.net(y.reshape(-1, 1)).reshape(-1)


def mixed_model(y):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    c = pyro.sample("c", dist.Normal(0.0, 1.0))
    r = pyro.sample("r", dist.Gamma(2.0, 2.0))
    with pyro.plate("data", len(y)):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(a + b + c + z, r), obs=y)


def mixed_guide(y, encoder):
    pyro.sample("a", dist.Normal(pyro.param("a_loc", torch.tensor(0.0)),
                                 pyro.param("a_scale", torch.tensor(1.0), constraint=constraints.positive)))
    pyro.sample("b", dist.Delta(pyro.param("b_value", torch.tensor(0.0))))
    pyro.sample("c", dist.Normal(pyro.param("c_loc", torch.tensor(0.0)), 0.3))
    pyro.sample("r", dist.Gamma(pyro.param("r_shape", torch.tensor(2.0), constraint=constraints.positive), 2.0))
    pyro.module("encoder", encoder)
    with pyro.plate("data", len(y)):
        pyro.sample("z", dist.Normal(encoder(y), pyro.param("z_scale", torch.tensor(0.5),
                                                             constraint=constraints.positive)))


def test_the_warning_names_the_sites_that_get_the_point_optimizer_once():
    y = torch.randn(5)
    encoder = Encoder()
    guide = functools.partial(mixed_guide, encoder=encoder)
    svi = SVI(mixed_model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning) as record:
        svi.step(y)
    (warning,) = [w for w in record if w.category is NotGaussianWarning]
    message = str(warning.message)
    for site, why in (("b", "Delta"), ("c", "scale is neither"), ("r", "Gamma"), ("z", "loc is not")):
        assert f"'{site}' ({why}" in message.replace("it is a ", "").replace("its ", ""), site
    assert "'a'" not in message
    assert "encoder$$$net.weight" in message and "'z_scale'" in message
    view = guide_view(guide, (y,))
    assert [site.name for site in view.sites] == ["a"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per guide structure
        for _ in range(3):
            svi.step(y)
    # every part trains: the point optimizer moved the params of the other sites
    assert pyro.param("b_value").item() != 0.0 and pyro.param("c_loc").item() != 0.0
    assert pyro.param("r_shape").item() != 2.0 and pyro.param("z_scale").item() != 0.5


def test_params_shared_between_sites_are_not_a_gaussian():
    def model():
        pyro.sample("p", dist.Normal(0.0, 1.0))
        pyro.sample("q", dist.Normal(0.0, 1.0))

    def guide():
        scale = pyro.param("shared_scale", torch.tensor(1.0), constraint=constraints.positive)
        pyro.sample("p", dist.Normal(pyro.param("p_loc", torch.tensor(0.0)), scale))
        pyro.sample("q", dist.Normal(pyro.param("q_loc", torch.tensor(0.0)), scale))

    blocks, others = read_trace(trace_guide(guide))
    assert blocks == []
    assert sorted(o.site for o in others) == ["p", "q"] and all("shares" in o.reason for o in others)


def test_a_gaussian_whose_loc_enters_another_site_directly_is_not_one():
    def guide():
        loc = pyro.param("loc_p", torch.tensor(0.0))
        pyro.sample("p", dist.Normal(loc, pyro.param("sp", torch.tensor(1.0), constraint=constraints.positive)))
        pyro.sample("q", dist.Normal(2 * loc, 1.0))

    blocks, others = read_trace(trace_guide(guide))
    assert blocks == []
    assert {o.site: o.params for o in others} == {"p": ("loc_p", "sp"), "q": ("loc_p",)}
    assert "also enter site 'q'" in others[0].reason


def test_a_site_built_from_a_gaussians_draw_leaves_that_gaussian_one():
    """A hierarchical guide: q's loc is p's draw; p stays a Gaussian, q is trained as a point."""
    def guide():
        p = pyro.sample("p", dist.Normal(pyro.param("loc_p", torch.tensor(0.0)),
                                         pyro.param("sp", torch.tensor(1.0), constraint=constraints.positive)))
        pyro.sample("q", dist.Normal(p, pyro.param("sq", torch.tensor(1.0), constraint=constraints.positive)))

    blocks, others = read_trace(trace_guide(guide))
    assert [b.site for b in blocks] == ["p"]
    assert [(o.site, o.params) for o in others] == [("q", ("sq",))]


def test_a_normal_without_rsample_or_with_a_broadcast_scale_is_not_a_gaussian():
    def guide():
        loc = pyro.param("m", torch.zeros(2))
        scale = pyro.param("s", torch.ones(2), constraint=constraints.positive)
        pyro.sample("p", dist.Normal(loc, scale).has_rsample_(False).to_event(1))
        pyro.sample("q", dist.Normal(pyro.param("mq", torch.zeros(2)),
                                     pyro.param("sq", torch.tensor(1.0), constraint=constraints.positive)).to_event(1))
        pyro.sample("r", dist.Normal(pyro.param("mr", torch.zeros(2)),
                                     pyro.param("sr", torch.ones(2), constraint=constraints.interval(0.0, 5.0))).to_event(1))

    blocks, others = read_trace(trace_guide(guide))
    assert blocks == []
    reasons = {o.site: o.reason for o in others}
    assert "reparameterised" in reasons["p"]
    assert "broadcast" not in reasons["q"]  # its scale is broadcast, its loc is not
    assert "scale" in reasons["q"]
    assert "exp or softplus" in reasons["r"]


def test_a_loc_shared_by_the_elements_of_a_plate_is_not_a_mean_field_gaussian():
    """AutoNormalMessenger(amortized_plates=...): one loc broadcast over the plate (Pyro's
    test_subsample_model_amortized)."""
    def model(x):
        with pyro.plate("batch", len(x)):
            pyro.sample("sigma", dist.LogNormal(0.0, 1.0))

    x = torch.zeros(5)
    guide = AutoNormalMessenger(model, amortized_plates=("batch",))
    guide(x)
    view = guide_view(guide, (x,), {}, model)
    assert view.sites == []
    (part,) = view.others
    assert part.site == "sigma" and "broadcast over the site" in part.reason


def named_like_gaussians(y):
    loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(loc, scale), obs=y)


def test_an_autodelta_with_sites_named_loc_and_scale_trains_exactly_as_with_adam():
    """Names are no evidence: AutoDelta's 'loc' and 'scale' are point estimates, trained by
    the point optimizer step for step as Pyro's ClippedAdam (clip_norm 10, torch's betas) trains
    them with the default's decaying step size, 0.05 / (1 + t / 50) (pyro_ngvi.point)."""
    y = torch.tensor([0.3, 1.2, -0.5, 0.8, 0.1])
    results = []
    clipped = {"lr": 0.05, "betas": (0.9, 0.999), "clip_norm": 10.0, "lrd": 1.0}
    adam = pyro.optim.LambdaLR({"optimizer": pyro.optim.clipped_adam.ClippedAdam, "optim_args": clipped,
                                "lr_lambda": lambda t: 1.0 / (1.0 + t / 50.0)})
    for optim in (NGVI(), adam):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoDelta(named_like_gaussians)
        svi = SVI(named_like_gaussians, guide, optim, Trace_ELBO())
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(20):
                svi.step(y)
                if optim is adam:
                    adam.step()
        results.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
        warned = [w for w in record if issubclass(w.category, NotGaussianWarning)]
        if isinstance(svi.optim, NGVI):
            assert len(warned) == 1
            assert "'loc' (it is a Delta" in str(warned[0].message)
            assert guide_view(guide, (y,)).sites == []
    assert results[0].keys() == results[1].keys()
    for name in results[0]:  # (the step sizes agree to rounding: a / (1 + x) against a * (1 / (1 + x)))
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-6, atol=0.0, msg=name)
    assert not torch.equal(results[0]["AutoDelta.loc"], torch.tensor(0.0))


def beta_bernoulli(y):
    p = pyro.sample("p", dist.Beta(1.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Bernoulli(p), obs=y)


def score_function_guide(y):
    a = pyro.param("a", torch.tensor(2.0), constraint=constraints.positive)
    b = pyro.param("b", torch.tensor(2.0), constraint=constraints.positive)
    pyro.sample("p", fakes.NonreparameterizedBeta(a, b))


def test_a_score_function_sites_params_train_as_with_unclipped_adam():
    """A guide site drawn without rsample gives its params score-function gradients, whose clamp at
    +-10 would bias them: the point optimizer trains them step for step as Pyro's plain Adam with
    the default's decaying step size (ClippedAdam, which the old code matched, ends elsewhere)."""
    y = torch.cat([torch.ones(70), torch.zeros(30)])
    ends = []
    for optimizer, args in ((None, None), (torch.optim.Adam, {}),
                            (pyro.optim.clipped_adam.ClippedAdam, {"clip_norm": 10.0, "lrd": 1.0})):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        optim = NGVI() if optimizer is None else pyro.optim.LambdaLR(
            {"optimizer": optimizer, "optim_args": {"lr": 0.05, "betas": (0.9, 0.999), **args},
             "lr_lambda": lambda t: 1.0 / (1.0 + t / 50.0)})
        svi = SVI(beta_bernoulli, score_function_guide, optim, Trace_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGaussianWarning)
            for _ in range(30):
                svi.step(y)
                if optimizer is not None:
                    optim.step()
        ends.append(torch.stack([pyro.param("a"), pyro.param("b")]).detach())
    torch.testing.assert_close(ends[0], ends[1], rtol=1e-6, atol=0.0)
    assert (ends[0] - ends[2]).abs().max() > 0.05  # (the clamp engaged: the two differ)
    trace = poutine.trace(score_function_guide).get_trace(y)
    _, (part,) = read_trace(trace)
    assert part.score_function and part.params == ("a", "b")


def test_an_enumerated_or_reparameterised_guide_site_is_no_score_function():
    def guide():
        pyro.sample("z", dist.Bernoulli(pyro.param("q", torch.tensor(0.3), constraint=constraints.unit_interval)),
                    infer={"enumerate": "parallel"})
        pyro.sample("g", dist.Gamma(pyro.param("c", torch.tensor(2.0), constraint=constraints.positive), 1.0))
        pyro.sample("d", dist.Bernoulli(pyro.param("r", torch.tensor(0.3), constraint=constraints.unit_interval)))

    parts = {part.site: part.score_function for part in read_trace(poutine.trace(guide).get_trace())[1]}
    assert parts == {"z": False, "g": False, "d": True}


def test_a_models_own_param_named_loc_is_not_a_gaussian():
    def model(y):
        loc = pyro.param("loc", torch.tensor(0.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(loc + w, 1.0), obs=y)

    def guide(y):
        pyro.sample("w", dist.Normal(pyro.param("q_m", torch.tensor(0.0)),
                                     pyro.param("q_s", torch.tensor(1.0), constraint=constraints.positive)))

    y = torch.randn(4)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    svi.step(y)
    params = [pyro.get_param_store()._params[n] for n in ("loc", "q_m", "q_s")]
    sites, others, _, _ = split_params(guide, params, (y,), {})
    assert [s.name for s in sites] == ["w"] and sites[0].loc is params[1]
    assert [id(p) for p in others] == [id(params[0])]


def test_low_rank_multivariate_normal_is_trained_by_the_point_optimizer_with_a_pointer():
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    guide = AutoLowRankMultivariateNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match="LowRankPrecisionNormal"):
        svi.step()
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi.step()
    assert all(not torch.equal(before[k], v.detach()) for k, v in pyro.get_param_store().items())


def _w_model():
    pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))


@pytest.mark.parametrize("make, reason", [
    (lambda: AutoStructured(_w_model, conditionals={"w": "normal"}),
     r"'w' \(it is a Delta carrying a density: a transform of another draw \(AutoStructured's"),
    (lambda: AutoStructured(_w_model, conditionals={"w": "delta"}), r"'w' \(it is a Delta \(a point estimate\)"),
    (lambda: poutine.scale(AutoMultivariateNormal(_w_model), scale=0.5),
     r"it is a MultivariateNormal: NGVI takes full-covariance steps only on an AutoMultivariateNormal \(handed to SVI"),
], ids=["AutoStructured-normal", "AutoStructured-delta", "scaled-AutoMultivariateNormal"])
def test_the_reason_a_gaussian_guide_goes_to_the_point_optimizer_says_what_it_is(make, reason):
    """AutoStructured's 'normal' conditional (a Delta at loc + scale * aux carrying the Gaussian's
    density) was named 'a point estimate', and an AutoMultivariateNormal under poutine.scale 'a
    MultivariateNormal, not a Normal' (NGVI takes AutoMultivariateNormal); each now says what it is."""
    svi = SVI(_w_model, make(), NGVI(), Trace_ELBO())
    with pytest.warns(NotGaussianWarning, match=reason):
        svi.step()


def test_only_the_sites_that_hold_params_are_named():
    """An AutoContinuous guide samples one latent and splits it into Deltas: the Deltas are built
    from the latent's draw, not from params of their own, so only the latent is named."""
    guide = AutoLowRankMultivariateNormal(median_model)
    guide()
    view = guide_view(guide, (), {}, median_model)
    assert view.sites == []
    (part,) = view.others
    assert part.site == "_AutoLowRankMultivariateNormal_latent" and "LowRankPrecisionNormal" in part.reason
    assert set(part.params) == {"AutoLowRankMultivariateNormal.loc", "AutoLowRankMultivariateNormal.cov_factor",
                                "AutoLowRankMultivariateNormal.scale"}
    pyro.clear_param_store()
    guide = AutoIAFNormal(median_model)
    guide()
    (part,) = guide_view(guide, (), {}, median_model).others
    assert part.site == "_AutoIAFNormal_latent" and "flow" in part.reason


# ------------------------------------------------------------------ the trace leaves no trace
class BatchNormGuide(PyroModule):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(1)
        self.scale = PyroParam(torch.tensor(1.0), constraint=constraints.positive)

    def forward(self, y):
        with pyro.plate("data", len(y)):
            pyro.sample("z", dist.Normal(self.norm(y.reshape(-1, 1)).reshape(-1), self.scale))


def test_tracing_a_guide_leaves_the_random_streams_and_buffers_as_they_were():
    import random

    import numpy

    guide = BatchNormGuide()
    y = torch.randn(6) + 3.0
    states = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    buffers = {k: v.clone() for k, v in guide.state_dict().items()}
    trace = trace_guide(guide, y)
    assert "z" in trace.nodes
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert (numpy.random.get_state()[1] == states[2]).all()
    for k, v in guide.state_dict().items():
        assert torch.equal(v, buffers[k]), k


def test_reading_the_guide_off_its_trace_draws_no_random_numbers():
    """The first NGVI step reads a hand-written guide off its trace; the run's random stream
    is where one Adam step leaves it (the same draws, the same losses as a run that never
    read it)."""
    y = means_data()
    states, losses = [], []
    for make in (lambda: NGVI(), lambda: pyro.optim.Adam({"lr": 0.01})):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        svi = SVI(means_model, hand_written_guide, make(), Trace_ELBO())
        losses.append(svi.step(y))
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])
    assert losses[0] == losses[1]


def test_a_guide_whose_params_a_handler_hides_from_svi_is_named_not_said_to_be_trained():
    """poutine.block(guide, expose_types=['sample']) hides the guide's pyro.param statements from
    SVI, which then hands NGVI none of them: no optimizer trains them (Adam neither). NGVI says so
    once, naming the sites, and claims no point optimizer for them; the guide stays as it was."""
    from pyro_ngvi import NGVIWarning
    from pyro_ngvi.family import NotGaussianWarning

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(w, 1.0), obs=torch.tensor(1.0))

    pyro.clear_param_store()
    guide = AutoNormal(model)
    guide()
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi = SVI(model, poutine.block(guide, expose_types=["sample"]), NGVI(), Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step()
    ours = [w for w in caught if issubclass(w.category, NGVIWarning)]
    assert len(ours) == 1 and not issubclass(ours[0].category, NotGaussianWarning)
    assert "'w_unconstrained'" in str(ours[0].message) and "no optimizer trains them" in str(ours[0].message)
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), before[k]), k


_BRANCH_DATA = 1.0 + 0.5 * torch.randn(10, generator=torch.Generator().manual_seed(0))


def _branching_model(data):
    """A coin picks which of two latents the data see (prior sd 1 and noise 0.5, or 2 and 1)."""
    heads = pyro.sample("c", dist.Bernoulli(0.5))
    prior, noise = (1.0, 0.5) if heads.item() == 1 else (2.0, 1.0)
    z = pyro.sample("a" if heads.item() == 1 else "b", dist.Normal(0.0, prior))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(z, noise), obs=data)


def _branching_guide(data):
    """The guide flips its own coin and draws the branch's latent: which sites it has depends on
    its draw, so a run of it by NGVI may take the other branch than the step took."""
    heads = pyro.sample("c", dist.Bernoulli(0.5))
    name = "a" if heads.item() == 1 else "b"
    loc = pyro.param(f"{name}_loc", torch.tensor(0.0))
    scale = pyro.param(f"{name}_scale", torch.tensor(0.1), constraint=constraints.positive)
    pyro.sample(name, dist.Normal(loc, scale))


@pytest.mark.parametrize("seed", [0, 2])
def test_a_guide_whose_sites_depend_on_its_own_draws_is_read_as_the_step_ran_it(seed):
    """NGVI read the guide off a run of its own, which could take the other branch than the step:
    the plan of the step's params then showed the other branch's site (warned about as hidden by a
    handler, falsely) and gave the step's own Gaussian Adam's steps, for good. With q(c) the prior,
    each branch's optimum is its exact conditional posterior: both are reached now, to 4e-4 sd and
    2e-4 in scale (before, after 300 steps: on 5 seeds of 6 a branch 0.05-0.12 sd off and its scale
    8-21 % low)."""
    from pyro_ngvi import NGVIWarning

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svi = SVI(_branching_model, _branching_guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(300):
            svi.step(_BRANCH_DATA)
    assert [str(w.message) for w in caught if issubclass(w.category, NGVIWarning)] == []
    total = float(_BRANCH_DATA.sum())
    for name, prior, noise in [("a", 1.0, 0.5), ("b", 2.0, 1.0)]:
        precision = prior**-2 + len(_BRANCH_DATA) / noise**2
        loc, scale = pyro.param(f"{name}_loc").item(), pyro.param(f"{name}_scale").item()
        assert abs(loc - total / noise**2 / precision) < 0.01 * precision**-0.5, name
        assert abs(scale * precision**0.5 - 1.0) < 0.01, name


_SOMETIMES_DATA = (2.0 * torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
                   + torch.tensor([[1.0], [-2.0]]))


def _sometimes_model():
    """``a`` and its 20 observations always; a coin, and only on heads ``b`` and its own 20."""
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(a, 1.0).expand([20]).to_event(1), obs=_SOMETIMES_DATA[0])
    if pyro.sample("c", dist.Bernoulli(0.5)).item() == 1:
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(b, 1.0).expand([20]).to_event(1), obs=_SOMETIMES_DATA[1])


def _sometimes_guide():
    """The guide flips its own coin and draws ``b`` only on heads: on tails its run has no ``b`` at all
    (site or nothing, where ``_branching_guide`` draws one site or the other)."""
    pyro.sample("a", dist.Normal(pyro.param("a_loc", torch.tensor(0.0)),
                                 pyro.param("a_scale", torch.tensor(1.0), constraint=constraints.positive)))
    if pyro.sample("c", dist.Bernoulli(0.5)).item() == 1:
        pyro.sample("b", dist.Normal(pyro.param("b_loc", torch.tensor(0.0)),
                                     pyro.param("b_scale", torch.tensor(1.0), constraint=constraints.positive)))


class _SometimesModule(PyroModule):
    """``_sometimes_guide`` as a ``PyroModule`` with ``PyroParam`` s (named ``a_loc``, ... in the store)."""

    def __init__(self):
        super().__init__()
        self.a_loc, self.b_loc = PyroParam(torch.tensor(0.0)), PyroParam(torch.tensor(0.0))
        self.a_scale = PyroParam(torch.tensor(1.0), constraint=constraints.positive)
        self.b_scale = PyroParam(torch.tensor(1.0), constraint=constraints.positive)

    def forward(self):
        pyro.sample("a", dist.Normal(self.a_loc, self.a_scale))
        if pyro.sample("c", dist.Bernoulli(0.5)).item() == 1:
            pyro.sample("b", dist.Normal(self.b_loc, self.b_scale))


@pytest.mark.parametrize("seed,guide,particles,steps,tol", [
    (0, "function", 1, 300, 1e-3), (4, "function", 1, 300, 1e-3), (5, "module", 1, 600, 1e-3),
    (2, "function", 4, 600, 0.07)])
def test_a_site_the_guide_draws_only_on_some_of_its_own_draws_is_stepped_as_a_gaussian(seed, guide, particles, steps,
                                                                                        tol):
    """A guide that draws ``b`` only when its own coin says so: NGVI read its structure off a run of its
    own, which on the first step with ``b`` could flip tails; the reading then showed no ``b`` (nothing
    hidden, so it was taken), and the plan kept for the params of steps with ``b`` handed ``b_loc`` and
    ``b_scale`` to the point optimizer for good, without a warning. The ELBO's ``b`` part is the b
    model's ELBO times P(c = 1), so q(b) must reach the exact posterior
    N(sum(y) / 21, 1 / 21) (prior N(0, 1), 20 observations of unit noise), and q(a) its own.
    Before, 1500 steps of NGVI() on the task's data: on 6 seeds of 10 ``b`` ended 0.04-0.17 posterior sd off
    and 6-10 % wide; now all 10 within 2e-4 sd and 2e-4 in scale. Four particles (Trace_ELBO's, not
    vectorised) leave a noise floor of a few % on every site (``a`` too, and without the coin): there the
    test asks for 7 % in sd units and in scale (before, 600 steps, seeds 0-5: on 5 ``b`` 17-21 % wide; now
    1-5 %, as ``a``)."""
    from pyro_ngvi import NGVIWarning

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svi = SVI(_sometimes_model, _SometimesModule() if guide == "module" else _sometimes_guide, NGVI(),
              Trace_ELBO(num_particles=particles))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            svi.step()
    assert [str(w.message) for w in caught if issubclass(w.category, NGVIWarning)] == []
    sd = 21**-0.5
    for name, data in zip("ab", _SOMETIMES_DATA):
        loc, scale = pyro.param(f"{name}_loc").item(), pyro.param(f"{name}_scale").item()
        assert abs(loc - data.sum().item() / 21) < tol * sd, (name, (loc - data.sum().item() / 21) / sd)
        assert abs(scale / sd - 1.0) < tol, (name, scale / sd - 1.0)


def test_a_model_and_guide_that_assert_their_enumerated_and_vectorised_shapes_run():
    """NGVI reads the guide off a run of it, and replays the model, outside the ELBO's handlers;
    a model (or guide) that asserts the shapes its ELBO's enumeration or vectorised particles
    give it failed there (31 of Pyro's tests/infer/test_valid_models.py). Such runs are now
    made as the ELBO makes them, and the Gaussian site reaches its exact posterior; a guide that
    asserts vectorised shapes is read off the vectorised run, where its params are expanded along
    the particles' plate: one Gaussian, drawn once per particle, that NGVI steps as any other."""
    generator = torch.Generator().manual_seed(0)
    y = 1.0 + torch.randn(20, generator=generator)
    precision = 1.0 + len(y)
    mean, sd = (y.sum() / precision).item(), precision**-0.5

    def model(particles=None, guide_asserts=True):
        shape = () if particles is None else (particles, 1)
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        assert mu.shape == shape
        a = pyro.sample("a", dist.Bernoulli(0.3), infer={"enumerate": "parallel"} if particles is None else {})
        if particles is None:
            assert a.shape == (2, 1)  # enumerated, left of the data plate
        with pyro.plate("data", len(y), dim=-1):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    def guide(particles=None, guide_asserts=True):
        loc = pyro.param("loc", torch.tensor(0.0))
        scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
        mu = pyro.sample("mu", dist.Normal(loc, scale))
        if guide_asserts:
            assert mu.shape == (() if particles is None else (particles, 1))
        if particles is not None:
            pyro.sample("a", dist.Bernoulli(0.3))

    vectorised = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    for loss, particles, guide_asserts in [(TraceEnum_ELBO(max_plate_nesting=1), None, True),
                                           (vectorised, 8, False), (vectorised, 8, True)]:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, guide, NGVI(), loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NotGaussianWarning)
            for _ in range(500):
                svi.step(particles, guide_asserts)
        named = [str(w.message) for w in caught if issubclass(w.category, NotGaussianWarning)]
        assert not named  # the Gaussian is read: natural-gradient steps, exact
        assert abs(pyro.param("loc").item() - mean) < 0.1 * sd
        assert abs(pyro.param("scale").item() / sd - 1) < 0.05


def test_a_vector_site_of_a_guide_that_asserts_its_vectorised_shape_reaches_the_exact_posterior():
    """A regression's weights, a vector site (event dim) left of a data plate, in a guide and
    model that assert the shape vectorised particles give them: the guide is read off the
    vectorised run, its loc and scale expanded along the particles' plate and the data plate's
    dim of size 1; NGVI takes natural-gradient steps and reaches the exact mean-field posterior.
    A param expanded along a plate that is not the particles' stays with the point optimizer."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(40, generator=generator)
    precision = x.T @ x / 0.25 + torch.eye(3)
    mean = torch.linalg.solve(precision, x.T @ y / 0.25)
    particles = 4

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        assert w.shape == (particles, 1, 3)
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal((x * w).sum(-1), 0.5), obs=y)

    def guide(groups=None):
        shape = (3,) if groups is None else (groups, 3)
        loc = pyro.param("loc", torch.zeros(shape))
        scale = pyro.param("scale", torch.ones(shape), constraint=constraints.positive)
        if groups is None:
            w = pyro.sample("w", dist.Normal(loc, scale).to_event(1))
            assert w.shape == (particles, 1, 3)
            return
        with pyro.plate("groups", groups, dim=-1):  # loc (groups, 3) is one Gaussian per group
            v = pyro.sample("v", dist.Normal(loc[0], scale[0]).to_event(1))
            assert v.shape == (particles, groups, 3)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(model, guide, NGVI(), Trace_ELBO(num_particles=particles, vectorize_particles=True,
                                               max_plate_nesting=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGaussianWarning)
        for _ in range(300):
            svi.step()
    sd = precision.diag().rsqrt()
    assert ((pyro.param("loc").detach() - mean).abs() / sd).max() < 0.15
    assert ((pyro.param("scale").detach() / sd - 1).abs()).max() < 0.05

    def model_of_groups(groups):
        with pyro.plate("groups", groups, dim=-1):
            v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
            assert v.shape == (particles, groups, 3)

    pyro.clear_param_store()
    svi = SVI(model_of_groups, guide, NGVI(), Trace_ELBO(num_particles=particles, vectorize_particles=True,
                                                         max_plate_nesting=1))
    with pytest.warns(NotGaussianWarning, match="'v'.*broadcast"):
        svi.step(2)


def regression(seed):
    """A 3-weight linear regression (40 rows, noise 0.5, prior N(0, 1)): ``x``, ``y`` and its exact
    mean-field posterior's means and sds."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 3, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(40, generator=generator)
    precision = x.T @ x / 0.25 + torch.eye(3)
    return x, y, torch.linalg.solve(precision, x.T @ y / 0.25), precision.diag().rsqrt()


def test_a_guide_computing_its_scales_by_exp_and_softplus_gets_exact_natural_gradient_steps():
    """The hand-written idioms ``Normal(loc, torch.exp(log_scale))`` and ``Normal(loc,
    F.softplus(rho))`` (Bayes-by-Backprop's) of unconstrained params: each site is read as a
    Gaussian with the map its guide computes (two sites of one size and two maps: two groups), and
    both reach the exact mean-field posterior; get_state / set_state resume them bit for bit. A
    softplus of another sharpness, and the exp of a positive param, stay with the point optimizer."""
    x, y, mean, sd = regression(2)

    def model():
        for name in ("u", "v"):
            w = pyro.sample(name, dist.Normal(0.0, 1.0).expand([3]).to_event(1))
            with pyro.plate(f"data_{name}", len(y)):
                pyro.sample(f"y_{name}", dist.Normal(x @ w, 0.5), obs=y)

    def guide(beta=1.0, positive=False):
        log_scale = pyro.param("u_log_scale", torch.zeros(3),
                               constraint=constraints.positive if positive else constraints.real)
        pyro.sample("u", dist.Normal(pyro.param("u_loc", torch.zeros(3)), log_scale.exp()).to_event(1))
        rho = pyro.param("v_rho", torch.zeros(3))
        pyro.sample("v", dist.Normal(pyro.param("v_loc", torch.zeros(3)),
                                     torch.nn.functional.softplus(rho, beta=beta)).to_event(1))

    def train(steps, optim=None, state=None):
        svi = SVI(model, guide, optim or NGVI(), Trace_ELBO())
        if state is not None:
            svi.optim.set_state(state)
        for _ in range(steps):
            svi.step()
        return svi.optim

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    assert [(s.name, s.scale_map) for s in guide_view(guide, (), {}).sites] == [("u", "exp"), ("v", "softplus")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGaussianWarning)
        optim = train(300)
    scales = {"u": pyro.param("u_log_scale").exp(), "v": torch.nn.functional.softplus(pyro.param("v_rho"))}
    for name in ("u", "v"):
        assert ((pyro.param(f"{name}_loc").detach() - mean).abs() / sd).max() < 0.15
        assert (scales[name].detach() / sd - 1).abs().max() < 0.05

    state, params = optim.get_state(), {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.set_rng_seed(1)
    train(20, optim)
    after = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.clear_param_store()
    for k, v in params.items():
        pyro.param(k, v.clone())
    pyro.set_rng_seed(1)
    train(20, state=state)
    assert all(torch.equal(pyro.param(k).detach(), v) for k, v in after.items())

    for kwargs, site in (({"beta": 2.0}, "'v'"), ({"positive": True}, "'u'")):
        pyro.clear_param_store()
        with pytest.warns(NotGaussianWarning, match=site + r" \(its scale is neither"):
            SVI(model, functools.partial(guide, **kwargs), NGVI(), Trace_ELBO()).step()


def test_sites_drawing_elements_of_one_param_are_one_gaussian_when_they_cover_it():
    """Pyro's Bayesian regression tutorial writes ``Normal(weights_loc[i], weights_scale[i])`` for
    each weight: the sites together draw every element of the params once, so they are one
    mean-field Gaussian of the whole params, and NGVI's steps reach the exact posterior (here with
    a slice, ``weights_loc[1:]``, as a vector site). Elements left undrawn, drawn twice, or a scale
    of other elements than the loc's leave the sites to the point optimizer, with the reason."""
    x, y, mean, sd = regression(3)

    def model():
        w0 = pyro.sample("w0", dist.Normal(0.0, 1.0))
        rest = pyro.sample("rest", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(x[:, 0] * w0 + x[:, 1:] @ rest, 0.5), obs=y)

    def guide(pieces=((0,), slice(1, 3))):
        loc = pyro.param("weights_loc", torch.zeros(3))
        scale = pyro.param("weights_scale", torch.ones(3), constraint=constraints.positive)
        (first,), rest = pieces[0], pieces[1]
        pyro.sample("w0", dist.Normal(loc[first], scale[pieces[2] if len(pieces) > 2 else first]))
        pyro.sample("rest", dist.Normal(loc[rest], scale[rest]).to_event(1))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    (site,) = guide_view(guide, (), {}).sites
    assert site.name == "w0, rest" and site.scale_name == "weights_scale"
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotGaussianWarning)
        for _ in range(300):
            svi.step()
    assert ((pyro.param("weights_loc").detach() - mean).abs() / sd).max() < 0.15
    assert (pyro.param("weights_scale").detach() / sd - 1).abs().max() < 0.05

    for pieces, why in ((((0,), slice(1, 2)), "exactly once"), (((1,), slice(1, 3)), "exactly once"),
                        (((0,), slice(1, 3), 2), "scale not the same elements")):
        pyro.clear_param_store()
        view = guide_view(functools.partial(guide, pieces), (), {})
        assert not view.sites and why in str(view.others)


def test_local_latents_indexed_by_the_subsample_get_exact_natural_gradient_steps():
    """``Normal(loc[ind], scale[ind])`` inside ``pyro.plate(..., subsample_size=B) as ind`` (and
    ``index_select``, and a scale computed as ``exp(log_scale)[ind]``): the rows the plate picks, as
    when the plate subsamples the params itself; every row reaches its exact posterior. Rows
    picked with repeats (a gather, not a subsample) stay with the point optimizer, with the reason."""
    generator = torch.Generator().manual_seed(4)
    n = 60
    y = 2.0 + 1.5 * torch.randn(n, generator=generator)
    mean, sd = y / 1.25, 1.25**-0.5  # z ~ N(0, 2^2), y ~ N(z, 1)

    def model():
        with pyro.plate("data", n, subsample_size=15) as ind:
            z = pyro.sample("z", dist.Normal(0.0, 2.0))
            pyro.sample("y", dist.Normal(z, 1.0), obs=y[ind])

    def indexed():
        loc = pyro.param("loc", torch.zeros(n))
        scale = pyro.param("scale", torch.ones(n), constraint=constraints.positive)
        with pyro.plate("data", n, subsample_size=15) as ind:
            pyro.sample("z", dist.Normal(loc[ind], scale[ind]))

    def selected():
        loc = pyro.param("loc", torch.zeros(n))
        log_scale = pyro.param("log_scale", torch.zeros(n))
        with pyro.plate("data", n, subsample_size=15) as ind:
            pyro.sample("z", dist.Normal(loc.index_select(0, ind), log_scale.exp()[ind]))

    for guide in (indexed, selected):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(model, guide, NGVI(), Trace_ELBO())
        with warnings.catch_warnings():
            warnings.simplefilter("error", NotGaussianWarning)
            for _ in range(400):
                svi.step()
        scale = pyro.param("scale") if guide is indexed else pyro.param("log_scale").exp()
        assert ((pyro.param("loc").detach() - mean).abs() / sd).max() < 0.1, guide.__name__
        assert (scale.detach() / sd - 1).abs().max() < 0.05, guide.__name__

    def gathered():
        loc = pyro.param("loc", torch.zeros(n))
        scale = pyro.param("scale", torch.ones(n), constraint=constraints.positive)
        first = torch.zeros(15, dtype=torch.long)
        with pyro.plate("data", n, subsample_size=15):
            pyro.sample("z", dist.Normal(loc[first], scale[first]))

    pyro.clear_param_store()
    view = guide_view(gathered, (), {})
    assert not view.sites and "not the subsample of the plate" in str(view.others)


def test_a_constrained_param_as_a_loc_is_named_with_its_constraint():
    """Pyro's regression tutorial draws its noise from ``Normal(sigma_loc, 0.05)`` with a positive
    ``sigma_loc``: the point optimizer trains it, and the reason names the param and its
    constraint (it said the loc was computed: a network's output, a sum, a transform)."""
    def guide():
        sigma_loc = pyro.param("sigma_loc", torch.tensor(1.0), constraint=constraints.positive)
        pyro.sample("sigma", dist.Normal(sigma_loc, 0.05))

    pyro.clear_param_store()
    view = guide_view(guide, (), {})
    assert not view.sites and "the param 'sigma_loc' of constraint GreaterThan" in str(view.others)
