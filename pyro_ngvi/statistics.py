"""
The statistics a step works from, per guide site: taken from the ELBO's hand-over
(:func:`~pyro_ngvi.handover.pop_curvature`, a :class:`~pyro_ngvi.handover.SiteCurvature`
fitted to the site) or, failing that, recovered from the ordinary reparameterised
gradients that :class:`~pyro.infer.Trace_ELBO` left on the guide's parameters
(Price's theorem, Opper and Archambeau 2009):

.. math:: g = \\nabla_\\mu, \\qquad h = (\\nabla_\\sigma + 1/\\sigma)/\\sigma, \\qquad
          \\epsilon = \\sigma h / g \\;\\text{(one draw per step)}.

A large site whose rows were all touched hands the gradients over as they are, and the
element-wise pass recovers the same statistics span by span (``RECOVER_IN_PASS``).

A subsampled plate scales a site's terms, its entropy included, by :math:`s = N/B`;
rows a step did not touch have exactly zero gradients (a ``mask``), and :math:`s` is
divided out of the touched ones.

A guide site that ``poutine.scale`` weighs by :math:`w` beyond its plates
(:class:`~pyro_ngvi.family.GaussianSite`'s ``weight``) carries :math:`w` on its entropy:
the objective of the site is :math:`\\mathbb{E}_q[f] - w\\,\\mathrm{H}[q]`, i.e. :math:`w`
times the ordinary one of the tempered target :math:`f / w` (with a model scaled by the
same :math:`w`, the untempered one). The recovered curvature then carries the entropy's
share, :math:`(\\nabla_\\sigma + 1/\\sigma)/\\sigma = \\nabla_\\sigma \\mathbb{E}_q[f]/\\sigma + (1 - w)\\lambda`,
and the statistics of :math:`f / w` are

.. math:: g_w = g / w, \\qquad h_w = \\big((\\nabla_\\sigma + 1/\\sigma)/\\sigma - (1 - w)\\lambda\\big) / w,
          \\qquad \\epsilon = \\sigma h_w / g_w,

on which the step runs as on any site: its fixed point :math:`\\lambda = h_w` is the optimum
of the weighted objective, :math:`\\sigma^2 = w / \\nabla^2 f` for a Gaussian target.
"""

import warnings
import weakref
from dataclasses import replace
from typing import Dict, Optional

import torch

from pyro.infer import (ELBO, JitTrace_ELBO, JitTraceEnum_ELBO, JitTraceGraph_ELBO, JitTraceMeanField_ELBO, RenyiELBO,
                        Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO, TraceTailAdaptive_ELBO)

from . import full_covariance
from .family import FullCovarianceSite, GaussianSite, SiteCurvature, pop_curvature
from .hot_path import no_grad
from .kronecker import KroneckerCurvature, KroneckerSite
from .low_rank_guide import LowRankCurvature, LowRankSite
from .monitor import NGVIWarning
from .scales import FastExp

#: A recovered draw :math:`|\epsilon|` beyond this is float32 round-off, not a normal draw.
EPS_MAX = 8.0
#: A site of at least this many elements, every row touched, gets its statistics recovered by
#: the element-wise pass itself, span by span (:class:`~pyro_ngvi.handover.SiteCurvature`
#: ``gradients``): the recovery's dozen operations then run on cached spans, or compiled
#: into the pass, instead of over the whole site first. (Smaller sites are recovered here:
#: the cross terms of a small model read their draws before the pass.)
RECOVER_IN_PASS = 1 << 12
#: ELBOs whose gradients of a Gaussian site, at one particle, are those of one draw
#: :math:`u = \mu + \sigma\epsilon` (pathwise through :math:`u`, plus the exact
#: :math:`-1/\sigma` of :math:`-\log q(u)`), whatever else they add: TraceGraph's and
#: TraceEnum's score-function and enumerated terms reach the site through :math:`u` only.
#: TraceMeanField_ELBO too, on the sites whose KL it does not integrate (an autoguide's: the
#: ``analytic`` sites of :func:`step_statistics`, :mod:`~pyro_ngvi.mean_field_kl`); no ELBO of several draws.
_ONE_DRAW_ELBOS = (Trace_ELBO, JitTrace_ELBO, TraceGraph_ELBO, JitTraceGraph_ELBO, TraceEnum_ELBO, JitTraceEnum_ELBO,
                   TraceMeanField_ELBO, JitTraceMeanField_ELBO)


