"""The float32 softplus bijection of the guide's scales, against float64, and the remembered scale."""

import math

import pytest
import torch

from pyro_ngvi.scales import FastSoftplus, forget_scale, known_scale, remember_scale, softplus, softplus_inverse

EPS = torch.finfo(torch.float32).eps


def log_uniform(low, high, n=200_000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(n, dtype=torch.float64).uniform_(math.log(low), math.log(high), generator=generator).exp()


def exact_inverse(sigma64):
    return sigma64 + torch.log(-torch.expm1(-sigma64))


@pytest.mark.parametrize("low,high", [(1e-8, 1e3), (1e-3, 2.0)])
def test_inverse_is_a_few_ulps_of_float64(low, high):
    sigma = log_uniform(low, high).float()
    exact = exact_inverse(sigma.double())
    r = softplus_inverse(sigma)
    assert r.dtype == torch.float32
    # absolute error in units of eps * max(|r|, 1) (r crosses 0 at sigma = log 2)
    error = (r.double() - exact).abs() / (exact.abs().clamp(min=1.0) * EPS)
    assert error.max() < 3.0
    # what the guide then holds, softplus(r) in float64, against sigma: the float32
    # rounding of r alone costs up to |r| / 2 ulps of sigma (r = log sigma = -18 at 1e-8)
    back = torch.nn.functional.softplus(r.double())
    rounding = exact.float().double()
    inherent = (torch.nn.functional.softplus(rounding) - sigma.double()).abs()
    assert ((back - sigma.double()).abs() - inherent).max() <= 3 * EPS * sigma.double().max()
    assert (((back - sigma.double()).abs() - inherent) / (sigma.double() * EPS)).max() < 3.0


@pytest.mark.parametrize("low,high", [(1e-8, 1e3), (1e-3, 2.0)])
def test_forward_is_a_few_ulps_of_float64(low, high):
    r = exact_inverse(log_uniform(low, high)).float()
    exact = torch.nn.functional.softplus(r.double())
    sigma = softplus(r)
    assert sigma.dtype == torch.float32
    assert ((sigma.double() - exact).abs() / (exact * EPS)).max() < 2.0


def test_edge_values():
    sigma = torch.tensor([0.0, 1e-30, 1e-10, 5e-8, 17.0, 17.5, 40.0, 1e3, 3e38, math.inf])
    r = softplus_inverse(sigma)
    assert torch.allclose(r[1:4], exact_inverse(sigma[1:4].double()).float(), rtol=2 * EPS)
    assert r[0] == -math.inf and r[-1] == math.inf
    assert torch.allclose(r[4:-1].double(), exact_inverse(sigma[4:-1].double()), rtol=2 * EPS)
    assert softplus_inverse(torch.tensor([math.nan, 1.0])).isnan().tolist() == [True, False]
    r = torch.tensor([-math.inf, -200.0, -20.0, 0.0, 16.9, 17.0, 17.5, 100.0, 3e38, math.inf])
    expected = torch.nn.functional.softplus(r.double()).float()  # float32 underflows at -200
    assert torch.allclose(softplus(r), expected, rtol=2 * EPS, atol=0.0)
    assert softplus(torch.tensor([math.nan, 0.0])).isnan().tolist() == [True, False]


def test_float64_and_the_transform():
    r = torch.linspace(-20, 30, 101, dtype=torch.float64)
    transform = FastSoftplus()
    assert torch.allclose(transform(r), torch.nn.functional.softplus(r), rtol=1e-15)
    assert torch.allclose(transform.inv(transform(r)), r, rtol=1e-12)
    r32 = r.float()
    assert torch.allclose(transform.log_abs_det_jacobian(r32, None).double(),
                          torch.nn.functional.logsigmoid(r), rtol=4 * EPS, atol=1e-30)
    assert torch.allclose(transform.derivative(r32).double(), torch.sigmoid(r), rtol=4 * EPS)


def test_remembered_scale_is_dropped_by_any_write():
    raw = torch.zeros(3, requires_grad=True)
    sigma = torch.full((3,), math.log(2.0))
    assert known_scale(raw) is None
    remember_scale(raw, sigma)
    assert known_scale(raw) is sigma
    with torch.no_grad():
        raw.view(-1)[0] = 1.0  # a write through a view bumps the shared version counter
    assert known_scale(raw) is None
    remember_scale(raw, sigma)
    forget_scale(raw)
    assert known_scale(raw) is None
    assert known_scale(torch.zeros(3)) is None  # another tensor


def test_series_inverse_gives_log_sigma():
    from pyro_ngvi.scales import softplus_inverse_and_log

    sigma = log_uniform(1e-8, 1.0).float()  # all <= 1: the series around log sigma
    r, log_sigma = softplus_inverse_and_log(sigma)
    exact = exact_inverse(sigma.double())
    assert ((r.double() - exact).abs() / (exact.abs().clamp(min=1.0) * EPS)).max() < 3.0
    assert torch.equal(log_sigma, sigma.log())
    assert softplus_inverse_and_log(torch.tensor([0.5, 1.5]))[1] is None  # Kahan's form beyond 1


# --------------------------------------------------------------------------- NGVI and the fast path
import pyro  # noqa: E402
from pyro.infer import SVI, Predictive  # noqa: E402
from pyro.infer.autoguide import AutoNormal  # noqa: E402
from torch import nn  # noqa: E402

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO  # noqa: E402
from pyro_ngvi.family import pop_curvature, scale_transform  # noqa: E402
from pyro_ngvi.safeguards import finite as _finite  # noqa: E402


@pytest.fixture
def float32_bnn():
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 300), nn.Tanh(), nn.Linear(300, 3))  # a site above _FLAT_MAX too
    net[0].weight.data = torch.randn(300, 4)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    bnn = BayesianNet(net, "categorical", num_data=100, prior=1.0)
    guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.05)
    svi = SVI(bnn, guide, NGVI(lr=0.1, beta=0.2), CurvatureELBO("ef"))
    yield bnn, guide, svi, x, y
    pyro.clear_param_store()


