"""The full-covariance step's cheaper algebra: the same matrices as the general forms, and the
work it skips (counted by torch's profiler: eigendecompositions, D x D x D matrix products)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pyro_ngvi import full_covariance as fc
from pyro_ngvi.update import full_covariance as update_fc

D = 40


def random_factor(size, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=g, dtype=torch.float64)
    return torch.linalg.cholesky(a @ a.T / size + 0.5 * torch.eye(size, dtype=torch.float64)), g


def symmetric_with(eigenvalues, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=g, dtype=torch.float64))
    return (q * eigenvalues) @ q.T


def ops(fn):
    """The names and input shapes of the aten operators ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, [tuple(s) for s in e.input_shapes]) for e in prof.events()]


def cubic_products(events, size):
    """The matrix products of two size x size matrices among ``events``."""
    return [e for e in events if e[0] in ("aten::mm", "aten::bmm") and e[1][:2] == [(size, size), (size, size)]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_draw_whitened_curvature_is_the_general_form_of_its_factor_gradient(seed):
    factor, g = random_factor(D, seed)
    grad, eps = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    general = fc.whitened_price_curvature(factor, torch.outer(grad, eps).tril())
    brute = factor.T @ fc.price_curvature(factor, torch.outer(grad, eps).tril()) @ factor  # C^T H C
    fast = fc.one_draw_whitened(factor, grad, eps)
    assert torch.allclose(fast, general, rtol=0, atol=1e-12 * general.abs().max())
    assert torch.allclose(fast, brute, rtol=0, atol=1e-9 * brute.abs().max())
    assert not cubic_products(ops(lambda: fc.one_draw_whitened(factor, grad, eps)), D)


def test_control_variate_baseline_is_the_whitened_price_estimate_of_the_precision_without_a_matrix_product():
    factor, g = random_factor(D, 3)
    grad, eps = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    whitened = fc.whitened_price_curvature(factor, torch.outer(grad, eps).tril())
    level = 1.7
    new_grad, new_whitened = fc.controlled_price_statistics(factor, grad, whitened, eps, level)
    pulled = torch.linalg.solve(factor.T, eps)  # C^{-T} eps, the gradient of the quadratic of Hessian S
    baseline = fc.whitened_price_curvature(factor, torch.outer(pulled, eps).tril()) - torch.eye(D, dtype=torch.float64)
    assert torch.allclose(new_grad, grad - level * pulled, rtol=1e-10, atol=1e-10)
    assert torch.allclose(new_whitened, whitened - level * baseline, rtol=0, atol=1e-10)
    events = ops(lambda: fc.controlled_price_statistics(factor, grad, whitened, eps, level))
    assert not cubic_products(events, D)


@pytest.mark.parametrize("low, high, inside", [(0.85, 1.2, True), (0.7, 1.2, False), (0.85, 1.4, False)])
def test_within_agrees_with_the_eigenvalues(low, high, inside):
    from pyro_ngvi.update.full_covariance import _within

    eigenvalues = torch.linspace(low, high, D, dtype=torch.float64)
    matrix = symmetric_with(eigenvalues, 4)
    assert _within(matrix, 0.8, 1.25) is inside
    spectrum = torch.linalg.eigvalsh(matrix)
    assert bool((spectrum >= 0.8).all() and (spectrum <= 1.25).all()) is inside


def spectral_reference(target, beta, ratio, corrected):
    """S'_w = V f(L) V^T of the adaptive step (by direction), written out eigenvalue by eigenvalue, its
    beta shortened to the largest (found by bisection) that keeps every (1 - b) + b lambda in [1/ratio, ratio]."""
    lam, vectors = torch.linalg.eigh(target)

    def fits(b):
        return all(1 / ratio <= (1 - b) + b * x <= ratio for x in lam.tolist())

    if not fits(beta):
        low, high = 0.0, beta
        for _ in range(60):
            low, high = ((low + high) / 2, high) if fits((low + high) / 2) else (low, (low + high) / 2)
        beta = low
    moved = []
    for x in lam.tolist():
        y = max(x, 1 - 1 / beta) if corrected else x
        value = (1 - beta) + beta * y + (0.5 * beta**2 * (1 - y) ** 2 if corrected and y <= 0 else 0.0)
        moved.append(min(max(value, 1 / ratio), ratio))
    return (vectors * torch.tensor(moved, dtype=target.dtype)) @ vectors.T


@pytest.mark.parametrize("beta", [0.5, 0.05])
def test_shortened_step_is_the_spectral_map_without_a_dense_reconstruction(beta):
    factor, g = random_factor(D, 5)
    eigenvalues = torch.cat([torch.linspace(-30, 0.5, D // 4), torch.linspace(0.9, 1.1, D // 2),
                             torch.linspace(2.0, 40.0, D - D // 4 - D // 2)]).double()
    target = symmetric_with(eigenvalues, 6)
    mean, direction = torch.zeros(D, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)

    def run():
        return update_fc.natural_step(mean, factor, direction, target, 1.0, beta, whitened=True,
                                      by_direction=True, max_ratio=1.25)

    step = run()
    new_whitened = spectral_reference(target, beta, 1.25, corrected=True)
    expected = factor @ torch.linalg.inv(new_whitened) @ factor.T  # S'^{-1} = C S'_w^{-1} C^T
    assert step.corrected
    assert torch.allclose(step.factor @ step.factor.T, expected, rtol=0, atol=1e-10 * expected.abs().max())
    events = ops(run)
    assert sum(e[0] == "aten::linalg_eigh" for e in events) == 1
    assert len(cubic_products(events, D)) == 1  # C U_w^{-T} (the reconstruction V f(L) V^T was a second)


def test_step_whose_target_needs_no_clamp_skips_the_eigendecomposition():
    factor, g = random_factor(D, 7)
    beta = 0.3
    target = symmetric_with(torch.linspace(0.5, 1.6, D, dtype=torch.float64), 8)  # lerp in [0.85, 1.18]
    mean, direction = torch.zeros(D, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)

    def run():
        return update_fc.natural_step(mean, factor, direction, target, 1.0, beta, whitened=True,
                                      by_direction=True, max_ratio=1.25)

    step = run()
    new_whitened = (1 - beta) * torch.eye(D, dtype=torch.float64) + beta * target
    expected = factor @ torch.linalg.inv(new_whitened) @ factor.T
    assert not step.corrected
    assert torch.allclose(step.factor @ step.factor.T, expected, rtol=0, atol=1e-10 * expected.abs().max())
    events = ops(run)
    assert not any(e[0] in ("aten::linalg_eigh", "aten::_linalg_eigh") for e in events)
