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
the chain's own operations, in place wherever a value is not needed again.
"""

from typing import NamedTuple, Optional

import torch

from .policies import AdaptiveSteps, NoiseState, adaptive_rates, warm_start_rates
from .safeguards import clamp_precision_, clip_, clip_target, far_elements, precision_trust_region
from .scales import softplus_branch_free, softplus_inverse_branch_free
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
    fast_scale: bool = True  # the transform is scales.FastSoftplus (else its own methods)
    branch_free: bool = False  # no branch on tensor values (compiled)
    at_most_one: bool = False  # every new sigma <= 1 (a floor >= 1): the raw scale by its series alone
    in_place: bool = False  # the new mean and raw scale written into ``mean`` and ``raw_scale`` (compiled)
    masked: bool = False  # written only if ``ok`` (a 0-d flag: the statistics are finite; pyro_ngvi.checks)


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
    momentum: Optional[torch.Tensor] = None  # the old average (or drift) buffer
    started: Optional[torch.Tensor] = None  # "mixed" momentum: elements of sites with a buffer
    fresh: Optional[torch.Tensor] = None  # "warm": elements of sites not started; "adaptive": without hdrift
    last_signs: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None  # the adaptive steps' count, running mean, pooled noise
    drift: Optional[torch.Tensor] = None
    hdrift: Optional[torch.Tensor] = None
    noise: Optional[NoiseState] = None
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
    """What the pass returns: the new mean, raw scale and :math:`\\sigma` read back from it
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


def mean_field_pass(b: Branches, t: Inputs, n: Numbers, transform) -> Outputs:
    """
    One mean-field step of the group, element by element (the equations of
    :mod:`~pyro_ngvi.update.mean_field` with the pieces of the layers around them):

    .. math:: \\hat g, \\hat h \\xrightarrow{\\text{control variate}} \\hat\\lambda = \\lambda_0 + \\hat h,
              \\quad \\bar g \\leftarrow \\rho\\bar g + (1-\\rho)\\hat g, \\quad (\\beta_t, \\alpha_t),
              \\quad \\lambda' = \\mathrm{clamp}((1-\\beta_t)\\lambda + \\beta_t\\hat\\lambda\\,[+\\text{Lin}]),
              \\quad \\mu' = \\mu - \\alpha_t\\frac{\\bar g + \\lambda_0(\\mu - m_0)}{\\lambda' + \\gamma},
              \\quad r' = T^{-1}(\\lambda'^{-1/2}).

    ``transform`` maps the raw scale to :math:`\\sigma`.
    """
    mean, grad, curvature, mask = t.mean, t.grad, t.curvature, t.mask
    if b.branch_free:  # (compiled: no input is changed but those written; the copies are fused away)
        grad, curvature = grad.clone(), curvature.clone()
    # the precision the ELBO read this step (else the one NGVI wrote, else the raw scale's)
    if b.known_scale:
        precision = t.scale.pow(-2)
    else:
        precision = _forward(b, transform, t.raw_scale).pow_(-2)
    prior_precision = t.prior_precision if b.prior else None
    if b.tau:  # from here g / tau and h / tau
        grad, curvature = grad.div_(n.tau), curvature.div_(n.tau)
    adaptive = b.rates == "adaptive"
    if b.control_variate:
        if adaptive:
            known, baseline = t.count > n.first_count, t.drift
        else:
            known, baseline = t.known, None
        control_variate(grad, curvature, t.eps_mean, t.eps_sq_mean.sub(1.0), precision, prior_precision, known,
                        baseline)
    target = precision_target(curvature, prior_precision)
    if adaptive:
        target = clip_target(target, precision)
    direction = _momentum(b, t, grad, n.rho)
    pull = dot = None  # the exact prior's gradient, lambda_0 (mu - m_0)
    if b.prior:
        deviation = mean - t.prior_loc
        if mask is None:
            pull = deviation * prior_precision
            if b.spread:  # the watch on growing means (pyro_ngvi.monitor)
                dot = torch.dot(pull, deviation)
        else:
            pull = deviation.mul_(prior_precision)
        del deviation

    # the step sizes
    steps = None
    if adaptive:
        steps = adaptive_rates(grad, direction, t.drift, pull, target, precision, t.count, t.hdrift, t.fresh, mask,
                               t.noise, n.lr, n.beta, n.rho)
        step_beta, step_lr = steps.beta, steps.lr
    elif b.rates == "warm":
        step_beta, step_lr = warm_start_rates(t.fresh, target, precision, n.beta, n.lr)
    else:
        step_beta, step_lr = n.beta, n.lr

    # the precision, and its safeguards
    new_precision = precision_step(precision, target, step_beta, correct=b.correct, fused=b.branch_free)
    del target
    if b.trust:  # trust region on the precision too
        new_precision = precision_trust_region(new_precision, precision, prior_precision)
    clamped, lowest = clamp_precision_(new_precision, t.floor if b.floor else None)
    denominator = new_precision + n.damping if b.damping else new_precision
    signs = far = None
    if b.signs:  # the stall test: |g| sigma beyond FAR with the last step's sign
        signs = grad > 0
        if b.branch_free:  # (compiled: 0 / 1 in g's dtype; inductor's CPU loops move bools slowly)
            signs = signs.to(grad.dtype)
        if b.far:
            far = far_elements(grad, precision, signs, t.last_signs)
            far = far if mask is None else far & mask
            # (compiled: a float sum, exact below 2^24 elements (else in float64); no int64 vectors)
            far = _count(far) if b.branch_free else torch.count_nonzero(far)

    # the mean, and its safeguards
    predicted = None
    if b.trust:  # the trust region bounds the likelihood part of the step, not the prior's
        new_mean = trusted_mean_step(mean, direction, pull, denominator, step_lr,
                                     precision.rsqrt_().mul_(n.max_step))
    elif b.guarded:  # a Newton step (at the mean) damped by the safeguard
        numerator = direction if pull is None else pull.add_(direction)
        step = numerator.mul(step_lr).div_(denominator)
        if b.guard_clip:  # while damped, also at most max_step standard deviations (before the step)
            step = clip_(step, precision.rsqrt_().mul_(n.max_step))
        predicted = ((numerator * step).sum(), (new_precision * step.square()).sum())
        new_mean = step.neg_().add_(mean)
    else:  # mu - lr (g + lambda_0 (mu - m_0)) / (lambda' + gamma) in one kernel
        new_mean = mean_step(mean, direction, pull, denominator, step_lr, out=t.out_mean)
    del precision, pull, denominator
    if b.masked:  # a step with non-finite statistics writes nothing
        new_mean = torch.where(t.ok, new_mean, mean)
    if t.out_mean is not None and new_mean is not t.out_mean:
        new_mean = t.out_mean.copy_(new_mean)
    if b.in_place:
        new_mean = t.mean.copy_(new_mean)

    # sigma' = lambda'^-1/2 as a raw scale, and sigma read back from it (what a reader of the raw
    # scale gets: the next step, the fast path, a process that loads the param store)
    if t.out_scale is None:
        new_scale = new_precision.rsqrt_()
    else:
        new_scale = torch.rsqrt(new_precision, out=t.out_scale)
    new_raw, small = _inverse(b, transform, new_scale, t.out_raw_scale, lowest)
    if b.masked:
        new_raw = torch.where(t.ok, new_raw, t.raw_scale)
    if t.out_raw_scale is not None and new_raw is not t.out_raw_scale:
        new_raw = t.out_raw_scale.copy_(new_raw)
    if b.in_place:
        new_raw = t.raw_scale.copy_(new_raw)
    read = None
    if mask is None:
        # (every sigma' <= 1 gives r' < 1: softplus need not look for its linear part)
        read = _forward(b, transform, new_raw, linear=False if small else None)
        if b.masked:  # (bit for bit the old sigma: not read again)
            read = torch.where(t.ok, read, t.scale if b.known_scale else _forward(b, transform, t.raw_scale))
        if t.out_scale is not None:
            read = t.out_scale.copy_(read)
    if b.masked:
        direction, clamped, signs, far, steps = _unchanged(b, t, direction, clamped, signs, far, steps)
    return Outputs(new_mean, new_raw, read, None if b.momentum == "none" else direction, clamped, signs, far,
                   dot, predicted, steps)


