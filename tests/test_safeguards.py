"""The safeguards of a step (pyro_ngvi.safeguards), as units."""

import pytest
import torch

import pyro

import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO, NGVIWarning
from pyro_ngvi.family import GaussianSite
from pyro_ngvi.safeguards import NewtonGuard, clamp_precision_, evaluated_on, finite


def make_site(name, value, dtype):
    pyro.param(f"g.locs.{name}", torch.as_tensor(value, dtype=dtype))
    pyro.param(f"g.scales.{name}", torch.full_like(torch.as_tensor(value, dtype=dtype), 0.5),
               constraint=pyro.distributions.constraints.softplus_positive)
    store = pyro.get_param_store()
    return GaussianSite(name, store._params[f"g.locs.{name}"], store._params[f"g.scales.{name}"],
                        f"g.scales.{name}")


@pytest.mark.parametrize("dtype, relative_rise, rejected", [
    (torch.float32, 4e-7, False),  # a few ulps of a float32 sum: round-off, not a rise
    (torch.float32, 1e-4, True),
    (torch.float64, 1e-12, False),
    (torch.float64, 1e-8, True),
])
def test_newton_guard_tells_round_off_from_a_rise(dtype, relative_rise, rejected):
    """The merit F compares steps up to the round-off of its dtype: a float32 F that 'rose
    from 66.2654 to 66.2654' is accepted (it was undone, with a warning, before)."""
    pyro.clear_param_store()
    site = make_site("w", [1.0, 2.0], dtype)
    guard = NewtonGuard()
    guard.keep([site], 66.2654)
    with torch.no_grad():
        site.loc.add_(1.0)
    if rejected:
        with pytest.warns(NGVIWarning, match="undid step"):
            assert guard.rejects([site], 66.2654 * (1 + relative_rise), step=7)
        assert torch.equal(site.loc, torch.tensor([1.0, 2.0], dtype=dtype))  # undone
    else:
        assert not guard.rejects([site], 66.2654 * (1 + relative_rise), step=7)
        assert torch.equal(site.loc, torch.tensor([2.0, 3.0], dtype=dtype))


def test_newton_guard_does_not_damp_steps_whose_predicted_decrease_is_round_off():
    """Near the optimum a float32 F changes by round-off only: Nielsen's ratio of that change to a
    predicted decrease below round-off is noise, and a 'rise' of a few ulps made it negative, which
    multiplied the damping on every such step until the mean froze short of the optimum. Such steps
    relax the damping, as steps that met their prediction do; a predicted decrease well above
    round-off that did not come still raises it."""
    pyro.clear_param_store()
    site = make_site("w", [1.0, 2.0], torch.float32)
    guard = NewtonGuard()
    f = 14668.0
    guard.factor = 9.0
    for _ in range(5):  # F 'rises' by an ulp or two, the model predicted a decrease of 1e-4
        guard.keep([site], f)
        guard.predicted = 1e-4
        assert not guard.rejects([site], f * (1 + 2e-7), step=1)
    assert guard.factor == 1.0
    guard.keep([site], f)
    guard.predicted = 10.0  # predicted 10, got nothing: the quadratic model failed, damp
    assert not guard.rejects([site], f, step=2)
    assert guard.factor == 2.0


