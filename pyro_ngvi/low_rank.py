"""
The natural-gradient algebra of a Gaussian with a low-rank-plus-diagonal *precision*,

.. math:: q(u) = \\mathcal{N}(\\mu, S^{-1}), \\qquad S = U U^\\top + \\mathrm{diag}(d),
          \\qquad U \\in \\mathbb{R}^{D \\times k}, \\; d > 0,

the family of SLANG [1], which is closed under the natural-gradient step up to a projection
that keeps the diagonal exact. One step of the Bayesian learning rule moves the precision,

.. math:: \\hat S = (1 - \\beta) S + \\beta (S_0 + \\hat H)
          = \\underbrace{(1-\\beta) U U^\\top + \\beta \\hat H}_{L}
            + (1 - \\beta)\\,\\mathrm{diag}(d) + \\beta S_0,

with :math:`S_0` a diagonal prior precision and :math:`\\hat H` a curvature estimate held as
low-rank factors, :math:`\\hat H = G_+ G_+^\\top - G_- G_-^\\top` (:math:`G_-` empty for
per-example gradient outer products, SLANG's :math:`GG^\\top`; both for a Price estimate,
:func:`price_factors`) or as a dense symmetric matrix at small :math:`D`. The step keeps the
top-:math:`k` eigen-pairs of :math:`L`, :math:`U' = Q_k \\Lambda_k^{1/2}` (negative
eigenvalues clipped), and matches the diagonal,

.. math:: d' = (1-\\beta) d + \\beta\\,\\mathrm{diag}(S_0) + \\mathrm{diag}(L) - \\mathrm{diag}(U'U'^\\top),

so :math:`\\mathrm{diag}(S') = \\mathrm{diag}(\\hat S)` exactly for any rank, and
:math:`S' = \\hat S` when nothing is discarded (rank :math:`D`, or :math:`\\hat S` of rank
at most :math:`k` plus diagonal). The mean takes the Newton-like step

.. math:: \\mu' = \\mu - \\alpha\\, (S' + \\gamma I)^{-1} \\big(g + S_0(\\mu - m_0)\\big),

solved by Woodbury in :math:`O(Dk^2)`. The eigen-pairs of :math:`L = B J B^\\top`
(:math:`B = [\\sqrt{1-\\beta}U, \\sqrt\\beta G_+, \\sqrt\\beta G_-]`, :math:`J` the signs) are
exact and cost :math:`O(D r^2)`, :math:`r = k + M_+ + M_-`: a thin QR of :math:`B` and the
eigen-decomposition of the :math:`r \\times r` matrix :math:`R J R^\\top` (no Lanczos, no
random probes). Sampling needs no square root of :math:`S^{-1}`: with
:math:`\\epsilon \\sim \\mathcal{N}(0, I_D)`, :math:`\\xi \\sim \\mathcal{N}(0, I_k)`,
:math:`x = d^{1/2}\\epsilon + U\\xi` has covariance :math:`S`, so :math:`S^{-1}x` has
covariance :math:`S^{-1}` (:func:`displacement`).

Pure functions of tensors, computed in float64 and returned in the caller's dtype.

**References**

[1] `SLANG: Fast Structured Covariance Approximations for Bayesian Deep Learning with Natural Gradient`,
    Aaron Mishkin, Frederik Kunstner, Didrik Nielsen, Mark Schmidt,
    Mohammad Emtiyaz Khan (NeurIPS 2018)
[2] `The Variational Gaussian Approximation Revisited`, Manfred Opper, Cedric Archambeau
    (Neural Computation 2009)
"""

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "LowRankStep",
    "bounded_change",
    "capacitance_cholesky",
    "controlled_price_factors",
    "displacement",
    "log_det",
    "low_rank_step",
    "marginal_variance",
    "precision_matvec",
    "price_factors",
    "project",
    "solve",
]

_WORK = torch.float64


class LowRankStep(NamedTuple):
    """The result of :func:`low_rank_step`: the new :math:`\\mu`, :math:`U`, :math:`d`, and
    where the diagonal was kept at its positive part (``clamped``, a bool tensor of shape
    ``(D,)``)."""

    mean: torch.Tensor
    factor: torch.Tensor
    diag: torch.Tensor
    clamped: torch.Tensor


# --------------------------------------------------------------------------- #
# S = U U^T + diag(d): products, solves, determinants, draws
# --------------------------------------------------------------------------- #


