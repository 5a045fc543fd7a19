"""
network_curvature against brute-force references (per-example loops, J^T H J), on
both of its paths: the closed form of a plain ``nn.Sequential`` MLP
(:mod:`pyro_ngvi.curvature.mlp`) and BackPACK (:class:`BackpackOnly`, a ``Sequential``
subclass, is no plain MLP to the closed form).
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from backpack import backpack, extend

import pyro
from pyro.infer import SVI

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO

from pyro_ngvi.curvature.batch_norm import EmpiricalFisherBackprop

from test_nn import output_hessian
from pyro_ngvi.curvature.backpack import (
    CURVATURE_EXTENSIONS,
    LOSS_MODULES,
    _extension,
    network_curvature,
)

B, D_IN, HIDDEN = 7, 4, 5


def extended_copy(plain):
    """A BackPACK-extended twin; references use the hook-free original (torch.func
    cannot differentiate through BackPACK's backward hooks)."""
    return extend(copy.deepcopy(plain))


class BackpackOnly(nn.Sequential):
    """A ``Sequential`` subclass (it could have a forward of its own): computed by BackPACK."""


#: the two paths of network_curvature: the closed form of a plain MLP, and BackPACK
CONTAINERS = [nn.Sequential, BackpackOnly]


def make_problem(likelihood, activation=nn.Tanh, seed=0, container=nn.Sequential):
    """A 4 -> 5 -> K MLP in float64, its extended twin, a loss module and a batch."""
    torch.manual_seed(seed)
    out = {"categorical": 3, "bernoulli": 1, "gaussian": 2}[likelihood]
    plain = container(nn.Linear(D_IN, HIDDEN), activation(), nn.Linear(HIDDEN, out))
    plain = plain.double()
    x = torch.randn(B, D_IN, dtype=torch.float64)
    if likelihood == "categorical":
        loss_module = nn.CrossEntropyLoss(reduction="sum")
        y = torch.randint(0, out, (B,))
    elif likelihood == "bernoulli":
        loss_module = nn.BCEWithLogitsLoss(reduction="sum")
        y = torch.randint(0, 2, (B, 1)).double()
    else:
        loss_module = nn.MSELoss(reduction="sum")
        y = torch.randn(B, out, dtype=torch.float64)
    return plain, extended_copy(plain), extend(loss_module), x, y


def flat_output_fn(net, x):
    """theta (flat) -> net output, for torch.func."""
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]

    def fn(theta):
        chunks = torch.split(theta, sizes)
        params = {n: c.reshape(s) for n, c, s in zip(names, chunks, shapes)}
        return functional_call(net, params, (x,))

    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return fn, theta


def unflatten(net, flat):
    sizes = [p.numel() for p in net.parameters()]
    return [c.reshape(p.shape) for c, p in zip(torch.split(flat, sizes), net.parameters())]


def output_hessians(likelihood, f):
    """Per-example Hessian of the summed loss w.r.t. the output, closed form: (B, K, K) (the
    squared error's is 2 I: a Gaussian of noise 1 / sqrt(2))."""
    return output_hessian(likelihood, f, noise=0.5**0.5)


def reference_ggn(net, likelihood, x, scale=1.0):
    fn, theta = flat_output_fn(net, x)
    jac = jacrev(fn)(theta)  # (B, K, P)
    hess = output_hessians(likelihood, fn(theta).detach())
    diag = scale * torch.einsum("bkp,bkl,blp->p", jac, hess, jac)
    return unflatten(net, diag), jac, hess


def reference_ef_and_grad(net, loss_module, x, y, scale=1.0):
    """Per-example gradients by a Python loop over examples."""
    params = list(net.parameters())
    ef = [torch.zeros_like(p) for p in params]
    grad = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        loss_i = scale * loss_module(net(x[i : i + 1]), y[i : i + 1])
        grads_i = torch.autograd.grad(loss_i, params)
        for e, g, gi in zip(ef, grad, grads_i):
            e += gi**2
            g += gi
    return grad, ef


