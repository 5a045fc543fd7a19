"""
The value of a :class:`~pyro_ngvi.BayesianNet`'s fast-path step: the negative ELBO
estimate with the meaning of ``Trace_ELBO().loss``,

.. math:: \\ell(w) + \\sum_j [\\log q(w_j) - \\log p_0(w_j)]
          \\quad \\text{at } w = \\mu + \\sigma\\epsilon, \\qquad
          \\ell(\\mu) + \\mathrm{KL}(q \\| p_0) \\quad \\text{deterministic},

constants included: :func:`full_nll` (:math:`\\ell`, and the gradient of a learned
Gaussian noise scale), :func:`log_ratio` and :func:`kl` for a mean-field guide,
:func:`matrix_normal_kl` for a Kronecker one.
"""

import math
from typing import Optional

import torch

from ..hot_path import no_grad, scalar

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


def full_nll(num_data, nll, loss_scale, noise_scale, target, batch_size) -> torch.Tensor:
    """
    :math:`\\ell = \\frac{N}{B}(-\\sum_i \\log p(y_i \\mid f_i))` with constants, from the
    loss module's :math:`c \\cdot` batch sum ``nll``; for a learned Gaussian noise scale
    also sets its ``.grad`` to :math:`\\partial \\ell / \\partial` (unconstrained).
    """
    scale = num_data / batch_size
    if noise_scale is None:  # (a 0-d tensor of nll's dtype: no cast of a Python float)
        return (scalar(scale, nll) if isinstance(nll, torch.Tensor) else scale) * nll
    # l = N/B [sse / (2 sigma^2) + B D (log sigma + log(2 pi) / 2)], sse = nll / c
    events = target.numel()
    if isinstance(noise_scale, torch.Tensor):
        sse = nll / loss_scale
        sigma_term = scale * (0.5 * sse / noise_scale**2 + events * noise_scale.log())
        if noise_scale.requires_grad:
            sigma_term.backward()
        sigma_term = sigma_term.detach()
    else:
        sigma_term = scale * (nll + events * math.log(noise_scale))
    return sigma_term + scale * events * _HALF_LOG_TWO_PI


@no_grad
def log_ratio(prior, weights, noises) -> torch.Tensor:
    """
    The sample-dependent part of :math:`\\log q(w) - \\log p_0(w)` at
    :math:`w = \\mu + \\sigma\\epsilon`, summed over sites:
    :math:`\\tfrac12 \\sum [\\lambda_0 (w - m_0)^2 - \\epsilon^2]`; the rest,
    :math:`\\sum [\\log s_0 - \\log\\sigma]`, does not depend on the sample.
    """
    if prior.norm_weights is not None:  # m_0 = 0, one lambda_0 per site: norms, one kernel each
        norms = torch.stack(torch._foreach_norm(list(weights) + noises)).square_()
        weights = prior.norm_weights  # (a learned prior's params may keep another dtype)
        return (weights if weights.dtype is norms.dtype else weights.to(norms.dtype)).dot(norms)
    noise_square = torch.stack(torch._foreach_norm(noises)).square_().sum()
    total = sum(_quadratic(w, loc, precision) for w, (loc, precision) in zip(weights, prior.compact))
    return 0.5 * (total - noise_square)


@torch.no_grad()
def kl(prior, locs, stddevs, log_scale) -> torch.Tensor:
    """
    :math:`\\sum_j \\mathrm{KL}(q_j \\| p_{0j})
    = \\sum [\\log(s_0/\\sigma) + \\lambda_0(\\sigma^2 + (\\mu - m_0)^2)/2 - 1/2]`
    over all sites; ``log_scale`` is :math:`\\sum \\log\\sigma`.
    """
    total, count = 0.0, 0
    for mean, stddev, (loc, precision) in zip(locs, stddevs, prior.compact):
        total = total + _quadratic(mean, loc, precision) + _quadratic(stddev, None, precision)
        count += mean.numel()
    return prior.log_scale_total - log_scale + 0.5 * (total - count)


def matrix_normal_kl(posterior, prior) -> torch.Tensor:
    """:math:`\\mathrm{KL}(\\mathcal{MN}(M, U, V) \\| \\prod \\mathcal{N}(m_{0}, s_0^2))
    = \\tfrac12 \\sum [\\lambda_0 (U_{ii} V_{jj} + (M - m_0)^2) - 1 + \\log(s_0^2)]
    - \\tfrac12 (p \\log\\det U + n \\log\\det V)`."""
    n, p = posterior.event_shape
    row_var = posterior.row_scale_tril.square().sum(-1)
    col_var = posterior.col_scale_tril.square().sum(-1)
    precision = prior.scale.pow(-2)
    second = torch.outer(row_var, col_var) + (posterior.loc - prior.loc).square()
    log_det = (2 * p * posterior.row_scale_tril.diagonal().log().sum()
               + 2 * n * posterior.col_scale_tril.diagonal().log().sum())
    return 0.5 * ((precision * second).sum() - n * p + 2 * prior.scale.log().sum() - log_det)


def _quadratic(w: torch.Tensor, loc: Optional[torch.Tensor], precision: torch.Tensor) -> torch.Tensor:
    """:math:`\\sum \\lambda_0 (w - m_0)^2` over a weight tensor, :math:`m_0` (``None``: 0)
    and :math:`\\lambda_0` broadcast to it: one dot product for a scalar prior."""
    deviation = w if loc is None else w - loc
    if precision.numel() == 1:
        flat = deviation.reshape(-1)
        return flat.dot(flat) * precision.reshape(())
    return deviation.square().mul_(precision).sum()