def precision_matvec(factor: torch.Tensor, diag: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:math:`S v` for ``v`` of shape ``(..., D)``."""
    return diag * v + (v @ factor) @ factor.transpose(-1, -2)


def capacitance_cholesky(factor: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
    """The lower Cholesky factor of :math:`I_k + U^\\top \\mathrm{diag}(d)^{-1} U` (all its
    eigenvalues are at least 1: always well conditioned)."""
    k = factor.shape[-1]
    capacitance = torch.eye(k, dtype=factor.dtype, device=factor.device) + (factor / diag[:, None]).T @ factor
    return torch.linalg.cholesky(capacitance)


def solve(factor: torch.Tensor, diag: torch.Tensor, v: torch.Tensor, tril: Optional[torch.Tensor] = None
          ) -> torch.Tensor:
    """
    :math:`S^{-1} v` for ``v`` of shape ``(..., D)``, by Woodbury:
    :math:`S^{-1} = D^{-1} - D^{-1} U (I + U^\\top D^{-1} U)^{-1} U^\\top D^{-1}`.

    :param tril: :func:`capacitance_cholesky` of ``(factor, diag)``, if at hand.
    """
    tril = capacitance_cholesky(factor, diag) if tril is None else tril
    scaled = v / diag
    inner = torch.cholesky_solve((scaled @ factor).unsqueeze(-1), tril).squeeze(-1)
    return scaled - (inner @ factor.transpose(-1, -2)) / diag


def log_det(factor: torch.Tensor, diag: torch.Tensor, tril: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:math:`\\log\\det S = \\sum \\log d + \\log\\det(I + U^\\top D^{-1} U)` (determinant lemma)."""
    tril = capacitance_cholesky(factor, diag) if tril is None else tril
    return diag.log().sum(-1) + 2 * tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def marginal_variance(factor: torch.Tensor, diag: torch.Tensor, tril: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """:math:`\\mathrm{diag}(S^{-1}) = 1/d - \\mathrm{rowsum}\\big((D^{-1}U L^{-\\top})^2\\big)`."""
    tril = capacitance_cholesky(factor, diag) if tril is None else tril
    rows = torch.linalg.solve_triangular(tril, (factor / diag[:, None]).T, upper=False)  # (k, D)
    return diag.reciprocal() - rows.pow(2).sum(0)


def displacement(factor: torch.Tensor, diag: torch.Tensor, eps: torch.Tensor, xi: torch.Tensor,
                 tril: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:math:`z = S^{-1}(d^{1/2}\\epsilon + U\\xi)` for standard normal ``eps`` ``(..., D)`` and
    ``xi`` ``(..., k)``: a draw of :math:`\\mathcal{N}(0, S^{-1})`, differentiable in
    :math:`U` and :math:`d` (only a :math:`k \\times k` Cholesky factor)."""
    return solve(factor, diag, diag.sqrt() * eps + xi @ factor.transpose(-1, -2), tril)


def price_factors(factor: torch.Tensor, diag: torch.Tensor, displacements: torch.Tensor,
                  grads: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    The Price (Stein) estimate of the expected Hessian of :math:`f` from draws
    :math:`u_m = \\mu + z_m` and gradients :math:`g_m = \\nabla f(u_m)` (both ``(M, D)``),
    :math:`\\mathbb{E}[\\nabla^2 f] = S\\,\\mathbb{E}[z \\nabla f^\\top]` [2], symmetrised,
    as low-rank factors: with :math:`a_m = S z_m`,

    .. math:: \\hat H = \\frac{1}{2M}\\sum_m (a_m g_m^\\top + g_m a_m^\\top)
              = G_+ G_+^\\top - G_- G_-^\\top, \\quad
              G_\\pm = \\frac{a \\pm g}{2\\sqrt{M}}.

    :returns: ``(plus, minus)``, each of shape ``(D, M)``.
    """
    count = grads.shape[0]
    a = precision_matvec(factor, diag, displacements)
    return ((a + grads) / (2 * count**0.5)).T, ((a - grads) / (2 * count**0.5)).T


def controlled_price_factors(precision_displacement: torch.Tensor, grad: torch.Tensor,
                             level: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    One draw's gradient and Price factors (:func:`price_factors`) with the control variate of
    the quadratic whose Hessian is :math:`cS` (:math:`c` = ``level``, a number from before
    the draw) at the same draw :math:`z`: its gradient :math:`c\\,a`, :math:`a = Sz`, and its
    Price estimate :math:`c\\,aa^\\top` subtracted, their means (0 and :math:`cS`) added back,

    .. math:: g' = g - c\\,a, \\qquad
              \\hat H' = \\hat H - c\\,(aa^\\top - S) = \\tfrac12 (a g'^\\top + g' a^\\top) + cS,

    unbiased for any :math:`c`, and exact on a quadratic target whose Hessian is :math:`cS`: the
    low-rank form of :func:`~pyro_ngvi.full_covariance.controlled_price_statistics`. The
    :math:`cS` goes to the step as its ``level`` (:func:`project`). Takes
    ``precision_displacement`` :math:`a` (the sum of :func:`price_factors`' two columns, or
    :func:`precision_matvec`); returns ``(g', plus, minus)``, the factors of
    :math:`\\tfrac12 (a g'^\\top + g' a^\\top)`.
    """
    a = precision_displacement
    controlled = grad - level * a
    return controlled, ((a + controlled) / 2).unsqueeze(-1), ((a - controlled) / 2).unsqueeze(-1)


# --------------------------------------------------------------------------- #
# The step
# --------------------------------------------------------------------------- #


def _top_eigen(columns: torch.Tensor, signs: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` largest eigen-pairs of :math:`B J B^\\top` (``columns`` :math:`B`, ``signs``
    the diagonal of :math:`J`): thin QR :math:`B = QR`, then the eigen-pairs of :math:`RJR^\\top`."""
    q, r = torch.linalg.qr(columns, mode="reduced")
    values, vectors = torch.linalg.eigh((r * signs) @ r.T)
    keep = values.argsort(descending=True)[:rank]
    return values[keep], q @ vectors[:, keep]


def bounded_change(factor: torch.Tensor, diag: torch.Tensor, kept: float, plus: torch.Tensor,
                   minus: torch.Tensor, max_ratio: float) -> Tuple[float, torch.Tensor, torch.Tensor]:
    """
    The trust region of the precision: :math:`\\hat S = k S + P P^\\top - M M^\\top` (``kept``
    :math:`k`, ``plus`` :math:`P`, ``minus`` :math:`M`) shortened towards :math:`S` until every
    generalised eigenvalue :math:`\\lambda` of :math:`(\\hat S, S)` lies in :math:`[1/r, r]`,
    :math:`r` = ``max_ratio``. With :math:`G = [P, M]`, :math:`J` the signs and :math:`A = G^\\top S^{-1} G =
    V a V^\\top`, :math:`A^{1/2} J A^{1/2} = Q \\ell Q^\\top` gives :math:`PP^\\top - MM^\\top
    = F \\ell F^\\top` with :math:`F = G V a^{-1/2} V^\\top Q` and :math:`F^\\top S^{-1} F = I`:
    the eigenvalues are :math:`k` (all but :math:`m` directions) and :math:`k + \\ell_j`. The step
    :math:`\\hat S - S` is scaled by the largest :math:`t \\le 1` that keeps every :math:`1 + t(\\lambda - 1)`
    in the bounds, :math:`t = \\min(1, (r - 1)/(\\lambda_{\\max} - 1), (1 - 1/r)/(1 - \\lambda_{\\min}))`
    (each bound only where it applies), the same as a step :math:`\\beta' = t\\beta`:

    .. math:: \\hat S_r = \\bar k S + t\\,F \\ell F^\\top, \\qquad \\bar k = 1 + t(k - 1),

    in :math:`O(D k m + m^3)`. Returns :math:`\\bar k` and the new ``(plus, minus)``. Clamping each
    eigenvalue on its own instead turned one-draw Price targets, noise far above the signal, into a
    random walk of the log precision (:math:`\\pm\\log r` a step): at rank D = 100 on a correlated
    regression the mean froze 42-49 posterior sd off after 2,000 steps.

    :raises torch.linalg.LinAlgError: when :math:`A` overflows (the step is skipped).
    """
    columns = torch.cat([plus, minus], 1)
    signs = torch.cat([plus.new_ones(plus.shape[1]), -plus.new_ones(minus.shape[1])])
    inner = columns.T @ solve(factor, diag, columns.T).T  # A = G^T S^-1 G
    if not bool(torch.isfinite(inner).all()):  # (an overflow would drop the curvature unseen)
        raise torch.linalg.LinAlgError("the curvature's factors overflow against the precision")
    values, vectors = torch.linalg.eigh(0.5 * (inner + inner.T))
    live = values > values.max().clamp_min(0) * columns.shape[1] * torch.finfo(_WORK).eps
    values, vectors = values[live], vectors[:, live]
    root = (vectors * values.sqrt()) @ vectors.T  # A^1/2
    ell, q = torch.linalg.eigh((root * signs) @ root)
    directions = columns @ ((vectors * values.rsqrt()) @ vectors.T @ q)  # F
    eigenvalues = kept + ell
    if ell.shape[0] < factor.shape[0]:  # (the bulk: the directions the curvature leaves alone)
        eigenvalues = torch.cat([eigenvalues, eigenvalues.new_tensor([kept])])
    largest, smallest = float(eigenvalues.max()), float(eigenvalues.min())
    scale = 1.0
    if largest > max_ratio:
        scale = min(scale, (max_ratio - 1) / (largest - 1))
    if smallest < 1 / max_ratio:
        scale = min(scale, (1 - 1 / max_ratio) / (1 - smallest))
    change = scale * ell
    return 1 + scale * (kept - 1), directions * change.clamp_min(0).sqrt(), directions * (-change).clamp_min(0).sqrt()


def project(factor: torch.Tensor, diag: torch.Tensor, beta: float,
            curvature_factor: Optional[torch.Tensor] = None,
            negative_factor: Optional[torch.Tensor] = None,
            curvature: Optional[torch.Tensor] = None,
            prior_precision: Optional[torch.Tensor] = None,
            level: float = 0.0, max_ratio: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    The new precision :math:`S' = U'U'^\\top + \\mathrm{diag}(d')` of the step (module
    docstring), of the rank of ``factor``, from :math:`\\hat H = G_+G_+^\\top - G_-G_-^\\top`
    (``curvature_factor`` :math:`G_+` and ``negative_factor`` :math:`G_-`, ``(D, M)``) or a
    dense symmetric ``curvature`` ``(D, D)``, plus ``level`` :math:`c \\ge 0` times the current
    precision (the mean a control variate adds back, :func:`controlled_price_factors`): the
    current :math:`U` and :math:`d` then enter with weight :math:`1 - \\beta + \\beta c`.

    With ``max_ratio`` (factors only) the change of :math:`(1-\\beta+\\beta c) S + \\beta \\hat H`
    is first bounded by :func:`bounded_change`.

    :returns: ``(factor, diag, clamped)``: where a discarded negative direction left the
        matched diagonal below :math:`(1-\\beta)d + \\beta\\,\\mathrm{diag}(S_0)` (its part that
        is positive by construction), it is kept there and ``clamped`` says so.
    """
    if max_ratio is not None and curvature is not None:
        raise ValueError("max_ratio bounds a curvature given as factors, not a dense curvature")
    dtype = factor.dtype
    u, d = factor.to(_WORK), diag.to(_WORK)
    rank = u.shape[1]
    prior = torch.zeros_like(d) if prior_precision is None else prior_precision.to(_WORK).expand_as(d)
    kept = 1 - beta + beta * level
    if curvature is not None:
        low_rank = kept * u @ u.T + beta * curvature.to(_WORK)
        low_rank = 0.5 * (low_rank + low_rank.T)
        values, vectors = torch.linalg.eigh(low_rank)
        keep = values.argsort(descending=True)[:rank]
        values, vectors = values[keep], vectors[:, keep]
        diag_low_rank = low_rank.diagonal()
    else:
        plus, minus = (torch.zeros_like(u[:, :0]) if block is None else beta**0.5 * block.to(_WORK)
                       for block in (curvature_factor, negative_factor))
        if max_ratio is not None:
            kept, plus, minus = bounded_change(u, d, kept, plus, minus, max_ratio)
        columns = torch.cat([kept ** 0.5 * u, plus, minus], 1)
        signs = torch.cat([u.new_ones(rank + plus.shape[1]), -u.new_ones(minus.shape[1])])
        values, vectors = _top_eigen(columns, signs, rank)
        diag_low_rank = (columns.pow(2) * signs).sum(1)
    new_factor = vectors * values.clamp_min(0).sqrt()
    if new_factor.shape[1] < rank:  # fewer directions than the rank: pad with zeros
        new_factor = torch.cat([new_factor, new_factor.new_zeros(u.shape[0], rank - new_factor.shape[1])], 1)
    positive = kept * d + beta * prior
    new_diag = positive + diag_low_rank - new_factor.pow(2).sum(1)
    floor = torch.where(positive > 0, positive, d * torch.finfo(_WORK).eps)
    clamped = new_diag < floor
    new_diag = torch.where(clamped, floor, new_diag)
    return new_factor.to(dtype), new_diag.to(dtype), clamped


def low_rank_step(mean: torch.Tensor, factor: torch.Tensor, diag: torch.Tensor, grad: torch.Tensor,
                  lr: float, beta: float,
                  curvature_factor: Optional[torch.Tensor] = None,
                  negative_factor: Optional[torch.Tensor] = None,
                  curvature: Optional[torch.Tensor] = None,
                  prior_precision: Optional[torch.Tensor] = None,
                  prior_loc: Optional[torch.Tensor] = None,
                  damping: float = 0.0, level: float = 0.0, max_ratio: Optional[float] = None,
                  max_step: Optional[float] = None) -> LowRankStep:
    """
    One natural-gradient step of :math:`q(u) = \\mathcal{N}(\\mu, (UU^\\top + \\mathrm{diag}(d))^{-1})`
    (module docstring): state in, state out, nothing written.

    :param mean: :math:`\\mu`, ``(D,)``.
    :param factor: :math:`U`, ``(D, k)``.
    :param diag: :math:`d > 0`, ``(D,)``.
    :param grad: :math:`g`, the gradient of the non-conjugate part of the negative log joint
        at the draw (or the mean), ``(D,)``.
    :param float lr: :math:`\\alpha > 0`.
    :param float beta: :math:`\\beta \\in (0, 1]`.
    :param curvature_factor: :math:`G_+` of :math:`\\hat H` (``(D, M)``), e.g. per-example
        gradients scaled to the data size (SLANG's :math:`GG^\\top`), or from
        :func:`price_factors`.
    :param negative_factor: :math:`G_-` (``(D, M)``), from :func:`price_factors`.
    :param curvature: a dense symmetric :math:`\\hat H` ``(D, D)`` instead (small :math:`D`).
    :param prior_precision: the diagonal :math:`S_0` of a conjugate Normal prior (``(D,)``),
        or ``None`` (the prior is inside ``grad`` and the curvature).
    :param prior_loc: its mean :math:`m_0` (default: zero).
    :param float damping: :math:`\\gamma \\ge 0`, added to the precision in the mean step only.
    :param float level: :math:`c \\ge 0`, the share of the current precision the curvature
        holds besides its factors (:func:`controlled_price_factors`; default 0).
    :param max_ratio: the trust region of the precision, :func:`bounded_change` (default: none).
    :param max_step: the trust region of the mean: the step :math:`\\delta` is shortened to
        :math:`\\sqrt{\\delta^\\top S \\delta} \\le` ``max_step``, a ball in the current guide's
        standard deviations (default: none).
    """
    if not 0 < beta <= 1:
        raise ValueError(f"beta must lie in (0, 1], got {beta!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if (curvature is None) == (curvature_factor is None and negative_factor is None):
        raise ValueError("give the curvature either as factors (curvature_factor, negative_factor) or "
                         "dense (curvature), not both or neither")
    if not level >= 0:
        raise ValueError(f"level must be non-negative, got {level!r}")
    new_factor, new_diag, clamped = project(factor, diag, beta, curvature_factor, negative_factor, curvature,
                                            prior_precision, level, max_ratio)
    direction = grad.to(_WORK)
    if prior_precision is not None:
        centre = mean.to(_WORK) - (0.0 if prior_loc is None else prior_loc.to(_WORK))
        direction = direction + prior_precision.to(_WORK) * centre
    step = lr * solve(new_factor.to(_WORK), new_diag.to(_WORK) + damping, direction)
    if max_step is not None:
        length = (step @ precision_matvec(factor.to(_WORK), diag.to(_WORK), step)).sqrt()
        step = step * (max_step / length).clamp(max=1.0)
    new_mean = (mean.to(_WORK) - step).to(mean.dtype)
    return LowRankStep(new_mean, new_factor, new_diag, clamped)
