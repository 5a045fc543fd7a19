"""
:class:`BayesianNet`: a plain :class:`torch.nn.Module` network, a Normal prior on
its weights and a likelihood as a Pyro model ``model(x, y=None)`` (usable with any
autoguide, ``SVI`` and ``Predictive``),

.. math:: w_j \\sim \\mathcal{N}(m_{0j}, s_{0j}^2), \\qquad
          y_i \\mid x_i, w \\sim p(y_i \\mid f(x_i; w)), \\quad i = 1, \\dots, N.

Its pieces: :mod:`.weights` (which tensors are latent), :mod:`.priors`,
:mod:`.noise_limit` (and the statistics hints), :mod:`.guide`, :mod:`.checks`, and
the fast path it offers :class:`~pyro_ngvi.CurvatureELBO`
(:meth:`BayesianNet.curvature_step`, the protocol of
:mod:`pyro_ngvi.elbo.protocol`), served by :mod:`.fast_path`.
"""

import numbers
from typing import Dict, List, Optional, Union

import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.distributions import constraints

from .checks import InputChecks, positive_finite
from .fast_path import BackpackStep, FastPath
from .guide import GuideFactory
from .noise_limit import NoiseLimit
from .priors import PriorSpec, WeightPriors
from .twin import LOSS_MODULES
from .weights import RunningStatistics, Weight, call_with, network_weights, weight_slots


