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
:func:`natural_step`). Getting from :math:`S` back to :math:`C` needs a
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

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "FullStep",
    "covariance_factor",
    "factor_gradient",
    "natural_step",
    "precision",
    "precision_cholesky",
    "price_curvature",
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


# --------------------------------------------------------------------------- #
# The step
# --------------------------------------------------------------------------- #


class FullStep(NamedTuple):
    """A computed, not yet written, full-covariance step."""

    mean: torch.Tensor
    factor: torch.Tensor  # lower Cholesky factor C' of the new covariance
    corrected: bool  # the positivity correction was added


def _upper_cholesky(matrix: torch.Tensor) -> Optional[torch.Tensor]:
    """:math:`U` upper triangular with ``matrix`` :math:`= U U^\\top` (by the reversal
    permutation), or ``None`` when it is not numerically positive definite."""
    reversed_factor, info = torch.linalg.cholesky_ex(matrix.flip(-1, -2))
    return None if int(info) != 0 else reversed_factor.flip(-1, -2)


@torch.no_grad()
def natural_step(
    mean: torch.Tensor,
    factor: torch.Tensor,
    direction: torch.Tensor,
    curvature: torch.Tensor,
    lr: float,
    beta: float,
    tau: float = 1.0,
    damping: float = 0.0,
    prior_loc: Optional[torch.Tensor] = None,
    prior_precision: Optional[torch.Tensor] = None,
    max_step: Optional[float] = None,
    warm: bool = False,
    whitened: bool = False,
    by_direction: bool = False,
    max_ratio: Optional[float] = None,
) -> Optional[FullStep]:
    """
    One step of the Bayesian learning rule on :math:`q = \\mathcal{N}(\\mu, S^{-1})`
    with :math:`S = C^{-\\top}C^{-1}`:

    .. math::

        \\hat H &= S_0 + H / \\tau, \\qquad
        S' = (1 - \\beta) S + \\beta \\hat H
            \\;\\Big[+\\, \\tfrac{\\beta^2}{2} (S - \\hat H) S^{-1} (S - \\hat H)
            \\text{ if } \\hat H \\not\\succ 0 \\Big], \\\\
        \\mu' &= \\mu - \\alpha\\, (S' + \\gamma I)^{-1}
            \\big(\\bar g + S_0 (\\mu - m_0)\\big).

    The bracket is Lin et al.'s correction [2]: it keeps :math:`S'` positive
    definite for any symmetric target and is added only when :math:`\\hat H` is
    not positive definite (a Cholesky attempt), so that ``lr = beta = 1`` with
    positive-definite exact curvature is a Newton step.

    **In whitened coordinates.** The step is computed in the coordinates
    :math:`z = C^{-1}(u - \\mu)` where :math:`S` is the identity: with
    :math:`W = C^\\top \\hat H C`,

    .. math:: S'_w = (1 - \\beta) I + \\beta W
              \\;\\big[+\\, \\tfrac{\\beta^2}{2} (I - W)^2\\big], \\qquad
              S' = C^{-\\top} S'_w C^{-1},

    and with :math:`S'_w = U_w U_w^\\top` (:math:`U_w` upper triangular, by the
    reversal permutation) the new factor is :math:`C' = C\\,U_w^{-\\top}`, lower
    triangular: :math:`C' C'^\\top = C S_w'^{-1} C^\\top = S'^{-1}`. One Cholesky
    factorisation, one triangular inverse and a few products; no inverse of
    :math:`S`, and the Price curvature of :func:`whitened_price_curvature` needs no
    inverse either.

    **Warm start** (``warm``, a site's first step): the matrix form of the
    mean-field rule "take the target where it exceeds the current precision". With
    :math:`W = V \\Lambda V^\\top`, generalised eigen-directions with
    :math:`\\lambda_k > 1` take :math:`\\lambda_k` (``beta = 1``), the others the
    step above, :math:`(1-\\beta) + \\beta\\lambda_k [+ \\tfrac{\\beta^2}{2}(1 -
    \\lambda_k)^2]`.

    **Trust region** (``max_step``, for sampled curvature): the likelihood part
    of the mean step is clipped in the coordinates that whiten the current
    :math:`q`, :math:`z = C^{-1}\\delta`, to :math:`|z_k| \\le` ``max_step``: on a
    diagonal :math:`C` the mean-field rule "at most ``max_step`` standard
    deviations per element". The prior's pull is not clipped.

    :param mean: :math:`\\mu`, shape ``(D,)``.
    :param factor: :math:`C`, shape ``(D, D)``, lower triangular.
    :param direction: :math:`\\bar g`, the (momentum-averaged, tempered) gradient
        of the non-conjugate part, shape ``(D,)``.
    :param curvature: :math:`H`, symmetric ``(D, D)`` (symmetrised here), or
        :math:`C^\\top H C` with ``whitened``.
    :param float lr: :math:`\\alpha`.
    :param float beta: :math:`\\beta`.
    :param float tau: :math:`\\tau`, divides ``curvature`` (``direction`` is
        already tempered) (default: 1).
    :param float damping: :math:`\\gamma` (default: 0).
    :param prior_loc: :math:`m_0` ``(D,)`` of a conjugate Gaussian prior, or None.
    :param prior_precision: :math:`S_0` ``(D, D)``, or None.
    :param max_step: trust radius in whitened coordinates, or None (default).
    :param bool warm: the warm start above (default: False).
    :param bool whitened: ``curvature`` is :math:`C^\\top H C` (default: False).
    :param bool by_direction: add the correction only in the eigen-directions of
        :math:`W` whose eigenvalue is not positive, :math:`(1-\\beta) + \\beta\\lambda_k
        + \\tfrac{\\beta^2}{2}(1-\\lambda_k)^2` there and :math:`(1-\\beta) + \\beta\\lambda_k
        > 0` elsewhere (positive definite all the same; the correction's upward bias stays
        out of the directions that need none) (default: False).
    :param max_ratio: trust region of the precision: each eigenvalue of :math:`S'_w` is
        clamped to ``[1 / max_ratio, max_ratio]`` (default: None, none).
    :returns: a :class:`FullStep`, or ``None`` when the new precision is not
        numerically positive definite (the caller skips the step).
    """
    dtype = mean.dtype
    mean, factor, direction, curvature = (
        t.to(_WORK_DTYPE) for t in (mean, factor, direction, curvature)
    )
    size = mean.shape[-1]
    identity = _eye(size, mean)
    target = _sym(curvature if whitened else whiten(factor, curvature)) / tau  # W
    if prior_precision is not None:
        prior_precision = prior_precision.to(_WORK_DTYPE)
        target = target + _sym(whiten(factor, prior_precision))
    corrected = int(torch.linalg.cholesky_ex(target)[1]) != 0  # the target is not PD
    if warm or (corrected and by_direction) or max_ratio is not None:
        eigenvalues, vectors = torch.linalg.eigh(target)
        moved = (1 - beta) + beta * eigenvalues
        if corrected:
            correction = 0.5 * beta**2 * (1 - eigenvalues).square()
            moved = moved + (torch.where(eigenvalues > 0, 0.0, correction) if by_direction else correction)
        if warm:
            moved = torch.where(eigenvalues > 1, eigenvalues, moved)
        if max_ratio is not None:
            moved = moved.clamp(1 / max_ratio, max_ratio)
        new_whitened = (vectors * moved) @ vectors.T
    else:
        new_whitened = torch.lerp(identity, target, beta)
        if corrected:
            gap = identity - target
            new_whitened = new_whitened + 0.5 * beta**2 * (gap @ gap)
    new_whitened = _sym(new_whitened)
    upper = _upper_cholesky(new_whitened)
    if upper is None:
        return None
    new_factor = factor @ _inverse_lower(upper.T)  # C U_w^{-T}
    if damping:
        upper = _upper_cholesky(new_whitened + damping * (factor.T @ factor))
        if upper is None:
            return None
        damped = factor @ _inverse_lower(upper.T)
    else:
        damped = new_factor

    def solve(vector):  # (S' + gamma I)^{-1} v = C_d C_d^T v
        return damped @ (damped.T @ vector)

    step = lr * solve(direction)
    if max_step is not None:
        whitened_step = torch.linalg.solve_triangular(factor, step.unsqueeze(-1), upper=False)
        step = factor @ whitened_step.squeeze(-1).clamp_(-max_step, max_step)
    new_mean = mean - step
    if prior_precision is not None:
        new_mean = new_mean - lr * solve(prior_precision @ (mean - prior_loc.to(_WORK_DTYPE)))
    return FullStep(new_mean.to(dtype), new_factor.to(dtype), corrected)
