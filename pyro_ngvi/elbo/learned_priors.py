"""
Priors learned by the evidence: recognising, in a traced mean-field particle, a
conjugate prior :math:`\\mathcal{N}(u; m_0, \\lambda_0^{-1})` whose ``loc`` and/or
``scale`` is a ``pyro.param`` of the model broadcast over the site::

    s = pyro.param("prior_scale", torch.tensor(1.0), constraint=constraints.positive)
    w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))

The site keeps its exact conjugate treatment (the param's current value), and its
:class:`~pyro_ngvi.handover.SiteCurvature` names the param
(:class:`~pyro_ngvi.handover.PriorParam`), which :class:`~pyro_ngvi.NGVI` sets after
each update to the maximiser of the ELBO given the guide, in closed form
(:func:`~pyro_ngvi.priors.update_learned_priors`). Recognised: the param itself or
a view of it, with a real, half-line or interval constraint, not both loc and
scale; under a subsampled plate the prior must not vary along the plate. A param
that also enters the model elsewhere has no closed-form maximiser: it is found
(:class:`SharedPriorParams`), trained by the point optimizer, and its priors go
into :math:`\\ell`, with a warning (:func:`without_shared_priors`). Anything
computed from a param (``Normal(0, 1 / tau.sqrt())``) is an ordinary, non-conjugate
prior; so is a learned prior on a full-covariance guide. (With a plain
:class:`~pyro.infer.Trace_ELBO` the param is a point estimate trained by its
gradient; ``CurvatureELBO("reparam")`` gives the same sampled curvature with the
prior learned in closed form.)
"""

import warnings
from typing import Dict, Optional

import torch
from torch.distributions import constraints

import pyro

from ..curvature.traced import scalar_scale
from ..family import PriorParam
from ..monitor import NGVIWarning
from ..priors import conjugate_normal_parts, learnable_constraint, prior_param_index
from .sites import subsampled_dims


class SharedPriorParams(Exception):
    """A learned prior param also enters the model elsewhere (see :func:`without_shared_priors`)."""

    def __init__(self, names):
        super().__init__(names)
        self.names = names


def without_shared_priors(elbo, particle, *args):
    """``particle(elbo, *args)``, again without closed-form learning of a prior param
    found to enter the model elsewhere (nothing was written before that was found)."""
    while True:
        try:
            return particle(elbo, *args)
        except SharedPriorParams as shared:
            elbo._shared_prior_params.update(shared.names)
            warnings.warn(
                f"The prior param(s) {', '.join(repr(n) for n in shared.names)} also enter the "
                "model outside conjugate Normal priors, so the ELBO has no closed-form "
                "maximiser in them: they are trained by NGVI's point optimizer from their "
                "gradient, and the priors they set are handled as non-conjugate.",
                NGVIWarning,
                stacklevel=4,
            )


def masked(site) -> bool:
    """Whether a model site's prior is hidden, wholly or in part: a ``poutine.mask`` on it or a
    scale of 0 (its ``log_prob_sum`` is then not :math:`c \\log p_0`; it stays in :math:`\\ell`)."""
    return not (site["mask"] is None or site["mask"] is True) or scalar_scale(site) == 0.0


