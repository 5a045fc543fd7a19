"""
The element-wise core of one mean-field step (:func:`mean_field_pass`): the chain of
:mod:`~pyro_ngvi.steps` for a group of sites, variance reduction
(:mod:`~pyro_ngvi.variance`) :math:`\\to` step sizes (:mod:`~pyro_ngvi.policies`)
:math:`\\to` the Bayesian learning rule (:mod:`~pyro_ngvi.update.mean_field`) :math:`\\to`
its safeguards (:mod:`~pyro_ngvi.safeguards`) :math:`\\to` the new raw scale
(:mod:`~pyro_ngvi.scales`), as one function of flat tensors (:class:`Inputs`), numbers
(:class:`Numbers`) and a static configuration (:class:`Branches`: which parts apply to the
group this step). Which parts apply is decided by the caller from the sites' state, never
from tensor values, so the pass runs unchanged under :func:`torch.compile`
(:mod:`~pyro_ngvi.update.fused`): each state tensor read once and written once. Eagerly it is
the chain's own operations, each writing into a buffer of the optimizer's workspace
(:class:`Scratch`, :class:`~pyro_ngvi.groups.Workspace`) or in place into the state it
updates: no tensor is made (on the CPU a new temporary of a large site costs more in page
faults than its arithmetic). Masks are 0 / 1 floats (a comparison into floats is vectorised
on the CPU, into bools it is not) and selections are ``lerp``, exact at 0 and 1.

A large site's statistics may come as the ordinary gradients of its loc and raw scale
(:class:`~pyro_ngvi.handover.SiteCurvature` ``gradients``): the pass recovers them first
(``_recover``, the equations of :mod:`~pyro_ngvi.statistics`), span by span. Under the
adaptive steps a large site takes two passes: :func:`noise_pass` prepares the statistics
and sums the noise over the site, then the step (``prepared``).
"""

from typing import NamedTuple, Optional

import torch

from .policies import (AdaptiveScratch, AdaptiveSteps, NoiseState, adaptive_rates, innovations, noise_sums,
                       seen_elements, warm_start_rates)
from .safeguards import clamp_precision_, clip_, clip_target, far_elements, precision_trust_region
from .scales import softplus_branch_free, softplus_inverse_branch_free
from .statistics import EPS_MAX
from .update.mean_field import mean_step, momentum, precision_step, precision_target, trusted_mean_step
from .variance import control_variate


class Branches(NamedTuple):
    """Which parts of the chain apply to a group this step (a compiled pass per value)."""

    tau: bool = False  # tau != 1: g and h divided by it
    control_variate: bool = False  # draws known, not a BayesianNet's minibatch statistics
    prior: bool = False  # a conjugate prior (m_0, lambda_0)
    mask: bool = False  # only some rows touched (subsampling)
    momentum: str = "none"  # "none", "average" (every site has a buffer), "mixed" (some start at g),
    #                         "span_first" / "span" (a span of one site: start its buffer / update it in place)
    rates: str = "constant"  # "constant", "warm" (first steps take a positive target whole), "adaptive"
    correct: bool = True  # Lin et al.'s correction where the target may be <= 0
    trust: bool = False  # sampled statistics with max_step: the trust regions
    floor: bool = False  # the family's least precision
    damping: bool = False
    guarded: bool = False  # a Newton step under the safeguard (at the mean)
    guard_clip: bool = False  # ... while damped, also at most max_step standard deviations
    signs: bool = False  # sampled statistics: keep the signs of g (the stall test)
    far: bool = False  # ... and count the elements far with the last step's signs
    spread: bool = False  # the watch on growing means: sum lambda_0 (mu - m_0)^2
    known_scale: bool = True  # sigma given (else read from the raw scale)
    fast_scale: bool = True  # the transform is scales.FastSoftplus or FastExp (else its own methods)
    exp_scale: bool = False  # ... and it is FastExp: sigma = exp(r)
    branch_free: bool = False  # no branch on tensor values (compiled)
    at_most_one: bool = False  # every new sigma <= 1 (a floor >= 1): the raw scale by its series alone
    in_place: bool = False  # the new mean and raw scale written into ``mean`` and ``raw_scale`` (compiled)
    masked: bool = False  # written only if ``ok`` (a 0-d flag: the statistics are finite; pyro_ngvi.checks)
    prepared: bool = False  # grad and curvature are the rule's g and target already (noise_pass ran on them)
    recover: bool = False  # grad and curvature are the gradients of loc and raw scale: recover g and h from them
    recover_draws: bool = False  # ... and the draws
    kept: bool = False  # a run's two passes (eager, adaptive): w.precision, w.scale and w.c are spans of
    #                     site-long buffers; the first writes lambda, lambda^-1/2 and the innovation, the second reads them


