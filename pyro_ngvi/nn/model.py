"""
Bayesian neural networks from plain :class:`torch.nn.Module` networks.

:class:`BayesianNet` turns a network, a Normal prior on its weights and a
likelihood into a Pyro model ``model(x, y=None)`` (usable with any autoguide,
``SVI`` and ``Predictive``). It offers :class:`~pyro_ngvi.CurvatureELBO` a faster
way to its curvature (:meth:`BayesianNet.curvature_step`, the protocol of
:mod:`pyro_ngvi.elbo`), served by :mod:`pyro_ngvi.nn.fast_path`.
"""

import math
import numbers
import sys
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible

from ..family import CURVATURE_PER_EXAMPLE, PriorParam, live_handover, on_rejected
from ..kronecker import KroneckerLayer
from ..monitor import NGVIWarning
from ..priors import _weight_prior_loc_scale
from .fast_path import LOSS_MODULES, BackpackStep

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

PriorSpec = Union[float, torch.Tensor, Tuple, torch.distributions.Distribution]

class WeightPrior(NamedTuple):
    """The Normal prior of all weights of a :class:`BayesianNet` as one fast-path step uses it."""

    site_locs: List[torch.Tensor]  # m_0 broadcast to each weight's shape (expanded views)
    site_precisions: List[torch.Tensor]  # lambda_0, the same
    log_scale_total: torch.Tensor  # sum of log s_0 over all elements
    params: Optional[List[PriorParam]]  # learned prior scales, one per site (or None)
    #: per site (m_0, lambda_0) broadcastable to the weight, m_0 None where it is 0:
    #: what the ELBO value needs, without the flat copies
    compact: List[Tuple[Optional[torch.Tensor], torch.Tensor]]
    #: where every m_0 is 0 and every site has one lambda_0: (lambda_0 / 2 per site, then -1/2
    #: per site), so that sum [lambda_0 w^2 - eps^2] / 2 is its dot with the squared norms of
    #: the weights and the draws (else None)
    norm_weights: Optional[torch.Tensor]


class _Weight(NamedTuple):
    site: str  # Pyro site (latent) or param (point estimate) name
    module: nn.Module
    param_name: str  # the parameter's name inside ``module``
    key: str  # the parameter's name inside the network, for functional_call
    index: int  # position among the network's parameters that require a gradient

    @property
    def param(self) -> torch.Tensor:
        return self.module._parameters[self.param_name]