def conjugate_prior(site, support, leaf, guide_scale, guide, candidates):
    """
    The conjugate prior of a guided site as ``((m0, lam0), learned)``: :math:`m_0`
    and :math:`\\lambda_0` expanded to ``leaf``, :math:`\\lambda_0` times :math:`c / g`
    (the model site's scale :math:`c`, a ``poutine.scale`` or a subsampled plate's
    :math:`N/B`, over the guide site's :math:`g`: Pyro's ELBO has
    :math:`c \\log p_0 - g \\log q`, and the statistics are divided by :math:`g`), and
    ``learned`` the dict of its learned :class:`~pyro_ngvi.handover.PriorParam` s
    (:func:`learned_prior`, with the ``"weight"`` of each row's KL in the full-data
    ELBO) or ``None`` for a fixed prior; ``None`` when the prior is not conjugate (or
    not recognised as learned, or learned with :math:`c \\neq g`: then an ordinary
    prior, its params trained by the point optimizer). ``candidates()`` gives the
    model's params a prior may be.
    """
    parts = conjugate_normal_parts(site["fn"], support)
    if parts is None:
        return None
    ratio = scalar_scale(site) / guide_scale
    hyper = None
    if parts[0].requires_grad or parts[1].requires_grad:
        hyper = learned_prior(site["name"], *parts, candidates(), guide) if ratio == 1.0 else None
        if hyper is None:
            return None
    prior = (parts[0].detach().expand_as(leaf), ratio * parts[1].detach().pow(-2).expand_as(leaf))
    if hyper is not None:
        hyper["weight"] = guide_scale * leaf.numel() / hyper["full"][0].numel()
    return prior, hyper


def check_not_shared(learned, others, other_grads) -> None:
    """Raise :class:`SharedPriorParams` when :math:`\\ell` has a gradient in a learned prior param."""
    hyper_names = {id(p.unconstrained): p.name for hyper in learned.values()
                   for p in (hyper.get("loc"), hyper.get("scale")) if p is not None}
    shared = sorted({hyper_names[id(p)] for p, g in zip(others, other_grads)
                     if g is not None and id(p) in hyper_names})
    if shared:
        raise SharedPriorParams(shared)


def prior_param_candidates(model_trace, guide, shared) -> Dict[str, torch.Tensor]:
    """The model's ``pyro.param`` values a prior's loc or scale may be (learnable ones,
    not in ``shared``)."""
    prefix = guide._pyro_name + "."
    store = pyro.get_param_store()
    return {
        name: site["value"] for name, site in model_trace.nodes.items()
        if site["type"] == "param" and not name.startswith(prefix)
        and name not in shared
        and learnable_constraint(store._constraints.get(name, constraints.real))
    }


def learned_prior(name, loc, scale, params, guide) -> Optional[dict]:
    """
    The :class:`~pyro_ngvi.handover.PriorParam` s of a conjugate prior whose
    ``loc`` / ``scale`` (those that need a gradient) are ``pyro.param`` values
    of the model, with the prior in full-size rows, as
    ``{"loc": ..., "scale": ..., "full": (m0, lam0)}``; ``None`` when any
    such tensor is not a param (or a view of one), or the prior varies along a
    subsampled plate (its rows outside the minibatch are then unknown).
    """
    found, full = {}, []
    for role, tensor in (("loc", loc), ("scale", scale)):
        full_tensor = _full_rows(tensor, guide, name)
        if full_tensor is None:
            return None
        full.append(full_tensor.detach())
        if not tensor.requires_grad:
            continue
        match = next(((param_name, value, index) for param_name, value in params.items()
                      for index in [prior_param_index(tensor, value)] if index is not None), None)
        if match is None:
            return None
        param_name, value, index = match
        found[role] = PriorParam(param_name, value.unconstrained(),
                                 pyro.get_param_store()._constraints[param_name],
                                 _full_rows(index, guide, name))
    if "loc" in found and "scale" in found and found["loc"].name == found["scale"].name:
        return None
    found["full"] = (full[0], full[1].pow(-2))
    return found


def _full_rows(tensor, guide, name):
    """
    ``tensor`` (a site's prior, shaped like its minibatch rows) for all rows of
    every subsampled plate, when it is constant along them (size 1 or stride 0
    there, as a broadcast param is); ``None`` when it varies along one.
    """
    for _, dim, full_size in subsampled_dims(guide, name):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != 0:
            return None
        shape = list(tensor.shape)
        shape[dim] = full_size
        tensor = tensor.narrow(dim, 0, 1).expand(shape)
    return tensor