class Inputs(NamedTuple):
    """The group's flat tensors (a span of them for a large site); ``None`` where not used.
    ``grad`` and ``curvature`` are this step's, written over."""

    mean: torch.Tensor
    raw_scale: torch.Tensor
    grad: torch.Tensor
    curvature: torch.Tensor
    scale: Optional[torch.Tensor] = None  # sigma the ELBO read, else the one NGVI wrote
    prior_loc: Optional[torch.Tensor] = None
    prior_precision: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    floor: Optional[torch.Tensor] = None
    eps_mean: Optional[torch.Tensor] = None
    eps_sq_mean: Optional[torch.Tensor] = None
    known: Optional[torch.Tensor] = None  # elements whose precision stands for a curvature (control variate)
    momentum: Optional[torch.Tensor] = None  # the old average (or drift) buffer: eagerly updated in place
    started: Optional[torch.Tensor] = None  # "mixed" momentum: elements of sites with a buffer
    fresh: Optional[torch.Tensor] = None  # "warm": elements of sites not started; "adaptive": without hdrift
    last_signs: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None  # the adaptive steps' count, running mean, pooled noise
    drift: Optional[torch.Tensor] = None
    hdrift: Optional[torch.Tensor] = None
    excess: Optional[torch.Tensor] = None  # the part of earlier curvature targets clipped off, carried over
    noise: Optional[NoiseState] = None
    levels: Optional[tuple] = None  # the adaptive steps' pooled noise, pooled over all spans (prepared)
    ok: Optional[torch.Tensor] = None  # masked: whether to write at all
    out_mean: Optional[torch.Tensor] = None  # where to write mu', the raw scale and sigma (else new tensors)
    out_raw_scale: Optional[torch.Tensor] = None
    out_scale: Optional[torch.Tensor] = None


class Numbers(NamedTuple):
    """The step's numbers."""

    lr: float
    beta: float
    rho: float = 0.0
    damping: float = 0.0
    tau: float = 1.0
    max_step: Optional[float] = None
    factor: float = 1.0  # the Newton guard's damping
    first_count: float = 0.0  # the count a new element starts from (adaptive steps)


class Outputs(NamedTuple):
    """What the pass returns: the new mean, raw scale and :math:`\\sigma'`
    (``None`` for a masked group), the new momentum average, the flags' inputs as 0-d tensors,
    and the adaptive steps' new state. Written into ``out_*`` where given."""

    mean: torch.Tensor
    raw_scale: torch.Tensor
    scale: Optional[torch.Tensor]
    momentum: Optional[torch.Tensor]
    clamped: torch.Tensor
    signs: Optional[torch.Tensor] = None
    far: Optional[torch.Tensor] = None  # elements far with the last signs (the mask's only)
    spread: Optional[torch.Tensor] = None  # sum lambda_0 (mu - m_0)^2
    predicted: Optional[torch.Tensor] = None  # guarded: (sum numerator * step, sum lambda' step^2)
    adaptive: Optional[AdaptiveSteps] = None


