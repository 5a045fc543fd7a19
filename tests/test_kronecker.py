"""Kronecker-factored Gaussians for BayesianNet layers (noisy K-FAC)."""


import math

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO
from pyro_ngvi.family import gaussian_sites, pop_curvature
from pyro_ngvi.full_covariance import precision
from pyro_ngvi.update.kronecker import kronecker_step
from pyro_ngvi.kronecker import (
    KroneckerCurvature,
    KroneckerNormal,
    KroneckerSite,
    MatrixNormal,
    fold_prior,
    unfold_prior,
)

F64 = torch.float64


def tiny_bnn(num_data=40, likelihood="categorical", prior=1.0, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    return BayesianNet(net, likelihood, num_data=num_data, prior=prior)


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=g, dtype=F64)
    return x, (x[:, 0] - x[:, 2] > 0).long()


def handed_factors(bnn, guide, x, y, curvature="ggn"):
    """The KroneckerCurvature the fast path attaches, per layer, at the guide's mean."""
    CurvatureELBO(curvature, deterministic=True).loss_and_grads(bnn, guide, x, y)
    return {site.name: pop_curvature(site.loc) for site in gaussian_sites(guide)}


def layer_ggn_by_autograd(bnn, guide, x, y, layer_index):
    """Per example i: the exact GGN block J_i^T H_i J_i of the layer's [W, b] (row-major),
    the output-side factor G_i = dz_i^T H_i dz_i and the input a_i, at the guide's mean."""
    means = guide.median()
    net = bnn.net
    layer = net[layer_index]
    weight_key, bias_key = f"{layer_index}.weight", f"{layer_index}.bias"
    blocks, output_factors, inputs = [], [], []
    for i in range(len(x)):
        def output_of(w_bar):
            params = dict(means)
            params[weight_key] = w_bar[:, :-1]
            params[bias_key] = w_bar[:, -1]
            return torch.func.functional_call(net, params, (x[i: i + 1],))[0]

        w_bar = torch.cat([means[weight_key], means[bias_key].unsqueeze(-1)], -1)
        logits = output_of(w_bar)
        probs = logits.softmax(-1)
        hessian = torch.diag(probs) - torch.outer(probs, probs)
        jacobian = torch.func.jacrev(output_of)(w_bar).reshape(len(logits), -1)
        blocks.append(jacobian.T @ hessian @ jacobian)

        # the layer's input a_i and the Jacobian of the output w.r.t. the layer's output z_i
        captured = []
        handle = layer.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
        torch.func.functional_call(net, means, (x[i: i + 1],))
        handle.remove()
        inputs.append(captured[0][0])

        def output_of_z(z):
            h = z
            for module in list(net)[layer_index + 1:]:
                h = module(h)
            return h

        with torch.no_grad():
            z = torch.nn.functional.linear(captured[0][0], means[weight_key], means[bias_key])
        dz = torch.func.jacrev(output_of_z)(z)
        output_factors.append(dz.T @ hessian @ dz)
    return blocks, output_factors, inputs


def nearest_kronecker(block, n, p):
    """Van Loan's nearest Kronecker product G ⊗ A (Frobenius) to an (np, np) block, by
    the SVD of its rearrangement."""
    rearranged = block.reshape(n, p, n, p).permute(0, 2, 1, 3).reshape(n * n, p * p)
    u, s, vh = torch.linalg.svd(rearranged)
    return torch.kron((s[0] * u[:, 0]).reshape(n, n), vh[0].reshape(p, p))


