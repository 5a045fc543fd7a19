"""
Variance reduction of sampled (Price) statistics where the draws are known:
control variates of mean zero subtracted from :math:`\\hat g = g/\\tau` and
:math:`\\hat h = h/\\tau` (Miller et al. 2017). With :math:`u = \\mu + \\sigma\\epsilon`,

.. math:: \\hat g \\leftarrow \\hat g - c\\,\\sigma\\bar\\epsilon - \\tilde H\\sigma\\bar\\epsilon, \\qquad
          \\hat h \\leftarrow \\hat h - b\\,\\bar\\epsilon/\\sigma - c\\,(\\overline{\\epsilon^2} - 1)
          - \\bar\\epsilon \\odot (\\tilde H \\sigma\\bar\\epsilon)/\\sigma,

:math:`c = \\lambda - \\lambda_0` the diagonal curvature the precision stands for,
:math:`b` the running mean of :math:`\\hat g`, :math:`\\tilde H` the off-diagonal slope
of a regression of past gradients on past draw points (:func:`cross_terms`, small
models only). None of them depends on this step's draws, so the estimates stay
unbiased; where the log joint is quadratic they are exact, with no Monte-Carlo floor.
A full-covariance site's one-draw statistics take the matrix form of the same control
variate (:func:`dense_control_variate`).

**References**

[1] `Reducing Reparameterization Gradient Variance`, Andrew C. Miller, Nicholas J.
    Foti, Alexander D'Amour, Ryan P. Adams (NeurIPS 2017)
"""

from dataclasses import replace
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from . import full_covariance, low_rank
from .family import GaussianSite, SiteCurvature
from .groups import flat
from .state import CROSS_LEGACY

#: The cross terms run where the mean-field sites with known draws have at most this many
#: elements together (the state holds two D x D matrices); with more, only the diagonal
#: control variate runs (no D x D anything).
CROSS_MAX = 64
#: The regression of g on the draw points weights the newest step 1/n, and at least this
#: much (a memory of about 100 steps where the log joint is not quadratic; on a quadratic
#: one the slope is exact whatever the weights).
CROSS_RATE = 0.01
#: The regression restarts where its line misses a step's g by more than CROSS_MISFIT current
#: sds (the miss times sigma; 0 on a quadratic log joint; tests/test_wide_start.py).
CROSS_MISFIT = 100.0
#: The regression's own diagonal stands in for a precision below it in the coupled step only
#: where its line met this step's g within CROSS_FIT current sds: a log joint quadratic here (the
#: miss is then 0 up to rounding). On a funnel's heavy tails the slope is noise, and a looser 1 sd
#: let it take s 1 sd further astray (benchmarks/funnel.py under CurvatureELBO with 8 draws).
CROSS_FIT = 0.01
#: Where the draws are several particles' means, the cross terms run only while the regression's line
#: met this step's g within CROSS_FIT_PARTICLES current sds. On a funnel's heavy tails the line of
#: eight particles' means steered s 1.4-5 sd astray (one draw, whose terms always run, is no better
#: there, and eight were its remedy); on a quadratic log joint the miss is 0 (benchmarks/funnel.py,
#: benchmarks/coupled.py).
CROSS_FIT_PARTICLES = 0.1
#: Each first site keeps the regressions of at most this many structures (the ordered keys and
#: shapes of the sites they cover: a guide whose sites change between steps), the least recently
#: taken dropped.
CROSS_STRUCTURES = 4
#: The rate of the running level of a full-covariance site's one-draw curvature, the
#: coefficient of its control variate (:func:`dense_control_variate`).
LEVEL_RATE = 0.2
#: ... which restarts where this step's level is below it over LEVEL_RESTART (:func:`kept_level`).
LEVEL_RESTART = 1e4


