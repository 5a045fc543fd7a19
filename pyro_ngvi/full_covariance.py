"""
The natural-gradient algebra of a full-covariance Gaussian,
:math:`q(u) = \\mathcal{N}(\\mu, \\Sigma)`, in the form Pyro's
:class:`~pyro.infer.autoguide.AutoMultivariateNormal` stores it.

Pyro 1.9 keeps ``loc`` :math:`= \\mu`, a positive ``scale`` :math:`s` and a unit
lower-triangular ``scale_tril`` :math:`L`, and samples
:math:`u = \\mu + C\\epsilon` with the lower Cholesky factor of the covariance

.. math:: C = \\mathrm{diag}(s)\\, L, \\qquad \\Sigma = C C^\\top, \\qquad
          S = \\Sigma^{-1} = C^{-\\top} C^{-1}.

The natural-gradient step lives in the precision :math:`S` (see
:func:`pyro_ngvi.update.full_covariance.natural_step`). Getting from :math:`S` back to :math:`C` needs a
Cholesky factor of :math:`S` that is *upper* triangular: with the reversal
permutation :math:`P` (``flip``), :math:`\\mathrm{chol}(P S P) = R` gives
:math:`S = U U^\\top`, :math:`U = P R P` upper triangular, hence
:math:`\\Sigma = U^{-\\top} U^{-1}` and :math:`C = U^{-\\top}` (lower triangular,
positive diagonal: *the* Cholesky factor of :math:`\\Sigma`). Only triangular
solves; :math:`S^{-1}` is never formed, and :math:`S'^{-1} v = C' C'^\\top v`
costs two triangular matrix-vector products.

Everything here is a pure function of tensors (no Pyro state); the matrix
algebra runs in float64 (a precision matrix squares the condition number of its
Cholesky factor) and results come back in the caller's dtype. Every step costs
:math:`O(D^3)`.

**References**

[1] `Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam`,
    Mohammad Emtiyaz Khan et al. (ICML 2018)
[2] `Handling the Positive-Definite Constraint in the Bayesian Learning Rule`,
    Wu Lin, Mark Schmidt, Mohammad Emtiyaz Khan (ICML 2020)
[3] `The Variational Gaussian Approximation Revisited`, Manfred Opper, Cedric
    Archambeau (Neural Computation 2009)
[4] `Differentiation of the Cholesky decomposition`, Iain Murray (2016),
    https://arxiv.org/abs/1602.07527
"""

from typing import Optional, Tuple

import torch

__all__ = [
    "controlled_price_statistics",
    "covariance_factor",
    "factor_gradient",
    "one_draw_whitened",
    "precision",
    "precision_cholesky",
    "price_curvature",
    "recovered_draw",
    "split_factor",
    "unwhiten",
    "whiten",
    "whitened_price_curvature",
]

_WORK_DTYPE = torch.float64


def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(n, dtype=like.dtype, device=like.device)


def _inverse_lower(factor: torch.Tensor) -> torch.Tensor:
    """:math:`C^{-1}` of a lower-triangular ``factor`` (one triangular solve)."""
    return torch.linalg.solve_triangular(factor, _eye(factor.shape[-1], factor), upper=False)


def _sym(matrix: torch.Tensor) -> torch.Tensor:
    return 0.5 * (matrix + matrix.transpose(-1, -2))


# --------------------------------------------------------------------------- #
# The guide's parameters <-> C <-> S
# --------------------------------------------------------------------------- #


def covariance_factor(scale: torch.Tensor, unit_tril: torch.Tensor) -> torch.Tensor:
    """:math:`C = \\mathrm{diag}(s) L`, the lower Cholesky factor of :math:`\\Sigma`."""
    return scale.unsqueeze(-1) * unit_tril