def test_newton_recipe_reaches_the_exact_mean_of_a_correlated_float32_regression():
    """The README's Newton recipe on a float32 linear regression with correlated columns: the
    safeguard's damping lets the mean reach the exact posterior mean (it froze 0.18 mean-field
    posterior sds away at N = 2,000, every step 0, while |grad F| = 0.8)."""
    from pyro.infer import SVI
    from pyro.infer.autoguide import AutoNormal

    from pyro_ngvi import NGVI, CurvatureELBO

    n, dim, noise = 2000, 4, 0.5
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=generator)
    x[:, 1] = x[:, 0] + 0.3 * x[:, 1]
    y = x @ torch.tensor([1.0, -1.0, 0.5, 2.0]) + noise * torch.randn(n, generator=generator)

    def model(x, y):
        w = pyro.sample("w", pyro.distributions.Normal(0.0, 2.0).expand([dim]).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("obs", pyro.distributions.Normal((x * w).sum(-1), noise), obs=y)

    xd, yd = x.double(), y.double()
    precision = torch.eye(dim, dtype=torch.float64) / 4 + xd.T @ xd / noise**2
    exact = torch.linalg.solve(precision, xd.T @ yd / noise**2)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    svi = SVI(model, guide, NGVI(lr=1.0, beta=1.0), CurvatureELBO("hessian", deterministic=True))
    for _ in range(300):
        svi.step(x, y)
    error = (guide.locs.w.detach().double() - exact) * precision.diagonal().sqrt()  # in mean-field sds
    assert error.abs().max() < 0.01


def test_newton_guard_compares_sites_by_identity_not_value():
    """Sites of another guide (same name, another shape) are other sites: no element-wise ==
    (which raised 'The size of tensor a (3) must match ...'), no undo of the wrong tensors."""
    pyro.clear_param_store()
    first = make_site("w", [1.0, 2.0, 3.0], torch.float64)
    guard = NewtonGuard()
    guard.keep([first], 1.0)
    pyro.clear_param_store()
    second = make_site("w", [1.0, 2.0, 3.0, 4.0, 5.0], torch.float64)
    assert not guard.rejects([second], 2.0, step=1)  # not the sites it saved: nothing to undo
    assert torch.equal(second.loc, torch.arange(1.0, 6.0, dtype=torch.float64))


def test_clamp_keeps_precision_finite_and_reports_overflow():
    precision = torch.tensor([0.0, 1.0, float(torch.finfo(torch.float32).max)])
    floor = torch.full((3,), 2.0)
    clamped, lowest = clamp_precision_(precision, floor)
    assert bool(clamped)  # the top was passed
    assert torch.all(precision >= 2.0) and torch.all(torch.isfinite(precision.rsqrt()))
    assert float(lowest) == torch.finfo(torch.float32).eps ** 2  # (sigma <= 1 / eps: its draws squared are finite)


def test_finite_tells_an_overflowing_sum_from_a_non_finite_value():
    huge = torch.full((4,), 3e38)
    assert not bool(finite(huge)) and bool(finite(huge, exact=True))
    assert not bool(finite(torch.tensor([1.0, float("nan")]), exact=True))
    mask = torch.tensor([True, False])
    assert bool(finite(torch.tensor([1.0, float("inf")]), mask=mask))  # untouched rows do not count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_is_isfinite_of_the_sum(dtype):
    """finite's two kernels (x - x equal to itself) give what torch.isfinite gives on the sums, as a 0-d bool."""
    for values in ([1.0, -2.0], [0.0, -0.0], [float("inf"), 1.0], [-float("inf"), 1.0], [float("nan"), 1.0],
                   [float("inf"), -float("inf")], [3e38, 3e38]):
        t = torch.tensor(values, dtype=dtype)
        for exact in (False, True):
            flag = finite(t, t.flip(0), exact=exact)
            total = t.sum(dtype=torch.float64 if exact else None) + t.flip(0).sum(dtype=torch.float64 if exact else None)
            assert flag.dtype == torch.bool and flag.dim() == 0
            assert bool(flag) == bool(torch.isfinite(total))


def test_finite_reads_only_the_masked_rows():
    t = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")], [3.0, -4.0]])
    rows = torch.tensor([[True, True], [False, False], [True, True]])
    assert bool(finite(t, mask=rows)) and not bool(finite(t))
    rows[1, 0] = True
    assert not bool(finite(t, mask=rows)) and not bool(finite(t, t.abs(), mask=rows, exact=True))
    big = torch.full((2,), 3e38)  # finite values whose float32 sum overflows: exact tells them apart
    assert not bool(finite(big, mask=torch.tensor([True, True]))) and bool(finite(big, mask=torch.tensor([True, True]), exact=True))


def test_clip_target_carries_the_clipped_part_over():
    """Error feedback: what is clipped off one target is added to the next, so the targets
    taken sum to those given, less the excess still carried."""
    from pyro_ngvi.safeguards import INNOVATION_MAX, clip_target

    precision = torch.ones(3)
    given = [torch.tensor([50.0, 1.0, -30.0]), torch.tensor([1.0, 2.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]),
             torch.tensor([0.5, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])]
    excess, taken = torch.zeros(3), []
    for target in given:
        clipped, excess = clip_target(target.clone(), precision, excess)
        assert (clipped <= 1 + INNOVATION_MAX).all() and (clipped >= 1 - INNOVATION_MAX).all()
        taken.append(clipped)
    torch.testing.assert_close(torch.stack(taken).sum(0) + excess, torch.stack(given).sum(0))
    assert taken[0].tolist() == [10.0, 1.0, -8.0] and taken[1].tolist() == [10.0, 2.0, -8.0]
    assert excess.abs().max() == 0  # all of it taken by the sixth step
    # without a carried excess: the plain clip
    clipped, none = clip_target(torch.tensor([50.0]), torch.ones(1))
    assert none is None and clipped.item() == 1 + INNOVATION_MAX


def test_a_full_covariance_mean_that_stalled_far_from_the_posterior_now_converges_unwarned():
    """An AutoMultivariateNormal started 100 times wider than the posterior took a first step of
    thousands of posterior sds; its precision then outgrew the mean's way back, which crawled
    (220 sds off after 1,000 steps), silently. Its drift test now says so; a run that converges
    does not warn."""
    import warnings

    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoMultivariateNormal

    from pyro_ngvi import NGVI

    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 1, generator=g) + 0.3 * torch.randn(30, 4, generator=g)  # (correlated features)
    y = x @ torch.tensor([1.0, -1.0, 0.5, 0.0]) + 0.5 * torch.randn(30, generator=g)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        with pyro.plate("data", 30):
            pyro.sample("obs", dist.Normal((x * w).sum(-1), 0.5), obs=y)

    precision = torch.eye(4) + x.T @ x / 0.25
    mean = torch.linalg.solve(precision, x.T @ y / 0.25)

    def run(seed, init_scale, steps):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoMultivariateNormal(model, init_scale=init_scale)
        svi = SVI(model, guide, NGVI(), Trace_ELBO())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                svi.step(x, y)
        d = guide.get_posterior().loc.detach() - mean
        return float(d @ precision @ d) ** 0.5, [w for w in caught if "stalls" in str(w.message)]

    # seed 2 stalled (> 50 sds off after 400 steps, warned) while the precision's trust region clamped each
    # eigenvalue; with the shortened beta of update.full_covariance._shortened it converges (0.098 sd), unwarned
    for seed in (2, 0):
        off, stalls = run(seed, 100.0, 400)
        assert off < 0.5 and not stalls, (seed, off)