def control_variate(grad, curvature, eps_mean, eps_sq_mean_minus_one, precision, prior_precision, known,
                    baseline, scratch=(None, None, None)) -> torch.Tensor:
    """
    Subtract, in place, the diagonal control variates of known draws :math:`\\epsilon`
    from :math:`\\hat g` and :math:`\\hat h`:

    .. math:: \\hat g \\leftarrow \\hat g - c\\,\\sigma\\bar\\epsilon, \\qquad
              \\hat h \\leftarrow \\hat h - b\\,\\bar\\epsilon/\\sigma - c\\,(\\overline{\\epsilon^2} - 1),

    with :math:`c = \\lambda - \\lambda_0` the curvature the current precision
    stands for and :math:`b` the running mean of :math:`\\hat g` (``baseline``; both 0
    where the element has no estimate yet: ``known`` false). Where :math:`\\ell` is
    quadratic with curvature :math:`c` and gradient :math:`b` at the mean they are
    exact: then :math:`\\hat g(\\mu + \\sigma\\epsilon) = b + c\\sigma\\epsilon`.
    ``eps_sq_mean_minus_one`` is consumed; ``None`` for a curvature exact at the draw (not a Price
    estimate, whose noise these terms of :math:`\\hat h` are): the gradient's alone. ``scratch``:
    three buffers of the length. Returns :math:`\\sigma = \\lambda^{-1/2}` (into the second).
    ``precision`` is :math:`\\sigma^{-2} \\ge 0` (without a prior :math:`c = \\lambda`: no clamp).
    """
    work, sigma, product = scratch
    # (known: a 0 / 1 mask; finite c and baseline: a product is the masked fill)
    if prior_precision is None:
        c = torch.mul(precision, known, out=work)
    else:
        c = torch.sub(precision, prior_precision, out=work).clamp_(min=0.0).mul_(known)
    sigma = torch.rsqrt(precision, out=sigma)
    grad.sub_(torch.mul(c, sigma, out=product).mul_(eps_mean))
    if eps_sq_mean_minus_one is None:
        return sigma
    curvature.sub_(eps_sq_mean_minus_one.mul_(c))
    if baseline is not None:
        curvature.sub_(torch.mul(baseline, known, out=product).mul_(eps_mean).div_(sigma))
    return sigma


def structure_key(sites: List[GaussianSite]) -> str:
    """The key of the regression of ``sites`` (in order) in their first one's state: their
    keys and shapes (the layout of the packed regression)."""
    return repr(tuple((site.key, tuple(site.loc.shape)) for site in sites))


class CrossSlot:
    """The regression of one structure (``key``) in the state of its first site (a dict by
    structure, least recently kept first): ``cross`` reads it (``None``: none kept) and, set, keeps
    it as the most recent. Beyond :data:`CROSS_STRUCTURES` the least recent is dropped, and so is an
    earlier version's regression (:data:`~pyro_ngvi.state.CROSS_LEGACY`): this one took it up, or
    that version would have overwritten it."""

    __slots__ = ("site_state", "key")

    def __init__(self, site_state, key: str):
        self.site_state, self.key = site_state, key

    @property
    def cross(self) -> Optional[torch.Tensor]:
        return (self.site_state.cross or {}).get(self.key)

    @cross.setter
    def cross(self, packed: torch.Tensor) -> None:
        kept = {k: v for k, v in (self.site_state.cross or {}).items() if k not in (self.key, CROSS_LEGACY)}
        kept[self.key] = packed
        self.site_state.cross = dict(list(kept.items())[-CROSS_STRUCTURES:])


class CrossTerms(NamedTuple):
    """What :func:`cross_terms` found for this step: the sites it covers (flat, in order),
    :math:`\\tilde H` (their symmetrised off-diagonal Hessian estimate, zero until it is
    usable), where to keep the regression (a :class:`CrossSlot`: ``state.cross = new``) and its
    new value (kept once the step is taken)."""

    sites: List[GaussianSite]
    off_diagonal: torch.Tensor
    state: CrossSlot
    new: torch.Tensor
    diagonal: Optional[torch.Tensor] = None  # the regression's diagonal of H, plus the prior's (0 until usable)


def takes_cross_terms(stats: SiteCurvature) -> bool:
    """Sampled statistics with known draws (of any curvature source), no mask, not a
    BayesianNet's minibatch statistics."""
    known = stats.eps_mean is not None or (stats.gradients and stats.draws)
    return stats.sampled and known and stats.mask is None and stats.num_data is None


def _price(stats: SiteCurvature) -> bool:
    """Whether the curvature is the Price estimate (:math:`\\hat h = \\epsilon \\hat g / \\sigma`,
    linear in the gradient: the gradient's cross terms enter it too), not one computed at the draw."""
    return stats.eps_sq_mean is not None or stats.gradients


