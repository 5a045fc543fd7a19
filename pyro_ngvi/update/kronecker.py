"""
The noisy K-FAC step of a Kronecker-factored layer (Zhang et al. 2018; the family
and its maths: :mod:`pyro_ngvi.kronecker`): moving averages of the two factors,

.. math:: A' = (1-\\beta) A + \\beta \\hat A, \\qquad G' = (1-\\beta) G + \\beta \\hat G / \\tau,

the prior folded in, and :math:`M' = M - \\alpha G_\\gamma^{-1}(\\bar g + (M - M_0)D)A_\\gamma^{-1}`.
"""

import math
from typing import NamedTuple, Optional

import torch

from ..full_covariance import _sym, precision, precision_cholesky
from ..kronecker import KroneckerCurvature, fold_prior, unfold_prior

class KroneckerStep(NamedTuple):
    mean: torch.Tensor
    row_factor: torch.Tensor
    col_factor: torch.Tensor


@torch.no_grad()
def kronecker_step(
    mean: torch.Tensor,
    row_factor: torch.Tensor,
    col_factor: torch.Tensor,
    direction: torch.Tensor,
    stats: KroneckerCurvature,
    lr: float,
    beta: float,
    tau: float = 1.0,
    damping: float = 0.0,
    first: bool = False,
    folded_with: Optional[torch.Tensor] = None,
) -> Optional[KroneckerStep]:
    """
    The noisy K-FAC step of the module docstring for one layer; ``None`` when a
    new factor is not numerically positive definite (the caller skips the step).

    :param mean: :math:`M`, ``(n, p)``.
    :param row_factor: :math:`L_U` now. :param col_factor: :math:`L_V` now.
    :param direction: :math:`\\bar g` (momentum-averaged, tempered), ``(n, p)``.
    :param stats: this step's :class:`~pyro_ngvi.kronecker.KroneckerCurvature`.
    :param float damping: :math:`\\gamma`, added in the mean step only, as
        :math:`(A_\\gamma + \\pi\\sqrt\\gamma I) \\otimes (G_\\gamma + \\sqrt\\gamma/\\pi I)`
        (default: 0).
    :param bool first: the site's first step: the factors start at this step's
        estimates (:math:`\\beta = 1`), as noisy K-FAC initialises them (default: False).
    """
    dtype = mean.dtype
    work = torch.float64
    eta = stats.prior_precision.to(work)
    input_hat, output_hat = stats.input_factor.to(work), stats.output_factor.to(work) / tau
    if first:
        input_factor, output_factor = input_hat, output_hat
    else:
        old_eta = eta if folded_with is None else folded_with.to(work)
        current = unfold_prior(precision(col_factor.to(work)), precision(row_factor.to(work)), old_eta)
        input_factor = torch.lerp(current[0], input_hat, beta)
        output_factor = torch.lerp(current[1], output_hat, beta)
    damped_input, damped_output = fold_prior(_sym(input_factor), _sym(output_factor), eta)
    new_col, new_row = precision_cholesky(damped_input), precision_cholesky(damped_output)
    if new_col is None or new_row is None:
        return None
    if damping:
        n = damped_output.shape[-1]
        pi = ((input_factor.trace() / eta.sum()) / (output_factor.trace() / n)).sqrt()
        root = math.sqrt(damping)
        solve_col = precision_cholesky(damped_input + pi * root * torch.eye(len(eta), dtype=work, device=eta.device))
        solve_row = precision_cholesky(damped_output + root / pi * torch.eye(n, dtype=work, device=eta.device))
        if solve_col is None or solve_row is None:
            return None
    else:
        solve_col, solve_row = new_col, new_row
    mean64 = mean.to(work)
    numerator = direction.to(work) + (mean64 - stats.prior_loc.to(work)) * eta
    # (G ⊗ A)^{-1} vec(X) = vec(G^{-1} X A^{-1}), G^{-1} = L L^T
    step = solve_row @ (solve_row.T @ numerator @ solve_col) @ solve_col.T
    return KroneckerStep((mean64 - lr * step).to(dtype), new_row.to(dtype), new_col.to(dtype))