class Scratch(NamedTuple):
    """Buffers of the pass's length for its temporaries, by role (:class:`~pyro_ngvi.groups.Workspace`:
    made once, so that a step allocates nothing; each ``None`` where the pass may allocate, as
    compiled). Their values do not outlive the pass."""

    precision: Optional[torch.Tensor] = None
    new_precision: Optional[torch.Tensor] = None
    deviation: Optional[torch.Tensor] = None
    pull: Optional[torch.Tensor] = None
    direction: Optional[torch.Tensor] = None
    rate: Optional[torch.Tensor] = None
    denominator: Optional[torch.Tensor] = None
    step: Optional[torch.Tensor] = None
    mean: Optional[torch.Tensor] = None
    raw: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    a: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None
    c: Optional[torch.Tensor] = None
    lr: Optional[torch.Tensor] = None  # the adaptive steps' per-element lr
    held: Optional[torch.Tensor] = None  # ... and their new count
    sigma: Optional[torch.Tensor] = None
    eps: Optional[torch.Tensor] = None  # the recovered draws (recover_draws)
    eps_sq: Optional[torch.Tensor] = None
    flag: Optional[torch.Tensor] = None  # 0 / 1 masks (comparisons into floats are vectorised, into
    flag2: Optional[torch.Tensor] = None  # bools they are not, nor bool-to-float casts: 4-10x slower
    flag3: Optional[torch.Tensor] = None  # on the CPU)
    signs: Optional[torch.Tensor] = None  # of g (the caller keeps them after the pass)
    ab: Optional[torch.Tensor] = None  # (2, n): the rows a and b


#: The dtypes whose far elements are counted by a dot of the two flags (its sums of 0 / 1 exact below 2^24).
_DOT = (torch.float32, torch.float64)
#: The number of buffers of :class:`Scratch` (``ab`` aside: a view of two of them).
SCRATCH_FLOATS = 23
NO_SCRATCH = Scratch()


