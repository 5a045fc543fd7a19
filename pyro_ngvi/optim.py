"""
:class:`NGVI`: the Bayesian learning rule for mean-field and full-covariance Gaussian guides, as a
:class:`pyro.optim.PyroOptim` that ``pyro.infer.SVI`` can drive.
"""

import copy
import math
import numbers
import warnings
import weakref
from dataclasses import replace
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import pyro
from pyro.infer import JitTrace_ELBO, Trace_ELBO
from pyro.optim.optim import PyroOptim

from . import full_covariance
from .checkpoint import safe_load
from .distributed import all_reduce_stats, is_distributed
from .family import CURVATURE_PER_EXAMPLE, FullCovarianceSite, GaussianSite, SiteCurvature, calling_svi, end_handover
from .family import pop_curvature, split_params
from .kronecker import KroneckerCurvature, KroneckerSite, kronecker_step
from .monitor import SKIPS_IN_A_ROW, ElboWatch, NGVIWarning, SpreadWatch, power_of_two, spread, stuck_message
from .priors import update_learned_priors
from .scales import known_scale, remember_scale

Schedule = Union[float, Callable[[int], float]]
_ONE_DRAW_ELBOS = (Trace_ELBO, JitTrace_ELBO)

#: Sites are concatenated into one update up to this many elements: that saves
#: per-operation overhead on small tensors and bounds the copies it costs.
_FLAT_MAX = 1 << 16
#: A large site's update runs in spans of this many elements (see ``NGVI._update_group``).
_CHUNK = 1 << 16
#: A site whose mean gradient exceeds ``_FAR`` of its guide's standard deviations
#: (:math:`|g|\sigma`, about :math:`|\mathcal{N}(0, 1)|` at the optimum of a
#: Gaussian posterior, larger by minibatch noise) with the sign it had at the last
#: step (noise flips it) on most elements, for ``_STALL_STEPS`` consecutive
#: sampled steps, is reported as stalling.
_FAR = 4.0
_STALL_STEPS = 100
#: Adaptive steps (sampled statistics): an element's count grows past 1/beta while
#: z^2 = (running mean of g)^2 / (its variance) is below _STALL_Z2, and falls back to
#: 1/beta above _DRIFT_Z2 (z^2 is about chi-square(1) when g is pure noise).
_STALL_Z2 = 2.0
_DRIFT_Z2 = 12.0
#: The pooled noise variances are running means over a site's steps, then forget at these
#: rates (a short and a long memory; the stall test uses the lower, the drift test the higher).
_NOISE_RATES = (0.2, 0.02)
_NOISE_FLOOR = 1e-12
#: Sampled curvature targets are clipped to (1 +- this) times the precision (with one
#: draw, eps^2 - 1 exceeds 9 once in 640 steps; coupled sites have heavier tails).
_INNOVATION_MAX = 9.0
#: Under sampled curvature a step changes an element's precision by at most this factor.
_PRECISION_RATIO = 4.0
#: A recovered draw |eps| beyond this is float32 round-off, not a normal draw.
_EPS_MAX = 8.0
#: The cross terms of the control variate (``NGVI._cross_terms``) run where the mean-field
#: sites with known draws have at most this many elements together (the state holds two
#: D x D matrices); with more, only the diagonal control variate runs (no D x D anything).
_CROSS_MAX = 64
#: Its regression of g on the draw points weights the newest step 1/n, and at least this
#: much (a memory of about 100 steps where the log joint is not quadratic; on a
#: quadratic one the slope is exact whatever the weights).
_CROSS_RATE = 0.01
#: Adaptive steps of a full-covariance site under sampled curvature: the floor of its
#: beta and lr (the longest memory, 1 / _DENSE_FLOOR steps, so a nonlinear model still
#: tracks), and the rate of the running means of its drift test.
_DENSE_FLOOR = 0.005
_DENSE_RATE = 0.1
#: ... and the factor by which a step may change its precision in any eigen-direction
#: (4, the mean-field value, lets the upward bias of Lin et al.'s correction on
#: noise-dominated directions inflate the precision at D = 100, K = 16: measured).
_DENSE_RATIO = 1.25


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


def defaults(num_data: Optional[int] = None, dense: bool = False, sampled: bool = False) -> Settings:
    """
    NGVI's default ``lr``, ``beta``, momentum and damping for a site's statistics:
    minibatch estimates of sums over ``num_data`` examples (a BayesianNet's:
    :data:`MINIBATCH`, the damping ``num_data`` :math:`\\times h_0` with :math:`h_0` =
    :data:`~pyro_ngvi.family.CURVATURE_PER_EXAMPLE`), else full-batch statistics of
    a full-covariance or Kronecker site (``dense``: :data:`DENSE`) or of a mean-field
    site (:data:`FULL_BATCH`); a full-covariance site's sampled statistics (``dense`` and
    ``sampled``) take :data:`DENSE_SAMPLED`, the start of its adaptive steps. Why each
    value is what it is: :class:`NGVI`'s docstring and the README's "Training a BayesianNet".
    """
    if num_data is not None:
        if isinstance(num_data, bool) or not isinstance(num_data, numbers.Integral) or num_data < 1:
            raise ValueError(f"num_data must be a positive integer or None, got {num_data!r}")
        return MINIBATCH._replace(damping=num_data * MINIBATCH.damping)
    if dense:
        return DENSE_SAMPLED if sampled else DENSE
    return FULL_BATCH


def _check_schedule(name: str, value, low: float, high: float, low_open=True):
    """Validate a finite number (or leave a callable for step-time checks)."""
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number or a callable of the step, got {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bracket = "(" if low_open else "["
        closing = "]" if math.isfinite(high) else ")"
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}{closing}, got {value}")
    return value


def _check_point_optim(point_optim, point_optim_args) -> Dict:
    """
    The point optimizer's arguments, validated by building it on a probe tensor and
    taking one step with a zero gradient: a bad value or an unknown key is refused
    here, not at the first step (after the guide sites were updated).
    """
    if not (isinstance(point_optim, type) and issubclass(point_optim, torch.optim.Optimizer)):
        raise ValueError(f"point_optim must be a torch.optim.Optimizer class, got {point_optim!r}")
    if point_optim_args is None:
        point_optim_args = {"lr": 0.01}
    if not isinstance(point_optim_args, dict):
        raise ValueError(f"point_optim_args must be a dict of {point_optim.__name__}'s arguments, "
                         f"got {point_optim_args!r}")
    probe = torch.zeros(1, requires_grad=True)
    try:
        optimizer = point_optim([probe], **point_optim_args)
        probe.grad = torch.zeros(1)
        optimizer.step()
    except Exception as error:
        raise ValueError(
            f"point_optim_args {point_optim_args!r} are not arguments {point_optim.__name__} "
            f"can run with (SVI calls its step() without a closure): {error}"
        ) from error
    return dict(point_optim_args)


