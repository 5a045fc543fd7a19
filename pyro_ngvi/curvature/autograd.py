"""
Curvature sources computed with :mod:`torch.autograd`, for any Pyro model.

Every function here is a pure function of tensors and
:class:`~torch.distributions.Distribution` objects: the caller (an ELBO) traces
the model and hands over the pieces. ``inputs`` is always a list of leaf tensors
``u_j`` (unconstrained latent values, ``requires_grad=True``) of any shapes, and
every result is a list with one tensor per input, of that input's shape (the
per-example functions add a leading example dimension). Results are detached.

Write :math:`u` for the concatenation of all inputs, :math:`D` for its length.

- :func:`diag_hessian`: :math:`\\mathrm{diag}\\,\\nabla^2_u \\ell(u)`, exact.
- :func:`per_example_grads`: rows :math:`g_i = \\nabla_u \\ell_i(u)` of the
  Jacobian of a vector of per-example terms.
- :func:`empirical_fisher_diag`: VOGN's :math:`\\sum_i g_i \\odot g_i`.
- :func:`ggn_diag`: exact generalised Gauss-Newton diagonal
  :math:`\\sum_i \\mathrm{diag}(J_i^\\top F_i J_i)` of a likelihood whose
  parameters are functions of ``u`` (see :data:`GGN_RULES`).
- :func:`mc_ggn_diag`: its Monte-Carlo (Fisher) estimate, for any likelihood.

All second-order quantities are sums of weighted squared Jacobian rows,

.. math:: \\sum_e w_e \\,(\\partial z_e / \\partial u)^{\\odot 2},

which are computed from batched vector-Jacobian products
(``torch.autograd.grad(..., is_grads_batched=True)``) with chunks of unit
vectors: one backward pass per output element, memory ``chunk_size * D``, never
a :math:`D \\times D` matrix. The graph of the inputs is retained, so the caller
may still call ``backward`` on the same loss afterwards.

**References**

1. Khan, M. E., Nielsen, D., Tangkaratt, V., Lin, W., Gal, Y., Srivastava, A.
   (2018). Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam.
2. Martens, J. (2020). New Insights and Perspectives on the Natural Gradient Method.
3. Kunstner, F., Balles, L., Hennig, P. (2019). Limitations of the Empirical
   Fisher Approximation for Natural Gradient Descent.
4. Dangel, F., Kunstner, F., Hennig, P. (2020). BackPACK: Packing more into Backprop.
"""

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, Independent, Normal

from pyro.distributions import Unit
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

Tensor = torch.Tensor

__all__ = [
    "GGN_RULES",
    "diag_hessian",
    "empirical_fisher_diag",
    "ggn_diag",
    "ggn_terms",
    "mc_ggn_diag",
    "per_example_grads",
    "per_example_log_prob",
]

_WRAPPERS = (Independent, ExpandedDistribution, MaskedDistribution)

#: From this many rows on, one batched (vmap) backward pass beats a loop of plain
#: ones (measured, torch 2.14 CPU: a 1-row vmap pass costs about two plain passes).
_BATCHED_MIN_ROWS = 3


# ---------------------------------------------------------------------------
# batched vector-Jacobian products
# ---------------------------------------------------------------------------


