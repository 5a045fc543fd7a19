"""
The cross terms of NGVI's control variate (``pyro_ngvi.variance.cross_terms``): on a correlated
posterior the diagonal control variate leaves the noise
:math:`\\sum_{j \\ne i} H_{ij}\\sigma_j\\epsilon_j` in :math:`g`; a regression of past
gradients on past draw points removes it for small models, without using this
step's draw (unbiased), and survives a checkpoint.
"""

import pytest
import torch

import pyro
import pyro.distributions as dist
import pyro_ngvi.variance
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_ngvi import NGVI, CurvatureELBO
from pyro_ngvi.family import SiteCurvature, gaussian_sites

NOISE = 0.5


def regression_data(n=200, d=5, correlation=0.3):
    """The benchmark's correlated design (benchmarks/conjugate.py), float64."""
    g = torch.Generator().manual_seed(0)
    cov = (1 - correlation) * torch.eye(d, dtype=torch.float64) + correlation
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov).T
    w = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w + NOISE * torch.randn(n, generator=g, dtype=torch.float64)
    precision = x.T @ x / NOISE**2 + torch.eye(d, dtype=torch.float64)
    mean = torch.linalg.solve(precision, x.T @ y / NOISE**2)
    return x, y, mean, precision.diagonal().rsqrt()  # the exact mean-field optimum


def regression(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal((x * w).sum(-1), NOISE), obs=y)


def within_one_percent(mean, std) -> bool:
    loc, scale = pyro.param("AutoNormal.locs.w"), pyro.param("AutoNormal.scales.w")
    return bool(((loc - mean).abs() < 0.01 * std).all() and ((scale / std - 1).abs() < 0.01).all())


@pytest.mark.parametrize("loss", [lambda: Trace_ELBO(max_plate_nesting=1),
                                  lambda: CurvatureELBO("reparam", max_plate_nesting=1),
                                  lambda: CurvatureELBO("hessian", max_plate_nesting=1),
                                  lambda: CurvatureELBO("ggn", max_plate_nesting=1)],
                         ids=["trace_elbo", "reparam", "hessian", "ggn"])
def test_correlated_regression_reaches_one_percent_where_the_diagonal_control_variate_cannot(
        monkeypatch, loss):
    """NGVI() with one draw per step holds the exact mean-field optimum to 1 % over steps
    380-400 (it gets there in about 150-220 steps, benchmarks/results/conjugate.md);
    with the diagonal control variate alone (no cross terms) it is still outside (it
    needs about 1300-8000). With curvature computed at the draw (hessian, ggn) too: the
    cross terms correct the gradient whatever the curvature's source (they were left out
    for those, which stayed 0.4 marginal sds off after 2,000 steps)."""
    x, y, mean, std = regression_data()
    outcome, default = {}, pyro_ngvi.variance.CROSS_MAX
    for cross_max in (default, 0):
        monkeypatch.setattr(pyro_ngvi.variance, "CROSS_MAX", cross_max)
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(regression, AutoNormal(regression), NGVI(), loss())
        held = []
        for step in range(400):
            svi.step(x, y)
            if step >= 380:
                held.append(within_one_percent(mean, std))
        outcome[cross_max] = all(held)
    assert outcome == {default: True, 0: False}


def quadratic_site(d=4):
    """One AutoNormal site of ``d`` elements and its NGVI, for hand-made statistics."""
    def model():
        pyro.sample("u", dist.Normal(torch.zeros(d, dtype=torch.float64), 1.0).to_event(1))

    pyro.clear_param_store()
    guide = AutoNormal(model)
    guide()
    (site,) = gaussian_sites(guide)
    return site, NGVI(guide=guide)


def off_diagonal_sym(matrix):
    sym = 0.5 * (matrix + matrix.T)
    return sym - torch.diag(sym.diagonal())


