"""
The Bayesian learning rule for mean-field Gaussians,
:math:`q(u) = \\mathcal{N}(\\mu, \\lambda^{-1})` element-wise, on flat vectors (VON /
VOGN, Khan et al. 2018, Osawa et al. 2019):

.. math::

    \\hat h &= \\lambda_0 + h / \\tau, \\qquad
    \\lambda' = (1 - \\beta)\\lambda + \\beta \\hat h
        \\;\\Big[+\\, \\tfrac{\\beta^2}{2\\lambda}(\\lambda - \\hat h)^2
        \\text{ where } \\hat h \\le 0 \\Big], \\\\
    \\bar g &\\leftarrow \\rho \\bar g + (1 - \\rho)\\, g / \\tau, \\qquad
    \\mu' = \\mu - \\alpha \\, \\frac{\\bar g + \\lambda_0 (\\mu - m_0)}{\\lambda' + \\gamma}.

The bracket is Lin et al.'s (2020) positivity correction, only where the target is
not positive, so that ``lr = beta = 1`` with exact positive curvature is one Newton
step. :math:`\\beta` and :math:`\\alpha` may be tensors (per-element step sizes of the
adaptive policy). The exact prior term stays out of the momentum (as in VOGN and IVON).
"""

from typing import Optional

import torch

from ..safeguards import clip_


def precision_target(curvature: torch.Tensor, prior_precision: Optional[torch.Tensor]) -> torch.Tensor:
    """:math:`\\hat h = \\lambda_0 + h/\\tau`, in place on ``curvature`` (already tempered)."""
    if prior_precision is not None:
        curvature.add_(prior_precision)
    return curvature


def precision_step(precision: torch.Tensor, target: torch.Tensor, beta, correct: bool = True,
                   out: Optional[torch.Tensor] = None, scratch=None) -> torch.Tensor:
    """
    :math:`\\lambda' = (1-\\beta)\\lambda + \\beta\\hat h`, plus Lin et al.'s correction
    :math:`\\tfrac{\\beta^2}{2\\lambda}(\\lambda - \\hat h)^2` where :math:`\\hat h \\le 0`
    (with ``correct``; a target known to be positive needs none). The corrected update is
    monotone in :math:`\\hat h` only down to :math:`\\hat h = (1 - 1/\\beta)\\lambda`, where
    it reaches its least value :math:`\\lambda/2`; below, a more negative target would give a
    *larger* precision (a target of :math:`-8\\lambda` at :math:`\\beta = 1/2` gives
    :math:`6.6\\lambda`), so a target is taken at most that far below (in place on ``target``):
    :math:`\\lambda' \\ge \\lambda/2`. Into ``out`` (default: a new tensor); ``scratch``: two
    buffers for the correction.
    """
    if correct:  # h <- max(h, (1 - 1/beta) lambda)
        work = scratch[0] if scratch is not None else None
        if isinstance(beta, torch.Tensor):  # (per-element steps)
            lowest = torch.sub(beta, 1.0, out=work).div_(beta).mul_(precision)
        else:
            lowest = torch.mul(precision, (beta - 1.0) / beta, out=work)
        target = torch.maximum(target, lowest, out=target)
    new_precision = torch.lerp(precision, target, beta, out=out)
    if not correct:
        return new_precision
    # (lambda - h) where h <= 0 (masked by 0 / 1 before it is squared: no inf * 0), squared
    work, flag = scratch if scratch is not None else (None, None)
    where = torch.le(target, 0, out=flag) if flag is not None else (target <= 0).to(target.dtype)
    square = torch.sub(precision, target, out=work).mul_(where).square_()
    if isinstance(beta, torch.Tensor):  # (per-element steps)
        return new_precision.addcdiv_(square.mul_(beta).mul_(beta), precision, value=0.5)
    return new_precision.addcdiv_(square, precision, value=beta**2 / 2)


def mean_step(mean, direction, pull, denominator, lr, out=None, scratch=None) -> torch.Tensor:
    """:math:`\\mu' = \\mu - \\alpha(\\bar g + \\lambda_0(\\mu - m_0))/(\\lambda' + \\gamma)`, with
    ``pull`` :math:`= \\lambda_0(\\mu - m_0)` (``None``: no conjugate prior; consumed) and
    ``lr`` a number or a tensor of per-element steps; into ``out`` (default: a new tensor),
    ``scratch`` a buffer for the step of per-element ``lr``."""
    numerator = direction if pull is None else pull.add_(direction)
    if isinstance(lr, torch.Tensor):
        step = torch.mul(numerator, lr, out=scratch).div_(denominator)
        return torch.sub(mean, step, out=out)
    return torch.addcdiv(mean, numerator, denominator, value=-lr, out=out)


