"""
What keeps a step of the Bayesian learning rule sound when its statistics are not:
finiteness (:func:`finite`: a step with a non-finite gradient or curvature is
skipped whole), the range of the precision (:func:`clamp_precision_`), the trust
region of sampled steps (:func:`clip_`, :func:`precision_trust_region`,
:func:`clip_target`), the stall test (:func:`far_elements`), the watch on curvature that one
draw cannot estimate (:func:`noisy_flags`), the accept-or-damp of
Newton steps evaluated at the mean (:class:`NewtonGuard`), and the warnings each
says when it engages (:func:`report`). Flags are 0-d tensors read at the next step's
one device sync: nothing here synchronises inside a step.
"""

import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .monitor import NGVIWarning

#: Sampled curvature targets are clipped to (1 +- this) times the precision (with one
#: draw, eps^2 - 1 exceeds 9 once in 640 steps; coupled sites have heavier tails).
INNOVATION_MAX = 9.0
#: The excess carried over (:func:`clip_target`) is at most this share of :math:`n\lambda`, the sum of
#: the targets the running mean :math:`\lambda` of :math:`n` of them stands for.
EXCESS_SHARE = 0.5
#: Under sampled curvature a step changes an element's precision by at most this factor.
PRECISION_RATIO = 4.0
#: A site whose mean gradient exceeds FAR of its guide's standard deviations
#: (:math:`|g|\sigma`, about :math:`|\mathcal{N}(0, 1)|` at the optimum of a Gaussian
#: posterior, larger by minibatch noise) with the sign it had at the last step (noise
#: flips it) on most elements, for STALL_STEPS consecutive sampled steps, is reported as stalling.
FAR = 4.0
STALL_STEPS = 100
#: A full-covariance site whose drift test (:func:`~pyro_ngvi.policies.dense_count`) finds
#: its Newton step drifting for this many steps in a row is reported as stalling.
DENSE_STALL_STEPS = STALL_STEPS // 2
#: A site of the adaptive steps whose relative curvature innovation :math:`(\hat h - \lambda)/\lambda`
#: has a pooled noise variance (long memory) above this many times one draw's from a Gaussian
#: posterior (2, plus :math:`N/B - 1` under subsampling) for NOISY_STEPS consecutive steps is reported.
#: Counted from a site's NOISY_AFTER-th step on: a transient's is not noise (the diabetes regression's
#: sigma: 35 at step 100, 17 at 150, below 1 from step 300 on).
NOISY_CURVATURE = 10.0
NOISY_STEPS = STALL_STEPS
NOISY_AFTER = 150


def finite(*tensors: torch.Tensor, mask=None, exact: bool = False) -> torch.Tensor:
    """
    Whether the ``mask`` rows (all: ``None``) of every tensor are finite, as a 0-d
    bool tensor (no device sync), from their sum: one reduction per tensor
    (``isfinite(x).all()`` costs several times more on the CPU). A finite sum
    proves them finite; a non-finite one may also be an overflow of finite values,
    which ``exact`` tells apart: accumulated in float64, the sum is finite iff they
    all are (float64 cannot overflow on float32 values; for float64 values only
    beyond ~1e300).
    """
    total = None
    for part in sums(*tensors, mask=mask, exact=exact):
        total = part if total is None else total + part
    # x - x is 0 for a finite x and NaN for an infinite or NaN one, the only value not equal to
    # itself: two kernels, where isfinite on a 0-d tensor runs four (x == x, |x|, != inf, and), one
    # of them casting inf to the tensor's dtype
    difference = torch.sub(total, total)
    return difference.eq(difference)


def sums(*tensors: torch.Tensor, mask=None, exact: bool = False) -> List[torch.Tensor]:
    """
    The sum of each tensor's ``mask`` rows (all: ``None``), 0-d (no device sync; ``exact``: in
    float64): all finite proves the tensors finite (:func:`finite`'s test, for a caller that reads
    them on the host anyway: no kernels adding them and comparing the total).
    """
    parts = []
    for t in tensors:
        if mask is not None:  # (the other rows as 0: a select, ~9x cheaper on the CPU than gathering the rows)
            t = torch.where(mask.reshape(t.shape), t, 0.0)
        parts.append(t.sum(dtype=torch.float64) if exact else t.sum())
    return parts


