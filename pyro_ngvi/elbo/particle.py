"""
One traced particle of :class:`~pyro_ngvi.CurvatureELBO` for an
:class:`~pyro.infer.autoguide.AutoNormal` guide: a draw
:math:`u = \\mu + \\sigma\\epsilon` per site (:math:`u = \\mu` when deterministic;
:math:`\\mu - \\sigma\\epsilon` for an antithetic partner), the model replayed there,
and per site

.. math:: g = \\nabla_u \\ell, \\qquad h \\text{ (the source's, }
          :mod:`pyro_ngvi.curvature.traced`), \\qquad \\epsilon, \\ \\epsilon^2,

divided by the guide site's scale :math:`g` (a subsampled plate's :math:`N/B`; the model's
terms keep their own scales, :math:`c` of a ``poutine.scale``, as in Pyro's ELBO: the guide
is not scaled with the model) and scattered into full-size rows, with the
conjugate prior :math:`(m_0, \\lambda_0)` and the value: Trace_ELBO's single-sample
estimate, or at the mean :math:`\\ell(\\mu) + \\mathrm{KL}(q \\| p_0)` for
conjugate sites (:math:`\\log q - \\log p` at the mean for others), and
:math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|` for NGVI's safeguard.
"""

import math
from typing import Dict, List, NamedTuple

import torch
from torch.distributions import biject_to

import pyro.poutine as poutine

from ..curvature import PER_EXAMPLE
from ..curvature.traced import Diagonal, scalar_scale, traced_curvature
from .learned_priors import check_not_shared, conjugate_prior, masked, prior_param_candidates
from .sites import (frozen_observed, gradients, minibatch_sites, negative_log_joint, other_params, replayed,
                    scatter_rows, split_terms, subsampled, torch_rng_state)


class Particle(NamedTuple):
    """What one draw hands :func:`~pyro_ngvi.elbo.mean_field.mean_field_loss_and_grads`."""

    loss: float
    #: site -> [g, h, touched-row count, eps, eps^2 (, F(mu) when deterministic)], full-size rows
    stats: Dict[str, List]
    #: site -> (m0, lam0, learned prior params or None), for sites with a conjugate prior
    priors: Dict[str, tuple]
    guide_trace: object
    #: the sites whose statistics are minibatch estimates (``pyro_ngvi.elbo.sites.minibatch_sites``)
    minibatch: frozenset = frozenset()


def particle(elbo, model, guide, args, kwargs, point_grads, mirror=None) -> Particle:
    """One draw: ``mirror`` is the guide trace of the previous draw, whose
    :math:`\\epsilon` this one negates (the antithetic partner). Gradients of other
    params, divided by the number of particles, are added to ``point_grads``."""
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs) if mirror is None else mirror
    leaves, latents = _draw(guide, guide_trace, elbo.deterministic, mirror)
    # per-example sources may rerun the model (BatchNorm): with the same random state
    rng_state = torch_rng_state() if elbo.curvature in PER_EXAMPLE else None
    model_trace = replayed(model, guide_trace, leaves, args, kwargs)

    conjugate, site_scale = {}, {}
    learned = {}  # site -> {"loc": PriorParam, "scale": PriorParam, "weight", "full": (m0, lam0)}
    params = []  # the model's params a prior may be, found when first needed

    def candidates():
        if not params:
            params.append(prior_param_candidates(model_trace, guide, elbo._shared_prior_params))
        return params[0]

    def prior_term(name, site):
        # the model's term is c log p0 (c its scale); the guide's entropy, log|det J| included, g times
        guide_scale = site_scale[name] = scalar_scale(guide_trace.nodes[name])
        leaf = leaves[name]
        log_det = latents[name][2].log_abs_det_jacobian(leaf, site["value"])
        support = guide.prototype_trace.nodes[name]["fn"].support
        prior = None if masked(site) else conjugate_prior(site, support, leaf, guide_scale, guide, candidates)
        if prior is None:
            return site["log_prob_sum"] + guide_scale * log_det.sum()
        conjugate[name], hyper = prior
        if hyper is not None:
            learned[name] = hyper
        # c log p0(T(u)) + g log|det J| = c log N(u; m0, 1 / lam0) + (g - c) log|det J|
        jacobian = guide_scale - scalar_scale(site)
        return jacobian * log_det.sum() if jacobian else None

    terms = split_terms(model_trace, leaves, elbo.max_plate_nesting, prior_term)
    names = list(leaves)
    inputs = [leaves[n] for n in names]
    others = other_params(model_trace, guide_trace, guide)
    grads, other_grads = gradients(terms.objective, inputs, others)
    check_not_shared(learned, others, other_grads)  # before anything is written
    if rng_state is not None:
        terms = terms._replace(observed=frozen_observed(model, model_trace, terms.observed, rng_state,
                                                        elbo.curvature, args, kwargs))
    for p, g in zip(others, other_grads):
        if g is not None:
            g = g.detach() / elbo.num_particles
            if id(p) in point_grads:
                point_grads[id(p)][1] = point_grads[id(p)][1] + g
            else:
                point_grads[id(p)] = [p, g]
    coordinates = Diagonal(inputs, [latents[n][0] for n in names], [latents[n][1] for n in names])
    curvatures = traced_curvature(elbo.curvature, terms, coordinates, grads, elbo.mc_samples)

    stats, priors = {}, {}
    for name, leaf, grad, curvature in zip(names, inputs, grads, curvatures):
        scale = site_scale.get(name, 1.0)
        grad, curvature = grad.detach() / scale, curvature.detach() / scale
        full_grad, count = scatter_rows(grad, guide, name, guide_trace)
        full_curvature, _ = scatter_rows(curvature, guide, name, guide_trace)
        loc, sigma = latents[name][:2]
        eps = (leaf.detach() - loc) / sigma
        stats[name] = [full_grad, full_curvature, count,
                       scatter_rows(eps, guide, name, guide_trace)[0],
                       scatter_rows(eps.square(), guide, name, guide_trace)[0]]
        if name in learned:  # full-size: constant along any subsampled plate
            m0, lam0 = learned[name].pop("full")
            priors[name] = (m0, lam0, learned[name])
        elif name in conjugate:
            m0, lam0 = (scatter_rows(t, guide, name, guide_trace, fill=1.0)[0] for t in conjugate[name])
            priors[name] = (m0, lam0, None)

    loss, objective = _value(model_trace, guide_trace, leaves, latents, site_scale, conjugate, elbo.deterministic)
    if elbo.deterministic and not subsampled(model_trace):
        for values in stats.values():
            values.append(objective)
    return Particle(loss, stats, priors, guide_trace, frozenset(minibatch_sites(model_trace, names)))


