"""
What :class:`~pyro_ngvi.NGVI` keeps per guide site between steps (:class:`SiteState`,
keyed, as torch's optimizers key theirs, by the site's parameter tensor), and the
form of the dict :meth:`~pyro_ngvi.NGVI.get_state` saves (:func:`check_state`).
"""

import warnings
import weakref
from typing import Dict, Optional

import torch

from .family import scale_transform
from .monitor import NGVIWarning
from .scales import known_scale, remember_scale

#: The per-element buffers of :class:`SiteState` (saved by ``NGVI.get_state``).
BUFFERS = ("momentum", "count", "drift", "hdrift", "excess")
#: Per-site (not per-element) tensors of :class:`SiteState`, saved too ("cross": a dict of them).
SITE_TENSORS = ("steps", "noise", "cross", "level", "prior")
#: The key of a regression of the cross terms restored from a checkpoint of an earlier version,
#: which did not say whose it was: the first structure of its total size takes it up, as that
#: version did (pyro_ngvi.variance.cross_terms).
CROSS_LEGACY = ""


class SiteState:
    """What NGVI keeps for one site between steps, keyed by its ``loc`` tensor."""

    __slots__ = ("loc", "raw", "started", "taken", "momentum", "far_steps", "noisy_steps", "count", "drift", "hdrift",
                 "excess", "steps", "noise", "cross", "level", "prior")

    def __init__(self, loc: weakref.ref, raw: Optional[weakref.ref] = None):
        self.loc = loc  # a weak reference: a cleared param store frees the site
        self.raw = raw  # ... and to its raw scale (mean-field sites), whose sigma NGVI remembers
        self.started = False  # the first-step warm start has happened
        self.taken = 0  # steps the site has taken: the clock of NGVI's schedules (lr, beta, tau)
        self.momentum: Optional[torch.Tensor] = None
        self.far_steps = 0  # consecutive steps its gradient exceeded safeguards.FAR sigma (mostly)
        self.noisy_steps = 0  # consecutive steps its one-draw curvature was noise (safeguards.noisy_flags)
        # sampled statistics, per element: the count n of the adaptive steps and the
        # running means of g (the momentum buffer, if any) and of (h - lambda) / lambda
        self.count: Optional[torch.Tensor] = None
        self.drift: Optional[torch.Tensor] = None
        self.hdrift: Optional[torch.Tensor] = None
        self.excess: Optional[torch.Tensor] = None  # the curvature clipped off its targets, carried over
        self.steps: Optional[torch.Tensor] = None  # steps that fed the site's pooled noise
        self.noise: Optional[torch.Tensor] = None  # the two pooled variances (short, long memory)
        # the regressions of the cross terms of the control variate, of the small sites this site
        # is the first of, by their structure (pyro_ngvi.variance.cross_terms), least recent first
        self.cross: Optional[Dict[str, torch.Tensor]] = None
        # a full-covariance site's running level tr(C^T H C) / D of its one-draw curvature (the
        # control variate's coefficient, pyro_ngvi.full_covariance.controlled_price_statistics)
        self.level: Optional[torch.Tensor] = None
        # a Kronecker layer's prior precision per column, as folded into its factors by the last step
        self.prior: Optional[torch.Tensor] = None

    def saved(self, store) -> Dict:
        """The entry :meth:`~pyro_ngvi.NGVI.get_state` saves (copies), with the sigma NGVI wrote into
        the site's raw scale and the raw scale's name in the param ``store`` (its bijection gives
        sigma back only to an ulp or two; a resumed run reads it, not the bijection, and takes the
        same steps)."""
        raw = None if self.raw is None else self.raw()
        scale = None if raw is None else known_scale(raw)
        return {"started": self.started, "taken": self.taken,
                **{key: _copied(getattr(self, key)) for key in BUFFERS + SITE_TENSORS},
                "scale": None if scale is None else scale.clone(),
                "scale_name": None if scale is None else store.param_name(raw)}

    def follow(self, loc: torch.Tensor) -> None:
        """Move the buffers to ``loc``'s dtype and device, where the guide was moved
        (``guide.to(torch.float64)``, ``.to("cuda")``), as torch's optimizers move theirs on a load."""
        for name in BUFFERS + SITE_TENSORS:
            value = getattr(self, name)
            if isinstance(value, dict) or (torch.is_tensor(value) and (value.dtype, value.device) != (loc.dtype,
                                                                                              loc.device)):
                setattr(self, name, _copied(value, loc))

    @staticmethod
    def check(loc: torch.Tensor, key: str, entry: Dict) -> None:
        """Refuse a saved ``entry`` whose buffers do not fit the site of ``loc``.

        :raises ValueError: naming the site and the checkpoint's shape."""
        for name in BUFFERS:
            buffer = entry.get(name)
            if buffer is not None and buffer.shape != loc.shape:
                raise ValueError(
                    f"NGVI state for '{key}' holds a {name} of shape {tuple(buffer.shape)}, the "
                    f"site has {tuple(loc.shape)}: the checkpoint belongs to another model"
                )

    @classmethod
    def restored(cls, loc: torch.Tensor, key: str, entry: Dict, raw: Optional[torch.Tensor] = None,
                 transform=None) -> "SiteState":
        """A state from a saved ``entry`` for the site whose ``loc`` (and raw scale, with its
        bijection ``transform``) is given.

        :raises ValueError: when a buffer does not fit the site (a checkpoint of another model)."""
        cls.check(loc, key, entry)
        state = cls(weakref.ref(loc), None if raw is None else weakref.ref(raw))
        state.started, state.taken = entry["started"], entry.get("taken", 0)
        for name in BUFFERS + SITE_TENSORS:
            setattr(state, name, _copied(entry.get(name), loc))
        if torch.is_tensor(state.cross):  # an earlier version's one regression, whose structure it did not say
            state.cross = {CROSS_LEGACY: state.cross}
        if raw is not None:
            restore_scale(raw, entry.get("scale"), transform)
        return state