def clip_target(target: torch.Tensor, precision: torch.Tensor, excess: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None, scratch=(None, None), count: Optional[torch.Tensor] = None,
                prior_precision: Optional[torch.Tensor] = None):
    """
    A sampled curvature target beyond :math:`(1 \\pm` :data:`INNOVATION_MAX` :math:`)\\lambda`
    is an outlier: clip it there (in place; ``scratch``: two buffers for the bounds). Only the
    sampled part is clipped: with an exact ``prior_precision`` :math:`\\lambda_0` in the target
    :math:`\\hat\\lambda = \\lambda_0 + \\hat h`, the bounds are :math:`\\lambda_0 + (1 \\pm 9)\\lambda`, so
    the prior's precision is always within reach (as in :func:`precision_trust_region`). Clipped to
    :math:`10\\lambda` instead, a guide 1e5 times wider than a prior of sd 1e-6 grew its precision
    5.5-fold a step while the prior's pull :math:`\\lambda_0(\\mu - m_0)/\\lambda'` was not clipped: the
    mean overshot 1e6 prior sd and diverged to inf.

    With ``excess`` :math:`r`, the part clipped off the earlier targets, the clipped value is
    carried over (error feedback): :math:`t \\leftarrow \\mathrm{clip}(\\hat\\lambda + r)`,
    :math:`r' = \\hat\\lambda + r - t`. The targets taken then sum to the targets given, less
    :math:`r'`, so a running average of them stays unbiased where clipping alone would bias it
    (a heavy-tailed curvature, such as the scale of a hierarchical model's, clipped on one side
    more often than on the other). With ``count`` :math:`n` (the adaptive steps'), :math:`|r'| \\le`
    :data:`EXCESS_SHARE` :math:`n\\lambda`: an excess is paid at most :math:`9\\lambda` a step while a
    clipped target :math:`-8\\lambda` shrinks :math:`\\lambda` by :math:`1 - 9/n`, so one beyond
    about :math:`n\\lambda` grows relative to :math:`\\lambda` and is never paid. (Under minibatch noise
    a debt of :math:`-163\\lambda` at :math:`n = 19` took :math:`-8\\lambda` eleven steps running, the
    scale grew 60-fold and the mean jumped 250 posterior sd.) Returns the target and :math:`r'` (into
    ``out``; default: a new tensor), or ``None`` without ``excess``.
    """
    low = torch.mul(precision, 1.0 - INNOVATION_MAX, out=scratch[0])
    high = torch.mul(precision, 1.0 + INNOVATION_MAX, out=scratch[1])
    if prior_precision is not None:
        low, high = low.add_(prior_precision), high.add_(prior_precision)
    if excess is None:
        return torch.clamp(target, min=low, max=high, out=target), None
    if out is excess:  # (eagerly, in place: the sum in excess's buffer, the clipped target in target's)
        raw = torch.add(target, excess, out=excess)
        target = torch.clamp(raw, min=low, max=high, out=target)
        new_excess = raw.sub_(target)
        if count is not None:  # |r'| <= share n lambda, one clamp (the bounds' buffers are free)
            radius = torch.mul(precision, count, out=scratch[1])
            low = torch.mul(radius, -EXCESS_SHARE, out=scratch[0])  # (rounding is symmetric)
            clip_(new_excess, radius.mul_(EXCESS_SHARE), low)
        return target, new_excess
    raw = target.add_(excess)
    clipped = torch.clamp(raw, min=low, max=high, out=low)
    new_excess = torch.sub(raw, clipped, out=out)
    target = target.copy_(clipped)
    if count is not None:  # |r'| <= share n lambda (high's buffer is free)
        clip_(new_excess, torch.mul(precision, count, out=scratch[1]).mul_(EXCESS_SHARE))
    return target, new_excess