# --------------------------------------------------------------------------- #
# The factors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("layer_index", [0, 2])
def test_factors_of_one_example_are_the_exact_ggn_block_and_its_kronecker_fit(layer_index):
    """One example: the GGN block of a layer is exactly G ⊗ a a^T; the handed factors
    reproduce it, and so does a brute-force (SVD) Kronecker fit of the block."""
    bnn = tiny_bnn(num_data=1)
    guide = KroneckerNormal(bnn)
    x, y = data(1)
    stats = handed_factors(bnn, guide, x, y)[str(layer_index)]
    blocks, _, _ = layer_ggn_by_autograd(bnn, guide, x, y, layer_index)
    kfac = torch.kron(stats.output_factor, stats.input_factor)
    torch.testing.assert_close(kfac, blocks[0], rtol=1e-10, atol=1e-12)
    n, p = stats.grad.shape
    torch.testing.assert_close(nearest_kronecker(blocks[0], n, p), kfac, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("curvature", ["ggn", "ggn_mc"])
def test_factors_of_a_batch_are_the_kfac_sums_against_autograd(curvature):
    """A minibatch of B out of N: G = N/B sum_i G_i (exact for KFLR, in expectation for
    KFAC), A = mean of [a, 1][a, 1]^T; the gradient is N/B times the batch's."""
    bnn = tiny_bnn(num_data=40)
    guide = KroneckerNormal(bnn)
    x, y = data(8)
    torch.manual_seed(0)
    stats = handed_factors(bnn, guide, x, y, curvature)["0"]
    blocks, output_factors, inputs = layer_ggn_by_autograd(bnn, guide, x, y, 0)
    scale = 40 / 8
    bar = torch.stack([torch.cat([a, torch.ones(1, dtype=F64)]) for a in inputs])
    torch.testing.assert_close(stats.input_factor, bar.T @ bar / 8, rtol=1e-12, atol=1e-14)
    exact_output = scale * sum(output_factors)
    if curvature == "ggn":
        torch.testing.assert_close(stats.output_factor, exact_output, rtol=1e-10, atol=1e-12)
    else:  # one sampled target per example: average over repeated draws
        draws = [handed_factors(bnn, guide, x, y, "ggn_mc")["0"].output_factor for _ in range(400)]
        assert (torch.stack(draws).mean(0) - exact_output).abs().max() < 0.1 * exact_output.abs().max()
    # K-FAC's Kronecker product approximates the summed exact block: the same trace
    # when every input is the same; here the inputs differ and it is an approximation
    exact_block = scale * sum(blocks)
    assert exact_block.shape == (4 * 4, 4 * 4)
    means = guide.median()
    params = {"0.weight": means["0.weight"].clone().requires_grad_(),
              "0.bias": means["0.bias"].clone().requires_grad_()}
    logits = torch.func.functional_call(bnn.net, {**means, **params}, (x,))
    loss = scale * torch.nn.functional.cross_entropy(logits, y, reduction="sum")
    grad_w, grad_b = torch.autograd.grad(loss, [params["0.weight"], params["0.bias"]])
    torch.testing.assert_close(stats.grad, torch.cat([grad_w, grad_b.unsqueeze(-1)], -1))


def test_identical_inputs_make_kfac_the_exact_block():
    """When every example has the same input, sum_i G_i ⊗ a a^T = (sum_i G_i) ⊗ a a^T
    exactly: the K-FAC product is the exact GGN block of the first layer."""
    bnn = tiny_bnn(num_data=6)
    guide = KroneckerNormal(bnn)
    x = torch.tensor([[0.3, -1.0, 0.5]], dtype=F64).expand(6, 3).contiguous()
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    stats = handed_factors(bnn, guide, x, y)["0"]
    blocks, _, _ = layer_ggn_by_autograd(bnn, guide, x, y, 0)
    torch.testing.assert_close(torch.kron(stats.output_factor, stats.input_factor), sum(blocks),
                               rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# The distribution, the guide
# --------------------------------------------------------------------------- #


def test_matrix_normal_is_the_gaussian_with_kronecker_covariance():
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(3, 2, generator=g, dtype=F64)
    row = torch.randn(3, 3, generator=g, dtype=F64).tril() + 2 * torch.eye(3, dtype=F64)
    col = torch.randn(2, 2, generator=g, dtype=F64).tril() + 2 * torch.eye(2, dtype=F64)
    matrix_normal = MatrixNormal(loc, row, col)
    dense = dist.MultivariateNormal(loc.reshape(-1), scale_tril=torch.kron(row, col))
    value = torch.randn(5, 3, 2, generator=g, dtype=F64)
    torch.testing.assert_close(matrix_normal.log_prob(value), dense.log_prob(value.reshape(5, -1)))
    torch.manual_seed(0)
    samples = matrix_normal.sample((20000,)).reshape(20000, -1)
    covariance = torch.cov(samples.T)
    assert (covariance - dense.covariance_matrix).abs().max() < 0.05 * dense.covariance_matrix.abs().max()


def test_guide_works_with_trace_elbo_predictive_and_the_fast_path_gives_its_loss():
    bnn = tiny_bnn()
    guide = KroneckerNormal(bnn, init_scale=0.05)
    x, y = data(8)
    guide(x, y)
    pyro.set_rng_seed(3)
    expected = Trace_ELBO().loss(bnn, guide, x, y)
    pyro.set_rng_seed(3)
    loss = CurvatureELBO("ggn").loss_and_grads(bnn, guide, x, y)
    assert loss == pytest.approx(expected, rel=1e-10)
    # deterministic: l(M) + KL(q || p0), the KL against the dense Gaussian's
    loss = CurvatureELBO("ggn", deterministic=True).loss_and_grads(bnn, guide, x, y)
    kl = 0.0
    for layer in guide.layers:
        q = guide.get_layer(layer.name)
        dense = dist.MultivariateNormal(q.loc.reshape(-1), scale_tril=torch.kron(q.row_scale_tril, q.col_scale_tril))
        prior = dist.MultivariateNormal(torch.zeros_like(q.loc.reshape(-1)), torch.eye(q.loc.numel(), dtype=F64))
        kl += float(torch.distributions.kl_divergence(dense, prior).detach())
    means = guide.median()
    logits = torch.func.functional_call(bnn.net, means, (x,))
    nll = 40 / 8 * float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    assert loss == pytest.approx(nll + kl, rel=1e-10)
    # Predictive draws every weight site from the guide (shaped as with AutoNormal)
    samples = Predictive(bnn, guide=guide, num_samples=7)(x)
    assert samples["0.weight"].shape == (7, 1, 4, 3) and samples["2.bias"].shape == (7, 1, 2)
    assert samples["obs"].shape == (7, 8)
    assert samples["0.weight"].std(0).min() > 0  # drawn, not the mean
    # and Pyro's own optimizers train it through Trace_ELBO
    svi = SVI(bnn, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(3):
        assert torch.isfinite(torch.tensor(svi.step(x, y)))


# --------------------------------------------------------------------------- #
# The step
# --------------------------------------------------------------------------- #


def random_stats(n, p, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(p, p, generator=g, dtype=F64)
    b = torch.randn(n, n, generator=g, dtype=F64)
    return KroneckerCurvature(
        grad=torch.randn(n, p, generator=g, dtype=F64),
        input_factor=a @ a.T / p, output_factor=5 * b @ b.T,
        prior_loc=0.1 * torch.randn(n, p, generator=g, dtype=F64),
        prior_precision=torch.tensor([1.0] * (p - 1) + [0.25], dtype=F64),
    )


def test_fold_and_unfold_of_the_prior_are_inverse_and_the_prior_enters_exactly():
    stats = random_stats(4, 3)
    damped_input, damped_output = fold_prior(stats.input_factor, stats.output_factor, stats.prior_precision)
    input_factor, output_factor = unfold_prior(damped_input, damped_output, stats.prior_precision)
    torch.testing.assert_close(input_factor, stats.input_factor)
    torch.testing.assert_close(output_factor, stats.output_factor)
    # G_g ⊗ A_g = G ⊗ A + I ⊗ D + (a positive semi-definite damping)
    damping = (torch.kron(damped_output, damped_input) - torch.kron(stats.output_factor, stats.input_factor)
               - torch.kron(torch.eye(4, dtype=F64), torch.diag(stats.prior_precision)))
    assert torch.linalg.eigvalsh(damping).min() > -1e-10


def test_kronecker_step_is_the_natural_gradient_step_under_the_kronecker_precision():
    n, p = 4, 3
    stats = random_stats(n, p)
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(n, p, generator=g, dtype=F64)
    old = random_stats(n, p, seed=9)
    damped = fold_prior(old.input_factor, old.output_factor, stats.prior_precision)
    row, col = torch.linalg.cholesky(torch.linalg.inv(damped[1])), torch.linalg.cholesky(torch.linalg.inv(damped[0]))
    step = kronecker_step(mean, row, col, stats.grad, stats, lr=0.3, beta=0.2, tau=2.0)
    input_factor = 0.8 * old.input_factor + 0.2 * stats.input_factor
    output_factor = 0.8 * old.output_factor + 0.2 * stats.output_factor / 2.0
    new_input, new_output = fold_prior(input_factor, output_factor, stats.prior_precision)
    torch.testing.assert_close(precision(step.col_factor), new_input, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(precision(step.row_factor), new_output, rtol=1e-9, atol=1e-9)
    dense_precision = torch.kron(new_output, new_input)
    pull = ((mean - stats.prior_loc) * stats.prior_precision).reshape(-1)
    expected = mean.reshape(-1) - 0.3 * torch.linalg.solve(dense_precision, stats.grad.reshape(-1) + pull)
    torch.testing.assert_close(step.mean.reshape(-1), expected, rtol=1e-10, atol=1e-12)
    # the next step recovers these factors from the guide alone
    recovered = unfold_prior(precision(step.col_factor), precision(step.row_factor), stats.prior_precision)
    torch.testing.assert_close(recovered[0], input_factor, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(recovered[1], output_factor, rtol=1e-8, atol=1e-9)


def test_ngvi_trains_a_kronecker_guide_through_the_fast_path():
    bnn = tiny_bnn(num_data=200)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 3, generator=g, dtype=F64)
    y = (x[:, 0] - x[:, 2] > 0).long()
    guide = KroneckerNormal(bnn, init_scale=0.01)
    optim = NGVI(lr=0.1, beta=0.1)
    svi = SVI(bnn, guide, optim, CurvatureELBO("ggn", num_particles=2))
    losses = [svi.step(x, y) for _ in range(150)]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    sites = gaussian_sites(guide)
    assert all(isinstance(site, KroneckerSite) for site in sites) and len(sites) == 2
    probs = Predictive(bnn, guide=guide, num_samples=50, return_sites=["output"])(x)["output"].softmax(-1).mean(0)
    assert (probs.argmax(-1) == y).double().mean() > 0.9
    assert optim.num_skipped_steps == 0


def test_unsupported_uses_of_the_kronecker_guide_are_refused():
    bnn = tiny_bnn()
    x, y = data(8)
    guide = KroneckerNormal(bnn)
    with pytest.raises(ValueError, match="Kronecker factors"):
        SVI(bnn, guide, NGVI(), Trace_ELBO()).step(x, y)
    with pytest.raises(ValueError, match="'ggn'"):
        SVI(bnn, guide, NGVI(), CurvatureELBO("ef")).step(x, y)
    with pytest.raises(ValueError, match="KroneckerNormal guide takes Kronecker factors.*'ggn'"):
        SVI(bnn, guide, NGVI(), CurvatureELBO("hessian")).step(x, y)  # (was "supports AutoNormal...")
    conv = BayesianNet(nn.Sequential(nn.Conv1d(1, 2, 2), nn.Flatten(), nn.Linear(4, 2)), "categorical", 10)
    with pytest.raises(NotImplementedError, match="Linear"):
        KroneckerNormal(conv)
    frozen = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(NotImplementedError, match="'0.bias' is latent while its layer's weight is frozen"):
        KroneckerNormal(BayesianNet(frozen, "categorical", 10))
    with pytest.raises(NotImplementedError, match="kronecker_layers"):
        KroneckerNormal(lambda: pyro.sample("z", dist.Normal(0.0, 1.0)))
    for bad in (0.0, -1.0, math.inf, math.nan, 1):
        with pytest.raises(ValueError, match="init_scale"):
            KroneckerNormal(bnn, init_scale=bad)
    per_element = tiny_bnn(prior={"0.weight": torch.rand(4, 3, dtype=F64) + 0.5, "0.bias": 1.0,
                                  "2.weight": 1.0, "2.bias": 1.0})
    with pytest.raises(NotImplementedError, match="one prior scale"):
        SVI(per_element, KroneckerNormal(per_element), NGVI(), CurvatureELBO("ggn")).step(x, y)


def test_a_prior_changed_between_steps_reaches_the_kronecker_step_and_the_factors_keep_their_data_part():
    # set_prior between steps (an evidence update, a continual task): the next step folds the
    # new prior in, and recovers the running factors A', G' from the guide with the prior they
    # were folded with, so that only their data part is averaged
    bnn = tiny_bnn(num_data=40)
    x, y = data(40)
    guide = KroneckerNormal(bnn, init_scale=0.05)
    beta = 0.25
    svi = SVI(bnn, guide, NGVI(lr=0.1, beta=beta), CurvatureELBO("ggn", deterministic=True))
    for _ in range(3):
        svi.step(x, y)
    old_eta = torch.ones(5, dtype=F64)  # prior scale 1 on [W, b] of the second layer (4 inputs + bias)
    site = [s for s in gaussian_sites(guide) if s.name.endswith("2")][0]
    before = unfold_prior(precision(site.col_factor), precision(site.row_factor), old_eta)
    bnn.set_prior(0.5)
    handed = handed_factors(bnn, guide, x, y)[site.name]
    torch.testing.assert_close(handed.prior_precision, torch.full((5,), 4.0, dtype=F64))
    svi.step(x, y)
    site = [s for s in gaussian_sites(guide) if s.name.endswith("2")][0]
    after = unfold_prior(precision(site.col_factor), precision(site.row_factor), handed.prior_precision)
    torch.testing.assert_close(after[0], torch.lerp(before[0], handed.input_factor, beta), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(after[1], torch.lerp(before[1], handed.output_factor, beta), rtol=1e-8, atol=1e-10)


def test_a_run_resumed_after_a_prior_change_takes_the_same_steps():
    # the prior the factors were folded with is part of NGVI's state: a run resumed from
    # get_state after set_prior unfolds them as the straight run does
    x, y = data(40)

    def run(resume: bool):
        pyro.clear_param_store()
        bnn = tiny_bnn(num_data=40)
        guide = KroneckerNormal(bnn, init_scale=0.05)
        optim = NGVI(lr=0.1, beta=0.25)
        elbo = CurvatureELBO("ggn", deterministic=True)
        svi = SVI(bnn, guide, optim, elbo)
        for _ in range(3):
            svi.step(x, y)
        bnn.set_prior(0.5)
        if resume:
            state = optim.get_state()
            assert all(entry["prior"] is not None for entry in state["ngvi"]["sites"].values())
            optim = NGVI(lr=0.1, beta=0.25)
            optim.set_state(state)
            svi = SVI(bnn, guide, optim, elbo)
        for _ in range(2):
            svi.step(x, y)
        return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    straight, resumed = run(False), run(True)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_a_checkpoint_restored_in_place_on_the_live_guide_retakes_the_same_steps():
    # the param store rolled back under a live KroneckerNormal (plain tensors from get_state) and
    # NGVI's state with it: the steps read the restored factors, not the guide module's old ones
    x, y = data(40)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    bnn = tiny_bnn(num_data=40)
    guide = KroneckerNormal(bnn, init_scale=0.05)
    optim = NGVI()
    svi = SVI(bnn, guide, optim, CurvatureELBO("ggn"))
    for _ in range(3):
        svi.step(x, y)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().get_state()["params"].items()}
    constraints = dict(pyro.get_param_store().get_state()["constraints"])
    state, rng = optim.get_state(), pyro.util.get_rng_state()
    first = [svi.step(x, y) for _ in range(3)]
    first_params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.get_param_store().set_state({"params": params, "constraints": constraints})
    optim.set_state(state)
    pyro.util.set_rng_state(rng)
    again = [svi.step(x, y) for _ in range(3)]
    assert again == first
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), first_params[name]), name


@pytest.mark.parametrize("loss", ["ggn", "trace"])
def test_a_stale_guide_param_of_another_layer_shape_is_refused_naming_the_layer(loss):
    """A KroneckerNormal named like one of a narrower net: an IndexError deep in the step before."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))

    def svi_of(width):
        bnn = BayesianNet(nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)), "categorical", 8)
        if loss == "ggn":
            return SVI(bnn, KroneckerNormal(bnn), NGVI(), CurvatureELBO("ggn"))
        return SVI(bnn, KroneckerNormal(bnn), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())

    svi_of(4).step(x, y)
    with pytest.raises(ValueError, match=r"layer '0''s mean of shape \(4, 4\).*needs \(5, 4\).*clear_param_store"):
        svi_of(5).step(x, y)


def test_init_loc_fn_must_be_callable():
    """KroneckerNormal(bnn, init_loc_fn=3) was taken, and its first call raised TypeError
    ('int' object is not callable); a callable still sets the guide's means."""
    pyro.clear_param_store()
    bnn = BayesianNet(nn.Linear(2, 1), "gaussian", num_data=5, noise_scale=0.5)
    with pytest.raises(ValueError, match="init_loc_fn must be a callable"):
        KroneckerNormal(bnn, init_loc_fn=3)
    x, y = torch.randn(5, 2), torch.randn(5)
    guide = KroneckerNormal(bnn, init_loc_fn=lambda site: torch.full(site["fn"].shape(), 0.25))
    guide(x, y)
    locs = [v for k, v in pyro.get_param_store().items() if ".locs." in k]
    assert len(locs) == 1 and torch.equal(locs[0].detach(), torch.full((1, 3), 0.25))