def test_cross_terms_use_past_draws_only():
    """At step t the term subtracted from g is offdiag(H_t) z_t, H_t the symmetrized
    least-squares slope of g on the draw points w = mu + z of steps 1 .. t-1 (brute
    force here; equal weights before 100 steps), 0 before D + 1 past steps; changing
    this step's g leaves it unchanged (it never sees this step's draw); the curvature
    loses eps (offdiag(H_t) z_t) / sigma."""
    d = 4
    site, optim = quadratic_site(d)
    g = torch.Generator().manual_seed(1)
    sigma = site.scale.detach().reshape(-1)
    points, grads = [], []
    for t in range(12):
        eps = torch.randn(d, generator=g, dtype=torch.float64)
        raw = torch.randn(d, generator=g, dtype=torch.float64)  # any gradient: a non-quadratic model
        curvature = torch.rand(d, generator=g, dtype=torch.float64) + 1.0

        def corrected(grad):
            stats = {site.key: SiteCurvature(grad.clone(), curvature.clone(), sampled=True,
                                             eps_mean=eps.clone(), eps_sq_mean=eps.square())}
            kept = pyro_ngvi.variance.cross_terms([site], stats, optim._state)
            return stats[site.key], kept

        out, kept = corrected(raw)
        state, new = kept.state, kept.new
        shifted = raw + 10.0 * torch.randn(d, generator=g, dtype=torch.float64)
        other, _ = corrected(shifted)
        z = sigma * eps
        if t <= d:
            expected = torch.zeros(d, dtype=torch.float64)
        else:
            w, gs = torch.stack(points), torch.stack(grads)
            wc, gc = w - w.mean(0), gs - gs.mean(0)
            slope = torch.linalg.lstsq(wc, gc).solution.T  # g ~ a + slope w
            expected = off_diagonal_sym(slope) @ z
            assert expected.abs().max() > 1e-3  # a real term to compare
        torch.testing.assert_close(raw - out.grad, expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(curvature - out.curvature, eps * expected / sigma, rtol=1e-9, atol=1e-12)
        # the term is the same whatever this step's gradient
        torch.testing.assert_close(shifted - other.grad, raw - out.grad, rtol=1e-12, atol=1e-12)
        state.cross = new  # the step is taken: the regression takes this step's pair
        points.append(site.loc.detach().reshape(-1) + z)
        grads.append(raw)


def test_cross_terms_are_exact_on_a_quadratic_after_d_plus_one_steps():
    """With g = b + H w (a quadratic log joint), the term is offdiag(H) z exactly from
    step D + 2 on: g minus it is b + H w - offdiag(H) z, whose noise is the diagonal
    part the diagonal control variate removes."""
    d = 4
    site, optim = quadratic_site(d)
    g = torch.Generator().manual_seed(2)
    hessian, b = random_hessian(d, g), torch.randn(d, generator=g, dtype=torch.float64)
    for t in range(3 * d):
        term, z, _ = quadratic_step(site, optim, g, hessian, b)
        if t > d:
            torch.testing.assert_close(term, off_diagonal_sym(hessian) @ z, rtol=1e-8, atol=1e-10)


def random_hessian(d, g):
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return a @ a.T + torch.eye(d, dtype=torch.float64)


def quadratic_step(site, optim, g, hessian, offset):
    """One step of the cross terms on the quadratic log joint g(w) = offset + H w at a new draw
    (the step taken: the regression keeps its pair): the term subtracted from g, the draw's
    offset z and the regression's new state."""
    sigma, loc = site.scale.detach().reshape(-1), site.loc.detach().reshape(-1)
    eps = torch.randn(loc.numel(), generator=g, dtype=torch.float64)
    z = sigma * eps
    raw = offset + hessian @ (loc + z)
    stats = {site.key: SiteCurvature(raw.clone(), torch.ones_like(raw), sampled=True,
                                     eps_mean=eps, eps_sq_mean=eps.square())}
    kept = pyro_ngvi.variance.cross_terms([site], stats, optim._state)
    kept.state.cross = kept.new
    return raw - stats[site.key].grad, z, kept.new


def test_the_regression_restarts_where_its_line_misses_g_by_many_sds():
    """On a quadratic log joint the regression's line is exact (a miss of 0); a g that misses
    it by more than CROSS_MISFIT current sds (here the log joint changes: another Hessian, as a
    wide start's first steps see one far from the optimum's) restarts the regression from that
    step's pair, which then corrects nothing until it has D + 1 pairs, and is exact again for
    the new Hessian after them (tests/test_wide_start.py: what the restart is for)."""
    d = 3
    site, optim = quadratic_site(d)
    g = torch.Generator().manual_seed(0)
    first, second = random_hessian(d, g), 1e4 * random_hessian(d, g)
    for _ in range(2 * d):
        term, z, new = quadratic_step(site, optim, g, first, 0.0)
    torch.testing.assert_close(term, off_diagonal_sym(first) @ z)  # exact on the quadratic
    assert float(new[0, 0]) == 2 * d
    term, _, new = quadratic_step(site, optim, g, second, 5e3)  # misses the line by ~1e3 sds
    assert term.abs().max() > 0 and float(new[0, 0]) == 1.0  # used, then restarted
    for t in range(d + 1):
        term, z, new = quadratic_step(site, optim, g, second, 5e3)
        if t < d:
            assert (term == 0).all()  # too few pairs yet
    torch.testing.assert_close(term, off_diagonal_sym(second) @ z)


def test_resume_is_bit_identical_with_the_cross_terms(tmp_path):
    """get_state carries the regression (the 'cross' entry): a resumed run takes the
    uninterrupted run's steps bit for bit."""
    x, y, _, _ = regression_data(n=50)

    def new_svi(guide):
        optim = NGVI()
        return SVI(regression, guide, optim, Trace_ELBO(max_plate_nesting=1)), optim

    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    svi, optim = new_svi(AutoNormal(regression))
    for _ in range(30):
        svi.step(x, y)
    (entry,) = optim.get_state()["ngvi"]["sites"].values()
    (cross,) = entry["cross"].values()  # (by the structure of the sites it covers: here w alone)
    assert cross.shape == (13, 5)
    pyro.get_param_store().save(tmp_path / "params.pt")
    optim.save(tmp_path / "optim.pt")
    rng = pyro.util.get_rng_state()
    uninterrupted = [svi.step(x, y) for _ in range(30)]
    expected = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "params.pt")
    guide = AutoNormal(regression)
    guide(x, y)
    svi, optim = new_svi(guide)
    optim.load(tmp_path / "optim.pt")
    pyro.util.set_rng_state(rng)
    resumed = [svi.step(x, y) for _ in range(30)]
    assert resumed == uninterrupted
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v, expected[k]), k


