"""
The fast path of :class:`~pyro_ngvi.BayesianNet` (:class:`FastPath`, the
protocol :class:`~pyro_ngvi.CurvatureELBO` calls): what the ELBO does for the net
and an :class:`~pyro.infer.autoguide.AutoNormal` guide, without Pyro's tracing
(:class:`BackpackStep`). Per particle :math:`w = \\mu + \\sigma\\epsilon` is written
into the network, one backward pass of its BackPACK twin (:mod:`.twin`) gives
:math:`g = \\nabla_w \\ell` and the curvature :math:`h` of every weight tensor
(``reparam``: :math:`h = g\\,\\epsilon/\\sigma`), and the particle averages are
handed to :class:`~pyro_ngvi.NGVI` as a :class:`~pyro_ngvi.handover.SiteCurvature` per
site, with the value of :mod:`.value`. A :class:`~pyro_ngvi.kronecker.KroneckerNormal`
guide takes the path of :mod:`.kronecker_step`.
"""

from functools import partial
from typing import List, NamedTuple, Optional, Tuple

import torch

import pyro

from ..curvature.backpack import network_curvature
from ..family import SiteCurvature, scale_transform
from ..handover import attach_curvatures
from ..kronecker import KroneckerNormal
from ..hot_path import no_grad, same, scalar
from ..scales import FastExp, known_scales, sum_log_scales
from .kept_step import KeptStep
from .kronecker_step import KroneckerStep
from .twin import LOSS_MODULES, BackpackTwin, accumulate_grad
from .value import full_nll, kl, log_ratio

def _one_dtype(tensors: List[torch.Tensor]) -> bool:
    """Whether the tensors share one dtype."""
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            return False
    return True


def _all_in(names: List[str], params: dict) -> bool:
    """Whether the param store's dict ``params`` holds all ``names``."""
    for name in names:
        if name not in params:
            return False
    return True


class GuideReading(NamedTuple):
    """What :meth:`BackpackStep._read_guide` reads of a guide, kept while it stands: the guide
    and its name, the net's latent parameter list, ``(name, tensor, constraint, weight)`` of each
    loc and raw scale in the param store, the loc names, the raw scale tensors, ``(constraint,
    transform)`` per site and which of those transforms are :class:`~pyro_ngvi.scales.FastExp`."""

    guide: object
    name: str
    latent_params: list
    entries: list
    loc_names: List[str]
    raws: List[torch.Tensor]
    transforms: list
    exps: List[bool]


