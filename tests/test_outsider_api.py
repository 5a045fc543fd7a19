"""An outsider's sweep of the public API beyond the optimizer (``BayesianNet``'s attributes,
``posterior_as_prior``, ``load_param_store`` / ``NGVI.load``): wrong values raise ``ValueError``
naming the argument, and correct use still gives what an independent reference gives."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import pyro_ngvi
from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO


# --------------------------------------------------------------------------- load_param_store, NGVI.load

# Bytes that torch's weights-only unpickler reads as pickle opcodes and then fails on with an error
# other than UnpicklingError: 'h' (BINGET) looks up a memo never filled (KeyError 104), '(' (MARK)
# followed by 'e' pops an empty stack (IndexError), 'G' (BINFLOAT) unpacks 8 bytes from 0 (struct.error),
# 'K' (BININT1) reads past the end (IndexError). A text file starting with "h" or "(" is one of them.
NOT_PICKLES = {"text 'hello'": b"hello world\n", "text '(ello'": b"(ello world\n", "'G'": b"G", "'K'": b"K"}


@pytest.mark.parametrize("content", list(NOT_PICKLES.values()), ids=list(NOT_PICKLES))
def test_loading_a_file_that_is_no_pickle_raises_a_value_error_naming_the_file(content, tmp_path):
    """These raised ``KeyError: 104``, ``IndexError: index out of range`` or ``struct.error`` from
    torch's unpickler, where the docstring promises a ``ValueError`` for a file not written by
    ``torch.save``; the param store stays as it was, and a file ``torch.save`` wrote still loads."""
    bad, good = tmp_path / "notes.txt", tmp_path / "params.pt"
    bad.write_bytes(content)
    pyro.param("a", torch.arange(3.0))
    pyro.param("b", torch.tensor([0.5, 2.0]), constraint=dist.constraints.positive)
    pyro.get_param_store().save(str(good))
    saved = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match="Could not read .*notes.txt.* as a Pyro param store"):
        pyro_ngvi.load_param_store(str(bad))
    with pytest.raises(ValueError, match="Could not read .*notes.txt.* as a NGVI state"):
        NGVI().load(str(bad))
    assert {name: value.detach() for name, value in pyro.get_param_store().items()}.keys() == saved.keys()
    pyro.clear_param_store()
    pyro_ngvi.load_param_store(str(good))
    store = pyro.get_param_store()
    for name, value in saved.items():  # (the values as saved, the constraint applied as saved)
        assert torch.equal(store[name].detach(), value)
    assert isinstance(store._constraints["b"], type(dist.constraints.positive))


@pytest.mark.parametrize("map_location", ["gpu", "nodevice", {"cpu": 3}, {"cpu": "nodevice"}], ids=repr)
def test_load_refuses_a_device_name_torch_cannot_read_naming_map_location(map_location, tmp_path):
    """``map_location="gpu"`` raised torch's ``RuntimeError: don't know how to restore data location``
    and ``{"cpu": 3}`` a ``TypeError: expected string or bytes-like object`` from its device-name
    parser; names torch reads load as before (the values as saved)."""
    path = str(tmp_path / "params.pt")
    pyro.param("a", torch.arange(3.0))
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    with pytest.raises(ValueError, match="map_location must be None, a device"):
        pyro_ngvi.load_param_store(path, map_location=map_location)
    assert dict(pyro.get_param_store().items()) == {}
    for good in ("cpu", {"cpu": "cpu"}):
        pyro.clear_param_store()
        pyro_ngvi.load_param_store(path, map_location=good)
        assert torch.equal(pyro.param("a").detach(), torch.arange(3.0))


# --------------------------------------------------------------------------- posterior_as_prior

def regression(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=torch.ones(len(x)))


@pytest.mark.parametrize("sites", [3, 1.5, torch.device("cpu")], ids=repr)
def test_posterior_as_prior_sites_of_another_type_name_sites_for_either_guide(sites):
    """For an AutoMultivariateNormal ``sites=3`` raised a bare ``TypeError: 'int' object is not
    iterable`` (an AutoNormal named ``sites``); ``sites="w"`` still gives the guide's own Gaussian."""
    x = torch.randn(6, 3)
    for guide_class in (AutoMultivariateNormal, AutoNormal):
        pyro.clear_param_store()
        guide = guide_class(regression)
        guide(x)
        with pytest.raises(ValueError, match="posterior_as_prior: sites must be a site name or a list of them"):
            pyro_ngvi.posterior_as_prior(guide, sites)
        prior = pyro_ngvi.posterior_as_prior(guide, "w")["w"]
        loc, scale = guide._loc_scale(x) if guide_class is AutoMultivariateNormal else guide._get_loc_and_scale("w")
        assert torch.allclose(prior.mean, loc.detach()) and torch.allclose(prior.variance, scale.detach() ** 2)


