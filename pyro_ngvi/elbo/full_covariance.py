"""
:class:`~pyro_ngvi.CurvatureELBO`'s path for an
:class:`~pyro.infer.autoguide.AutoMultivariateNormal` guide: one
:class:`~pyro_ngvi.handover.SiteCurvature` for its whole latent vector ``z``
(``D`` coordinates) at :math:`z = \\mu + C\\epsilon` (:math:`\\mu` when
deterministic), with :math:`g = \\nabla_z \\ell` and a dense ``(D, D)`` curvature
(:class:`~pyro_ngvi.curvature.traced.Dense`; ``"reparam"``: the Price estimate
of :math:`\\mathrm{tril}(g\\epsilon^\\top)`, the one NGVI recovers from
Trace_ELBO's gradients, handed over whitened). Priors that are Gaussian in ``u``
(:func:`~pyro_ngvi.priors.conjugate_gaussian`, not masked) are handed over as the
blocks of :math:`(m_0, S_0)`, :math:`S_0` times the site's scale :math:`c` (Pyro's ELBO has
:math:`c \\log p_0`; the guide, and so :math:`\\log|\\det J|`, is not scaled); the other
sites' blocks of :math:`S_0` are zero.
Deterministic, the loss is :math:`\\ell(\\mu) - \\mathcal{H}(q) - E_q[\\log p_0]`
(the Gaussian parts in expectation, in closed form). Learned prior params are not
recognised here (such a prior is an ordinary non-conjugate one), and ``BatchNorm``
statistics are not frozen.
"""

import math

import torch
from torch.distributions import biject_to

import pyro
import pyro.poutine as poutine

from ..curvature.traced import Dense, scalar_scale, traced_curvature
from ..family import SiteCurvature, _full_covariance_site, _is_automultivariatenormal, attach_curvature
from ..priors import conjugate_gaussian
from .learned_priors import masked
from .sites import gradients, minibatch_sites, negative_log_joint, other_params, replayed, run_once, split_terms


def full_covariance_loss_and_grads(elbo, model, guide, args, kwargs) -> float:
    """:meth:`~pyro_ngvi.CurvatureELBO.loss_and_grads` for an AutoMultivariateNormal guide."""
    if not _is_automultivariatenormal(guide):
        raise NotImplementedError(
            f"CurvatureELBO cannot read the Gaussian of {type(guide).__name__}, a subclass of "
            "AutoMultivariateNormal that changes how it builds its posterior; use Trace_ELBO"
        )
    run_once(guide, args, kwargs)
    site = _full_covariance_site(guide, pyro.get_param_store())
    grad = curvature = None
    prior = (None, None)
    loss, minibatch = 0.0, False
    for _ in range(elbo.num_particles):
        particle_loss, particle_grad, particle_curvature, prior, estimated = _particle(elbo, model, guide, args, kwargs)
        minibatch = minibatch or estimated
        loss += particle_loss / elbo.num_particles
        grad = particle_grad if grad is None else grad + particle_grad
        curvature = particle_curvature if curvature is None else curvature + particle_curvature
    attach_curvature(site.loc, SiteCurvature(
        grad / elbo.num_particles, curvature / elbo.num_particles, *prior,
        # noisy at draws, and at the mean too where a plate is subsampled (a minibatch estimate)
        sampled=not elbo.deterministic or minibatch, whitened=elbo.curvature == "reparam",
    ))
    return loss