class BackpackStep(BackpackTwin):
    """
    A BackPACK-extended twin of ``net`` and its loss module; calling it runs one
    ELBO step of a :class:`~pyro_ngvi.BayesianNet` (see :meth:`__call__`).

    :param torch.nn.Module net: the plain network (its parameter and buffer dicts
        are shared, not copied).
    :param str likelihood: a key of :data:`~pyro_ngvi.nn.twin.LOSS_MODULES`.
    """

    #: Curvature sources the fast path serves.
    sources = ("ef", "ggn", "ggn_mc", "reparam")

    def __init__(self, net, likelihood: str):
        super().__init__(net, likelihood)
        self._kronecker_step = KroneckerStep(self)
        self._guide_names = {}  # id(guide) -> (its name, loc names, scale names, transforms, their constraints, exps)
        self._plain_loss = LOSS_MODULES[likelihood](reduction="sum")  # (a plain backward needs no hooks)
        self._buffers = {}  # name -> a tensor per site reused every step (the draws, the reparam curvature)
        self._plans = {}  # the closed-form plans of the net and its twin (pyro_ngvi.curvature.mlp.planned)
        self._served = None  # the guide serves() took last
        self._order = None  # (latents, point estimates, whether the latents are all the params in order)
        self._read = None  # the last step's reading of the guide (_read_anew), while it stands
        self._kept = None  # the last full step's decisions, replayed straight-line while they stand (KeptStep)

    def __getstate__(self) -> dict:
        """What a pickle or a copy keeps: all but what the next step rebuilds (the closed-form plans
        hold the activations' functions, the kept readings and step refer to a guide and the param
        store), so that a trained :class:`~pyro_ngvi.BayesianNet` pickles (``torch.save(bnn)``)."""
        state = self.__dict__.copy()
        state.update(_plans={}, _guide_names={}, _served=None, _order=None, _read=None, _kept=None)
        return state

    def __call__(self, model, guide, x: torch.Tensor, y: torch.Tensor, curvature: str, num_particles: int = 1,
                 deterministic: bool = False, mc_samples: int = 1) -> torch.Tensor:
        """:meth:`pyro_ngvi.BayesianNet.curvature_step` of ``model`` (see there for the
        estimates and the value returned); a step whose decisions are those of the last full
        step (:class:`~pyro_ngvi.nn.kept_step.KeptStep`'s guards) replays them straight-line."""
        kept = self._kept
        if kept is not None:
            loss = kept.run(self, model, guide, x, y, curvature, num_particles, deterministic, mc_samples)
            if loss is not None:
                return loss
        self._kept = None
        if guide is not self._served and isinstance(guide, KroneckerNormal):  # (served: an AutoNormal)
            return self._kronecker_step(model, guide, x, y, curvature, num_particles, deterministic, mc_samples)
        self._check_step(guide, y, curvature, deterministic)
        batch = model._check_batch(x, y, step=True)
        locs, raws, stddevs = self._read_guide(model, guide, x, y)
        points, noise_scale, loss_scale = self.begin(model)
        prior = model._weight_prior()
        target = self.loss_target(model, y)
        source = "none" if curvature == "reparam" else curvature
        in_order = self._in_order(model)
        grads: List[torch.Tensor] = []
        curvatures: List[torch.Tensor] = []
        point_grads: List[torch.Tensor] = []
        nll, sample_log_ratio = 0.0, 0.0
        draws = None  # reparam: the sum over particles of eps and eps^2, for NGVI's control variate
        for particle in range(num_particles):
            noises = self._sample_into_net(model, locs, stddevs, deterministic)
            if curvature == "reparam":
                if draws is None:  # (one particle: the draws themselves, not changed below)
                    draws = [[n.clone() if num_particles > 1 else n for n in noises],
                             list(torch._foreach_mul(noises, noises))]  # (eps^2: one call for all sites)
                else:
                    torch._foreach_add_(draws[0], noises)
                    torch._foreach_addcmul_(draws[1], noises, noises)
            result = network_curvature(  # (reparam: a plain backward, on the plain network)
                self.net if source == "none" else self.twin, self._plain_loss if source == "none" else self.loss_module,
                x, target, source,
                mc_samples=mc_samples, loss_scale=loss_scale,
                params=self.params,
                check_output=partial(model._check_targets, y, source=curvature) if particle == 0 else None,
                plans=self._plans,
            )
            site_grads = result.grads if in_order else [result.grads[w.index] for w in model._latents]
            if curvature == "reparam":  # h = g eps / sigma (the first particle's into buffers kept for it;
                # three calls for all sites, not two per site: on a GPU every call is a kernel launch)
                site_curvatures = (list(self._buffers_like("curvature", site_grads))
                                   if particle == 0 else [torch.empty_like(g) for g in site_grads])
                torch._foreach_copy_(site_curvatures, site_grads)
                torch._foreach_mul_(site_curvatures, noises)
                torch._foreach_div_(site_curvatures, stddevs)
            else:
                site_curvatures = (result.curvatures if in_order
                                   else [result.curvatures[w.index] for w in model._latents])
            site_point_grads = [result.grads[w.index] for w in model._point_estimates] if not in_order else []
            if particle == 0:  # fresh tensors, ours to scale in place below
                grads, curvatures, point_grads = site_grads, site_curvatures, site_point_grads
            else:
                torch._foreach_add_(grads, site_grads)
                torch._foreach_add_(curvatures, site_curvatures)
                if point_grads:
                    torch._foreach_add_(point_grads, site_point_grads)
            # (the first particle's terms as they are: no 0-d kernel adding them to 0)
            nll = result.loss if particle == 0 else nll + result.loss
            if not deterministic:
                ratio = log_ratio(prior, model._latent_params, noises)
                sample_log_ratio = ratio if particle == 0 else sample_log_ratio + ratio

        # full-data scale N/B and particle average
        num_data = model.effective_num_data
        factor = num_data / batch / num_particles
        # (by a 0-d tensor of their dtype, where they share one: a Python float is cast for every tensor)
        scaled = grads + curvatures
        by = factor
        if grads:
            dtype = grads[0].dtype
            for t in scaled:  # (inline: _one_dtype)
                if t.dtype is not dtype:
                    break
            else:
                by = scalar(factor, grads[0])
        torch._foreach_mul_(scaled, by)  # (one call for both)
        if draws is not None and num_particles > 1:
            for d in draws:
                torch._foreach_div_(d, num_particles)
        mean_nll = nll / num_particles if num_particles > 1 else nll
        nll = full_nll(num_data, mean_nll, loss_scale, noise_scale, target, batch)
        loss = _value(nll, sample_log_ratio, raws, locs, stddevs, self._read.exps, prior,
                      num_particles, deterministic)
        self._hand_over(model, locs, stddevs, grads, curvatures, draws, prior, curvature, deterministic, loss)
        for value, grad in zip(points, point_grads):
            accumulate_grad(value.unconstrained(), grad.mul_(factor))
        self._kept = KeptStep.record(self, model, guide, x, y, curvature, num_particles, deterministic, mc_samples,
                                     in_order, points, loss_scale, by, batch, _value.__wrapped__)
        return loss

    def _in_order(self, model) -> bool:
        """Whether the latent sites are the network's trainable parameters, all of them, in order
        (then a pass's lists of gradients and curvatures are the sites'), decided once per model."""
        kept = self._order
        if kept is None or kept[0] is not model._latents or kept[1] is not model._point_estimates:
            indices = [w.index for w in model._latents]
            kept = self._order = (model._latents, model._point_estimates,
                                  not model._point_estimates and indices == list(range(len(indices))))
        return kept[2]

    def _hand_over(self, model, locs, stddevs, grads, curvatures, draws, prior, curvature, deterministic, loss):
        """Attach :math:`g, h` (and the draws' moments, the prior, the model's
        statistics hints) to each site's unconstrained ``loc``."""
        eps_means, eps_sq_means = draws if draws is not None else ([None] * len(locs), [None] * len(locs))
        floors = None
        if model.noise_limit_mode == "mean" and not deterministic:  # (a family that moves with its means:
            floors, loss = model._mean_floor(locs), None  # its loss is not one family's, the ELBO watch is not fed)
        hints = model._sites_hints(deterministic, floors)
        handed = [None] * len(locs)
        for j, (loc, grad, curv, stddev) in enumerate(zip(locs, grads, curvatures, stddevs)):
            if grad.dtype != loc.dtype:  # (a net converted, .double(), after its guide was made)
                grad, curv = grad.to(loc.dtype), curv.to(loc.dtype)
                eps_means[j], eps_sq_means[j] = (None if e is None else e.to(loc.dtype)
                                                 for e in (eps_means[j], eps_sq_means[j]))
            stats = SiteCurvature(
                grad=grad,
                curvature=curv,
                prior_loc=prior.site_locs[j],
                prior_precision=prior.site_precisions[j],
                sampled=curvature == "reparam",
                nonnegative=curvature != "reparam",
                scale=stddev,
                prior_scale_param=None if prior.params is None else prior.params[j],
                eps_mean=eps_means[j],
                eps_sq_mean=eps_sq_means[j],
                loss=loss,
                watched=floors is None,
                fitted=True,  # (the net's own tensors: the loc's shape, dtype and device)
                **hints[j],
            )
            handed[j] = stats
        attach_curvatures(locs, handed)

    def _read_guide(self, model, guide, x, y) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
        """
        The guide's unconstrained ``loc`` tensors, read by ``pyro.param``
        statements (which ``SVI.step`` records to hand them to the optimizer), its raw
        scale tensors, and
        :math:`\\sigma` of each site (detached, read-only): the one
        :class:`~pyro_ngvi.NGVI` remembers writing
        (:func:`~pyro_ngvi.scales.known_scale`), else the softplus of the raw
        scale, read from the param store directly (NGVI finds the raw tensors by
        name, and gets :math:`\\sigma` in the :class:`~pyro_ngvi.handover.SiteCurvature`).
        """
        if guide.prototype_trace is None:
            guide(x, y)
        store = pyro.get_param_store()
        params, kept = store._params, self._read
        # the last step's reading, where the guide's name, each tensor and constraint in the store and
        # each weight's shape are as they were (checked by identity, no call each; a guide of the same
        # name reads the same tensors)
        if kept is not None and kept.name == guide._pyro_name and kept.latent_params is model._latent_params:
            constraints = store._constraints
            for name, tensor, constraint, weight in kept.entries:
                if (name not in params or params[name] is not tensor or constraints[name] is not constraint
                        or tensor.shape != weight.shape):
                    kept = None
                    break
        else:
            kept = None
        if kept is None:
            kept = self._read = self._read_anew(model, guide, store)
        locs, raws, transforms = kept.loc_names, kept.raws, kept.transforms
        stddevs = known_scales(raws)
        for j, stddev in enumerate(stddevs):
            if stddev is None:
                with torch.no_grad():
                    stddevs[j] = transforms[j][1](raws[j].detach())
        return read_params(locs), raws, stddevs

    def _read_anew(self, model, guide, store) -> GuideReading:
        """What :meth:`_read_guide` reads of the guide (registering its tensors where the store
        lacks them; refusing a tensor of another shape than its weight)."""
        names = self._guide_names.get(id(guide))
        if names is None or names[0] != guide._pyro_name:
            prefix = guide._pyro_name
            names = self._guide_names[id(guide)] = (
                prefix, [f"{prefix}.locs.{w.site}" for w in model._latents],
                [f"{prefix}.scales.{w.site}" for w in model._latents], None, None, None)
        _, locs, scales, transforms, constraints_then, exps = names
        params = store._params
        if not _all_in(locs + scales, params):
            with guide._pyro_context:  # (re-)registers the guide's own tensors
                for w in model._latents:
                    guide._get_loc_and_scale(w.site)
        raws = [params[name] for name in scales]
        # (the net's weights are model._latent_params: _check_batch refused a step where one was replaced)
        shapes = [p.shape for p in model._latent_params]
        if [params[name].shape for name in locs] != shapes or [raw.shape for raw in raws] != shapes:
            for w, loc_name, scale_name in zip(model._latents, locs, scales):  # (draws go into the net's tensors)
                for name in (loc_name, scale_name):
                    if params[name].shape != w.param.shape:
                        raise ValueError(
                            f"BayesianNet: the param store's '{name}' has shape {tuple(params[name].shape)}, the "
                            f"weight {w.site!r} has {tuple(w.param.shape)}: a guide of another model named "
                            f"{names[0]!r} (or a loaded param store) left it there. Call pyro.clear_param_store(), "
                            "give this guide another name, or set it up with pyro_ngvi.start_task")
        constraints = [store._constraints[name] for name in scales]
        if transforms is None or not same(constraints_then, constraints):
            transforms = [(c, scale_transform(c)) for c in constraints]
            exps = [isinstance(t, FastExp) for _, t in transforms]
            self._guide_names[id(guide)] = names[:3] + (transforms, constraints, exps)
        weights = list(model._latent_params)
        entries = [(name, params[name], store._constraints[name], w) for group in (locs, scales)
                   for name, w in zip(group, weights)]
        return GuideReading(guide, names[0], model._latent_params, entries, locs, raws, transforms, exps)

    @no_grad
    def _sample_into_net(self, model, locs, stddevs, deterministic) -> Optional[List[torch.Tensor]]:
        """
        Draw :math:`\\epsilon` site by site, write :math:`w = \\mu + \\sigma\\epsilon`
        (:math:`\\mu` when ``deterministic``) straight into the net's weights; return
        the draws (``None`` when ``deterministic``).
        """
        if deterministic:
            torch._foreach_copy_(model._latent_params, locs)
            return None
        noises = [noise.normal_() for noise in self._buffers_like("noise", locs)]  # (site by site, in order)
        params = model._latent_params
        torch._foreach_copy_(params, locs)  # (two calls for all sites, not one per site)
        torch._foreach_addcmul_(params, stddevs, noises)
        return noises

    def _buffers_like(self, name: str, likes: List[torch.Tensor]) -> List[torch.Tensor]:
        """Tensors like ``likes`` (one per site) kept for the sites' ``name`` (made once, written
        over every step: a fresh tensor of a large site costs page faults on the CPU); a site whose
        tensor changed shape, dtype or device gets a new one."""
        buffers = self._buffers[name] if name in self._buffers else self._buffers.setdefault(name, [])
        if len(buffers) != len(likes):
            buffers[len(likes):] = []
            buffers += [None] * (len(likes) - len(buffers))
        j = 0  # (a counter, not enumerate: no call)
        for like in likes:
            buffer = buffers[j]
            if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype or buffer.device != like.device:
                buffers[j] = torch.empty_like(like, memory_format=torch.contiguous_format)
            j += 1
        return buffers

    def _check_step(self, guide, y, curvature, deterministic):
        if curvature not in self.sources:
            raise ValueError(
                f"Curvature source {curvature!r} is not available on the BayesianNet "
                "fast path; supported: " + ", ".join(repr(c) for c in self.sources)
            )
        if curvature == "reparam" and deterministic:
            raise ValueError(
                "The 'reparam' curvature g * eps / sigma needs sampled weights; "
                "use deterministic=False or a curvature 'ef', 'ggn', 'ggn_mc'"
            )
        if y is None:
            raise ValueError("curvature_step needs the targets y")
        if guide is not self._served and not serves(guide):
            raise NotImplementedError(
                f"The BayesianNet fast path needs an AutoNormal guide (or a KroneckerNormal), got "
                f"{type(guide).__name__}. For another guide, CurvatureELBO's traced path computes the "
                "statistics by autograd: SVI(bnn, guide, NGVI(), CurvatureELBO(...)) takes it by itself"
            )
        self._served = guide  # (served: not asked again while the step is given this guide)


