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
