"""The closed-form MLP path of network_curvature (pyro_ngvi.curvature.mlp) against BackPACK."""

import copy

import pytest
import torch
from torch import nn

import pyro
from pyro.infer import SVI

from backpack import extend

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.curvature import mlp
from pyro_ngvi.curvature.backpack import network_curvature

from test_backpack import BackpackOnly, reference_ef_and_grad, reference_ggn

B = 9
LOSSES = {
    "categorical": (lambda: nn.CrossEntropyLoss(reduction="sum"), 4),
    "bernoulli": (lambda: nn.BCEWithLogitsLoss(reduction="sum"), 1),
    "gaussian": (lambda: nn.MSELoss(reduction="sum"), 3),
}


def targets(likelihood, out, generator):
    if likelihood == "categorical":
        return torch.randint(0, out, (B,), generator=generator)
    if likelihood == "bernoulli":
        return torch.randint(0, 2, (B, 1), generator=generator).double()
    return torch.randn(B, out, generator=generator, dtype=torch.float64)


def both_paths(layers):
    """The same weights as a plain Sequential (closed form) and as BackpackOnly (BackPACK)."""
    plain = nn.Sequential(*layers).double()
    other = extend(BackpackOnly(*copy.deepcopy(list(plain))))
    return extend(plain), other


NETS = {
    "activation": lambda act, out: [nn.Linear(6, 5), act, nn.Linear(5, out)],
    "three layers, no bias in the middle": lambda act, out: [nn.Linear(6, 7), act, nn.Linear(7, 5, bias=False),
                                                            copy.deepcopy(act), nn.Linear(5, out)],
    "a bare Linear (a GLM)": lambda act, out: [nn.Linear(6, out)],
    "flatten first, nested, output activation": lambda act, out: [
        nn.Flatten(), nn.Sequential(nn.Linear(6, 5), act), nn.Linear(5, out), nn.Identity(), nn.Tanh()],
}


@pytest.mark.parametrize("net_kind", list(NETS))
@pytest.mark.parametrize("activation", [nn.ReLU(), nn.LeakyReLU(0.1), nn.Tanh(), nn.Sigmoid(), nn.Identity()],
                         ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("likelihood", list(LOSSES))
@pytest.mark.parametrize("source", ["ef", "ggn", "reparam"])
def test_closed_form_equals_backpack(source, likelihood, activation, net_kind):
    torch.manual_seed(0)
    make_loss, out = LOSSES[likelihood]
    plain, other = both_paths(NETS[net_kind](activation, out))
    if net_kind.startswith("a bare"):
        plain = plain[0]
    assert mlp.plan(plain) is not None and mlp.plan(other) is None
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(B, 6, generator=generator, dtype=torch.float64)
    if net_kind.startswith("flatten"):
        x = x.reshape(B, 2, 3)
    y = targets(likelihood, out, generator)
    seen = []
    closed = network_curvature(plain, extend(make_loss()), x, y, source, loss_scale=0.3, check_output=seen.append)
    reference = network_curvature(other, extend(make_loss()), x, y, source, loss_scale=0.3)
    assert len(seen) == 1 and torch.allclose(seen[0], other(x))  # the output is checked once
    assert torch.allclose(closed.loss, reference.loss, rtol=1e-12)
    for g, g_ref in zip(closed.grads, reference.grads):
        assert g.shape == g_ref.shape and torch.allclose(g, g_ref, rtol=1e-10, atol=1e-14)
    for h, h_ref in zip(closed.curvatures, reference.curvatures):
        if source == "reparam":
            assert h is None and h_ref is None
        else:
            assert h.shape == h_ref.shape and torch.allclose(h, h_ref, rtol=1e-10, atol=1e-14)
    assert all(p.grad is None for p in plain.parameters())


@pytest.mark.parametrize("activation", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Softplus(),
                                        nn.Softplus(beta=2.0, threshold=1.0), nn.ELU(alpha=0.7)],
                         ids=["GELU", "GELU-tanh", "SiLU", "Softplus", "Softplus-beta2-threshold1", "ELU"])
