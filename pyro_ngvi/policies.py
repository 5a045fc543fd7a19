"""
Step sizes of the Bayesian learning rule: the settings NGVI resolves per site
(:func:`defaults`), schedules (:func:`check_schedule`), the first-step warm start
(:func:`warm_start_rates`) and the adaptive steps under sampled curvature
(:func:`adaptive_rates` for mean-field sites, :func:`dense_rates` and
:func:`dense_count` for full-covariance ones).

Every function maps the statistics of a step (and the policy's own state) to the
step sizes :math:`(\\beta_t, \\alpha_t)` of the precision average and the mean step;
none writes a guide. The adaptive steps are Polyak-Ruppert averaging once progress
stalls: each element keeps a count :math:`n` and steps with

.. math:: \\beta_t = 1/n, \\qquad \\alpha_t = \\alpha / (1 + \\alpha \\max(n - 1/\\beta, 0)),

so that past :math:`n = 1/\\beta` the natural parameters are running means of the
noisy targets; :math:`n` grows only while the running means of the innovations are
indistinguishable from noise, and halves where they drift (why and how they were picked:
:doc:`/guide/update`).
"""

import math
import numbers
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch

from .family import CURVATURE_PER_EXAMPLE
from .groups import select
from .safeguards import INNOVATION_MAX

Schedule = Union[float, Callable[[int], float]]

#: An element's count grows past 1/beta while z^2 = (running mean of g)^2 / (its variance)
#: is below STALL_Z2, and halves (down to 1/beta) above DRIFT_Z2 (z^2 is about chi-square(1)
#: when g is pure noise).
STALL_Z2 = 2.0
DRIFT_Z2 = 12.0
#: The pooled noise variances are running means over a site's steps, then forget at these
#: rates (a short and a long memory; the stall test uses the lower, the drift test the higher).
NOISE_RATES = (0.2, 0.02)
#: A drifting element's count is multiplied by FALLBACK (and kept at least 1/beta).
FALLBACK = 0.5
NOISE_FLOOR = 1e-12
#: Adaptive steps of a full-covariance site: the floor of its beta and lr (the longest
#: memory, 1 / DENSE_FLOOR steps, so a nonlinear model still tracks), and the rate of the
#: running means of its drift test.
DENSE_FLOOR = 0.005
DENSE_RATE = 0.1
#: A Newton step z whose ||z||^2 exceeds DENSE_OUTLIER times the running mean of ||z||^2 enters
#: the drift test's running means shortened to that length. A chi-square of D >= 1 degrees of
#: freedom is that far above its mean with probability < 1.3e-5; a heavy-tailed one-draw step far
#: from the optimum can be 1e10 times it, and its square, forgotten by a decade every
#: 2.3 / DENSE_RATE steps, would make every step of the next hundreds look like noise.
DENSE_OUTLIER = (2 - DENSE_RATE) / DENSE_RATE


class Settings(NamedTuple):
    """The step's hyperparameters for one kind of statistics (see :func:`defaults`)."""

    lr: float
    beta: float
    momentum: float
    damping: float


#: NGVI()'s defaults for full-batch statistics of mean-field sites (with the adaptive
#: steps, picked by benchmarks/tune_defaults.py).
FULL_BATCH = Settings(lr=1.0, beta=0.5, momentum=0.0, damping=0.0)
#: ... of full-covariance statistics that are not sampled and of Kronecker sites
#: (constant steps, as measured in benchmarks/full_covariance.py).
DENSE = Settings(lr=0.1, beta=0.05, momentum=0.0, damping=0.0)
#: ... of sampled (Price / Stein) curvature of a full-covariance site: the starting lr and
#: the rate beta its adaptive steps fall back to (picked by benchmarks/full_covariance.py
#: --tune on the D = 10 regression and Pyro's "exact" test model).
DENSE_SAMPLED = Settings(lr=1.0, beta=0.5, momentum=0.0, damping=0.0)
#: ... of minibatch statistics of a BayesianNet (SiteCurvature.num_data set; picked by
#: benchmarks/bnn_suite.py): the damping is per example, ``damping = num_data * MINIBATCH.damping``.
MINIBATCH = Settings(lr=0.3, beta=0.01, momentum=0.9, damping=CURVATURE_PER_EXAMPLE)