def _batched_vjp(
    output: Tensor, inputs: Sequence[Tensor], grad_outputs: Tensor
) -> Tuple[Optional[Tensor], ...]:
    """
    Rows ``grad_outputs[c] @ d output / d inputs`` for every ``c`` at once; an
    input the output does not depend on gives ``None``.
    """
    if len(grad_outputs) >= _BATCHED_MIN_ROWS:
        try:
            return torch.autograd.grad(
                output,
                inputs,
                grad_outputs,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        except RuntimeError:
            pass  # an operation in the graph without a vmap rule
    # one backward per row
    rows = [
        torch.autograd.grad(output, inputs, vector, retain_graph=True, allow_unused=True)
        for vector in grad_outputs
    ]
    return tuple(None if column[0] is None else torch.stack(column) for column in zip(*rows))


def _jacobian_rows(
    output: Tensor,
    inputs: Sequence[Tensor],
    chunk_size: int,
    indices: Optional[Tensor] = None,
) -> Iterator[Tuple[Tensor, Tuple[Optional[Tensor], ...]]]:
    """
    Yield ``(rows, grads)`` chunk by chunk: ``rows`` the flat indices ``e`` of
    ``output`` in this chunk and ``grads[j]`` of shape
    ``(len(rows), *inputs[j].shape)`` the gradients of ``output.flatten()[e]``
    (``None`` for inputs not reached).

    :param Tensor output: any tensor computed from ``inputs``.
    :param inputs: leaf tensors.
    :param int chunk_size: number of rows per backward pass.
    :param indices: flat indices to differentiate (default: all).
    """
    flat = output.reshape(-1)
    if indices is None:
        indices = torch.arange(flat.numel(), device=flat.device)
    for start in range(0, indices.numel(), chunk_size):
        rows = indices[start : start + chunk_size]
        unit_vectors = flat.new_zeros(rows.numel(), flat.numel())
        unit_vectors[torch.arange(rows.numel(), device=rows.device), rows] = 1
        yield rows, _batched_vjp(flat, inputs, unit_vectors)


def _weighted_squared_jacobian(
    output: Tensor,
    weight: Tensor,
    inputs: Sequence[Tensor],
    chunk_size: int,
    skip_zero_weights: bool = False,
) -> List[Tensor]:
    """
    :math:`\\sum_e w_e (\\partial z_e / \\partial u_j)^{\\odot 2}` for every input
    :math:`u_j`, with :math:`z` = ``output`` and :math:`w` = ``weight``
    (broadcast to ``output``'s shape, detached).

    :param bool skip_zero_weights: differentiate only the elements with a nonzero
        weight (masked-out elements then cost nothing and cannot leak a NaN).
    """
    result = [torch.zeros_like(x) for x in inputs]
    if not output.requires_grad or output.numel() == 0:
        return result
    weight = torch.broadcast_to(weight.detach(), output.shape).reshape(-1)
    indices = None
    if skip_zero_weights:
        indices = torch.nonzero(weight).reshape(-1)
    for rows, grads in _jacobian_rows(output, inputs, chunk_size, indices):
        w = weight[rows]
        for j, g in enumerate(grads):
            if g is not None:
                w_j = w.reshape((-1,) + (1,) * (g.dim() - 1))
                result[j] = result[j] + (w_j * g.square()).sum(0)
    return result


# ---------------------------------------------------------------------------
# exact Hessian diagonal
# ---------------------------------------------------------------------------


def diag_hessian(
    loss: Tensor, inputs: Sequence[Tensor], chunk_size: int = 256
) -> List[Tensor]:
    """
    Exact diagonal of the Hessian of a scalar ``loss`` w.r.t. the concatenation
    :math:`u` of all inputs,

    .. math:: h_a = \\partial^2 \\ell / \\partial u_a^2 .

    The loss may couple inputs; cross-input second derivatives are off the
    diagonal and never computed. The gradient :math:`g = \\nabla_u \\ell` is
    built with ``create_graph=True``; then, per input, the rows of
    :math:`\\partial g_j / \\partial u_j` are taken ``chunk_size`` at a time as
    batched vector-Jacobian products with unit vectors and their diagonal entries
    kept: :math:`D` backward passes, memory ``chunk_size * D``.

    :param Tensor loss: scalar loss.
    :param inputs: leaf tensors with ``requires_grad=True``.
    :param int chunk_size: unit vectors per backward pass (default: 256).
    :return: one tensor per input, of its shape. An input the loss does not
        depend on, or on which the gradient does not depend (the loss is linear
        in it), gets zeros.
    """
    inputs = list(inputs)
    grads = torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
    result = []
    for x, g in zip(inputs, grads):
        diagonal = torch.zeros_like(x).reshape(-1)
        if g is not None and g.requires_grad:
            for rows, (h,) in _jacobian_rows(g, [x], chunk_size):
                if h is None:
                    break
                h = h.reshape(rows.numel(), -1)
                diagonal[rows] = h[torch.arange(rows.numel(), device=rows.device), rows]
        result.append(diagonal.reshape(x.shape).detach())
    return result


# ---------------------------------------------------------------------------
# per-example gradients and the empirical Fisher
# ---------------------------------------------------------------------------


def per_example_grads(
    per_example_terms: Tensor, inputs: Sequence[Tensor], chunk_size: int = 256
) -> List[Tensor]:
    """
    Per-example gradients :math:`g_i = \\nabla_u \\ell_i`, the rows of the
    Jacobian of the vector :math:`(\\ell_1, \\dots, \\ell_B)`: batched
    vector-Jacobian products with the rows of the identity.

    :param Tensor per_example_terms: 1-D tensor of :math:`B` scalar terms, e.g.
        per-example negative log-likelihoods.
    :param inputs: leaf tensors with ``requires_grad=True``.
    :param int chunk_size: examples per backward pass (default: 256).
    :return: for each input a tensor of shape ``(B, *input.shape)``
        (zeros for an input the terms do not depend on).
    """
    inputs = list(inputs)
    if per_example_terms.dim() != 1:
        raise ValueError(
            "per_example_terms must be 1-D, got shape {}".format(
                tuple(per_example_terms.shape)
            )
        )
    num_examples = per_example_terms.shape[0]
    result = [x.new_zeros((num_examples,) + x.shape) for x in inputs]
    if not per_example_terms.requires_grad:
        return result
    for rows, grads in _jacobian_rows(per_example_terms, inputs, chunk_size):
        for j, g in enumerate(grads):
            if g is not None:
                result[j][rows] = g
    return result


def empirical_fisher_diag(
    per_example_terms: Tensor, inputs: Sequence[Tensor], chunk_size: int = 256
) -> List[Tensor]:
    """
    VOGN's Gauss-Newton approximation (the diagonal empirical Fisher)

    .. math:: h = \\sum_{i=1}^B g_i \\odot g_i, \\qquad g_i = \\nabla_u \\ell_i,

    unscaled: under a subsampled data plate the caller multiplies by
    :math:`N/B`. Per-example gradients are squared chunk by chunk, never all
    stored.

    :param Tensor per_example_terms: 1-D tensor of :math:`B` scalar terms.
    :param inputs: leaf tensors with ``requires_grad=True``.
    :param int chunk_size: examples per backward pass (default: 256).
    :return: one tensor per input, of its shape.
    """
    if per_example_terms.dim() != 1:
        raise ValueError(
            "per_example_terms must be 1-D, got shape {}".format(
                tuple(per_example_terms.shape)
            )
        )
    ones = torch.ones((), dtype=per_example_terms.dtype, device=per_example_terms.device)
    return _weighted_squared_jacobian(per_example_terms, ones, list(inputs), chunk_size)


# ---------------------------------------------------------------------------
# per-example log-likelihood
# ---------------------------------------------------------------------------


def _example_dim(fn: Distribution, data_dim: int) -> int:
    """Position of the (negative) batch dim ``data_dim`` within ``fn.batch_shape``."""
    batch_ndim = len(fn.batch_shape)
    if not isinstance(data_dim, int) or not -batch_ndim <= data_dim < 0:
        raise ValueError(
            "data_dim must be a negative batch dimension of the likelihood "
            "(as a Pyro plate's dim), in [-{}, -1] for batch_shape {}; got {}".format(
                batch_ndim, tuple(fn.batch_shape), data_dim
            )
        )
    return batch_ndim + data_dim


def per_example_log_prob(fn: Distribution, value: Tensor, data_dim: int) -> Tensor:
    """
    Log-likelihood of each example,

    .. math:: \\log p_i = \\sum_{b \\,:\\, b_{\\text{data\\_dim}} = i}
              \\log f(\\text{value}_b),

    i.e. ``fn.log_prob(value)`` (event dims already summed, masks already
    applied by Pyro's wrappers) summed over every batch dim except ``data_dim``.

    :param fn: the likelihood distribution.
    :param Tensor value: observed (or sampled) value; extra leading dims of
        ``value`` beyond ``fn``'s shape (a sample shape) are kept.
    :param int data_dim: the negative batch dimension of ``fn`` that indexes
        examples (a data plate's ``dim``).
    :return: tensor of shape ``(B,)`` (``sample_shape + (B,)`` with a sample shape).
    """
    position = _example_dim(fn, data_dim)
    batch_ndim = len(fn.batch_shape)
    log_prob = fn.log_prob(value)
    shape = torch.broadcast_shapes(log_prob.shape, fn.batch_shape)
    log_prob = log_prob.expand(shape)
    sample_ndim = len(shape) - batch_ndim
    summed = [sample_ndim + d for d in range(batch_ndim) if d != position]
    return log_prob.sum(summed) if summed else log_prob


# ---------------------------------------------------------------------------
# exact GGN
# ---------------------------------------------------------------------------


def _unwrap(fn: Distribution) -> Tuple[Distribution, Optional[Tensor], bool]:
    """
    Strip Pyro's shape wrappers (``Independent``, ``ExpandedDistribution``,
    ``MaskedDistribution``) down to the elementwise likelihood.

    :return: ``(base, mask, all_masked)``: ``mask`` is ``None`` or a boolean
        tensor broadcastable to ``fn.batch_shape + fn.event_shape`` (the value's
        shape); ``all_masked`` is true when a ``mask=False`` was met.
    """
    mask = None
    while isinstance(fn, _WRAPPERS):
        if isinstance(fn, MaskedDistribution):
            if fn._mask is False:
                return fn.base_dist, None, True
            if fn._mask is not True:
                # the mask covers this level's batch dims; its event dims lie to the
                # right of them in the value's shape
                level_mask = fn._mask.reshape(
                    fn._mask.shape + (1,) * len(fn.event_shape)
                )
                mask = level_mask if mask is None else mask & level_mask
        fn = fn.base_dist
    return fn, mask, False


def _collapse_broadcast(param: Tensor, weight: Tensor, ndim: int) -> Tuple[Tensor, Tensor]:
    """
    Keep one slice of every broadcast (stride-0) dim among the first ``ndim``
    dims of ``param`` and sum ``weight`` (same shape as ``param`` or size 1 in the
    remaining dims) over it: all elements along such a dim are the same function
    of the inputs, so :math:`\\sum_e w_e J_e^2 = (\\sum_e w_e) J^2`. A scalar
    noise scale broadcast over :math:`B` examples then costs one backward
    pass, not :math:`B`.
    """
    for dim in range(ndim):
        if param.shape[dim] > 1 and param.stride(dim) == 0:
            param = param.narrow(dim, 0, 1)
            weight = weight.sum(dim, keepdim=True)
    return param, weight


def _categorical_terms(
    fn: Categorical, value_shape: torch.Size, weight: Tensor
) -> List[Tuple[Tensor, Tensor]]:
    """
    Categorical with logits :math:`z`, :math:`p = \\mathrm{softmax}(z)`:
    :math:`F = \\mathrm{diag}(p) - p p^\\top` over the classes. In the
    log-probabilities :math:`\\ell = z - \\mathrm{logsumexp}(z)` the Jacobian is
    :math:`J_\\ell = (I - \\mathbf 1 p^\\top) J_z` and
    :math:`J_\\ell^\\top \\mathrm{diag}(p) J_\\ell = J_z^\\top F J_z`, so per element

    .. math:: \\mathrm{diag}(J_z^\\top F J_z) = \\sum_k p_k J_{\\ell,k}^{\\odot 2}
              = \\sum_k p_k J_{z,k}^{\\odot 2} - \\Big(\\sum_k p_k J_{z,k}\\Big)^{\\odot 2},

    one backward pass per class and element (the term :math:`\\sum_k p_k
    J_{\\ell,k}` vanishes identically). ``fn.logits`` is renormalised here, so
    the identity holds whatever logits the distribution stores.
    """
    num_classes = fn.logits.shape[-1]
    logits = torch.broadcast_to(fn.logits, value_shape + (num_classes,))
    logits, weight = _collapse_broadcast(logits, weight.unsqueeze(-1), len(value_shape))
    log_probs = logits - logits.logsumexp(-1, keepdim=True)
    return [(log_probs, weight * log_probs.detach().exp())]


def _bernoulli_terms(
    fn: Bernoulli, value_shape: torch.Size, weight: Tensor
) -> List[Tuple[Tensor, Tensor]]:
    """Bernoulli with logits :math:`z`: :math:`F = p (1 - p)`, :math:`p = \\sigma(z)`."""
    logits = torch.broadcast_to(fn.logits, value_shape)
    logits, weight = _collapse_broadcast(logits, weight, len(value_shape))
    probs = torch.sigmoid(logits.detach())
    return [(logits, weight * probs * (1 - probs))]


def _normal_terms(
    fn: Normal, value_shape: torch.Size, weight: Tensor
) -> List[Tuple[Tensor, Tensor]]:
    """
    Normal in (loc :math:`m`, log scale :math:`\\log s`): :math:`F = \\mathrm{diag}
    (1/s^2, 2)`, so per element :math:`J_m^{\\odot 2}/s^2 + 2 J_{\\log s}^{\\odot 2}`;
    the second term only when the scale depends on the inputs.
    """
    scale = torch.broadcast_to(fn.scale, value_shape)
    precision = scale.detach().square().reciprocal()
    loc = torch.broadcast_to(fn.loc, value_shape)
    loc, loc_weight = _collapse_broadcast(loc, weight * precision, len(value_shape))
    terms = [(loc, loc_weight)]
    if scale.requires_grad:
        scale, scale_weight = _collapse_broadcast(
            scale, weight.expand(value_shape), len(value_shape)
        )
        terms.append((scale.log(), 2 * scale_weight))
    return terms


#: Likelihoods :func:`ggn_diag` supports: distribution class -> rule
#: ``(base_dist, value_shape, weight) -> [(output, output_weight), ...]`` such that
#: the GGN diagonal is :math:`\sum \sum_e w_e (\partial z_e/\partial u)^2` over the
#: returned pairs ``(z, w)``; ``weight`` (shape ``value_shape``) is the mask.
#: Supporting a new likelihood is adding a rule here.
GGN_RULES: Dict[type, Callable] = {
    Categorical: _categorical_terms,
    Bernoulli: _bernoulli_terms,
    Normal: _normal_terms,
}


def _ggn_rule(base: Distribution) -> Optional[Callable]:
    for cls in type(base).__mro__:
        if cls in GGN_RULES:
            return GGN_RULES[cls]
    return None


def ggn_diag(
    fn: Distribution, inputs: Sequence[Tensor], data_dim: int, chunk_size: int = 256
) -> List[Tensor]:
    """
    Exact generalised Gauss-Newton diagonal of the negative log-likelihood
    :math:`-\\sum_i \\log f(y_i \\mid \\theta_i(u))`,

    .. math:: h = \\sum_i \\mathrm{diag}\\big(J_i^\\top F_i J_i\\big),
              \\qquad J_i = \\partial \\theta_i / \\partial u, \\quad
              F_i = \\nabla^2_{\\theta_i} \\big(-\\log f(y_i \\mid \\theta_i)\\big),

    without forming a :math:`D \\times D` matrix: :math:`F_i` is block-diagonal
    over the independent observation elements of an example, and each block is
    applied to Jacobian rows from batched vector-Jacobian products (one backward
    pass per output element; broadcast parameters such as one noise scale shared
    by all examples are differentiated once). Supported (:data:`GGN_RULES`):

    - ``Categorical``: :math:`\\theta` = ``fn.logits``,
      :math:`F = \\mathrm{diag}(p) - p p^\\top` (computed as
      :math:`\\mathrm{diag}(p)` in the log-probabilities);
    - ``Bernoulli``: :math:`\\theta` = ``fn.logits``, :math:`F = p (1 - p)`;
    - ``Normal``: :math:`\\theta` = (loc, log scale), :math:`F = \\mathrm{diag}
      (1/s^2, 2)`; the log-scale term only if the scale depends on the inputs.

    Pyro's ``Independent``, ``ExpandedDistribution`` and ``MaskedDistribution``
    are unwrapped; masked-out elements contribute nothing. :math:`F_i` does not
    depend on the observed values, so none are needed, and since :math:`F_i` is
    block-diagonal the result does not depend on how elements group into
    examples: ``data_dim`` is checked, and kept for symmetry with
    :func:`mc_ggn_diag`.

    :param fn: likelihood whose parameters are differentiable functions of ``inputs``.
    :param inputs: leaf tensors with ``requires_grad=True``.
    :param int data_dim: negative batch dimension of ``fn`` that indexes examples.
    :param int chunk_size: output elements per backward pass (default: 256).
    :return: one tensor per input, of its shape.
    :raises NotImplementedError: for any other likelihood.
    """
    inputs = list(inputs)
    dtype = inputs[0].dtype if inputs else torch.get_default_dtype()
    device = inputs[0].device if inputs else None
    terms, masked = ggn_terms(fn, data_dim, dtype, device, "ggn_diag")
    result = [torch.zeros_like(x) for x in inputs]
    for output, output_weight in terms:
        parts = _weighted_squared_jacobian(
            output, output_weight, inputs, chunk_size, skip_zero_weights=masked
        )
        result = [total + part for total, part in zip(result, parts)]
    return result


def is_factor(fn: Distribution) -> bool:
    """Whether the likelihood ``fn`` is a ``pyro.factor`` term (a ``Unit``, behind Pyro's wrappers)."""
    return isinstance(_unwrap(fn)[0], Unit)


def ggn_terms(fn: Distribution, data_dim: int, dtype, device, caller: str) -> Tuple[List[Tuple[Tensor, Tensor]], bool]:
    """
    The weighted outputs ``(z, w)`` of the likelihood's :data:`GGN_RULES` rule, with
    :math:`\\sum_e w_e j_e j_e^\\top` over them the GGN (its diagonal in
    :func:`ggn_diag`, all of it in :func:`~pyro_ngvi.curvature.dense.ggn_matrix`),
    and whether a mask weights them (masked-out elements are then skipped).
    Pyro's wrappers are unwrapped; a ``mask=False`` gives no terms.

    :raises NotImplementedError: for a likelihood without a rule (``caller`` named).
    """
    _example_dim(fn, data_dim)
    base, mask, all_masked = _unwrap(fn)
    rule = _ggn_rule(base)
    if rule is None:
        raise NotImplementedError(
            "{} supports {} likelihoods (after Independent/Expanded/Masked "
            "wrappers), got {}. Use curvature {}'ef' (empirical Fisher) or 'hessian' "
            "(exact Hessian) instead.".format(
                caller, ", ".join(cls.__name__ for cls in GGN_RULES),
                *(("a pyro.factor term (Unit)", "") if isinstance(base, Unit) else
                  (type(base).__name__, "'ggn_mc' (Monte-Carlo GGN), "))
            )
        )
    if all_masked:
        return [], False
    value_shape = fn.batch_shape + fn.event_shape
    if mask is None:
        weight = torch.ones(value_shape, dtype=dtype, device=device)
    else:
        weight = torch.broadcast_to(mask, value_shape).to(dtype)
    return rule(base, value_shape, weight), mask is not None


# ---------------------------------------------------------------------------
# Monte-Carlo GGN
# ---------------------------------------------------------------------------


def _sample_targets(
    fn: Distribution, num_samples: int, generator: Optional[torch.Generator], device
) -> Tensor:
    """
    ``num_samples`` detached draws from ``fn``; with a ``generator``, the draw is
    seeded from it and the global RNG state is left as it was.
    """
    sample_shape = torch.Size([num_samples])
    if is_factor(fn):  # (its log_prob ignores the value: every draw would give the EF)
        raise NotImplementedError(
            "curvature 'ggn_mc' draws targets from the likelihood; a pyro.factor term (Unit) has none to draw. "
            "Use curvature 'ef' (empirical Fisher), 'hessian' (exact Hessian) or 'reparam' for it.")
    if generator is None:
        return fn.sample(sample_shape).detach()
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        return fn.sample(sample_shape).detach()


def mc_ggn_diag(
    fn: Distribution,
    inputs: Sequence[Tensor],
    data_dim: int,
    num_samples: int = 1,
    generator: Optional[torch.Generator] = None,
    chunk_size: int = 256,
) -> List[Tensor]:
    """
    Monte-Carlo GGN (Fisher) diagonal, for any likelihood with ``.sample()``:

    .. math:: h = \\frac1S \\sum_{s=1}^S \\sum_i \\big(\\nabla_u \\log
              f(\\tilde y_{si} \\mid \\theta_i(u))\\big)^{\\odot 2},
              \\qquad \\tilde y_s \\sim f(\\cdot \\mid \\theta(u)) \\text{ (detached)},

    an unbiased estimate of :func:`ggn_diag` (for an exponential family in its
    natural parameters, :math:`E_{\\tilde y}[\\nabla \\nabla^\\top] = J^\\top F J`).
    Unlike :func:`empirical_fisher_diag` the targets are drawn from the model,
    not the data. Per-example terms sum every batch dim but ``data_dim``.
    Cost: :math:`S B` backward passes, in groups of about ``chunk_size``.

    :param fn: likelihood whose parameters are differentiable functions of ``inputs``.
    :param inputs: leaf tensors with ``requires_grad=True``.
    :param int data_dim: negative batch dimension of ``fn`` that indexes examples.
    :param int num_samples: number :math:`S` of target draws (default: 1).
    :param generator: optional :class:`torch.Generator` seeding the draws (the
        global RNG is then left untouched); ``None`` uses the global RNG.
    :param int chunk_size: per-example terms per backward pass (default: 256).
    :return: one tensor per input, of its shape.
    """
    inputs = list(inputs)
    if num_samples < 1:
        raise ValueError("num_samples must be >= 1, got {}".format(num_samples))
    num_examples = fn.batch_shape[_example_dim(fn, data_dim)]
    device = inputs[0].device if inputs else None
    targets = _sample_targets(fn, num_samples, generator, device)
    # A backward pass for one term also runs through the log-likelihood of every
    # term built in the same graph, so the draws are taken a group at a time
    # (about chunk_size terms per group): cost linear, not quadratic, in S.
    group_size = max(1, chunk_size // max(num_examples, 1))
    result = [torch.zeros_like(x) for x in inputs]
    for group in torch.split(targets, group_size):
        nll = -per_example_log_prob(fn, group, data_dim)  # (group, B)
        weight = torch.full((), 1.0 / num_samples, dtype=nll.dtype, device=nll.device)
        parts = _weighted_squared_jacobian(nll, weight, inputs, chunk_size)
        result = [total + part for total, part in zip(result, parts)]
    return result
