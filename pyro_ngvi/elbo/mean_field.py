"""
:class:`~pyro_ngvi.CurvatureELBO`'s traced path for an
:class:`~pyro.infer.autoguide.AutoNormal` guide: the particles
(:mod:`pyro_ngvi.elbo.particle`; antithetic pairs :math:`\\mu \\pm \\sigma\\epsilon` when asked)
averaged, and per site a :class:`~pyro_ngvi.handover.SiteCurvature`

.. math:: \\bar g = \\frac{\\sum_s g_s}{n}, \\quad \\bar h = \\frac{\\sum_s h_s}{n},
          \\quad \\overline{\\epsilon}, \\ \\overline{\\epsilon^2}

(:math:`n` the draws that touched each row; a row no draw touched is masked out)
attached to its ``loc`` with the conjugate prior, the learned prior params and
the model's :func:`~pyro_ngvi.elbo.protocol.statistics_hints`.
"""

from typing import Dict, List

import torch

import pyro

from ..family import SiteCurvature, attach_curvature
from ..safeguards import evaluated_on
from .learned_priors import without_shared_priors
from .particle import particle
from .protocol import statistics_hints
from .sites import check_guide


def mean_field_loss_and_grads(elbo, model, guide, args, kwargs) -> float:
    """:meth:`~pyro_ngvi.CurvatureELBO.loss_and_grads` for an AutoNormal guide, by tracing."""
    check_guide(guide, args, kwargs)
    totals: Dict[str, List[torch.Tensor]] = {}
    priors = {}
    point_grads: Dict[int, List] = {}  # id -> [param, grad]: written once all particles ran
    loss = 0.0
    draws = 2 * elbo.num_particles if elbo.antithetic else elbo.num_particles
    guide_trace, minibatch = None, set()
    for i in range(draws):
        mirror = guide_trace if elbo.antithetic and i % 2 else None  # eps, then -eps
        particle_loss, stats, particle_priors, guide_trace, estimated = without_shared_priors(
            elbo, particle, model, guide, args, kwargs, point_grads, mirror)
        minibatch |= estimated
        loss += particle_loss / draws
        priors.update(particle_priors)
        for name, values in stats.items():
            if name in totals:
                for total, value in zip(totals[name], values):
                    total += value
            else:
                totals[name] = list(values)
    for p, grad in point_grads.values():
        p.grad = grad if p.grad is None else p.grad + grad
    store = pyro.get_param_store()
    # statistics at draws are noisy whatever their source, and so are a minibatch's sums, at the mean
    # too (the adaptive steps average both); the draws give the gradient's control variate, the
    # curvature's only for the Price estimate
    drawn, price = not elbo.deterministic, elbo.curvature == "reparam"
    hints = statistics_hints(model)
    for name, (grad, curvature, count, eps, eps_sq, *objective) in totals.items():
        touched = count > 0
        denominator = count.clamp(min=1)
        prior_loc, prior_precision, learned = priors.get(name, (None, None, None))
        learned = learned or {}
        attach_curvature(
            store._params[f"{guide._pyro_name}.locs.{name}"],
            SiteCurvature(
                grad / denominator,
                curvature / denominator,
                prior_loc,
                prior_precision,
                None if bool(touched.all()) else touched,
                sampled=drawn or name in minibatch,
                prior_loc_param=learned.get("loc"),
                prior_scale_param=learned.get("scale"),
                prior_weight=learned.get("weight", 1.0),
                # the draws, for NGVI's control variate (untouched rows: eps 0, eps^2 1)
                eps_mean=eps / denominator if drawn else None,
                eps_sq_mean=torch.where(touched, eps_sq / denominator, 1.0) if price else None,
                particles=draws,
                # deterministic (one draw, at the mean): the merit of NGVI's Newton safeguard
                objective=objective[0] if objective else None,
                arguments=evaluated_on(model, args, kwargs) if objective else None,
                loss=loss,
                **hints(name, elbo.deterministic),
            ),
        )
    return loss