def normal_mean(data):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(data)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=data)


def test_the_newton_guard_compares_f_only_on_the_same_data():
    """F at the mean is a sum over the rows given: a step on 20 rows after one on 5 'raised' it
    from 13.1 to 79.3, and every step on more rows than the last was undone (and the one before
    with it): after 100 steps on 5, 20 and 12 rows in turn and 300 on all 20, the guide was still
    at its start (mean 0, sd 0.1; the posterior's 2.318, 0.222). F on other data is not compared:
    no step is undone, and the steps on all the data land on the closed-form posterior."""
    data = torch.randn(20, generator=torch.Generator().manual_seed(0)) + 2.0
    guide, optim = AutoNormal(normal_mean), NGVI()
    svi = SVI(normal_mean, guide, optim, CurvatureELBO("hessian", deterministic=True))
    for step in range(30):
        svi.step(data[:(5, 20, 12)[step % 3]])
    assert optim.num_rejected_steps == 0
    for _ in range(30):
        svi.step(data)
    precision = 0.25 + len(data)
    torch.testing.assert_close(guide.locs.mu.detach(), data.sum() / precision, rtol=1e-5, atol=0)
    torch.testing.assert_close(guide.scales.mu.detach(), torch.tensor(precision ** -0.5), rtol=1e-5, atol=0)

    # equal halves, each standing for all the data (poutine.scale): half the steps were undone
    # before, and the guide never left its start (mean 0.0 after 200 steps)
    pyro.clear_param_store()
    halves = pyro.poutine.scale(normal_mean, scale=2.0)
    guide, optim = AutoNormal(halves), NGVI()
    svi = SVI(halves, guide, optim, CurvatureELBO("hessian", deterministic=True))
    for step in range(20):
        svi.step(data[:10] if step % 2 else data[10:])
    assert optim.num_rejected_steps == 0
    assert abs(guide.locs.mu.item() - data.sum().item() / precision) < 1.0


def test_the_newton_guard_takes_equal_data_as_the_same_and_a_written_tensor_as_other():
    """Arguments are the same F where they are the same tensors, unwritten since, or equal copies
    (data made anew each step); a tensor written in place since, or other rows, are other data."""
    site = make_site("w", [1.0, 2.0], torch.float32)
    x = torch.arange(6.0)
    cases = [((x.clone(),), True),          # an equal copy: compared, and the rise undone
             ((x[:3],), False),             # fewer rows: another F, the step kept
             ((x,), True)]                  # the same tensor, unwritten
    for args, compared in cases:
        guard = NewtonGuard()
        guard.keep([site], 10.0, evaluated_on(normal_mean, (x,), {"n": 2}))
        with torch.no_grad():
            site.loc.add_(1.0)
        moved = site.loc.detach().clone()
        if compared:
            with pytest.warns(NGVIWarning, match="undid step"):
                assert guard.rejects([site], 11.0, 1, evaluated_on(normal_mean, args, {"n": 2}))
            assert torch.equal(site.loc, moved - 1.0)
        else:
            assert not guard.rejects([site], 11.0, 1, evaluated_on(normal_mean, args, {"n": 2}))
            assert torch.equal(site.loc, moved)
    guard = NewtonGuard()
    guard.keep([site], 10.0, evaluated_on(normal_mean, (x,), {"n": 2}))
    x.add_(1.0)  # written in place: other data
    assert not guard.rejects([site], 11.0, 1, evaluated_on(normal_mean, (x,), {"n": 2}))
    assert not guard.rejects([site], 11.0, 1, evaluated_on(normal_mean, (x,), {"n": 3}))  # another kwarg
    guard.keep([site], 10.0, evaluated_on(normal_mean, (x,), {"n": 2}))
    assert not guard.rejects([site], 11.0, 1, evaluated_on(lambda data: None, (x,), {"n": 2}))  # another model
