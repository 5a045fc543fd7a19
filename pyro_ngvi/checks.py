"""
The checks the host reads after a step's statistics are in (:func:`read_checks`): their
finiteness (a step whose gradient or curvature is not finite is skipped, the guide untouched)
and the flags the safeguards and watches raised at the steps before, in one device sync.

Read once every K steps (:class:`DeferredChecks`): on CUDA reading a
tensor's value is a device synchronisation, which would stall the queue of kernels once per
step. There a step of mean-field sites takes its statistics' finiteness as a 0-d flag on the
device and writes the guide under it (a masked write, :mod:`~pyro_ngvi.elementwise`: a step with
a non-finite gradient or curvature leaves the guide and the optimizer's state unchanged); the
host reads the flags of the steps since its last read, with the safeguards' flags, in one
synchronisation every :data:`SYNC_EVERY_CUDA` steps, and counts and warns of the skipped ones
then. On the CPU a read costs nothing: every step is checked before any write (K = 1).

What a deferred step cannot do: the point optimizer's step and full-covariance or Kronecker
sites need the check before they write (their steps read the host anyway), and so do a
Newton-guarded step, a learned prior and the cross terms of a small model (their coupled
mean step); a step with any of them is checked at once. Between reads, a skipped step
still counts in ``NGVI.num_steps`` (the read corrects it) and a site's first step is taken
as done.
"""

import math
import warnings
from typing import List, NamedTuple

import torch

from .family import GaussianSite
from .monitor import SKIPS_IN_A_ROW, NGVIWarning, power_of_two, stuck_message
from .point import param_label
from .safeguards import finite, report, sums
from .state import advance
from .statistics import tensors

#: What a skip for a non-finite step advises: a NaN in one example's inputs or targets skips every
#: minibatch that holds it while the others train (so it never makes the 50 in a row that raise).
NON_FINITE_ADVICE = (f"A NaN or inf in the data (an input or target of the minibatch) skips every step it is "
                     f"in; {SKIPS_IN_A_ROW} in a row raise.")

#: On CUDA the host reads the finiteness and safeguard flags once every this many steps.
SYNC_EVERY_CUDA = 16


class Pending(NamedTuple):
    """One deferred step: its finiteness flag per group (0-d bool tensors), the groups' site names
    and the sites' states (:class:`~pyro_ngvi.state.SiteState`: a skipped step is not taken)."""

    flags: List[torch.Tensor]
    names: List[str]
    states: list


class DeferredChecks:
    """The steps of one guide structure taken since the host last read their flags."""

    def __init__(self):
        self.pending: List[Pending] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, flags: List[torch.Tensor], names: List[str], states: list) -> torch.Tensor:
        """Keep a step's finiteness flags; returns whether all hold (a 0-d bool tensor, no sync)."""
        self.pending.append(Pending(flags, names, states))
        return torch.stack(flags).all()

    def take(self) -> List[Pending]:
        """The pending steps, oldest first (and forget them)."""
        pending, self.pending = self.pending, []
        return pending


def sync_every(device: torch.device, every) -> int:
    """K for a guide on ``device``: ``every`` if given, else :data:`SYNC_EVERY_CUDA` on CUDA and 1 elsewhere."""
    if every is not None:
        return every
    return SYNC_EVERY_CUDA if device.type == "cuda" else 1


def check_step_arguments(args: tuple) -> None:
    """``NGVI(...)(params, *args)`` hands ``args`` to the point optimizer's step, as Pyro's
    optimizers do: at most one, a closure. A model's data there is refused (it would reach
    ``torch.optim`` as a closure and fail there, obscurely).

    :raises TypeError: for anything else."""
    if args and (len(args) > 1 or not callable(args[0])):  # (none, the usual: no call)
        raise TypeError("NGVI(...)(params, *args) hands args to the point optimizer's step, as Pyro's "
                        "optimizers do (a closure); a guide's own arguments are bound with "
                        "NGVI(guide=functools.partial(guide, *args))")


def read_flags(flags) -> list:
    """The 0-d ``flags`` as Python values, in one device sync. Those of the host (the ELBO watch's,
    from ``SVI.step``'s float loss) go to the device of the others first: one stack, one read (of one
    dtype: with sums among the flags, the flags come back as 0.0 / 1.0)."""
    if not flags:
        return []
    device = flags[0].device
    for f in flags:
        if f.device.type != "cpu":
            device = f.device
            break
    for f in flags:  # (all on that device, the usual: stacked as they are, no list made)
        if f.device != device:
            return torch.stack([f if f.device == device else f.to(device) for f in flags]).tolist()
    return torch.stack(flags).tolist()


def _all_finite(values: list) -> bool:
    for value in values:
        if not math.isfinite(value):
            return False
    return True


def read_checks(optim, plan, sites, stats, groups, group_stats, flats, others) -> bool:
    """Whether every statistic and point gradient of ``optim``'s step is finite; the last steps'
    safeguard flags and the deferred steps' checks are read in the same device sync, and reported
    (:func:`~pyro_ngvi.safeguards.report`). A step that is not is skipped whole (counted, warned
    about by ``optim._skip``)."""
    others_with_grad = [p for p in others if p.grad is not None]
    checked = [((grad, curvature), st[0].mask) for (grad, curvature), st in zip(flats, group_stats)]
    checked += [((p.grad,), None) for p in others_with_grad]
    checked += [(tensors(stats[site.key]), None) for site in sites if not isinstance(site, GaussianSite)]
    parts = [sums(*t, mask=mask) for t, mask in checked]  # (read on the host: finite iff all their sums are)
    pending, records, elbo_flag, checks = take_flags(plan, parts)
    return settle_checks(optim, plan, sites, stats, groups, others_with_grad, checked, parts, pending, records,
                         elbo_flag, checks)