#: :data:`MINIBATCH` with its damping for each data size asked so far: ``(type, num_data) -> Settings``
_MINIBATCH_OF: Dict[tuple, Settings] = {}


def defaults(num_data: Optional[int] = None, dense: bool = False, sampled: bool = False) -> Settings:
    """
    NGVI's default ``lr``, ``beta``, momentum and damping for a site's statistics:
    minibatch estimates of sums over ``num_data`` examples (a BayesianNet's:
    :data:`MINIBATCH`, the damping ``num_data`` :math:`\\times h_0` with :math:`h_0` =
    :data:`~pyro_ngvi.family.CURVATURE_PER_EXAMPLE`), else full-batch statistics of
    a full-covariance or Kronecker site (``dense``: :data:`DENSE`) or of a mean-field
    site (:data:`FULL_BATCH`); a full-covariance site's sampled statistics (``dense`` and
    ``sampled``) take :data:`DENSE_SAMPLED`, the start of its adaptive steps. Why each
    value is what it is: :doc:`/guide/update` and :doc:`/guide/bnn`.
    """
    if num_data is not None:
        found = _MINIBATCH_OF.get((type(num_data), num_data))  # (keyed by type too: True == 1)
        if found is not None:
            return found
        if isinstance(num_data, bool) or not isinstance(num_data, numbers.Integral) or num_data < 1:
            raise ValueError(f"num_data must be a positive integer or None, got {num_data!r}")
        found = _MINIBATCH_OF[(type(num_data), num_data)] = MINIBATCH._replace(damping=num_data * MINIBATCH.damping)
        return found
    if dense:
        return DENSE_SAMPLED if sampled else DENSE
    return FULL_BATCH


def resolve(given: Settings, stats, dense: bool = False, sampled: bool = False) -> Settings:
    """The settings for a site with statistics ``stats``: each value ``given`` (``None``:
    not given), else the default for their kind (:func:`defaults`)."""
    default = defaults(getattr(stats, "num_data", None), dense, sampled)
    return Settings(*[d if g is None else g for g, d in zip(given, default)])


def check_schedule(name: str, value, low: float, high: float, low_open: bool = True, high_open: bool = False):
    """Validate a finite number in the interval, a Python, NumPy or one-element torch number (or
    leave a callable for step-time checks).

    :raises ValueError: naming ``name``, for anything else."""
    if callable(value):
        return value
    if torch.is_tensor(value) and value.numel() == 1 and not (value.dtype == torch.bool or value.is_complex()):
        value = value.item()  # (a one-element tensor is its number)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number or a callable of the step, got {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        bracket = "(" if low_open else "["
        closing = "]" if math.isfinite(high) and not high_open else ")"
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}{closing}, got {value}")
    return value


def number(name: str, value, low: float, high: float, what: str, low_open: bool = False,
           high_open: bool = False) -> float:
    """A number hyperparameter (no schedule) in its interval. :raises ValueError: naming it."""
    if callable(value):
        raise ValueError(f"{name} must be {what}, got a callable")
    return check_schedule(name, value, low, high, low_open=low_open, high_open=high_open)


class Checked:
    """An optimizer attribute checked by ``check(name, value)`` whenever it is set (in ``__init__``
    and later: ``optim.lr = 0.01`` between steps, the hand-written ReduceLROnPlateau, is checked too;
    a NaN there was written into the guide); ``None`` (the default) passes unchecked where ``optional``."""

    def __init__(self, check: Callable, optional: bool = True):
        self.check, self.optional = check, optional

    def __set_name__(self, owner, name):
        self.name = name

    # No ``__get__``: the checked value sits in the instance's ``__dict__`` under the same name, where
    # Python's attribute look-up finds it without a call (the step reads these every time).
    def __set__(self, obj, value):
        obj.__dict__[self.name] = None if value is None and self.optional else self.check(self.name, value)