class NGVI(PyroOptim):
    """
    Natural-gradient variational inference: the variational online-Newton
    (VON / VOGN) form of the Bayesian learning rule [1, 2] for the guide sites of
    :class:`~pyro.infer.autoguide.AutoNormal` and
    :class:`~pyro.infer.autoguide.AutoDiagonalNormal` (mean-field) and of
    :class:`~pyro.infer.autoguide.AutoMultivariateNormal` (full covariance).

    Each site is a Gaussian :math:`q(u) = \\mathcal{N}(\\mu, \\lambda^{-1})` in the
    site's unconstrained coordinates. With :math:`g, h` the gradient and diagonal
    curvature of the (tempered) non-conjugate part of the negative log joint at
    :math:`u \\sim q`, and :math:`(m_0, \\lambda_0)` a Normal prior that enters
    conjugately (only with :class:`~pyro_ngvi.CurvatureELBO`), one step is

    .. math::

        \\hat h &= \\lambda_0 + h / \\tau, \\qquad
        \\lambda' = (1 - \\beta)\\lambda + \\beta \\hat h
            \\;\\Big[+\\, \\tfrac{\\beta^2}{2\\lambda}(\\lambda - \\hat h)^2
            \\text{ where } \\hat h \\le 0 \\Big], \\\\
        \\bar g &\\leftarrow \\rho \\bar g + (1 - \\rho)\\, g / \\tau, \\qquad
        \\mu' = \\mu - \\alpha \\, \\frac{\\bar g + \\lambda_0 (\\mu - m_0)}{\\lambda' + \\gamma},

    with :math:`\\alpha` = ``lr``, :math:`\\beta` = ``beta``, :math:`\\rho` =
    ``momentum``, :math:`\\gamma` = ``damping``. The exact prior term stays out
    of the momentum (as in VOGN and IVON). The bracketed term is the
    positivity-preserving correction of [3], used only where the curvature
    target is negative so that ``lr = beta = 1`` with exact positive curvature
    is one Newton step.

    **Where g and h come from.** With a plain :class:`~pyro.infer.Trace_ELBO`
    (or ``JitTrace_ELBO``) they are recovered from the ordinary reparameterised
    gradients at no extra cost (Price's theorem [4]):
    :math:`g = \\nabla_\\mu`, :math:`h = (\\nabla_\\sigma + 1/\\sigma)/\\sigma`.
    There the prior is part of :math:`g, h` and ``tau`` tempers the whole log
    joint (it weights the entropy). :class:`~pyro_ngvi.CurvatureELBO` instead hands
    exact or Gauss-Newton curvature and a conjugate prior.

    **Subsampled local latents.** Pyro scales a site under a subsampled plate,
    its guide entropy included, by :math:`s = N/B`. Rows a step did not touch
    have exactly zero gradients and are left untouched (mean, scale, state); for
    touched rows :math:`s` is the ratio of the site's rows to the touched rows
    and is divided out, so they get their full-batch update.

    **Sampled curvature: why NGVI() needs no schedule.** A Price estimate
    (``Trace_ELBO`` or ``CurvatureELBO("reparam")``, flagged ``sampled``) is noisy:
    with constant steps the mean and the precision keep a Monte-Carlo floor, and
    far from the optimum the noise of :math:`h` (about :math:`|g|/\\sigma` per draw)
    swamps it. Three mechanisms, each chosen by measurement (below), remove that
    without a user schedule; none applies to exact, Gauss-Newton or Fisher
    statistics, so there ``lr = beta = 1`` stays a Newton step.

    1. *Control variate* [5]. Where the draws :math:`\\epsilon` (``u = mu + sigma eps``)
       are known, NGVI subtracts terms of mean zero,

       .. math:: g \\leftarrow g - c\\,\\sigma\\bar\\epsilon, \\qquad
                 h \\leftarrow h - b\\,\\bar\\epsilon/\\sigma - c\\,(\\overline{\\epsilon^2} - 1),

       with :math:`c = \\lambda - \\lambda_0` and :math:`b` the running mean of
       :math:`g` (both from before this step): the estimates stay unbiased and, where
       the log joint is quadratic with a diagonal Hessian, the fixed point is exact,
       with no Monte-Carlo floor. Where the mean-field sites with known draws have at
       most ``_CROSS_MAX`` elements together (whatever their grouping), the cross terms
       go too, :math:`g \\leftarrow g - \\tilde H\\sigma\\bar\\epsilon` with
       :math:`\\tilde H` the off-diagonal slope of a regression of past gradients on
       past draw points (exact on a quadratic after :math:`D + 1` steps; see
       ``_cross_terms``): on the correlated linear regression of
       ``benchmarks/conjugate.py`` this cuts the steps to 1 % with one draw from 3635 to 180
       (``Trace_ELBO``) and from 1797 to 177 (``CurvatureELBO("reparam")``).
       ``CurvatureELBO("reparam")`` hands its draws over (with
       ``antithetic=True`` in pairs :math:`\\pm\\epsilon`); with a one-particle
       ``Trace_ELBO`` or ``JitTrace_ELBO`` (Pyro's default) each draw is recovered
       exactly from the two gradients, :math:`\\epsilon = \\sigma h / g`. With
       ``num_particles > 1`` the averaged gradients do not determine the draws, and
       only the next mechanism acts.
    2. *Adaptive steps* (Polyak-Ruppert averaging once progress stalls). Every
       element keeps a count :math:`n` and steps with :math:`\\beta_t = 1/n`,
       :math:`\\alpha_t = \\alpha/(1 + \\alpha\\max(n - 1/\\beta, 0))`. The first positive
       curvature target is taken whole (:math:`n = 1`; a non-positive one is not
       trusted), :math:`n` then grows to :math:`1/\\beta`, and beyond that only while
       the running means of both innovations, :math:`g` and
       :math:`(\\hat h - \\lambda)/\\lambda`, are indistinguishable from noise (a
       :math:`z^2` test against their variances pooled over the site, see
       ``_adaptive_rates``). There the natural parameters become running averages
       of the noisy targets and the error falls like :math:`1/\\sqrt{t}`; where the
       targets move again :math:`n` falls back to :math:`1/\\beta`.
    3. *Trust region.* Each element's mean moves at most ``max_step`` standard
       deviations per step and its precision changes by at most a factor 4 (the
       exact prior precision always within reach).

    The mean-field defaults ``lr = 1``, ``beta = 0.5`` and the thresholds were
    picked on the tuning models of ``benchmarks/tune_defaults.py`` (full-covariance
    sites take their own adaptive steps under sampled curvature, see "Full covariance";
    other full-covariance statistics and Kronecker sites keep constant steps,
    ``lr = 0.1``, ``beta = 0.05``, by default) and are reported on others:
    ports of Pyro's autoguide tests (``benchmarks/autoguide.py``) and the
    conjugate models (``benchmarks/conjugate.py``). State: three latent-size
    vectors per site (the count and the running means of the two innovations;
    the first of those is the momentum buffer when ``momentum > 0``) and five
    numbers. The adaptive steps are on with the defaults (``NGVI()``); steps the
    user chose (numbers, unless ``averaging=True``, or a callable schedule) run as
    chosen, as in minibatch training of a network, where the gradient's noise is
    not only the Monte-Carlo noise the adaptive steps average (measured: a
    BatchNorm CNN on minibatched digits, ``NGVI(lr=0.1, beta=0.05)`` with
    ``CurvatureELBO("reparam")``, reached 38 % test accuracy with them and 88-95 %
    without). Without them, on a site's first step,
    elements whose curvature target exceeds the precision take it at once (as
    VOGN initialises its precision from the first minibatch [2]).

    **Defaults follow the statistics.** ``lr``, ``beta``, ``momentum`` and
    ``damping`` left at ``None`` are resolved per site from what its ELBO says
    about its statistics (:func:`defaults`): full-batch statistics take the above
    (:data:`FULL_BATCH`, :data:`DENSE`); minibatch statistics of a
    :class:`~pyro_ngvi.BayesianNet` (:attr:`~pyro_ngvi.family.SiteCurvature.num_data`
    set: estimates of sums over :math:`N` examples) take :data:`MINIBATCH`: ``lr``
    0.3, ``beta`` 0.01, ``momentum`` 0.9 and ``damping`` :math:`N h_0`, with
    :math:`h_0` = :data:`~pyro_ngvi.family.CURVATURE_PER_EXAMPLE` = 1, and neither
    the adaptive steps nor the control variate (the precision there is started
    above the curvature and floored below it, so :math:`\\lambda - \\lambda_0` is not
    the curvature the control variate needs). Why: the damping bounds the mean
    step by :math:`\\alpha \\bar g / (N h_0)`, an SGD step of ``lr`` on the loss per
    example, wherever the data's curvature per example is below :math:`h_0`, and
    leaves it a Newton step where the curvature is larger; it is what keeps
    Gauss-Newton curvature, which vanishes on confidently wrong examples while
    their gradient does not, from throwing the means out (the failure of an
    undamped ``ggn`` on deep nets), and it scales with :math:`N` as the statistics
    do, so no absolute value is picked per data set. ``beta`` 0.01 averages the
    precision over about a hundred minibatches (one minibatch's curvature is a
    noisy estimate); momentum 0.9 does the same for the gradient; these and ``lr``
    0.3 were chosen on two tasks of ``benchmarks/bnn_suite.py`` and frozen. The
    README's "Training a BayesianNet" says more; values given are used as given.

    **The family's limits.** Where the statistics carry a
    :attr:`~pyro_ngvi.family.SiteCurvature.min_precision` (a ``BayesianNet``'s
    ``noise_limit``), the new precision is kept at least that,
    :math:`\\lambda' \\leftarrow \\max(\\lambda', \\lambda_{\\min})`: the step projected
    on a variational family whose standard deviations are bounded (the ELBO is
    maximised within it).

    **Watches** (:mod:`pyro_ngvi.monitor`). NGVI warns :class:`NGVIWarning`, once,
    when a site's means grow without bound (tens of prior standard deviations,
    doubling within ten steps) and when the training ELBO an ELBO hands over
    (``CurvatureELBO``; ``Trace_ELBO`` hands none) keeps getting worse, window
    after window, beyond its noise; skipped steps warn at the 1st, 2nd, 4th, ...;
    :data:`~pyro_ngvi.monitor.SKIPS_IN_A_ROW` skipped steps in a row raise
    ``RuntimeError``: every draw from the guide is then non-finite and nothing can
    change it any more.

    **Statistics at the mean: the Newton-step safeguard.** With exact curvature at
    the mean (``CurvatureELBO(..., deterministic=True)``) and ``beta = 1`` a step is
    a diagonal Newton step on :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|`:
    exact in one step where the posterior precision is diagonal, but a Jacobi
    iteration elsewhere, which diverges for ``lr`` above
    :math:`2/\\lambda_{\\max}(D^{-1}H)`, and a jump out of the quadratic model's
    reach where the curvature is nearly flat. The ELBO hands :math:`F` over; a
    step after which :math:`F` rose is undone and the following mean steps are
    damped, Levenberg-Marquardt style (``_NewtonGuard``, Nielsen's rule [6]),
    and at most ``max_step`` standard deviations while damped; NGVI warns when
    this engages. An undamped step that lowers :math:`F` passes untouched. Off
    with ``safeguard=False`` or a callable ``lr``; inactive under subsampled
    plates (:math:`F` changes with the minibatch), while learned prior params or
    point-estimated parameters move with the guide (:math:`F` then compares more
    than the guide's step), and on paths that do not hand :math:`F` over (a
    model's own fast path, full-covariance sites).

    **Safeguards.** The new precision is kept in
    :math:`[\\text{tiny}, \\text{max}/4]` of the site's dtype, so the scale
    written stays finite and positive; and under sampled curvature a site whose
    mean gradient exceeds 4 of its guide's standard deviations,
    :math:`|g|\\sigma > 4` (at the optimum :math:`|g|\\sigma` is about
    :math:`|\\mathcal{N}(0, 1)|`, more with minibatch noise, which however flips
    its sign), with the sign it had at the last step, on most elements for 100
    consecutive steps is reported as stalling: far from the optimum the trust
    region and the noisy curvature keep its mean steps within a few, shrinking,
    standard deviations. Either warns :class:`NGVIWarning`, at the next step
    (the check rides on that step's one device sync). Both signal a problem
    badly scaled for the guide's initialisation (data of size 1e6 or 1e-6 for
    an ``init_scale`` of 0.1): rescale it, start the guide nearer
    (``init_loc_fn``), or use exact curvature (``CurvatureELBO("hessian")``).

    **Full covariance.** An :class:`~pyro.infer.autoguide.AutoMultivariateNormal`
    is one site :math:`q(u) = \\mathcal{N}(\\mu, S^{-1})` over its whole latent
    vector, updated by the matrix form of the same rule,
    :math:`S' = (1-\\beta) S + \\beta (S_0 + H/\\tau)` [with Lin et al.'s correction
    :math:`\\tfrac{\\beta^2}{2}(S - \\hat H)S^{-1}(S - \\hat H)` where the target
    :math:`\\hat H` is not positive definite], :math:`\\mu' = \\mu - \\alpha (S' +
    \\gamma I)^{-1}(\\bar g + S_0(\\mu - m_0))`, with the same ``lr``, ``beta``,
    ``tau``, momentum, damping, trust region and warm start
    (:func:`~pyro_ngvi.full_covariance.natural_step`). With Trace_ELBO the
    curvature is the Price estimate recovered from the gradients w.r.t. ``scale``
    and ``scale_tril`` (:func:`~pyro_ngvi.full_covariance.price_curvature`); the
    new precision is written back through its Cholesky factor. :math:`O(D^3)` per
    step. *Sampled curvature with the defaults* (``NGVI()``, Trace_ELBO): a scalar count
    :math:`n` per site sets :math:`\\beta_t = \\max(1/n, 0.005)` and
    :math:`\\alpha_t = \\max(1/(1 + \\max(n - 2, 0)), 0.005)` (:data:`DENSE_SAMPLED`: lr 1,
    beta 0.5): past :math:`n = 2` the precision is the running mean of the Price targets
    (for a Gaussian target, unbiased estimates of its Hessian: the error falls like
    :math:`1/\\sqrt{n}`) and the mean the Polyak-Ruppert average of Newton steps. The
    count grows while a drift test on the Newton step in the guide's standard deviations,
    :math:`C'^\\top \\bar g`, finds only noise and falls back to 2 where it drifts
    (:meth:`NGVI._dense_count`). Lin et al.'s correction is added only in the
    eigen-directions whose target is not positive, and a step changes the precision by at
    most a factor 1.25 in each: with :math:`D^2` entries estimated from :math:`K` draws the
    target is indefinite (:math:`K < D`) and, far from the mean, dominated by noise, where
    the correction's upward bias (it halves at most, the target may quadruple) inflated the
    precision at :math:`D = 100, K = 16` until the mean stalled (measured with 4). Picked on
    ``benchmarks/full_covariance.py``'s D = 10 regression and Pyro's "exact" model, the
    ratio on D = 100 (seed 0); reported on the rest. ``AutoLowRankMultivariateNormal`` is refused (its family is not closed
    under the step; see :mod:`pyro_ngvi.family`). A
    :class:`~pyro_ngvi.kronecker.KroneckerNormal` layer takes the noisy K-FAC step
    of :func:`~pyro_ngvi.kronecker.kronecker_step` on the Kronecker factors a
    model's fast path hands over (``CurvatureELBO("ggn")`` / ``"ggn_mc"``).

    **Priors learned by the evidence.** Where the ELBO names a ``pyro.param`` of
    the model as the loc or scale of a site's conjugate prior
    (:class:`~pyro_ngvi.CurvatureELBO`, :class:`~pyro_ngvi.BayesianNet` with
    ``learn_prior=True``), NGVI sets it after the guide's update to the
    maximiser of the ELBO given the new guide, e.g. for a zero-mean prior with
    one scale shared by a set of elements

    .. math:: s_0^2 = \\mathrm{mean}(\\mu^2 + \\sigma^2)

    over them (:func:`~pyro_ngvi.priors.update_learned_priors`: variational
    EM, one M-step per step); the point optimizer never sees it.

    **Which tensors are Gaussian sites** is read off the guide, never off
    parameter names (:func:`~pyro_ngvi.family.gaussian_sites`): NGVI takes the
    guide from the :class:`~pyro.infer.SVI` that calls it (or from ``guide``).
    **Everything else** SVI hands over (``pyro.param`` values of the model, a
    noise scale, BatchNorm weights, the values of ``AutoDelta`` parts of an
    ``AutoGuideList``) is updated by ``point_optim`` (Adam with lr 0.01 by default:
    of 0.003-0.1 the fastest to reach 5 % on every run of the tuning models of
    ``benchmarks/tune_defaults.py --point``; the former 0.001 needed ten times the
    steps) through :class:`~pyro.optim.PyroOptim`'s per-parameter machinery, in
    the same step; a model with no latent site at all is trained by it alone.
    Per-site state (momentum, the adaptive steps' counts and averages) belongs
    to the site's tensor, as
    Pyro's optimizers key theirs: two guides, or a guide made anew after
    ``pyro.clear_param_store()``, never share it.

    **Distributed.** With a :mod:`torch.distributed` process group of more than
    one rank initialised, every site's :math:`g, h` and the point-estimated
    parameters' gradients are averaged across ranks before the finiteness check
    (:func:`pyro_ngvi.distributed.all_reduce_stats`), so all ranks take, or all
    skip, the identical update; each rank draws its own sample
    (:func:`pyro_ngvi.distributed.seed_rank`). Single processes are unaffected.

    :param lr: step size :math:`\\alpha > 0` on the mean (under sampled statistics
        the starting value of the adaptive steps), or a callable of the step count
        returning it (a schedule of your own; torch LR schedulers need a torch
        optimizer and do not apply) (default: None, resolved per site: 1 for
        mean-field sites and sampled statistics of full-covariance sites, 0.1 for other
        full-covariance and Kronecker statistics, 0.3 for a
        ``BayesianNet``'s minibatch statistics; see "Defaults follow the statistics")
    :param beta: step :math:`\\beta \\in (0, 1]` of the precision moving average
        (under sampled statistics the rate the adaptive steps fall back to), or a
        callable of the step count (default: None: 0.5 for mean-field sites and sampled
        statistics of full-covariance sites, 0.05 for other statistics of full-covariance
        and Kronecker sites, 0.01 for minibatch statistics)
    :param momentum: :math:`\\rho \\in [0, 1)` on the mean gradient (default: None:
        0, or 0.9 for minibatch statistics)
    :param damping: :math:`\\gamma \\ge 0` added to the precision in the mean
        step only (default: None: 0, or :math:`N h_0` for minibatch statistics of
        :math:`N` examples)
    :param tau: temperature :math:`\\tau > 0` (the KL weight), or a callable of
        the step count for a warm-up (default: 1)
    :param max_step: trust radius, in current standard deviations, of the mean
        step under sampled curvature (and of damped Newton steps); ``None``
        disables it and the precision's trust region (default: 3)
    :param bool warm_start: take the first positive curvature target whole (with a
        schedule of your own: where it exceeds the precision) (default: True)
    :param bool averaging: adaptive steps for sampled statistics of mean-field
        and full-covariance sites (default: None, on exactly when neither ``lr`` nor ``beta`` is given:
        steps you choose, e.g. for minibatch training of a network, where gradient
        noise is not only Monte-Carlo noise, run as chosen unless ``averaging=True``)
    :param bool control_variate: the control variate where draws are known
        (default: True)
    :param bool safeguard: the Newton-step safeguard for statistics at the mean
        (default: True)
    :param point_optim: torch optimizer class for non-guide parameters
        (default: :class:`torch.optim.Adam`)
    :param dict point_optim_args: its arguments, checked at construction by
        building it on a probe tensor (default: ``{"lr": 0.01}``)
    :param guide: the guide whose sites to update; only needed when NGVI is
        called outside :class:`~pyro.infer.SVI` (default: None, the calling
        ``SVI``'s guide)

    :ivar int num_steps: updates taken.
    :ivar int num_skipped_steps: steps skipped for non-finite values.
    :ivar int num_rejected_steps: steps undone by the Newton-step safeguard.

    **References**

    [1] `Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam`,
        Mohammad Emtiyaz Khan, Didrik Nielsen, Voot Tangkaratt, Wu Lin, Yarin Gal,
        Akash Srivastava (ICML 2018)
    [2] `Practical Deep Learning with Bayesian Principles`, Kazuki Osawa, Siddharth
        Swaroop, Anirudh Jain, Runa Eschenhagen, Richard E. Turner, Rio Yokota,
        Mohammad Emtiyaz Khan (NeurIPS 2019)
    [3] `Handling the Positive-Definite Constraint in the Bayesian Learning Rule`,
        Wu Lin, Mark Schmidt, Mohammad Emtiyaz Khan (ICML 2020)
    [4] `The Variational Gaussian Approximation Revisited`, Manfred Opper, Cedric
        Archambeau (Neural Computation 2009)
    [5] `Reducing Reparameterization Gradient Variance`, Andrew C. Miller, Nicholas J.
        Foti, Alexander D'Amour, Ryan P. Adams (NeurIPS 2017)
    [6] `Damping Parameter in Marquardt's Method`, Hans Bruun Nielsen (IMM-REP-1999-05,
        Technical University of Denmark, 1999)
    """

    def __init__(
        self,
        lr: Optional[Schedule] = None,
        beta: Optional[Schedule] = None,
        momentum: Optional[float] = None,
        damping: Optional[float] = None,
        tau: Schedule = 1.0,
        max_step: Optional[float] = 3.0,
        warm_start: bool = True,
        averaging: Optional[bool] = None,
        control_variate: bool = True,
        safeguard: bool = True,
        point_optim=torch.optim.Adam,
        point_optim_args: Optional[Dict] = None,
        guide=None,
    ):
        # None: the defaults, resolved per site from its statistics (defaults())
        self.lr = None if lr is None else _check_schedule("lr", lr, 0.0, math.inf)
        self.beta = None if beta is None else _check_schedule("beta", beta, 0.0, 1.0)
        if momentum is not None:
            momentum = _check_schedule("momentum", momentum, 0.0, 1.0, low_open=False)
            if momentum == 1.0 or callable(momentum):
                raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
        self.momentum = momentum
        if damping is not None:
            damping = _check_schedule("damping", damping, 0.0, math.inf, low_open=False)
            if callable(damping):
                raise ValueError("damping must be a number")
        self.damping = damping
        self.tau = _check_schedule("tau", tau, 0.0, math.inf)
        if max_step is not None:
            max_step = _check_schedule("max_step", max_step, 0.0, math.inf)
            if callable(max_step):
                raise ValueError("max_step must be a positive number or None")
        self.max_step = max_step
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        for name, value in (("averaging", averaging), ("control_variate", control_variate),
                            ("safeguard", safeguard)):
            if not (isinstance(value, bool) or (name == "averaging" and value is None)):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if averaging is None:  # with the defaults; steps the user chose run as chosen
            averaging = lr is None and beta is None
        self.averaging, self.control_variate, self.safeguard = averaging, control_variate, safeguard
        # a schedule the user wrote runs as written
        self._adaptive = averaging and not (callable(lr) or callable(beta))
        self._newton = _NewtonGuard()
        self._predicted = None
        super().__init__(point_optim, _check_point_optim(point_optim, point_optim_args))
        self.guide = guide
        self.num_steps = 0
        self.num_skipped_steps = 0
        self._states: Dict[int, _SiteState] = {}  # id(loc) -> that site's state
        self._pending_states: Dict[str, Dict] = {}  # from set_state, by param name
        self._split_cache = None
        self._group_cache: Dict[tuple, List[_Group]] = {}
        self._signs: Dict[int, tuple] = {}  # id(group) -> (group, g > 0 at its last sampled step)
        self._safeguards: List[_Safeguards] = []  # last step's, read at the next sync
        self._spread_watch = SpreadWatch()  # means growing without bound (pyro_ngvi.monitor)
        self._elbo_watch = ElboWatch()  # a training ELBO that keeps getting worse
        self._elbo_flag: Optional[torch.Tensor] = None  # the watch's last flag, read at the next sync
        self._skips_in_a_row = 0

    @property
    def num_rejected_steps(self) -> int:
        return self._newton.rejected

    #: :class:`~pyro_ngvi.CurvatureELBO` hands its statistics to an optimizer that says so.
    consumes_curvature = True

    def _hyper(self, name: str, low: float, high: float) -> Optional[float]:
        """The value of ``name`` at this step (``None``: its default, resolved per site)."""
        value = getattr(self, name)
        if callable(value):
            value = _check_schedule(f"{name}({self.num_steps})", value(self.num_steps), low, high)
        return value

    def _settings(self, stats, lr: Optional[float], beta: Optional[float], dense: bool = False,
                  sampled: bool = False) -> Settings:
        """``lr``, ``beta``, momentum and damping for a site with statistics ``stats``: the
        values given, else the defaults for their kind (:func:`defaults`)."""
        default = defaults(getattr(stats, "num_data", None), dense, sampled)
        return Settings(
            default.lr if lr is None else lr,
            default.beta if beta is None else beta,
            default.momentum if self.momentum is None else self.momentum,
            default.damping if self.damping is None else self.damping,
        )

    # ---------------------------------------------------------------- the step
    def __call__(self, params, *args, **kwargs) -> None:
        """
        One step on the tensors ``SVI`` hands over. A step is taken whole or not
        at all: everything that can refuse it (state of another model, a
        schedule's value, statistics of the wrong shape) is checked before the
        first write. A refused or failed step undoes the evaluation's registered
        side effects, as a skipped step does, and, under ``SVI`` (which zeroes
        gradients only after a step), drops the ``.grad`` the next step's would
        be added to.
        """
        params = list(params)
        svi = calling_svi("optim", self)
        try:
            accepted = self._step(params, svi, *args, **kwargs)
        except BaseException:
            if svi is not None:
                for p in params:
                    p.grad = None
            end_handover(accepted=False)
            raise
        end_handover(accepted)

    def _step(self, params, svi, *args, **kwargs) -> bool:
        sites, others = self._split(params, svi)
        states = [self._state(site) for site in sites]  # may refuse: before any write
        self._check_point_states(others)
        # statistics count only when this step's ELBO made them (else they are stale)
        curvature_live = svi is None or getattr(
            getattr(svi.loss_and_grads, "__self__", None), "produces_curvature", False)
        one_draw = self.control_variate and _one_draw(svi)
        stats = {site.key: self._site_curvature(site, curvature_live, one_draw) for site in sites}
        kronecker_sites = [site for site in sites if isinstance(site, KroneckerSite)]
        if kronecker_sites and is_distributed():
            raise NotImplementedError("NGVI does not average Kronecker factors across processes yet")
        learned = {id(p.unconstrained) for s in stats.values() if isinstance(s, SiteCurvature)
                   for p in s.prior_params()}
        if learned:  # prior params set in closed form below, not by the point optimizer
            others = [p for p in others if id(p) not in learned]
        if is_distributed():  # draws differ between ranks: no control variate
            stats = {key: replace(s, eps_mean=None, eps_sq_mean=None) if isinstance(s, SiteCurvature) else s
                     for key, s in stats.items()}
        stats = all_reduce_stats(stats, others)  # no-op without torch.distributed
        objective = next((s.objective for s in stats.values()
                          if isinstance(s, SiteCurvature) and s.objective is not None), None)
        # F compares guide steps only: not while other parameters move with them
        guarded = (self.safeguard and objective is not None and not callable(self.lr) and not learned
                   and not any(p.grad is not None for p in others))
        mean_field = [site for site in sites if isinstance(site, GaussianSite)]
        if guarded and self._newton.rejects(mean_field, objective, self.num_steps):
            self._restart_momentum()
            return False
        full_sites = [site for site in sites if isinstance(site, (FullCovarianceSite, KroneckerSite))]
        cross = self._cross_terms(mean_field, stats) if self.control_variate else None
        groups = self._groups([site for site in sites if isinstance(site, GaussianSite)], stats)
        group_stats = [[stats[site.key] for site in group.sites] for group in groups]
        flats = [(_flat([s.grad for s in st]), _flat([s.curvature for s in st])) for st in group_stats]
        others_with_grad = [p for p in others if p.grad is not None]
        checked = [((grad, curvature), st[0].mask) for (grad, curvature), st in zip(flats, group_stats)]
        checked += [((p.grad,), None) for p in others_with_grad]
        checked += [(_statistics(stats[site.key]), None) for site in full_sites]
        finite = [_finite(*tensors, mask=mask) for tensors, mask in checked]
        safeguards, self._safeguards = self._safeguards, []
        elbo_flag, self._elbo_flag = self._elbo_flag, None
        flags = [f for s in safeguards for f in s.flags()] + ([] if elbo_flag is None else [elbo_flag])
        checks = torch.stack(finite + flags).tolist()  # one device sync
        finite, engaged = checks[: len(finite)], checks[len(finite):]
        if not all(finite):  # or finite values whose sum overflowed: tell them apart
            finite = [ok or bool(_finite(*tensors, mask=mask, exact=True)) for ok, (tensors, mask) in zip(finite, checked)]
        self._report(safeguards, engaged)
        if elbo_flag is not None and engaged[-1]:
            message = self._elbo_watch.message(self.num_steps)
            if message:
                warnings.warn(message, NGVIWarning, stacklevel=3)
        if not all(finite):
            bad = [site.name for site, ok in zip(sites, self._sites_finite(stats)) if not ok]
            bad += [_param_label(p) for p, ok in zip(others_with_grad, finite[len(groups):]) if not ok]
            self.num_skipped_steps += 1
            self._skips_in_a_row += 1
            if self._skips_in_a_row >= SKIPS_IN_A_ROW:
                largest = max((float(site.mean.abs().max()) for site in sites), default=math.nan)
                raise RuntimeError(stuck_message(self._skips_in_a_row, ", ".join(repr(b) for b in bad), largest))
            if power_of_two(self.num_skipped_steps):
                attempted = self.num_steps + self.num_skipped_steps + self.num_rejected_steps
                warnings.warn(
                    f"NGVI skipped step {attempted} ({self.num_steps} taken): non-finite gradient or curvature "
                    f"at {', '.join(repr(b) for b in bad)}; the guide is unchanged "
                    f"({self.num_skipped_steps} skipped so far; warned at the 1st, 2nd, 4th, 8th, ...; "
                    f"{SKIPS_IN_A_ROW} in a row raise).",
                    NGVIWarning,
                    stacklevel=3,
                )
            return False
        self._skips_in_a_row = 0
        lr = self._hyper("lr", 0.0, math.inf)
        beta = self._hyper("beta", 0.0, 1.0)
        tau = self._hyper("tau", 0.0, math.inf)
        state_of = {site.key: state for site, state in zip(sites, states)}
        # full-covariance steps are computed before anything is written: one whose
        # new precision is not positive definite skips the whole step
        full_steps = []
        for site in full_sites:
            adaptive = self._dense_adaptive(site, stats[site.key])
            settings = self._settings(stats[site.key], lr, beta, dense=True, sampled=adaptive)
            step = self._full_step(site, stats[site.key], settings, tau, state_of[site.key], adaptive)
            if step is None:
                self.num_skipped_steps += 1
                attempted = self.num_steps + self.num_skipped_steps + self.num_rejected_steps
                warnings.warn(
                    f"NGVI skipped step {attempted} ({self.num_steps} taken): the new precision of {site.name!r} is "
                    "not numerically positive definite; the guide is unchanged "
                    f"({self.num_skipped_steps} skipped so far). Lower beta or add damping.",
                    NGVIWarning,
                    stacklevel=3,
                )
                return False
            full_steps.append((step, settings.momentum))
        newton = 1.0
        if guarded:  # the point to come back to, and the Newton step damped by the safeguard
            self._newton.keep(mean_field, objective)
            newton = self._newton.factor
        self._predicted = 0.0 if guarded else None
        new_scales = {}  # sigma after the update, for the prior M-step
        for group, st, (grad, curvature) in zip(groups, group_stats, flats):
            group_states = [state_of[site.key] for site in group.sites]
            settings = self._settings(st[0], lr, beta)
            settings = settings._replace(lr=settings.lr / newton)
            clamped, far, sigma, spreading = self._update_group(group, st, grad, curvature, settings, tau,
                                                                group_states)
            self._safeguards.append(_Safeguards(group, group_states, clamped, far, spreading))
            if learned and sigma is not None:
                new_scales.update((site.key, piece.view_as(site.loc))
                                  for site, piece in zip(group.sites, sigma.split(group.sizes)))
        if guarded:
            self._newton.predicted = float(self._predicted)
        if cross is not None:  # the regression takes this step's gradients (not before: a skipped step)
            cross[0].cross = cross[1]
        for site, ((step, momentum, kept), rho) in zip(full_sites, full_steps):
            site.write(*step)
            state = state_of[site.key]
            state.started = True
            if rho:
                state.momentum = momentum
            for name, value in kept.items():  # the adaptive steps' count and drift test
                setattr(state, name, value)
        if learned:
            update_learned_priors([(site.mean, new_scales[site.key] if site.key in new_scales else site.scale,
                                    stats[site.key]) for site in sites
                                   if isinstance(site, GaussianSite) and stats[site.key].prior_params()])
        if others:
            super().__call__(others, *args, **kwargs)
        self._watch_elbo(stats, tau)
        self.num_steps += 1
        return True

    def _watch_elbo(self, stats, tau: float) -> None:
        """Feed the ELBO watch (:mod:`pyro_ngvi.monitor`) the loss this step's ELBO handed over;
        at another temperature than 1 that loss is not the objective: start again."""
        loss = next((s.loss for s in stats.values() if getattr(s, "loss", None) is not None), None)
        if loss is None:
            return
        if tau != 1:
            self._elbo_watch.reset()
            return
        self._elbo_flag = self._elbo_watch.add(loss)

    def _report(self, safeguards: List["_Safeguards"], engaged: List[bool]) -> None:
        """Warn about the safeguards that engaged at the last step (read at this step's sync)."""
        engaged = iter(engaged)
        for record in safeguards:
            names = ", ".join(repr(site.name) for site in record.group.sites)
            dtype = record.group.sites[0].loc.dtype
            if next(engaged):
                warnings.warn(
                    f"NGVI clamped the precision of {names} to the range where the scale stays "
                    f"finite and positive in {dtype} (the update left it at step "
                    f"{self.num_steps - 1}): the problem is badly scaled for the guide, e.g. "
                    "sampled curvature far from the optimum. Rescale the data or the model, "
                    "start the guide nearer (init_loc_fn) or use exact curvature "
                    "(CurvatureELBO('hessian')).",
                    NGVIWarning,
                    stacklevel=4,
                )
            if record.spreading is not None and next(engaged):
                message = self._spread_watch.message(record.group, names, self.num_steps - 1)
                if message:
                    warnings.warn(message, NGVIWarning, stacklevel=4)
            if record.far is None:
                continue
            far = next(engaged)
            for state in record.states:
                state.far_steps = state.far_steps + 1 if far else 0
            if far and any(state.far_steps == _STALL_STEPS for state in record.states):
                warnings.warn(
                    f"NGVI: the mean of {names} stalls. Its gradient has exceeded {_FAR:g} of its "
                    "guide's standard deviations, with the same sign, on most elements for "
                    f"{_STALL_STEPS} consecutive steps: the mean is far from where the data put "
                    "it, and under sampled curvature its steps stay within a few standard "
                    "deviations while the scale shrinks. Rescale the data or the model, start the "
                    "guide nearer (init_loc_fn) or wider (init_scale), or use exact curvature "
                    "(CurvatureELBO('hessian')).",
                    NGVIWarning,
                    stacklevel=4,
                )

    def _check_point_states(self, others: List[torch.Tensor]) -> None:
        """Refuse, before any write, a restored point-optimizer state whose tensors do
        not fit the parameter it would be loaded into (a checkpoint of another model)."""
        waiting = self._state_waiting_to_be_consumed
        if not waiting:
            return
        store = pyro.get_param_store()
        for p in others:
            name = store.param_name(p)
            if p in self.optim_objs or name not in waiting:
                continue
            template = self._point_state_shapes(p)
            for per_param in waiting[name]["state"].values():
                for key, value in per_param.items():
                    if torch.is_tensor(value) and key in template and value.shape != template[key]:
                        raise ValueError(
                            f"NGVI's point-optimizer state for '{name}' holds {key!r} of shape "
                            f"{tuple(value.shape)}, the parameter has {tuple(p.shape)}: the "
                            "checkpoint belongs to another model"
                        )

    def _point_state_shapes(self, p: torch.Tensor) -> Dict[str, torch.Size]:
        """The shapes of the per-parameter state a fresh point optimizer keeps for ``p``
        (one zero-gradient step on a probe of its shape)."""
        probe = torch.zeros_like(p, requires_grad=True)
        optimizer = self.pt_optim_constructor([probe], **self.pt_optim_args)
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
        return {key: value.shape for key, value in optimizer.state[probe].items() if torch.is_tensor(value)}

    def _split(self, params, svi=None):
        """:func:`~pyro_ngvi.family.split_params` for the guide, remembered for the same
        guide and tensors (SVI hands the same ones every step) as long as each site's
        tensors are still the param store's."""
        guide = self._guide(svi)
        key = (id(guide), frozenset(map(id, params)))
        if self._split_cache is not None and self._split_cache[0] == key:
            sites, others = self._split_cache[1:]
            store = pyro.get_param_store()._params
            if all(_still_stored(site, store) for site in sites):
                return sites, others
        sites, others = split_params(guide, params)
        self._split_cache = (key, sites, others)
        self._group_cache = {}
        self._signs = {}
        return sites, others

    def _guide(self, svi=None):
        """The guide given at construction, else the one of the ``SVI`` running this step."""
        if self.guide is not None:
            return self.guide
        if svi is None:
            raise RuntimeError(
                "NGVI reads which tensors form Gaussian sites off the guide, and found none: "
                "call it through pyro.infer.SVI(model, guide, NGVI(...), loss), or pass the "
                "guide, NGVI(..., guide=guide), when calling it yourself."
            )
        return svi.guide

    def _state(self, site: GaussianSite) -> "_SiteState":
        """The state of ``site`` (keyed by its ``loc`` tensor; new for a new tensor),
        taking a :meth:`set_state` entry of the same param name once."""
        state = self._states.get(id(site.loc))
        if state is not None and state.loc() is site.loc:
            return state
        state = _SiteState(weakref.ref(site.loc))
        pending = self._pending_states.pop(site.key, None)
        if pending is not None:
            for key in _BUFFERS:
                buffer = pending.get(key)
                if buffer is not None and buffer.shape != site.loc.shape:
                    raise ValueError(
                        f"NGVI state for '{site.key}' holds a {key} of shape "
                        f"{tuple(buffer.shape)}, the site has {tuple(site.loc.shape)}: the "
                        "checkpoint belongs to another model"
                    )
            state.started = pending["started"]
            for key in _BUFFERS + _SITE_TENSORS:
                buffer = pending.get(key)
                setattr(state, key, None if buffer is None else buffer.to(site.loc).clone())
        self._states[id(site.loc)] = state
        return state

    def _groups(self, sites: List[GaussianSite], stats: Dict[str, SiteCurvature]) -> List["_Group"]:
        """:func:`_group_sites` for these sites and kinds of statistics, remembered."""
        key = tuple((s.mask is None, s.sampled, s.nonnegative, s.prior_precision is None, s.eps_mean is None,
                     s.num_data, s.min_precision is None) for s in (stats[site.key] for site in sites))
        groups = self._group_cache.get(key)
        if groups is None:
            groups = self._group_cache[key] = [_Group.of(group) for group in _group_sites(sites, stats)]
        return groups

    @staticmethod
    def _sites_finite(stats: Dict[str, SiteCurvature]) -> List[bool]:
        """Per site, whether its touched rows are finite (to name the bad ones)."""
        return [bool(_finite(*_statistics(s), mask=getattr(s, "mask", None), exact=True)) for s in stats.values()]

    @torch.no_grad()
    def _site_curvature(self, site: GaussianSite, live: bool = True, one_draw: bool = False) -> SiteCurvature:
        """
        The ELBO's curvature for ``site`` (when ``live``: this step's ELBO made it),
        in the site's dtype and device, or, failing that, the reparam estimate
        recovered from the ordinary gradients. With one draw per step (``one_draw``:
        a one-particle ``Trace_ELBO``) the draw of a mean-field site is recovered
        too, :math:`\\epsilon = \\sigma h / g` (as :math:`h = g\\epsilon/\\sigma`), for the
        control variate.
        """
        stats = pop_curvature(site.loc)
        if stats is not None and live:
            return _fit_to_site(stats, site) if isinstance(site, GaussianSite) else stats
        if isinstance(site, KroneckerSite):
            raise ValueError(
                f"NGVI found no Kronecker factors for layer '{site.name}' of a KroneckerNormal guide: "
                "train it with pyro_ngvi.CurvatureELBO('ggn') (BackPACK KFLR) or 'ggn_mc' (KFAC) on "
                "a model that serves them (a BayesianNet)."
            )
        if site.loc.grad is None or site.raw_scale.grad is None:
            raise ValueError(
                f"NGVI found no gradient for guide site '{site.name}': use a loss that "
                "backpropagates through the guide (Trace_ELBO, JitTrace_ELBO) or "
                "pyro_ngvi.CurvatureELBO."
            )
        if isinstance(site, FullCovarianceSite):
            return _full_reparam_curvature(site)
        raw = site.raw_scale.detach()
        scale = site.scale
        transform = site._scale_transform
        if hasattr(transform, "derivative"):  # softplus: d sigma / d r = sigmoid(r)
            dscale_draw = transform.derivative(raw)
        else:
            dscale_draw = transform.log_abs_det_jacobian(raw, scale).exp()
        scale_grad = site.raw_scale.grad / dscale_draw
        touched = int(torch.count_nonzero(scale_grad))
        if touched == scale_grad.numel():
            mask, plate_scale = None, 1.0
        else:
            mask, plate_scale = scale_grad != 0, scale_grad.numel() / max(touched, 1)
        grad = site.loc.grad / plate_scale if plate_scale != 1.0 else site.loc.grad.clone()  # ours to change
        inverse_scale = scale.reciprocal()
        if plate_scale != 1.0:
            scale_grad.div_(plate_scale)
        curvature = scale_grad.add_(inverse_scale).mul_(inverse_scale)  # (d_sigma + 1 / sigma) / sigma
        if not one_draw:
            return SiteCurvature(grad, curvature, mask=mask, sampled=True)
        # eps = sigma h / g; where g vanishes (untouched rows) the draw is unknown: 0.
        # |eps| beyond _EPS_MAX is float32 round-off in h, never a real draw. (By arithmetic
        # on 0 / 1 masks: torch's CPU where and masked_fill run one element at a time.)
        eps = torch.mul(curvature, scale).div_(grad)  # +-inf or nan where g = 0: |eps| <= max fails
        keep = (eps.abs() <= _EPS_MAX).to(eps.dtype)
        eps = eps.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(keep)
        eps_sq_mean = (eps == 0).to(eps.dtype).addcmul_(eps, eps)  # eps^2, and 1 where the draw is unknown
        return SiteCurvature(grad, curvature, mask=mask, sampled=True, eps_mean=eps, eps_sq_mean=eps_sq_mean)

    @torch.no_grad()
    def _update_group(self, group: "_Group", stats: List[SiteCurvature],
                      grad: torch.Tensor, curvature: torch.Tensor, settings: Settings, tau,
                      states: List["_SiteState"]):
        """
        :meth:`_update_span` on the whole group; a large site (beyond ``_CHUNK``
        elements, alone in its group, no mask, not the adaptive steps, whose noise
        is pooled over the site first) in spans of ``_CHUNK`` elements, one after
        the other: the same element-wise update, with temporaries of a span's size
        that stay in cache and are reused by the allocator (on the CPU, whole-vector
        temporaries of a large site go back to the system and page-fault on every
        step). Returns what :meth:`_update_span` returns.
        """
        first = stats[0]
        size = grad.numel()
        if len(group.sites) > 1 or first.mask is not None or size <= _CHUNK or self._adaptive_for(first):
            result = self._update_span(group, stats, grad, curvature, settings, tau, states)
        else:
            run = _Spans(self, group, states[0], size, first.sampled, settings.momentum)
            for start in range(0, size, _CHUNK):
                run.slice = slice(start, min(start + _CHUNK, size))
                self._update_span(group, stats, grad, curvature, settings, tau, states, run)
            result = run.finish(self, group, states[0], first.prior_precision is not None)
        for state in states:
            state.started = True
        return result

    def _adaptive_for(self, stats: SiteCurvature) -> bool:
        """Whether statistics like ``stats`` take the adaptive steps: sampled, not a
        BayesianNet's minibatch statistics (``num_data``: their noise is the data's as much
        as the draws', which the adaptive steps would average away; the recipe's steps)."""
        return stats.sampled and self._adaptive and stats.num_data is None

    def _update_span(self, group: "_Group", stats: List[SiteCurvature],
                     grad: torch.Tensor, curvature: torch.Tensor, settings: Settings, tau,
                     states: List["_SiteState"], run: Optional["_Spans"] = None):
        """
        The update of the class docstring for ``sites`` at once, as one flat
        vector (one kernel per operation rather than one per site and operation);
        ``grad`` and ``curvature`` are the sites' ``g`` and ``h`` so flattened.
        The sites share the scale constraint, ``sampled``, ``nonnegative``, whether
        a prior is given, whether draws are known, ``num_data``, whether a
        ``min_precision`` is given, and either have no ``mask`` or are a single
        masked site.

        :returns: 0-d bool tensors (no device sync): whether the precision was
            clamped, and, for sampled curvature (else ``None``), whether most
            elements' gradient exceeds ``_FAR`` standard deviations with the
            sign it had at the group's last step; the new :math:`\\sigma` as a
            flat vector (``None`` for a masked site); and the flag of the watch on
            growing means (:mod:`pyro_ngvi.monitor`; ``None`` without a prior).
        """
        # In-place wherever a value is not needed again (``grad`` and ``curvature``
        # are this step's, the optimizer's to overwrite): besides the flat copies of
        # a multi-site group, the update holds about five vectors at its peak.
        first, sites, transform = stats[0], group.sites, group.transform
        lr, beta, rho = settings.lr, settings.beta, settings.momentum

        def cut(flat):  # the span of a flat vector (all of it outside a run)
            return flat if run is None else flat[run.slice]

        mean = cut(_flat([site.loc for site in sites]))
        # the sigma the ELBO read this step, else the one this optimizer wrote last (in a run, as it was
        # at the run's start: the spans before this one have written the raw scale since)
        scales = [(known_scale(site.raw_scale) if run is None else run.old_scale) if s.scale is None else s.scale
                  for s, site in zip(stats, sites)]
        if all(scale is not None for scale in scales):
            precision = cut(_flat(scales)).pow(-2)
        else:
            precision = transform(cut(_flat([site.raw_scale for site in sites]))).pow_(-2)
        mask = None if first.mask is None else first.mask.reshape(-1)
        prior_precision = None if first.prior_precision is None else cut(
            group.flat_of("prior_precision", [s.prior_precision for s in stats]))
        adaptive = self._adaptive_for(first)
        grad, curvature = cut(grad), cut(curvature)
        grad = grad.div_(tau) if tau != 1 else grad  # from here g / tau and h / tau
        curvature = curvature.div_(tau) if tau != 1 else curvature
        if adaptive:
            count = self._buffer(group, states, "count", self._first_count(beta))
            drift = self._buffer(group, states, "momentum" if rho else "drift", 0.0)
        # the control variate takes lambda - lambda_0 for the curvature: not where the precision is
        # started above it and floored below it (the minibatch recipe)
        if self.control_variate and first.eps_mean is not None and first.num_data is None:
            if adaptive:
                known, baseline = count > self._first_count(beta), drift
            elif run is not None:  # one site
                known, baseline = torch.full_like(grad, states[0].started, dtype=torch.bool), None
            else:
                known, baseline = _flat([torch.full_like(site.loc, state.started, dtype=torch.bool)
                                         for site, state in zip(sites, states)]), None
            eps_mean = cut(_flat([s.eps_mean for s in stats]))
            self._control_variate(grad, curvature, eps_mean, cut(_flat([s.eps_sq_mean for s in stats])).sub(1.0),
                                  precision, prior_precision, known, baseline)
        target = curvature
        if prior_precision is not None:
            target.add_(prior_precision)
        if adaptive:  # a sampled target beyond (1 +- _INNOVATION_MAX) lambda is an outlier
            target = torch.clamp(target, min=precision * (1.0 - _INNOVATION_MAX),
                                 max=precision * (1.0 + _INNOVATION_MAX))
        direction = self._momentum(group, states, grad, mask, rho, run)
        pull = spreading = None  # the exact prior's gradient, lambda_0 (mu - m_0)
        if prior_precision is not None:
            deviation = mean - cut(group.flat_of("prior_loc", [s.prior_loc for s in stats]))
            if mask is None:  # the watch on growing means (pyro_ngvi.monitor): sum lambda_0 (mu - m_0)^2
                pull = deviation * prior_precision
                if run is None:
                    spreading = self._spread_watch.flag(group, spread(deviation, pull), self.num_steps)
                else:  # summed span by span, the flag at the end of the run
                    run.spread = run.spread + torch.dot(pull, deviation)
            else:
                pull = deviation.mul_(prior_precision)
            del deviation
        if adaptive:
            step_beta, step_lr = self._adaptive_rates(group, states, grad, direction, drift, pull, target,
                                                      precision, count, lr, beta, mask, rho)
        elif self.warm_start and not all(state.started for state in states):
            fresh = torch.full_like(grad, True, dtype=torch.bool) if run is not None else _flat(
                [torch.full_like(site.loc, not state.started, dtype=torch.bool) for site, state in zip(sites, states)])
            step_beta, step_lr = torch.where(fresh & (target > precision), 1.0, beta).to(target.dtype), lr
        else:
            step_beta, step_lr = beta, lr
        new_precision = torch.lerp(precision, target, step_beta)
        if not (first.nonnegative and prior_precision is not None):  # else target > 0
            correction = torch.sub(precision, target).square_().mul_(step_beta**2 / 2).div_(precision)
            # only where target <= 0 (a 0 / 1 mask: an overflowed correction times 0 is nan, made 0)
            correction.mul_((target <= 0).to(correction.dtype)).nan_to_num_(nan=0.0, posinf=math.inf)
            new_precision.add_(correction)
            del correction
        del target
        if first.sampled and self.max_step is not None:  # trust region on the precision too
            upper, lower = precision * _PRECISION_RATIO, precision / _PRECISION_RATIO
            if prior_precision is not None:  # the exact prior part is always within reach
                upper, lower = upper.maximum(prior_precision), lower.minimum(prior_precision)
            new_precision = torch.minimum(new_precision, upper, out=new_precision)
            new_precision = torch.maximum(new_precision, lower, out=new_precision)
            del upper, lower
        # lambda' in [tiny, max / 4], and >= lambda_min where the family has a floor
        floor = None if first.min_precision is None else cut(group.flat_of("min_precision", [s.min_precision for s in stats]))
        clamped, lowest = _clamp_precision_(new_precision, floor)
        del floor
        damping = settings.damping
        denominator = new_precision + damping if damping else new_precision
        del prior_precision

        far = None
        if first.sampled and run is not None:  # the same, counted span by span
            positive = grad > 0
            if run.last_signs is not None:
                persistent = torch.eq(positive, run.last_signs[run.slice])
                run.far = run.far + torch.count_nonzero(
                    torch.gt(grad.square(), precision * _FAR**2).logical_and_(persistent))
            run.signs[run.slice] = positive
        elif first.sampled:  # |g| sigma > _FAR (g^2 > _FAR^2 lambda), with the sign of the last step
            positive = grad > 0
            last = self._signs.get(id(group))
            self._signs[id(group)] = (group, positive)
            if last is not None and last[0] is group:
                persistent = torch.eq(positive, last[1])
                far = _mostly(torch.gt(grad.square(), precision * _FAR**2).logical_and_(persistent), mask)
            else:
                far = torch.zeros((), dtype=torch.bool, device=grad.device)
        if first.sampled and self.max_step is not None:
            # the trust region bounds the likelihood part of the step, not the prior's
            step = direction.mul(step_lr).div_(denominator)
            radius = precision.rsqrt_().mul_(self.max_step)
            step = torch.minimum(step, radius, out=step)
            step = torch.maximum(step, radius.neg_(), out=step)
            del radius
            new_mean = step.neg_().add_(mean)
            if pull is not None:
                new_mean.sub_(pull.mul_(step_lr).div_(denominator))
        elif torch.is_tensor(step_lr):
            numerator = direction if pull is None else pull.add_(direction)
            new_mean = numerator.mul(step_lr).div_(denominator).neg_().add_(mean)
        elif self._predicted is not None:  # guarded Newton step (evaluated at the mean)
            numerator = direction if pull is None else pull.add_(direction)
            step = numerator.mul(step_lr).div_(denominator)
            if self._newton.factor > 1 and self.max_step is not None:
                # while damped, also at most max_step standard deviations (before the step)
                radius = precision.rsqrt_().mul_(self.max_step)
                step = torch.minimum(step, radius, out=step)
                step = torch.maximum(step, radius.neg_(), out=step)
            # the decrease of F the quadratic model predicts for it
            self._predicted = self._predicted + (numerator * step).sum() - 0.5 * (new_precision * step.square()).sum()
            new_mean = step.neg_().add_(mean)
        else:  # mu - lr (g + lambda_0 (mu - m_0)) / (lambda' + gamma) in one kernel (a span: into loc)
            numerator = direction if pull is None else pull.add_(direction)
            new_mean = torch.addcdiv(mean, numerator, denominator, value=-step_lr, out=None if run is None else mean)
        del precision, pull, denominator, direction
        new_scale = new_precision.rsqrt_() if run is None else torch.rsqrt(new_precision, out=run.scale[run.slice])
        raw_out = None if run is None else group.raw_scales[0][run.slice]  # a span: straight into the raw scale
        if hasattr(transform, "inverse_and_log"):  # (its log sigma, of sigma before the round trip: unused)
            new_raw_scale = transform.inverse_and_log(new_scale, raw_out, lowest.rsqrt())[0]
        else:
            new_raw_scale = transform.inv(new_scale)
        del new_precision
        # the sigma the new raw scale gives when read, remembered for the next reader: exactly what a
        # process reads from the saved param store, so a resumed run takes the same steps bit for bit
        # (the round trip moves sigma by an ulp or so; the kernels give the same bits at any offset)
        read = transform(new_raw_scale) if mask is None else None
        if run is not None:  # one site, no mask: write the span
            if new_mean is not mean:
                group.locs[0][run.slice].copy_(new_mean)
            if new_raw_scale is not raw_out:
                raw_out.copy_(new_raw_scale)
            run.scale[run.slice].copy_(read)
            run.clamped.append(clamped)
            return None
        if mask is None:
            torch._foreach_copy_(group.locs, new_mean.split_with_sizes(group.sizes))
            torch._foreach_copy_(group.raw_scales, new_raw_scale.split_with_sizes(group.sizes))
            new_scale = read
            for site, piece in zip(sites, new_scale.split_with_sizes(group.sizes)):
                remember_scale(site.raw_scale, piece.view_as(site.loc))
        else:  # a masked site is a group of its own
            (loc,), (raw_scale,) = group.locs, group.raw_scales
            loc.copy_(torch.where(mask, new_mean, loc))
            raw_scale.copy_(torch.where(mask, new_raw_scale, raw_scale))
            new_scale = None  # untouched rows keep their old scale
        return clamped, far, new_scale, spreading

    def _first_count(self, beta: float) -> float:
        """The count a new element starts from: 0 (its first step takes the curvature
        target whole) with the warm start, else one short of :math:`1/\\beta`."""
        return 0.0 if self.warm_start else max(1.0 / beta - 1.0, 0.0)

    @staticmethod
    def _control_variate(grad, curvature, eps_mean, eps_sq_mean_minus_one, precision, prior_precision, known,
                         baseline) -> None:
        """
        Subtract, in place, control variates of known draws :math:`\\epsilon` from
        :math:`\\hat g = g/\\tau` and :math:`\\hat h = h/\\tau`:

        .. math:: \\hat g \\leftarrow \\hat g - c\\,\\sigma\\bar\\epsilon, \\qquad
                  \\hat h \\leftarrow \\hat h - b\\,\\bar\\epsilon/\\sigma - c\\,(\\overline{\\epsilon^2} - 1),

        with :math:`c = \\lambda - \\lambda_0` the curvature the current precision
        stands for and :math:`b` the running mean of :math:`\\hat g` (both 0 where the
        element has no estimate yet). Neither depends on this step's draws, so the
        estimates stay unbiased; where :math:`\\ell` is quadratic with curvature
        :math:`c` and gradient :math:`b` at the mean they are exact: then
        :math:`\\hat g(\\mu + \\sigma\\epsilon) = b + c\\sigma\\epsilon`.
        """
        c = precision if prior_precision is None else precision - prior_precision
        known = known.to(precision.dtype)  # 0 / 1 (finite c and baseline: a product is the masked fill)
        c = c.clamp(min=0.0).mul_(known)
        sigma = precision.rsqrt()
        grad.sub_(c * sigma * eps_mean)
        curvature.sub_(eps_sq_mean_minus_one.mul_(c))
        if baseline is not None:
            curvature.sub_(baseline.mul(known).mul_(eps_mean).div_(sigma))

    def _cross_terms(self, sites: List[GaussianSite], stats: Dict[str, SiteCurvature]):
        """
        Subtract the cross terms of the control variate of the small mean-field sites
        (together at most ``_CROSS_MAX`` elements, each with known draws, no mask, not
        a BayesianNet's minibatch statistics) from their :math:`\\hat g` and :math:`\\hat h`
        (replacing ``stats``' entries; :meth:`_control_variate` takes the diagonal later):

        .. math:: \\hat g \\leftarrow \\hat g - \\tilde H z, \\qquad
                  \\hat h \\leftarrow \\hat h - \\bar\\epsilon \\odot (\\tilde H z)/\\sigma,
                  \\qquad z = \\sigma\\bar\\epsilon,

        with :math:`\\tilde H` the symmetrized off-diagonal part of
        :math:`\\hat H = S_{gw} S_{ww}^{-1}`, the slope of a weighted least-squares
        regression of the raw :math:`\\hat g` on the draw points :math:`w = \\mu + z`
        of these sites' past steps (weights :math:`\\max(1/n, ` ``_CROSS_RATE`` :math:`)`
        for the newest; running means of :math:`w` and :math:`\\hat g`, and their
        covariances :math:`S_{ww}`, :math:`S_{gw}`). Where :math:`\\ell` is quadratic,
        :math:`\\hat g(w) = \\hat g(0) + H w` exactly, so after :math:`D + 1` steps
        :math:`\\hat H = H` whatever the weights, and with the diagonal term
        :math:`\\hat g` is exact: the off-diagonal noise
        :math:`\\sum_{j\\ne i} H_{ij}\\sigma_j\\epsilon_j` of a correlated posterior
        is gone (so is the matching :math:`\\epsilon_i\\epsilon_j` noise of
        :math:`\\hat h`). :math:`\\hat H` uses past steps only, so both terms have
        mean zero whatever its error: the estimates stay unbiased. Before
        :math:`D + 1` steps, or where :math:`S_{ww}` is not positive definite or the
        term is not finite, it is 0 (no device sync). The state, one
        :math:`(2D + 3) \\times D` tensor (count, the two means, :math:`S_{ww}`,
        :math:`S_{gw}`), is kept with the first of the sites (saved with it by
        :meth:`get_state`; for another total size it starts afresh); the new state is
        returned, with the state to keep it in, to be kept once the step is taken
        (``None``: no cross terms this step).
        """
        chosen = [(site, self._state(site)) for site in sites
                  if (lambda s: s.sampled and s.eps_mean is not None and s.eps_sq_mean is not None
                      and s.mask is None and s.num_data is None)(stats[site.key])]
        size = sum(site.loc.numel() for site, _ in chosen)
        if not 1 < size <= _CROSS_MAX or any(site.loc.dtype != chosen[0][0].loc.dtype
                                               or site.loc.device != chosen[0][0].loc.device for site, _ in chosen):
            return None
        picked = [stats[site.key] for site, _ in chosen]
        with torch.no_grad():
            raw_grad = _flat([s.grad for s in picked])
            eps = _flat([s.eps_mean for s in picked])
            sigma = _flat([site.scale if s.scale is None else s.scale for (site, _), s in zip(chosen, picked)])
            z = sigma * eps  # the draw's offset from the mean
            point = _flat([site.loc for site, _ in chosen]) + z
            state = chosen[0][1]
            packed = state.cross
            if packed is None or packed.shape != (2 * size + 3, size):
                packed = raw_grad.new_zeros(2 * size + 3, size)
            n, mean_w, mean_g = packed[0, 0], packed[1], packed[2]
            cov_ww, cov_gw = packed[3:3 + size], packed[3 + size:]
            factor, info = torch.linalg.cholesky_ex(cov_ww)
            slope = torch.cholesky_solve(cov_gw.T.contiguous(), factor)  # (S_gw S_ww^-1)^T
            off = slope.add_(slope.T.clone()).mul_(0.5)
            off.diagonal().zero_()
            correction = off @ z
            usable = (n > size) & (info == 0) & torch.isfinite(correction).all()
            correction = torch.where(usable, correction, 0.0)
            curvature_correction = correction * eps / sigma
            pieces = zip(correction.split([s.grad.numel() for s in picked]),
                         curvature_correction.split([s.grad.numel() for s in picked]))
            for (site, _), s, (dg, dh) in zip(chosen, picked, pieces):
                stats[site.key] = replace(s, grad=s.grad - dg.view_as(s.grad),
                                          curvature=s.curvature - dh.view_as(s.curvature))
            # the regression takes this step's point after its use
            n = n + 1
            weight = n.reciprocal().clamp(min=_CROSS_RATE)
            dw, dg = point.sub_(mean_w), raw_grad - mean_g
            new = torch.empty_like(packed)
            new[0] = n
            new[1] = mean_w + weight * dw
            new[2] = mean_g + weight * dg
            new[3:3 + size] = (cov_ww + weight * torch.outer(dw, dw)).mul_(1 - weight)
            new[3 + size:] = (cov_gw + weight * torch.outer(dg, dw)).mul_(1 - weight)
        return state, new

    def _adaptive_rates(self, group, states, grad, direction, drift, pull, target, precision, count, lr,
                        beta, mask, momentum):
        """
        Per-element steps from the measured signal-to-noise ratio of the two
        natural-gradient innovations: :math:`\\hat g` and :math:`(\\hat h - \\lambda)/\\lambda`.

        Each element keeps a count :math:`n`; its steps are
        :math:`\\beta_t = 1/n` and
        :math:`\\alpha_t = \\alpha / (1 + \\alpha \\max(n - 1/\\beta, 0))`. The count grows by
        one per step up to :math:`1/\\beta` (a warm-up that averages the first
        curvature estimates instead of trusting one), and beyond it only while the
        running means :math:`\\bar g, \\bar e` of both innovations are
        indistinguishable from zero,

        .. math:: z^2 = \\frac{\\bar g^2}{r\\,V_g} + \\frac{\\bar e^2}{r\\,V_e} < z^2_{\\rm stall}

        (:math:`r = 1/n` their averaging rate, :math:`V` the variances, pooled over
        the site in standard-deviation units): there the mean and the precision
        become running averages of the noisy targets (Polyak-Ruppert averaging of
        the natural parameters). Where :math:`z^2 > z^2_{\\rm drift}` the targets
        have moved and the count falls back to :math:`1/\\beta`.
        """
        base = 1.0 / beta
        rate = (count + 1.0).reciprocal_()
        sigma = precision.rsqrt()
        fresh = self._fresh(group, states, "hdrift")
        seen = None if fresh is None else ~fresh
        if mask is not None:
            seen = mask if seen is None else seen & mask
        # innovations and their deviation from the running means so far (noise, pooled)
        innovation = torch.sub(target, precision).div_(precision)
        hdrift = self._buffer(group, states, "hdrift", 0.0)
        deviations = torch.stack([torch.sub(grad, drift).mul_(sigma), innovation - hdrift])
        low, high = self._pooled_noise(group, states, deviations.square_(), seen)
        if momentum:
            drift, drift_rate = direction, 1.0 - momentum
        else:
            drift, drift_rate = torch.lerp(drift, grad, rate), rate
        hdrift = torch.lerp(hdrift, innovation, rate)
        if fresh is not None:
            drift = drift if momentum else torch.where(fresh, grad, drift)
            hdrift = torch.where(fresh, innovation, hdrift)
        total = drift if pull is None else drift + pull  # the whole gradient, exact prior included
        signal = torch.stack([(total * sigma).square_().div_(drift_rate), hdrift.square().div_(rate)])
        stalled = signal.div(low).sum(0) < _STALL_Z2  # noise at its lowest plausible value
        drifting = signal.div_(high).sum(0) > _DRIFT_Z2  # and at its highest
        grown = count + 1.0
        # (selections of finite values by lerp on 0 / 1 masks, see _select)
        new_count = _select(stalled, grown, torch.minimum(grown, torch.clamp(count, min=base)))
        new_count = _select(drifting, new_count.new_tensor(base), new_count)
        # a first target that is not positive tells nothing of the precision: wait for one
        new_count = _select((count > 0) | (target > 0), new_count, count)
        if mask is not None:
            new_count = torch.where(mask, new_count, count)
            hdrift = torch.where(mask, hdrift, self._buffer(group, states, "hdrift", 0.0))
            if not momentum:
                drift = torch.where(mask, drift, self._buffer(group, states, "drift", 0.0))
        self._keep(group, states, "count", new_count)
        self._keep(group, states, "hdrift", hdrift)
        if not momentum:
            self._keep(group, states, "drift", drift)
        tiny = torch.finfo(new_count.dtype).tiny  # (1 / tiny is finite: the unselected value too)
        step_beta = _select(new_count > 0, new_count.clamp(min=tiny).reciprocal(), new_count.new_tensor(beta))
        step_lr = (new_count - base).clamp_(min=0.0).mul_(lr).add_(1.0).reciprocal_().mul_(lr)
        return step_beta, step_lr

    @staticmethod
    def _pooled_noise(group, states, squares, seen) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        The variances of the two innovations, per site: the mean over its elements
        ``seen`` this step of ``squares`` (one row per innovation), averaged over
        steps with a short and a long memory (``_NOISE_RATES``; a running mean until
        then). Returns the lower and the higher of the two, per element (shape
        ``squares.shape``, or ``(2, 1)`` for a group of one site), each at most the
        variance of a one-draw estimate at the fixed point (the rest is a transient,
        not noise). No device sync.
        """
        dtype, device = squares.dtype, squares.device
        constants = group.constants(dtype, device)
        single = len(states) == 1
        weights = None if seen is None else seen.to(dtype)
        if single:  # (innovation, site = 1)
            if weights is None:
                totals, counts = squares.sum(1, keepdim=True), constants["lengths"].to(dtype)
            else:
                totals, counts = (squares * weights).sum(1, keepdim=True), weights.sum().reshape(1)
        else:
            lengths = constants["lengths"]
            totals = torch.segment_reduce((squares if weights is None else squares * weights).T,
                                          "sum", lengths=lengths).T
            counts = lengths.to(dtype) if weights is None else torch.segment_reduce(weights, "sum", lengths=lengths)
        means = (totals / counts.clamp(min=1.0)).unsqueeze(-1)  # innovation, site, 1
        if any(state.noise is None for state in states):
            for state in states:
                if state.noise is None:
                    state.steps = torch.zeros((), dtype=dtype, device=device)
                    state.noise = torch.full((2, 2), math.inf, dtype=dtype, device=device)
        steps = torch.stack([state.steps for state in states])
        noise = torch.stack([state.noise for state in states], dim=1)  # innovation, site, memory
        touched = counts > 0
        steps = steps + touched.to(dtype)
        rate = torch.maximum(steps.reciprocal()[:, None], constants["rates"])
        new = torch.where(steps[:, None] <= 1, means, torch.lerp(noise, means, rate))  # the first whole
        noise = torch.where(touched[:, None], new, noise)
        for j, state in enumerate(states):
            state.steps, state.noise = steps[j], noise[:, j]
        low, high = noise.aminmax(dim=-1)
        # at most 1 for g / sqrt(lambda), 2 for (h - lambda) / lambda: one draw at lambda = h
        # and at least _NOISE_FLOOR: a drift below a millionth of a standard deviation is none
        ceiling = constants["ceiling"]
        low, high = (torch.minimum(n, ceiling).clamp_(min=_NOISE_FLOOR) for n in (low, high))
        if single:
            return low, high
        return low.repeat_interleave(constants["lengths"], dim=1), high.repeat_interleave(constants["lengths"], dim=1)

    @staticmethod
    def _fresh(group, states, name):
        """Where a site has no ``name`` buffer yet (flat bool), or ``None`` when all have."""
        if all(getattr(state, name) is not None for state in states):
            return None
        return _flat([torch.full_like(site.loc, getattr(state, name) is None, dtype=torch.bool)
                      for site, state in zip(group.sites, states)])

    @staticmethod
    def _buffer(group, states, name, fill: float) -> torch.Tensor:
        """The sites' ``name`` buffers as one flat vector (``fill`` for a site without one)."""
        values = [getattr(state, name) for state in states]
        if all(v is not None for v in values):
            return _flat(values)
        return _flat([torch.full_like(site.loc, fill) if v is None else v
                      for site, v in zip(group.sites, values)])

    @staticmethod
    def _keep(group, states, name, flat: torch.Tensor) -> None:
        """Store ``flat`` as the sites' ``name`` buffers, each shaped like its loc."""
        for state, piece in zip(states, _unflatten_dense_tensors(flat, [site.loc for site in group.sites])):
            setattr(state, name, piece)

    def _dense_adaptive(self, site, stats) -> bool:
        """Whether a full-covariance site takes the adaptive steps (:meth:`_dense_rates`):
        sampled statistics, with ``averaging`` on and no schedule of the user's."""
        return self._adaptive and isinstance(site, FullCovarianceSite) and bool(stats.sampled)

    @staticmethod
    def _dense_rates(settings: Settings, state: "_SiteState") -> Tuple[float, float, float]:
        """
        ``(lr, beta, n)`` of a full-covariance site's adaptive step: with the site's
        count :math:`n` (1 at its first step),

        .. math:: \\beta_t = \\max(1/n, \\beta_{\\min}), \\qquad
                  \\alpha_t = \\max\\big(\\alpha / (1 + \\alpha \\max(n - 1/\\beta, 0)),
                  \\beta_{\\min}\\big),

        :math:`\\beta_{\\min}` = ``_DENSE_FLOOR``: once :math:`n` passes :math:`1/\\beta`
        the precision is the running mean of the curvature targets (for a Gaussian
        target, of unbiased estimates of its Hessian) and the mean the Polyak-Ruppert
        average of Newton steps.
        """
        lr, beta = settings.lr, settings.beta
        n = 1.0 if state.count is None else float(state.count.reshape(-1)[0])
        rate = max(1.0 / n, _DENSE_FLOOR)
        step = max(lr / (1.0 + lr * max(n - 1.0 / beta, 0.0)), _DENSE_FLOOR)
        return min(step, lr), min(rate, 1.0), n

    @staticmethod
    def _dense_count(settings: Settings, state: "_SiteState", n: float, newton: torch.Tensor) -> Dict:
        """
        The drift test of a full-covariance site's adaptive steps, on the Newton step
        in the new guide's standard deviations, :math:`z = C'^\\top \\bar g`
        (:math:`\\mathcal{N}(0, I/K)` at the optimum of a Gaussian target, :math:`K`
        particles): with running means :math:`\\bar z` and :math:`v` of :math:`z` and
        :math:`\\|z\\|^2` (rate :math:`\\rho` = ``_DENSE_RATE``, started at the first
        step's), :math:`z^2 = \\|\\bar z\\|^2 (2 - \\rho) / (\\rho v)` is about 1 when
        :math:`z` is pure noise and :math:`(2 - \\rho)/\\rho` = 19 while the mean is far.
        The count grows to :math:`1/\\beta`, beyond that while :math:`z^2 <` 2, and falls
        back to :math:`1/\\beta` above 12 (the mean-field thresholds). The state to keep.
        """
        rho = _DENSE_RATE
        square = newton.square().sum()
        if state.drift is None:
            drift, power = newton, square
        else:
            drift = torch.lerp(state.drift.to(newton), newton, rho)
            power = torch.lerp(state.noise.to(square), square, rho)
        z2 = float(drift.square().sum() * (2 - rho) / (rho * power.clamp(min=_NOISE_FLOOR)))
        fallback = 1.0 / settings.beta
        grown = n + 1.0 if (n < fallback or z2 < _STALL_Z2) else n
        if z2 > _DRIFT_Z2:
            grown = min(grown, max(fallback, 1.0))
        dtype = state.loc().dtype
        return {"count": torch.full_like(newton, grown, dtype=dtype), "drift": drift.to(dtype),
                "noise": power.to(dtype)}

    def _full_step(self, site, stats, settings: Settings, tau, state: "_SiteState", adaptive: bool = False):
        """
        The step of :func:`~pyro_ngvi.full_covariance.natural_step` for a
        full-covariance site (of :func:`~pyro_ngvi.kronecker.kronecker_step` for a
        Kronecker-factored layer), not yet written: ``(values to write, momentum,
        state to keep)``, or ``None`` when a new precision is not positive definite.
        Same ``lr``, ``beta``, ``tau``, momentum, damping, trust region (sampled
        curvature) and first-step warm start as the mean-field update (a Kronecker
        layer's first step takes its factors from the data, as noisy K-FAC initialises
        them). With ``adaptive`` (sampled curvature and NGVI's defaults) ``lr`` and
        ``beta`` follow :meth:`_dense_rates`, Lin et al.'s correction is added only in
        the eigen-directions whose target is not positive, and the precision changes by
        at most a factor ``_DENSE_RATIO`` per step in each.
        """
        lr, beta, rho, damping = settings
        grad = stats.grad / tau if tau != 1 else stats.grad
        momentum = grad
        if rho and state.momentum is not None:
            momentum = torch.lerp(grad, state.momentum, rho)
        if isinstance(site, KroneckerSite):
            step = kronecker_step(site.mean, site.row_factor, site.col_factor, momentum, stats, lr, beta,
                                  tau, damping, first=not state.started)
            return None if step is None else (tuple(step), momentum, {})
        count = None
        if adaptive:
            lr, beta, count = self._dense_rates(settings, state)
        step = full_covariance.natural_step(
            site.mean, site.factor, momentum, stats.curvature, lr, beta, tau, damping,
            stats.prior_loc, stats.prior_precision,
            max_step=self.max_step if stats.sampled else None,
            warm=self.warm_start and not state.started, whitened=stats.whitened,
            by_direction=adaptive, max_ratio=_DENSE_RATIO if adaptive else None,
        )
        if step is None:
            return None
        kept = {}
        if adaptive:
            newton = step.factor.T.to(momentum) @ momentum  # z = C'^T g
            kept = self._dense_count(settings, state, count, newton)
        return (step.mean, step.factor), momentum, kept

    def _momentum(self, group: "_Group", states: List["_SiteState"], grad: torch.Tensor, mask,
                  rho: float, run: Optional["_Spans"] = None) -> torch.Tensor:
        """
        :math:`\\bar g \\leftarrow \\rho \\bar g + (1 - \\rho) g` (a site's first step
        takes g), as one flat vector; each site's buffer is kept as a view of it.
        In a run of spans (one site), the span of the site's buffer, updated in place.
        """
        if rho == 0:
            return grad
        if run is not None:
            buffer = run.momentum[run.slice]
            if run.fresh_momentum:
                return buffer.copy_(grad)
            return torch.lerp(grad, buffer, rho, out=buffer)
        sites = group.sites
        if all(state.momentum is not None for state in states):
            old = _flat([state.momentum for state in states])
            new = torch.lerp(grad, old, rho)
            if mask is not None:
                new = torch.where(mask, new, old)
        else:  # some site's first step: its buffer starts at g
            pieces = grad.split(group.sizes)
            old = _flat([piece if state.momentum is None else state.momentum.reshape(-1)
                         for state, piece in zip(states, pieces)])
            started = _flat([torch.full_like(piece, state.momentum is not None, dtype=torch.bool)
                             for state, piece in zip(states, pieces)])
            new = torch.where(started, torch.lerp(grad, old, rho), grad)
        for state, piece in zip(states, _unflatten_dense_tensors(new, [site.loc for site in sites])):
            state.momentum = piece  # shaped like the site's loc
        return new

    def _restart_momentum(self) -> None:
        """Forget every site's momentum (its next step starts the average at g)."""
        for state in self._states.values():
            state.momentum = None

    # ---------------------------------------------------------------- state
    def get_state(self) -> Dict:
        """
        Optimizer state: step counts, each site's state (keyed, as Pyro keys its
        optimizers' state, by the param-store name of the site's ``loc``) and the
        point optimizers'. Plain tensors, numbers and strings: it loads with
        ``torch.load(..., weights_only=True)``. A copy: later steps leave it as it is.
        """
        store = pyro.get_param_store()
        sites = {}
        for state in self._states.values():
            loc = state.loc()
            name = None if loc is None else store.param_name(loc)
            if name is not None:
                sites[name] = {"started": state.started,
                               **{key: None if getattr(state, key) is None else getattr(state, key).clone()
                                  for key in _BUFFERS + _SITE_TENSORS}}
        for name, pending in self._pending_states.items():  # restored, not seen since
            sites.setdefault(name, pending)
        return {
            "ngvi": {"num_steps": self.num_steps, "num_skipped_steps": self.num_skipped_steps,
                     "sites": sites},
            "point": copy.deepcopy(super().get_state()),  # torch's state_dict aliases live tensors
        }

    def set_state(self, state_dict: Dict) -> None:
        """
        Restore a :meth:`get_state` dict (also after :meth:`load`); each site's
        entry is taken up when a site of that name next steps, each point
        parameter's when it next steps (also if it has stepped before).

        :raises ValueError: for a dict :meth:`get_state` does not produce (the
            optimizer is then unchanged). An entry that does not fit its site
            or parameter (a checkpoint of another model) is refused at the next
            step, before anything is written.
        """
        _check_state(state_dict)
        ngvi, point = state_dict["ngvi"], state_dict["point"]
        self.num_steps = ngvi["num_steps"]
        self.num_skipped_steps = ngvi["num_skipped_steps"]
        self._states = {}
        self._safeguards = []
        self._signs = {}
        self._elbo_watch, self._elbo_flag, self._skips_in_a_row = ElboWatch(), None, 0
        self._pending_states = {name: dict(entry) for name, entry in ngvi["sites"].items()}
        store = pyro.get_param_store()
        for p in [p for p in self.optim_objs if store.param_name(p) in point]:
            del self.optim_objs[p]  # restored, not kept: it loads the entry when it next steps
        super().set_state(copy.deepcopy(point))  # loading may alias them: steps would change ``point``

    def load(self, filename, map_location=None) -> None:
        """
        Restore a state saved by :meth:`save`, loading it with
        ``torch.load(..., weights_only=True)``: only tensors, numbers, strings and
        containers are built, so a crafted file cannot run code (Pyro's
        :meth:`PyroOptim.load <pyro.optim.optim.PyroOptim.load>` would run it).

        :param filename: a file written by :meth:`save`.
        :param map_location: as in :func:`torch.load` (default: None).
        :raises ValueError: when the file holds other objects (nothing from it
            has run), or is not an NGVI state.
        """
        self.set_state(safe_load(filename, map_location, what="NGVI state"))