def scales_in_store(guide, bnn):
    store = pyro.get_param_store()
    return {site: store[f"AutoNormal.scales.{site}"].detach() for site in bnn.latent_sites}


def test_remembered_scales_are_the_guides(float32_bnn):
    bnn, guide, svi, x, y = float32_bnn
    for _ in range(3):
        svi.step(x, y)
    store = pyro.get_param_store()
    for site, sigma in scales_in_store(guide, bnn).items():  # softplus of the raw scale
        remembered = known_scale(store._params[f"AutoNormal.scales.{site}"])
        assert remembered is not None and remembered.shape == sigma.shape
        assert ((remembered.double() - sigma.double()).abs() / (sigma.double() * EPS)).max() < 4.0
    samples = Predictive(bnn, guide=guide, num_samples=2, return_sites=["0.weight"])(x)
    assert samples["0.weight"].shape[-2:] == (300, 4)


def test_a_write_to_the_raw_scale_is_what_the_next_step_reads(float32_bnn):
    bnn, guide, svi, x, y = float32_bnn
    svi.step(x, y)
    store = pyro.get_param_store()
    raw = store._params["AutoNormal.scales.0.weight"]
    with torch.no_grad():
        raw.copy_(softplus_inverse(torch.full_like(raw, 0.3)))  # e.g. a user resetting the scale
    assert known_scale(raw) is None
    guide_scale = scales_in_store(guide, bnn)["0.weight"]
    bnn.curvature_step(guide, x, y, "ef")
    stats = pop_curvature(store._params["AutoNormal.locs.0.weight"])
    torch.testing.assert_close(stats.scale, guide_scale, rtol=2 * EPS, atol=0)  # the new scale, not the remembered
    torch.testing.assert_close(stats.scale, torch.full_like(raw, 0.3), rtol=4 * EPS, atol=0)


def test_elbo_value_with_remembered_log_scale_is_the_recomputed_one(float32_bnn):
    bnn, guide, svi, x, y = float32_bnn
    for _ in range(2):
        svi.step(x, y)
    store = pyro.get_param_store()
    raws = [store._params[f"AutoNormal.scales.{site}"] for site in bnn.latent_sites]
    state = torch.get_rng_state()
    remembered = bnn.curvature_step(guide, x, y, "ef")
    for raw in raws:
        forget_scale(raw)
    torch.set_rng_state(state)
    recomputed = bnn.curvature_step(guide, x, y, "ef")
    torch.testing.assert_close(remembered, recomputed, rtol=1e-6, atol=0)


def test_finiteness_check_tells_an_overflow_of_finite_values_apart():
    huge = torch.full((4,), 3e38)
    assert not bool(_finite(huge))  # the float32 sum overflows ...
    assert bool(_finite(huge, exact=True))  # ... the values are finite
    assert not bool(_finite(torch.tensor([1.0, math.inf]), exact=True))
    assert not bool(_finite(torch.tensor([1.0, math.nan])))