@no_grad
def _value(nll, sample_log_ratio, raws, locs, stddevs, exps, prior, num_particles, deterministic):
    """:meth:`BackpackStep.__call__`'s value from the particles' ``nll`` and ``sample_log_ratio``
    (their sums) and the guide (``exps``: which sites' sigma is the exponential of the raw scale):
    computed without a graph (no ``detach`` of each term)."""
    log_scale = sum_log_scales(raws, stddevs, exps)  # sum log sigma
    if deterministic:
        return nll + kl(prior, locs, stddevs, log_scale)
    # the particle average of sum [lambda_0 (w - m_0)^2 - eps^2] / 2 - log sigma + log s_0
    if num_particles > 1:
        sample_log_ratio = sample_log_ratio / num_particles
    sample_log_ratio = sample_log_ratio - log_scale + prior.log_scale_total
    return nll + sample_log_ratio


def read_params(names: List[str]) -> List[torch.Tensor]:
    """
    The unconstrained tensors of ``names``, read by ``pyro.param(name)`` statements, so that
    ``SVI.step``'s trace records them (and a user's handler sees them) as any guide's reads.
    """
    return [pyro.param(name).unconstrained() for name in names]


def serves(guide) -> bool:
    """Whether the fast path takes ``guide``: an AutoNormal (or a KroneckerNormal), whose
    locs and scales it reads per site."""
    return isinstance(guide, KroneckerNormal) or (hasattr(guide, "_get_loc_and_scale")
                                                  and hasattr(guide, "prototype_trace"))