class _NewtonGuard:
    """
    Accept-or-damp for steps whose statistics were evaluated at the mean (a
    diagonal Newton method on :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J|`):
    a step after which :math:`F` rose (or is not finite) is undone, and the mean
    step of the next ones is divided by a factor :math:`f` (Levenberg-Marquardt
    damping of the diagonal curvature, :math:`D \\to fD`), multiplied by
    :math:`\\nu` on each rejection (:math:`\\nu` doubling while rejections follow
    one another) and relaxed after accepted steps by Nielsen's rule,
    :math:`f \\leftarrow \\max(1, f \\max(1/3, 1 - (2\\rho - 1)^3))` with :math:`\\rho`
    the actual over the predicted decrease of :math:`F`. An undamped step
    (:math:`f = 1`) that decreases :math:`F` passes untouched, so ``lr = beta = 1``
    with exact curvature is still one Newton step where that step is good [5].
    """

    __slots__ = ("factor", "nu", "reference", "saved", "predicted", "rejected")

    def __init__(self):
        self.factor, self.nu = 1.0, 2.0
        self.reference: Optional[float] = None  # F at the saved point
        self.saved: List = []  # (site, loc, raw scale) before the last step
        self.predicted = 0.0
        self.rejected = 0

    def rejects(self, sites, objective: float, step: int) -> bool:
        """Undo the last step if ``objective`` (F at its result) is worse than before it."""
        if self.reference is None or [s for s, _, _ in self.saved] != list(sites):
            return False
        slack = 1e-9 * max(1.0, abs(self.reference))
        if objective <= self.reference + slack:  # accepted: relax the damping
            rho = (self.reference - objective) / self.predicted if self.predicted > 0 else 1.0
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
            "warned at the 1st, 2nd, 4th, ...; see num_rejected_steps). A diagonal Newton step (exact curvature, lr = beta = 1) diverges where "
            "lr > 2 / lambda_max(D^-1 H) (correlated designs) or jumps out of its region of "
            "validity (funnels): a smaller lr avoids the undone steps.",
            NGVIWarning,
            stacklevel=4,
        )
        return True

    def keep(self, sites, objective: float) -> None:
        """Remember the point the coming step starts from, and F there."""
        with torch.no_grad():
            if [s for s, _, _ in self.saved] == list(sites):
                for site, loc, raw_scale in self.saved:
                    loc.copy_(site.loc)
                    raw_scale.copy_(site.raw_scale)
            else:
                self.saved = [(site, site.loc.detach().clone(), site.raw_scale.detach().clone())
                              for site in sites]
        self.reference = objective