def _unchanged(b: Branches, t: Inputs, direction, clamped, signs, far, steps):
    """The state a masked step keeps: its new values where ``ok``, else the old ones (a first
    momentum average starts at 0), and flags that do not count."""
    ok = t.ok
    if b.momentum == "average":
        direction = torch.where(ok, direction, t.momentum)
    elif b.momentum == "mixed":
        direction = torch.where(ok, direction, torch.where(t.started, t.momentum, 0.0))
    if signs is not None and t.last_signs is not None:
        signs = torch.where(ok, signs, t.last_signs.to(signs.dtype))
    if far is not None:
        far = torch.where(ok, far, torch.zeros_like(far))
    if steps is not None:
        noise = t.noise
        steps = steps._replace(
            count=torch.where(ok, steps.count, t.count), hdrift=torch.where(ok, steps.hdrift, t.hdrift),
            drift=None if steps.drift is None else torch.where(ok, steps.drift, t.drift),
            steps=torch.where(ok, steps.steps, noise.steps), noise=torch.where(ok, steps.noise, noise.noise))
    return direction, clamped & ok, signs, far, steps


def _count(flags: torch.Tensor) -> torch.Tensor:
    """The number of set ``flags``, as a float sum (exact)."""
    dtype = torch.float32 if flags.numel() < 1 << 24 else torch.float64
    return flags.to(dtype).sum()


def _momentum(b: Branches, t: Inputs, grad, rho):
    """The mean-gradient average :math:`\\bar g` (:func:`~pyro_ngvi.update.mean_field.momentum`)."""
    if b.momentum == "none":
        return grad
    if b.momentum == "span_first":
        return momentum(grad, None, rho, out=t.momentum)
    if b.momentum == "span":
        return momentum(grad, t.momentum, rho, out=t.momentum)
    return momentum(grad, t.momentum, rho, started=t.started if b.momentum == "mixed" else None, mask=t.mask)


def _forward(b: Branches, transform, raw, linear=None):
    """:math:`\\sigma` from the raw scale."""
    if b.branch_free and b.fast_scale:
        return softplus_branch_free(raw)
    return transform._call(raw, linear) if b.fast_scale else transform(raw)


def _inverse(b: Branches, transform, new_scale, out, lowest):
    """The raw scale of :math:`\\sigma'` (into ``out`` where given), and whether every
    :math:`\\sigma' \\le 1` is known (eager: then the series was used)."""
    if not b.fast_scale:
        return transform.inv(new_scale), False
    if b.branch_free:
        return softplus_inverse_branch_free(new_scale, b.at_most_one), False
    # (its log sigma, of sigma before the round trip, tells that the series was used)
    new_raw, log_sigma = transform.inverse_and_log(new_scale, out, lowest.rsqrt())
    return new_raw, log_sigma is not None