def cross_terms(sites: List[GaussianSite], stats: Dict[str, SiteCurvature],
                state_of: Callable) -> Optional[CrossTerms]:
    """
    Subtract the cross terms of the control variate of the small mean-field sites
    (together at most :data:`CROSS_MAX` elements, each with known draws, no mask, not
    a BayesianNet's minibatch statistics) from their :math:`\\hat g` and :math:`\\hat h`
    (replacing ``stats``' entries; :func:`control_variate` takes the diagonal later):

    .. math:: \\hat g \\leftarrow \\hat g - \\tilde H z, \\qquad
              \\hat h \\leftarrow \\hat h - \\bar\\epsilon \\odot (\\tilde H z)/\\sigma,
              \\qquad z = \\sigma\\bar\\epsilon,

    with :math:`\\tilde H` the symmetrized off-diagonal part of
    :math:`\\hat H = S_{gw} S_{ww}^{-1}`, the slope of a weighted least-squares
    regression of the raw :math:`\\hat g` on the draw points :math:`w = \\mu + z`
    of these sites' past steps (weights :math:`\\max(1/n,` :data:`CROSS_RATE` :math:`)`
    for the newest; running means of :math:`w` and :math:`\\hat g`, and their
    covariances :math:`S_{ww}`, :math:`S_{gw}`). Where :math:`\\ell` is quadratic,
    :math:`\\hat g(w) = \\hat g(0) + H w` exactly, so after :math:`D + 1` steps
    :math:`\\hat H = H` whatever the weights. :math:`\\hat H` uses past steps only, so
    both terms have mean zero whatever its error, but noise in proportion to its error: where
    this step's :math:`\\hat g` misses the regression's line by more than :data:`CROSS_MISFIT`
    current standard deviations, :math:`\\max_i |\\hat g_i - \\hat g_{\\text{line}, i}|\\sigma_i`
    (a line fitted to a transient's wide first steps on a log joint that is not quadratic; on a
    quadratic one the miss is 0), the regression starts afresh from this step's pair, for the
    steps after; with several particles' draws the terms wait while it misses by more than
    :data:`CROSS_FIT_PARTICLES`. Sites of a half or bfloat16 dtype take none (torch has no Cholesky
    factor for them: the step raised ``NotImplementedError``). Before :math:`D + 1` steps, or where
    :math:`S_{ww}` is not positive definite or the term is not finite, it is 0 (no
    device sync). The state, one :math:`(2D + 3) \\times D` tensor (count, the two means,
    :math:`S_{ww}`, :math:`S_{gw}`), is kept with the first of the sites (``state_of(site)``)
    under the structure of the sites it covers, their ordered keys and shapes
    (:func:`structure_key`): a guide whose sites change between steps keeps one regression per
    structure (at most :data:`CROSS_STRUCTURES` per first site, the least recently taken
    dropped), each fitted to its own steps only and taken up again when its structure comes
    back; a new structure starts afresh. (A regression shared by all restarted at every change,
    never reaching :math:`D + 1` steps under a site present on every other step, and two
    structures of one total size took each other's slopes.) Returns :class:`CrossTerms` (``None``: no
    cross terms this step); its :math:`\\tilde H` also couples the sites' mean step
    (:func:`~pyro_ngvi.update.mean_field.coupled_mean_step`).
    """
    chosen = [(site, state_of(site)) for site in sites if takes_cross_terms(stats[site.key])]
    size = sum(site.loc.numel() for site, _ in chosen)
    if (not 1 < size <= CROSS_MAX or chosen[0][0].loc.dtype not in (torch.float32, torch.float64)
            or any(site.loc.dtype != chosen[0][0].loc.dtype or site.loc.device != chosen[0][0].loc.device
                   for site, _ in chosen)):
        return None
    picked = [stats[site.key] for site, _ in chosen]
    with torch.no_grad():
        raw_grad = flat([s.grad for s in picked])
        eps = flat([s.eps_mean for s in picked])
        sigma = flat([site.scale if s.scale is None else s.scale for (site, _), s in zip(chosen, picked)])
        z = sigma * eps  # the draw's offset from the mean
        point = flat([site.loc for site, _ in chosen]) + z
        slot = CrossSlot(chosen[0][1], structure_key([site for site, _ in chosen]))
        packed = slot.cross
        if packed is None:  # (an earlier version's regression: the first structure of its size takes it up)
            packed = (chosen[0][1].cross or {}).get(CROSS_LEGACY)
        if packed is None or packed.shape != (2 * size + 3, size):
            packed = raw_grad.new_zeros(2 * size + 3, size)
        n, mean_w, mean_g = packed[0, 0], packed[1], packed[2]
        cov_ww, cov_gw = packed[3:3 + size], packed[3 + size:]
        factor, info = torch.linalg.cholesky_ex(cov_ww)
        slope = torch.cholesky_solve(cov_gw.T.contiguous(), factor)  # (S_gw S_ww^-1)^T
        # how far this step's g is from the regression's line, in the current sds (taken after use)
        misfit = (raw_grad - mean_g - (point - mean_w) @ slope).mul_(sigma).abs_().amax()
        off = slope.add_(slope.T.clone()).mul_(0.5)
        diagonal = off.diagonal().clone()
        off.diagonal().zero_()
        correction = off @ z
        usable = (n > size) & (info == 0) & torch.isfinite(correction).all()
        if any(s.particles > 1 for s in picked):
            usable = usable & (misfit <= CROSS_FIT_PARTICLES)
        correction = torch.where(usable, correction, 0.0)
        off = torch.where(usable, off, 0.0)
        # (plus the conjugate prior's precision, which the regressed gradient leaves out)
        prior = [torch.zeros_like(s.grad) if s.prior_precision is None else s.prior_precision.expand_as(s.grad)
                 for s in picked]
        diagonal = torch.where(usable & (misfit <= CROSS_FIT), diagonal + flat(prior), 0.0)
        curvature_correction = correction * eps / sigma
        pieces = zip(correction.split([s.grad.numel() for s in picked]),
                     curvature_correction.split([s.grad.numel() for s in picked]))
        for (site, _), s, (dg, dh) in zip(chosen, picked, pieces):
            stats[site.key] = replace(s, grad=s.grad - dg.view_as(s.grad),
                                      curvature=s.curvature - dh.view_as(s.curvature) if _price(s) else s.curvature)
        # the regression takes this step's point after its use
        n = n + 1
        weight = n.reciprocal().clamp(min=CROSS_RATE)
        dw, dg = point - mean_w, raw_grad - mean_g
        new = torch.empty_like(packed)
        new[0] = n
        new[1] = mean_w + weight * dw
        new[2] = mean_g + weight * dg
        new[3:3 + size] = (cov_ww + weight * torch.outer(dw, dw)).mul_(1 - weight)
        new[3 + size:] = (cov_gw + weight * torch.outer(dg, dw)).mul_(1 - weight)
        # a line fitted where the log joint is far from this quadratic (a transient's wide first steps)
        # misses g by many sds: the regression restarts from this step's pair
        refit = usable & ~(misfit <= CROSS_MISFIT)
        fresh = torch.zeros_like(packed)
        fresh[0], fresh[1], fresh[2] = 1.0, point, raw_grad
        new = torch.where(refit, fresh, new)
    return CrossTerms([site for site, _ in chosen], off, slot, new, diagonal)