#: The per-element buffers of :class:`_SiteState` (saved by :meth:`NGVI.get_state`).
_BUFFERS = ("momentum", "count", "drift", "hdrift")
#: Per-site (not per-element) tensors of :class:`_SiteState`, saved too.
_SITE_TENSORS = ("steps", "noise", "cross")


class _SiteState:
    """What NGVI keeps for one site between steps, keyed by its ``loc`` tensor."""

    __slots__ = ("loc", "started", "momentum", "far_steps", "count", "drift", "hdrift", "steps", "noise",
                 "cross")

    def __init__(self, loc: weakref.ref):
        self.loc = loc  # a weak reference: a cleared param store frees the site
        self.started = False  # the first-step warm start has happened
        self.momentum: Optional[torch.Tensor] = None
        self.far_steps = 0  # consecutive steps its gradient exceeded _FAR sigma (mostly)
        # sampled statistics, per element: the count n of the adaptive steps and the
        # running means of g (the momentum buffer, if any) and of (h - lambda) / lambda
        self.count: Optional[torch.Tensor] = None
        self.drift: Optional[torch.Tensor] = None
        self.hdrift: Optional[torch.Tensor] = None
        self.steps: Optional[torch.Tensor] = None  # steps that fed the site's pooled noise
        self.noise: Optional[torch.Tensor] = None  # the two pooled variances (short, long memory)
        # the regression of the cross terms of the control variate, of the small sites this site
        # is the first of (NGVI._cross_terms)
        self.cross: Optional[torch.Tensor] = None