def test_ngvi_takes_a_step_on_huge_finite_statistics(float32_bnn):
    from pyro_ngvi.family import SiteCurvature, attach_curvature, begin_handover

    bnn, guide, svi, x, y = float32_bnn
    svi.step(x, y)
    optim = NGVI(lr=1e-30, beta=0.5, guide=guide)
    store = pyro.get_param_store()
    begin_handover()
    params = []
    for site in bnn.latent_sites:
        loc = store._params[f"AutoNormal.locs.{site}"]
        attach_curvature(loc, SiteCurvature(torch.full_like(loc, 3e38), torch.full_like(loc, 1e30),
                                            prior_loc=torch.zeros_like(loc), prior_precision=torch.ones_like(loc),
                                            nonnegative=True))
        params.append(loc)
    optim(params)
    assert optim.num_skipped_steps == 0 and optim.num_steps == 1


def test_remembered_scale_goes_with_its_tensor():
    import gc

    from pyro_ngvi import scales

    raw = torch.zeros(3)
    remember_scale(raw, torch.ones(3))
    key = id(raw)
    assert key in scales._remembered
    del raw
    gc.collect()
    assert key not in scales._remembered  # no sigma kept for a tensor that is gone


# --------------------------------------------------------------------------- a large site in spans
def _run_large(chunk, monkeypatch, make_svi, steps=3, flat_max=None):
    from pyro_ngvi import groups
    from pyro_ngvi import steps as chain

    monkeypatch.setattr(chain, "SPAN", chunk)
    if flat_max is not None:  # sites above it are groups of their own
        monkeypatch.setattr(groups, "FLAT_MAX", flat_max)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi, args = make_svi()
    losses = [svi.step(*args) for _ in range(steps)]
    store = pyro.get_param_store()
    state = svi.optim.get_state()
    spreads = [float(value) for value in svi.optim._spread_watch.latest.values()]  # the watch on growing means
    return losses, {k: v.detach().clone() for k, v in store.items()}, state, spreads


def _large_model(size):
    data = torch.randn(size, generator=torch.Generator().manual_seed(3))

    def model():
        z = pyro.sample("z", pyro.distributions.Normal(0.0, 1.0).expand([size]).to_event(1))
        pyro.sample("x", pyro.distributions.StudentT(4.0, z, 1.0).to_event(1), obs=data)

    return model


@pytest.mark.parametrize("options", [
    dict(lr=0.3, beta=0.2, momentum=0.9, damping=1.0),  # the chosen-step path, control variate
    dict(lr=0.3, beta=0.2, tau=2.0, warm_start=False, max_step=None),
    dict(),  # NGVI()'s defaults: the adaptive steps (whole site)
])
def test_a_large_site_in_spans_takes_the_whole_sites_step(monkeypatch, options):
    from pyro.infer import Trace_ELBO

    size = 3 * 1024 + 123

    def make_svi():
        model = _large_model(size)
        guide = AutoNormal(model)
        return SVI(model, guide, NGVI(**options), Trace_ELBO()), ()

    # two steps (the second with the first's momentum and warm start): equal up to rounding, as a
    # span picks the series or Kahan's form of the inverse softplus by its own largest sigma (both
    # a few ulps from exact); later sampled steps amplify that rounding
    whole = _run_large(1 << 30, monkeypatch, make_svi, steps=2)
    spans = _run_large(1024, monkeypatch, make_svi, steps=2)
    assert whole[0] == pytest.approx(spans[0], rel=1e-6)
    for name, value in whole[1].items():
        torch.testing.assert_close(value, spans[1][name], rtol=1e-5, atol=1e-6, msg=name)
    for name, entry in whole[2]["ngvi"]["sites"].items():
        other = spans[2]["ngvi"]["sites"][name]
        for key, value in entry.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(value, other[key], rtol=1e-5, atol=1e-6, msg=key)
            else:
                assert value == other[key], key


