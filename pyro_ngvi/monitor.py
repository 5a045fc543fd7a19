"""
What :class:`~pyro_ngvi.NGVI` watches while it trains, so that a run that has gone
wrong says so instead of ending in a guide that predicts nothing (issue 19):

* **means growing without bound**: a site's means, measured in prior standard
  deviations, :math:`z^2 = \\mathrm{mean}\\,\\lambda_0(\\mu - m_0)^2`, beyond
  :data:`SPREAD_LIMIT` and at least doubled since a reference step (taken every
  :data:`SPREAD_EVERY` steps; measured every step, one dot product). A Normal prior puts
  :math:`e^{-z^2/2}` of its density there, so no posterior goes there but one whose
  mean steps are unstable (Gauss-Newton curvature vanishes on confidently wrong
  examples, while their gradient does not);
* **a training ELBO that keeps getting worse**: the negative ELBO the ELBO
  evaluations hand over (``loss`` of a :class:`~pyro_ngvi.handover.SiteCurvature`), averaged
  over windows of :data:`ELBO_WINDOW` accepted steps, rising from each window to
  the next :data:`ELBO_RISES` times in a row, by more than
  :data:`ELBO_SIGNIFICANCE` standard errors in all (the minibatch and sampling
  noise of a window's mean is estimated from its own steps) and by more than
  :math:`10^{-6}` of its value (round-off of a deterministic run), or a window mean
  above the best window's (or the first step's loss) by more than :data:`ELBO_BLOWUP` times
  its standard deviation plus its size (a run that blew up: one window suffices). Pyro's own losses feed it the
  loss ``SVI.step`` computed (:func:`~pyro_ngvi.family.step_loss`);
* **a training loss that is not finite** over a window while the steps' gradients were (a log
  density of :math:`-\\infty` where the guide draws, whose gradient, 0, tells the guide nothing:
  before, such a run trained on the rest of the model without a word);
* **a guide that can only produce non-finite predictions**: every step skipped
  for non-finite statistics, :data:`SKIPS_IN_A_ROW` times in a row; nothing can
  change the guide any more, so NGVI raises.

Each warns once (the skipped steps at the 1st, 2nd, 4th, 8th, ...), with what
happened and what to change. Checks ride on the device sync NGVI does once a step
anyway (a flag computed at one step is read at the next).
"""

import math
from typing import List, Optional, Tuple

import torch

#: Steps between two reference measurements of a site's spread.
SPREAD_EVERY = 10
#: The spread :math:`\mathrm{mean}\,\lambda_0(\mu - m_0)^2` beyond which growing means are
#: reported (root-mean-square 10 prior standard deviations).
SPREAD_LIMIT = 100.0
#: Accepted steps whose losses make one window mean of the ELBO watch.
ELBO_WINDOW = 100
#: Window means rising in a row before the ELBO watch reports.
ELBO_RISES = 3
#: Total rise over those windows, in standard errors of the difference, needed to report.
ELBO_SIGNIFICANCE = 4.0
#: A window mean above the best window's mean :math:`m` by more than this times
#: :math:`s + |m|` (:math:`s` the standard deviation of its steps' losses) is reported at once.
ELBO_BLOWUP = 1.0
#: Skipped steps in a row after which NGVI raises.
SKIPS_IN_A_ROW = 50


class NGVIWarning(UserWarning):
    """Warned when :class:`~pyro_ngvi.NGVI` skips a step (non-finite gradient or curvature), a
    safeguard engages (a precision clamped, a site whose mean stalls, a Newton step undone), a
    watch above reports, or a :class:`~pyro_ngvi.BayesianNet` runs where NGVI cannot see its
    recipe (inside another model)."""


def spread(deviation: torch.Tensor, pull: torch.Tensor) -> torch.Tensor:
    """:math:`\\mathrm{mean}\\,\\lambda_0(\\mu - m_0)^2` from the flat ``deviation`` :math:`\\mu - m_0`
    and ``pull`` :math:`\\lambda_0(\\mu - m_0)`, as a 0-d tensor (no device sync)."""
    return torch.dot(pull, deviation) / deviation.numel()


def power_of_two(count: int) -> bool:
    """Whether ``count`` is 1, 2, 4, 8, ...: when a repeated event is worth a warning."""
    return count > 0 and count & (count - 1) == 0