class BayesianNet(nn.Module):
    """
    A Bayesian neural network as a Pyro model. For a network :math:`f(x; w)`
    with weight tensors :math:`w_j` the model is

    .. math:: w_j \\sim \\mathcal{N}(m_{0j}, s_{0j}^2) \\text{ element-wise}, \\qquad
              y_i \\mid x_i, w \\sim p(y_i \\mid f(x_i; w)), \\quad i = 1, \\dots, N,

    with one latent site per weight tensor, named as the parameter in the
    network (``"0.weight"``, prefixed ``"<name>."`` when ``name`` is given), and
    the likelihood under a ``pyro.plate("data", N, subsample=...)``: a
    minibatch of :math:`B` examples stands for all :math:`N`, its log-likelihood
    scaled by :math:`N/B`. :math:`N` is the *effective* data size
    :attr:`effective_num_data` ``= round(num_data * augmentation_factor)``.
    Likelihoods, for a network output :math:`f`:

    * ``"categorical"``: :math:`\\mathrm{Categorical}(\\mathrm{logits}=f)`, output
      ``(B, K)``, integer targets ``(B,)``;
    * ``"bernoulli"``: :math:`\\mathrm{Bernoulli}(\\mathrm{logits}=f)`, targets 0/1;
    * ``"gaussian"``: :math:`\\mathcal{N}(f, \\sigma^2)`, with ``noise_scale``
      :math:`\\sigma` fixed, or a positive ``pyro.param`` (point-estimated) when
      ``noise_scale=None``.

    For ``bernoulli`` and ``gaussian`` an output ``(B, 1)`` is one scalar per
    example (targets ``(B,)``); an output ``(B, D)`` is a vector event
    (targets ``(B, D)``). The model returns the likelihood's parameter (logits
    or mean) and records it as the deterministic site ``"output"``; the
    observations are the site ``"obs"``.

    ``BatchNorm`` weights and biases are point-estimated (``pyro.param``);
    parameters with ``requires_grad=False`` stay fixed. The network's own
    parameters are not the model's: :meth:`curvature_step` writes the sampled
    weights into them. The running statistics of train-mode ``BatchNorm`` layers
    are saved at the first forward pass of each step and restored should
    :class:`~pyro_ngvi.NGVI` skip the step (or the step fail). What each
    curvature source computes for a network with ``BatchNorm`` in train mode is
    said in :mod:`pyro_ngvi.curvature.batch_norm`.

    **Priors learned by the evidence** (``learn_prior=True``). Each weight
    tensor's prior scale becomes a positive ``pyro.param``,
    ``"<site>.prior_scale"``, of the shape of the scale given in ``prior``
    (one number per weight tensor for a float ``prior``), initialised there and
    broadcast over the tensor: :math:`w_j \\sim \\mathcal{N}(m_{0j}, s_{0j}^2)`
    with :math:`s_{0j}` learned. :class:`~pyro_ngvi.NGVI` sets it after every
    step to the maximiser of the ELBO given the guide, in closed form,

    .. math:: s_{0j}^2 = \\frac{1}{D_j} \\sum_{i=1}^{D_j} \\left[(\\mu_{ji} - m_{0ji})^2 + \\sigma_{ji}^2\\right]

    (type-II maximum likelihood of the ELBO, variational EM; one prior precision
    :math:`s_{0j}^{-2}` per weight tensor), and the prior stays conjugate (exact)
    in the update; on the fast path and the traced path alike. Compared with
    :func:`~pyro_ngvi.optimize_prior_precision` (the Laplace evidence of a MAP
    fit, maximised over a grid of candidates, one refit per candidate, a
    posterior approximation around the mode), this maximises the ELBO of the
    very Gaussian being trained, continuously and per weight tensor, at the cost
    of a few reductions per step; the grid search's evidence is an estimate at
    the mode, not a bound, and each extra hyperparameter multiplies its cost.
    At the start of training the guide is the network's initialisation with a
    small ``init_scale``, and the maximiser is that initialisation's scale
    (about :math:`1/\\sqrt{\\text{fan-in}}` for PyTorch's layers): learned from
    the first step, the priors shrink before the data has moved the weights. The
    attribute ``learn_prior`` is read at every step, so it can be switched on
    later (``bnn.learn_prior = True``; the learned scales then start at
    ``prior``), but with NGVI's minibatch defaults a warm-up does not prevent the
    collapse: each tensor's scale falls to that of its weights, the means shrink,
    and the network switches off (the README's "Training a BayesianNet").

    **Data augmentation.** Training on randomly transformed copies of the
    examples (shifts, rotations) presents more distinct data than ``num_data``:
    the seeds model it as a larger data set, :math:`N` multiplied by a factor.
    ``augmentation_factor`` :math:`\\rho` says so: the data plate has size
    :math:`\\rho N` and each minibatch's log-likelihood, gradient and curvature
    are scaled by :math:`\\rho N / B` (on the traced path and the fast path). For
    the fit this is the same as tempering the prior by :math:`1/\\rho`
    (``NGVI(tau=1 / rho)``); the ELBO's value differs by the factor.

    **Training recipe** (the README's "Training a BayesianNet" says why)::

        guide = bnn.guide()                       # the network's weights, sigma = (lambda_0 + N)^-1/2
        svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))   # or "ef", "ggn_mc", "reparam"

    The statistics the fast path hands over say that they are minibatch
    estimates for :math:`N` examples, and NGVI's defaults follow from that
    (:func:`pyro_ngvi.optim.defaults`: the mean step damped by :math:`N`). The
    variational family is limited by ``noise_limit``: the weight noise may add at
    most :math:`v` of the signal's variance along the network (:meth:`max_scale`),
    because a mean-field Gaussian whose scales sit at a wide prior's, as the
    unrestricted optimum's do for weights the data pin down only jointly, swamps
    every unit with noise and predicts little better than chance.

    Run inside another model (a lambda, a bigger Pyro model), the net's hints reach
    the ELBO only through that model: ``model.statistics_hints = bnn.statistics_hints``
    (the net warns :class:`~pyro_ngvi.NGVIWarning` once when NGVI would lose them).

    **Fast path.** :meth:`curvature_step` does what an ELBO does for this model
    with an :class:`~pyro.infer.autoguide.AutoNormal` guide, without Pyro's
    tracing: sample, forward, backward under BackPACK, and attach gradient and
    curvature of the likelihood to each site (see there). As it never evaluates
    the likelihood's ``log_prob``, it checks the targets as that would: their
    shape (once per shape) and, while Pyro's validation is enabled, their values.

    :param torch.nn.Module net: the plain network; its output for a batch ``x``
        is ``(B, ...)``. BackPACK curvature needs supported layers (``Linear``,
        ``Conv*``, activations, ``Flatten``, pooling, ``Dropout``, ...) and, for
        ``ggn``/``ggn_mc``, a 2-d output.
    :param str likelihood: ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    :param int num_data: size of the training set (before augmentation).
    :param prior: the prior on the weights: a positive scale :math:`s_0` for all
        weights (mean 0), or a dict from site name to a scale, a pair
        ``(loc, scale)`` of tensors broadcastable to the weight's shape, or a
        ``Normal`` distribution (e.g. a previous posterior), one entry per latent
        site (default: 1.0).
    :param noise_scale: fixed :math:`\\sigma` of the Gaussian likelihood, or
        ``None`` to learn it (default: None).
    :param float init_noise_scale: initial :math:`\\sigma` when learned (default: 1.0).
    :param str name: prefix of every site and param name (default: "").
    :param bool learn_prior: learn each weight tensor's prior scale by the
        evidence, starting at ``prior`` (default: False).
    :param float augmentation_factor: :math:`\\rho > 0`, the effective data size
        is ``round(rho * num_data)`` (default: 1.0).
    :param noise_limit: :math:`v > 0`, the most variance the guide's weight noise
        may add to the network's output, relative to the signal, for unit-variance
        inputs: each of the :math:`L` layers with a fan-in (``Linear``, ``Conv*``)
        may add :math:`v / L` (noise compounds through the layers), so the
        standard deviation of each weight of a layer with fan-in :math:`n` is at
        most :math:`\\sqrt{v / (L n)}` (:class:`~pyro_ngvi.NGVI` keeps the precision
        at least :math:`L n / v`); ``None`` lifts the limit (default: 1.0). See the
        README's "Training a BayesianNet" for why.
    """

    #: Curvature sources :meth:`curvature_step` supports.
    curvature_sources = BackpackStep.sources

    def __init__(
        self,
        net: nn.Module,
        likelihood: str,
        num_data: int,
        prior: Union[PriorSpec, Dict[str, PriorSpec]] = 1.0,
        noise_scale: Optional[float] = None,
        init_noise_scale: float = 1.0,
        name: str = "",
        learn_prior: bool = False,
        augmentation_factor: float = 1.0,
        noise_limit: Optional[float] = 1.0,
    ):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise ValueError(f"net must be a torch.nn.Module, got {net!r}")
        if not isinstance(likelihood, str) or likelihood not in LOSS_MODULES:
            raise ValueError(
                f"Unknown likelihood {likelihood!r}; supported: "
                + ", ".join(repr(k) for k in LOSS_MODULES)
            )
        if noise_scale is not None:
            noise_scale = _positive_finite("noise_scale", noise_scale)
        init_noise_scale = _positive_finite("init_noise_scale", init_noise_scale)
        if not isinstance(name, str):
            raise ValueError(f"name must be a string, got {name!r}")
        self.net = net
        self.likelihood = likelihood
        self._noise_floor_cache = None
        self.noise_limit = noise_limit
        self.num_data = num_data
        self.augmentation_factor = augmentation_factor
        self.learn_prior = learn_prior
        self.noise_scale = noise_scale
        self.init_noise_scale = init_noise_scale
        self.prefix = name + "." if name else ""
        self._batch_norms = [m for m in net.modules() if isinstance(m, _BATCH_NORMS)]
        self._outer_model_warned = False  # run inside another model without its hints: warned
        self._outer_model_checked = None  # the hand-over (ELBO evaluation) last checked for that
        self._running_stats_handover = None  # the hand-over whose forward saved them
        self._checked_targets = set()  # (y shape, y dtype, output shape) seen valid

        self._fast_path = BackpackStep(net, likelihood)

        self._latents: List[_Weight] = []
        self._point_estimates: List[_Weight] = []
        trainable = [(k, p) for k, p in net.named_parameters() if p.requires_grad]
        for index, (key, param) in enumerate(trainable):
            path, _, param_name = key.rpartition(".")
            module = net.get_submodule(path)
            weight = _Weight(self.prefix + key, module, param_name, key, index)
            if isinstance(module, _BATCH_NORMS):
                self._point_estimates.append(weight)
            else:
                self._latents.append(weight)
        if not self._latents:
            raise ValueError(
                "BayesianNet found no weight to put a prior on: the network needs a "
                "parameter with requires_grad=True outside BatchNorm layers."
            )
        self._latent_params = [w.param for w in self._latents]
        self._prior_cache = self._flat_prior_cache = self._prior_index_cache = None
        self._set_priors(prior)

    @property
    def learn_prior(self) -> bool:
        """Whether the prior scales are learned (read at every step; may be set, e.g. after a warm-up)."""
        return self._learn_prior

    @learn_prior.setter
    def learn_prior(self, value) -> None:
        if not isinstance(value, bool):  # a string "no" would switch it on
            raise ValueError(f"learn_prior must be True or False, got {value!r}")
        self._learn_prior = value

    @property
    def augmentation_factor(self) -> float:
        """:math:`\\rho`, the effective data size is ``round(rho * num_data)`` (a positive number; may be set)."""
        return self._augmentation_factor

    @augmentation_factor.setter
    def augmentation_factor(self, value) -> None:
        self._augmentation_factor = _positive_finite("augmentation_factor", value)

    @property
    def noise_limit(self) -> Optional[float]:
        """:math:`v`, the variance the weight noise may add to a unit (``None``: no limit; may be set)."""
        return self._noise_limit

    @noise_limit.setter
    def noise_limit(self, value) -> None:
        self._noise_limit = None if value is None else _positive_finite("noise_limit", value)
        self._noise_floor_cache = None

    def max_scale(self, site: str) -> Optional[float]:
        """
        The largest standard deviation :attr:`noise_limit` allows the weights of
        ``site``, :math:`\\sqrt{v / (L n)}` with :math:`n` the fan-in of its layer and
        :math:`L` the number of layers with a fan-in (``None`` when unlimited, or
        when the layer has no fan-in: a weight of fewer than two dimensions, an
        embedding).

        :raises ValueError: when ``site`` is not one of :attr:`latent_sites`.
        """
        weight = self._latents[self._latent_index(site)]
        fan_in = _fan_in(weight.module)
        if self.noise_limit is None or fan_in is None:
            return None
        layers = len({id(w.module) for w in self._latents if _fan_in(w.module) is not None})
        return math.sqrt(self.noise_limit / (layers * fan_in))

    def _noise_floor(self) -> Optional[List[torch.Tensor]]:
        """Per site, the least precision :math:`L n / v` the guide may have (a tensor of the
        weight's shape: a view of one number, no memory of its own; 0 where the scale is
        unlimited), or ``None``."""
        if self.noise_limit is None:
            return None
        if self._noise_floor_cache is None:
            floors = []
            for weight in self._latents:
                cap, param = self.max_scale(weight.site), weight.param
                floor = 0.0 if cap is None else cap**-2
                floors.append(torch.tensor(floor, dtype=param.dtype, device=param.device).expand(param.shape))
            self._noise_floor_cache = floors
        return self._noise_floor_cache

    def statistics_hints(self, site: str, deterministic: bool = False) -> Dict[str, object]:
        """
        What the curvature statistics of ``site`` should tell
        :class:`~pyro_ngvi.NGVI` besides :math:`g, h` (the protocol
        :class:`~pyro_ngvi.CurvatureELBO` reads, on this model's fast path and on the
        traced path alike): ``num_data``, the effective data size the minibatch
        stands for (NGVI's defaults for a ``BayesianNet`` follow from it), and, for
        sampled statistics, ``min_precision``, the floor :attr:`noise_limit` puts on
        the precision (``None`` at the mean, ``deterministic``: no weight noise
        is injected there, and Laplace's precision is the curvature's). For a site
        that is not one of :attr:`latent_sites` (another part of a bigger model):
        ``{}``, nothing to say, so that the hints of a net inside a bigger model can
        be given to that model (``model.statistics_hints = bnn.statistics_hints``, or
        merged with another net's).
        """
        if site not in self.latent_sites:
            return {}
        floors = None if deterministic else self._noise_floor()
        index = self.latent_sites.index(site)
        return {"num_data": self.effective_num_data, "min_precision": None if floors is None else floors[index]}

    def initial_scale(self) -> float:
        """
        The guide's initial standard deviation for minibatch training, relative to
        the data: :math:`(\\lambda_{0} + N h_0)^{-1/2}` with :math:`N` the effective
        data size, :math:`\\lambda_0` the largest prior precision and :math:`h_0` =
        :data:`~pyro_ngvi.family.CURVATURE_PER_EXAMPLE` (the precision a Gaussian
        posterior has after :math:`N` examples of unit curvature each; ivon-opt's
        ``ess * hess_init``), and at most :meth:`max_scale` of every site.
        """
        prior_precision = max(float(self._prior_buffers(j)[2].max()) for j in range(len(self._latents)))
        scale = (prior_precision + self.effective_num_data * CURVATURE_PER_EXAMPLE) ** -0.5
        caps = [c for c in map(self.max_scale, self.latent_sites) if c is not None]
        return min([scale] + caps)

    def guide(self, init_scale: Optional[float] = None, **kwargs) -> AutoNormal:
        """
        The mean-field guide of the recipe: an
        :class:`~pyro.infer.autoguide.AutoNormal` that starts each weight at the
        network's own initialisation (:meth:`init_loc_fn`) with the
        data-relative standard deviation :meth:`initial_scale`::

            svi = SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO("ggn"))

        :param init_scale: another initial standard deviation, a positive finite
            number (default: None, :meth:`initial_scale`).
        :param kwargs: other arguments of ``AutoNormal`` (an ``init_loc_fn`` given
            replaces :meth:`init_loc_fn`).
        """
        init_scale = self.initial_scale() if init_scale is None else _positive_finite("init_scale", init_scale)
        kwargs.setdefault("init_loc_fn", self.init_loc_fn)
        return AutoNormal(self, init_scale=init_scale, **kwargs)

    @property
    def num_data(self) -> int:
        """Size :math:`N` of the training set (a positive integer; may be set)."""
        return self._num_data

    @num_data.setter
    def num_data(self, value) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"num_data must be a positive integer, got {value!r}")
        self._num_data = int(value)

    # ------------------------------------------------------------------ priors

    def _set_priors(self, prior):
        sites = [w.site for w in self._latents]
        if isinstance(prior, dict):
            unknown = sorted(set(prior) - set(sites))
            missing = [s for s in sites if s not in prior]
            if unknown or missing:
                raise ValueError(
                    "The prior dict needs one entry per latent site "
                    f"({', '.join(sites)}); missing: {missing}, not latent sites: "
                    f"{unknown} (BatchNorm parameters are point estimates)"
                )
        for index, weight in enumerate(self._latents):
            spec = prior[weight.site] if isinstance(prior, dict) else prior
            loc, scale = _as_loc_scale(spec, weight)
            self.register_buffer(f"_prior_loc_{index}", loc)
            self.register_buffer(f"_prior_scale_{index}", scale)
            self.register_buffer(f"_prior_precision_{index}", scale.pow(-2))
            # sum of log s_0 over the weight's elements, the prior's normaliser
            log_scale_sum = scale.log().expand(weight.param.shape).sum()
            self.register_buffer(f"_prior_log_scale_sum_{index}", log_scale_sum)
        like = self._latents[0].param
        total = sum(getattr(self, f"_prior_log_scale_sum_{j}") for j in range(len(self._latents)))
        self.register_buffer("_prior_log_scale_total", torch.as_tensor(total, dtype=like.dtype))

    def _prior_buffers(self, index: int):
        """``(loc, scale, precision, sum of log scale)`` of the ``index``-th latent site
        as given (for a learned prior: its initial scale)."""
        if self._prior_cache is None:  # nn.Module attribute lookups are slow: cache
            self._prior_cache = [
                tuple(
                    getattr(self, f"_prior_{what}_{j}")
                    for what in ("loc", "scale", "precision", "log_scale_sum")
                )
                for j in range(len(self._latents))
            ]
        return self._prior_cache[index]

    def _prior_scale_name(self, weight: _Weight) -> str:
        return weight.site + ".prior_scale"

    def _learned_scale(self, index: int) -> torch.Tensor:
        """The ``pyro.param`` holding the prior scale of the ``index``-th site (learned)."""
        initial = self._prior_buffers(index)[1]
        return pyro.param(self._prior_scale_name(self._latents[index]),
                          lambda: initial.clone(), constraint=constraints.positive)

    def _prior_scale(self, index: int) -> torch.Tensor:
        """The prior scale of the ``index``-th site now: the learned param or the given one."""
        return self._learned_scale(index) if self.learn_prior else self._prior_buffers(index)[1]

    def _weight_prior(self) -> "WeightPrior":
        """
        The prior of all latent sites as one step of the fast path uses it, as views
        broadcast over each weight (no copies): built once for a fixed prior; with
        ``learn_prior``, the precisions and normaliser are read from the learned
        params (in the param store) on every call, a few operations per site on the
        scales' own (small) shapes.
        """
        if self._flat_prior_cache is None:
            self._flat_prior_cache = self._fixed_prior()
        fixed = self._flat_prior_cache
        if not self.learn_prior:
            return fixed
        unconstrained = self._learned_scale_tensors()
        site_precisions, compact, log_scale_total = [], [], 0.0
        with torch.no_grad():  # positive params: s_0 = exp(unconstrained), lambda_0 = exp(-2 unconstrained)
            for weight, u, (loc, _) in zip(self._latents, unconstrained, fixed.compact):
                precision = u.detach().mul(-2.0).exp_()
                site_precisions.append(precision.expand(weight.param.shape))
                compact.append((loc, precision))
                log_scale_total = log_scale_total + u.detach().sum() * (weight.param.numel() / u.numel())
        params = [PriorParam(self._prior_scale_name(w), u, constraints.positive, index)
                  for w, u, index in zip(self._latents, unconstrained, self._prior_index_cache)]
        return WeightPrior(fixed.site_locs, site_precisions, log_scale_total, params, compact, _norm_weights(compact))

    def _fixed_prior(self) -> "WeightPrior":
        """The prior as given, broadcast over each weight, and for ``learn_prior`` per site
        the index of its scale's element for each weight element (an expanded view)."""
        site_locs, site_precisions, compact, indices, log_scale_total = [], [], [], [], 0.0
        for j, weight in enumerate(self._latents):
            loc, scale, precision, log_scale_sum = self._prior_buffers(j)
            shape = weight.param.shape
            site_locs.append(loc.expand(shape))
            site_precisions.append(precision.expand(shape))
            compact.append((None if not bool(loc.any()) else loc, precision))
            log_scale_total = log_scale_total + log_scale_sum
            indices.append(torch.arange(scale.numel(), device=scale.device).reshape(scale.shape).expand(shape))
        self._prior_index_cache = indices
        like = self._latents[0].param
        return WeightPrior(site_locs, site_precisions, torch.as_tensor(log_scale_total, dtype=like.dtype,
                                                                       device=like.device), None, compact,
                           _norm_weights(compact))

    def _learned_scale_tensors(self) -> List[torch.Tensor]:
        """The unconstrained tensors of the learned prior scales in the param store
        (created through ``pyro.param`` on first use)."""
        store = pyro.get_param_store()
        tensors = []
        for j, weight in enumerate(self._latents):
            name = self._prior_scale_name(weight)
            if name not in store._params:
                self._learned_scale(j)
            if not _is_positive(store._constraints[name]):
                raise ValueError(
                    f"The param store holds '{name}' with constraint {store._constraints[name]}; "
                    "a learned prior scale of a BayesianNet is a positive param"
                )
            tensors.append(store._params[name])
        return tensors

    def _apply(self, fn, *args, **kwargs):
        # .to(), .double(), ... replace the buffers
        self._prior_cache = self._flat_prior_cache = self._prior_index_cache = None
        self._noise_floor_cache = None
        module = super()._apply(fn, *args, **kwargs)
        self._fast_path.refresh()  # the shared parameter dicts may hold new tensors
        self._latent_params = [w.param for w in self._latents]
        return module

    def prior(self, site: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """Prior ``(loc, scale)`` of a latent site now, broadcastable to its shape (with
        ``learn_prior``, the learned scale's current value, detached)."""
        index = self._latent_index(site)
        return self._prior_buffers(index)[0], self._prior_scale(index).detach()

    @property
    def effective_num_data(self) -> int:
        """The data plate's size :math:`N`: ``round(num_data * augmentation_factor)`` (at least 1)."""
        return max(1, round(self.num_data * self.augmentation_factor))

    def _latent_index(self, site: str) -> int:
        sites = self.latent_sites
        if site not in sites:
            raise ValueError(f"site {site!r} is not a latent site of this BayesianNet; its latent sites are {sites}")
        return sites.index(site)

    @property
    def latent_sites(self) -> List[str]:
        """Names of the latent sites, one per weight tensor."""
        return [w.site for w in self._latents]

    def with_priors(self, priors: Dict[str, torch.distributions.Distribution]) -> "BayesianNet":
        """
        The same model with the priors of some weight sites replaced, as a
        :class:`BayesianNet` on the same plain network (so the fast path and the
        conjugate handling of the prior keep working). This is what
        :func:`pyro_ngvi.with_priors` does for a :class:`BayesianNet`; e.g. with
        yesterday's posterior (variational continual learning)::

            bnn_2 = bnn.with_priors(posterior_as_prior(guide))

        Sites not named in ``priors`` keep their prior (a learned one at its
        current value: the new model's priors are fixed, ``learn_prior=False``);
        ``num_data``, ``augmentation_factor``, ``noise_limit``, the likelihood, the
        noise scale and the name are kept (``num_data`` is a plain attribute: set it when
        the next task has another size).

        Each prior must be the law a site of this model could have: a Normal in
        the weight (``Normal(loc, scale).to_event(d)``, possibly ``.expand``-ed, or
        a transformed Normal whose transforms are the identity) with the weight's
        shape as its event shape. Each of these is an error naming the site: a
        name that is not a latent site (:class:`ValueError`), a prior that is not
        a :class:`~torch.distributions.Distribution` (:class:`TypeError`), a
        shape mismatch, a support other than the real line, a real-valued prior
        that is not Normal (:class:`ValueError`; wrap the model in a
        :class:`~pyro_ngvi.PriorMessenger` for those, on the traced path).

        :param dict priors: ``{site name: distribution}``.
        :returns: a new :class:`BayesianNet` sharing :attr:`net` with this one.
        """
        if not isinstance(priors, dict):
            raise TypeError(f"priors must be a dict of distributions, got {type(priors).__name__}")
        sites = self.latent_sites
        specs = {site: self.prior(site) for site in sites}
        for name, prior in priors.items():
            if name not in specs:
                point = [w.site for w in self._point_estimates]
                note = f" ('{name}' is a point-estimated BatchNorm parameter)" if name in point else ""
                raise ValueError(
                    f"with_priors: '{name}' is not a latent site of this BayesianNet{note}; "
                    f"its latent sites are {sites}."
                )
            index = sites.index(name)
            specs[name] = _weight_prior_loc_scale(name, prior, self._latents[index].param.shape)
        new = BayesianNet(
            self.net,
            self.likelihood,
            self.num_data,
            prior=specs,
            noise_scale=self.noise_scale,
            init_noise_scale=self.init_noise_scale,
            name=self.prefix[:-1],
            augmentation_factor=self.augmentation_factor,
            noise_limit=self.noise_limit,
        )
        new.training = self.training  # not .train(): that would also set the shared net
        return new

    def kronecker_layers(self) -> List[KroneckerLayer]:
        """
        The network's fully-connected layers, for a
        :class:`~pyro_ngvi.kronecker.KroneckerNormal` guide (the protocol it reads):
        one :class:`~pyro_ngvi.kronecker.KroneckerLayer` per ``Linear`` module with
        its weight and bias sites.

        :raises NotImplementedError: when a latent weight belongs to a module
            other than ``nn.Linear`` (K-FAC factors are served for those only).
        """
        layers, seen = [], set()
        for weight in self._latents:
            module = weight.module
            if type(module) is not nn.Linear:
                raise NotImplementedError(
                    f"KroneckerNormal puts a matrix normal on nn.Linear layers only; site "
                    f"'{weight.site}' belongs to a {type(module).__name__}. Use AutoNormal."
                )
            if id(module) in seen:
                continue
            seen.add(id(module))
            sites = {w.param_name: w.site for w in self._latents if w.module is module}
            name = sites["weight"][: -len(".weight")]
            layers.append(KroneckerLayer(name, sites["weight"], sites.get("bias"),
                                         module.out_features, module.in_features))
        return layers

    def init_loc_fn(self, site) -> torch.Tensor:
        """
        An autoguide ``init_loc_fn`` that starts each weight site at the value
        the network holds now (e.g. PyTorch's initialisation), other sites as
        :func:`~pyro.infer.autoguide.initialization.init_to_feasible`::

            guide = AutoNormal(bnn, init_loc_fn=bnn.init_loc_fn, init_scale=1e-2)
        """
        for weight in self._latents:
            if weight.site == site["name"]:
                return weight.param.detach().clone()
        return init_to_feasible(site)

    # ------------------------------------------------------------- the model

    def _site(self, name: str) -> str:
        return self.prefix + name

    def _noise_scale(self) -> torch.Tensor:
        if self.noise_scale is not None:
            return self.noise_scale
        like = self._latents[0].param
        return pyro.param(
            self._site("noise_scale"),
            lambda: torch.tensor(self.init_noise_scale, dtype=like.dtype, device=like.device),
            constraint=constraints.positive,
        )

    def _point_estimate(self, weight: _Weight) -> torch.Tensor:
        return pyro.param(weight.site, lambda: weight.param.detach().clone())

    def _likelihood_param(self, output: torch.Tensor) -> torch.Tensor:
        """The network output as the likelihood's parameter (scalar outputs squeezed)."""
        if self.likelihood != "categorical" and output.dim() == 2 and output.shape[1] == 1:
            return output.squeeze(-1)
        return output

    def _likelihood(self, param: torch.Tensor) -> dist.Distribution:
        if self.likelihood == "categorical":
            return dist.Categorical(logits=param).to_event(param.dim() - 2)
        if self.likelihood == "bernoulli":
            return dist.Bernoulli(logits=param).to_event(param.dim() - 1)
        return dist.Normal(param, self._noise_scale()).to_event(param.dim() - 1)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        The Pyro model: sample the weights from the prior, run the network on
        ``x`` and observe ``y`` (sample it when ``None``).

        :returns: the likelihood's parameter (logits or mean), batch first.
        :raises ValueError: for an empty batch, or ``y`` of another length than ``x``.
        """
        self._check_batch(x, y)
        if not self._outer_model_warned and self._outer_model_checked != live_handover():
            self._outer_model_checked = live_handover()  # once per ELBO evaluation
            self._warn_if_inside_another_model()
        self._keep_running_stats_until_accepted()
        params = {}
        for index, weight in enumerate(self._latents):
            loc, scale = self._prior_buffers(index)[0], self._prior_scale(index)
            shape = weight.param.shape
            prior = dist.Normal(loc, scale).expand(shape).to_event(len(shape))
            params[weight.key] = pyro.sample(weight.site, prior)
        for weight in self._point_estimates:
            params[weight.key] = self._point_estimate(weight)
        output = self._likelihood_param(functional_call(self.net, params, (x,)))
        likelihood = self._likelihood(output)
        subsample = torch.arange(len(x), device=x.device)
        with pyro.plate(self._site("data"), self.effective_num_data, subsample=subsample):
            pyro.deterministic(self._site("output"), output, event_dim=output.dim() - 1)
            pyro.sample(self._site("obs"), likelihood, obs=y)
        return output

    def _warn_if_inside_another_model(self) -> None:
        """
        Warn once when this net runs inside another model (a lambda, a bigger Pyro
        model, a poutine handler) under an ``SVI`` with :class:`~pyro_ngvi.NGVI` and
        :class:`~pyro_ngvi.CurvatureELBO`, and that model offers no
        ``statistics_hints``: the ELBO asks the model it is given for them, so NGVI
        would take its full-batch defaults and ignore :attr:`noise_limit`. Nothing to
        say when every setting the recipe resolves was given and there is no limit.
        """
        svi = _calling_svi()
        if svi is None:
            return
        model, optim = svi.model, svi.optim
        elbo = getattr(svi.loss_and_grads, "__self__", None)
        if (model is self or getattr(model, "statistics_hints", None) is not None
                or not getattr(elbo, "produces_curvature", False)
                or not getattr(optim, "consumes_curvature", False)):
            return
        resolved = [name for name in ("lr", "beta", "momentum", "damping") if getattr(optim, name, 0) is None]
        if not resolved and self.noise_limit is None:
            return
        self._outer_model_warned = True
        lost = (f"NGVI resolves {', '.join(resolved)} for full-batch statistics (lr 1, beta 0.5, no damping: "
                "minibatch training with them diverges) instead of the minibatch recipe" if resolved else "")
        if self.noise_limit is not None:
            lost += (" and " if lost else "") + f"the noise limit ({self.noise_limit:g}) is not applied"
        warnings.warn(
            f"BayesianNet ({', '.join(self.latent_sites[:2])}, ...) runs inside another model ({model!r}) "
            f"that has no statistics_hints: CurvatureELBO reads the hints from the model SVI was given, "
            f"so {lost}. Give that model the net's hints, model.statistics_hints = bnn.statistics_hints "
            "(merged with other nets' for several), or train the BayesianNet itself.",
            NGVIWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------ data
    def _check_batch(self, x, y) -> None:
        """An empty batch, or targets of another length, are refused (no device sync)."""
        if len(x) == 0:
            raise ValueError(
                "BayesianNet got an empty batch x: a minibatch needs at least one example "
                "(its log-likelihood is scaled by num_data / batch size)"
            )
        if y is not None and (y.dim() == 0 or len(y) != len(x)):
            raise ValueError(
                f"BayesianNet: y holds {len(y) if y.dim() else 'no'} targets for a batch of "
                f"{len(x)} inputs"
            )

    def _check_targets(self, y: torch.Tensor, output: torch.Tensor) -> None:
        """
        Refuse targets the model's likelihood would refuse, for a path that does not
        evaluate its ``log_prob`` (the BackPACK fast path): the shape (the likelihood
        parameter's, class dimension dropped for ``categorical``) and dtype, checked
        once per distinct shape and dtype; and, while Pyro's validation is enabled
        (:func:`pyro.enable_validation`, as for a distribution's support), the values:
        class indices in ``[0, K)`` (integral, e.g. no ``-100``), Bernoulli
        targets in ``{0, 1}``. Gaussian targets are any real number (a non-finite
        one makes the step non-finite: the optimizer skips it).
        """
        param = self._likelihood_param(output)
        expected = param.shape[:-1] if self.likelihood == "categorical" else param.shape
        key = (y.shape, y.dtype, output.shape)
        if key not in self._checked_targets:
            if y.shape != expected:
                raise ValueError(
                    f"BayesianNet ({self.likelihood}): targets y of shape {tuple(y.shape)} for a "
                    f"network output of shape {tuple(output.shape)}; expected {tuple(expected)}"
                )
            if y.dtype == torch.bool and self.likelihood != "bernoulli" or y.is_complex():
                raise ValueError(
                    f"BayesianNet ({self.likelihood}): targets y of dtype {y.dtype} are not "
                    "supported"
                )
            self._checked_targets.add(key)
        if self.likelihood == "gaussian" or y.dtype == torch.bool or not dist.is_validation_enabled():
            return
        top = param.shape[-1] - 1 if self.likelihood == "categorical" else 1
        low, high = torch.aminmax(y.detach())
        valid = low.tolist() >= 0 and high.tolist() <= top  # a device sync, as Pyro's support checks
        if valid and y.is_floating_point():
            valid = not bool(torch.any(y != y.round()))
        if not valid:
            valid = (y >= 0) & (y <= top) & (y == y.round())
            support = f"class indices in {{0, ..., {top}}}" if self.likelihood == "categorical" else "0 or 1"
            bad = y[~valid]
            raise ValueError(
                f"BayesianNet ({self.likelihood}): targets y must be {support}; got "
                f"{bad.numel()} others, e.g. {bad[:3].tolist()} (the fast path checks them "
                "while Pyro's validation is enabled, as the model's log_prob would)"
            )

    def _keep_running_stats_until_accepted(self) -> None:
        """
        Save the running statistics of the network's train-mode BatchNorm layers once
        per ELBO evaluation (hand-over), for the optimizer to restore should it reject
        the step: a skipped or failed step leaves no trace in them.
        """
        handover = live_handover()
        if self._running_stats_handover == handover:
            return
        buffers = [buffer for m in self._batch_norms if m.training and m.track_running_stats
                   for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
                   if buffer is not None]
        if not buffers:
            return
        self._running_stats_handover = handover
        saved = [buffer.clone() for buffer in buffers]
        on_rejected(lambda: torch._foreach_copy_(buffers, saved))

    # ------------------------------------------------------------ fast path

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
        :class:`~pyro_ngvi.family.SiteCurvature` ``(g, h, m_0, 1/s_0^2, sigma)`` to
        each site's unconstrained ``loc`` in the param store: the Normal prior is
        conjugate and left to the optimizer (with ``learn_prior``, the
        :class:`~pyro_ngvi.family.PriorParam` of the site's learned scale too,
        which the optimizer sets in closed form). Point-estimated params (a learned
        noise scale, ``BatchNorm``) get the gradient of the particle average of
        :math:`\\ell` in ``.grad``. The guide's locs are read through ``pyro.param``
        statements, so ``SVI.step`` hands them to the optimizer, which finds each
        scale by name; all sites are handled as one flat vector (one sample
        kernel, one copy into the net, one reduction for the ELBO value).

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


def _norm_weights(compact) -> Optional[torch.Tensor]:
    """:attr:`WeightPrior.norm_weights` of the per-site ``(m_0, lambda_0)``."""
    if not all(loc is None and precision.numel() == 1 for loc, precision in compact):
        return None
    precisions = torch.cat([precision.reshape(1) for _, precision in compact])
    return torch.cat([0.5 * precisions, torch.full_like(precisions, -0.5)])


def _as_loc_scale(spec, weight: _Weight) -> Tuple[torch.Tensor, torch.Tensor]:
    """A prior spec as ``(loc, scale)`` tensors of the weight's dtype and device."""
    if isinstance(spec, torch.distributions.Independent):
        spec = spec.base_dist
    if isinstance(spec, torch.distributions.Normal):
        loc, scale = spec.loc, spec.scale
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        loc, scale = spec
    elif isinstance(spec, (int, float, torch.Tensor)):
        loc, scale = 0.0, spec
    else:
        raise TypeError(
            f"Prior of site {weight.site!r}: expected a scale, a (loc, scale) pair "
            f"or a Normal distribution, got {type(spec).__name__}"
        )
    param = weight.param
    loc, scale = (
        torch.as_tensor(v, dtype=param.dtype, device=param.device).detach().clone()
        for v in (loc, scale)
    )
    try:
        shape = torch.broadcast_shapes(loc.shape, scale.shape, param.shape)
    except RuntimeError:
        shape = None
    if shape != param.shape:
        raise ValueError(
            f"Prior of site {weight.site!r}: loc {tuple(loc.shape)} and scale "
            f"{tuple(scale.shape)} do not broadcast to the weight's shape {tuple(param.shape)}"
        )
    if not torch.isfinite(loc).all():
        raise ValueError(f"Prior of site {weight.site!r}: the loc must be finite")
    if not (torch.isfinite(scale) & (scale > 0)).all():
        raise ValueError(f"Prior of site {weight.site!r}: the scale must be positive and finite")
    return loc, scale


def _calling_svi(depth: int = 64):
    """The :class:`pyro.infer.SVI` whose ``step`` (or ``evaluate_loss``) is on the call stack, or ``None``."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, SVI):
            return owner
        frame = frame.f_back
    return None


def _is_positive(constraint) -> bool:
    """Whether ``constraint`` is ``constraints.positive``, or a copy of it (a param store
    loaded from a file holds unpickled copies, not the singleton)."""
    return constraint is constraints.positive or (
        type(constraint) is type(constraints.positive) and constraint.lower_bound == 0)


def _fan_in(module: nn.Module) -> Optional[int]:
    """The fan-in of a layer with a weight of two or more dimensions (``Linear``, ``Conv*``:
    the inputs each output sums over), else ``None``."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or isinstance(module, nn.Embedding):
        return None
    return weight[0].numel()


def _positive_finite(name: str, value) -> float:
    """``value`` as a float, or a ValueError naming ``name`` unless it is a positive finite number."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        0 < value < math.inf
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)