class BayesianNet(WeightPriors, NoiseLimit, GuideFactory, InputChecks, FastPath, nn.Module):
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
      ``(B, K)``, integer targets ``(B,)`` (or classes per position, ``(B, T, K)`` and ``(B, T)``:
      the fast path's ``ef`` and ``reparam`` take those, ``ggn`` / ``ggn_mc`` need ``(B, K)``);
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
    are restored should :class:`~pyro_ngvi.NGVI` skip the step (or the step fail).

    With ``learn_prior=True`` each weight tensor's prior scale :math:`s_{0j}` is a
    positive ``pyro.param`` ``"<site>.prior_scale"``, set by NGVI after every step
    to the maximiser of the ELBO given the guide,
    :math:`s_{0j}^2 = \\frac{1}{D_j} \\sum_i [(\\mu_{ji} - m_{0ji})^2 + \\sigma_{ji}^2]`
    (:mod:`pyro_ngvi.nn.priors`). ``augmentation_factor`` :math:`\\rho` models
    randomly transformed copies of the data as a data set of :math:`\\rho N`
    examples (for the fit, the same as ``NGVI(tau=1 / rho)``).

    **Training recipe**::

        guide = bnn.guide()                       # the network's weights, sigma = (lambda_0 + N)^-1/2
        svi = SVI(bnn, guide, NGVI(), CurvatureELBO("ggn"))   # or "ef", "ggn_mc", "reparam"

    The statistics the fast path hands over say that they are minibatch
    estimates for :math:`N` examples (NGVI's minibatch defaults follow), and the
    variational family is limited by ``noise_limit`` (:mod:`pyro_ngvi.nn.noise_limit`).
    Run inside another model, the net's hints reach the ELBO only through that
    model: ``model.statistics_hints = bnn.statistics_hints`` (the net warns
    :class:`~pyro_ngvi.NGVIWarning` once when NGVI would lose them).

    :param torch.nn.Module net: the plain network; its output for a batch ``x``
        is ``(B, ...)``. BackPACK curvature needs layers it has an extension for
        (``Linear``, ``Conv*``, ``ReLU`` / ``Tanh`` / ``Sigmoid`` / ``ELU`` / ...,
        ``Flatten``, pooling, ``Dropout``; not ``GELU``, ``SiLU`` or ``Softplus`` for ``ggn`` /
        ``ggn_mc``, except in an ``nn.Sequential`` MLP, whose curvature is computed in closed
        form) and, for ``ggn``/``ggn_mc``, a 2-d output; ``reparam`` needs none.
    :param str likelihood: ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    :param int num_data: size of the training set (before augmentation).
    :param prior: the prior on the weights: a positive scale :math:`s_0` for all
        weights (mean 0), or a dict from site name to a scale, a pair
        ``(loc, scale)`` of tensors broadcastable to the weight's shape, or a
        ``Normal`` distribution (e.g. a previous posterior), one entry per latent
        site (default: 1.0).
    :param noise_scale: fixed :math:`\\sigma` of the Gaussian likelihood, or
        ``None`` to learn it as the positive ``pyro.param`` ``"noise_scale"`` (prefixed
        ``"<name>."``) (default: None); only for ``"gaussian"``.
    :param float init_noise_scale: initial :math:`\\sigma` when learned (default: 1.0); only
        for ``"gaussian"``.
    :param str name: prefix of every site and param name (default: "").
    :param bool learn_prior: learn each weight tensor's prior scale by the
        evidence, starting at ``prior`` (default: False).
    :param float augmentation_factor: :math:`\\rho > 0`, the effective data size
        is ``round(rho * num_data)`` (default: 1.0).
    :param noise_limit: :math:`v > 0`, the most variance the guide's weight noise
        may add to the network's output, relative to the signal, for unit-variance
        inputs: each of the :math:`L` layers with a fan-in (``Linear``, ``Conv*``)
        may add :math:`v / L`, so the standard deviation of each weight of a layer
        with fan-in :math:`n` is at most :math:`\\sqrt{v / (L n)}`
        (:class:`~pyro_ngvi.NGVI` keeps the precision at least :math:`L n / v`);
        ``None`` lifts the limit (default: 1.0). A limit of the mean-field family: a
        :class:`~pyro_ngvi.KroneckerNormal` or full-covariance guide is not limited by it.
    :param str noise_limit_mode: what the limit is relative to: ``"fan_in"`` (above: weights
        of variance :math:`1/n`) or ``"mean"``, each weight's own mean where it is larger,
        :math:`\\sigma_{ij}^2 \\le (v/L)\\max(\\mu_{ij}^2, 1/n)` (a bias: its unit's mean square
        weight), kept as the means move (the fast path only; see
        :mod:`pyro_ngvi.nn.noise_limit`) (default: ``"fan_in"``).
    """

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
        noise_limit_mode: str = "fan_in",
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
            noise_scale = positive_finite("noise_scale", noise_scale)
        init_noise_scale = positive_finite("init_noise_scale", init_noise_scale)
        if likelihood != "gaussian" and (noise_scale is not None or init_noise_scale != 1.0):
            given = "noise_scale" if noise_scale is not None else "init_noise_scale"
            raise ValueError(f"{given} is the scale of the 'gaussian' likelihood; the {likelihood!r} "
                             "likelihood has no noise scale: leave it out")
        if not isinstance(name, str):
            raise ValueError(f"name must be a string, got {name!r}")
        self.net = net
        self.likelihood = likelihood
        self.noise_limit = noise_limit
        self.noise_limit_mode = noise_limit_mode
        self.num_data = num_data
        self.augmentation_factor = augmentation_factor
        self.learn_prior = learn_prior
        self.noise_scale = noise_scale
        self.init_noise_scale = init_noise_scale
        self.prefix = name + "." if name else ""
        self._running_stats = RunningStatistics(net)
        self._outer_model_warned = False  # run inside another model without its hints: warned
        self._outer_model_checked = None  # the hand-over (ELBO evaluation) last checked for that
        self._checked_targets = set()  # (y shape, y dtype, output shape) seen valid
        self._scale_checked = False  # the first batch with targets looked at for unstandardised data
        self._predict_mode_warned = False  # warned of a prediction with train-mode BatchNorm

        self._fast_path = BackpackStep(net, likelihood)

        self._latents, self._point_estimates = network_weights(net, self.prefix)
        self._latent_params = [w.param for w in self._latents]
        self._slots = weight_slots(net, self._latents + self._point_estimates)  # (checked at each fast step)
        self._forget_priors()
        self._set_priors(prior)

    @property
    def likelihood(self) -> str:
        """``"categorical"``, ``"bernoulli"`` or ``"gaussian"``: fixed at construction (the fast path's loss is
        built for it); setting another raises ``ValueError``."""
        return self._likelihood_kind

    @likelihood.setter
    def likelihood(self, value) -> None:
        current = getattr(self, "_likelihood_kind", value)
        if value != current:  # (the model would use the new one, the fast path its loss for the old: two models)
            raise ValueError(f"likelihood is fixed at construction ({current!r}: the fast path's loss is built for it), "
                             f"got {value!r}: make a new BayesianNet for another likelihood")
        self._likelihood_kind = value

    @property
    def noise_scale(self) -> Optional[float]:
        """The fixed :math:`\\sigma` of the Gaussian likelihood, or ``None`` when learned (a positive finite
        number or ``None``; may be set)."""
        return self._fixed_noise_scale

    @noise_scale.setter
    def noise_scale(self, value) -> None:
        if value is not None:
            value = positive_finite("noise_scale", value)
            if self.likelihood != "gaussian":
                raise ValueError(f"noise_scale is the scale of the 'gaussian' likelihood; the {self.likelihood!r} "
                                 "likelihood has none: leave it None")
        self._fixed_noise_scale = value

    @property
    def init_noise_scale(self) -> float:
        """The initial :math:`\\sigma` of a learned noise scale (a positive finite number; may be set)."""
        return self._init_noise_scale

    @init_noise_scale.setter
    def init_noise_scale(self, value) -> None:
        self._init_noise_scale = positive_finite("init_noise_scale", value)

    @property
    def num_data(self) -> int:
        """Size :math:`N` of the training set (a positive integer; may be set)."""
        return self._num_data

    @num_data.setter
    def num_data(self, value) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"num_data must be a positive integer, got {value!r}")
        self._num_data = int(value)
        self._effective_num_data = max(1, round(self._num_data * getattr(self, "_augmentation_factor", 1.0)))

    @property
    def augmentation_factor(self) -> float:
        """:math:`\\rho`, the effective data size is ``round(rho * num_data)`` (a positive number; may be set)."""
        return self._augmentation_factor

    @augmentation_factor.setter
    def augmentation_factor(self, value) -> None:
        self._augmentation_factor = positive_finite("augmentation_factor", value)
        self._effective_num_data = max(1, round(self._num_data * self._augmentation_factor))

    @property
    def effective_num_data(self) -> int:
        """The data plate's size :math:`N`: ``round(num_data * augmentation_factor)`` (at least 1; computed
        when either is set, read at every step)."""
        return self._effective_num_data

    @property
    def latent_sites(self) -> List[str]:
        """Names of the latent sites, one per weight tensor."""
        return [w.site for w in self._latents]

    def _latent_index(self, site: str) -> int:
        sites = self.latent_sites
        if site not in sites:
            raise ValueError(f"site {site!r} is not a latent site of this BayesianNet; its latent sites are {sites}")
        return sites.index(site)

    # ------------------------------------------------------------- the model
    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        The Pyro model: sample the weights from the prior, run the network on
        ``x`` and observe ``y`` (sample it when ``None``).

        :returns: the likelihood's parameter (logits or mean), batch first.
        :raises ValueError: for an empty batch, or ``y`` of another length than ``x``, or of
            a shape or dtype the likelihood does not take.
        """
        self._check_batch(x, y)
        self._warn_if_inside_another_model()
        if y is None:
            self._warn_if_predicting_in_training_mode()
        self._running_stats.keep_until_accepted()
        params = {}
        for index, weight in enumerate(self._latents):
            loc, scale = self._prior_buffers(index)[0], self._prior_scale(index)
            shape = weight.param.shape
            prior = dist.Normal(loc, scale).expand(shape).to_event(len(shape))
            value = pyro.sample(weight.site, prior)
            if value.shape != shape:  # (vectorised draws: Predictive(parallel=True), vectorize_particles)
                raise NotImplementedError(
                    f"BayesianNet runs its network on one draw of the weights at a time; site {weight.site!r} "
                    f"got a batch of draws of shape {tuple(value.shape)}: use Predictive(..., parallel=False) "
                    "and an ELBO with vectorize_particles=False")
            # (a network converted, .double(), after its guide was made: as its fast path writes the draws)
            params[weight.key] = value if value.dtype == weight.param.dtype else value.to(weight.param.dtype)
        for weight in self._point_estimates:
            params[weight.key] = self._point_estimate(weight)
        raw = call_with(self.net, params, x)
        output = self._likelihood_param(raw)
        self._check_output(output, len(x))
        if y is not None:  # (the shape and dtype, as on the fast path; the values are the log_prob's to check)
            self._check_targets(y, raw, values=False)
        likelihood = self._likelihood(output)
        subsample = torch.arange(len(x), device=x.device)
        with pyro.plate(self._site("data"), self.effective_num_data, subsample=subsample):
            pyro.deterministic(self._site("output"), output, event_dim=output.dim() - 1)
            pyro.sample(self._site("obs"), likelihood, obs=y)
        return output

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

    def _point_estimate(self, weight: Weight) -> torch.Tensor:
        return pyro.param(weight.site, lambda: weight.param.detach().clone())

    def _likelihood_param(self, output: torch.Tensor) -> torch.Tensor:
        """The network output as the likelihood's parameter (scalar outputs squeezed)."""
        if not torch.is_tensor(output):
            raise ValueError(f"BayesianNet: the network must return one tensor, batch first; it returned a "
                             f"{type(output).__name__} (an nn.LSTM returns (output, state): wrap it in a module "
                             "that returns the tensor to predict from)")
        if self.likelihood != "categorical" and output.dim() == 2 and output.shape[1] == 1:
            return output.squeeze(-1)
        return output

    def _likelihood(self, param: torch.Tensor) -> dist.Distribution:
        if self.likelihood == "categorical":
            return dist.Categorical(logits=param).to_event(param.dim() - 2)
        if self.likelihood == "bernoulli":
            return dist.Bernoulli(logits=param).to_event(param.dim() - 1)
        return dist.Normal(param, self._noise_scale()).to_event(param.dim() - 1)

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
        ``num_data``, ``augmentation_factor``, ``noise_limit`` (and its mode), the likelihood, the
        noise scale and the name are kept (``num_data`` may be set when
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
        :returns: a new :class:`BayesianNet` sharing ``net`` with this one.
        """
        new = BayesianNet(
            self.net,
            self.likelihood,
            self.num_data,
            prior=self._priors_with(priors),
            noise_scale=self.noise_scale,
            init_noise_scale=self.init_noise_scale,
            name=self.prefix[:-1],
            augmentation_factor=self.augmentation_factor,
            noise_limit=self.noise_limit,
            noise_limit_mode=self.noise_limit_mode,
        )
        new.training = self.training  # not .train(): that would also set the shared net
        return new

    def _apply(self, fn, *args, **kwargs):
        # .to(), .double(), ... replace the buffers
        self._forget_priors()
        self._forget_noise_floor()
        module = super()._apply(fn, *args, **kwargs)
        self._fast_path.refresh()  # the shared parameter dicts may hold new tensors
        self._latent_params = [w.param for w in self._latents]
        self._slots = weight_slots(self.net, self._latents + self._point_estimates)
        return module