def _particle(elbo, model, guide, args, kwargs):
    """One draw: ``(loss, g, h, (m0, S0) or (None, None), minibatch)``, ``minibatch`` whether terms of a
    subsampled plate reach ``z`` (:func:`~.sites.minibatch_sites`); other params' gradients, divided by
    the number of particles, added to their ``.grad``."""
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    latent = guide_trace.nodes[f"_{guide._pyro_name}_latent"]
    posterior = latent["fn"]
    loc, factor = posterior.loc.detach(), posterior.scale_tril.detach()
    z = (loc if elbo.deterministic else latent["value"]).detach().clone().requires_grad_()
    blocks, position = {}, 0
    for prototype, u in guide._unpack_latent(z):
        name = prototype["name"]
        transform = biject_to(prototype["fn"].support)
        guide_trace.nodes[name]["value"] = transform(u)
        blocks[name] = (slice(position, position + u.numel()), u, transform, prototype["fn"].support)
        position += u.numel()
    model_trace = replayed(model, guide_trace, blocks, args, kwargs)

    size = z.numel()
    prior_loc, prior_precision = z.new_zeros(size), z.new_zeros(size, size)
    conjugate = []

    def prior_term(name, node):  # c log p0 (c the site's scale, poutine.mask applied); log|det J| unscaled
        block, u, transform, support = blocks[name]
        prior = None if masked(node) else conjugate_gaussian(node["fn"], support)
        log_det = transform.log_abs_det_jacobian(u, node["value"]).sum()
        if prior is not None and not (prior[0].requires_grad or prior[1].requires_grad):
            scale = scalar_scale(node)
            prior_loc[block] = prior[0].detach()
            prior_precision[block, block] = scale * prior[1].detach()
            conjugate.append((name, scale))
            # c log p0(T(u)) + log|det J| = c log N(u; m0, S0^-1) + (1 - c) log|det J|
            return (1.0 - scale) * log_det if scale != 1.0 else None
        return node["log_prob_sum"] + log_det

    terms = split_terms(model_trace, blocks, elbo.max_plate_nesting, prior_term)
    others = other_params(model_trace, guide_trace, guide)
    (grad,), other_grads = gradients(terms.objective, [z], others)
    for p, g in zip(others, other_grads):
        if g is not None:
            g = g.detach() / elbo.num_particles
            p.grad = g if p.grad is None else p.grad + g
    (curvature,) = traced_curvature(elbo.curvature, terms, Dense(z, loc, factor), [grad], elbo.mc_samples)
    prior = (prior_loc, prior_precision) if conjugate else (None, None)

    with torch.no_grad():
        if elbo.deterministic:  # l(mu) - H(q) + the conjugate blocks' cross-entropy
            loss = 0.0 if terms.objective is None else float(terms.objective)
            loss -= float(posterior.entropy())
            if conjugate:
                loss += float(_gaussian_cross_entropy(loc, factor, prior_loc, prior_precision,
                                                      [(blocks[n][0], c) for n, c in conjugate]))
        else:
            loss = negative_log_joint(model_trace)
            loss += float(posterior.log_prob(z))
            for name, (_, u, transform, _) in blocks.items():
                value = guide_trace.nodes[name]["value"]
                loss -= float(transform.log_abs_det_jacobian(u, value).sum())
    return loss, grad.detach(), curvature, prior, bool(minibatch_sites(model_trace, blocks))


def _gaussian_cross_entropy(loc, factor, prior_loc, prior_precision, blocks) -> torch.Tensor:
    """:math:`-s\\,E_q[\\log p_0(u_b)]` summed over the conjugate blocks ``(b, s)`` (:math:`s` the
    site's scale, :math:`S_0` the block of ``prior_precision``, which is :math:`s` times the prior's):
    :math:`\\tfrac12[\\mathrm{tr}(S_0 \\Sigma_{bb}) + (\\mu_b - m_0)^\\top S_0 (\\mu_b - m_0)
    - s \\log\\det (S_0 / s) + s\\,d_b \\log 2\\pi]`."""
    covariance = factor @ factor.T
    total = loc.new_zeros(())
    for block, scale in blocks:
        precision = prior_precision[block, block]
        offset = loc[block] - prior_loc[block]
        total = total + 0.5 * ((precision * covariance[block, block]).sum() + offset @ precision @ offset
                               - scale * torch.logdet(precision / scale) + scale * offset.numel() * math.log(2 * math.pi))
    return total
