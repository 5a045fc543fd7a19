"""
Dense curvature matrices by autograd, for a full-covariance guide
(:class:`~pyro.infer.autoguide.AutoMultivariateNormal`): the same sources as
:mod:`.autograd`, as :math:`D \\times D` matrices in one latent vector ``z``
(a 1-D leaf tensor, ``requires_grad=True``) instead of diagonals.

- :func:`hessian_matrix`: :math:`\\nabla^2_z \\ell`, exact.
- :func:`empirical_fisher_matrix`: :math:`\\sum_i g_i g_i^\\top`.
- :func:`ggn_matrix`: :math:`\\sum_i J_i^\\top F_i J_i` (rules of
  :data:`~pyro_ngvi.curvature.autograd.GGN_RULES`).
- :func:`mc_ggn_matrix`: its Monte-Carlo (Fisher) estimate.

Every one is a Gram matrix :math:`\\sum_e w_e\\, j_e j_e^\\top` of Jacobian rows
:math:`j_e = \\partial z_e / \\partial u` (for the Hessian, the rows of the
Jacobian of the gradient), taken ``chunk_size`` rows per batched backward pass
(``torch.autograd.grad(..., is_grads_batched=True)``, which runs on
``torch.func.vmap``). Results are detached and symmetric.
"""

from typing import Optional

import torch
from torch.distributions import Distribution

from .autograd import _jacobian_rows, _sample_targets, ggn_terms, per_example_log_prob

Tensor = torch.Tensor

__all__ = ["empirical_fisher_matrix", "ggn_matrix", "hessian_matrix", "mc_ggn_matrix"]


def _check_latent(z: Tensor) -> None:
    if z.dim() != 1:
        raise ValueError(f"the latent vector must be 1-D, got shape {tuple(z.shape)}")


def _weighted_gram(output: Tensor, weight: Tensor, z: Tensor, chunk_size: int,
                   skip_zero_weights: bool = False) -> Tensor:
    """:math:`\\sum_e w_e j_e j_e^\\top`, :math:`j_e = \\partial\\, \\text{output}_e / \\partial z`."""
    gram = z.new_zeros(z.numel(), z.numel())
    if not output.requires_grad or output.numel() == 0:
        return gram
    weight = torch.broadcast_to(weight.detach(), output.shape).reshape(-1)
    indices = torch.nonzero(weight).reshape(-1) if skip_zero_weights else None
    for rows, (jacobian,) in _jacobian_rows(output, [z], chunk_size, indices):
        if jacobian is not None:
            jacobian = jacobian.reshape(rows.numel(), -1)
            gram = gram + jacobian.T @ (weight[rows].unsqueeze(-1) * jacobian)
    return gram.detach()


def hessian_matrix(loss: Tensor, z: Tensor, chunk_size: int = 256) -> Tensor:
    """
    The exact Hessian :math:`\\nabla^2_z \\ell` of a scalar ``loss``: the gradient
    with ``create_graph=True``, then the rows of its Jacobian, ``chunk_size`` at a
    time (:math:`D` backward passes), symmetrised.
    """
    _check_latent(z)
    (grad,) = torch.autograd.grad(loss, [z], create_graph=True, allow_unused=True)
    hessian = z.new_zeros(z.numel(), z.numel())
    if grad is None or not grad.requires_grad:
        return hessian
    for rows, (block,) in _jacobian_rows(grad, [z], chunk_size):
        if block is None:
            return hessian
        hessian[rows] = block.detach()
    return 0.5 * (hessian + hessian.T)


def empirical_fisher_matrix(per_example_terms: Tensor, z: Tensor, chunk_size: int = 256) -> Tensor:
    """
    :math:`\\sum_{i=1}^B g_i g_i^\\top`, :math:`g_i = \\nabla_z \\ell_i`, unscaled
    (under a subsampled data plate the caller multiplies by :math:`N/B`).

    :param Tensor per_example_terms: 1-D tensor of :math:`B` scalar terms.
    """
    _check_latent(z)
    if per_example_terms.dim() != 1:
        raise ValueError(
            f"per_example_terms must be 1-D, got shape {tuple(per_example_terms.shape)}"
        )
    ones = torch.ones((), dtype=per_example_terms.dtype, device=per_example_terms.device)
    return _weighted_gram(per_example_terms, ones, z, chunk_size)


def ggn_matrix(fn: Distribution, z: Tensor, data_dim: int, chunk_size: int = 256) -> Tensor:
    """
    The exact generalised Gauss-Newton matrix :math:`\\sum_i J_i^\\top F_i J_i`
    of the negative log-likelihood ``fn`` (whose parameters are functions of
    ``z``), for the likelihoods of
    :data:`~pyro_ngvi.curvature.autograd.GGN_RULES` (the matrix form of
    :func:`~pyro_ngvi.curvature.autograd.ggn_diag`: each rule's weighted outputs
    give :math:`\\sum_e w_e j_e j_e^\\top`, the Categorical one through the
    identity :math:`J_z^\\top (\\mathrm{diag}(p) - pp^\\top) J_z = J_\\ell^\\top
    \\mathrm{diag}(p) J_\\ell` in the log-probabilities :math:`\\ell`).

    :raises NotImplementedError: for any other likelihood.
    """
    _check_latent(z)
    terms, masked = ggn_terms(fn, data_dim, z.dtype, z.device, "ggn_matrix")
    gram = z.new_zeros(z.numel(), z.numel())
    for output, output_weight in terms:
        gram = gram + _weighted_gram(output, output_weight, z, chunk_size, skip_zero_weights=masked)
    return gram


def mc_ggn_matrix(fn: Distribution, z: Tensor, data_dim: int, num_samples: int = 1,
                  generator: Optional[torch.Generator] = None, chunk_size: int = 256) -> Tensor:
    """
    The Monte-Carlo GGN (Fisher) matrix :math:`\\frac1S \\sum_s \\sum_i
    \\nabla_z \\log f(\\tilde y_{si})\\, \\nabla_z \\log f(\\tilde y_{si})^\\top`,
    :math:`\\tilde y_s \\sim f` (detached): an unbiased estimate of :func:`ggn_matrix`
    for any likelihood with ``.sample()``.
    """
    _check_latent(z)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    targets = _sample_targets(fn, num_samples, generator, z.device)
    nll = -per_example_log_prob(fn, targets, data_dim)  # (S, B)
    weight = torch.full((), 1.0 / num_samples, dtype=nll.dtype, device=nll.device)
    return _weighted_gram(nll, weight, z, chunk_size)
