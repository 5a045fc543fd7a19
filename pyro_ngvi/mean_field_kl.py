"""
Which Gaussian sites of a guide ``TraceMeanField_ELBO`` draws, and which it integrates.

``TraceMeanField_ELBO`` takes, for each latent site :math:`z` of the model, the KL term in
closed form where one is registered, :math:`-\\mathrm{KL}(q_z \\| p_z)`, and
:math:`\\log p(z) - \\log q(z)` at the draw where none is; a guide site the model does not have
(an autoguide's auxiliary Gaussian) enters through its entropy term at the draw,
:math:`-\\log q(u)`. An autoguide's Gaussian is such an auxiliary site (``AutoNormal``'s
``t_unconstrained``, ``AutoDiagonalNormal``'s ``_AutoDiagonalNormal_latent``), and the model's
site meets a ``Delta`` at :math:`x = T(u)`, whose KL is :math:`-\\log p(x)` at that point: every
term reaches :math:`(\\mu, \\sigma)` through the draw :math:`u = \\mu + \\sigma\\epsilon` and the
exact :math:`-\\log q(u)`,

.. math:: \\nabla_\\mu = \\nabla f(u), \\qquad \\nabla_\\sigma = \\nabla f(u)\\,\\epsilon - 1/\\sigma,

the gradients of one draw, as under ``Trace_ELBO`` (equal to rounding on a real site; on a
constrained one :math:`f` lacks :math:`\\log|\\det J_T|`, which the ``Delta``'s KL drops). So the draw
is recovered (:math:`\\epsilon = \\sigma h / g`, :mod:`~pyro_ngvi.statistics`) or, with several
particles, read as the guide runs (:mod:`~pyro_ngvi.draws`), and the control variate and the
coupled mean step run as under ``Trace_ELBO`` (:mod:`~pyro_ngvi.variance`).

A Gaussian guide site that *is* a model site with a registered KL (a hand-written guide's
``Normal`` against a ``Normal`` prior) has, with :math:`\\ell` the likelihood's part,

.. math:: \\nabla_\\mu = \\nabla\\ell(u) + \\lambda_0(\\mu - m_0), \\qquad
          \\nabla_\\sigma = \\nabla\\ell(u)\\,\\epsilon - 1/\\sigma + \\lambda_0\\sigma,

the prior's share taken at the mean, not at the draw: :math:`\\sigma h / g \\ne \\epsilon`, and a
regression of :math:`g` on the draw points misses by :math:`\\lambda_0\\sigma\\epsilon`. Where the
prior is a fixed Gaussian in the site's coordinates (:func:`~pyro_ngvi.conjugate_normal`, of
no tensor that requires a gradient) and the site is of weight 1, :func:`move_prior_to_draws` moves
that share to the draw: with :math:`\\nabla\\ell = g - \\lambda_0(\\mu - m_0)` the draw is
:math:`\\epsilon = \\sigma(h - \\lambda_0)/\\nabla\\ell` (one particle; several: read as the guide
runs), and

.. math:: \\nabla_\\mu \\mathrel{+}= \\lambda_0\\sigma\\bar\\epsilon, \\qquad
          \\nabla_\\sigma \\mathrel{+}= \\lambda_0\\big((\\mu - m_0)\\bar\\epsilon + \\sigma(\\overline{\\epsilon^2} - 1)\\big)

are the gradients ``Trace_ELBO`` takes at the same draws (:math:`-\\log p_0` at
:math:`u`, whose mean over :math:`\\epsilon` is the KL's prior part): the site then steps as under
``Trace_ELBO``. Elsewhere its draws are neither recovered nor read (:func:`analytic_locs`).
"""

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch.distributions import kl_divergence

from pyro.infer import JitTraceMeanField_ELBO, TraceMeanField_ELBO

from .family import GaussianSite, calling_step
from .guide_trace import elbo_traces
from .hot_path import reference
from .priors import conjugate_normal
from .statistics import EPS_MAX