def positive_numbers(name: str, value, one: bool = False) -> List[float]:
    """``value`` (``one``: or a single number) as a non-empty list of positive finite numbers.

    :raises ValueError: naming ``name``, for anything else (a string, ``None``, a bool)."""
    listed = [value] if one and isinstance(value, numbers.Real) else \
        [] if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) else list(value)
    if not listed or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < math.inf
                             for v in listed):
        raise ValueError(f"{name} must be a non-empty list of positive finite numbers{' (or one)' if one else ''}, "
                         f"got {value!r}")
    return [float(v) for v in listed]


def at_step(name: str, value, step: int, low: float, high: float) -> Optional[float]:
    """The value of a hyperparameter at ``step`` (a schedule called and checked; ``None``
    stays ``None``: its default, resolved per site)."""
    if callable(value):
        value = check_schedule(f"{name}({step})", value(step), low, high)
    return value


def scheduled(lr, beta, tau, step: int) -> Tuple[Optional[float], Optional[float], float]:
    """``lr``, ``beta`` and ``tau`` at ``step`` (:func:`at_step`)."""
    return (at_step("lr", lr, step, 0.0, math.inf), at_step("beta", beta, step, 0.0, 1.0),
            at_step("tau", tau, step, 0.0, math.inf))


# --------------------------------------------------------------------------- #
# Mean-field sites
# --------------------------------------------------------------------------- #


def first_count(beta: float, warm_start: bool) -> float:
    """The count a new element starts from: 0 (its first step takes the curvature
    target whole) with the warm start, else one short of :math:`1/\\beta`."""
    return 0.0 if warm_start else max(1.0 / beta - 1.0, 0.0)


def warm_start_rates(fresh: torch.Tensor, target: torch.Tensor, precision: torch.Tensor, beta: float,
                     lr: float, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, float]:
    """Constant steps, except that a site's first step takes the curvature target whole
    where it exceeds the precision (as VOGN initialises its precision from the first
    minibatch): :math:`\\beta_t = 1` there. ``fresh``: the elements of sites not yet started
    (0 / 1); ``out``: a buffer (default: a new tensor)."""
    whole = torch.gt(target, precision, out=out) if out is not None else torch.gt(target, precision).to(target.dtype)
    return select(whole.mul_(fresh), target.new_ones(()), target.new_full((), beta), out=whole), lr


class NoiseState(NamedTuple):
    """What the pooled noise of :func:`adaptive_rates` reads of a group of sites: per site, the steps
    that fed it and the two pooled variances (short, long memory), stacked, and the group's
    constants (site lengths, :data:`NOISE_RATES`, the ceilings), made once per group."""

    steps: torch.Tensor  # (sites,)
    noise: torch.Tensor  # (innovation, site, memory)
    lengths: torch.Tensor
    rates: torch.Tensor
    ceiling: torch.Tensor


class AdaptiveSteps(NamedTuple):
    """What :func:`adaptive_rates` returns: the per-element steps and the state to keep."""

    beta: torch.Tensor
    lr: torch.Tensor
    count: torch.Tensor
    hdrift: torch.Tensor
    drift: Optional[torch.Tensor]  # (None with momentum: the momentum buffer is the drift)
    steps: torch.Tensor
    noise: torch.Tensor


def noise_constants(sizes, dtype, device, subsampling: float = 0.0) -> Dict[str, torch.Tensor]:
    """The constants of :class:`NoiseState` for sites of ``sizes`` elements; the ceilings of the
    pooled noise (:func:`pooled_levels`) one draw's variances, 1 for :math:`g/\\sqrt\\lambda` and 2
    for :math:`(\\hat h - \\lambda)/\\lambda`, plus ``subsampling`` :math:`= N/B - 1` for a model
    whose data is subsampled: a sum over :math:`N` terms estimated from :math:`B` of them adds a
    variance of about :math:`N/B - 1` in these units (:math:`\\lambda \\approx N\\,E[h_i]
    \\approx N\\,E[g_i^2]` at the optimum), which is noise to average, not a drift."""
    return {
        "lengths": torch.tensor(sizes, device=device),
        "rates": torch.tensor(NOISE_RATES, dtype=dtype, device=device),
        "ceiling": torch.tensor([[1.0], [2.0]], dtype=dtype, device=device) + subsampling,
    }