@pytest.mark.parametrize("likelihood", list(LOSSES))
def test_activations_backpack_has_no_ggn_for_are_exact_against_autograd(likelihood, activation):
    """GELU, SiLU and Softplus (BackPACK has no second-order extension for them) and ELU in the
    closed form: the gradient, the empirical Fisher and the Gauss-Newton diagonal equal brute-force
    autograd (per-example gradients, and J^T H J from the full Jacobian)."""
    torch.manual_seed(0)
    make_loss, out = LOSSES[likelihood]
    net = nn.Sequential(nn.Linear(6, 5), activation, nn.Linear(5, 4), copy.deepcopy(activation),
                        nn.Linear(4, out)).double()
    assert mlp.plan(net) is not None
    generator = torch.Generator().manual_seed(1)
    x = 1.5 * torch.randn(B, 6, generator=generator, dtype=torch.float64)  # (both sides of Softplus' threshold)
    y = targets(likelihood, out, generator)
    grad, ef = reference_ef_and_grad(net, make_loss(), x, y)
    ggn = reference_ggn(net, likelihood, x)[0]
    for source, expected in (("ef", ef), ("ggn", ggn)):
        closed = network_curvature(net, extend(make_loss()), x, y, source)
        for g, g_ref, h, h_ref in zip(closed.grads, grad, closed.curvatures, expected):
            torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(h, h_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("net_kind", list(NETS))
@pytest.mark.parametrize("likelihood", list(LOSSES))
def test_kronecker_factors_equal_backpacks(likelihood, net_kind):
    # kflr: [G, A] of each weight, [G] of each bias, as BackPACK's KFLR; kfac (sampled targets) has
    # G's mean: over many targets it is KFLR's G
    torch.manual_seed(0)
    make_loss, out = LOSSES[likelihood]
    plain, other = both_paths(NETS[net_kind](nn.Tanh(), out))
    if net_kind.startswith("a bare"):
        plain = plain[0]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(B, 6, generator=generator, dtype=torch.float64)
    if net_kind.startswith("flatten"):
        x = x.reshape(B, 2, 3)
    y = targets(likelihood, out, generator)
    closed = network_curvature(plain, extend(make_loss()), x, y, "kflr", loss_scale=0.3)
    reference = network_curvature(other, extend(make_loss()), x, y, "kflr", loss_scale=0.3)
    assert reference.inputs is None and closed.inputs is not None
    for factors, factors_ref in zip(closed.curvatures, reference.curvatures):
        assert len(factors) == len(factors_ref)
        for f, f_ref in zip(factors, factors_ref):
            assert f.shape == f_ref.shape and torch.allclose(f, f_ref, rtol=1e-10, atol=1e-14)
    sampled = network_curvature(plain, extend(make_loss()), x, y, "kfac", mc_samples=20000, loss_scale=0.3)
    for factors, factors_ref in zip(sampled.curvatures, reference.curvatures):
        scale = factors_ref[0].abs().max()
        assert (factors[0] - factors_ref[0]).abs().max() < 0.05 * scale
        assert len(factors) == 1 or torch.allclose(factors[1], factors_ref[1], rtol=1e-10, atol=1e-14)


def _twice(layer):
    return nn.Sequential(layer, nn.Tanh(), layer)


def _with_parameter(net):
    net.register_parameter("temperature", nn.Parameter(torch.ones(())))
    return net


def _hooked(net):
    net[0].register_forward_hook(lambda module, inputs, output: 2 * output)
    return net


@pytest.mark.parametrize("make_net, why", [
    (lambda: BackpackOnly(nn.Linear(3, 2)), "a Sequential subclass"),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.Softmax(-1)), "not element-wise"),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5), nn.Linear(2, 2)), "dropout"),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.Mish(), nn.Linear(2, 2)), "an activation not covered"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Flatten(), nn.Linear(4, 2)), "flatten after a Linear"),
    (lambda: nn.Sequential(nn.Tanh()), "no Linear"),
    (lambda: _hooked(nn.Sequential(nn.Linear(3, 2), nn.Tanh())), "a user's forward hook"),
    (lambda: nn.Sequential(nn.Linear(3, 2).requires_grad_(False), nn.Linear(2, 2)), "a frozen layer"),
    (lambda: _twice(nn.Linear(3, 3)), "one layer twice (weights shared)"),
    (lambda: _with_parameter(nn.Sequential(nn.Linear(3, 2))), "a parameter of the container"),
])
def test_plan_refuses_what_it_does_not_compute(make_net, why):
    assert mlp.plan(make_net()) is None, why


def test_a_user_hook_is_honoured_by_falling_back_to_backpack():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(B, 3, dtype=torch.float64), torch.randint(0, 2, (B,))
    loss = extend(nn.CrossEntropyLoss(reduction="sum"))
    before = network_curvature(extend(copy.deepcopy(net)), loss, x, y, "ggn")
    _hooked(net)
    after = network_curvature(extend(net), loss, x, y, "ggn")
    assert torch.allclose(after.loss, loss(net(x), y))  # the doubled output, as the network computes it
    assert not torch.allclose(after.loss, before.loss)