def mean_field_pass(b: Branches, t: Inputs, n: Numbers, transform, w: Scratch = NO_SCRATCH) -> Outputs:
    """
    One mean-field step of the group, element by element (the equations of
    :mod:`~pyro_ngvi.update.mean_field` with the pieces of the layers around them):

    .. math:: \\hat g, \\hat h \\xrightarrow{\\text{control variate}} \\hat\\lambda = \\lambda_0 + \\hat h,
              \\quad \\bar g \\leftarrow \\rho\\bar g + (1-\\rho)\\hat g, \\quad (\\beta_t, \\alpha_t),
              \\quad \\lambda' = \\mathrm{clamp}((1-\\beta_t)\\lambda + \\beta_t\\hat\\lambda\\,[+\\text{Lin}]),
              \\quad \\mu' = \\mu - \\alpha_t\\frac{\\bar g + \\lambda_0(\\mu - m_0)}{\\lambda' + \\gamma},
              \\quad r' = T^{-1}(\\lambda'^{-1/2}).

    ``transform`` maps the raw scale to :math:`\\sigma`; the temporaries go into the
    buffers of ``w`` (eagerly: :class:`Scratch`), and where ``t`` names outputs
    (``out_*``, the momentum buffer) the results are written there.
    """
    mean, mask = t.mean, t.mask
    adaptive = b.rates == "adaptive"
    if b.branch_free:  # (compiled: no input is changed but those written; the copies are fused away)
        t = t._replace(grad=t.grad.clone(), curvature=t.curvature.clone())
        w = NO_SCRATCH
    precision, grad, target, root = _prepare(b, t, n, transform, w)
    if b.branch_free:  # (compiled: as it was)
        root = None
    elif adaptive and root is None:  # (read again by the trust region's radius)
        root = torch.rsqrt(precision, out=w.scale)
    prior_precision = t.prior_precision if b.prior else None
    direction = _momentum(b, t, grad, n.rho, w)
    pull = dot = None  # the exact prior's gradient, lambda_0 (mu - m_0)
    if b.prior:
        deviation = torch.sub(mean, t.prior_loc, out=w.deviation)
        if mask is None:
            pull = torch.mul(deviation, prior_precision, out=w.pull)
            if b.spread:  # the watch on growing means (pyro_ngvi.monitor)
                dot = torch.dot(pull, deviation)
        else:
            pull = deviation.mul_(prior_precision)
        del deviation

    # the step sizes
    steps = None
    if adaptive:
        steps = adaptive_rates(grad, direction, t.drift, pull, target, precision, t.count, t.hdrift, t.fresh, mask,
                               t.noise, n.lr, n.beta, n.rho, _adaptive_scratch(b, t, w), t.levels, root,
                               w.c if b.prepared and b.kept else None)
        step_beta, step_lr = steps.beta, steps.lr
    elif b.rates == "warm":
        step_beta, step_lr = warm_start_rates(t.fresh, target, precision, n.beta, n.lr, out=w.rate)
    else:
        step_beta, step_lr = n.beta, n.lr

    # the precision, and its safeguards
    new_precision = precision_step(precision, target, step_beta, correct=b.correct, out=w.new_precision,
                                   scratch=(w.a, w.flag))
    del target
    if b.trust:  # trust region on the precision too
        new_precision = precision_trust_region(new_precision, precision, prior_precision, scratch=(w.a, w.b))
    clamped, lowest = clamp_precision_(new_precision, t.floor if b.floor else None)
    denominator = torch.add(new_precision, n.damping, out=w.denominator) if b.damping else new_precision
    signs = far = None
    if b.signs:  # the stall test: |g| sigma beyond FAR with the last step's sign
        if pull is not None:  # (of the whole gradient: at the optimum g = -lambda_0 (mu - m_0), not 0)
            grad = torch.add(grad, pull, out=w.step)
        signs = _flag(torch.gt, grad, 0, w.signs)  # (0 / 1 in g's dtype)
        if b.far:
            # (counted by a dot of the two flags: one pass less than their product's sum)
            if mask is None and not b.branch_free and grad.numel() < 1 << 24 and grad.dtype in _DOT:
                far = torch.dot(*far_elements(grad, precision, signs, t.last_signs, scratch=(w.a, w.b),
                                              flags=(w.flag, w.flag2), product=False))  # (exact: integers < 2^24)
            else:
                far = far_elements(grad, precision, signs, t.last_signs, scratch=(w.a, w.b), flags=(w.flag, w.flag2))
                far = far if mask is None else far.mul_(mask)
                far = _count(far)  # (a float sum, exact below 2^24 elements (else in float64))

    # the mean, and its safeguards
    predicted = None
    out_mean = _out(b, t.out_mean, mean, w.mean)
    if b.trust:  # the trust region bounds the step, to max_step sd or the prior's exact part where longer
        if root is None:
            radius, low = precision.rsqrt_().mul_(n.max_step), None
        else:  # (sigma's bounds of the step, +-max_step sigma: rounding is symmetric)
            radius, low = torch.mul(root, n.max_step, out=precision), torch.mul(root, -n.max_step, out=root)
        new_mean = trusted_mean_step(mean, direction, pull, denominator, step_lr, radius, out=out_mean,
                                     scratch=w.step, low=low)
    elif b.guarded:  # a Newton step (at the mean) damped by the safeguard
        numerator = direction if pull is None else pull.add_(direction)
        step = torch.mul(numerator, step_lr, out=w.step).div_(denominator)
        if b.guard_clip:  # while damped, also at most max_step standard deviations (before the step)
            step = clip_(step, precision.rsqrt_().mul_(n.max_step))
        predicted = ((numerator * step).sum(), (new_precision * step.square()).sum())
        new_mean = torch.sub(mean, step, out=out_mean)
    else:  # mu - lr (g + lambda_0 (mu - m_0)) / (lambda' + gamma) in one kernel
        new_mean = mean_step(mean, direction, pull, denominator, step_lr, out=out_mean, scratch=w.step)
    del precision, pull, denominator
    if b.masked:  # a step with non-finite statistics writes nothing
        new_mean = torch.where(t.ok, new_mean, mean)
        if t.out_mean is not None:
            new_mean = t.out_mean.copy_(new_mean)
    elif b.in_place and new_mean is not mean:  # (compiled)
        new_mean = mean.copy_(new_mean)

    # sigma' = lambda'^-1/2, and as a raw scale (the guide's own parameter: what Predictive, the
    # param store and Adam see; its bijection gives sigma' back to an ulp or two). NGVI remembers
    # sigma' itself for the next reader (the next step, the fast path; saved with its state)
    new_scale = torch.rsqrt(new_precision, out=w.scale if b.masked else None if b.branch_free else t.out_scale)
    new_raw = _inverse(b, transform, new_scale, _out(b, t.out_raw_scale, t.raw_scale, w.raw), lowest,
                       scratch=(w.a, w.b, w.c))
    if b.masked:
        new_raw = torch.where(t.ok, new_raw, t.raw_scale)
        if t.out_raw_scale is not None:
            new_raw = t.out_raw_scale.copy_(new_raw)
    elif b.in_place and new_raw is not t.raw_scale:  # (compiled)
        new_raw = t.raw_scale.copy_(new_raw)
    read = None
    if mask is None:
        read = new_scale
        if b.masked:  # (the old sigma, bit for bit)
            read = torch.where(t.ok, read, t.scale if b.known_scale else _forward(b, transform, t.raw_scale))
        if t.out_scale is not None and read is not t.out_scale:
            read = t.out_scale.copy_(read)
    if b.masked:
        direction, clamped, signs, far, steps = _unchanged(b, t, direction, clamped, signs, far, steps)
    if b.branch_free:  # (compiled: the state written into its buffers by the same loop, not copied after)
        direction, steps = _write_state(b, t, direction, steps)
    return Outputs(new_mean, new_raw, read, None if b.momentum == "none" else direction, clamped, signs, far,
                   dot, predicted, steps)