def dense_control_variate(factor: torch.Tensor, stats: SiteCurvature, state):
    """
    A full-covariance site's one-draw statistics (its draw in ``stats.eps_mean``, whitened
    curvature :math:`W`) with the control variate of
    :func:`~pyro_ngvi.full_covariance.controlled_price_statistics`, its coefficient :math:`c`
    the level ``state`` kept from the steps before (0 at the first; at least 0: any :math:`c`
    is unbiased), and the level to keep: the running mean, at rate :data:`LEVEL_RATE`, of
    :math:`\\mathrm{tr}(W)/D` (:func:`kept_level`). Returns ``(stats, {"level": ...})``.
    """
    whitened = stats.curvature
    observed = whitened.diagonal().mean()
    level = 0.0 if state.level is None else max(float(state.level), 0.0)
    grad, curvature = full_covariance.controlled_price_statistics(
        factor.to(whitened), stats.grad.to(whitened), whitened, stats.eps_mean.to(whitened), level)
    stats = replace(stats, grad=grad.to(stats.grad), curvature=curvature, eps_mean=None)
    return stats, {"level": kept_level(state.level, observed).to(stats.grad.dtype)}


def kept_level(level: Optional[torch.Tensor], observed: torch.Tensor) -> torch.Tensor:
    """The control variate's level after this step: the running mean of the ``observed``
    levels at rate :data:`LEVEL_RATE` (the first one as it is), restarted at the observed one
    (at least 0) where its size is below the level over :data:`LEVEL_RESTART`. A level kept from
    a far region of a log joint that is not quadratic (a wide start's first steps: 1e17 where 1e3
    is seen now) is noise in proportion to itself, and it kept the precision growing
    (``tests/test_wide_start.py``); a one-draw level crosses 0 often, and with a ratio of 100 the
    restarts this made in ordinary runs cost the one-draw benchmark up to 2x. Any level from past
    steps leaves the estimate unbiased."""
    if level is None:
        return observed
    level = level.to(observed)
    return torch.where(observed.abs() < level / LEVEL_RESTART, observed.clamp(min=0.0),
                       torch.lerp(level, observed, LEVEL_RATE))


def low_rank_control_variate(stats, state):
    """
    A low-rank-precision site's one-draw statistics (the draw's ``displacement`` :math:`z`)
    with the control variate of :func:`~pyro_ngvi.low_rank.controlled_price_factors`, its
    coefficient :math:`c` the level ``state`` kept (0 at the first step; at least 0), and the
    level to keep: the running mean, at rate :data:`LEVEL_RATE`, of
    :math:`\\mathrm{tr}(S^{-1}\\hat H)/D = z^\\top g / D`, as for the full covariance
    (:func:`dense_control_variate`). Returns ``(stats, {"level": ...})``.
    """
    z, grad = stats.displacement, stats.grad
    observed = (z.to(grad) @ grad) / grad.numel()
    level = 0.0 if state.level is None else max(float(state.level), 0.0)
    a = (stats.plus + stats.minus).squeeze(-1)  # (G+ + G- = S z: the one draw's factors hold it)
    controlled, plus, minus = low_rank.controlled_price_factors(a, grad, level)
    return (replace(stats, grad=controlled, plus=plus, minus=minus, displacement=None, level=level),
            {"level": kept_level(state.level, observed)})