def trusted_mean_step(mean, direction, pull, denominator, lr, radius, out=None, scratch=None,
                      low=None) -> torch.Tensor:
    """The mean step :math:`\\alpha(\\bar g + \\lambda_0(\\mu - m_0))/(\\lambda'+\\gamma)` clipped to
    ``radius`` (the trust region of sampled steps; consumed), or to the length of the prior's part
    :math:`\\alpha\\lambda_0|\\mu - m_0|/(\\lambda'+\\gamma)` where that is longer (an exact step: a mean
    far outside a tight prior is pulled in at once); into ``out`` (default: a new tensor),
    ``scratch`` a buffer for the step; ``low``: :math:`-` ``radius`` where the caller has it (one
    clamp, :func:`~pyro_ngvi.safeguards.clip_`). The whole step is clipped, so its fixed point is
    the rule's, :math:`\\bar g + \\lambda_0(\\mu - m_0) = 0`: with the likelihood's part clipped
    alone, the rule stopped where that clipped part met the prior's (a Normal mean under a prior of
    sd 0.1, 50 observations 30 prior sd away: 7.7 posterior sd short, for good)."""
    if pull is not None:  # radius <- max(radius, alpha |lambda_0 (mu - m_0)| / (lambda' + gamma))
        reach = torch.abs(pull, out=scratch).mul_(lr).div_(denominator)
        radius = torch.maximum(radius, reach, out=radius)
        low = None if low is None else torch.neg(radius, out=low)
        direction = pull.add_(direction)
    step = clip_(torch.mul(direction, lr, out=scratch).div_(denominator), radius, low)
    return torch.sub(mean, step, out=out)


def coupled_mean_step(step: torch.Tensor, denominator: torch.Tensor, off_diagonal: torch.Tensor,
                      radius: torch.Tensor, diagonal: Optional[torch.Tensor] = None) -> torch.Tensor:
    """
    The mean step of a few sites coupled by :math:`\\tilde H`, an estimate of the
    off-diagonal part of the Hessian (:func:`~pyro_ngvi.variance.cross_terms`): with
    :math:`D = \\mathrm{diag}(\\lambda' + \\gamma)` and the element-wise step
    :math:`\\delta = D^{-1}\\alpha r` this step took,

    .. math:: \\delta' = (D + \\tilde H)^{-1} D\\,\\delta,

    a Newton step on the mean where the element-wise one is a Jacobi iteration (on a
    quadratic log joint with :math:`\\tilde H` exact and :math:`\\alpha = 1`, the exact
    mean in one step). Its fixed point is the same (:math:`\\delta' = 0` iff
    :math:`\\delta = 0`): the mean-field optimum. Clipped to ``radius`` element-wise (the
    trust region). Where the regression's own ``diagonal`` :math:`\\hat H_{ii}` is given,
    :math:`\\max(D, \\mathrm{diag}\\,\\hat H) + \\tilde H` takes the place of :math:`D + \\tilde H`:
    near a singular :math:`H` (latents seen only in a combination: a 4-vector observed through its
    sum has :math:`H_{ii} = 32.25`, :math:`H_{ij} = 32`, its smallest eigenvalue 0.25) the
    precision's noise below :math:`H_{ii}` makes :math:`D + \\tilde H` indefinite (and the
    element-wise step it would fall back to leaves the directions only the prior holds all but
    still) or, 0.4 below, positive definite with a smallest eigenvalue of 0.016: a step 12 times
    the Newton step's length (several particles' steps jumped 1.5-3 sd off the optimum, once
    converged). The lifted matrix is :math:`\\hat H + \\Delta`, :math:`\\Delta \\succeq 0` diagonal, so
    with :math:`\\hat H \\succ 0` the step cannot overshoot the Newton step of :math:`\\hat H`:
    :math:`(D\\delta)^\\top (\\hat H + \\Delta)^{-1} D\\delta \\le (D\\delta)^\\top \\hat H^{-1} D\\delta`.
    Where it is not positive definite, :math:`\\delta`.
    """
    lifted = denominator if diagonal is None else torch.maximum(denominator, diagonal)
    factor, info = torch.linalg.cholesky_ex(off_diagonal + torch.diag(lifted))
    coupled = torch.cholesky_solve((denominator * step).unsqueeze(-1), factor).squeeze(-1)
    coupled = torch.minimum(torch.maximum(coupled, -radius), radius)
    usable = (info == 0) & torch.isfinite(coupled).all() & off_diagonal.any()
    return torch.where(usable, coupled, step)


def momentum(grad: torch.Tensor, old: Optional[torch.Tensor], rho: float, started: Optional[torch.Tensor] = None,
             mask: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
             scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """
    :math:`\\bar g \\leftarrow \\rho \\bar g + (1 - \\rho) g` from the ``old`` average
    (``None``: a first step, which takes g); where ``started`` (0 / 1) is given, only its
    elements average (the others take g); else, where ``mask`` is, only its rows change.
    ``out``: where the new average goes (it may be ``old`` itself: updated in place;
    default: a new tensor); ``scratch``: a buffer for the average of a masked step.
    """
    if old is None:
        return grad if out is None else out.copy_(grad)
    if started is not None:  # (0 / 1: where started the average, else g)
        new = torch.lerp(grad, old, rho, out=out)
        return torch.lerp(grad, new, started, out=out)
    if mask is not None:
        new = torch.lerp(grad, old, rho, out=scratch)
        return torch.where(mask, new, old, out=out)
    return torch.lerp(grad, old, rho, out=out)