def _prepare(b: Branches, t: Inputs, n: Numbers, transform, w: Scratch):
    """The precision and the step's statistics as the rule takes them (in place on ``t.grad`` and
    ``t.curvature``): :math:`\\lambda`, :math:`\\hat g` and the target :math:`\\hat\\lambda` (tempered,
    the control variate subtracted, the prior added, an outlier clipped); ``prepared``: done before,
    by :func:`noise_pass` (only the precision is read again; ``kept``: not even that). Returns also
    :math:`\\lambda^{-1/2}` where computed (else ``None``)."""
    if b.prepared and b.kept:  # (the first pass's, in its buffers)
        return w.precision, t.grad, t.curvature, w.scale
    # the precision the ELBO read this step (else the one NGVI wrote, else the raw scale's)
    if b.known_scale:
        precision = torch.pow(t.scale, -2, out=w.precision)
    elif not b.recover:
        precision = _forward(b, transform, t.raw_scale, out=w.precision, scratch=(w.a, w.b)).pow_(-2)
    grad, curvature = t.grad, t.curvature
    if b.recover and not b.known_scale:  # (the recovery reads sigma)
        sigma = _forward(b, transform, t.raw_scale, out=w.sigma, scratch=(w.a, w.b))
        precision = torch.pow(sigma, -2, out=w.precision)
    root = None  # lambda^-1/2, where computed (the control variate's; w.scale)
    if b.prepared:
        return precision, grad, curvature, root
    if b.recover:
        t = _recover(b, t, t.scale if b.known_scale else sigma, w)
        grad, curvature = t.grad, t.curvature
    prior_precision = t.prior_precision if b.prior else None
    if b.tau:  # from here g / tau and h / tau
        grad, curvature = grad.div_(n.tau), curvature.div_(n.tau)
    adaptive = b.rates == "adaptive"
    if b.control_variate:
        if adaptive:
            known, baseline = _flag(torch.gt, t.count, n.first_count, w.flag3), t.drift
        else:
            known, baseline = t.known, None
        if t.eps_sq_mean is None:  # (a curvature exact at the draws: the gradient's control variate alone)
            eps_sq_minus_one = None
        else:
            eps_sq_minus_one = t.eps_sq_mean.sub(1.0) if b.branch_free else t.eps_sq_mean.sub_(1.0)
        root = control_variate(grad, curvature, t.eps_mean, eps_sq_minus_one, precision, prior_precision, known,
                               baseline, scratch=(w.a, w.scale, w.c))
    target = precision_target(curvature, prior_precision)
    if adaptive:  # an outlier clipped, the clipped part carried to the next steps (state: excess)
        excess = t.excess
        in_place = excess is not None and not (b.branch_free or b.masked or t.mask is not None)
        target, new_excess = clip_target(target, precision, excess, out=excess if in_place else None,
                                         scratch=(w.a, w.b), count=t.count, prior_precision=prior_precision)
        if new_excess is not None:  # carried only while averaging (n > 1/beta): a transient's is dropped
            new_excess.mul_(_flag(torch.gt, t.count, 1.0 / n.beta, w.flag3))
        if new_excess is not None and not in_place:  # (rows not touched, or a step not taken: kept)
            if t.mask is not None:
                new_excess = torch.where(t.mask, new_excess, excess)
            if b.masked:
                new_excess = torch.where(t.ok, new_excess, excess)
            excess.copy_(new_excess)
    return precision, grad, target, root