class AdaptiveScratch(NamedTuple):
    """Buffers of the length for :func:`adaptive_rates` (``None`` each: new tensors). ``pair`` is
    ``(2, n)``; ``beta``, ``lr`` receive the step sizes, ``count``, ``hdrift``, ``drift`` the new
    state (they may be the old state's own tensors: updated in place, read before written)."""

    rate: Optional[torch.Tensor] = None
    sigma: Optional[torch.Tensor] = None
    innovation: Optional[torch.Tensor] = None
    pair: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    grown: Optional[torch.Tensor] = None
    held: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None
    lr: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None
    hdrift: Optional[torch.Tensor] = None
    drift: Optional[torch.Tensor] = None
    seen: Optional[torch.Tensor] = None  # (bool)
    flag: Optional[torch.Tensor] = None  # (bool)
    flag2: Optional[torch.Tensor] = None  # (bool)


def adaptive_rates(grad, direction, drift, pull, target, precision, count, hdrift, fresh, mask, noise: NoiseState,
                   lr: float, beta: float, momentum: float, w: AdaptiveScratch = AdaptiveScratch(),
                   levels=None, sigma=None, innovation=None) -> AdaptiveSteps:
    """
    Per-element steps from the measured signal-to-noise ratio of the two
    natural-gradient innovations, :math:`\\hat g` and :math:`(\\hat h - \\lambda)/\\lambda`:
    :math:`\\beta_t = 1/n`, :math:`\\alpha_t = \\alpha / (1 + \\alpha \\max(n - 1/\\beta, 0))`.
    The count :math:`n` grows by one per step up to :math:`1/\\beta`, beyond it only while
    the running means :math:`\\bar g, \\bar e` of both innovations are indistinguishable
    from zero,

    .. math:: z^2 = \\frac{\\bar g^2}{r\\,V_g} + \\frac{\\bar e^2}{r\\,V_e} < z^2_{\\rm stall}

    (:math:`r = 1/n` their averaging rate, :math:`V` the variances pooled over the site
    in standard-deviation units, :func:`pooled_noise`), and halves (down to :math:`1/\\beta`)
    where :math:`z^2 > z^2_{\\rm drift}`: a lasting drift is back at the constant steps in a few
    steps, one heavy-tailed draw only shortens the memory. ``hdrift`` and ``drift`` are the running means so
    far (``drift`` the momentum buffer with ``momentum``), ``fresh`` the elements without them
    yet (``None``: none). Returns :math:`(\\beta_t, \\alpha_t)` per element and the new count,
    running means and pooled noise (:class:`AdaptiveSteps`), written into the buffers of ``w``
    where given. ``levels``: the pooled noise (:func:`pooled_levels`) when it was pooled before
    (a large site's, over all its spans); ``sigma``: :math:`\\lambda^{-1/2}`, and ``innovation``:
    :math:`(\\hat h - \\lambda)/\\lambda` (with ``levels`` only), when the caller has them.
    No device sync, no branch on values.
    """
    base = 1.0 / beta
    grown = torch.add(count, 1.0, out=w.grown)  # (n + 1, read again below)
    rate = torch.reciprocal(grown, out=w.rate)
    if sigma is None:
        sigma = torch.rsqrt(precision, out=w.sigma)
    # innovations and their deviation from the running means so far (noise, pooled; the squares
    # only where they are pooled here)
    if innovation is None:
        innovation, squares = innovations(target, precision, grad, drift, hdrift, sigma, (w.innovation, w.pair),
                                          squared=levels is None, bounded=pull is not None)
    if levels is None:
        levels = pooled_noise(squares, seen_elements(fresh, mask, w.seen), noise)
    low, high, steps, pooled = levels
    old_hdrift, old_drift = hdrift, drift
    if momentum:
        drift, drift_rate = direction, 1.0 - momentum
    else:
        drift, drift_rate = torch.lerp(drift, grad, rate, out=w.drift if mask is None else None), rate
    hdrift = torch.lerp(hdrift, innovation, rate, out=w.hdrift if mask is None else None)
    if fresh is not None:  # (0 / 1: where fresh, the running means start at this step's values)
        drift = drift if momentum else torch.lerp(drift, grad, fresh, out=drift)
        hdrift = torch.lerp(hdrift, innovation, fresh, out=hdrift)
    if mask is not None:
        hdrift = torch.where(mask, hdrift, old_hdrift, out=w.hdrift)
        if not momentum:
            drift = torch.where(mask, drift, old_drift, out=w.drift)
    # (the deviations are pooled: their rows take the signal)
    signal = w.pair  # (None: stacked below)
    total = drift if pull is None else torch.add(drift, pull, out=None if signal is None else signal[0])
    if signal is None:
        signal = torch.stack([(total * sigma).square_().div_(drift_rate), hdrift.square().div_(rate)])
        stalled = signal.div(low).sum(0) < STALL_Z2  # noise at its lowest plausible value
        drifting = signal.div_(high).sum(0) > DRIFT_Z2  # and at its highest
    else:
        torch.mul(total, sigma, out=signal[0]).square_().div_(drift_rate)
        torch.square(hdrift, out=signal[1]).div_(rate)
        stalled = torch.lt(_row_sum(signal, low, w.z), STALL_Z2, out=w.flag)  # (0 / 1)
        drifting = torch.gt(_row_sum(signal, high, w.z), DRIFT_Z2, out=w.flag2)
    held = torch.clamp(count, min=base, out=w.held)
    new_count = select(stalled, grown, torch.minimum(grown, held, out=held), w.weight, out=held)
    # a drifting element halves its count (not below 1/beta): a drift that lasts falls back to
    # 1/beta within a few steps, one heavy-tailed draw only shortens the memory
    halved = torch.mul(count, FALLBACK, out=grown).clamp_(min=base)  # (grown is read: its buffer is free)
    new_count = select(drifting, halved, new_count, w.weight, out=held)
    # a first target that is not positive tells nothing of the precision: wait for one
    if w.flag is None:
        known = (count > 0) | (target > 0)
    else:
        # (fmax skips a NaN as the "or" of the two comparisons does: max(n, t) > 0 in two passes, not three)
        known = torch.gt(torch.fmax(count, target, out=w.flag2), 0, out=w.flag)
    if mask is None and w.count is not None:  # (into the state's own buffer: no copy after; count read above)
        new_count = select(known, new_count, count, w.weight, out=w.count)
    else:
        new_count = select(known, new_count, count, w.weight, out=held)
        if mask is not None:
            new_count = torch.where(mask, new_count, count, out=held)
        if w.count is not None:
            new_count = w.count.copy_(new_count)
    tiny = torch.finfo(new_count.dtype).tiny  # (1 / tiny is finite: the unselected value too)
    counted = torch.gt(new_count, 0) if w.flag is None else torch.gt(new_count, 0, out=w.flag)
    step_beta = select(counted, torch.clamp(new_count, min=tiny, out=w.beta).reciprocal_(),
                       new_count.new_tensor(beta), w.weight, out=w.beta)
    step_lr = torch.sub(new_count, base, out=w.lr).clamp_(min=0.0).mul_(lr).add_(1.0).reciprocal_().mul_(lr)
    return AdaptiveSteps(step_beta, step_lr, new_count, hdrift, None if momentum else drift, steps, pooled)


