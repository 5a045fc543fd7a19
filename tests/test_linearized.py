"""pyro_ngvi.linearized: the GLM predictive (issue 26)."""

import pytest
import torch
from torch import nn

from pyro_ngvi.linearized import linearized_outputs


def test_linearised_predictive_of_a_linear_model_is_its_exact_predictive_draw_for_draw():
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    posterior = {name: (torch.randn_like(p), 0.3 * torch.rand_like(p) + 0.1) for name, p in net.named_parameters()}
    x = torch.randn(7, 3, dtype=torch.float64)
    ours = linearized_outputs(net, posterior, x, 5, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the same draws, in the same order: weight then bias
    for s in range(5):
        w, b = (mean + std * torch.randn(mean.shape, generator=g, dtype=mean.dtype) for mean, std in
                (posterior["weight"], posterior["bias"]))
        assert torch.allclose(ours[s], x @ w.T + b, atol=1e-12)


def test_linearised_predictive_has_the_moments_of_the_first_order_expansion():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    names = [k for k, _ in net.named_parameters()]
    means = [p.detach().clone() for p in net.parameters()]
    stds = [0.05 + 0.1 * torch.rand_like(m) for m in means]
    x = torch.randn(4, 2, dtype=torch.float64)
    outputs = linearized_outputs(net, {n: (m, s) for n, m, s in zip(names, means, stds)}, x, 20000,
                                 torch.Generator().manual_seed(0)).squeeze(-1)
    jac = torch.func.jacrev(lambda *ws: torch.func.functional_call(net, dict(zip(names, ws)), (x,)).squeeze(-1),
                            argnums=tuple(range(len(means))))(*means)
    variance = sum((j.reshape(4, -1).square() * s.reshape(1, -1).square()).sum(1) for j, s in zip(jac, stds))
    assert torch.allclose(outputs.mean(0), net(x).squeeze(-1).detach(), atol=4 * float(variance.max().sqrt()) / 20000**0.5)
    assert torch.allclose(outputs.var(0) / variance, torch.ones(4, dtype=torch.float64), atol=0.05)


def test_point_estimates_and_bad_sample_counts():
    net = nn.Linear(2, 1)
    posterior = {"weight": (net.weight.detach(), None)}
    x = torch.randn(3, 2)
    out = linearized_outputs(net, posterior, x, 2)
    assert torch.allclose(out[0], net(x).detach()) and torch.allclose(out[1], out[0])
    with pytest.raises(ValueError, match="num_samples"):
        linearized_outputs(net, posterior, x, 0)