def _recover(b: Branches, t: Inputs, sigma: torch.Tensor, w: Scratch) -> Inputs:
    """The statistics from the gradients of the loc and the raw scale (``t.grad``, ``t.curvature``,
    written over), as :func:`~pyro_ngvi.statistics.reparam_curvature` recovers them: :math:`g`,
    :math:`h = (\\nabla_\\sigma + 1/\\sigma)/\\sigma` and, with ``recover_draws``, the draws
    :math:`\\epsilon = \\sigma h / g` (those that cannot be one: 0) and their squares."""
    grad, curvature = t.grad, t.curvature
    if b.exp_scale:  # d sigma / d r: sigma for the exponential, sigmoid(r) for the softplus
        curvature.div_(sigma)
    else:
        curvature.div_(torch.sigmoid(t.raw_scale, out=w.a))
    inverse = torch.reciprocal(sigma, out=w.a)
    curvature.add_(inverse).mul_(inverse)
    if not b.recover_draws:
        return t
    eps = torch.mul(curvature, sigma, out=w.eps).div_(grad)
    keep = _flag(torch.le, torch.abs(eps, out=w.a), EPS_MAX, w.flag)
    eps = eps.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(keep)
    eps_sq = _flag(torch.eq, eps, 0, w.eps_sq)  # 1 where the draw is unknown, and + eps^2
    return t._replace(eps_mean=eps, eps_sq_mean=eps_sq.addcmul_(eps, eps))


def noise_pass(b: Branches, t: Inputs, n: Numbers, transform, w: Scratch = NO_SCRATCH):
    """
    The first of two passes over a large site under the adaptive steps, whose noise is pooled
    over the whole site before any element steps: the statistics prepared in place
    (``_prepare``; the second pass, ``prepared``, takes them as they are) and the sums of the
    squared innovations over the elements seen, with their count
    (:func:`~pyro_ngvi.policies.noise_sums`), for this span.
    """
    precision, grad, target, root = _prepare(b, t, n, transform, w)
    drift = t.momentum if b.momentum != "none" else t.drift
    sigma = torch.rsqrt(precision, out=w.scale) if root is None else root
    _, squares = innovations(target, precision, grad, drift, t.hdrift, sigma, (w.c, w.ab), bounded=b.prior)
    return noise_sums(squares, seen_elements(t.fresh, t.mask, w.flag), t.noise.lengths)


def _write_state(b: Branches, t: Inputs, direction, steps):
    """The new momentum and adaptive counts written into the group's buffers they were read from
    (what :func:`~pyro_ngvi.group_io.keep_pass` would copy there after the pass)."""
    if b.momentum in ("average", "mixed") and direction is not t.momentum:
        direction = t.momentum.copy_(direction)
    if steps is not None:  # (made anew, not ``_replace``d: torch 2.11's dynamo cannot return a _replace's tuple)
        steps = AdaptiveSteps(steps.beta, steps.lr, t.count.copy_(steps.count), t.hdrift.copy_(steps.hdrift),
                              None if steps.drift is None else t.drift.copy_(steps.drift), steps.steps, steps.noise)
    return direction, steps


def _unchanged(b: Branches, t: Inputs, direction, clamped, signs, far, steps):
    """The state a masked step keeps: its new values where ``ok``, else the old ones (a first
    momentum average starts at 0), and flags that do not count."""
    ok = t.ok
    if b.momentum == "average":
        direction = torch.where(ok, direction, t.momentum)
    elif b.momentum == "mixed":
        direction = torch.where(ok, direction, t.momentum * t.started)
    if signs is not None and t.last_signs is not None:
        signs = torch.where(ok, signs, t.last_signs)
    if far is not None:
        far = torch.where(ok, far, torch.zeros_like(far))
    if steps is not None:
        noise = t.noise
        steps = AdaptiveSteps(
            steps.beta, steps.lr, torch.where(ok, steps.count, t.count), torch.where(ok, steps.hdrift, t.hdrift),
            None if steps.drift is None else torch.where(ok, steps.drift, t.drift),
            torch.where(ok, steps.steps, noise.steps), torch.where(ok, steps.noise, noise.noise))
    return direction, clamped & ok, signs, far, steps


