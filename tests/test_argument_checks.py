"""Bad arguments of the public functions raise ``ValueError`` naming the argument (issue: a sweep of
``pyro_ngvi.__all__`` with wrong types); a guide or model of a kind not supported still raises
``NotImplementedError`` saying what is."""

import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoDelta, AutoNormal

import pyro_ngvi
from pyro_ngvi import BayesianNet, KroneckerNormal, LowRankPrecisionNormal, PriorMessenger


def model(x):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=torch.zeros(len(x)))


X = torch.randn(10, 3)
NOT_A_DICT = [[1.0, 2.0], torch.ones(3), 3.0, math.nan, "w", [("w", dist.Normal(0.0, 1.0))]]
NOT_CALLABLE = [3, -1.0, math.nan, torch.zeros(0), [1, 2], "model"]


def bnn():
    return BayesianNet(torch.nn.Sequential(torch.nn.Linear(3, 1)), "gaussian", num_data=10)


@pytest.mark.parametrize("priors", NOT_A_DICT, ids=repr)
@pytest.mark.parametrize("call", ["with_priors", "with_priors(BayesianNet)", "start_task", "PriorMessenger"])
def test_priors_that_are_not_a_dict_raise_a_value_error_naming_priors(call, priors):
    """A list, a tensor, a number raised a bare ``TypeError`` ("priors must be a dict of
    distributions, got <class 'list'>"): not the ``ValueError`` every bad argument raises."""
    calls = {"with_priors": lambda: pyro_ngvi.with_priors(model, priors),
             "with_priors(BayesianNet)": lambda: pyro_ngvi.with_priors(bnn(), priors),
             "start_task": lambda: pyro_ngvi.start_task(AutoNormal(model), priors, X, carry=True),
             "PriorMessenger": lambda: PriorMessenger(priors)}
    with pytest.raises(ValueError, match=r"priors must be a dict \{site name: Distribution\}"):
        calls[call]()
    assert dict(pyro.get_param_store().items()) == {}


@pytest.mark.parametrize("carry", [True, False])
@pytest.mark.parametrize("prior", [3.0, torch.ones(3), None], ids=repr)
def test_start_task_refuses_a_prior_that_is_not_a_distribution_naming_it(prior, carry):
    """With ``carry=True`` the error came from deep inside ("conjugate_normal: fn must be a
    distribution"), with ``carry=False`` such priors were taken silently."""
    before = {"AutoNormal.locs.w": torch.full((3,), 5.0)}
    pyro.param("AutoNormal.locs.w", before["AutoNormal.locs.w"].clone())
    guide = AutoNormal(model)
    with pytest.raises(ValueError, match=r"start_task: priors\['w'\] \(the prior for site 'w'\) must be a Distribution"):
        pyro_ngvi.start_task(guide, {"w": prior}, X, carry=carry)
    assert guide.prototype_trace is None
    assert torch.equal(pyro.param("AutoNormal.locs.w"), before["AutoNormal.locs.w"])


@pytest.mark.parametrize("bad", NOT_CALLABLE, ids=repr)
def test_a_guide_or_model_that_is_not_callable_raises_a_value_error_naming_it(bad):
    """``laplace(model, x, guide=3)`` raised ``NotImplementedError`` (as for a guide of another
    kind); ``laplace(3, x)``, ``with_priors(3, ...)`` and ``LowRankPrecisionNormal(3)`` Pyro's "3 is
    not callable, did you mean to pass it as a keyword arg?", naming no argument; a non-callable
    ``make_model`` or ``init_loc_fn`` a ``TypeError`` at its first call. (``optimize_prior_precision``
    hands its ``guide`` to ``laplace``, which names it.)"""
    cases = {
        "laplace: guide": lambda: pyro_ngvi.laplace(model, X, guide=bad, num_steps=1),
        "(laplace|optimize_prior_precision): guide": lambda: pyro_ngvi.optimize_prior_precision(
            lambda alpha: model, [1.0], X, guide=bad),
        "optimize_prior_precision: make_model": lambda: pyro_ngvi.optimize_prior_precision(bad, [1.0], X),
        "posterior_as_prior: guide": lambda: pyro_ngvi.posterior_as_prior(bad),
        "start_task: guide": lambda: pyro_ngvi.start_task(bad, None, X, carry=False),
        "laplace: model": lambda: pyro_ngvi.laplace(bad, X, num_steps=1),
        "with_priors: model": lambda: pyro_ngvi.with_priors(bad, {}),
        "LowRankPrecisionNormal: model": lambda: LowRankPrecisionNormal(bad),
        "LowRankPrecisionNormal: init_loc_fn": lambda: LowRankPrecisionNormal(model, init_loc_fn=bad),
        "KroneckerNormal: model": lambda: KroneckerNormal(bad),
    }
    for name, call in cases.items():
        pyro.clear_param_store()
        with pytest.raises(ValueError, match=name + " must be"):
            call()
        assert dict(pyro.get_param_store().items()) == {}, name
    # a guide of a kind they do not support is still NotImplementedError, saying what they support
    with pytest.raises(NotImplementedError, match="AutoNormal or AutoMultivariateNormal guide, got AutoDelta"):
        pyro_ngvi.laplace(model, X, guide=AutoDelta(model), num_steps=1)
    with pytest.raises(NotImplementedError, match="supports AutoNormal and AutoMultivariateNormal"):
        pyro_ngvi.posterior_as_prior(AutoDelta(model))


@pytest.mark.parametrize("filename", [1.5, [1, 2], torch.zeros(0), None], ids=repr)
def test_load_param_store_refuses_a_filename_that_is_not_a_path(filename):
    """``load_param_store(0)`` opened file descriptor 0 (stdin) and closed it; other non-paths raised
    ``TypeError: expected str, bytes or os.PathLike object``."""
    with pytest.raises(ValueError, match="filename must be a path"):
        pyro_ngvi.load_param_store(filename)


@pytest.mark.parametrize("map_location", [3, 1.5, [1, 2]], ids=repr)
def test_load_param_store_refuses_a_map_location_torch_cannot_take(map_location, tmp_path):
    """Such a ``map_location`` raised ``TypeError: 'int' object is not callable`` from torch's unpickler;
    a device (or a dict, or a function) loads as before, the values as saved."""
    pyro.param("a", torch.arange(3.0))
    path = str(tmp_path / "params.pt")
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    with pytest.raises(ValueError, match="map_location must be None, a device"):
        pyro_ngvi.load_param_store(path, map_location=map_location)
    assert dict(pyro.get_param_store().items()) == {}
    pyro_ngvi.load_param_store(path, map_location=torch.device("cpu"))
    assert torch.equal(pyro.param("a"), torch.arange(3.0))