class SpreadWatch:
    """Each group's spread at its last reference step (every :data:`SPREAD_EVERY` steps), to tell
    growth from a large but steady value."""

    def __init__(self):
        self.reference = {}  # id(group) -> (group, max(SPREAD_LIMIT, 2 x its spread at the reference step))
        self.latest = {}  # id(group) -> spread at the latest step
        self.warned = set()  # ids of groups already reported

    def flag(self, group, value: torch.Tensor, step: int) -> torch.Tensor:
        """Whether ``value`` is beyond the limit and at least twice the reference (0-d bool);
        at every :data:`SPREAD_EVERY`-th step ``value`` becomes the reference. (One comparison a
        step: with the reference, its threshold :math:`\\max(` :data:`SPREAD_LIMIT`, twice the
        reference :math:`)` is kept.)"""
        key = id(group)
        reference = self.reference.get(key)
        self.latest[key] = value
        fresh = reference is None or reference[0] is not group
        flag = torch.zeros((), dtype=torch.bool, device=value.device) if fresh else value > reference[1]
        if fresh or step % SPREAD_EVERY == 0:
            self.reference[key] = (group, torch.clamp(2 * value, min=SPREAD_LIMIT))
        return flag

    def keep(self, groups) -> None:
        """Forget every group but ``groups`` (those of the plans NGVI still holds): a group whose
        plan is gone would keep its guide's tensors alive, and its id could be another's later."""
        live = {id(group) for group in groups}
        self.reference = {k: v for k, v in self.reference.items() if k in live}
        self.latest = {k: v for k, v in self.latest.items() if k in live}
        self.warned &= live

    def message(self, group, names: str, step: int) -> Optional[str]:
        """The warning for ``group`` (``None`` when it has been given already)."""
        if id(group) in self.warned:
            return None
        self.warned.add(id(group))
        now = math.sqrt(float(self.latest[id(group)]))
        return (
            f"NGVI: the means of {names} grow without bound: their root-mean-square distance from "
            f"the prior mean reached {now:.3g} prior standard deviations at step {step}, more than "
            f"doubling its square within {SPREAD_EVERY} steps. The mean steps are unstable: with "
            "Gauss-Newton curvature ('ggn', 'ggn_mc'), which vanishes on confidently wrong examples "
            "while their gradient does not, the step lr * g / (precision + damping) has nothing to "
            "bound it. Lower lr or raise damping; for a BayesianNet, NGVI()'s defaults damp the mean "
            "step by N (the data size) and start the guide at bnn.guide(), for standardised inputs (and "
            "Gaussian targets)."
        )


#: What the ELBO watch adds where each step's statistics come from one draw of the guide.
ONE_DRAW_ADVICE = (
    " Each step's statistics come from one draw of the guide: where the log joint is heavy-tailed "
    "in those draws (a scale multiplying other latents, as in a non-centred hierarchical model) one "
    "draw is too few, and averaging several is the remedy: "
    "Trace_ELBO(num_particles=8, vectorize_particles=True).")