LIKELIHOODS = ["categorical", "bernoulli", "gaussian"]


@pytest.mark.parametrize("activation", [nn.Tanh, nn.ReLU])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("container", CONTAINERS)
def test_ef_is_sum_of_squared_per_example_gradients(likelihood, activation, container):
    plain, net, loss_module, x, y = make_problem(likelihood, activation, container=container)
    grad, ef = reference_ef_and_grad(plain, loss_module, x, y)
    result = network_curvature(net, loss_module, x, y, "ef")
    assert torch.allclose(result.loss, loss_module(plain(x), y).detach(), rtol=1e-12)
    for g, h, g_ref, h_ref in zip(result.grads, result.curvatures, grad, ef):
        assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)
        assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("activation", [nn.Tanh, nn.ReLU])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("container", CONTAINERS)
def test_ggn_is_diagonal_of_jacobian_hessian_jacobian(likelihood, activation, container):
    plain, net, loss_module, x, y = make_problem(likelihood, activation, seed=1, container=container)
    ggn, _, _ = reference_ggn(plain, likelihood, x)
    result = network_curvature(net, loss_module, x, y, "ggn")
    for h, h_ref in zip(result.curvatures, ggn):
        assert h.shape == h_ref.shape
        assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("container", CONTAINERS)
def test_loss_scale_is_a_per_example_weight(likelihood, container):
    # c * loss: gradient and GGN carry c, the empirical Fisher c^2 (per-example
    # gradients are c times larger), the loss value c.
    c = 0.37
    plain, net, loss_module, x, y = make_problem(likelihood, seed=2, container=container)
    grad, ef = reference_ef_and_grad(plain, loss_module, x, y, scale=c)
    ggn, _, _ = reference_ggn(plain, likelihood, x, scale=c)
    result_ef = network_curvature(net, loss_module, x, y, "ef", loss_scale=c)
    result_ggn = network_curvature(net, loss_module, x, y, "ggn", loss_scale=c)
    assert torch.allclose(result_ef.loss, c * loss_module(plain(x), y).detach())
    for g, h_ef, h_ggn, g_ref, ef_ref, ggn_ref in zip(
        result_ef.grads, result_ef.curvatures, result_ggn.curvatures, grad, ef, ggn
    ):
        assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)
        assert torch.allclose(h_ef, ef_ref, rtol=1e-10, atol=1e-13)
        assert torch.allclose(h_ggn, ggn_ref, rtol=1e-10, atol=1e-13)


def sampled_ggn_variance(likelihood, f, jac):
    """
    Exact variance, per parameter, of one Monte-Carlo GGN sample summed over the
    batch: z_i = (J_i^T r_i)^2 with r_i the gradient of the loss at a target
    drawn from the model.
    """
    if likelihood in ("categorical", "bernoulli"):
        if likelihood == "categorical":
            p = f.softmax(-1)
            outcomes = torch.eye(f.shape[-1], dtype=f.dtype)  # one-hot targets
            residuals = p.unsqueeze(1) - outcomes  # (B, K outcomes, K)
            probs = p
        else:
            p = f.sigmoid()  # (B, 1)
            residuals = torch.stack([p, p - 1], dim=1)  # targets 0 and 1: (B, 2, 1)
            probs = torch.cat([1 - p, p], dim=1)
        z = torch.einsum("bkp,bok->bop", jac, residuals) ** 2  # (B, outcomes, P)
        mean = torch.einsum("bo,bop->bp", probs, z)
        second = torch.einsum("bo,bop->bp", probs, z**2)
        return (second - mean**2).sum(0)
    # MSE: r = 2 (y~ - f) = sqrt(2) xi, z = 2 (a . xi)^2 with a = J_i[:, p]: Var = 8 |a|^4
    a_sq = (jac**2).sum(1)  # (B, P)
    return (8 * a_sq**2).sum(0)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_ggn_mc_is_unbiased_for_ggn(likelihood, container):
    plain, net, loss_module, x, y = make_problem(likelihood, seed=3, container=container)
    ggn, jac, _ = reference_ggn(plain, likelihood, x)
    f = plain(x).detach()
    mc_samples = 4000
    torch.manual_seed(4)
    result = network_curvature(net, loss_module, x, y, "ggn_mc", mc_samples=mc_samples)
    estimate = torch.cat([h.reshape(-1) for h in result.curvatures])
    reference = torch.cat([h.reshape(-1) for h in ggn])
    std = (sampled_ggn_variance(likelihood, f, jac) / mc_samples).sqrt()
    assert (estimate - reference).abs().le(5 * std + 1e-12).all()
    # the tolerance is tight enough to tell ggn_mc with the wrong factor from ggn
    assert ((2 * estimate - reference).abs() > 5 * std + 1e-12).any()