@pytest.mark.parametrize("curvature, options, noise_limit", [
    ("ef", dict(lr=0.1, beta=0.2, momentum=0.5), 1.0),
    ("reparam", dict(lr=0.1, beta=0.2, momentum=0.5), 1.0),
    ("ef", dict(), 1e-3),  # NGVI()'s minibatch defaults; a floor that binds on every element
    ("reparam", dict(), 1e-3),
])
def test_a_large_layer_in_spans_on_the_fast_path(monkeypatch, curvature, options, noise_limit):
    def make_svi():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(40, 60), nn.Tanh(), nn.Linear(60, 3))
        x, y = torch.randn(32, 40), torch.randint(0, 3, (32,))
        bnn = BayesianNet(net, "categorical", num_data=100, prior=1.0, noise_limit=noise_limit)
        guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=0.05)
        return SVI(bnn, guide, NGVI(**options), CurvatureELBO(curvature)), (x, y)

    whole = _run_large(1 << 30, monkeypatch, make_svi, steps=4, flat_max=1000)
    spans = _run_large(768, monkeypatch, make_svi, steps=4, flat_max=1000)  # 0.weight (2400) in 4 spans
    assert whole[0] == pytest.approx(spans[0], rel=1e-6)  # sum log sigma summed span by span
    for name, value in whole[1].items():
        torch.testing.assert_close(value, spans[1][name], rtol=1e-5, atol=1e-6, msg=name)
    # the watch on growing means sees the same spread, summed span by span
    assert len(whole[3]) >= 2 and whole[3] == pytest.approx(spans[3], rel=1e-5)
    if noise_limit < 1:  # the family's floor held in every span: sigma <= sqrt(v / (L n)), attained
        cap = math.sqrt(noise_limit / (2 * 40))
        sigma = spans[1]["AutoNormal.scales.0.weight"]  # (the store gives constrained values)
        assert float(sigma.max()) == pytest.approx(cap, rel=1e-5)


def test_spans_read_the_remembered_scale_without_softplus(monkeypatch):
    """Once NGVI has written a large site's scale, its next update (in spans, each of which
    writes its part of the raw scale) reads the sigma it remembered, and writes the new raw
    scale without reading it back: no softplus at all."""
    from pyro.infer import Trace_ELBO

    from pyro_ngvi import scales, steps

    monkeypatch.setattr(steps, "SPAN", 1024)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    size = 3 * 1024 + 123
    model = _large_model(size)
    svi = SVI(model, AutoNormal(model), NGVI(lr=0.3, beta=0.2), Trace_ELBO())
    svi.step()
    calls = []
    original = scales.FastSoftplus._call
    monkeypatch.setattr(scales.FastSoftplus, "_call",
                        lambda self, x, *hint: calls.append(x.numel()) or original(self, x, *hint))
    svi.step()
    assert calls == []
    raw = pyro.get_param_store()._params["AutoNormal.scales.z"]
    assert known_scale(raw) is not None


def test_remembered_scale_is_the_raw_scales_and_a_resumed_run_reads_it(float32_bnn, tmp_path):
    """The sigma NGVI remembers is the one its bijection gives the raw scale it wrote, to an ulp or
    two; the optimizer's state carries it, so a run resumed from the saved param store and state
    reads that very sigma (bit for bit) and takes the uninterrupted run's steps; a state that does
    not belong to the raw scale loaded (another point of the run) is not taken for it."""
    bnn, guide, svi, x, y = float32_bnn
    for _ in range(3):
        svi.step(x, y)
    store = pyro.get_param_store()
    names = [f"AutoNormal.scales.{site}" for site in bnn.latent_sites]
    remembered = {}
    for name in names:
        raw = store._params[name]
        remembered[name] = known_scale(raw).clone()
        read = scale_transform(store._constraints[name])(raw.detach())
        torch.testing.assert_close(remembered[name], read, rtol=4 * torch.finfo(torch.float32).eps, atol=0.0)
    store.save(tmp_path / "params.pt")
    svi.optim.save(tmp_path / "optim.pt")
    rng = pyro.util.get_rng_state()
    uninterrupted = [svi.step(x, y) for _ in range(3)]
    expected = {k: v.detach().clone() for k, v in store.items()}
    later = svi.optim.get_state()

    pyro.clear_param_store()
    store.load(tmp_path / "params.pt")
    resumed_svi = SVI(bnn, guide, NGVI(lr=0.1, beta=0.2), CurvatureELBO("ef"))
    resumed_svi.optim.load(tmp_path / "optim.pt")
    for name in names:
        assert torch.equal(known_scale(store._params[name]), remembered[name]), name
    pyro.util.set_rng_state(rng)
    assert [resumed_svi.step(x, y) for _ in range(3)] == uninterrupted
    for k, v in store.items():
        assert torch.equal(v.detach(), expected[k]), k

    pyro.clear_param_store()
    store.load(tmp_path / "params.pt")
    NGVI().set_state(later)  # three steps later: where its sigma moved, it is not the loaded raw scale's
    taken = [known_scale(store._params[name]) is not None for name in names]
    assert not all(taken)
    for name, was_taken in zip(names, taken):
        entry = next(e for e in later["ngvi"]["sites"].values() if e["scale_name"] == name)
        read = scale_transform(store._constraints[name])(store._params[name].detach())
        assert was_taken == torch.allclose(read, entry["scale"], rtol=8 * torch.finfo(torch.float32).eps, atol=0.0)