def one_draw(svi) -> bool:
    """Whether ``svi`` computes its gradients from one draw of each latent: a plain
    ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO`` or ``TraceMeanField_ELBO`` (or their Jit
    versions) with one particle (then :math:`\\epsilon` is recoverable from :math:`g` and :math:`h`;
    under ``TraceMeanField_ELBO`` only on the sites whose KL it does not integrate).

    :raises NotImplementedError: for a loss whose gradients are not the ELBO's (``RenyiELBO``,
        ``TraceTailAdaptive_ELBO``)."""
    elbo = getattr(getattr(svi, "loss_and_grads", None), "__self__", None)
    if isinstance(elbo, (RenyiELBO, TraceTailAdaptive_ELBO)):
        what = ("an importance-weighted alpha-divergence bound" if isinstance(elbo, RenyiELBO) else
                "the particles' log p - log q weighted by their ranks, an adaptive f-divergence")
        raise NotImplementedError(
            f"NGVI reads the ELBO's gradients as the Bayesian learning rule's statistics; "
            f"{type(elbo).__name__}'s ({what}) are not those, and the guide would not reach that loss's "
            "optimum (RenyiELBO's diverge; TraceTailAdaptive_ELBO's stop where its gradient is not zero). "
            "Use Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO (or their Jit versions) or "
            f"CurvatureELBO with NGVI, or a Pyro optimizer (pyro.optim.Adam) with {type(elbo).__name__}")
    return type(elbo) in _ONE_DRAW_ELBOS and getattr(elbo, "num_particles", None) == 1


def warn_loss_function(svi) -> None:
    """Warn (:class:`~pyro_ngvi.NGVIWarning`) when ``svi`` was given a loss function, not an ELBO
    (nor an ELBO's bound method): NGVI reads its gradients as the ELBO's, and cannot check it."""
    if svi is None or getattr(getattr(svi, "loss_and_grads", None), "__self__", None) is not None:
        return
    if isinstance(getattr(getattr(svi, "loss", None), "__self__", None), ELBO):
        return
    warnings.warn(
        "SVI was given a loss function, whose gradients NGVI reads as the negative ELBO's (Price's "
        "theorem: g = d/d mu, h = (d/d sigma + 1/sigma)/sigma); if it is another objective (importance-"
        "weighted, Renyi, tail-adaptive), the guide lands away from that objective's optimum, silently. "
        "With an ELBO's loss (e.g. Trace_ELBO().differentiable_loss plus terms of the model), filter "
        "pyro_ngvi.NGVIWarning to silence this.", NGVIWarning, stacklevel=2)


def tensors(stats) -> tuple:
    """The tensors of a site's statistics that must be finite."""
    if isinstance(stats, (KroneckerCurvature, LowRankCurvature)):
        return stats.tensors
    return stats.grad, stats.curvature