@pytest.mark.parametrize("container", CONTAINERS)
def test_reparam_and_none_give_gradient_only(container):
    plain, net, loss_module, x, y = make_problem("categorical", container=container)
    grad, _ = reference_ef_and_grad(plain, loss_module, x, y)
    for source in ("reparam", "none"):
        result = network_curvature(net, loss_module, x, y, source)
        assert all(h is None for h in result.curvatures)
        for g, g_ref in zip(result.grads, grad):
            assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("container", CONTAINERS)
def test_calls_do_not_accumulate(container):
    plain, net, loss_module, x, y = make_problem("categorical", container=container)
    first = network_curvature(net, loss_module, x, y, "ef")
    second = network_curvature(net, loss_module, x, y, "ef")
    assert all(p.grad is None for p in net.parameters())
    assert not any(hasattr(p, "sum_grad_squared") for p in net.parameters())
    for a, b in zip(first.grads + first.curvatures, second.grads + second.curvatures):
        assert torch.equal(a, b)


def batch_norm_problem(likelihood, seed=0):
    torch.manual_seed(seed)
    plain, _, loss_module, x, y = make_problem(likelihood, seed=seed)
    out = plain[2].out_features
    layers = [nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, out)]
    plain = nn.Sequential(*layers).double()
    with torch.no_grad():  # BatchNorm weights away from their (1, 0) start
        plain[1].weight.uniform_(0.5, 1.5)
        plain[1].bias.uniform_(-0.5, 0.5)
    return plain, extended_copy(plain), loss_module, x, y


def frozen_statistics_copy(plain, x):
    """An eval-mode copy whose BatchNorm running statistics are x's batch mean and
    biased variance: the network with frozen statistics, per-example separable."""
    frozen = copy.deepcopy(plain)
    with torch.no_grad():
        z = frozen[0](x)
    frozen[1].running_mean.copy_(z.mean(0))
    frozen[1].running_var.copy_(z.var(0, unbiased=False))
    return frozen.eval()


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_batch_norm_in_train_mode_curvature_is_that_of_frozen_statistics(likelihood):
    plain, net, loss_module, x, y = batch_norm_problem(likelihood)
    frozen = frozen_statistics_copy(plain, x)
    _, ef = reference_ef_and_grad(frozen, loss_module, x, y)
    ggn, _, _ = reference_ggn(frozen, likelihood, x)
    as_run = copy.deepcopy(plain)  # train mode: the gradient through the statistics
    grad = torch.autograd.grad(loss_module(as_run(x), y), list(as_run.parameters()))
    for source, reference in (("ef", ef), ("ggn", ggn)):
        result = network_curvature(net, loss_module, x, y, source)
        for g, h, g_ref, h_ref in zip(result.grads, result.curvatures, grad, reference):
            assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)
            assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-13)  # BatchNorm's own included
    # one training-mode forward per call: the running statistics moved as a plain forward's
    plain(x), plain(x)
    for a, b in zip(net.buffers(), plain.buffers()):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=0)