def test_coupled_mean_step_is_the_newton_step_and_falls_back_where_not_positive_definite():
    """With the off-diagonal Hessian known, the element-wise step delta = D^-1 r becomes the
    Newton step H^-1 r (D the diagonal of H); where D + H_off is not positive definite, or
    no off-diagonal estimate exists yet, the element-wise step is kept as it was."""
    from pyro_ngvi.update.mean_field import coupled_mean_step

    g = torch.Generator().manual_seed(5)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    hessian = a @ a.T + 0.5 * torch.eye(6, dtype=torch.float64)
    diagonal = hessian.diagonal().clone()
    off = hessian - torch.diag(diagonal)
    r = torch.randn(6, generator=g, dtype=torch.float64)
    wide = torch.full((6,), 1e6, dtype=torch.float64)
    newton = coupled_mean_step(r / diagonal, diagonal, off, wide)
    torch.testing.assert_close(newton, torch.linalg.solve(hessian, r), rtol=1e-10, atol=1e-12)
    # clipped to the radius element-wise
    radius = torch.full((6,), 0.01, dtype=torch.float64)
    assert coupled_mean_step(r / diagonal, diagonal, off, radius).abs().max() <= 0.01
    # not positive definite: the element-wise step, bit for bit
    step = r / diagonal
    indefinite = -30.0 * off
    assert torch.linalg.eigvalsh(indefinite + torch.diag(diagonal)).min() < 0
    assert torch.equal(coupled_mean_step(step, diagonal, indefinite, wide), step)
    assert torch.equal(coupled_mean_step(step, diagonal, torch.zeros(6, 6, dtype=torch.float64), wide), step)