def split_factor(factor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:math:`(s, L)` with :math:`C = \\mathrm{diag}(s) L`: ``scale = diag(C)``,
    ``scale_tril = C / scale[:, None]`` (unit diagonal, exactly)."""
    scale = factor.diagonal(dim1=-2, dim2=-1)
    unit_tril = (factor / scale.unsqueeze(-1)).tril(-1) + _eye(factor.shape[-1], factor)
    return scale.clone(), unit_tril


def precision(factor: torch.Tensor) -> torch.Tensor:
    """:math:`S = C^{-\\top} C^{-1}` (one triangular solve and one product)."""
    inverse = _inverse_lower(factor)
    return inverse.transpose(-1, -2) @ inverse


def precision_cholesky(precision_matrix: torch.Tensor) -> Optional[torch.Tensor]:
    """
    :math:`C = U^{-\\top}`, the lower Cholesky factor of :math:`\\Sigma = S^{-1}`,
    from the upper Cholesky factor :math:`U = P\\,\\mathrm{chol}(P S P)\\,P` of the
    precision :math:`S` (:math:`P` the reversal permutation); ``None`` when
    :math:`S` is not numerically positive definite.
    """
    reversed_factor, info = torch.linalg.cholesky_ex(precision_matrix.flip(-1, -2))
    if int(info) != 0:
        return None
    upper = reversed_factor.flip(-1, -2)  # S = U U^T
    # C = U^{-T}: solve U^T C = I with U^T lower triangular
    return _inverse_lower(upper.transpose(-1, -2))


# --------------------------------------------------------------------------- #
# Curvature from the gradient w.r.t. C (Price's theorem in Sigma)
# --------------------------------------------------------------------------- #


def factor_gradient(scale: torch.Tensor, unit_tril: torch.Tensor, scale_grad: torch.Tensor,
                    unit_tril_grad: torch.Tensor) -> torch.Tensor:
    """
    The gradient :math:`\\bar C` w.r.t. the lower triangle of
    :math:`C = \\mathrm{diag}(s) L` from the gradients w.r.t. :math:`s` and the
    strictly lower part of :math:`L`, the tensors ``SVI`` hands an optimizer:
    :math:`\\partial/\\partial L_{ij} = s_i \\bar C_{ij}` (:math:`i > j`) and
    :math:`\\partial/\\partial s_i = \\sum_{j \\le i} \\bar C_{ij} L_{ij}`, so

    .. math:: \\bar C_{ij} = \\bar L_{ij} / s_i \\; (i > j), \\qquad
              \\bar C_{ii} = \\bar s_i - \\sum_{j < i} \\bar C_{ij} L_{ij}.
    """
    strict = unit_tril_grad.tril(-1) / scale.unsqueeze(-1)
    diagonal = scale_grad - (strict * unit_tril).sum(-1)
    return strict + torch.diag_embed(diagonal)


def whitened_price_curvature(factor: torch.Tensor, factor_grad: torch.Tensor) -> torch.Tensor:
    """
    :func:`price_curvature` in the coordinates that whiten :math:`q`,
    :math:`C^\\top H C = \\Phi(M) + \\Phi(M)^\\top` (no inverse, one product).
    """
    inner = (factor.transpose(-1, -2) @ factor_grad).tril()
    inner.diagonal(dim1=-2, dim2=-1).mul_(0.5)
    return inner + inner.transpose(-1, -2)


#: The largest relative residual with which a factor gradient counts as one draw's
#: :math:`\mathrm{tril}(g\epsilon^\top)` (:func:`recovered_draw`): round-off, not a second draw
#: (whose residual is of order one). At least DRAW_RESIDUAL, and DRAW_RESIDUAL_ULPS machine
#: epsilons of the dtype the gradients were computed in: float32 gradients (Pyro's default) miss
#: 1e-8 by their own round-off, and one-draw steps of a float32 guide then went without the
#: control variate (a Bayesian logistic regression of D = 31 diverged: sds 70 times the prior's).
DRAW_RESIDUAL = 1e-8
DRAW_RESIDUAL_ULPS = 1e3


def recovered_draw(grad: torch.Tensor, factor_grad: torch.Tensor,
                   computed_in: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """
    :math:`\\epsilon` of the one draw :math:`u = \\mu + C\\epsilon` behind ``factor_grad``
    :math:`= \\mathrm{tril}(g\\epsilon^\\top)` (the entropy's term removed) and ``grad``
    :math:`g`: column :math:`j` holds :math:`g_i\\epsilon_j` for :math:`i \\ge j`, so
    :math:`\\epsilon_j = \\sum_{i \\ge j} g_i \\bar C_{ij} / \\sum_{i \\ge j} g_i^2`. ``None``
    where that does not reproduce ``factor_grad`` (a column without gradient, gradients
    of several draws) to ``DRAW_RESIDUAL`` or ``DRAW_RESIDUAL_ULPS`` of the dtype the
    gradients were ``computed_in`` (default: ``factor_grad``'s).
    """
    lower = factor_grad.tril()
    weights = grad.square().flip(-1).cumsum(-1).flip(-1)  # sum_{i >= j} g_i^2
    if not bool((weights > 0).all()):
        return None
    eps = (grad.unsqueeze(-1) * lower).sum(-2) / weights
    residual = (torch.outer(grad, eps).tril() - lower).norm()
    tolerance = max(DRAW_RESIDUAL, DRAW_RESIDUAL_ULPS * torch.finfo(computed_in or factor_grad.dtype).eps)
    if not bool(residual <= tolerance * lower.norm()):
        return None
    return eps


def controlled_price_statistics(factor: torch.Tensor, grad: torch.Tensor, whitened: torch.Tensor,
                                eps: torch.Tensor, level: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    One draw's statistics :math:`g` and :math:`W = C^\\top \\hat H C` with the control variate
    of the quadratic whose Hessian is :math:`c\\,S`, :math:`S = C^{-\\top}C^{-1}` the current
    precision and :math:`c` = ``level`` (a number from before the draw), at the same draw:
    its gradient :math:`cS(u - \\mu) = c\\,C^{-\\top}\\epsilon` and whitened Price estimate
    :math:`c\\,W_S` (mean :math:`cI`) subtracted, their means added back,

    .. math:: g' = g - c\\,C^{-\\top}\\epsilon, \\qquad W' = W - c\\,(W_S - I),

    unbiased for any target and any :math:`c`, and exact on a quadratic target of Hessian
    :math:`cS`: the full-covariance form of the mean-field :math:`h - c(\\epsilon^2 - 1)`.
    With :math:`c` the running level of the whitened curvature, :math:`\\mathrm{tr}(W)/D`,
    it tends to 1 as :math:`S` reaches the Hessian. Returns :math:`(g', W')`.
    """
    pulled = torch.linalg.solve_triangular(factor.transpose(-1, -2), eps.unsqueeze(-1), upper=True).squeeze(-1)
    # W_S = epsilon epsilon^T exactly (one_draw_whitened with C^T C^{-T} epsilon = epsilon): O(D^2)
    baseline = torch.outer(eps, eps) - _eye(factor.shape[-1], factor)
    return grad - level * pulled, whitened - level * baseline


def one_draw_whitened(factor: torch.Tensor, grad: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """
    :func:`whitened_price_curvature` of one draw's factor gradient
    :math:`\\bar C = \\mathrm{tril}(g\\epsilon^\\top)` in :math:`O(D^2)`: :math:`C^\\top` is upper
    triangular, so for :math:`i \\ge j`, :math:`(C^\\top \\bar C)_{ij} = \\sum_{k \\ge i} C_{ki} g_k
    \\epsilon_j = a_i \\epsilon_j` with :math:`a = C^\\top g`, and

    .. math:: C^\\top H C = \\Phi(a\\epsilon^\\top) + \\Phi(a\\epsilon^\\top)^\\top, \\qquad
              W_{ij} = a_{\\max(i,j)}\\,\\epsilon_{\\min(i,j)}

    (one matrix-vector product where the general form takes a matrix product). With
    :math:`g = S(u - \\mu) = C^{-\\top}\\epsilon`, :math:`a = \\epsilon` and :math:`W = \\epsilon\\epsilon^\\top`.
    """
    inner = torch.outer(factor.transpose(-1, -2) @ grad, eps).tril()
    inner.diagonal(dim1=-2, dim2=-1).mul_(0.5)
    return inner + inner.transpose(-1, -2)


def price_curvature(factor: torch.Tensor, factor_grad: torch.Tensor) -> torch.Tensor:
    """
    The symmetric :math:`H` whose :math:`\\tfrac12 H` is the gradient w.r.t.
    :math:`\\Sigma` of an objective whose gradient w.r.t. the lower Cholesky
    factor :math:`C` is ``factor_grad`` :math:`\\bar C` (:math:`\\bar C =
    \\mathrm{tril}(H C)`, solved for symmetric :math:`H` as in the reverse mode
    of the Cholesky decomposition [4]):

    .. math:: H = C^{-\\top} \\big(\\Phi(M) + \\Phi(M)^\\top\\big) C^{-1},
              \\qquad M = C^\\top \\bar C,

    :math:`\\Phi` the lower triangle with its diagonal halved. For an expected
    loss :math:`E_q[\\ell(\\mu + C\\epsilon)]` the gradient w.r.t. :math:`C` is
    :math:`\\mathrm{tril}\\,E[\\nabla\\ell\\,\\epsilon^\\top]` and Price's theorem
    [3] gives :math:`2\\nabla_\\Sigma E_q[\\ell] = E_q[\\nabla^2 \\ell]`: fed the
    particles' :math:`\\mathrm{tril}(g\\epsilon^\\top)`, :math:`H` is an unbiased
    estimate of the expected Hessian, with the same expectation as Stein's
    :math:`E[g\\epsilon^\\top] C^{-1}` (symmetrised) and exactly the mean-field
    :math:`g\\epsilon/\\sigma` on a diagonal :math:`C`. It needs only the lower
    triangle of :math:`E[g\\epsilon^\\top]`, which is all the gradients w.r.t.
    ``scale`` and ``scale_tril`` carry. The update uses its whitened form
    (:func:`whitened_price_curvature`).
    """
    return unwhiten(factor, whitened_price_curvature(factor, factor_grad))


def whiten(factor: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """:math:`C^\\top A C`: a precision-like matrix in the coordinates
    :math:`z = C^{-1}(u - \\mu)` in which :math:`q` is standard normal."""
    return factor.transpose(-1, -2) @ matrix @ factor


def unwhiten(factor: torch.Tensor, whitened: torch.Tensor) -> torch.Tensor:
    """:math:`C^{-\\top} W C^{-1}`, the inverse of :func:`whiten`."""
    inverse = _inverse_lower(factor)
    return inverse.transpose(-1, -2) @ whitened @ inverse
