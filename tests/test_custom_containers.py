"""A user's own container module on BackPACK's first-order path: one whose forward BackPACK's
converter cannot take (two branches multiplied) gets the empirical Fisher exactly and without
BackPACK's warning on every pass (which a test suite that turns warnings into errors failed on);
a layer BackPACK has no extension for (LayerNorm) is refused with an error naming the sources
that need none."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import pyro
from pyro.infer import SVI

from pyro_ngvi import NGVI, CurvatureELBO
from pyro_ngvi.curvature.backpack import network_curvature
from pyro_ngvi.nn import BayesianNet
from pyro_ngvi.nn.twin import BackpackTwin


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 1)

    def forward(self, x):
        return self.head(self.a(x) * torch.sigmoid(self.b(x)))


class Normalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.norm, self.head = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.l1(x))))


def data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=generator), torch.randn(16, generator=generator)


def assert_exact_empirical_fisher(net, x, y):
    """BackPACK's 'ef' through the net's twin equals the squared per-example gradients (torch.func)."""
    twin = BackpackTwin(net, "gaussian")
    result = network_curvature(twin.twin, twin.loss_module, x, y.unsqueeze(-1), "ef", params=twin.params)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, xi, yi):
        return (functional_call(net, p, (xi.unsqueeze(0),)).squeeze() - yi).square()

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for (name, _), h in zip(net.named_parameters(), result.curvatures):
        torch.testing.assert_close(h, per_example[name].square().sum(0), rtol=1e-4, atol=1e-6)


def svi_after_exact_empirical_fisher(net, curvature):
    """:func:`assert_exact_empirical_fisher` on ``net``, then the recipe's SVI with ``curvature``."""
    torch.manual_seed(0)
    x, y = data()
    assert_exact_empirical_fisher(net, x, y)
    pyro.clear_param_store()
    bnn = BayesianNet(net, "gaussian", num_data=16, noise_scale=0.5)
    return SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(curvature)), x, y


def test_gated_container_empirical_fisher_is_exact_and_quiet():
    svi, x, y = svi_after_exact_empirical_fisher(Gated(), "ef")
    for _ in range(2):  # (warnings are errors in this suite)
        svi.step(x, y)


def test_layer_without_extension_names_the_sources_that_need_none():
    x, y = data()
    bnn = BayesianNet(Normalised(), "gaussian", num_data=16, noise_scale=0.5)
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ef"))
    with pytest.raises(RuntimeError, match="LayerNorm.*CurvatureELBO\\('reparam'\\)"):
        svi.step(x, y)


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) + 0.1)


def test_container_adding_a_number_gets_the_exact_empirical_fisher_and_a_clear_refusal_of_ggn():
    """BackPACK's converter turns ``h + 0.1`` into its sum of tensors, which cannot run (an
    AssertionError from inside BackPACK); the container is then left unconverted: the
    empirical Fisher, which needs no pass through it, is exact, and ``ggn`` is refused by name."""
    svi, x, y = svi_after_exact_empirical_fisher(Shifted(), "ggn")
    with pytest.raises(NotImplementedError, match="'ggn'.*CurvatureELBO\\('reparam'\\)"):
        svi.step(x, y)
