"""
:class:`NGVI`: the Bayesian learning rule for mean-field Gaussian guides, as a
:class:`pyro.optim.PyroOptim` that ``pyro.infer.SVI`` can drive.
"""

import math
import numbers
import warnings
from typing import Callable, Dict, List, Optional, Union

import torch

import pyro
from pyro.optim.optim import PyroOptim

from .distributed import all_reduce_stats
from .family import GaussianSite, SiteCurvature, pop_curvature, split_params

Schedule = Union[float, Callable[[int], float]]

#: Sites are concatenated into one update up to this many elements: that saves
#: per-operation overhead on small tensors and bounds the copies it costs.
_FLAT_MAX = 1 << 16


class NGVIWarning(UserWarning):
    """Warned when :class:`NGVI` skips a step (non-finite gradient or curvature)."""


def _check_schedule(name: str, value, low: float, high: float, low_open=True):
    """Validate a number (or leave a callable for step-time checks)."""
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number or a callable of the step, got {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    if math.isnan(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must lie in {bracket}{low}, {high}], got {value}")
    return value


class NGVI(PyroOptim):
    """
    Natural-gradient variational inference: the variational online-Newton
    (VON / VOGN) form of the Bayesian learning rule [1, 2] for the guide sites of
    :class:`~pyro.infer.autoguide.AutoNormal` and
    :class:`~pyro.infer.autoguide.AutoDiagonalNormal`.

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

    **Trust region for sampled curvature.** The Price estimate's noise is
    :math:`|g|/\\sigma` per particle: far from the optimum (in units of
    :math:`\\sigma`) it is mostly noise, and an overshooting mean step feeds it.
    For such estimates each element's mean moves at most ``max_step`` current
    standard deviations per step (exact, Gauss-Newton and Fisher sources are
    not limited, so ``lr = beta = 1`` stays a Newton step).

    **Start-up.** On a site's first step, elements whose curvature target exceeds
    the current precision take it at once (``beta = 1`` there; VOGN initialises
    its precision from the first minibatch [2]). This stops a small
    ``init_scale`` from turning the first mean steps into overshoots.

    **Everything else** SVI hands over (``pyro.param`` values, a noise scale,
    BatchNorm weights) is updated by ``point_optim`` (Adam by default) through
    :class:`~pyro.optim.PyroOptim`'s per-parameter machinery, in the same step.

    **Distributed.** With a :mod:`torch.distributed` process group of more than
    one rank initialised, every site's :math:`g, h` and the point-estimated
    parameters' gradients are averaged across ranks before the finiteness check
    (:func:`pyro_ngvi.distributed.all_reduce_stats`), so all ranks take, or all
    skip, the identical update; each rank draws its own sample
    (:func:`pyro_ngvi.distributed.seed_rank`). Single processes are unaffected.

    :param lr: step size :math:`\\alpha > 0` on the mean, or a callable of the
        step count returning it (this is how to schedule it; torch LR schedulers
        need a torch optimizer and do not apply) (default: 0.1)
    :param beta: step :math:`\\beta \\in (0, 1]` of the precision moving average,
        or a callable of the step count (default: 0.05)
    :param momentum: :math:`\\rho \\in [0, 1)` on the mean gradient (default: 0)
    :param damping: :math:`\\gamma \\ge 0` added to the precision in the mean
        step only (default: 0)
    :param tau: temperature :math:`\\tau > 0` (the KL weight), or a callable of
        the step count for a warm-up (default: 1)
    :param max_step: trust radius, in current standard deviations, of the mean
        step under sampled (reparameterisation) curvature; ``None`` disables it
        (default: 3)
    :param warm_start: raise the precision to the first curvature estimate where
        that is larger (default: True)
    :param point_optim: torch optimizer class for non-guide parameters
        (default: :class:`torch.optim.Adam`)
    :param dict point_optim_args: its arguments (default: ``{"lr": 1e-3}``)

    :ivar int num_steps: updates taken.
    :ivar int num_skipped_steps: steps skipped for non-finite values.

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
    """

    def __init__(
        self,
        lr: Schedule = 0.1,
        beta: Schedule = 0.05,
        momentum: float = 0.0,
        damping: float = 0.0,
        tau: Schedule = 1.0,
        max_step: Optional[float] = 3.0,
        warm_start: bool = True,
        point_optim=torch.optim.Adam,
        point_optim_args: Optional[Dict] = None,
    ):
        self.lr = _check_schedule("lr", lr, 0.0, math.inf)
        self.beta = _check_schedule("beta", beta, 0.0, 1.0)
        self.momentum = _check_schedule("momentum", momentum, 0.0, 1.0, low_open=False)
        if self.momentum == 1.0 or callable(momentum):
            raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
        self.damping = _check_schedule("damping", damping, 0.0, math.inf, low_open=False)
        if callable(damping):
            raise ValueError("damping must be a number")
        self.tau = _check_schedule("tau", tau, 0.0, math.inf)
        if max_step is not None:
            max_step = _check_schedule("max_step", max_step, 0.0, math.inf)
            if callable(max_step):
                raise ValueError("max_step must be a positive number or None")
        self.max_step = max_step
        self.warm_start = bool(warm_start)
        if not (isinstance(point_optim, type) and issubclass(point_optim, torch.optim.Optimizer)):
            raise ValueError(
                f"point_optim must be a torch.optim.Optimizer class, got {point_optim!r}"
            )
        super().__init__(point_optim, dict(point_optim_args or {"lr": 1e-3}))
        self.num_steps = 0
        self.num_skipped_steps = 0
        self._momentum_buffers: Dict[str, torch.Tensor] = {}
        self._started: set = set()

    def _hyper(self, name: str, low: float, high: float) -> float:
        value = getattr(self, name)
        if callable(value):
            value = _check_schedule(f"{name}({self.num_steps})", value(self.num_steps), low, high)
        return value

    # ---------------------------------------------------------------- the step
    def __call__(self, params, *args, **kwargs) -> None:
        sites, others = split_params(params)
        if not sites:
            raise NotImplementedError(
                "NGVI found no Gaussian guide site among the parameters SVI passed: "
                "it supports AutoNormal and AutoDiagonalNormal guides (each site's "
                "'<prefix>.locs.<site>' / '<prefix>.scales.<site>' or "
                "'<prefix>.loc' / '<prefix>.scale'); for AutoDelta or a hand-written "
                "guide use a pyro.optim optimizer such as Adam."
            )
        stats = {site.name: self._site_curvature(site) for site in sites}
        stats = all_reduce_stats(stats, others)  # no-op without torch.distributed
        groups = _groups(sites, stats)
        group_stats = [[stats[site.name] for site in group] for group in groups]
        flats = [(_flat([s.grad for s in st]), _flat([s.curvature for s in st])) for st in group_stats]
        others_with_grad = [p for p in others if p.grad is not None]
        finite = [_finite(grad, curvature, st[0].mask) for (grad, curvature), st in zip(flats, group_stats)]
        finite += [torch.isfinite(p.grad).all() for p in others_with_grad]
        finite = torch.stack(finite).tolist()  # one device sync for the whole step
        if not all(finite):
            bad = [site.name for site, ok in zip(sites, self._sites_finite(stats)) if not ok]
            bad += [_param_label(p) for p, ok in zip(others_with_grad, finite[len(groups):]) if not ok]
            self.num_skipped_steps += 1
            warnings.warn(
                f"NGVI skipped step {self.num_steps}: non-finite gradient or curvature "
                f"at {', '.join(repr(b) for b in bad)}; the guide is unchanged "
                f"({self.num_skipped_steps} skipped so far).",
                NGVIWarning,
                stacklevel=2,
            )
            return
        lr = self._hyper("lr", 0.0, math.inf)
        beta = self._hyper("beta", 0.0, 1.0)
        tau = self._hyper("tau", 0.0, math.inf)
        for group, st, (grad, curvature) in zip(groups, group_stats, flats):
            self._update_group(group, st, grad, curvature, lr, beta, tau)
        if others:
            super().__call__(others, *args, **kwargs)
        self.num_steps += 1

    @staticmethod
    def _sites_finite(stats: Dict[str, SiteCurvature]) -> List[bool]:
        """Per site, whether its touched rows are finite (to name the bad ones)."""
        return [bool(_finite(s.grad.reshape(-1), s.curvature.reshape(-1), s.mask)) for s in stats.values()]

    @torch.no_grad()
    def _site_curvature(self, site: GaussianSite) -> SiteCurvature:
        """The ELBO's curvature for ``site`` or, failing that, the reparam estimate."""
        stats = pop_curvature(site.loc)
        if stats is not None:
            return stats
        if site.loc.grad is None or site.raw_scale.grad is None:
            raise ValueError(
                f"NGVI found no gradient for guide site '{site.name}': use a loss that "
                "backpropagates through the guide (Trace_ELBO, JitTrace_ELBO) or "
                "pyro_ngvi.CurvatureELBO."
            )
        raw = site.raw_scale.detach()
        scale = site._scale_transform(raw)
        dscale_draw = site._scale_transform.log_abs_det_jacobian(raw, scale).exp()
        scale_grad = site.raw_scale.grad / dscale_draw
        loc_grad = site.loc.grad
        mask = scale_grad != 0
        touched = int(mask.sum())
        if touched == mask.numel():
            mask, plate_scale = None, 1.0
        else:
            plate_scale = mask.numel() / max(touched, 1)
        grad = loc_grad / plate_scale
        curvature = (scale_grad / plate_scale + 1.0 / scale) / scale
        return SiteCurvature(grad, curvature, mask=mask, sampled=True)

    @torch.no_grad()
    def _update_group(self, sites: List[GaussianSite], stats: List[SiteCurvature],
                      grad: torch.Tensor, curvature: torch.Tensor, lr, beta, tau):
        """
        The update of the class docstring for ``sites`` at once, as one flat
        vector (one kernel per operation rather than one per site and operation);
        ``grad`` and ``curvature`` are the sites' ``g`` and ``h`` so flattened.
        The sites share the scale constraint, ``sampled``, whether a prior is
        given, and either have no ``mask`` or are a single masked site.
        """
        # In-place wherever a value is not needed again: besides the flat copies
        # of a multi-site group, the update holds about five vectors at its peak.
        first = stats[0]
        mean = _flat([site.loc for site in sites])
        transform = sites[0]._scale_transform
        precision = transform(_flat([site.raw_scale for site in sites])).pow_(-2)
        mask = None if first.mask is None else first.mask.reshape(-1)
        target = curvature / tau
        if first.prior_precision is not None:
            prior_precision = _flat([s.prior_precision for s in stats])
            target.add_(prior_precision)
        if self.warm_start and any(site.name not in self._started for site in sites):
            fresh = _flat([torch.full_like(site.loc, site.name not in self._started, dtype=torch.bool)
                           for site in sites])
            step_beta = torch.where(fresh & (target > precision), 1.0, beta).to(target.dtype)
        else:
            step_beta = beta
        new_precision = torch.lerp(precision, target, step_beta)
        correction = torch.sub(precision, target).square_().mul_(step_beta**2 / 2).div_(precision)
        new_precision.add_(correction.masked_fill_(target > 0, 0.0))  # only where target <= 0
        del correction, target
        new_precision.clamp_(min=torch.finfo(new_precision.dtype).tiny)
        denominator = new_precision + self.damping if self.damping else new_precision

        step = self._momentum(sites, grad / tau, mask).mul(lr).div_(denominator)
        if first.sampled and self.max_step is not None:
            radius = precision.rsqrt_().mul_(self.max_step)
            step = torch.minimum(step, radius, out=step)
            step = torch.maximum(step, radius.neg_(), out=step)
            del radius
        del precision
        if first.prior_precision is not None:
            pull = (mean - _flat([s.prior_loc for s in stats])).mul_(prior_precision)
            step.add_(pull.mul_(lr).div_(denominator))
            del pull, prior_precision
        del denominator
        new_mean = step.neg_().add_(mean)
        new_raw_scale = transform.inv(new_precision.rsqrt_())
        for site, loc, raw_scale in zip(sites, *_unflat([new_mean, new_raw_scale], sites)):
            if mask is None:
                site.loc.copy_(loc)
                site.raw_scale.copy_(raw_scale)
            else:
                site_mask = first.mask
                site.loc.copy_(torch.where(site_mask, loc, site.loc))
                site.raw_scale.copy_(torch.where(site_mask, raw_scale, site.raw_scale))
            self._started.add(site.name)

    def _momentum(self, sites, grad: torch.Tensor, mask) -> torch.Tensor:
        """:math:`\\bar g \\leftarrow \\rho \\bar g + (1 - \\rho) g` (a site's first step takes g)."""
        if self.momentum == 0:
            return grad
        if all(site.name in self._momentum_buffers for site in sites):
            buffer = _flat([self._momentum_buffers[site.name] for site in sites])
            new = torch.lerp(grad, buffer, self.momentum)
            buffer = new if mask is None else torch.where(mask, new, buffer)
        else:  # some site's first step: its buffer starts at g
            pieces = _unflat([grad], sites)[0]
            buffer = _flat([
                torch.lerp(piece, self._momentum_buffers[site.name], self.momentum)
                if site.name in self._momentum_buffers else piece
                for site, piece in zip(sites, pieces)
            ])
            if mask is not None and sites[0].name in self._momentum_buffers:
                buffer = torch.where(mask, buffer, self._momentum_buffers[sites[0].name].reshape(-1))
        for site, piece in zip(sites, _unflat([buffer], sites)[0]):
            self._momentum_buffers[site.name] = piece
        return buffer

    # ---------------------------------------------------------------- state
    def get_state(self) -> Dict:
        """Optimizer state: step counts, momentum buffers and the point optimizers'."""
        return {
            "ngvi": {
                "num_steps": self.num_steps,
                "num_skipped_steps": self.num_skipped_steps,
                "started": sorted(self._started),
                "momentum": {k: v.clone() for k, v in self._momentum_buffers.items()},
            },
            "point": super().get_state(),
        }

    def set_state(self, state_dict: Dict) -> None:
        """Restore a :meth:`get_state` dict (also after :meth:`load`)."""
        if set(state_dict) != {"ngvi", "point"}:
            raise ValueError("NGVI.set_state expects a dict produced by NGVI.get_state")
        ngvi = state_dict["ngvi"]
        self.num_steps = ngvi["num_steps"]
        self.num_skipped_steps = ngvi["num_skipped_steps"]
        self._started = set(ngvi["started"])
        self._momentum_buffers = {k: v.clone() for k, v in ngvi["momentum"].items()}
        super().set_state(state_dict["point"])


def _finite(grad: torch.Tensor, curvature: torch.Tensor, mask) -> torch.Tensor:
    """Whether the ``mask`` rows (all: ``None``) of flat ``grad`` and ``curvature`` are finite (0-d)."""
    if mask is not None:
        mask = mask.reshape(-1)
        grad, curvature = grad[mask], curvature[mask]
    return torch.isfinite(grad).all() & torch.isfinite(curvature).all()


def _param_label(p: torch.Tensor) -> str:
    return pyro.get_param_store().param_name(p) or f"tensor of shape {tuple(p.shape)}"


def _groups(sites: List[GaussianSite], stats: Dict[str, SiteCurvature]) -> List[List[GaussianSite]]:
    """
    Sites whose update can run as one flat vector: same scale constraint, dtype,
    device, ``sampled`` flag and prior presence, no mask, at most ``_FLAT_MAX``
    elements together. A masked site (subsampled rows) or a large one is a group
    of its own (no copies: its flat tensors are views).
    """
    groups: Dict[tuple, List[GaussianSite]] = {}
    sizes: Dict[tuple, int] = {}
    for site in sites:
        s = stats[site.name]
        if s.mask is not None or site.loc.numel() > _FLAT_MAX:
            key = ("alone", site.name)
        else:
            constraint = id(pyro.get_param_store()._constraints[site.scale_name])
            key = (constraint, site.loc.dtype, site.loc.device, s.sampled, s.prior_precision is None)
            if sizes.get(key, 0) + site.loc.numel() > _FLAT_MAX:  # start another group
                groups[key + (len(groups),)] = groups.pop(key)
                sizes[key] = 0
        groups.setdefault(key, []).append(site)
        sizes[key] = sizes.get(key, 0) + site.loc.numel()
    return list(groups.values())


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors, flattened and concatenated (no copy for a single contiguous one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flats: List[torch.Tensor], sites: List[GaussianSite]) -> List[List[torch.Tensor]]:
    """Split each flat vector back into views shaped like the sites' locs."""
    sizes = [site.loc.numel() for site in sites]
    return [[piece.view_as(site.loc) for piece, site in zip(flat.split(sizes), sites)] for flat in flats]