def test_a_precision_below_a_nearly_singular_hessian_s_diagonal_takes_the_regression_s():
    """A 4-vector seen only through its sum: H = I/4 + 32 11^T (its diagonal 32.25, off-diagonal 32).
    A precision whose noise puts an element below 32 makes D + H_off indefinite; the element-wise
    step it fell back to leaves the directions only the prior holds all but still (8 draws a step
    under CurvatureELBO: 1.2 and 2.3 mean-field sd off after 1,000 steps). With the regression's own
    diagonal (plus the prior's), max(D, diag H) + H_off, the coupled step is the Newton step again."""
    from pyro_ngvi.update.mean_field import coupled_mean_step

    hessian = torch.eye(4, dtype=torch.float64) / 4 + 32.0 * torch.ones(4, 4, dtype=torch.float64)
    off = hessian - torch.diag(hessian.diagonal())
    noisy = torch.tensor([31.0, 33.0, 32.5, 30.5], dtype=torch.float64)  # (the precision the step used)
    assert torch.linalg.eigvalsh(off + torch.diag(noisy)).min() < 0
    r = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    wide = torch.full((4,), 1e6, dtype=torch.float64)
    step = r / noisy
    assert torch.equal(coupled_mean_step(step, noisy, off, wide), step)  # without the diagonal: element-wise
    lifted = torch.maximum(noisy, hessian.diagonal())
    expected = torch.linalg.solve(off + torch.diag(lifted), noisy * step)
    torch.testing.assert_close(coupled_mean_step(step, noisy, off, wide, hessian.diagonal()), expected,
                               rtol=1e-10, atol=1e-12)
    # a diagonal given where D + H_off is positive definite changes nothing, bit for bit
    good = hessian.diagonal() + 1.0
    assert torch.equal(coupled_mean_step(r / good, good, off, wide, hessian.diagonal()),
                       coupled_mean_step(r / good, good, off, wide))

    # the run: 8 draws a step under CurvatureELBO reach the exact means (were 1.2-2.3 sd off)
    obs = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 0.5 + 3.0

    def model(obs):
        t = pyro.sample("t", dist.Normal(0.0, 2.0).expand([4]).to_event(1))
        with pyro.plate("obs", 8):
            pyro.sample("o", dist.Normal(t.sum(-1), 0.5), obs=obs)

    mean = torch.linalg.solve(hessian.float(), torch.ones(4) * obs.sum() / 0.25)
    scale = hessian.diagonal().float().rsqrt()
    for seed in (0, 1):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoNormal(model)
        svi = SVI(model, guide, NGVI(), CurvatureELBO("reparam", num_particles=8))
        for _ in range(1000):
            svi.step(obs)
        loc, found = (t.detach() for t in guide._get_loc_and_scale("t"))
        assert float(((loc - mean).abs() / scale).max()) < 0.3
        assert float((found / scale - 1).abs().max()) < 0.05


def test_bfloat16_sites_train_without_cross_terms():
    # torch has no Cholesky factor for half dtypes: the regression's raised NotImplementedError
    # ("cholesky_cpu" not implemented for 'BFloat16') at the first step of a bfloat16 AutoNormal
    # under Trace_ELBO, where Adam trains it. Without cross terms it lands on the mean-field
    # optimum to the dtype's resolution.
    dtype = torch.bfloat16
    x, y, mean, sd = regression_data(n=100, d=3)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(regression)
    svi = SVI(regression, guide, NGVI(), loss=Trace_ELBO())
    for _ in range(300):
        svi.step(x.to(dtype), y.to(dtype))
    store = pyro.get_param_store()
    assert store["AutoNormal.locs.w"].dtype == dtype
    assert ((store["AutoNormal.locs.w"].double() - mean).abs() / sd).max() < 0.5
    torch.testing.assert_close(store["AutoNormal.scales.w"].double() / sd, torch.ones(3, dtype=torch.float64),
                               rtol=0, atol=0.15)