def test_batch_norm_in_eval_mode_is_per_example_exact():
    plain, net, loss_module, x, y = batch_norm_problem("categorical")
    plain(x)  # move the running statistics away from (0, 1)
    net.load_state_dict(plain.state_dict())
    plain.eval(), net.eval()
    grad, ef = reference_ef_and_grad(plain, loss_module, x, y)
    ggn, _, _ = reference_ggn(plain, "categorical", x)
    for source, reference in (("ef", ef), ("ggn", ggn)):
        result = network_curvature(net, loss_module, x, y, source)
        for g, h, g_ref, h_ref in zip(result.grads, result.curvatures, grad, reference):
            assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)
            assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_empirical_fisher_by_backprop_equals_sum_grad_squared(likelihood):
    """The ef used for nets with BatchNorm on batch statistics, checked where both apply."""
    plain, net, loss_module, x, y = make_problem(likelihood, activation=nn.ReLU, seed=5)
    expected = network_curvature(net, loss_module, x, y, "ef")
    with warnings.catch_warnings(), backpack(EmpiricalFisherBackprop()):
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        loss_module(net(x), y).backward()
    for p, h in zip(net.parameters(), expected.curvatures):
        assert torch.allclose(p.empirical_fisher_diag, h, rtol=1e-10, atol=1e-13)


