"""A BayesianNet whose network holds one layer under two names (tied weights, a repeated block):
its forward leaves the network's own Parameters in place (the fast path writes each draw into
them: a network that had lost them ran the shared layer on the first trace's draw at every step,
a sine regression's -ELBO 214 after 1,000 steps, Trace_ELBO's 100), and BackPACK's sources refuse it with a NotImplementedError
that says why (BackPACK keeps one call's input and output per module)."""

import pytest
import torch
from torch import nn

import pyro
from pyro.infer import SVI

from pyro_ngvi import NGVI, CurvatureELBO
from pyro_ngvi.nn import BayesianNet


def tied_net():
    torch.manual_seed(3)
    layer = nn.Linear(4, 4)
    return nn.Sequential(layer, nn.Tanh(), layer, nn.Tanh(), nn.Linear(4, 1))


def data():
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return x, torch.sin(x.sum(-1))


def test_forward_keeps_the_networks_parameters():
    net = tied_net()
    before = [(name, p) for name, p in net.named_parameters(remove_duplicate=False)]
    bnn = BayesianNet(net, "gaussian", num_data=32, noise_scale=0.5)
    x, y = data()
    pyro.poutine.trace(bnn).get_trace(x, y)
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("reparam"))
    for _ in range(3):
        svi.step(x, y)
    after = [(name, p) for name, p in net.named_parameters(remove_duplicate=False)]
    assert [n for n, _ in before] == [n for n, _ in after]
    assert all(p is q and isinstance(q, nn.Parameter) for (_, p), (_, q) in zip(before, after))


@pytest.mark.parametrize("source", ["ef", "ggn", "ggn_mc"])
def test_backpack_sources_refuse_a_layer_called_twice(source):
    net = tied_net()
    bnn = BayesianNet(net, "gaussian", num_data=32, noise_scale=0.5)
    x, y = data()
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(source))
    with pytest.raises(NotImplementedError, match="more than once.*reparam"):
        svi.step(x, y)
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())


class CalledTwice(nn.Module):
    """A network of a class of its own whose forward calls one layer twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


@pytest.mark.parametrize("source", ["ggn", "ggn_mc"])
def test_second_order_sources_name_a_layer_called_twice_in_a_forward_of_its_own(source):
    """The forward of a class of its own reaches BackPACK as a torch.fx graph; with a layer called
    twice BackPACK's converter refuses it ('Cycle with parameters detected ... used 2 times'), and the
    refusal said only 'does not have an extension for Module CalledTwice', as if the container were
    an unknown layer: it now cites the converter's reason."""
    bnn = BayesianNet(CalledTwice(), "gaussian", num_data=32, noise_scale=0.5)
    x, y = data()
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(source))
    with pytest.raises(NotImplementedError, match=r"did not become a graph of its layers.*used 2 times.*'reparam'"):
        svi.step(x, y)
    pyro.clear_param_store()
    svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("reparam"))  # (what it names trains)
    assert torch.isfinite(torch.tensor(svi.step(x, y)))