@no_grad
def step_statistics(sites, svi, control_variate: bool = True, buffers: Optional["Buffers"] = None,
                    draws: Optional[Dict] = None, analytic: frozenset = frozenset()) -> Dict:
    """Each site's statistics for one step of ``svi`` (None: NGVI called directly), by site key
    (:func:`site_statistics`): the ELBO's counted only when this step's ELBO made them (else they
    are stale), the draws recovered for the control variate when ``control_variate`` (or read as
    the guide ran: ``draws``, by ``id(site.loc)``, :mod:`~pyro_ngvi.draws`), except on the sites
    whose ``id(site.loc)`` is in ``analytic`` (a KL in closed form: :mod:`~pyro_ngvi.mean_field_kl`),
    and under ``svi`` written over its gradients and into ``buffers``."""
    live = svi is None or getattr(getattr(svi.loss_and_grads, "__self__", None), "produces_curvature", False)
    single = one_draw(svi)
    # (SVI replaces the gradients after the step: the recovered statistics may be written over them)
    buffers = None if svi is None else buffers
    draws = draws if control_variate and draws else {}
    if not analytic and not draws:  # (the common case: no site's loc to look up)
        return {site.key: site_statistics(site, live, single, control_variate, buffers) for site in sites}
    return {site.key: site_statistics(site, live, single and id(site.loc) not in analytic, control_variate, buffers,
                                      None if id(site.loc) in analytic else draws.get(id(site.loc)))
            for site in sites}


def site_statistics(site, live: bool = True, one_draw: bool = False, recover_draws: bool = True,
                    buffers: Optional["Buffers"] = None, draws: Optional[tuple] = None):
    """
    The ELBO's statistics for ``site`` (when ``live``: this step's ELBO made them; run under
    ``torch.no_grad()``),
    in the site's dtype and device, or, failing that, the Price estimate recovered
    from the ordinary gradients. With one draw per step (``one_draw``) the draw of a
    mean-field site is recovered too (``recover_draws``, for the control variate),
    :math:`\\epsilon = \\sigma h / g`, and a low-rank site's is read off its guide; ``draws``:
    :math:`(\\bar\\epsilon, \\overline{\\epsilon^2}, K)` of :math:`K` particles read as the guide ran.
    With ``buffers`` (:class:`Buffers`: ``SVI`` replaces the gradients after the step) the
    estimate is written over the gradients and into buffers kept for the site: no new tensor.

    :raises ValueError: when there is neither (a loss that does not backpropagate
        through the guide, a Kronecker layer without its factors), or when the estimate would be
        recovered for a float16 site (its running moments overflow float16's range).
    """
    if isinstance(site, LowRankSite):
        return site.statistics(one_draw, recover_draws)
    stats = pop_curvature(site.loc)
    if stats is not None and live:
        return fit_to_site(stats, site) if isinstance(site, GaussianSite) and not stats.fitted else stats
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
            "pyro_ngvi.CurvatureELBO. With such a loss, the guide ran on tensors that are not the "
            "param store's: a store loaded (pyro.get_param_store().load, load_param_store) after the "
            "guide was set up leaves the guide its old ones; load the store first, then make the guide."
        )
    if site.loc.dtype == torch.float16:
        raise ValueError(
            f"NGVI cannot train guide site '{site.name}' in float16 from the ordinary gradients: one draw's "
            "recovered curvature reaches 1e3-1e4, and the running moments of it that the step keeps overflow "
            "float16 (largest value 65504; the scale became NaN after 35 steps of a Normal mean). Keep the "
            "guide in float32, float64 or bfloat16 (float32's range), or hand NGVI its curvature with "
            "pyro_ngvi.CurvatureELBO.")
    if isinstance(site, FullCovarianceSite):
        return full_reparam_curvature(site, one_draw and recover_draws)
    return reparam_curvature(site, one_draw and recover_draws, buffers, draws)