def test_a_precision_just_below_a_nearly_singular_hessian_s_diagonal_does_not_overshoot():
    """The precision 0.41 below H_ii = 32.25 (a 4-vector seen through its sum; the noise of 8
    particles' precisions at step 1,737): D + H_off is positive definite, yet its smallest
    eigenvalue is 0.016 where H's is 0.25, and the coupled step was 12 times the Newton step's
    length (78 mean-field sd where Newton's is 6). The regression's diagonal lifts it whenever
    given: max(D, diag H) + H_off, no longer than Newton's step. On a correlated regression (10
    features, correlation 0.9) under Trace_ELBO(num_particles=8, vectorize_particles=True), the
    means then stay within 0.5 mean-field sd of the exact posterior's over steps 600-900 (they
    jumped 2.9 and 1.7 sd off, seeds 1 and 3)."""
    from pyro_ngvi.update.mean_field import coupled_mean_step

    hessian = torch.eye(4, dtype=torch.float64) / 4 + 32.0 * torch.ones(4, 4, dtype=torch.float64)
    off = hessian - torch.diag(hessian.diagonal())
    noisy = hessian.diagonal() + torch.tensor([1.06, -0.41, 0.06, 0.44], dtype=torch.float64)
    assert 0.0 < torch.linalg.eigvalsh(off + torch.diag(noisy)).min() < 0.02
    r = torch.tensor([0.3, -0.2, 0.1, 0.05], dtype=torch.float64)
    wide = torch.full((4,), 1e6, dtype=torch.float64)
    coupled = coupled_mean_step(r / noisy, noisy, off, wide, hessian.diagonal())
    lifted = torch.maximum(noisy, hessian.diagonal())
    torch.testing.assert_close(coupled, torch.linalg.solve(off + torch.diag(lifted), r), rtol=1e-10, atol=1e-12)
    newton = torch.linalg.solve(hessian, r)
    sd = hessian.diagonal().rsqrt()
    assert float((coupled / sd).abs().max()) <= float((newton / sd).abs().max())
    assert float(coupled @ (off + torch.diag(lifted)) @ coupled) <= float(r @ newton)
    old = torch.linalg.solve(off + torch.diag(noisy), r)  # (what D + H_off alone gave)
    assert float((old / sd).abs().max()) > 10 * float((newton / sd).abs().max())

    size, rows = 10, 20
    g = torch.Generator().manual_seed(1)
    features = torch.randn(rows, size, generator=g) @ torch.linalg.cholesky(
        torch.full((size, size), 0.9) + 0.1 * torch.eye(size)).T
    y = features @ torch.randn(size, generator=g) + 0.5 * torch.randn(rows, generator=g)

    def regression():
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([size]).to_event(1))
        with pyro.plate("rows", rows):
            pyro.sample("y", dist.Normal((w * features).sum(-1), 0.5), obs=y)

    precision = torch.eye(size) + features.T @ features / 0.25
    mean, scale = torch.linalg.solve(precision, features.T @ y / 0.25), precision.diagonal().rsqrt()
    for seed in (1, 3):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        guide = AutoNormal(regression)
        elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
        svi = SVI(regression, guide, NGVI(), elbo)
        worst = 0.0
        for step in range(900):
            svi.step()
            if step >= 600:
                worst = max(worst, float(((guide.locs.w.detach() - mean).abs() / scale).max()))
        assert worst < 0.5, (seed, worst)
