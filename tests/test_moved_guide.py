"""A guide moved to another dtype between steps (``guide.to(torch.float64)``): NGVI's state
follows the params, as the param store's tensors keep their identity and get new storage."""

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO

PRIOR_SD = 10.0


def model(y):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=y.dtype), PRIOR_SD).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(w, 1.0).to_event(1), obs=y)


def exact_posterior(y):
    """Each coordinate's conjugate posterior: precision n + 1 / s0^2, mean sum(y) / precision."""
    precision = len(y) + PRIOR_SD**-2
    return y.sum(0) / precision, torch.full((3,), precision**-0.5, dtype=y.dtype)


def fit(loss, move: bool, steps: int):
    """5 steps, then ``steps`` more in float64: after ``guide.to(torch.float64)`` if ``move``, else
    float64 from the start (the reference). Returns the guide's loc and scale and the optimizer."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = torch.randn(20, 3) + torch.tensor([1.0, -2.0, 0.5])
    y = y if move else y.double()
    guide = AutoNormal(model)
    if loss == "trace":
        optim, elbo = NGVI(), Trace_ELBO()
    else:
        optim, elbo = NGVI(lr=1.0, beta=1.0), CurvatureELBO("hessian", deterministic=True)
    svi = SVI(model, guide, optim, elbo)
    for _ in range(5):
        svi.step(y)
    if move:
        guide.to(torch.float64)
        y = y.double()
    for _ in range(steps):
        svi.step(y)
    loc, scale = guide._get_loc_and_scale("w")
    return y, loc.detach(), scale.detach(), optim


@pytest.mark.parametrize("loss,steps", [("trace", 60), ("hessian", 3)])
def test_a_guide_moved_to_float64_after_float32_steps_trains_on_in_float64(loss, steps):
    """After 5 float32 steps, ``guide.to(torch.float64)`` and float64 data crashed the next step
    ("expected m1 and m2 to have the same dtype, but got: double != float", in the control variate's
    cross terms): the site's state stayed float32. Now the state follows the params: the run takes
    the steps of a run in float64 from the start (to 1e-6 posterior sd: the first 5 steps' float32
    round-off), on its way to the exact posterior (0.009 sd off after 60 steps of ``Trace_ELBO``), and
    Newton steps land on it to float64 precision (1e-10 sd after 3; float32 rounds the mean off by
    about 1e-6 sd)."""
    y, loc, scale, optim = fit(loss, move=True, steps=steps)
    _, reference_loc, reference_scale, _ = fit(loss, move=False, steps=steps)
    mean, sd = exact_posterior(y)
    assert loc.dtype == scale.dtype == torch.float64
    assert optim.num_skipped_steps == 0
    assert (loc - reference_loc).abs().max() < 1e-6 * sd.max()
    assert ((scale / reference_scale) - 1).abs().max() < 1e-6
    tolerance = 0.02 if loss == "trace" else 1e-10
    assert (loc - mean).abs().max() < tolerance * sd.max()
    assert ((scale / sd) - 1).abs().max() < tolerance


def test_the_sigma_remembered_for_a_moved_guide_is_not_read_in_the_old_dtype():
    """NGVI remembers the exact sigma it wrote into a raw scale (its bijection gives it back only to
    an ulp); ``guide.to`` keeps the tensor and its version, so after the move the float32 sigma was
    still taken for the float64 raw scale. Now it is forgotten (sigma is read off the raw scale
    through the bijection) and the next step remembers a float64 one, Pyro's ``scales`` to an ulp."""
    from pyro_ngvi.scales import known_scale

    pyro.set_rng_seed(0)
    y = torch.randn(20, 3)
    guide = AutoNormal(model)
    svi = SVI(model, guide, NGVI(), Trace_ELBO())
    for _ in range(3):
        svi.step(y)
    raw = pyro.get_param_store()._params["AutoNormal.scales.w"]
    assert known_scale(raw) is not None and known_scale(raw).dtype == torch.float32
    guide.to(torch.float64)
    assert known_scale(raw) is None
    svi.step(y.double())
    assert known_scale(raw).dtype == torch.float64
    assert torch.allclose(known_scale(raw), guide.scales.w.detach(), rtol=1e-13, atol=0.0)  # (float32: 1e-7)