# --------------------------------------------------------------------------- BayesianNet attributes

def gaussian_net(noise_scale=1.0):
    torch.manual_seed(0)
    return BayesianNet(torch.nn.Linear(3, 1), "gaussian", 20, noise_scale=noise_scale)


def deterministic_loss(bnn, x, y, source):
    """The ELBO's loss at the guide's mean (no draw): the fast path's (``ggn``) or the traced model's."""
    pyro.clear_param_store()
    guide = bnn.guide(init_scale=0.1)
    return CurvatureELBO(source, deterministic=True).loss_and_grads(bnn, guide, x, y)


@pytest.mark.parametrize("other", ["bernoulli", "categorical", "poisson", None])
def test_the_likelihood_of_a_bayesian_net_cannot_be_changed_after_construction(other):
    """``bnn.likelihood = "bernoulli"`` on a Gaussian net was taken: the model then scored the
    Bernoulli likelihood while the BackPACK fast path kept its Gaussian loss, two models (loss at the
    mean 33.8 on the fast path, 20.2 traced, on 20 binary targets). Now refused; the same value may be
    set again, and the fast path and the traced model still agree."""
    torch.manual_seed(1)
    x, y = torch.randn(20, 3), torch.randn(20)
    bnn = gaussian_net()
    with pytest.raises(ValueError, match="likelihood is fixed at construction"):
        bnn.likelihood = other
    bnn.likelihood = "gaussian"
    assert bnn.likelihood == "gaussian"
    assert deterministic_loss(bnn, x, y, "ggn") == pytest.approx(deterministic_loss(bnn, x, y, "hessian"), rel=1e-5)


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan, math.inf, "0.5", True, torch.ones(3)], ids=repr)
def test_a_noise_scale_set_after_construction_is_checked_as_the_constructor_checks_it(bad):
    """``bnn.noise_scale = -1.0`` (or ``init_noise_scale``) was taken silently and failed at the next
    step inside Pyro's ``Normal`` ("Expected parameter scale ..."), naming no argument. A valid value
    set later gives the model a net built with it gives (a reference run: the loss at the mean)."""
    torch.manual_seed(1)
    x, y = torch.randn(20, 3), torch.randn(20)
    bnn = gaussian_net()
    with pytest.raises(ValueError, match="noise_scale must be a positive finite number"):
        bnn.noise_scale = bad
    with pytest.raises(ValueError, match="init_noise_scale must be a positive finite number"):
        bnn.init_noise_scale = bad
    assert bnn.noise_scale == 1.0 and bnn.init_noise_scale == 1.0
    bnn.noise_scale = 0.5
    reference = deterministic_loss(gaussian_net(noise_scale=0.5), x, y, "ggn")
    assert deterministic_loss(bnn, x, y, "ggn") == pytest.approx(reference, rel=1e-6)
    assert deterministic_loss(bnn, x, y, "hessian") == pytest.approx(reference, rel=1e-5)
    bernoulli = BayesianNet(torch.nn.Linear(3, 1), "bernoulli", 20)
    with pytest.raises(ValueError, match="noise_scale is the scale of the 'gaussian' likelihood"):
        bernoulli.noise_scale = 1.0
    assert bernoulli.noise_scale is None


@pytest.mark.parametrize("bad", [3, "init_to_mean", None, torch.zeros(3)], ids=repr)
def test_bayesian_net_guide_refuses_an_init_loc_fn_that_is_not_callable(bad):
    """``bnn.guide(init_loc_fn=3)`` was taken, and the guide's first run raised ``TypeError: 'int'
    object is not callable`` from Pyro's initialisation, naming no argument (``KroneckerNormal`` and
    ``LowRankPrecisionNormal`` named it). A function given is used: the guide starts where it says."""
    bnn = gaussian_net()
    with pytest.raises(ValueError, match="BayesianNet.guide: init_loc_fn must be a function of a site"):
        bnn.guide(init_loc_fn=bad)
    assert dict(pyro.get_param_store().items()) == {}
    guide = bnn.guide(init_loc_fn=lambda site: torch.full(site["fn"].shape(), 0.25))
    guide(torch.randn(4, 3), torch.randn(4))
    assert torch.equal(pyro.param("AutoNormal.locs.weight").detach(), torch.full((1, 3), 0.25))
    assert torch.equal(pyro.param("AutoNormal.locs.bias").detach(), torch.full((1,), 0.25))