class Buffers:
    """Tensors kept per site for the statistics recovered from its gradients (the draws and their
    squares), and the optimizer's workspace for the temporaries: a step makes no new tensor."""

    def __init__(self, workspace):
        self.workspace = workspace
        self._kept = {}

    def kept(self, site, name: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor like ``like`` kept for ``site``'s ``name`` (written over every step)."""
        key = (id(site.loc), name)
        found = self._kept.get(key)
        if found is None or found[0]() is not site.loc or found[1].shape != like.shape or found[1].dtype != like.dtype:
            found = self._kept[key] = (weakref.ref(site.loc), torch.empty_like(like))
        return found[1]

    def prune(self) -> None:
        """Drop the tensors kept for sites whose ``loc`` is gone (a cleared param store)."""
        self._kept = {k: v for k, v in self._kept.items() if v[0]() is not None}

    def scratch(self, like: torch.Tensor):
        """Two temporaries like ``like`` (the second for 0 / 1 masks)."""
        value, flag = self.workspace.take(like.numel(), like, 2)
        return value.view_as(like), flag.view_as(like)


def _all_nonzero(x: torch.Tensor, flag: torch.Tensor) -> bool:
    """Whether no element of ``x`` is 0: the sum of ``x != 0`` as 0 / 1 in ``flag`` (``x``'s float
    dtype; exact: integers below 2^24, else summed in float64) is the length. Two cheap passes where
    ``count_nonzero`` (an integer reduction) cost 2-4x more on the CPU."""
    ones = torch.ne(x, 0, out=flag)
    total = ones.sum(dtype=torch.float64) if x.numel() >= 1 << 24 or not x.is_floating_point() else ones.sum()
    return int(total) == x.numel()


def reparam_curvature(site: GaussianSite, one_draw: bool = False, buffers: Optional[Buffers] = None,
                      draws: Optional[tuple] = None) -> SiteCurvature:
    """The Price estimate of a mean-field site from the gradients on its ``loc`` and raw
    scale (module docstring), the plate scale divided out of the touched rows, of the
    tempered target :math:`f / w` for a site of ``weight`` :math:`w`. With ``buffers``,
    written over the gradients (ours: ``SVI`` replaces them after the step) and into the
    site's kept tensors. ``draws``: the particles' :math:`(\\bar\\epsilon, \\overline{\\epsilon^2})`
    and their number, handed on (untouched rows: 0 and 1)."""
    raw = site.raw_scale.detach()
    scale = site.scale
    transform = site._scale_transform
    if buffers is None:
        scale_grad, grad, work, flag = site.raw_scale.grad.clone(), site.loc.grad.clone(), None, None
    else:
        scale_grad, grad = site.raw_scale.grad, site.loc.grad
        work, flag = buffers.scratch(grad)
    weight = getattr(site, "weight", 1.0)
    if (buffers is not None and weight == 1.0 and grad.numel() >= RECOVER_IN_PASS and draws is None
            and hasattr(transform, "inverse_and_log")
            and _all_nonzero(scale_grad, flag)):  # (no row untouched)
        return SiteCurvature(grad, scale_grad, sampled=True, fitted=True, gradients=True, draws=one_draw)
    if isinstance(transform, FastExp):  # d sigma / d r = sigma
        scale_grad.div_(scale)
    elif hasattr(transform, "derivative"):  # softplus: d sigma / d r = sigmoid(r)
        scale_grad.div_(torch.sigmoid(raw, out=work))
    else:
        scale_grad.div_(transform.log_abs_det_jacobian(raw, scale).exp())
    touched = int(torch.count_nonzero(scale_grad))
    if touched == scale_grad.numel():
        mask, plate_scale = None, 1.0
    else:
        mask, plate_scale = scale_grad != 0, scale_grad.numel() / max(touched, 1)
    if plate_scale != 1.0:
        grad.div_(plate_scale)
        scale_grad.div_(plate_scale)
    inverse_scale = torch.reciprocal(scale, out=work)
    curvature = scale_grad.add_(inverse_scale).mul_(inverse_scale)  # (d_sigma + 1 / sigma) / sigma
    if weight != 1.0:  # the statistics of f / w (module docstring); untouched rows keep lambda
        curvature.sub_(inverse_scale.square().mul_(1.0 - weight)).div_(weight)
        grad.div_(weight)
    if draws is not None:
        eps, eps_sq_mean, particles = draws
        eps, eps_sq_mean = eps.to(grad), eps_sq_mean.to(grad)
        if mask is not None:
            eps, eps_sq_mean = eps * mask, torch.where(mask, eps_sq_mean, 1.0)
        return SiteCurvature(grad, curvature, mask=mask, sampled=True, eps_mean=eps, eps_sq_mean=eps_sq_mean,
                             fitted=True, particles=particles)
    if not one_draw:
        return SiteCurvature(grad, curvature, mask=mask, sampled=True)
    # eps = sigma h / g; where g vanishes (untouched rows) the draw is unknown: 0.
    # |eps| beyond EPS_MAX is float32 round-off in h, never a real draw. (By arithmetic
    # on 0 / 1 masks: torch's CPU where and masked_fill run one element at a time.)
    eps = torch.mul(curvature, scale, out=None if buffers is None else buffers.kept(site, "eps", grad))
    eps.div_(grad)  # +-inf or nan where g = 0: |eps| <= max fails
    keep = torch.abs(eps) <= EPS_MAX if buffers is None else torch.le(torch.abs(eps, out=work), EPS_MAX, out=flag)
    eps = eps.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(keep)
    if buffers is None:
        eps_sq_mean = (eps == 0).to(eps.dtype)
    else:  # (0 / 1 floats: a comparison into floats is vectorised, into bools it is not)
        eps_sq_mean = torch.eq(eps, 0, out=buffers.kept(site, "eps_sq", grad))
    eps_sq_mean.addcmul_(eps, eps)  # eps^2, and 1 where the draw is unknown
    return SiteCurvature(grad, curvature, mask=mask, sampled=True, eps_mean=eps, eps_sq_mean=eps_sq_mean,
                         fitted=True)


@torch.no_grad()
def full_reparam_curvature(site: FullCovarianceSite, one_draw: bool = False) -> SiteCurvature:
    """
    :math:`g` and the Price curvature :math:`H` of a full-covariance site from the
    reparameterised gradients ``SVI`` left on its ``loc``, ``scale`` and
    ``scale_tril``: the gradient w.r.t. :math:`C` is
    :math:`\\mathrm{tril}(E[g\\epsilon^\\top]) - \\mathrm{diag}(1/s)` (the entropy
    gives the second term), so
    :func:`~pyro_ngvi.full_covariance.price_curvature` of it plus
    :math:`\\mathrm{diag}(1/s)` is :math:`H` (the mean-field
    :math:`(\\nabla_\\sigma + 1/\\sigma)/\\sigma` on a diagonal). Handed on whitened,
    :math:`C^\\top H C`, which needs no inverse. With ``one_draw`` the draw is recovered
    (:func:`~pyro_ngvi.full_covariance.recovered_draw`) and handed on as ``eps_mean``, for
    the control variate of the step (:func:`~pyro_ngvi.full_covariance.controlled_price_statistics`),
    and the whitened curvature is then :func:`~pyro_ngvi.full_covariance.one_draw_whitened` of
    :math:`g` and :math:`\\epsilon` (:math:`O(D^2)`; the recovered draw reproduces the factor gradient
    to its round-off).
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
    factor = full_covariance.covariance_factor(scale, unit_tril)
    grad = site.loc.grad.detach()
    eps = full_covariance.recovered_draw(grad.double(), factor_grad, grad.dtype) if one_draw else None
    if eps is None:
        curvature = full_covariance.whitened_price_curvature(factor, factor_grad)
    else:  # (the draw recovered: tril(g eps^T) to round-off, whitened in O(D^2))
        curvature = full_covariance.one_draw_whitened(factor, grad.double(), eps)
    return SiteCurvature(grad, curvature.to(site.loc.dtype), sampled=True, whitened=True,
                         eps_mean=None if eps is None else eps.to(site.loc.dtype))


def fit_to_site(stats: SiteCurvature, site: GaussianSite) -> SiteCurvature:
    """
    ``stats`` in the dtype and on the device of the site's ``loc`` (an ELBO may
    compute a float32 site's curvature in float64); a tensor of another shape
    is refused, before anything is written.

    :raises ValueError: naming the tensor and the site.
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