@pytest.mark.parametrize("loss_module", [
    nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1),
    nn.CrossEntropyLoss(reduction="sum", weight=torch.ones(3, dtype=torch.float64)),
    nn.BCEWithLogitsLoss(reduction="sum", pos_weight=torch.ones(1, dtype=torch.float64)),
])
def test_loss_options_outside_the_closed_form_are_left_to_backpack(loss_module):
    f = torch.randn(B, 3 if isinstance(loss_module, nn.CrossEntropyLoss) else 1, dtype=torch.float64)
    y = torch.randint(0, 3, (B,)) if isinstance(loss_module, nn.CrossEntropyLoss) else torch.ones(B, 1).double()
    assert mlp.output_gradient_and_hessian(loss_module, f, y) is None


@pytest.mark.parametrize("likelihood", list(LOSSES))
def test_ggn_mc_rows_have_the_loss_hessian_as_mean(likelihood):
    # sum_m r_m r_m^T over many sampled targets -> the output Hessian (the Fisher of the likelihood)
    make_loss, out = LOSSES[likelihood]
    f = torch.randn(3, out, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.manual_seed(1)
    rows = mlp.sampled_rows(make_loss(), f, 200000)
    estimate = rows.transpose(1, 2) @ rows
    if likelihood == "categorical":
        p = f.softmax(-1)
        exact = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    elif likelihood == "bernoulli":
        exact = (f.sigmoid() * (1 - f.sigmoid())).unsqueeze(-1)
    else:
        exact = 2 * torch.eye(out, dtype=torch.float64).expand(3, out, out)
    assert (estimate - exact).abs().max() < 0.02 * exact.abs().max()
    assert not torch.allclose(estimate, 2 * exact, atol=0.1 * exact.abs().max())


@pytest.mark.parametrize("likelihood, source", [("categorical", "ggn"), ("categorical", "ef"),
                                                ("categorical", "ggn_mc"),
                                                ("categorical", "reparam"), ("gaussian", "ggn"),
                                                ("bernoulli", "ef")])
def test_the_recipe_takes_the_same_steps_on_both_paths(likelihood, source):
    # BayesianNet's fast path over a plain MLP (closed form) and over the same MLP as a
    # Sequential subclass (BackPACK): the same guide after a few NGVI steps (the Gaussian
    # likelihood's noise scale learned: a tensor per-example weight)
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = {"categorical": (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), "bernoulli": (x[:, 0] > 0).double(),
         "gaussian": x[:, 0] - x[:, 1]}[likelihood]
    results = []
    for container in (nn.Sequential, BackpackOnly):
        pyro.clear_param_store()
        torch.manual_seed(0)
        net = container(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3 if likelihood == "categorical" else 1)).double()
        bnn = BayesianNet(net, likelihood=likelihood, num_data=len(x))
        svi = SVI(bnn, bnn.guide(), NGVI(), loss=CurvatureELBO(source))
        torch.manual_seed(1)
        for step in range(5):
            svi.step(x[8 * step: 8 * step + 8], y[8 * step: 8 * step + 8])
        results.append({name: value.detach().clone() for name, value in pyro.get_param_store().items()})
    assert results[0].keys() == results[1].keys()
    if source == "ggn_mc":  # (the two paths draw their targets differently: the same guide up to that noise)
        for name in results[0]:
            assert torch.allclose(results[0][name], results[1][name], rtol=0.05, atol=0.02), name
        return
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], rtol=1e-9, atol=1e-12), name


def test_a_kronecker_guide_takes_the_same_steps_on_both_paths():
    # KroneckerNormal's step reads its input factor from the inputs the closed form returns
    # (BackPACK's pass fills them by a hook instead): the same guide after a few steps
    from pyro_ngvi import KroneckerNormal

    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    results = []
    for container in (nn.Sequential, BackpackOnly):
        pyro.clear_param_store()
        torch.manual_seed(0)
        net = container(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        bnn = BayesianNet(net, likelihood="categorical", num_data=len(x))
        guide = KroneckerNormal(bnn, init_scale=float(bnn.initial_scale()))
        svi = SVI(bnn, guide, NGVI(), loss=CurvatureELBO("ggn"))
        torch.manual_seed(1)
        for step in range(5):
            svi.step(x[8 * step: 8 * step + 8], y[8 * step: 8 * step + 8])
        results.append({name: value.detach().clone() for name, value in pyro.get_param_store().items()})
    assert results[0].keys() == results[1].keys() and len(results[0]) > 0
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], rtol=1e-9, atol=1e-12), name