def seen_elements(fresh, mask, out=None):
    """The elements with running means so far (not ``fresh``, 0 / 1) that this step touches
    (``mask``, bool), 0 / 1, or ``None`` for all."""
    seen = None if fresh is None else torch.sub(1.0, fresh, out=out)
    if mask is not None:
        seen = mask if seen is None else seen.mul_(mask)
    return seen


def _row_sum(signal: torch.Tensor, noise: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``(signal / noise).sum(0)`` of two rows (``noise`` broadcast to them), into ``out``."""
    total = torch.div(signal[0], noise[0], out=out)
    return total.addcdiv_(signal[1], noise[1].expand_as(signal[1]))


def pooled_noise(squares, seen, state: NoiseState) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    The variances of the two innovations, per site: the mean over its elements
    ``seen`` this step of ``squares`` (one row per innovation), averaged over
    steps with a short and a long memory (:data:`NOISE_RATES`; a running mean until
    then). Returns the lower and the higher of the two, per element (shape
    ``squares.shape``, or ``(2, 1)`` for a group of one site), each at most the
    variance of a one-draw estimate at the fixed point (the rest is a transient,
    not noise), and the new steps and pooled variances of the sites. No device sync.
    """
    return pooled_levels(*noise_sums(squares, seen, state.lengths), state)


def noise_sums(squares, seen, lengths) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sums of ``squares`` (two rows) over each site's elements ``seen`` (all: ``None``), ``(2, sites)``,
    and their counts ``(sites,)``: what :func:`pooled_levels` averages (a large site sums them span by span)."""
    dtype = squares.dtype
    weights = None if seen is None else seen.to(dtype)
    if lengths.numel() == 1:  # (innovation, site = 1; the squares of a span of it)
        if weights is None:
            return squares.sum(1, keepdim=True), squares.new_full((1,), squares.shape[1])
        return torch.mv(squares, weights).unsqueeze(1), weights.sum().reshape(1)
    totals = torch.segment_reduce((squares if weights is None else squares * weights).T, "sum", lengths=lengths).T
    counts = lengths.to(dtype) if weights is None else torch.segment_reduce(weights, "sum", lengths=lengths)
    return totals, counts


def pooled_levels(totals, counts, state: NoiseState) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pooled_noise` from the sums of the squares and their counts (:func:`noise_sums`)."""
    dtype = totals.dtype
    lengths = state.lengths
    means = (totals / counts.clamp(min=1.0)).unsqueeze(-1)  # innovation, site, 1
    noise = state.noise
    touched = counts > 0
    steps = state.steps + touched.to(dtype)
    rate = torch.maximum(steps.reciprocal()[:, None], state.rates)
    new = torch.where(steps[:, None] <= 1, means, torch.lerp(noise, means, rate))  # the first whole
    noise = torch.where(touched[:, None], new, noise)
    low, high = noise.aminmax(dim=-1)
    # at most 1 for g / sqrt(lambda), 2 for (h - lambda) / lambda: one draw at lambda = h
    # and at least NOISE_FLOOR: a drift below a millionth of a standard deviation is none
    ceiling = state.ceiling
    low, high = (torch.minimum(n, ceiling).clamp_(min=NOISE_FLOOR) for n in (low, high))
    if lengths.numel() != 1:
        low, high = low.repeat_interleave(lengths, dim=1), high.repeat_interleave(lengths, dim=1)
    return low, high, steps, noise


def innovations(target, precision, grad, drift, hdrift, sigma, out=(None, None), squared: bool = True,
                bounded: bool = False):
    """The two innovations' deviations from their running means so far, in standard-deviation
    units, squared: :math:`((g - \\bar g)\\sigma)^2` and :math:`((\\hat h - \\lambda)/\\lambda - \\bar e)^2`
    (``out``: a buffer for the innovation :math:`(\\hat h - \\lambda)/\\lambda`, kept, and a
    ``(2, n)`` one for the squares; ``squared=False``: the innovation alone, the squares ``None``).
    With ``bounded`` (a target with an exact prior precision in it), the innovation is taken within
    :math:`\\pm` :data:`~pyro_ngvi.safeguards.INNOVATION_MAX`, the clip of the sampled part of :math:`\\hat h`
    (without a prior the target is within it already): a target that jumps to an exact prior precision
    :math:`\\lambda_0 \\gg \\lambda` (:func:`~pyro_ngvi.safeguards.clip_target`) is a transient, not noise
    (unclipped, :math:`\\lambda_0/\\lambda = 10^8` stayed in the long memory past step 150 and the noisy-curvature
    watch warned on a Normal mean under ``CurvatureELBO("hessian")``)."""
    innovation = torch.sub(target, precision, out=out[0]).div_(precision)
    if bounded:
        innovation = innovation.clamp_(-INNOVATION_MAX, INNOVATION_MAX)
    if not squared:
        return innovation, None
    if out[1] is None:
        return innovation, torch.stack([torch.sub(grad, drift).mul_(sigma), innovation - hdrift]).square_()
    squares = out[1]
    torch.sub(grad, drift, out=squares[0]).mul_(sigma)
    torch.sub(innovation, hdrift, out=squares[1])
    return innovation, squares.square_()


# --------------------------------------------------------------------------- #
# Full-covariance sites
# --------------------------------------------------------------------------- #


def dense_rates(settings: Settings, state, start: float = 1.0) -> Tuple[float, float, float]:
    """
    ``(lr, beta, n)`` of a full-covariance (or low-rank) site's adaptive step: with the
    site's count :math:`n` (``start`` at its first step: 1 takes the first target whole),

    .. math:: \\beta_t = \\max(1/n, \\beta_{\\min}), \\qquad
              \\alpha_t = \\max\\big(\\alpha / (1 + \\alpha \\max(n - 1/\\beta, 0)),
              \\beta_{\\min}\\big),

    :math:`\\beta_{\\min}` = :data:`DENSE_FLOOR`: once :math:`n` passes :math:`1/\\beta`
    the precision is the running mean of the curvature targets (for a Gaussian
    target, of unbiased estimates of its Hessian) and the mean the Polyak-Ruppert
    average of Newton steps.
    """
    lr, beta = settings.lr, settings.beta
    n = start if state.count is None else float(state.count.reshape(-1)[0])
    rate = max(1.0 / n, DENSE_FLOOR)
    step = max(lr / (1.0 + lr * max(n - 1.0 / beta, 0.0)), DENSE_FLOOR)
    return min(step, lr), min(rate, 1.0), n


def dense_count(settings: Settings, state, n: float, newton: torch.Tensor) -> Dict[str, torch.Tensor]:
    """
    The drift test of a full-covariance site's adaptive steps, on the Newton step
    in the new guide's standard deviations, :math:`z = C'^\\top \\bar g`
    (:math:`\\mathcal{N}(0, I/K)` at the optimum of a Gaussian target, :math:`K`
    particles): with running means :math:`\\bar z` and :math:`v` of :math:`z` and
    :math:`\\|z\\|^2` (rate :math:`\\rho` = ``DENSE_RATE``, started at the first
    step's), :math:`z^2 = \\|\\bar z\\|^2 (2 - \\rho) / (\\rho v)` is about 1 when
    :math:`z` is pure noise and :math:`(2 - \\rho)/\\rho` = 19 while the mean is far.
    The count grows to :math:`1/\\beta`, beyond that while :math:`z^2 <` 2, and falls
    back to :math:`1/\\beta` above 12 (the mean-field thresholds). A step with
    :math:`\\|z\\|^2 >` :data:`DENSE_OUTLIER` :math:`v` enters shortened to that length; one
    that overflows leaves the test as it was. The state to keep, with ``far_steps``, the steps in a
    row above 12 (the safeguards' stall test, :func:`~pyro_ngvi.safeguards.warn_dense_stall`).
    """
    rho = DENSE_RATE
    dtype = state.loc().dtype
    square = newton.square().sum()
    if not bool(torch.isfinite(square)):  # (an overflowing step tells nothing: the test keeps its state)
        return {"count": torch.full_like(newton, n, dtype=dtype), "drift": state.drift, "noise": state.noise}
    if state.drift is None:
        drift, power = newton, square
    else:
        cap = DENSE_OUTLIER * state.noise.to(square)
        if square > cap:
            newton, square = newton * (cap / square).sqrt(), cap
        drift = torch.lerp(state.drift.to(newton), newton, rho)
        power = torch.lerp(state.noise.to(square), square, rho)
    z2 = float(drift.square().sum() * (2 - rho) / (rho * power.clamp(min=NOISE_FLOOR)))
    fallback = 1.0 / settings.beta
    grown = n + 1.0 if (n < fallback or z2 < STALL_Z2) else n
    if z2 > DRIFT_Z2:
        grown = min(grown, max(fallback, 1.0))
    return {"count": torch.full_like(newton, grown, dtype=dtype), "drift": drift.to(dtype),
            "noise": power.to(dtype), "far_steps": state.far_steps + 1 if z2 > DRIFT_Z2 else 0}
