"""
:class:`CurvatureELBO`: the ELBO with explicit curvature for :class:`~pyro_ngvi.NGVI`.
"""

import math
import warnings
from typing import Dict, List

import torch
from torch.distributions import biject_to, constraints

import pyro
import pyro.poutine as poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from pyro.infer.elbo import ELBO
from pyro.poutine.util import site_is_subsample
from pyro.util import check_site_shape

from .curvature import check_source
from .curvature.autograd import diag_hessian, empirical_fisher_diag, ggn_diag, mc_ggn_diag, per_example_log_prob
from .curvature.batch_norm import frozen_batch_statistics, uses_batch_statistics
from .curvature.dense import empirical_fisher_matrix, ggn_matrix, hessian_matrix, mc_ggn_matrix
from .family import PriorParam, SiteCurvature, _full_covariance_site, _is_automultivariatenormal, attach_curvature
from .family import begin_handover, calling_svi, end_handover
from .full_covariance import whitened_price_curvature
from .priors import conjugate_gaussian, conjugate_normal_parts, learnable_constraint, prior_param_index


class CurvatureELBO(ELBO):
    """
    The evidence lower bound of :class:`~pyro.infer.Trace_ELBO`, whose
    :meth:`loss_and_grads` also hands :class:`~pyro_ngvi.NGVI`, for every site of
    an :class:`~pyro.infer.autoguide.AutoNormal` guide, the gradient :math:`g` and
    a diagonal curvature :math:`h` of the non-conjugate part :math:`\\ell` of the
    negative log joint in the site's unconstrained coordinates ``u``, evaluated at
    :math:`u = \\mu + \\sigma\\epsilon` (or at :math:`u = \\mu` when
    ``deterministic``) and averaged over particles:

    .. math:: -\\log p(x, T(u)) - \\log|\\det J_T(u)|
              = \\underbrace{\\ell(u)}_{\\text{likelihood, other priors}}
              + \\underbrace{\\tfrac{\\lambda_0}{2}(u - m_0)^2}_{\\text{conjugate prior}}
              + \\text{const}.

    A prior that is Normal in ``u`` (see :func:`~pyro_ngvi.priors.conjugate_normal`)
    is handed over as :math:`(m_0, \\lambda_0)` and enters the update exactly.
    Every other prior term (and ``log|det J|``) stays in :math:`\\ell` with its
    gradient and exact diagonal Hessian. Terms of a site under a subsampled plate
    are divided by that site's plate scale :math:`N/B`, so the rows in the
    minibatch get their full-data values.

    **Priors learned by the evidence.** When the ``loc`` and/or ``scale`` of such
    a prior is a ``pyro.param`` of the model, broadcast over the site (Pyro's
    way to write a learnable hyperparameter)::

        s = pyro.param("prior_scale", torch.tensor(1.0), constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, s).expand([D]).to_event(1))

    the site keeps its exact conjugate treatment (with the param's current
    value), and the :class:`~pyro_ngvi.family.SiteCurvature` names the param
    (:class:`~pyro_ngvi.family.PriorParam`: its tensor, constraint, and which of
    its elements is the prior of each site element). :class:`~pyro_ngvi.NGVI`
    then sets it, after each update of the guide, to the maximiser of the ELBO
    given the guide (type-II maximum likelihood in closed form,
    :func:`~pyro_ngvi.priors.update_learned_priors`), and keeps it away from its
    point optimizer: a few steps reach the evidence optimum where a gradient
    optimizer needs thousands. Recognised: the param itself or any view of it
    (``expand``, ``unsqueeze``, broadcasting), with a real, half-line or interval
    constraint, the same param not being both loc and scale; under a subsampled
    plate the prior must not vary along the plate. A param that also enters the
    model elsewhere (the likelihood, a non-conjugate prior) has no closed-form
    maximiser: it is trained by the point optimizer as before, its sites' priors
    go into :math:`\\ell`, and a :class:`UserWarning` says so once. Anything
    computed from a param (``Normal(0, 1 / tau.sqrt())``) is an ordinary,
    non-conjugate prior. With a plain :class:`~pyro.infer.Trace_ELBO` the
    optimizer sees no model trace: the prior is inside :math:`g, h` and the param
    is a point-estimated parameter trained by its gradient; use
    ``CurvatureELBO("reparam")`` for the same sampled curvature with the prior
    learned in closed form.

    Curvature sources for the likelihood part (:data:`pyro_ngvi.curvature.SOURCES`):

    - ``"reparam"``: :math:`h = g\\,\\epsilon/\\sigma` (Price's theorem), no extra pass;
    - ``"hessian"``: the exact Hessian diagonal by autograd (small models);
    - ``"ef"``: VOGN's Gauss-Newton :math:`\\frac{N}{B}\\sum_{i \\in B} g_i^2`
      from per-example gradients over the data plate;
    - ``"ggn_mc"``: the same at targets drawn from the model's own likelihood;
    - ``"ggn"``: the exact generalised Gauss-Newton diagonal for Categorical,
      Bernoulli and Normal likelihoods.

    For a model whose likelihood passes a ``BatchNorm`` that normalises with
    the minibatch's statistics (train mode), ``ef``, ``ggn`` and ``ggn_mc`` are
    those of the network with the statistics frozen (the model is run once more
    for them), the gradient stays exact: see :mod:`pyro_ngvi.curvature.batch_norm`.

    **Full covariance.** For an
    :class:`~pyro.infer.autoguide.AutoMultivariateNormal` the same sources are
    dense ``(D, D)`` matrices over the guide's whole latent vector
    (:mod:`pyro_ngvi.curvature.dense`: the exact Hessian, :math:`\\sum_i J_i^\\top
    F_i J_i`, :math:`\\frac{N}{B}\\sum_i g_i g_i^\\top`, its Monte-Carlo GGN, and
    for ``"reparam"`` the Price estimate of
    :func:`~pyro_ngvi.full_covariance.price_curvature`), and a prior that is
    Gaussian in ``u`` (a Normal, or the ``MultivariateNormal`` that
    :func:`~pyro_ngvi.posterior_as_prior` makes of a full-covariance guide) is
    handed over as its block of :math:`(m_0, S_0)`. Deterministic, the loss is
    :math:`\\ell(\\mu) - \\mathcal{H}(q) - E_q[\\log p_0]` (the Gaussian parts in
    expectation, in closed form). Learned prior params (above) are recognised
    on mean-field sites only; on a full-covariance guide such a prior is an
    ordinary non-conjugate one, and BatchNorm statistics are not frozen.

    **A model's own fast path.** A model that can compute these statistics
    faster than tracing says so (the protocol; the ELBO knows no model class):

    - ``model.curvature_sources``: the sources it serves (a tuple of names);
    - ``model.curvature_step(guide, *args, curvature=, num_particles=,
      deterministic=, mc_samples=, **kwargs)``: does what :meth:`loss_and_grads`
      does (attach a :class:`~pyro_ngvi.family.SiteCurvature` to every guide
      site's ``loc``, set ``.grad`` of the other parameters) and returns the loss.
    - ``model.statistics_hints(site, deterministic)`` (optional, also read on the
      traced path): a dict of further :class:`~pyro_ngvi.family.SiteCurvature`
      fields for the site (``num_data``, ``min_precision``: what NGVI's defaults
      and the variational family follow).

    :class:`~pyro_ngvi.BayesianNet` is one: its network runs with the sampled
    weights and BackPACK computes the per-example quantities, with no Pyro
    tracing. For any other model (or source) the same numbers come from autograd.

    **What else NGVI gets** (mean-field sites). With ``"reparam"`` the draws
    :math:`\\epsilon` themselves (their mean and mean square over particles), for
    NGVI's control variate; with ``antithetic=True`` each particle is a pair of
    draws :math:`\\mu \\pm \\sigma\\epsilon` (two model evaluations), whose mean
    gradient is the gradient at the mean for a quadratic log joint. When
    ``deterministic`` (and no plate is subsampled),
    :math:`F(\\mu) = -\\log p(x, T(\\mu)) - \\log|\\det J_T(\\mu)|`, the objective of
    the Newton steps, for NGVI's safeguard.

    **Discrete sites.** The ELBO neither enumerates nor samples latent sites the
    guide does not cover: a model with one (a ``config_enumerate`` site, or any
    other) is refused with :class:`NotImplementedError`, which names it; sum
    discrete sites out with :class:`~pyro.infer.TraceEnum_ELBO` and NGVI (Price
    curvature) instead.

    :param str curvature: one of the sources above (default: ``"reparam"``)
    :param int num_particles: Monte-Carlo samples (antithetic: pairs) per step (default: 1)
    :param bool deterministic: evaluate at the mean, "OGN" (default: False)
    :param int mc_samples: target samples per step for ``"ggn_mc"`` (default: 1)
    :param int max_plate_nesting: as in :class:`~pyro.infer.ELBO`
    :param bool antithetic: draw each particle as the pair :math:`\\pm\\epsilon`
        (sampled evaluations of mean-field guides; a model's own fast path is not
        used then) (default: False)

    The value returned by :meth:`loss_and_grads` is the single-sample estimate
    Trace_ELBO would return at the same sample. When ``deterministic`` it is the
    likelihood part at the mean plus, for sites with a conjugate Normal prior,
    the closed-form :math:`\\mathrm{KL}(q \\| p_0)` (for other sites
    :math:`\\log q - \\log p` at the mean), the same value on the traced and
    :class:`~pyro_ngvi.BayesianNet` paths. :meth:`loss` is Trace_ELBO's.
    """

    def __init__(
        self,
        curvature: str = "reparam",
        num_particles: int = 1,
        deterministic: bool = False,
        mc_samples: int = 1,
        max_plate_nesting: float = math.inf,
        antithetic: bool = False,
    ):
        if not isinstance(curvature, str):
            raise ValueError(f"curvature must be a string naming a source, got {curvature!r}")
        check_source(curvature)
        for name, value in (("num_particles", num_particles), ("mc_samples", mc_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
        if not (max_plate_nesting == math.inf or (
                isinstance(max_plate_nesting, int) and not isinstance(max_plate_nesting, bool)
                and max_plate_nesting >= 0)):
            raise ValueError(
                f"max_plate_nesting must be a non-negative integer or math.inf, got {max_plate_nesting!r}"
            )
        if deterministic and curvature == "reparam":
            raise ValueError(
                "curvature='reparam' is estimated from the sampling noise and needs "
                "deterministic=False; with deterministic=True use 'hessian', 'ggn' or 'ef'."
            )
        if deterministic and num_particles != 1:
            raise ValueError("deterministic=True evaluates at the mean: use num_particles=1")
        if not isinstance(antithetic, bool):
            raise ValueError(f"antithetic must be True or False, got {antithetic!r}")
        if deterministic and antithetic:
            raise ValueError("antithetic=True pairs sampled draws eps, -eps: it needs deterministic=False")
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting)
        self.curvature = curvature
        self.deterministic = deterministic
        self.mc_samples = mc_samples
        self.antithetic = antithetic
        # prior params found to enter the model outside conjugate priors (no closed form)
        self._shared_prior_params = set()

    #: :class:`~pyro_ngvi.NGVI` takes the statistics of an ELBO that says so (others'
    #: steps leave nothing it could take).
    produces_curvature = True

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError("CurvatureELBO traces model and guide in loss_and_grads")

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO, estimated exactly as :class:`~pyro.infer.Trace_ELBO` does."""
        elbo = Trace_ELBO(num_particles=self.num_particles, max_plate_nesting=self.max_plate_nesting)
        return elbo.loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """
        Estimate the loss, attach a :class:`~pyro_ngvi.family.SiteCurvature` to every
        guide site's ``loc`` and set ``.grad`` of the other parameters.

        An exception in any particle leaves no ``.grad`` and no statistics behind,
        and undoes the side effects registered for the step (a
        :class:`~pyro_ngvi.BayesianNet`'s BatchNorm running statistics).

        :raises RuntimeError: when run by an ``SVI`` whose optimizer is not
            :class:`~pyro_ngvi.NGVI` (any other would find no ``.grad`` on the
            guide and train nothing).
        """
        svi = calling_svi("loss_and_grads", self.loss_and_grads)
        if svi is not None and not getattr(svi.optim, "consumes_curvature", False):
            raise RuntimeError(
                "CurvatureELBO hands its gradient and curvature to pyro_ngvi.NGVI only; this "
                f"SVI's optimizer is {type(svi.optim).__name__}, which would find no .grad on "
                "the guide and train nothing. Use NGVI, or Trace_ELBO with this optimizer."
            )
        begin_handover()
        try:
            return self._loss_and_grads(model, guide, args, kwargs)
        except BaseException:
            end_handover(accepted=False)  # undo the evaluation's side effects
            raise

    def _loss_and_grads(self, model, guide, args, kwargs) -> float:
        if self.curvature in getattr(model, "curvature_sources", ()) and not self.antithetic:  # own fast path
            loss = model.curvature_step(
                guide, *args, curvature=self.curvature, num_particles=self.num_particles,
                deterministic=self.deterministic, mc_samples=self.mc_samples, **kwargs,
            )
            return float(loss)
        if isinstance(guide, AutoMultivariateNormal):
            if self.antithetic:
                raise NotImplementedError("antithetic=True pairs the draws of mean-field guides "
                                          "(AutoNormal); use it without for AutoMultivariateNormal")
            return self._full_loss_and_grads(model, guide, args, kwargs)
        _check_guide(guide, model, args, kwargs)
        totals: Dict[str, List[torch.Tensor]] = {}
        priors = {}
        point_grads: Dict[int, List] = {}  # id -> [param, grad]: written once all particles ran
        loss = 0.0
        draws = 2 * self.num_particles if self.antithetic else self.num_particles
        guide_trace = None
        for i in range(draws):
            mirror = guide_trace if self.antithetic and i % 2 else None  # eps, then -eps
            particle_loss, stats, particle_priors, guide_trace = self._particle_with_priors(
                model, guide, args, kwargs, point_grads, mirror)
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
        sampled = self.curvature == "reparam"
        hints = getattr(model, "statistics_hints", None)  # a model's own word on its statistics
        for name, (grad, curvature, count, eps, eps_sq, *objective) in totals.items():
            touched = count > 0
            denominator = count.clamp(min=1)
            prior_loc, prior_precision, learned = priors.get(name, (None, None, None))
            learned = learned or {}
            hinted = {} if hints is None else hints(name, self.deterministic)
            attach_curvature(
                store._params[f"{guide._pyro_name}.locs.{name}"],
                SiteCurvature(
                    grad / denominator,
                    curvature / denominator,
                    prior_loc,
                    prior_precision,
                    None if bool(touched.all()) else touched,
                    sampled=sampled,
                    prior_loc_param=learned.get("loc"),
                    prior_scale_param=learned.get("scale"),
                    prior_weight=learned.get("weight", 1.0),
                    # the draws, for NGVI's control variate (untouched rows: eps 0, eps^2 1)
                    eps_mean=eps / denominator if sampled else None,
                    eps_sq_mean=torch.where(touched, eps_sq / denominator, 1.0) if sampled else None,
                    # deterministic (one draw, at the mean): the merit of NGVI's Newton safeguard
                    objective=objective[0] if objective else None,
                    loss=loss,
                    **hinted,
                ),
            )
        return loss

    def _particle_with_priors(self, model, guide, args, kwargs, point_grads, mirror=None):
        """:meth:`_particle`, again without closed-form learning of a prior param
        found to enter the model elsewhere (nothing was written before that was found)."""
        while True:
            try:
                return self._particle(model, guide, args, kwargs, point_grads, mirror)
            except _SharedPriorParams as shared:
                self._shared_prior_params.update(shared.names)
                warnings.warn(
                    f"The prior param(s) {', '.join(repr(n) for n in shared.names)} also enter the "
                    "model outside conjugate Normal priors, so the ELBO has no closed-form "
                    "maximiser in them: they are trained by NGVI's point optimizer from their "
                    "gradient, and the priors they set are handled as non-conjugate.",
                    UserWarning,
                    stacklevel=4,
                )

    # ------------------------------------------------------------------ one particle
    def _particle(self, model, guide, args, kwargs, point_grads, mirror=None):
        """One draw: ``mirror`` is the guide trace of the previous draw, whose
        :math:`\\epsilon` this one negates (the antithetic partner)."""
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs) if mirror is None else mirror
        leaves, latents = {}, {}
        for name, site in guide.prototype_trace.iter_stochastic_nodes():
            aux = guide_trace.nodes[name + "_unconstrained"]
            normal = aux["fn"].base_dist if hasattr(aux["fn"], "base_dist") else aux["fn"]
            u = normal.loc if self.deterministic else aux["value"]
            if mirror is not None:  # mu - sigma eps
                u = 2 * normal.loc - u
            leaf = u.detach().requires_grad_()
            transform = biject_to(site["fn"].support)
            guide_trace.nodes[name]["value"] = transform(leaf)
            leaves[name] = leaf
            latents[name] = (normal.loc.detach(), normal.scale.detach(), transform, aux)
        # per-example sources may rerun the model (BatchNorm): with the same random state
        rng_state = _torch_rng_state() if self.curvature in _PER_EXAMPLE else None
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        _check_unguided(model_trace, leaves)
        model_trace.compute_log_prob()

        likelihood, prior_terms, conjugate, site_scale = [], [], {}, {}
        learned = {}  # site -> {"loc": PriorParam, "scale": PriorParam, "weight", "full": (m0, lam0)}
        params = None  # the model's params a prior may be, found when first needed
        observed = []
        for name, site in model_trace.nodes.items():
            if site["type"] != "sample":
                continue
            if site["is_observed"]:
                if site["infer"].get("_deterministic"):
                    continue  # pyro.deterministic: a recorded value, no log-density
                if self.max_plate_nesting < math.inf:
                    check_site_shape(site, self.max_plate_nesting)
                likelihood.append(site["log_prob_sum"])
                observed.append(site)
                continue
            if name not in leaves:
                continue
            scale = _scalar_scale(site)
            site_scale[name] = scale
            leaf = leaves[name]
            transform = latents[name][2]
            log_det = transform.log_abs_det_jacobian(leaf, site["value"])
            parts = conjugate_normal_parts(site["fn"], guide.prototype_trace.nodes[name]["fn"].support)
            hyper = None
            if parts is not None and (parts[0].requires_grad or parts[1].requires_grad):
                if params is None:
                    params = self._prior_param_candidates(model_trace, guide)
                hyper = self._learned_prior(name, *parts, params, guide)
            if parts is not None and (hyper is not None or not (parts[0].requires_grad or parts[1].requires_grad)):
                conjugate[name] = (parts[0].detach().expand_as(leaf), parts[1].detach().pow(-2).expand_as(leaf))
                if hyper is not None:
                    hyper["weight"] = scale * leaf.numel() / hyper["full"][0].numel()
                    learned[name] = hyper
            else:
                prior_terms.append(site["log_prob_sum"] + scale * log_det.sum())
        nonconjugate_prior = -sum(prior_terms) if prior_terms else None
        nll = -sum(likelihood) if likelihood else None
        objective = _add(nll, nonconjugate_prior)

        names = list(leaves)
        inputs = [leaves[n] for n in names]
        others = _other_params(model_trace, guide_trace, guide)
        if objective is None:
            grads = [torch.zeros_like(x) for x in inputs]
            other_grads = []
        else:
            all_grads = torch.autograd.grad(
                objective, inputs + others, allow_unused=True, retain_graph=True
            )
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(all_grads[: len(inputs)], inputs)]
            other_grads = all_grads[len(inputs):]
        hyper_names = {id(p.unconstrained): p.name for hyper in learned.values()
                       for p in (hyper.get("loc"), hyper.get("scale")) if p is not None}
        shared = sorted({hyper_names[id(p)] for p, g in zip(others, other_grads)
                         if g is not None and id(p) in hyper_names})
        if shared:  # before anything is written
            raise _SharedPriorParams(shared)
        if rng_state is not None and uses_batch_statistics([site["log_prob_sum"] for site in observed]):
            observed = self._frozen_rerun(model, model_trace, observed, rng_state, args, kwargs)
        for p, g in zip(others, other_grads):
            if g is not None:
                g = g.detach() / self.num_particles
                if id(p) in point_grads:
                    point_grads[id(p)][1] = point_grads[id(p)][1] + g
                else:
                    point_grads[id(p)] = [p, g]
        curvatures = self._curvature(objective, nll, nonconjugate_prior, observed, inputs, names, latents, grads)

        stats, priors = {}, {}
        for name, leaf, grad, curvature in zip(names, inputs, grads, curvatures):
            scale = site_scale.get(name, 1.0)
            grad, curvature = grad.detach() / scale, curvature.detach() / scale
            full_grad, count = _scatter_rows(grad, guide, name, guide_trace)
            full_curvature, _ = _scatter_rows(curvature, guide, name, guide_trace)
            loc, sigma = latents[name][:2]
            eps = (leaf.detach() - loc) / sigma
            stats[name] = [full_grad, full_curvature, count,
                           _scatter_rows(eps, guide, name, guide_trace)[0],
                           _scatter_rows(eps.square(), guide, name, guide_trace)[0]]
            if name in learned:  # full-size: constant along any subsampled plate
                m0, lam0 = learned[name].pop("full")
                priors[name] = (m0, lam0, learned[name])
            elif name in conjugate:
                m0, lam0 = (_scatter_rows(t, guide, name, guide_trace, fill=1.0)[0] for t in conjugate[name])
                priors[name] = (m0, lam0, None)

        with torch.no_grad():
            loss = -float(sum(site["log_prob_sum"] for site in model_trace.nodes.values()
                              if site["type"] == "sample"))
            # at the mean: F(mu) = -log p(x, T(mu)) - log|det J_T(mu)|, NGVI's safeguard's merit
            negative_log_joint = loss
            for name, (loc, scale, transform, aux) in latents.items():
                s = site_scale.get(name, 1.0)
                leaf = leaves[name]
                log_det = transform.log_abs_det_jacobian(leaf, guide_trace.nodes[name]["value"]).sum()
                negative_log_joint -= s * float(log_det)
                if self.deterministic and name in conjugate:
                    # at the mean, a conjugate site's log q - log p is replaced by its
                    # expectation, KL(q || p0) in closed form (as on the fast path)
                    loss += float(model_trace.nodes[name]["log_prob_sum"])
                    loss += s * float(_normal_kl(loc, scale, *conjugate[name]))
                    continue
                log_q = aux["fn"].log_prob(leaf).sum()
                loss += s * float(log_q - log_det)
        if self.deterministic and not _subsampled(model_trace):
            for values in stats.values():
                values.append(negative_log_joint)
        return loss, stats, priors, guide_trace

    def _prior_param_candidates(self, model_trace, guide) -> Dict[str, torch.Tensor]:
        """The model's ``pyro.param`` values a prior's loc or scale may be (learnable ones only)."""
        prefix = guide._pyro_name + "."
        store = pyro.get_param_store()
        return {
            name: site["value"] for name, site in model_trace.nodes.items()
            if site["type"] == "param" and not name.startswith(prefix)
            and name not in self._shared_prior_params
            and learnable_constraint(store._constraints.get(name, constraints.real))
        }

    def _learned_prior(self, name, loc, scale, params, guide):
        """
        The :class:`~pyro_ngvi.family.PriorParam` s of a conjugate prior whose
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

    def _frozen_rerun(self, model, model_trace, observed, rng_state, args, kwargs):
        """
        The observed sites of a second run of the model, replaying ``model_trace``
        (the same latent values, subsamples) from the random state the first run
        started with (the same dropout masks), under
        :func:`~pyro_ngvi.curvature.batch_norm.frozen_batch_statistics`: the
        likelihood of the network whose ``BatchNorm`` layers hold the minibatch's
        statistics fixed, per-example separable, for the per-example curvature.
        """
        state_after = _torch_rng_state()
        _set_torch_rng_state(rng_state)
        try:
            with frozen_batch_statistics():
                trace = poutine.trace(poutine.replay(model, trace=model_trace)).get_trace(*args, **kwargs)
        finally:
            _set_torch_rng_state(state_after)
        observed = [trace.nodes[site["name"]] for site in observed]
        trace.compute_log_prob()
        if uses_batch_statistics([site["log_prob_sum"] for site in observed]):
            raise NotImplementedError(
                f"curvature='{self.curvature}' needs per-example terms, but the model normalises "
                "with minibatch statistics outside torch.nn.functional.batch_norm (e.g. "
                "torch.batch_norm called directly), which cannot be frozen. Use nn.BatchNorm* "
                "or F.batch_norm, or curvature='hessian' or 'reparam'."
            )
        return observed

    def _curvature(self, objective, nll, nonconjugate_prior, observed, inputs, names, latents, grads):
        if self.curvature == "reparam":
            return [g * (x - loc) / scale.square() for g, x, (loc, scale, _, _) in
                    zip(grads, inputs, (latents[n] for n in names))]
        if self.curvature == "hessian":
            if objective is None:
                return [torch.zeros_like(x) for x in inputs]
            return diag_hessian(objective, inputs)
        curvatures = [torch.zeros_like(x) for x in inputs]
        if nonconjugate_prior is not None:
            curvatures = diag_hessian(nonconjugate_prior, inputs)
        for site in observed:
            data_dim, scale = _data_dim(site, self.curvature), _scalar_scale(site)
            fn = site["fn"]
            if self.curvature == "ef":
                terms = -per_example_log_prob(fn, site["value"], data_dim)
                site_curvature = [scale * h for h in empirical_fisher_diag(terms, inputs)]
            elif self.curvature == "ggn":
                site_curvature = [scale * h for h in ggn_diag(fn, inputs, data_dim)]
            else:
                site_curvature = [scale * h for h in mc_ggn_diag(fn, inputs, data_dim, self.mc_samples)]
            curvatures = [c + h for c, h in zip(curvatures, site_curvature)]
        return curvatures


    # ------------------------------------------------------ full covariance
    def _full_loss_and_grads(self, model, guide, args, kwargs) -> float:
        """
        :meth:`loss_and_grads` for an :class:`~pyro.infer.autoguide.AutoMultivariateNormal`:
        one :class:`~pyro_ngvi.family.SiteCurvature` for its whole latent vector ``z``
        (``D`` coordinates), with :math:`g = \\nabla_z \\ell` and a dense
        ``(D, D)`` curvature (:mod:`pyro_ngvi.curvature.dense`; ``"reparam"``: the
        Price estimate :func:`~pyro_ngvi.full_covariance.price_curvature` of
        :math:`\\mathrm{tril}(g\\epsilon^\\top)`, the one NGVI recovers from
        Trace_ELBO's gradients, handed over whitened). Priors that are Gaussian in ``u``
        (:func:`~pyro_ngvi.priors.conjugate_gaussian`) are handed over as the
        blocks of :math:`(m_0, S_0)`; the other sites' blocks of :math:`S_0` are zero.
        """
        if not _is_automultivariatenormal(guide):
            raise NotImplementedError(
                f"CurvatureELBO cannot read the Gaussian of {type(guide).__name__}, a subclass of "
                "AutoMultivariateNormal that changes how it builds its posterior; use Trace_ELBO"
            )
        if guide.prototype_trace is None:
            with poutine.block():
                guide(*args, **kwargs)
        site = _full_covariance_site(guide, pyro.get_param_store())
        grad = curvature = None
        prior = (None, None)
        loss = 0.0
        for _ in range(self.num_particles):
            particle_loss, particle_grad, particle_curvature, prior = self._full_particle(
                model, guide, args, kwargs)
            loss += particle_loss / self.num_particles
            grad = particle_grad if grad is None else grad + particle_grad
            curvature = particle_curvature if curvature is None else curvature + particle_curvature
        attach_curvature(site.loc, SiteCurvature(
            grad / self.num_particles, curvature / self.num_particles, *prior,
            sampled=self.curvature == "reparam", whitened=self.curvature == "reparam",
        ))
        return loss

    def _full_particle(self, model, guide, args, kwargs):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        latent = guide_trace.nodes[f"_{guide._pyro_name}_latent"]
        posterior = latent["fn"]
        loc, factor = posterior.loc.detach(), posterior.scale_tril.detach()
        z = (loc if self.deterministic else latent["value"]).detach().clone().requires_grad_()
        blocks, position = {}, 0
        for prototype, u in guide._unpack_latent(z):
            name = prototype["name"]
            transform = biject_to(prototype["fn"].support)
            guide_trace.nodes[name]["value"] = transform(u)
            blocks[name] = (slice(position, position + u.numel()), u, transform, prototype["fn"].support)
            position += u.numel()
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        _check_unguided(model_trace, blocks)
        model_trace.compute_log_prob()

        size = z.numel()
        prior_loc, prior_precision = z.new_zeros(size), z.new_zeros(size, size)
        conjugate = []
        likelihood, prior_terms, observed = [], [], []
        for name, node in model_trace.nodes.items():
            if node["type"] != "sample":
                continue
            if node["is_observed"]:
                if node["infer"].get("_deterministic"):
                    continue
                if self.max_plate_nesting < math.inf:
                    check_site_shape(node, self.max_plate_nesting)
                likelihood.append(node["log_prob_sum"])
                observed.append(node)
                continue
            if name not in blocks:
                continue
            block, u, transform, support = blocks[name]
            prior = conjugate_gaussian(node["fn"], support)
            if prior is not None and not (prior[0].requires_grad or prior[1].requires_grad) \
                    and _scalar_scale(node) == 1.0:
                prior_loc[block] = prior[0].detach()
                prior_precision[block, block] = prior[1].detach()
                conjugate.append(name)
            else:
                log_det = transform.log_abs_det_jacobian(u, node["value"])
                prior_terms.append(node["log_prob_sum"] + _scalar_scale(node) * log_det.sum())
        nonconjugate_prior = -sum(prior_terms) if prior_terms else None
        nll = -sum(likelihood) if likelihood else None
        objective = _add(nll, nonconjugate_prior)

        others = _other_params(model_trace, guide_trace, guide)
        if objective is None:
            grad, other_grads = torch.zeros_like(z), []
        else:
            grad, *other_grads = torch.autograd.grad(objective, [z] + others, allow_unused=True,
                                                     retain_graph=True)
            grad = torch.zeros_like(z) if grad is None else grad
        for p, g in zip(others, other_grads):
            if g is not None:
                g = g.detach() / self.num_particles
                p.grad = g if p.grad is None else p.grad + g
        curvature = self._full_curvature(objective, nonconjugate_prior, observed, z, grad, loc, factor)
        prior = (prior_loc, prior_precision) if conjugate else (None, None)

        with torch.no_grad():
            if self.deterministic:  # l(mu) - H(q) + the conjugate blocks' cross-entropy
                loss = 0.0 if objective is None else float(objective)
                loss -= float(posterior.entropy())
                if conjugate:
                    loss += float(_gaussian_cross_entropy(loc, factor, prior_loc, prior_precision,
                                                          [blocks[n][0] for n in conjugate]))
            else:
                loss = -float(sum(node["log_prob_sum"] for node in model_trace.nodes.values()
                                  if node["type"] == "sample"))
                loss += float(posterior.log_prob(z))
                for name, (_, u, transform, _) in blocks.items():
                    value = guide_trace.nodes[name]["value"]
                    loss -= float(transform.log_abs_det_jacobian(u, value).sum())
        return loss, grad.detach(), curvature, prior

    def _full_curvature(self, objective, nonconjugate_prior, observed, z, grad, loc, factor):
        """The dense curvature of the non-conjugate part :math:`\\ell` at ``z``."""
        size = z.numel()
        if self.curvature == "reparam":
            noise = torch.linalg.solve_triangular(factor, (z.detach() - loc).unsqueeze(-1),
                                                  upper=False).squeeze(-1)
            return whitened_price_curvature(factor, torch.outer(grad.detach(), noise).tril())
        if objective is None:
            return z.new_zeros(size, size)
        if self.curvature == "hessian":
            return hessian_matrix(objective, z)
        curvature = z.new_zeros(size, size)
        if nonconjugate_prior is not None:
            curvature = hessian_matrix(nonconjugate_prior, z)
        for node in observed:
            data_dim, scale = _data_dim(node, self.curvature), _scalar_scale(node)
            if self.curvature == "ef":
                terms = -per_example_log_prob(node["fn"], node["value"], data_dim)
                curvature = curvature + scale * empirical_fisher_matrix(terms, z)
            elif self.curvature == "ggn":
                curvature = curvature + scale * ggn_matrix(node["fn"], z, data_dim)
            else:
                curvature = curvature + scale * mc_ggn_matrix(node["fn"], z, data_dim, self.mc_samples)
        return curvature


def _gaussian_cross_entropy(loc, factor, prior_loc, prior_precision, blocks) -> torch.Tensor:
    """:math:`-E_q[\\log p_0(u_c)]` summed over the conjugate blocks ``c``:
    :math:`\\tfrac12[\\mathrm{tr}(S_0 \\Sigma_{cc}) + (\\mu_c - m_0)^\\top S_0 (\\mu_c - m_0)
    - \\log\\det S_0 + d_c \\log 2\\pi]`."""
    covariance = factor @ factor.T
    total = loc.new_zeros(())
    for block in blocks:
        precision = prior_precision[block, block]
        offset = loc[block] - prior_loc[block]
        total = total + 0.5 * ((precision * covariance[block, block]).sum() + offset @ precision @ offset
                               - torch.logdet(precision) + offset.numel() * math.log(2 * math.pi))
    return total


#: Sources summing per-example terms over a data plate.
_PER_EXAMPLE = ("ef", "ggn", "ggn_mc")


def _torch_rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_torch_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class _SharedPriorParams(Exception):
    """A learned prior param also enters the model elsewhere (see :meth:`CurvatureELBO._particle_with_priors`)."""

    def __init__(self, names):
        super().__init__(names)
        self.names = names


def _subsampled_dims(guide, name):
    """``(frame, dim, full size)`` of each subsampled plate of a guide site (``dim``
    counted from the right of the site's value, event dims included)."""
    event_dim = guide._event_dims[name]
    for frame in guide.prototype_trace.nodes[name]["cond_indep_stack"]:
        full_size = frame.full_size or frame.size
        if frame.vectorized and full_size != frame.size:
            yield frame, frame.dim - event_dim, full_size


def _full_rows(tensor, guide, name):
    """
    ``tensor`` (a site's prior, shaped like its minibatch rows) for all rows of
    every subsampled plate, when it is constant along them (size 1 or stride 0
    there, as a broadcast param is); ``None`` when it varies along one.
    """
    for _, dim, full_size in _subsampled_dims(guide, name):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != 0:
            return None
        shape = list(tensor.shape)
        shape[dim] = full_size
        tensor = tensor.narrow(dim, 0, 1).expand(shape)
    return tensor


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _scalar_scale(site) -> float:
    scale = site["scale"]
    if torch.is_tensor(scale):
        if scale.numel() != 1:
            raise NotImplementedError(
                f"CurvatureELBO needs a scalar scale at site '{site['name']}', got a tensor of "
                f"shape {tuple(scale.shape)}"
            )
        scale = float(scale)
    return float(scale)


def _data_dim(site, curvature) -> int:
    """The plate dimension that indexes examples of an observed site."""
    frames = [f for f in site["cond_indep_stack"] if f.vectorized]
    if not frames:
        raise ValueError(
            f"curvature='{curvature}' sums per-example terms over a data plate, but the "
            f"observed site '{site['name']}' is in no pyro.plate. Put the observations in "
            "`with pyro.plate('data', N):`, or use curvature='hessian' or 'reparam'."
        )
    subsampled = [f for f in frames if f.full_size is not None and f.full_size != f.size]
    frame = (subsampled or sorted(frames, key=lambda f: -f.size))[0]
    return frame.dim


def _scatter_rows(values, guide, name, guide_trace, fill=0.0):
    """Place a subsampled site's rows into a full-size tensor; count touched rows."""
    full = values
    count = torch.ones_like(values)
    for frame, dim, full_size in _subsampled_dims(guide, name):
        index = guide_trace.nodes[frame.name]["value"]
        shape = list(full.shape)
        shape[dim] = full_size
        full = torch.full(shape, fill, dtype=values.dtype, device=values.device).index_copy(dim, index, full)
        count = torch.zeros(shape, dtype=values.dtype, device=values.device).index_copy(dim, index, count)
    return full, count


def _other_params(model_trace, guide_trace, guide) -> List[torch.Tensor]:
    """Unconstrained parameters that are not the guide's locs and scales."""
    prefix = guide._pyro_name + "."
    params = {}
    for trace in (model_trace, guide_trace):
        for name, site in trace.nodes.items():
            if site["type"] == "param" and not name.startswith(prefix):
                value = site["value"].unconstrained()
                params[id(value)] = value
    return [p for p in params.values() if p.requires_grad]


def _check_guide(guide, model, args, kwargs):
    if not isinstance(guide, AutoNormal):
        raise NotImplementedError(
            f"CurvatureELBO supports AutoNormal and AutoMultivariateNormal guides, got "
            f"{type(guide).__name__}. For AutoDiagonalNormal or an AutoGuideList use Trace_ELBO "
            "with NGVI (reparam curvature)."
        )
    if guide.prototype_trace is None:
        with poutine.block():
            guide(*args, **kwargs)


def _subsampled(model_trace) -> bool:
    """Whether any site is under a subsampled plate (then F at the mean changes with
    the minibatch, and values of two steps cannot be compared)."""
    return any(frame.full_size is not None and frame.full_size != frame.size
               for site in model_trace.nodes.values() if site["type"] == "sample"
               for frame in site["cond_indep_stack"])


def _check_unguided(model_trace, guided) -> None:
    """
    Refuse a model with a latent site the guide does not cover (a discrete site
    marked for enumeration, or any other): CurvatureELBO neither enumerates nor
    samples such sites, and running the model would draw them from the prior every
    step, a silently wrong answer.
    """
    unguided = [name for name, site in model_trace.nodes.items()
                if site["type"] == "sample" and not site["is_observed"] and name not in guided
                and not site_is_subsample(site)]
    if not unguided:
        return
    enumerated = [name for name in unguided if model_trace.nodes[name]["infer"].get("enumerate")]
    if enumerated:
        raise NotImplementedError(
            f"CurvatureELBO does not enumerate discrete sites: {', '.join(map(repr, enumerated))} "
            "is marked for enumeration (config_enumerate) and has no guide site. Train it with "
            "NGVI and pyro.infer.TraceEnum_ELBO(max_plate_nesting=...), which sums it out "
            "(NGVI then uses the reparameterisation curvature of the continuous sites)."
        )
    raise NotImplementedError(
        f"CurvatureELBO needs a guide site for every latent site of the model; "
        f"{', '.join(map(repr, unguided))} has none (the guide must cover all latent sites, "
        "as AutoNormal does for continuous ones). Discrete sites can be summed out with "
        "config_enumerate and pyro.infer.TraceEnum_ELBO."
    )


def _normal_kl(loc, scale, prior_loc, prior_precision) -> torch.Tensor:
    """:math:`\\sum \\mathrm{KL}(\\mathcal{N}(\\mu, \\sigma^2) \\| \\mathcal{N}(m_0, \\lambda_0^{-1}))
    = \\sum [\\tfrac12 \\lambda_0 (\\sigma^2 + (\\mu - m_0)^2) - \\tfrac12 \\log(\\lambda_0 \\sigma^2) - \\tfrac12]`."""
    variance = scale.square()
    return 0.5 * (prior_precision * (variance + (loc - prior_loc).square())
                  - (prior_precision * variance).log() - 1.0).sum()