def embedding_problem(dtype, **options):
    """Embedding(6, 3) -> Flatten -> Linear -> Tanh -> Linear(4, 3) on index triples, example 0
    looking row 2 up twice (its gradient rows add before squaring)."""
    torch.manual_seed(2)
    plain = BackpackOnly(nn.Embedding(6, 3, **options), nn.Flatten(), nn.Linear(9, 4), nn.Tanh(),
                         nn.Linear(4, 3)).to(dtype)
    x = torch.randint(0, 6, (B, 3))
    x[0] = torch.tensor([2, 5, 2])
    return plain, extended_copy(plain), extend(nn.CrossEntropyLoss(reduction="sum")), x, torch.randint(0, 3, (B,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_embedding_curvature_is_that_of_its_per_example_row_gradients(dtype):
    """ef = sum_n (grad_W l_n)^2 and ggn = diag sum_n J_n^T H_n J_n for the table too, in the net's
    dtype (BackPACK's own rule built a float32 indicator: a float64 net raised)."""
    plain, net, loss_module, x, y = embedding_problem(dtype)
    grad, ef = reference_ef_and_grad(plain, loss_module, x, y)
    ggn, _, _ = reference_ggn(plain, "categorical", x)
    tolerance = dict(rtol=1e-10, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for source, reference in (("ef", ef), ("ggn", ggn)):
        result = network_curvature(net, loss_module, x, y, source)
        assert result.curvatures[0].dtype == dtype and result.curvatures[0].shape == (6, 3)
        looked_up = torch.zeros(6, dtype=torch.bool)
        looked_up[x.unique()] = True
        assert (result.curvatures[0][looked_up] > 0).all() and (result.curvatures[0][~looked_up] == 0).all()
        for g, h, g_ref, h_ref in zip(result.grads, result.curvatures, grad, reference):
            assert torch.allclose(g, g_ref, **tolerance)
            assert torch.allclose(h, h_ref, **tolerance)
    with warnings.catch_warnings(), backpack(_extension("ef", 1, batch_statistics=True)):
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        loss_module(net(x), y).backward()  # the ef of nets with BatchNorm on batch statistics
    for p, h_ref in zip(net.parameters(), ef):
        assert torch.allclose(p.empirical_fisher_diag, h_ref, **tolerance)


def test_embedding_options_other_than_a_plain_look_up_are_refused():
    _, net, loss_module, x, y = embedding_problem(torch.float64, padding_idx=0)
    with pytest.raises(NotImplementedError, match="Embedding.*padding_idx"):
        network_curvature(net, loss_module, x, y, "ef")


def test_unknown_source_lists_supported_ones():
    plain, net, loss_module, x, y = make_problem("categorical")
    with pytest.raises(ValueError) as info:
        network_curvature(net, loss_module, x, y, "hessian")
    for name in CURVATURE_EXTENSIONS:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    "loss_module",
    [nn.NLLLoss(reduction="sum"), nn.CrossEntropyLoss(), nn.MSELoss(reduction="mean")],
)
def test_unsupported_loss_module_is_an_error(loss_module):
    _, net, _, x, y = make_problem("categorical")
    with pytest.raises(ValueError) as info:
        network_curvature(net, loss_module, x, y, "ef")
    message = str(info.value)
    assert all(cls.__name__ in message for cls in LOSS_MODULES) or "reduction" in message


def test_no_warnings():
    _, net, loss_module, x, y = make_problem("categorical")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for source in CURVATURE_EXTENSIONS:
            network_curvature(net, loss_module, x, y, source)


@pytest.mark.parametrize("source", ["ef", "ggn", "ggn_mc"])
def test_network_not_extended_is_an_error(source):
    torch.manual_seed(0)
    net = BackpackOnly(nn.Linear(D_IN, 3)).double()
    x, y = torch.randn(B, D_IN, dtype=torch.float64), torch.randint(0, 3, (B,))
    with pytest.raises(RuntimeError, match="backpack.extend"):
        network_curvature(net, nn.CrossEntropyLoss(reduction="sum"), x, y, source)


@pytest.mark.parametrize("activation, module", [(torch.tanh, nn.Tanh()), (torch.relu, nn.ReLU()),
                                                (lambda h: h.sigmoid(), nn.Sigmoid()),
                                                (lambda h: nn.functional.leaky_relu(h, 0.2), nn.LeakyReLU(0.2))],
                         ids=["tanh", "relu", "sigmoid-method", "leaky-relu"])
def test_an_activation_written_as_a_function_gets_the_ggn_of_its_module(activation, module):
    """BackPACK passes no second-order quantity through a function: a custom class whose forward
    calls ``torch.tanh`` (``F.relu``, ``h.sigmoid()``) raised its bare AssertionError out of
    svi.step. The traced twin calls the activation's module instead: the GGN (and gradient) are
    those of the same net written as an nn.Sequential, to round-off."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(activation(self.hidden(x)))

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    custom = Net().double()
    sequential = nn.Sequential(copy.deepcopy(custom.hidden), module, copy.deepcopy(custom.out))
    steps = []
    for net in (custom, sequential):  # one Newton step (beta = 1: the precision is prior + GGN)
        bnn = BayesianNet(net, "categorical", num_data=16, noise_limit=None)
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = SVI(bnn, bnn.guide(), NGVI(lr=1.0, beta=1.0), CurvatureELBO("ggn", deterministic=True))
        svi.step(x, y)
        steps.append([v.detach() for _, v in sorted(pyro.get_param_store().items())])
    for a, b in zip(*steps):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert steps[0][0].ne(steps[1][0].new_zeros(())).all()


def test_an_operation_backpack_cannot_pass_is_refused_by_the_ggn_with_what_to_write():
    """``torch.sin`` in forward (no module of BackPACK's): a clear error says what to write, the
    guide is untouched, and ``ef`` (first-order quantities only) trains the same net."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(torch.sin(self.hidden(x)))
    torch.manual_seed(0)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    pyro.clear_param_store()
    bnn = BayesianNet(Net(), "categorical", num_data=16)
    guide = bnn.guide()
    svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ef"))
    svi.step(x, y)
    before = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    with pytest.raises(NotImplementedError, match=r"nn\.Tanh.*CurvatureELBO\('ef'\)"):
        SVI(bnn, guide, NGVI(), CurvatureELBO("ggn")).step(x, y)
    assert all(torch.equal(value.detach(), before[name]) for name, value in pyro.get_param_store().items())
    assert svi.step(x, y) > 0  # (ef goes on)