class _Spans:
    """
    What a large site's update accumulates span by span (:meth:`NGVI._update_group`):
    the current ``slice``, the new :math:`\\sigma` (a whole vector, written span by
    span: the scale remembered for the next reader), the momentum buffer (the site's
    own, updated in place, or a new one on its first step), the signs of :math:`g`
    (sampled statistics) and the counts of the stall test, the clamp flags and the
    spread of the watch on growing means.
    """

    def __init__(self, optim, group: "_Group", state: "_SiteState", size: int, sampled: bool, rho: float):
        like, (site,) = group.locs[0], group.sites
        self.slice = slice(0, 0)
        # the new sigma over the one remembered (ours: each span reads its old values first)
        remembered = known_scale(site.raw_scale)
        self.scale = remembered.view(-1) if remembered is not None and remembered.is_contiguous() else \
            torch.empty_like(like)
        # the old sigma, read span by span before the span's new one is written over it (None: unknown)
        self.old_scale = remembered
        self.fresh_momentum = rho != 0 and state.momentum is None
        self.momentum = None
        if rho != 0:
            self.momentum = torch.empty_like(like) if self.fresh_momentum else state.momentum.view(-1)
        self.clamped: List[torch.Tensor] = []
        self.spread = torch.zeros((), dtype=like.dtype, device=like.device)  # sum lambda_0 (mu - m_0)^2
        self.signs = self.last_signs = None
        self.far = 0
        if sampled:
            last = optim._signs.get(id(group))
            self.last_signs = last[1] if last is not None and last[0] is group else None
            self.signs = torch.empty_like(like, dtype=torch.bool)

    def finish(self, optim, group: "_Group", state: "_SiteState", prior: bool):
        """Keep the site's buffers and scale; the flags and the new scale, as :meth:`NGVI._update_span`
        returns (the watch on growing means fed the spread the spans summed, given a ``prior``)."""
        (site,), size = group.sites, self.scale.numel()
        if self.fresh_momentum:
            state.momentum = self.momentum.view_as(site.loc)
        remember_scale(site.raw_scale, self.scale.view_as(site.loc))
        far = None
        if self.signs is not None:
            optim._signs[id(group)] = (group, self.signs)
            far = (torch.as_tensor(self.far) > size // 2) if self.last_signs is not None else torch.zeros(
                (), dtype=torch.bool, device=self.scale.device)
        spreading = optim._spread_watch.flag(group, self.spread / size, optim.num_steps) if prior else None
        return torch.stack(self.clamped).any(), far, self.scale, spreading


