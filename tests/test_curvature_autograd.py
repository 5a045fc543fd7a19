"""
Autograd curvature sources against independent brute force (float64): full
Hessians from ``torch.autograd.functional.hessian``, full Jacobians from
``torch.func.jacrev`` multiplied out as ``J^T F J``, per-example gradients from
a Python loop.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import jacrev

import pyro.distributions as dist
from pyro.distributions.torch_distribution import ExpandedDistribution

import pyro_ngvi.curvature.autograd as curvature_autograd
from pyro_ngvi.curvature.autograd import (
    diag_hessian,
    empirical_fisher_diag,
    ggn_diag,
    mc_ggn_diag,
    per_example_grads,
    per_example_log_prob,
)

DTYPE = torch.float64
NUM_EXAMPLES, NUM_FEATURES, NUM_HIDDEN = 5, 3, 4
TOL = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# a small tanh MLP whose weights are the inputs
# ---------------------------------------------------------------------------


def make_mlp(num_outputs, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(NUM_HIDDEN, NUM_FEATURES), (NUM_HIDDEN,), (num_outputs, NUM_HIDDEN), (num_outputs,)]
    weights = [
        torch.randn(shape, generator=generator, dtype=DTYPE).requires_grad_()
        for shape in shapes
    ]
    features = torch.randn(NUM_EXAMPLES, NUM_FEATURES, generator=generator, dtype=DTYPE)
    return weights, features


def mlp(weights, features):
    w1, b1, w2, b2 = weights
    return torch.tanh(features @ w1.T + b1) @ w2.T + b2


def flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat, like):
    pieces, start = [], 0
    for t in like:
        pieces.append(flat[start : start + t.numel()].reshape(t.shape))
        start += t.numel()
    return pieces


def jacobian(outputs_of, inputs):
    """Full Jacobian (*output_shape, D) of ``outputs_of(list of inputs)``."""
    flat = flatten(inputs).detach()
    return jacrev(lambda v: outputs_of(unflatten(v, inputs)))(flat)


def full_hessian_diag(loss_of, inputs):
    flat = flatten(inputs).detach()
    hessian = torch.autograd.functional.hessian(lambda v: loss_of(unflatten(v, inputs)), flat)
    return hessian, hessian.diagonal()


def assert_close_flat(result, expected, **tol):
    assert [r.shape for r in result] == [r.shape for r in unflatten(expected, result)]
    torch.testing.assert_close(flatten(result), expected, **(tol or TOL))


# ---------------------------------------------------------------------------
# (a) exact Hessian diagonal
# ---------------------------------------------------------------------------


def test_diag_hessian_equals_diagonal_of_full_hessian_on_mlp():
    weights, features = make_mlp(3)
    labels = torch.tensor([0, 2, 1, 1, 0])

    def loss_of(ws):
        nll = -dist.Categorical(logits=mlp(ws, features)).log_prob(labels).sum()
        return nll + 0.5 * sum((w**2).sum() for w in ws)

    _, expected = full_hessian_diag(loss_of, weights)
    # chunk_size 5 does not divide the input sizes: chunk boundaries are exercised
    result = diag_hessian(loss_of(weights), weights, chunk_size=5)
    assert_close_flat(result, expected)


def test_diag_hessian_of_coupled_loss_ignores_cross_terms_and_zeros_linear_or_unused():
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(3, generator=generator, dtype=DTYPE).requires_grad_()
    b = torch.randn(2, 2, generator=generator, dtype=DTYPE).requires_grad_()
    linear = torch.randn(2, generator=generator, dtype=DTYPE).requires_grad_()
    unused = torch.randn(4, generator=generator, dtype=DTYPE).requires_grad_()
    inputs = [a, b, linear, unused]

    def loss_of(xs):
        a, b, linear, _ = xs
        return (a.sum() * b).pow(2).sum() + (a.sin() * b.sum()).sum() + 3 * linear.sum()

    hessian, expected = full_hessian_diag(loss_of, inputs)
    assert hessian[:3, 3:7].abs().max() > 0.1  # the loss really couples a and b
    result = diag_hessian(loss_of(inputs), inputs, chunk_size=2)
    assert_close_flat(result, expected)
    assert torch.equal(result[2], torch.zeros(2, dtype=DTYPE))
    assert torch.equal(result[3], torch.zeros(4, dtype=DTYPE))


# ---------------------------------------------------------------------------
# (b) per-example gradients and the empirical Fisher
# ---------------------------------------------------------------------------


def test_per_example_grads_and_empirical_fisher_equal_loop_over_examples():
    weights, features = make_mlp(3)
    unused = torch.zeros(2, dtype=DTYPE, requires_grad=True)
    inputs = weights + [unused]
    labels = torch.tensor([0, 2, 1, 1, 0])
    terms = -dist.Categorical(logits=mlp(weights, features)).log_prob(labels)

    loop = [torch.autograd.grad(terms[i], weights, retain_graph=True) for i in range(NUM_EXAMPLES)]
    expected = [torch.stack(column) for column in zip(*loop)]
    expected.append(torch.zeros(NUM_EXAMPLES, 2, dtype=DTYPE))

    result = per_example_grads(terms, inputs, chunk_size=2)
    assert [r.shape for r in result] == [(NUM_EXAMPLES,) + x.shape for x in inputs]
    for r, e in zip(result, expected):
        torch.testing.assert_close(r, e, **TOL)

    fisher = empirical_fisher_diag(terms, inputs, chunk_size=2)
    for f, e in zip(fisher, expected):
        torch.testing.assert_close(f, e.square().sum(0), **TOL)
    # the graph is retained for the caller's own backward
    terms.sum().backward()


# ---------------------------------------------------------------------------
# (c) exact GGN against J^T F J
# ---------------------------------------------------------------------------


def ggn_from_full_jacobian(jac, fisher):
    """diag(sum_i J_i^T F_i J_i); jac (B, P, D), fisher (B, P, P)."""
    return torch.einsum("bpd,bpq,bqd->d", jac, fisher, jac)


def test_ggn_diag_categorical_equals_bruteforce():
    weights, features = make_mlp(3)
    logits = mlp(weights, features)
    jac = jacobian(lambda ws: mlp(ws, features), weights)  # (B, K, D)
    probs = logits.detach().softmax(-1)
    fisher = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
    expected = ggn_from_full_jacobian(jac, fisher)

    result = ggn_diag(dist.Categorical(logits=logits), weights, data_dim=-1, chunk_size=4)
    assert_close_flat(result, expected)


def test_ggn_diag_bernoulli_to_event_equals_bruteforce():
    weights, features = make_mlp(2)
    logits = mlp(weights, features)
    jac = jacobian(lambda ws: mlp(ws, features), weights)
    probs = torch.sigmoid(logits.detach())
    expected = ggn_from_full_jacobian(jac, torch.diag_embed(probs * (1 - probs)))

    fn = dist.Bernoulli(logits=logits).to_event(1)
    assert_close_flat(ggn_diag(fn, weights, data_dim=-1), expected)


def test_ggn_diag_normal_fixed_scale_equals_bruteforce():
    weights, features = make_mlp(2)
    scale = 0.7
    jac = jacobian(lambda ws: mlp(ws, features), weights)
    fisher = torch.eye(2, dtype=DTYPE).expand(NUM_EXAMPLES, 2, 2) / scale**2
    expected = ggn_from_full_jacobian(jac, fisher)

    fn = dist.Normal(mlp(weights, features), scale).to_event(1)
    assert_close_flat(ggn_diag(fn, weights, data_dim=-1), expected)


def normal_loc_logscale_ggn(outputs_of, inputs):
    """Brute force for Normal: theta_i = (loc_i, log scale_i), F_i = diag(1/s_i^2, 2)."""
    jac = jacobian(lambda xs: torch.stack(outputs_of(xs), -1), inputs)  # (B, 2, D)
    loc, log_scale = outputs_of([x.detach() for x in inputs])
    fisher = torch.diag_embed(torch.stack([(-2 * log_scale).exp(), 2 + 0 * log_scale], -1))
    return ggn_from_full_jacobian(jac, fisher)


def test_ggn_diag_normal_with_scale_from_network_adds_log_scale_fisher():
    weights, features = make_mlp(2)

    def loc_and_log_scale(ws):
        out = mlp(ws, features)
        return out[:, 0], torch.log(F.softplus(out[:, 1]) + 0.1)

    expected = normal_loc_logscale_ggn(loc_and_log_scale, weights)
    out = mlp(weights, features)
    fn = dist.Normal(out[:, 0], F.softplus(out[:, 1]) + 0.1)
    result = ggn_diag(fn, weights, data_dim=-1)
    assert_close_flat(result, expected)
    # the log-scale term matters: dropping it (fixed scale) gives a different answer
    fixed = ggn_diag(dist.Normal(out[:, 0], fn.scale.detach()), weights, data_dim=-1)
    assert not torch.allclose(flatten(fixed), expected)


def test_ggn_diag_normal_with_shared_learned_noise_scale():
    weights, features = make_mlp(1)
    log_sigma = torch.tensor(-0.3, dtype=DTYPE, requires_grad=True)
    inputs = weights + [log_sigma]

    def loc_and_log_scale(xs):
        return mlp(xs[:4], features)[:, 0], xs[4].expand(NUM_EXAMPLES)

    expected = normal_loc_logscale_ggn(loc_and_log_scale, inputs)
    # one scalar scale broadcast over the examples: each example counts once
    torch.testing.assert_close(expected[-1], torch.tensor(2.0 * NUM_EXAMPLES, dtype=DTYPE))
    fn = dist.Normal(mlp(weights, features)[:, 0], log_sigma.exp())
    assert_close_flat(ggn_diag(fn, inputs, data_dim=-1), expected)


def test_ggn_diag_differentiates_a_broadcast_scale_once(monkeypatch):
    weights, features = make_mlp(1)
    log_sigma = torch.tensor(-0.3, dtype=DTYPE, requires_grad=True)
    fn = dist.Normal(mlp(weights, features)[:, 0], log_sigma.exp())
    rows = []

    def counting_vjp(output, inputs, grad_outputs):
        rows.append(grad_outputs.shape[0])
        return batched_vjp(output, inputs, grad_outputs)

    batched_vjp = curvature_autograd._batched_vjp
    monkeypatch.setattr(curvature_autograd, "_batched_vjp", counting_vjp)
    ggn_diag(fn, weights + [log_sigma], data_dim=-1)
    # B backward passes for the loc, one for the scale shared by all B examples
    assert sum(rows) == NUM_EXAMPLES + 1


def test_ggn_diag_expanded_distribution_counts_every_copy():
    weights, features = make_mlp(1)
    scale, copies = 0.5, 3
    jac = jacobian(lambda ws: mlp(ws, features), weights)  # (B, 1, D)
    fisher = torch.full((NUM_EXAMPLES, 1, 1), copies / scale**2, dtype=DTYPE)
    expected = ggn_from_full_jacobian(jac, fisher)

    base = dist.Normal(mlp(weights, features)[:, 0], scale)
    fn = ExpandedDistribution(base, torch.Size([copies, NUM_EXAMPLES]))
    assert_close_flat(ggn_diag(fn, weights, data_dim=-1), expected)


def test_ggn_diag_of_linear_normal_model_equals_hessian_of_nll():
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(NUM_EXAMPLES, NUM_FEATURES, generator=generator, dtype=DTYPE)
    targets = torch.randn(NUM_EXAMPLES, generator=generator, dtype=DTYPE)
    w = torch.randn(NUM_FEATURES, generator=generator, dtype=DTYPE).requires_grad_()
    b = torch.zeros((), dtype=DTYPE, requires_grad=True)
    fn = dist.Normal(features @ w + b, 0.3)

    hessian = diag_hessian(-fn.log_prob(targets).sum(), [w, b])
    result = ggn_diag(fn, [w, b], data_dim=-1)
    for r, h in zip(result, hessian):
        torch.testing.assert_close(r, h, **TOL)
    torch.testing.assert_close(result[0], features.square().sum(0) / 0.09, **TOL)


# ---------------------------------------------------------------------------
# (d) Monte-Carlo GGN
# ---------------------------------------------------------------------------


NUM_MC = 4000


def mc_standard_error(per_sample):
    """Standard error of the mean over the leading (sample) dim."""
    return per_sample.std(0) / per_sample.shape[0] ** 0.5


def test_mc_ggn_diag_categorical_agrees_with_ggn_within_five_standard_errors():
    weights, features = make_mlp(3)
    logits = mlp(weights, features)
    fn = dist.Categorical(logits=logits)
    exact = flatten(ggn_diag(fn, weights, data_dim=-1))

    estimate = flatten(
        mc_ggn_diag(fn, weights, -1, num_samples=NUM_MC,
                    generator=torch.Generator().manual_seed(3))
    )
    # Standard error from an independent set of NUM_MC draws: the gradient of
    # -log p(y_i) w.r.t. the logits is p_i - onehot(y_i), so one draw's estimate
    # is sum_i (J_i^T (p_i - e_{y_i}))^2; its mean is the exact GGN.
    jac = jacobian(lambda ws: mlp(ws, features), weights)  # (B, K, D)
    probs = logits.detach().softmax(-1)
    draws = torch.multinomial(
        probs, NUM_MC, replacement=True, generator=torch.Generator().manual_seed(4)
    ).T  # (S, B)
    residual = probs - F.one_hot(draws, 3).to(DTYPE)  # (S, B, K)
    per_sample = torch.einsum("bkd,sbk->sbd", jac, residual).square().sum(1)  # (S, D)
    standard_error = mc_standard_error(per_sample)
    assert (standard_error > 0).all()
    assert ((estimate - exact).abs() <= 5 * standard_error).all()

    # not trivially equal: a single draw is far outside that band
    single = flatten(mc_ggn_diag(fn, weights, -1, generator=torch.Generator().manual_seed(3)))
    assert ((single - exact).abs() > 5 * standard_error).any()
    assert not torch.allclose(single, exact, rtol=0.05)


def test_mc_ggn_diag_works_for_poisson_likelihood():
    weights, features = make_mlp(1)
    log_rate = mlp(weights, features)[:, 0]
    fn = dist.Poisson(log_rate.exp())
    # Fisher of a Poisson in its log rate eta is the rate; d(-log p)/d eta = rate - y
    jac = jacobian(lambda ws: mlp(ws, features)[:, 0], weights)  # (B, D)
    rate = log_rate.detach().exp()
    exact = (rate.unsqueeze(-1) * jac.square()).sum(0)

    estimate = flatten(
        mc_ggn_diag(fn, weights, -1, num_samples=NUM_MC,
                    generator=torch.Generator().manual_seed(5))
    )
    draws = torch.poisson(
        rate.expand(NUM_MC, NUM_EXAMPLES), generator=torch.Generator().manual_seed(6)
    )
    per_sample = ((rate - draws).unsqueeze(-1) * jac).square().sum(1)  # (S, D)
    assert ((estimate - exact).abs() <= 5 * mc_standard_error(per_sample)).all()


def test_mc_ggn_diag_generator_makes_draws_reproducible_and_leaves_global_rng():
    weights, features = make_mlp(3)
    fn = dist.Categorical(logits=mlp(weights, features))
    state = torch.get_rng_state()
    first = mc_ggn_diag(fn, weights, -1, num_samples=3, generator=torch.Generator().manual_seed(7))
    again = mc_ggn_diag(fn, weights, -1, num_samples=3, generator=torch.Generator().manual_seed(7))
    other = mc_ggn_diag(fn, weights, -1, num_samples=3, generator=torch.Generator().manual_seed(8))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


# ---------------------------------------------------------------------------
# (e) unsupported likelihoods
# ---------------------------------------------------------------------------


def test_ggn_diag_poisson_raises_naming_supported_likelihoods_and_alternatives():
    weights, features = make_mlp(1)
    fn = dist.Poisson(mlp(weights, features)[:, 0].exp())
    with pytest.raises(NotImplementedError) as error:
        ggn_diag(fn, weights, data_dim=-1)
    message = str(error.value)
    for word in ["Poisson", "Categorical", "Bernoulli", "Normal", "'ggn_mc'", "'ef'", "'hessian'"]:
        assert word in message


# ---------------------------------------------------------------------------
# (f) masks, per-example log-likelihood, data_dim
# ---------------------------------------------------------------------------


def test_masked_examples_contribute_nothing():
    weights, features = make_mlp(3)
    mask = torch.tensor([True, False, True, True, False])
    # an input only the masked-out examples depend on
    offset = torch.tensor([0.5, -1.0, 2.0], dtype=DTYPE, requires_grad=True)
    inputs = weights + [offset]
    logits = mlp(weights, features) + (~mask).to(DTYPE).unsqueeze(-1) * offset
    fn = dist.Categorical(logits=logits).mask(mask)

    jac = jacobian(lambda ws: mlp(ws, features), weights)[mask]
    probs = logits.detach()[mask].softmax(-1)
    fisher = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
    expected = torch.cat([ggn_from_full_jacobian(jac, fisher), torch.zeros(3, dtype=DTYPE)])
    assert_close_flat(ggn_diag(fn, inputs, data_dim=-1), expected)
    # without the mask the offset does receive curvature
    assert (ggn_diag(dist.Categorical(logits=logits), inputs, -1)[-1] > 0).all()

    labels = torch.tensor([0, 2, 1, 1, 0])
    terms = per_example_log_prob(fn, labels, data_dim=-1)
    assert torch.equal(terms[~mask], torch.zeros(2, dtype=DTYPE))
    masked_grads = per_example_grads(-terms, inputs)[0][~mask]
    assert torch.equal(masked_grads, torch.zeros_like(masked_grads))
    mc = mc_ggn_diag(fn, inputs, -1, num_samples=50, generator=torch.Generator().manual_seed(9))
    assert torch.equal(mc[-1], torch.zeros(3, dtype=DTYPE))
    assert (mc[0] > 0).any()

    everything_masked = dist.Categorical(logits=logits).mask(False)
    for curvature in [ggn_diag, mc_ggn_diag]:
        result = curvature(everything_masked, inputs, -1)
        assert all(torch.equal(r, torch.zeros_like(x)) for r, x in zip(result, inputs))


def test_elementwise_mask_inside_independent_drops_only_those_outputs():
    weights, features = make_mlp(2)
    scale = 0.5
    mask = torch.tensor([[True, False], [True, True], [False, False], [False, True], [True, True]])
    fn = dist.Normal(mlp(weights, features), scale).mask(mask).to_event(1)

    jac = jacobian(lambda ws: mlp(ws, features), weights)
    fisher = torch.diag_embed(mask.to(DTYPE)) / scale**2
    assert_close_flat(ggn_diag(fn, weights, data_dim=-1), ggn_from_full_jacobian(jac, fisher))


def test_example_mask_outside_independent_drops_whole_examples():
    weights, features = make_mlp(2)
    scale = 0.5
    mask = torch.tensor([True, False, False, True, True])
    # the mask has the batch shape (B,), the event dim (2,) lies to its right
    fn = dist.Normal(mlp(weights, features), scale).to_event(1).mask(mask)

    jac = jacobian(lambda ws: mlp(ws, features), weights)[mask]
    fisher = torch.eye(2, dtype=DTYPE).expand(int(mask.sum()), 2, 2) / scale**2
    assert_close_flat(ggn_diag(fn, weights, data_dim=-1), ggn_from_full_jacobian(jac, fisher))


def test_per_example_log_prob_sums_all_but_the_data_dim():
    generator = torch.Generator().manual_seed(10)
    loc = torch.randn(2, NUM_EXAMPLES, 3, generator=generator, dtype=DTYPE)
    fn = dist.Normal(loc, 1.0).to_event(1)  # batch (2, B), event (3,)
    value = torch.randn(2, NUM_EXAMPLES, 3, generator=generator, dtype=DTYPE)
    elementwise = torch.distributions.Normal(loc, 1.0).log_prob(value)
    expected = torch.stack([elementwise[:, i].sum() for i in range(NUM_EXAMPLES)])
    torch.testing.assert_close(per_example_log_prob(fn, value, data_dim=-1), expected, **TOL)
    torch.testing.assert_close(
        per_example_log_prob(fn, value, data_dim=-2), elementwise.sum((1, 2)), **TOL
    )
    # a leading sample shape is kept
    samples = torch.randn(7, 2, NUM_EXAMPLES, 3, generator=generator, dtype=DTYPE)
    assert per_example_log_prob(fn, samples, data_dim=-1).shape == (7, NUM_EXAMPLES)
    for bad in [0, -3]:
        with pytest.raises(ValueError, match="data_dim"):
            per_example_log_prob(fn, value, data_dim=bad)