class FastPath:
    """
    The fast path :class:`~pyro_ngvi.BayesianNet` offers
    :class:`~pyro_ngvi.CurvatureELBO` (the protocol of :mod:`pyro_ngvi.elbo.protocol`;
    a mixin of the model, which holds its :class:`BackpackStep` as ``_fast_path``).
    """

    #: Curvature sources :meth:`curvature_step` supports.
    curvature_sources = BackpackStep.sources

    def serves_guide(self, guide) -> bool:
        """Whether :meth:`curvature_step` takes ``guide`` (an AutoNormal or a KroneckerNormal);
        :class:`~pyro_ngvi.CurvatureELBO` traces the model for any other (e.g. an
        ``AutoMultivariateNormal``, which ``laplace(..., covariance="full")`` makes)."""
        return serves(guide)

    def curvature_step(
        self,
        guide,
        x: torch.Tensor,
        y: torch.Tensor,
        curvature: str,
        num_particles: int = 1,
        deterministic: bool = False,
        mc_samples: int = 1,
    ) -> torch.Tensor:
        """
        One ELBO step for an :class:`~pyro.infer.autoguide.AutoNormal` guide,
        :math:`q(w) = \\mathcal{N}(\\mu, \\mathrm{diag}(\\sigma^2))`, without tracing.

        For each of ``num_particles`` samples :math:`w = \\mu + \\sigma\\epsilon`,
        :math:`\\epsilon \\sim \\mathcal{N}(0, I)` drawn from torch's global RNG
        (site by site, in :attr:`latent_sites` order; :math:`w = \\mu` when
        ``deterministic``), the negative log-likelihood of the minibatch,
        :math:`\\ell(w) = -\\frac{N}{B}\\sum_{i=1}^B \\log p(y_i \\mid x_i, w)`, gives

        .. math::

            g = \\nabla_w \\ell, \\qquad h = \\begin{cases}
                \\frac{N}{B} \\sum_i (\\nabla_w \\log p(y_i \\mid x_i, w))^2 & \\texttt{ef} \\\\
                \\frac{N}{B} \\,\\mathrm{diag} \\sum_i J_i^\\top H_i J_i & \\texttt{ggn} \\\\
                \\text{the same, } H_i \\text{ from sampled targets} & \\texttt{ggn\\_mc} \\\\
                g \\, \\epsilon / \\sigma & \\texttt{reparam}
            \\end{cases}

        (:math:`J_i` the Jacobian of the output, :math:`H_i` the Hessian of
        :math:`-\\log p(y_i \\mid f)` in the output; :math:`N` the effective data
        size :attr:`effective_num_data`). With ``BatchNorm`` layers on minibatch
        statistics (train mode) :math:`g` is exact and :math:`J_i` is that of the
        network with the statistics frozen (:mod:`pyro_ngvi.curvature.batch_norm`).
        For the Gaussian likelihood
        :math:`-\\log p = \\|f - y\\|^2 / (2\\sigma^2) + \\text{const}`, so the
        per-example gradients carry :math:`1/(2\\sigma^2)` (squared in ``ef``).
        :math:`g` and :math:`h` are averaged over particles and attached as
        :class:`~pyro_ngvi.handover.SiteCurvature` ``(g, h, m_0, 1/s_0^2, sigma)`` to
        each site's unconstrained ``loc`` in the param store: the Normal prior is
        conjugate and left to the optimizer (with ``learn_prior``, the
        :class:`~pyro_ngvi.handover.PriorParam` of the site's learned scale too,
        which the optimizer sets in closed form), with :meth:`statistics_hints`.
        Point-estimated params (a learned noise scale, ``BatchNorm``) get the
        gradient of the particle average of :math:`\\ell` in ``.grad``. The guide's
        locs are read through ``pyro.param`` statements, so ``SVI.step`` hands them
        to the optimizer, which finds each scale by name. A
        :class:`~pyro_ngvi.KroneckerNormal` guide gets Kronecker factors instead
        (:mod:`pyro_ngvi.nn.kronecker_step`). As the fast path never evaluates the
        likelihood's ``log_prob``, it checks the targets as that would: their shape
        (once per shape) and, while Pyro's validation is enabled, their values.

        :param guide: an :class:`~pyro.infer.autoguide.AutoNormal` of this model
            (run once on ``(x, y)`` if it has not been).
        :param torch.Tensor x: a minibatch of inputs.
        :param torch.Tensor y: its targets.
        :param str curvature: ``"ef"``, ``"ggn"``, ``"ggn_mc"`` or ``"reparam"``.
        :param int num_particles: samples of the weights (default: 1).
        :param bool deterministic: evaluate at the mean (default: False).
        :param int mc_samples: sampled targets per example for ``ggn_mc`` (default: 1).
        :returns: an estimate of the negative ELBO with the meaning of
            ``Trace_ELBO().loss``: the particle average of
            :math:`\\ell(w) + \\sum_j [\\log q(w_j) - \\log p_0(w_j)]`, constants
            included; when ``deterministic``, :math:`\\ell(\\mu) + \\mathrm{KL}(q \\| p_0)`.
        :rtype: torch.Tensor
        """
        return self._fast_path(
            self, guide, x, y, curvature, num_particles=num_particles,
            deterministic=deterministic, mc_samples=mc_samples,
        )