def check_pending(pending: Dict, sites) -> None:
    """Refuse the saved entries of ``sites`` (``pending``: :meth:`~pyro_ngvi.NGVI.set_state`'s, by
    param name) that do not fit them, all before any is taken (:meth:`SiteState.check`)."""
    for site in sites:
        if site.key in pending:
            SiteState.check(site.loc, site.key, pending[site.key])


def warn_unmatched(restored, pending: Dict, sites) -> None:
    """Warn when the first guide with Gaussian ``sites`` to step after ``set_state`` finds none of
    them in the checkpoint (names ``restored``) while nothing of it was taken yet (all still
    ``pending``): a checkpoint of another guide or model, whose entries would stay unused, unsaid."""
    keys = sorted(site.key for site in sites)
    if set(restored) <= set(pending) and not any(key in pending for key in keys):
        def few(names):
            return ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        warnings.warn(f"NGVI.set_state restored state for the sites {few(sorted(restored))}, but none of them "
                      f"is a site of the guide now stepping ({few(keys)}): these start from fresh state and "
                      "the checkpoint's entries stay unused (a checkpoint of another guide or model, or param "
                      "names that changed, e.g. another autoguide prefix). Load the state get_state saved "
                      "for this guide.", NGVIWarning, stacklevel=4)


def _copied(value, like: Optional[torch.Tensor] = None):
    """A copy of a saved tensor, or of a dict of them (``cross``), as ``like``'s dtype and device."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: _copied(tensor, like) for key, tensor in value.items()}
    return (value if like is None else value.to(like)).clone()


def schedule_clock(states) -> int:
    """The step :math:`t` NGVI's schedules are called with: the most steps any of ``states`` (the
    sites of one step) has taken, so that each guide keeps its own clock, as each parameter keeps
    its own step count in torch's optimizers (an NGVI shared by two guides steps each as two
    would; one reused after ``pyro.clear_param_store()`` starts again from 0)."""
    return max([state.taken for state in states], default=0)


def advance(states, by: int = 1) -> None:
    """Count a step taken (``by = -1``: a deferred step found skipped) for each of ``states``."""
    for state in states:
        state.taken += by


def restore_scale(raw: torch.Tensor, scale: Optional[torch.Tensor], transform) -> bool:
    """Remember the saved sigma ``scale`` as the one ``raw`` holds, if it is that (to a few ulps:
    a saved state of another point of the run is not); whether it was."""
    if scale is None or scale.shape != raw.shape or known_scale(raw) is not None:
        return False
    with torch.no_grad():
        scale = scale.to(raw).clone()
        read = transform(raw.detach())
        if not torch.allclose(read, scale, rtol=8 * torch.finfo(raw.dtype).eps, atol=0.0):
            return False
    remember_scale(raw, scale)
    return True


def restore_scales(entries, store) -> None:
    """:func:`restore_scale` for every saved site entry whose raw scale the param ``store`` holds."""
    for entry in entries:
        raw = store._params.get(entry.get("scale_name") or "")
        if raw is not None:
            restore_scale(raw, entry.get("scale"), scale_transform(store._constraints[entry["scale_name"]]))


def check_state(state_dict) -> None:
    """:raises ValueError: unless ``state_dict`` has the form ``NGVI.get_state`` gives."""
    def fail(why):
        raise ValueError(f"NGVI.set_state expects a dict produced by NGVI.get_state: {why}")

    def count(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def float_tensor(value):
        return torch.is_tensor(value) and value.is_floating_point()

    if not isinstance(state_dict, dict) or set(state_dict) != {"ngvi", "point"}:
        fail("the keys must be 'ngvi' and 'point'")
    ngvi, point = state_dict["ngvi"], state_dict["point"]
    required = {"num_steps", "num_skipped_steps", "sites"}
    if not isinstance(ngvi, dict) or not required <= set(ngvi) <= required | {"num_rejected_steps", "newton"}:
        fail("state['ngvi'] must have the keys 'num_steps', 'num_skipped_steps' and 'sites' (and from this "
             "version on 'num_rejected_steps' and 'newton')")
    for key in ("num_steps", "num_skipped_steps", "num_rejected_steps"):
        if key in ngvi and not count(ngvi[key]):
            fail(f"state['ngvi'][{key!r}] must be a non-negative integer, got {ngvi[key]!r}")
    _check_newton(ngvi.get("newton", []), fail)
    if not isinstance(ngvi["sites"], dict):
        fail("state['ngvi']['sites'] must be a dict")
    keys = {"started", "taken", "scale", "scale_name", *BUFFERS, *SITE_TENSORS}
    for name, entry in ngvi["sites"].items():
        if not (isinstance(name, str) and isinstance(entry, dict) and "started" in entry
                and "momentum" in entry and set(entry) <= keys):
            fail(f"site entry {name!r} must be a dict with the keys 'started', 'momentum' and "
                 f"(from this version on) {', '.join(map(repr, BUFFERS[1:] + SITE_TENSORS))}")
        if "taken" in entry and not count(entry["taken"]):
            fail(f"site entry {name!r} needs a non-negative integer 'taken', got {entry['taken']!r}")
        if not (entry.get("scale_name") is None or isinstance(entry["scale_name"], str)):
            fail(f"site entry {name!r} needs a string 'scale_name' or None")
        cross = entry.get("cross")  # (a dict by structure; one tensor from an earlier version)
        if not isinstance(entry["started"], bool) or not all(
            entry.get(key) is None or float_tensor(entry[key]) for key in BUFFERS + SITE_TENSORS + ("scale",)
            if key != "cross"
        ) or not (cross is None or float_tensor(cross) or (isinstance(cross, dict) and all(
                isinstance(k, str) and float_tensor(v) for k, v in cross.items()))):
            fail(f"site entry {name!r} needs a bool 'started', float tensors or None for the rest and for "
                 "'cross' a dict of them by string")
    if not isinstance(point, dict):
        fail("state['point'] must be a dict")
    for name, entry in point.items():
        if not (isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("state"), dict)
                and isinstance(entry.get("param_groups"), list)
                and all(isinstance(v, dict) for v in entry["state"].values())):
            fail(f"point entry {name!r} must be a torch optimizer's state_dict")


def _check_newton(entries, fail) -> None:
    """The Newton guards of a state (:meth:`~pyro_ngvi.safeguards.NewtonGuard.saved_state`)."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(entries, list):
        fail("state['ngvi']['newton'] must be a list")
    for entry in entries:
        if not (isinstance(entry, dict) and set(entry) == {"factor", "nu", "reference", "predicted", "rejected",
                                                            "saved"}
                and all(number(entry[k]) for k in ("factor", "nu", "predicted", "rejected"))
                and (entry["reference"] is None or number(entry["reference"]))
                and isinstance(entry["saved"], dict)
                and all(isinstance(k, str) and isinstance(v, list) and len(v) == 2 and all(map(torch.is_tensor, v))
                        for k, v in entry["saved"].items())):
            fail("each entry of state['ngvi']['newton'] must be a Newton guard's saved state")