def precision_trust_region(new_precision: torch.Tensor, precision: torch.Tensor,
                           prior_precision: Optional[torch.Tensor], scratch=(None, None)) -> torch.Tensor:
    """Keep :math:`\\lambda'` within a factor :data:`PRECISION_RATIO` of :math:`\\lambda`
    (in place), the exact prior precision always within reach (``scratch``: two buffers)."""
    upper = torch.mul(precision, PRECISION_RATIO, out=scratch[0])
    lower = torch.div(precision, PRECISION_RATIO, out=scratch[1])
    if prior_precision is not None:
        upper = torch.maximum(upper, prior_precision, out=scratch[0])
        lower = torch.minimum(lower, prior_precision, out=scratch[1])
    return torch.clamp(new_precision, min=lower, max=upper, out=new_precision)


def clip_(step: torch.Tensor, radius: torch.Tensor, low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clip ``step`` to :math:`[-r, r]` element-wise, in place (``radius`` :math:`r \\ge 0` is negated in
    place, unless ``low``, :math:`-r`, is given: then one clamp)."""
    if low is not None:
        return torch.clamp(step, min=low, max=radius, out=step)
    step = torch.minimum(step, radius, out=step)
    return torch.maximum(step, radius.neg_(), out=step)


def clamp_precision_(precision: torch.Tensor, floor: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Keep ``precision`` in ``[eps^2, max / 4]`` of its dtype, in place: then
    :math:`\\sigma = \\lambda^{-1/2} \\le 1/\\epsilon` (8.4e6 in float32, 4.5e15 in float64) and
    :math:`\\sigma^{-2}` are finite and positive, and a draw :math:`\\mu + \\sigma\\epsilon`
    squared is finite too. (The update from finite statistics is a convex combination plus a
    non-negative correction: never NaN, above the top only by overflow of the correction.
    An element the model does not depend on, such as an observed entry of an ``obs_mask``
    site's ``_unobserved`` latent, has no curvature and no prior: its precision falls
    towards 0, the posterior being flat there, and a draw of a larger :math:`\\sigma`
    overflowed the model's masked log density to NaN.) With a ``floor`` (the family's
    :math:`\\lambda_{\\min}`, broadcast to ``precision``), also
    :math:`\\lambda \\ge \\lambda_{\\min}`. Returns whether the top was passed, as a
    0-d bool tensor (no device sync), and a lower bound on the smallest precision
    (0-d, at least ``eps^2``).
    """
    info = torch.finfo(precision.dtype)
    high = info.max / 4
    low = max(info.tiny, info.eps**2)
    lowest, highest = torch.aminmax(precision)
    lowest = lowest.clamp(min=low)
    precision.clamp_(low, high)
    if floor is not None:  # (two passes: torch's CPU clamp with tensor bounds is ~7x slower than both)
        torch.maximum(precision, floor, out=precision)
    return highest > high, lowest


def mostly(flags: torch.Tensor, mask) -> torch.Tensor:
    """Whether more than half of the (``mask``) elements are set, as a 0-d bool tensor."""
    if mask is None:
        return torch.count_nonzero(flags) > flags.numel() // 2
    return torch.count_nonzero(flags & mask) * 2 > torch.count_nonzero(mask)


def far_elements(grad: torch.Tensor, precision: torch.Tensor, positive: torch.Tensor,
                 last_positive: torch.Tensor, scratch=(None, None), flags=(None, None), product: bool = True):
    """Elements whose gradient exceeds :data:`FAR` standard deviations,
    :math:`g^2 > \\text{FAR}^2 \\lambda`, with the sign of the last step, as 0 / 1 in ``grad``'s
    dtype (the signs so too; ``scratch``, ``flags``: two buffers each; the result is the first flag).
    ``product=False``: the two factors (far, same sign), for a caller that only counts them."""
    dtype = grad.dtype
    persistent = torch.eq(positive, last_positive, out=flags[1])
    square = torch.square(grad, out=scratch[0])
    far = torch.gt(square, torch.mul(precision, FAR**2, out=scratch[1]), out=flags[0])
    if flags[0] is None:
        far, persistent = far.to(dtype), persistent.to(dtype)
    return far.mul_(persistent) if product else (far, persistent)


class Safeguards(NamedTuple):
    """A group's safeguard flags of one step (0-d bool tensors), read at the next sync."""

    group: object
    states: list
    clamped: torch.Tensor
    far: Optional[torch.Tensor]
    spreading: Optional[torch.Tensor] = None  # means growing without bound (pyro_ngvi.monitor)
    noisy: Optional[List[torch.Tensor]] = None  # per state: curvature one draw cannot estimate (noisy_flags)

    def flags(self) -> List[torch.Tensor]:
        """In the order :func:`report` reads them."""
        return [f for f in (self.clamped, self.spreading) if f is not None] + (self.noisy or []) + (
            [] if self.far is None else [self.far])


def noisy_flags(states, subsampling: float = 0.0) -> Optional[List[torch.Tensor]]:
    """
    Per site of the adaptive steps (``None`` where a state has no pooled noise yet): whether, past its
    first ``NOISY_AFTER`` steps, the pooled
    noise variance (long memory, :func:`~pyro_ngvi.policies.pooled_levels`) of its relative curvature
    innovation :math:`e = (\\hat h - \\lambda)/\\lambda` exceeds :data:`NOISY_CURVATURE` times
    :math:`2 + N/B - 1`, the variance of one draw at the fixed point of a Gaussian posterior
    (:math:`\\mathrm{Var}(\\epsilon^2 - 1) = 2`, and the subsampling's), as 0-d bool tensors.

    Where a latent scales others (a centred funnel: a horseshoe's global and local HalfCauchy
    scales), one draw's Price curvature of the scale is heavy-tailed: its targets fall beyond the
    clip at :math:`(1 \\pm 9)\\lambda` on 20-70 % of the steps (a Gaussian posterior: once in 640),
    the drift test reads that noise as a drift, the steps stay at :math:`\\beta = 1/2`, and under
    the clip and Lin et al.'s floor (:math:`\\lambda' \\le 4\\lambda` up, :math:`\\ge \\lambda/2`
    down) :math:`\\log\\lambda` random-walks with a drift of :math:`(\\log 4 - \\log 2)/2` per
    step on such noise: the scale collapses (a standard deviation of 5e-6 for a posterior one of
    0.2) or, the other way, its draws leave the dtype's range. Measured past step 150: 10-80 on a centred
    horseshoe at one draw, at most 4 with 8 draws; on the non-centred eight schools at most 36, above
    the level for at most 47 steps in a row (6 seeds).
    """
    if any(state.noise is None for state in states):
        return None
    limit = NOISY_CURVATURE * (2.0 + subsampling)
    return [(state.noise[1, ..., -1].max() > limit) & (state.steps.min() > NOISY_AFTER) for state in states]


def report(records: List[Safeguards], engaged: List[bool], step: int, spread_watch, depth: int = 0) -> None:
    """Warn about the safeguards that engaged at the last step (read at this step's sync;
    ``step`` is the number of steps taken since; the warnings point ``depth`` frames further up)."""
    engaged = iter(engaged)
    for record in records:
        dtype = record.group.sites[0].loc.dtype
        if next(engaged):
            warnings.warn(
                f"NGVI clamped the precision of {_names(record)} to the range where the scale stays "
                f"finite and positive in {dtype} (the update left it at step {step - 1}): the "
                "problem is badly scaled for the guide, e.g. sampled curvature far from the "
                "optimum. Rescale the data or the model, start the guide nearer (init_loc_fn) "
                "or use exact curvature (CurvatureELBO('hessian')).",
                NGVIWarning,
                stacklevel=5 + depth,
            )
        if record.spreading is not None and next(engaged):
            message = spread_watch.message(record.group, _names(record), step - 1)
            if message:
                warnings.warn(message, NGVIWarning, stacklevel=5 + depth)
        if record.noisy is not None:
            _count_noisy(record, [next(engaged) for _ in record.noisy], depth)
        if record.far is None:
            continue
        far = next(engaged)
        for state in record.states:
            state.far_steps = state.far_steps + 1 if far else 0
        if far and any(state.far_steps == STALL_STEPS for state in record.states):
            warnings.warn(
                f"NGVI: the mean of {_names(record)} stalls. Its gradient has exceeded {FAR:g} of its "
                "guide's standard deviations, with the same sign, on most elements for "
                f"{STALL_STEPS} consecutive steps: the mean is far from where the data put "
                "it, and under sampled curvature its steps stay within a few standard "
                "deviations while the scale shrinks. Rescale the data or the model, start the "
                "guide nearer (init_loc_fn) or wider (init_scale), or use exact curvature "
                "(CurvatureELBO('hessian')).",
                NGVIWarning,
                stacklevel=5 + depth,
            )


def _names(record: Safeguards) -> str:
    """The names of the record's sites, for a warning."""
    return ", ".join(repr(site.name) for site in record.group.sites)


def _count_noisy(record: Safeguards, noisy: List[bool], depth: int = 0) -> None:
    """Count each site's steps in a row flagged by :func:`noisy_flags`; warn once per group, when the
    first reaches :data:`NOISY_STEPS` (the remedy is the same for all its sites; their counts then stay
    past it)."""
    for state, flagged in zip(record.states, noisy):
        if state.noisy_steps <= NOISY_STEPS:
            state.noisy_steps = state.noisy_steps + 1 if flagged else 0
    sites = [site for site, state in zip(record.group.sites, record.states) if state.noisy_steps == NOISY_STEPS]
    if sites:
        warnings.warn(noisy_message(", ".join(repr(site.name) for site in sites)), NGVIWarning, stacklevel=6 + depth)
        for state in record.states:
            state.noisy_steps = NOISY_STEPS + 1


def noisy_message(names: str) -> str:
    """The warning of :func:`noisy_flags` for the sites ``names``. It names both causes seen: a latent
    that scales others (a funnel: several draws per step settle it), and a posterior strongly
    correlated across a mean-field site's elements (a random walk, whose latents enter the
    likelihood as cumulative sums: :mod:`pyro.contrib.forecast`'s local-level models), where the
    element-wise mean step is a Jacobi iteration on the precision :math:`H`, unstable for
    :math:`\\alpha > 2/\\lambda_{\\max}(D^{-1}H)`, and its diagonal Price curvature carries the cross
    terms :math:`\\sum_{j \\ne i} H_{ij}\\sigma_j\\epsilon_j`: there more draws do not help (a local-level
    model of 100 steps, :math:`\\lambda_{\\max}(D^{-1}H) = 58`: 42 mean-field sd off after 600 steps
    with 8 draws), a guide of the correlations does (``tests/test_outsider_pyro.py``)."""
    return (
        f"NGVI: the draws of each step cannot estimate the curvature of {names}. For {NOISY_STEPS} steps in a row "
        f"the noise of its curvature targets has exceeded {NOISY_CURVATURE:g} times what one draw gives "
        "at the optimum of a Gaussian posterior. Two causes: (1) a latent that scales other latents (a funnel: a "
        "horseshoe's or a hierarchical model's HalfCauchy scale) makes one draw's curvature heavy-tailed, and the "
        "precision then random-walks, so the guide's scale collapses (a standard deviation far below the "
        "posterior's, the ELBO stuck far from its best) or its draws leave the range of the dtype (a scale of 0 "
        "or inf in the model, then Pyro's ValueError or non-finite steps): draw several per step, "
        "Trace_ELBO(num_particles=8, vectorize_particles=True). (2) A posterior strongly correlated across the "
        "elements of a mean-field guide (a random walk or time series whose latents enter as cumulative sums, "
        "as in pyro.contrib.forecast's local-level models): the element-wise mean steps overshoot and the means "
        "wander far from the posterior's, whatever the number of draws: use a guide that models the "
        "correlations, pyro_ngvi.LowRankPrecisionNormal(model, rank=10) or AutoMultivariateNormal (up to a few "
        "hundred latents), e.g. Forecaster(model, data, covariates, guide=LowRankPrecisionNormal(model, "
        "rank=10), optim=NGVI())."
    )


def warn_dense_stall(site, state) -> None:
    """Warn once per run of :data:`DENSE_STALL_STEPS` steps in which the Newton step of a
    full-covariance ``site``, in its guide's standard deviations, kept one direction
    (a mean far from the optimum, approached slowly: a guide started far wider than the posterior)."""
    if state.far_steps == DENSE_STALL_STEPS:
        warnings.warn(
            f"NGVI: the mean of {site.name!r} stalls. Its Newton step, in the guide's standard deviations, "
            f"has pointed the same way for {DENSE_STALL_STEPS} steps in a row: the mean is far from where "
            "the data put it and approaches slowly (a guide started much wider than the posterior takes a "
            "first step of several of its own standard deviations, and its precision then grows faster than "
            "the mean returns). Start the guide nearer (init_loc_fn) or narrower (init_scale), or use exact "
            "curvature (CurvatureELBO('hessian')).", NGVIWarning, stacklevel=5)


def evaluated_on(model, args, kwargs) -> list:
    """What an evaluation of :math:`F` at the mean was made on, for :class:`NewtonGuard` to tell
    whether two values of :math:`F` are of one function: the model and its arguments, flattened
    through lists, tuples and dicts, each tensor with its version counter (an in-place write
    bumps it). Kept by reference: a later minibatch cannot reuse a freed tensor's identity."""
    leaves = []

    def walk(x):
        if torch.is_tensor(x):
            leaves.append((x, x._version))
        elif isinstance(x, (list, tuple)):
            leaves.append((type(x), len(x)))
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            leaves.append((dict, len(x)))
            for k, v in x.items():
                leaves.append((k, None))
                walk(v)
        else:
            leaves.append((x, None))

    walk((model, args, sorted(kwargs.items(), key=lambda item: item[0])))
    return leaves


def same_evaluation(saved: Optional[list], new: Optional[list]) -> bool:
    """Whether :func:`evaluated_on` records ``saved`` and ``new`` are of the same :math:`F` (unknown,
    ``None``: taken as the same): the same model and arguments, a tensor either the same one at
    the same version or another one with equal values; other objects the same one or equal."""
    if saved is None or new is None:
        return True
    if len(saved) != len(new):
        return False
    for (a, version), (b, _) in zip(saved, new):
        if torch.is_tensor(a) and torch.is_tensor(b):
            if a is b:
                if a._version != version:
                    return False
            elif a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b):
                return False
        elif a is not b:
            try:
                if type(a) is not type(b) or bool(a != b):
                    return False
            except Exception:  # (a comparison that is no bool: an array)
                return False
    return True