def take_flags(plan, parts: list) -> tuple:
    """What the host reads at a check: the 0-d sums ``parts`` (lists of them), the deferred steps'
    finiteness flags, the safeguards' and the ELBO watch's flags since the last read, all taken off
    ``plan`` and read in one sync: ``(pending steps, safeguard records, ELBO flag, values read)``."""
    pending = plan.deferred.take()
    records, plan.safeguards = plan.safeguards, []
    elbo_flag, plan.elbo_flag = plan.elbo_flag, None
    flags = [f for step in pending for f in step.flags] + [f for r in records for f in r.flags()]
    flags += [] if elbo_flag is None else [elbo_flag]
    return pending, records, elbo_flag, read_flags([s for p in parts for s in p] + flags)


def settle_checks(optim, plan, sites, stats, groups, others_with_grad, checked, parts, pending, records, elbo_flag,
                  checks: list) -> bool:
    """:func:`read_checks` once the host has read its flags (``checks``, in the order of ``parts``, the
    ``pending`` steps' flags, the ``records``' and ``elbo_flag``): the deferred skips counted, the
    safeguards reported, whether the step is taken (else counted and warned of as skipped)."""
    ok, at = [], 0
    for p in parts:
        ok.append(_all_finite(checks[at:at + len(p)]))
        at += len(p)
    engaged = checks[at:]
    engaged = _deferred_skips(optim, plan, pending, engaged)
    if not all(ok):  # or finite values whose sum overflowed: tell them apart
        ok = [good or bool(finite(*t, mask=mask, exact=True)) for good, (t, mask) in zip(ok, checked)]
    report(records, engaged, optim.num_steps, optim._spread_watch, depth=1)
    if elbo_flag is not None and engaged[-1]:
        message = plan.elbo_watch.message(optim.num_steps)
        if message:
            warnings.warn(message, NGVIWarning, stacklevel=6)
    if all(ok):
        if checked:
            plan.skips_in_a_row = 0
        return True
    bad = [site.name for site in sites
           if not bool(finite(*tensors(stats[site.key]), mask=getattr(stats[site.key], "mask", None), exact=True))]
    bad += [param_label(p) for p, good in zip(others_with_grad, ok[len(groups):]) if not good]
    optim.num_skipped_steps += 1
    plan.skips_in_a_row += 1
    if plan.skips_in_a_row >= SKIPS_IN_A_ROW:
        largest = max((float(site.mean.abs().max()) for site in sites), default=math.nan)
        # where no step was ever taken, a guide that starts from inf or NaN (init_to_mean of a HalfCauchy)
        start = [site.name for site in sites if not bool(torch.isfinite(site.mean).all())]
        start += [param_label(p) for p in others_with_grad if not bool(torch.isfinite(p).all())]
        raise RuntimeError(stuck_message(plan.skips_in_a_row, ", ".join(repr(b) for b in bad), largest,
                                         optim.num_steps, ", ".join(repr(b) for b in start)) + _float16_note(sites))
    warn_skip(optim, f"non-finite gradient or curvature at {', '.join(repr(b) for b in bad)}; the guide is "
              "unchanged", NON_FINITE_ADVICE + _float16_note(sites), stacklevel=7)
    return False


def _float16_note(sites) -> str:
    """What to say of a skipped step when a guide site is float16: its statistics (a BayesianNet's
    empirical Fisher, the curvature's running moments) overflow float16's range, not the model."""
    if not any(site.loc.dtype == torch.float16 for site in sites):
        return ""
    return (" The guide is float16, whose largest value (65504) the curvature overflows: train it in "
            "float32 or bfloat16 (float32's range).")


def _deferred_skips(optim, plan, pending, engaged: List[bool]) -> List[bool]:
    """Count and warn of the deferred steps whose statistics were not finite (taken as
    steps, written as none); returns the flags after theirs."""
    for step in pending:
        good, engaged = engaged[: len(step.flags)], engaged[len(step.flags):]
        if all(good):
            plan.skips_in_a_row = 0
            continue
        optim.num_steps -= 1
        advance(step.states, -1)
        optim.num_skipped_steps += 1
        plan.skips_in_a_row += 1
        bad = ", ".join(name for name, g in zip(step.names, good) if not g)
        if plan.skips_in_a_row >= SKIPS_IN_A_ROW:
            raise RuntimeError(stuck_message(plan.skips_in_a_row, bad, math.nan, optim.num_steps))
        warn_skip(optim, f"non-finite gradient or curvature at {bad} (read {len(pending)} steps late); the "
                  "guide is unchanged", NON_FINITE_ADVICE, stacklevel=8)
    return engaged


def warn_skip(optim, why: str, advice: str, every: bool = False, stacklevel: int = 4) -> None:
    """Warn of a step of ``optim`` skipped (counted already) at the 1st, 2nd, 4th, ... skip
    unless ``every``, the warning pointing at ``SVI.step`` (``stacklevel`` frames up)."""
    if not (every or power_of_two(optim.num_skipped_steps)):
        return
    attempted = optim.num_steps + optim.num_skipped_steps + optim.num_rejected_steps
    when = "" if every else "; warned at the 1st, 2nd, 4th, 8th, ..."
    warnings.warn(f"NGVI skipped step {attempted} ({optim.num_steps} taken): {why} "
                  f"({optim.num_skipped_steps} skipped so far{when}). {advice}", NGVIWarning,
                  stacklevel=stacklevel)