#: The ELBOs that take some latents' KL in closed form.
MEAN_FIELD_ELBOS = (TraceMeanField_ELBO, JitTraceMeanField_ELBO)


def mean_field_elbo(svi) -> Optional[TraceMeanField_ELBO]:
    """The ``TraceMeanField_ELBO`` (or its Jit version) ``svi`` steps with, else ``None``."""
    elbo = getattr(getattr(svi, "loss_and_grads", None), "__self__", None)
    return elbo if type(elbo) in MEAN_FIELD_ELBOS else None


def analytic_locs(svi, guide, sites, cache: dict) -> Dict[int, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`integrated_sites` of ``svi``'s step (its loss, and the model and arguments of its
    ``SVI.step``, :func:`~pyro_ngvi.family.calling_step`); none under any loss but ``TraceMeanField_ELBO``."""
    elbo = mean_field_elbo(svi)
    if elbo is None or not sites:
        return {}
    found = calling_step(guide)
    if found is None or found.model is None:
        return {id(site.loc): None for site in sites}
    return integrated_sites(elbo, found.model, guide, found.args, found.kwargs, sites, cache)


def integrated_sites(elbo, model, guide, args, kwargs, sites, cache: dict) -> Dict[int, Optional[Tuple]]:
    """
    By the ``id`` of its ``loc``, each of ``sites`` whose gradients ``elbo`` (a
    ``TraceMeanField_ELBO``) does not take at one draw (module docstring), with its prior's
    :math:`(m_0, \\lambda_0)` where they are fixed and of the site's shape (else ``None``): those whose
    guide ``Normal`` is not found drawn in a trace of the ELBO's (``model`` replayed against ``guide``
    on ``args`` and ``kwargs`` as the ELBO runs them, :func:`~pyro_ngvi.guide_trace.elbo_traces`,
    random streams untouched): a site of the model with a registered KL, or a ``loc`` no guide
    ``Normal`` is built on (a computed one). Every site, with no prior, where the run fails. Read once
    per model (by identity: a weak reference) and loss type, kept in ``cache`` (the plan's).
    """
    key = (id(model), type(elbo))
    entry = cache.get(key)
    if entry is None or entry[0]() is not model:  # (a new model may get a freed one's id)
        try:
            traces = elbo_traces(elbo, model, guide, *args, **kwargs)
        except Exception:  # (the ELBO ran them already: its errors are its own to report)
            traces = None
        for gone in [k for k, (ref, _) in cache.items() if ref() is None]:
            del cache[gone]
        entry = cache[key] = (reference(model), None if traces is None else drawn_leaves(*traces))
    drawn, priors = entry[1] or (frozenset(), {})
    return {id(site.loc): priors.get(id(site.loc)) for site in sites if id(site.loc) not in drawn}


def drawn_leaves(model_trace, guide_trace) -> Tuple[frozenset, Dict[int, Tuple[torch.Tensor, torch.Tensor]]]:
    """The ``id`` of each leaf tensor that is the ``loc`` (or what it views) of a guide ``Normal``
    ``TraceMeanField_ELBO`` draws (an auxiliary site, or a model site with no registered KL) and of
    none it integrates; and of each leaf that is the ``loc`` itself of a site it integrates against
    a fixed Gaussian prior in the site's coordinates, of the leaf's shape, that prior's
    :math:`(m_0, \\lambda_0)` (detached)."""
    drawn, analytic, priors = set(), set(), {}
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        leaves = set(_normal_loc_leaves(site["fn"]))
        if not leaves:
            continue
        prior = model_trace.nodes.get(name)
        if prior is None or prior["type"] != "sample" or prior["is_observed"]:
            drawn |= leaves
            continue
        try:
            kl_divergence(site["fn"], prior["fn"])
        except NotImplementedError:
            drawn |= leaves
            continue
        except Exception:  # (a KL that fails otherwise: counted as integrated, no draws read)
            pass
        analytic |= leaves
        fixed = _fixed_prior(site["fn"], prior["fn"])
        if fixed is not None:
            priors[next(iter(leaves))] = fixed
    return frozenset(drawn - analytic), priors


def _fixed_prior(fn, prior_fn) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:math:`(m_0, \\lambda_0)` of ``prior_fn`` where it is a Gaussian in the coordinates of the
    guide's ``Normal`` in ``fn`` (whose ``loc`` is a leaf of the same shape), of tensors that need no
    gradient (not learned, not of another latent's draw), else ``None``."""
    base = fn
    while hasattr(base, "base_dist"):
        base = base.base_dist
    try:
        found = conjugate_normal(prior_fn, fn.support)
    except (ValueError, TypeError):
        return None
    if found is None or any(t.requires_grad for t in found) or not base.loc.is_leaf:
        return None
    m0, lam0 = found
    if m0.shape != base.loc.shape or lam0.shape != base.loc.shape:
        return None
    return m0.detach().clone(), lam0.detach().clone()


def move_prior_to_draws(sites, analytic: Dict, one_particle: bool, draws: Dict) -> Dict:
    """
    Move the integrated prior's share of the gradients of each mean-field site of ``analytic``
    (:func:`analytic_locs`) with a fixed prior, of weight 1 and no untouched row, to its draw
    (module docstring), in place on ``loc.grad`` and ``raw_scale.grad``: its draws
    :math:`(\\bar\\epsilon, \\overline{\\epsilon^2}, K)` read as the guide ran (``draws[id(loc)]``), or the
    one draw recovered (``one_particle``); a site with neither stays. An element whose draw is not
    recovered (:math:`|\\epsilon| >` :data:`~pyro_ngvi.statistics.EPS_MAX`, or :math:`\\nabla\\ell = 0`)
    is left as it was. Returns ``analytic`` less the sites moved.
    """
    left = dict(analytic)
    for site in sites:
        prior = analytic.get(id(site.loc))
        if (prior is None or not isinstance(site, GaussianSite) or site.weight != 1.0 or site.loc.grad is None
                or site.raw_scale.grad is None or not (one_particle or id(site.loc) in draws)):
            continue
        with torch.no_grad():
            grad, raw_grad = site.loc.grad, site.raw_scale.grad
            m0, lam0 = (t.to(grad) for t in prior)
            raw = site.raw_scale.detach()
            sigma = site._scale_transform(raw)
            slope = site._scale_transform.log_abs_det_jacobian(raw, sigma).exp()  # d sigma / d raw
            scale_grad = raw_grad / slope
            if (scale_grad == 0).any():  # (rows no draw touched: a mask, not moved)
                continue
            offset = site.loc.detach() - m0
            if id(site.loc) in draws:
                eps, eps_sq, _ = draws[id(site.loc)]
                eps, eps_sq = eps.to(grad), eps_sq.to(grad)
                known = torch.ones_like(grad, dtype=torch.bool)
            else:
                likelihood = grad - lam0 * offset
                eps = sigma * ((scale_grad + 1.0 / sigma) / sigma - lam0) / likelihood
                known = torch.isfinite(eps) & (eps.abs() <= EPS_MAX)
                eps = torch.where(known, eps, 0.0)
                eps_sq = eps.square()
            grad.add_(torch.where(known, lam0 * sigma * eps, 0.0))
            moved = lam0 * (offset * eps + sigma * (eps_sq - 1.0))
            raw_grad.add_(torch.where(known, moved * slope, 0.0))
        del left[id(site.loc)]
    return left


def _normal_loc_leaves(fn) -> Iterable[int]:
    """The ``id`` of the leaf under a ``Normal``'s ``loc`` inside ``fn`` (through ``Independent``,
    expanded, masked or transformed wrappers), if there is one."""
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    if not isinstance(fn, torch.distributions.Normal):
        return ()
    loc = fn.loc
    leaf = loc if loc._base is None else loc._base
    return (id(leaf),) if leaf.is_leaf else ()