class _Safeguards(NamedTuple):
    """A group's safeguard flags of one step (0-d bool tensors), read at the next sync."""

    group: "_Group"
    states: List[_SiteState]
    clamped: torch.Tensor
    far: Optional[torch.Tensor]
    spreading: Optional[torch.Tensor] = None  # means growing without bound (pyro_ngvi.monitor)

    def flags(self) -> List[torch.Tensor]:
        """In the order :meth:`NGVI._report` reads them."""
        return [f for f in (self.clamped, self.spreading, self.far) if f is not None]


def _clamp_precision_(precision: torch.Tensor, floor: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Keep ``precision`` in ``[tiny, max / 4]`` of its dtype, in place: then
    :math:`\\sigma = \\lambda^{-1/2}` and :math:`\\sigma^{-2}` are finite and
    positive. (The update from finite statistics is a convex combination plus a
    non-negative correction: never NaN, below ``tiny`` only by underflow, above
    the top by overflow of the correction.) With a ``floor`` (the family's
    :math:`\\lambda_{\\min}`, broadcast to ``precision``), also
    :math:`\\lambda \\ge \\lambda_{\\min}`. Returns whether the top
    was passed, as a 0-d bool tensor (no device sync), and a lower bound on the
    smallest precision (0-d, at least ``tiny``).
    """
    info = torch.finfo(precision.dtype)
    high = info.max / 4
    lowest, highest = torch.aminmax(precision)
    lowest = lowest.clamp(min=info.tiny)
    if floor is None:
        precision.clamp_(info.tiny, high)
    else:  # (two passes: torch's CPU clamp with tensor bounds is ~7x slower than both together)
        precision.clamp_(info.tiny, high)
        torch.maximum(precision, floor, out=precision)
    return highest > high, lowest


def _select(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """
    ``torch.where(condition, a, b)`` for finite ``a`` and ``b`` (broadcast), as
    ``torch.lerp(b, a, m)`` on the 0 / 1 mask ``m`` of ``condition``: exactly the same
    values (``lerp(b, a, 0) = b``, ``lerp(b, a, 1) = a``), without torch's CPU ``where``,
    which runs one element at a time (~4 ns an element against ~0.2-0.4 ns).
    """
    return torch.lerp(b, a, condition.to(torch.result_type(a, b)))


def _mostly(flags: torch.Tensor, mask) -> torch.Tensor:
    """Whether more than half of the (``mask``) elements are set, as a 0-d bool tensor."""
    if mask is None:
        return torch.count_nonzero(flags) > flags.numel() // 2
    return torch.count_nonzero(flags & mask) * 2 > torch.count_nonzero(mask)


def _fit_to_site(stats: SiteCurvature, site: GaussianSite) -> SiteCurvature:
    """
    ``stats`` in the dtype and on the device of the site's ``loc`` (an ELBO may
    compute a float32 site's curvature in float64); a tensor of another shape
    is refused, before anything is written.
    """
    loc, converted = site.loc, {}
    for name in ("grad", "curvature", "prior_loc", "prior_precision", "mask", "scale", "min_precision",
                 "eps_mean", "eps_sq_mean"):
        value = getattr(stats, name)
        if value is None:
            continue
        if value.shape != loc.shape:
            raise ValueError(
                f"The ELBO handed NGVI a {name} of shape {tuple(value.shape)} for site "
                f"'{site.name}', whose loc has shape {tuple(loc.shape)}"
            )
        if name == "mask":
            if value.device != loc.device:
                converted[name] = value.to(loc.device)
        elif value.dtype != loc.dtype or value.device != loc.device:
            converted[name] = value.to(loc)
    return replace(stats, **converted) if converted else stats


def _check_state(state_dict) -> None:
    """:raises ValueError: unless ``state_dict`` has the form :meth:`NGVI.get_state` gives."""
    def fail(why):
        raise ValueError(f"NGVI.set_state expects a dict produced by NGVI.get_state: {why}")

    def count(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(state_dict, dict) or set(state_dict) != {"ngvi", "point"}:
        fail("the keys must be 'ngvi' and 'point'")
    ngvi, point = state_dict["ngvi"], state_dict["point"]
    if not isinstance(ngvi, dict) or set(ngvi) != {"num_steps", "num_skipped_steps", "sites"}:
        fail("state['ngvi'] must have the keys 'num_steps', 'num_skipped_steps' and 'sites'")
    for key in ("num_steps", "num_skipped_steps"):
        if not count(ngvi[key]):
            fail(f"state['ngvi'][{key!r}] must be a non-negative integer, got {ngvi[key]!r}")
    if not isinstance(ngvi["sites"], dict):
        fail("state['ngvi']['sites'] must be a dict")
    keys = {"started", *_BUFFERS, *_SITE_TENSORS}
    for name, entry in ngvi["sites"].items():
        if not (isinstance(name, str) and isinstance(entry, dict) and "started" in entry
                and "momentum" in entry and set(entry) <= keys):
            fail(f"site entry {name!r} must be a dict with the keys 'started', 'momentum' and "
                 f"(from this version on) {', '.join(map(repr, _BUFFERS[1:] + _SITE_TENSORS))}")
        if not isinstance(entry["started"], bool) or not all(
            entry.get(key) is None or (torch.is_tensor(entry[key]) and entry[key].is_floating_point())
            for key in _BUFFERS + _SITE_TENSORS
        ):
            fail(f"site entry {name!r} needs a bool 'started' and float tensors or None for the rest")
    if not isinstance(point, dict):
        fail("state['point'] must be a dict")
    for name, entry in point.items():
        if not (isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("state"), dict)
                and isinstance(entry.get("param_groups"), list)
                and all(isinstance(v, dict) for v in entry["state"].values())):
            fail(f"point entry {name!r} must be a torch optimizer's state_dict")


def _statistics(stats) -> tuple:
    """The tensors of a site's statistics that must be finite."""
    if isinstance(stats, KroneckerCurvature):
        return stats.tensors
    return stats.grad, stats.curvature


def _still_stored(site, store) -> bool:
    """Whether the param store still holds the site's tensors under their names."""
    if isinstance(site, KroneckerSite):
        return store.get(site.row_name) is site.raw_row_scale_tril and store.get(site.col_name) is site.raw_col_scale_tril
    if isinstance(site, FullCovarianceSite) and store.get(site.scale_tril_name) is not site.raw_scale_tril:
        return False
    return store.get(site.scale_name) is site.raw_scale


@torch.no_grad()
def _full_reparam_curvature(site: FullCovarianceSite) -> SiteCurvature:
    """
    :math:`g` and the Price curvature :math:`H` of a full-covariance site from the
    reparameterised gradients ``SVI`` left on its ``loc``, ``scale`` and
    ``scale_tril``: the gradient w.r.t. :math:`C` is
    :math:`\\mathrm{tril}(E[g\\epsilon^\\top]) - \\mathrm{diag}(1/s)` (the entropy
    gives the second term), so
    :func:`~pyro_ngvi.full_covariance.price_curvature` of it plus
    :math:`\\mathrm{diag}(1/s)` is :math:`H` (the mean-field
    :math:`(\\nabla_\\sigma + 1/\\sigma)/\\sigma` on a diagonal). Handed on whitened,
    :math:`C^\\top H C`, which needs no inverse.
    """
    raw = site.raw_scale.detach().double()
    transform = site._scale_transform
    scale = transform(raw)
    scale_grad = site.raw_scale.grad.double() / transform.log_abs_det_jacobian(raw, scale).exp()
    unit_tril = site.unit_tril.double()
    tril_grad = site.raw_scale_tril.grad
    tril_grad = torch.zeros_like(unit_tril) if tril_grad is None else tril_grad.double()
    # UnitLowerCholeskyTransform is the identity on the strictly lower triangle
    factor_grad = full_covariance.factor_gradient(scale, unit_tril, scale_grad, tril_grad)
    factor_grad = factor_grad + torch.diag_embed(scale.reciprocal())
    curvature = full_covariance.whitened_price_curvature(
        full_covariance.covariance_factor(scale, unit_tril), factor_grad)
    return SiteCurvature(site.loc.grad.detach(), curvature.to(site.loc.dtype), sampled=True,
                         whitened=True)


def _finite(*tensors: torch.Tensor, mask=None, exact: bool = False) -> torch.Tensor:
    """
    Whether the ``mask`` rows (all: ``None``) of every tensor are finite, as a 0-d
    bool tensor (no device sync), from their sum: one reduction per tensor
    (``isfinite(x).all()`` costs several times more on the CPU). A finite sum
    proves them finite; a non-finite one may also be an overflow of finite values,
    which ``exact`` tells apart: accumulated in float64, the sum is finite iff they
    all are (float64 cannot overflow on float32 values; for float64 values only
    beyond ~1e300). Cheap first, exact where the cheap sum is not finite.
    """
    total = 0
    for t in tensors:
        if mask is not None:
            t = t.reshape(-1)[mask.reshape(-1)]
        total = total + (t.sum(dtype=torch.float64) if exact else t.sum())
    return torch.isfinite(total)


def _one_draw(svi) -> bool:
    """Whether ``svi`` computes its gradients from one draw of each latent: a plain
    ``Trace_ELBO`` / ``JitTrace_ELBO`` with one particle (then :math:`\\epsilon` is
    recoverable from :math:`g` and :math:`h`)."""
    elbo = getattr(getattr(svi, "loss_and_grads", None), "__self__", None)
    return type(elbo) in _ONE_DRAW_ELBOS and getattr(elbo, "num_particles", None) == 1


def _param_label(p: torch.Tensor) -> str:
    return pyro.get_param_store().param_name(p) or f"tensor of shape {tuple(p.shape)}"


def _group_sites(sites: List[GaussianSite], stats: Dict[str, SiteCurvature]) -> List[List[GaussianSite]]:
    """
    Sites whose update can run as one flat vector: same scale constraint, dtype,
    device, ``sampled`` and ``nonnegative`` flags and prior presence, no mask, at most ``_FLAT_MAX``
    elements together. A masked site (subsampled rows) or a large one is a group
    of its own (no copies: its flat tensors are views).
    """
    groups: Dict[tuple, List[GaussianSite]] = {}
    sizes: Dict[tuple, int] = {}
    for site in sites:
        s = stats[site.key]
        if s.mask is not None or site.loc.numel() > _FLAT_MAX:
            key = ("alone", site.key)
        else:
            constraint = id(pyro.get_param_store()._constraints[site.scale_name])
            key = (constraint, site.loc.dtype, site.loc.device, s.sampled, s.nonnegative,
                   s.prior_precision is None, s.eps_mean is None, s.num_data, s.min_precision is None)
            if sizes.get(key, 0) + site.loc.numel() > _FLAT_MAX:  # start another group
                groups[key + (len(groups),)] = groups.pop(key)
                sizes[key] = 0
        groups.setdefault(key, []).append(site)
        sizes[key] = sizes.get(key, 0) + site.loc.numel()
    return list(groups.values())


class _Group(NamedTuple):
    """Sites updated as one flat vector, with what the update needs of them every step."""

    sites: List[GaussianSite]
    sizes: List[int]
    locs: List[torch.Tensor]  # flat views of the sites' loc tensors, to write into
    raw_scales: List[torch.Tensor]  # and of their raw scale tensors
    transform: object  # raw scale -> sigma
    cache: Dict  # small constant tensors of the adaptive steps, by (dtype, device); kept flats (flat_of)

    @classmethod
    def of(cls, sites: List[GaussianSite]) -> "_Group":
        with torch.no_grad():
            return cls(sites, [site.loc.numel() for site in sites],
                       [site.loc.view(-1) for site in sites],
                       [site.raw_scale.view(-1) for site in sites],
                       sites[0]._scale_transform, {})

    def flat_of(self, name: str, tensors: List[torch.Tensor]) -> torch.Tensor:
        """:func:`_flat` of ``tensors``, kept while they are the same tensors, unchanged (a
        fixed prior and the family's floor are: their concatenation is not redone every
        step); the result is read-only."""
        if len(tensors) == 1:  # a view: nothing to keep
            return _flat(tensors)
        versions = [t._version for t in tensors]
        kept = self.cache.get(("flat", name))
        if kept is not None and kept[1] == versions and all(a is b for a, b in zip(kept[0], tensors)):
            return kept[2]
        flat = _flat(tensors)
        self.cache[("flat", name)] = (list(tensors), versions, flat)
        return flat

    def constants(self, dtype, device) -> Dict[str, torch.Tensor]:
        found = self.cache.get((dtype, device))
        if found is None:
            found = self.cache[(dtype, device)] = {
                "lengths": torch.tensor(self.sizes, device=device),
                "rates": torch.tensor(_NOISE_RATES, dtype=dtype, device=device),
                "ceiling": torch.tensor([[1.0], [2.0]], dtype=dtype, device=device),
            }
        return found


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors, flattened and concatenated (no copy for a single contiguous one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    if all(t.is_contiguous() for t in tensors):
        return _flatten_dense_tensors(tensors)  # one call: reshape and cat in C++
    return torch.cat([t.reshape(-1) for t in tensors])  # (an expanded prior: no copy before the cat)