class ElboWatch:
    """Window means of the negative ELBO handed over by accepted steps, and their standard errors."""

    def __init__(self):
        self.losses: List = []  # this window's, as handed over (reduced at the window's end)
        self.windows: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (mean, squared standard error)
        self.best: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (mean, standard deviation) of the best
        self.warned = False
        self.one_draw = False  # the steps' statistics come from one draw of the guide (the advice differs)
        self.infinite = None  # the last window's mean is not finite (0-d bool)

    @property
    def count(self) -> int:
        """Steps counted in the current window."""
        return len(self.losses)

    def reset(self) -> None:
        """Forget the windows (the objective changed: a temperature other than 1)."""
        self.losses = []
        self.windows = []
        self.best = None

    def add(self, loss) -> Optional[torch.Tensor]:
        """
        Count one accepted step's ``loss``; at the end of a window, the flag (0-d bool)
        that the last :data:`ELBO_RISES` + 1 window means rose each time and by more
        than :data:`ELBO_SIGNIFICANCE` standard errors in all, else ``None``. (A step
        only keeps its loss: the window is reduced, in float64, at its end.)
        """
        if self.warned:
            return None
        self.losses.append(loss.detach() if torch.is_tensor(loss) and loss.requires_grad else loss)
        if len(self.losses) < ELBO_WINDOW:
            return None
        window = torch.stack([torch.as_tensor(value, dtype=torch.float64) for value in self.losses])
        self.losses = []
        mean = window.mean()
        # a loss not finite while the steps' gradients were: a log density of -inf where the guide draws
        self.infinite = ~torch.isfinite(mean)
        variance = (window.square().mean() - mean.square()).clamp(min=0.0)
        self.windows = (self.windows + [(mean, variance / len(window))])[-(ELBO_RISES + 1):]
        if self.best is None:  # (the first step's loss too: a run can blow up within its first window)
            self.best = (torch.minimum(mean, window[0]), variance.sqrt())
            return self.infinite
        best, spread = self.best
        blown = mean - best > ELBO_BLOWUP * (spread + best.abs())
        self.best = tuple(torch.where(mean < best, new, old) for new, old in zip((mean, variance.sqrt()), self.best))
        if len(self.windows) <= ELBO_RISES:
            return blown | self.infinite
        means = torch.stack([m for m, _ in self.windows])
        rising = torch.all(means[1:] > means[:-1])
        (first, first_se2), (last, last_se2) = self.windows[0], self.windows[-1]
        noise = torch.maximum(ELBO_SIGNIFICANCE * (first_se2 + last_se2).sqrt(), 1e-6 * first.abs())
        return (rising & (last - first > noise)) | blown | self.infinite

    def message(self, step: int) -> Optional[str]:
        if self.warned:
            return None
        self.warned = True
        if self.infinite is not None and bool(self.infinite):
            return (
                f"NGVI: the training loss is not finite: the negative ELBO of the steps up to step {step} "
                "was infinite or NaN while their gradients were finite, so the steps were taken. A log "
                "density is -inf where the guide draws (an observation outside its likelihood's support, "
                "with Pyro's validation off), and its gradient, 0, tells the guide nothing: the guide "
                "trains on the rest of the model. Check the data and the model (pyro.enable_validation(True) "
                "names the site)."
            )
        means = ", ".join(f"{float(m):.6g}" for m, _ in self.windows)
        return (
            f"NGVI: the training ELBO has got worse up to step {step}: the negative ELBO, averaged "
            f"over windows of {ELBO_WINDOW} steps ({means}; the best {float(self.best[0]):.6g}), rose "
            f"{ELBO_RISES} times in a row beyond its minibatch and sampling noise, or far above its "
            "best (if the data or the model changed between steps, start a new NGVI). The steps "
            "overshoot: lower lr "
            "(or beta, or raise damping); for a BayesianNet, NGVI()'s defaults and bnn.guide() are "
            "the documented recipe." + (ONE_DRAW_ADVICE if self.one_draw else "") + " (Watched only at "
            "temperature 1, where the loss is the ELBO NGVI maximises.)"
        )


def stuck_message(skipped: int, sites: str, largest_mean: float, taken: int = 1, start: str = "") -> str:
    """The error when every step is skipped: the guide can only produce non-finite predictions,
    or, where no step was ever taken (``taken`` 0), the guide's initial values (``start``: the
    sites or params that are not finite; an AutoMessenger guide's default ``init_to_mean`` puts
    a HalfCauchy scale at :math:`\\log \\infty`), else the model or the data are not finite."""
    if taken == 0 and start:  # the guide never moved from values that are not finite
        return (
            f"NGVI skipped all of its first {skipped} steps: every draw from the guide gave a non-finite "
            f"gradient or curvature at {sites}, and the guide starts from values that are not finite at "
            f"{start}: its init_loc_fn gave inf or NaN, as init_to_mean (the default of AutoNormalMessenger, "
            "AutoRegressiveMessenger, AutoHierarchicalNormalMessenger) does for a distribution without a finite "
            "mean (HalfCauchy, Cauchy, StudentT with df <= 1), or init_to_value with a value outside the "
            "support. Start the guide with init_loc_fn=init_to_median or init_to_feasible "
            "(pyro.infer.autoguide.initialization)."
        )
    if taken == 0:  # the guide is as initialised: it did not diverge
        return (
            f"NGVI skipped all of its first {skipped} steps: every draw from the guide gave a non-finite "
            f"gradient or curvature at {sites}, and no step was ever taken, so the model or the data are "
            "not finite, not the guide: check the data for NaN or inf (entries hidden by poutine.mask or "
            "obs_mask must still be finite: a masked NaN gives NaN gradients; fill them with any number) "
            "and the model for a log-density that is not finite where the guide draws. Pyro's validation "
            "(pyro.enable_validation(True)) names the site."
        )
    return (
        f"NGVI skipped the last {skipped} steps in a row: every draw from the guide gave a non-finite "
        f"gradient or curvature at {sites}, so nothing can change the guide any more and its "
        f"predictions are non-finite too (the largest |mean| is {largest_mean:.3g}). The run has "
        "diverged: start again with a smaller lr or more damping (for a BayesianNet, NGVI()'s "
        "defaults and bnn.guide() on standardised inputs and Gaussian targets), or check the data for "
        "non-finite values. Where a latent scales other "
        "latents (a funnel: a horseshoe's or a hierarchical model's HalfCauchy scale), one draw per step "
        "gives heavy-tailed curvature: draw several, Trace_ELBO(num_particles=8, vectorize_particles=True)."
    )