def _draw(guide, guide_trace, deterministic, mirror):
    """Per site a leaf ``u`` (``requires_grad``) written into the guide trace as
    :math:`T(u)`, and ``(mu, sigma, T, the guide's unconstrained site)``."""
    leaves, latents = {}, {}
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        aux = guide_trace.nodes[name + "_unconstrained"]
        normal = aux["fn"].base_dist if hasattr(aux["fn"], "base_dist") else aux["fn"]
        u = normal.loc if deterministic else aux["value"]
        if mirror is not None:  # mu - sigma eps
            u = 2 * normal.loc - u
        leaf = u.detach().requires_grad_()
        transform = biject_to(site["fn"].support)
        guide_trace.nodes[name]["value"] = transform(leaf)
        leaves[name] = leaf
        latents[name] = (normal.loc.detach(), normal.scale.detach(), transform, aux)
    return leaves, latents


@torch.no_grad()
def _value(model_trace, guide_trace, leaves, latents, site_scale, conjugate, deterministic):
    """
    The particle's loss, :math:`-\\log p(x, z) + \\log q(z)` with each site's scale (the
    model's :math:`c`, the guide's :math:`g`) at the draw (at the mean, a conjugate site's
    :math:`g \\log q - c \\log p` replaced by its expectation in closed form,
    :math:`g\\,\\mathrm{KL}(q \\| p_0)` when :math:`c = g`, as on a model's own fast path), and
    :math:`F = -\\log p(x, T(u)) - g \\log|\\det J_T(u)|` there.
    """
    loss = negative_log_joint(model_trace)
    objective = loss
    for name, (loc, scale, transform, aux) in latents.items():
        g = site_scale.get(name, 1.0)
        leaf = leaves[name]
        log_det = float(transform.log_abs_det_jacobian(leaf, guide_trace.nodes[name]["value"]).sum())
        objective -= g * log_det
        if deterministic and name in conjugate:
            site = model_trace.nodes[name]
            c = scalar_scale(site)
            prior_loc, prior_precision = conjugate[name]  # (lam0 times c / g)
            loss += float(site["log_prob_sum"]) + (c - g) * log_det  # E[log|det J|] at the mean
            loss += float(_normal_cross_entropy(loc, scale, prior_loc, prior_precision * (g / c), c, g))
            continue
        log_q = aux["fn"].log_prob(leaf).sum()
        loss += g * (float(log_q) - log_det)
    return loss, objective


def _normal_cross_entropy(loc, scale, prior_loc, prior_precision, c, g) -> torch.Tensor:
    """:math:`c\\,\\mathrm{H}(q, p_0) - g\\,\\mathrm{H}(q)` for :math:`q = \\mathcal{N}(\\mu, \\sigma^2)`,
    :math:`p_0 = \\mathcal{N}(m_0, \\lambda_0^{-1})`: :math:`\\sum [\\tfrac{c}{2} (\\lambda_0 (\\sigma^2 + (\\mu - m_0)^2)
    - \\log \\lambda_0) - \\tfrac{g}{2} (\\log \\sigma^2 + 1) + \\tfrac{c - g}{2} \\log 2\\pi]`
    (:math:`g\\,\\mathrm{KL}(q \\| p_0)` when :math:`c = g`)."""
    variance = scale.square()
    cross = prior_precision * (variance + (loc - prior_loc).square()) - prior_precision.log()
    return 0.5 * (c * cross - g * (variance.log() + 1.0) + (c - g) * math.log(2 * math.pi)).sum()