def _flag(compare, x, y, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``compare(x, y)`` as 0 / 1 in ``x``'s dtype (into ``out`` where given)."""
    if out is None:
        return compare(x, y).to(x.dtype)
    return compare(x, y, out=out)


def _count(flags: torch.Tensor) -> torch.Tensor:
    """The number of set ``flags``, as a float sum (exact)."""
    if flags.dtype == torch.float32 and flags.numel() >= 1 << 24:
        return flags.sum(dtype=torch.float64)
    return flags.sum()


def _adaptive_scratch(b: Branches, t: Inputs, w: Scratch) -> AdaptiveScratch:
    """The pass's buffers that :func:`~pyro_ngvi.policies.adaptive_rates` may use: those the pass
    writes only after it (its steps ``beta``, ``lr`` and new ``count`` survive it), and the
    state's own tensors for the new state (not in a masked pass: the old state is kept there)."""
    if w.precision is None:
        return AdaptiveScratch()
    own = not b.masked
    return AdaptiveScratch(
        rate=w.step, sigma=w.scale, innovation=w.c, pair=w.ab, z=w.denominator, grown=w.new_precision, held=w.held,
        weight=w.raw, beta=w.rate, lr=w.lr, count=t.count if own else None, hdrift=t.hdrift if own else None,
        drift=t.drift if own and b.momentum == "none" else None, seen=w.flag, flag=w.flag2, flag2=w.flag3)


def _out(b: Branches, given, own, scratch):
    """Where the pass writes a result: eagerly ``given`` (an ``out_*`` input), else the input's
    ``own`` tensor (``in_place``), else ``scratch``; a masked pass always ``scratch`` (the old
    value is selected back where the step is not good); compiled, nowhere (new tensors)."""
    if b.branch_free:
        return None
    if b.masked:
        return scratch
    if given is not None:
        return given
    return own if b.in_place else scratch


def _momentum(b: Branches, t: Inputs, grad, rho, w: Scratch):
    """The mean-gradient average :math:`\\bar g` (:func:`~pyro_ngvi.update.mean_field.momentum`), into the
    momentum buffer (eagerly; a masked step: a scratch buffer, the buffer kept until it is known good)."""
    if b.momentum == "none":
        return grad
    if b.momentum == "span_first":
        return momentum(grad, None, rho, out=t.momentum)
    if b.momentum == "span":
        return momentum(grad, t.momentum, rho, out=t.momentum)
    out = None if b.branch_free else w.direction if b.masked else t.momentum
    return momentum(grad, t.momentum, rho, started=t.started if b.momentum == "mixed" else None, mask=t.mask,
                    out=out, scratch=None if b.masked else w.direction)


def _forward(b: Branches, transform, raw, out=None, scratch=(None, None)):
    """:math:`\\sigma` from the raw scale (into ``out`` where given)."""
    if b.exp_scale:
        return torch.exp(raw, out=out)
    if b.branch_free and b.fast_scale:
        return softplus_branch_free(raw)
    if b.fast_scale:
        return transform._call(raw, None, out, scratch)
    sigma = transform(raw)
    return sigma if out is None else out.copy_(sigma)


def _inverse(b: Branches, transform, new_scale, out, lowest, scratch=(None, None, None)):
    """The raw scale of :math:`\\sigma'` (into ``out`` where given)."""
    if b.exp_scale:
        return torch.log(new_scale, out=out)
    if not b.fast_scale:
        raw = transform.inv(new_scale)
        return raw if out is None else out.copy_(raw)
    if b.branch_free:
        return softplus_inverse_branch_free(new_scale, b.at_most_one)
    return transform.inverse_and_log(new_scale, out, lowest.rsqrt(), scratch)[0]