class NewtonGuard:
    """
    Accept-or-damp for steps whose statistics were evaluated at the mean (a
    diagonal Newton method on :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J|`):
    a step after which :math:`F` rose (or is not finite) is undone, and the mean
    step of the next ones is divided by a factor :math:`f` (Levenberg-Marquardt
    damping of the diagonal curvature, :math:`D \\to fD`), multiplied by
    :math:`\\nu` on each rejection (:math:`\\nu` doubling while rejections follow
    one another) and relaxed after accepted steps by Nielsen's rule [1],
    :math:`f \\leftarrow \\max(1, f \\max(1/3, 1 - (2\\rho - 1)^3))` with :math:`\\rho`
    the actual over the predicted decrease of :math:`F` (taken as 1 where the predicted
    decrease is below :math:`F`'s round-off: there the change of :math:`F` is round-off
    too, and a ratio of it would damp a converging run to a halt). An undamped step
    (:math:`f = 1`) that decreases :math:`F` passes untouched, so ``lr = beta = 1``
    with exact curvature is still one Newton step where that step is good.

    :math:`F` is compared only between evaluations of the same model on the same arguments
    (:func:`same_evaluation`): on other data (a minibatch passed without a subsampling
    plate, a batch of another size, the next task) :math:`F` is another function, whose value
    says nothing of the last step, which is then kept and :math:`F` there becomes the reference
    (steps on 5, 20 and 12 rows in turn were each undone before, on the ground that the sum over
    more rows is larger: the guide stayed at its initial point).

    [1] `Damping Parameter in Marquardt's Method`, Hans Bruun Nielsen (IMM-REP-1999-05,
        Technical University of Denmark, 1999)
    """

    __slots__ = ("factor", "nu", "reference", "saved", "predicted", "rejected", "arguments")

    def __init__(self):
        self.factor, self.nu = 1.0, 2.0
        self.reference: Optional[float] = None  # F at the saved point
        self.saved: List = []  # (site, loc, raw scale) before the last step
        self.predicted = 0.0
        self.rejected = 0
        self.arguments: Optional[list] = None  # what F at the saved point was evaluated on (None: unknown)

    def _same_sites(self, sites) -> bool:
        return len(self.saved) == len(sites) and all(
            s.loc is site.loc and s.raw_scale is site.raw_scale for (s, _, _), site in zip(self.saved, sites))

    def rejects(self, sites, objective: float, step: int, arguments: Optional[list] = None) -> bool:
        """Undo the last step if ``objective`` (F at its result, evaluated on ``arguments``:
        :func:`evaluated_on`) is worse than before it, on the same arguments."""
        if self.reference is None or not self._same_sites(sites) or not same_evaluation(self.arguments, arguments):
            return False
        # a rise within the round-off of F in the sites' dtype is none (float32 sums of many terms)
        rounding = max((16 * torch.finfo(site.loc.dtype).eps for site in sites), default=0.0)
        slack = max(1e-9, rounding) * max(1.0, abs(self.reference))
        if objective <= self.reference + slack:  # accepted: relax the damping
            # (rho measures the step only where the predicted decrease exceeds F's round-off; below
            # it, F's change is round-off too: a step as good as predicted)
            rho = max(self.reference - objective, 0.0) / self.predicted if self.predicted > slack else 1.0
            self.factor = max(1.0, self.factor * max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3))
            self.nu = 2.0
            return False
        with torch.no_grad():
            for site, loc, raw_scale in self.saved:
                site.loc.copy_(loc)
                site.raw_scale.copy_(raw_scale)
        self.factor *= self.nu
        self.nu *= 2.0
        self.rejected += 1
        if self.rejected & (self.rejected - 1):  # warn at the 1st, 2nd, 4th, 8th, ... only
            return True
        warnings.warn(
            f"NGVI undid step {step}: F(mu) = -log p(x, T(mu)) - log|det J| at the mean rose "
            f"from {self.reference:.6g} to {objective:.6g}; the guide is back where it was and "
            f"the mean step is damped by {self.factor:g} ({self.rejected} steps undone so far; "
            "warned at the 1st, 2nd, 4th, ...; see num_rejected_steps). A diagonal Newton step "
            "(exact curvature, lr = beta = 1) diverges where lr > 2 / lambda_max(D^-1 H) "
            "(correlated designs) or jumps out of its region of validity (funnels): a smaller lr "
            "avoids the undone steps.",
            NGVIWarning,
            stacklevel=4,
        )
        return True

    def saved_state(self) -> Optional[Dict]:
        """What a checkpoint keeps of the guard (``None`` while it is as new): its damping, the
        counts and, per site (by the param-store name of its ``loc``), the point it would undo to."""
        if self.reference is None and self.rejected == 0 and self.factor == 1.0 and self.nu == 2.0:
            return None
        return {"factor": float(self.factor), "nu": float(self.nu), "reference": self.reference,
                "predicted": float(self.predicted), "rejected": int(self.rejected),
                "saved": {site.key: [loc.clone(), raw_scale.clone()] for site, loc, raw_scale in self.saved}}

    def restore(self, entry: Dict, sites) -> bool:
        """Take a :meth:`saved_state` ``entry`` if its point is of these ``sites`` (by name, in
        order, of the same shapes); returns whether it was taken."""
        saved = entry["saved"]
        if list(saved) != [site.key for site in sites] or any(
                loc.shape != site.loc.shape or raw.shape != site.raw_scale.shape
                for site, (loc, raw) in zip(sites, saved.values())):
            return False
        self.factor, self.nu, self.reference = entry["factor"], entry["nu"], entry["reference"]
        self.predicted, self.rejected = entry["predicted"], entry["rejected"]
        self.arguments = None  # (not kept: compared as the uninterrupted run compared them)
        self.saved = [(site, loc.to(site.loc).clone(), raw.to(site.raw_scale).clone())
                      for site, (loc, raw) in zip(sites, saved.values())]
        return True

    def keep(self, sites, objective: float, arguments: Optional[list] = None) -> None:
        """Remember the point the coming step starts from, and F there (evaluated on ``arguments``)."""
        with torch.no_grad():
            if self._same_sites(sites):
                for site, loc, raw_scale in self.saved:
                    loc.copy_(site.loc)
                    raw_scale.copy_(site.raw_scale)
            else:
                self.saved = [(site, site.loc.detach().clone(), site.raw_scale.detach().clone())
                              for site in sites]
        self.reference = objective
        self.arguments = arguments
