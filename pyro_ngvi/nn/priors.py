"""
The prior of a :class:`~pyro_ngvi.BayesianNet`'s weights,
:math:`w_j \\sim \\mathcal{N}(m_{0j}, s_{0j}^2)` element-wise: as given (a scale, a
``(loc, scale)`` pair or a ``Normal`` per site, kept as buffers of the model), or
with each tensor's scale a positive ``pyro.param`` ``"<site>.prior_scale"`` learned
by the evidence (``learn_prior``): :class:`~pyro_ngvi.NGVI` sets it after every step
to the maximiser of the ELBO given the guide,

.. math:: s_{0j}^2 = \\frac{1}{D_j} \\sum_{i=1}^{D_j} \\left[(\\mu_{ji} - m_{0ji})^2 + \\sigma_{ji}^2\\right],

and the prior stays conjugate (type-II maximum likelihood of the ELBO, variational
EM; one prior precision per weight tensor), on the fast path and the traced path
alike. Unlike :func:`~pyro_ngvi.optimize_prior_precision` (the Laplace evidence of a
MAP fit over a grid of candidates, one refit each), this maximises the ELBO of the
Gaussian being trained, continuously, at the cost of a few reductions per step. At
the start the guide is the network's initialisation with a small scale, whose
maximiser is that initialisation's scale (about :math:`1/\\sqrt{\\text{fan-in}}`):
the priors shrink before the data has moved the weights. ``learn_prior`` is read at
every step and may be switched on later (the learned scales then start at
``prior``), but with NGVI's minibatch defaults a warm-up does not prevent the
collapse: each tensor's scale falls to that of its weights, the means shrink, and
the network switches off. :class:`WeightPrior` is the view one step of the fast
path uses.
"""

import itertools
import numbers
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

import pyro
from pyro.distributions import constraints

from ..family import PriorParam
from ..priors import _weight_prior_loc_scale
from .weights import Weight

PriorSpec = Union[float, torch.Tensor, Tuple, torch.distributions.Distribution]
_PRIOR_VERSIONS = itertools.count()


class WeightPrior(NamedTuple):
    """The Normal prior of all weights of a :class:`~pyro_ngvi.BayesianNet` as one fast-path step uses it."""

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


class WeightPriors:
    """
    The prior part of :class:`~pyro_ngvi.BayesianNet` (a mixin of the model: it
    reads ``_latents``, the ``Weight`` s (``pyro_ngvi.nn.weights``) of the latent
    sites, and registers its buffers on the model).
    """

    @property
    def learn_prior(self) -> bool:
        """Whether the prior scales are learned (read at every step; may be set, e.g. after a warm-up)."""
        return self._learn_prior

    @learn_prior.setter
    def learn_prior(self, value) -> None:
        if not isinstance(value, bool):  # a string "no" would switch it on
            raise ValueError(f"learn_prior must be True or False, got {value!r}")
        self._learn_prior = value

    def prior(self, site: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """Prior ``(loc, scale)`` of a latent site now, broadcastable to its shape (with
        ``learn_prior``, the learned scale's current value, detached)."""
        index = self._latent_index(site)
        return self._prior_buffers(index)[0], self._prior_scale(index).detach()

    def _priors_with(self, priors) -> dict:
        """Every latent site's prior spec now, with those of ``priors``
        (``{site: distribution}``) replacing theirs (see :meth:`BayesianNet.with_priors`)."""
        if not isinstance(priors, dict):
            raise PriorTypeError(f"priors must be a dict of distributions, got {type(priors).__name__}")
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
        return specs

    def _set_priors(self, prior) -> None:
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
        # every entry checked before any is written: a refused prior leaves the old one whole
        specs = [_as_loc_scale(prior[weight.site] if isinstance(prior, dict) else prior, weight)
                 for weight in self._latents]
        for index, (weight, (loc, scale)) in enumerate(zip(self._latents, specs)):
            self.register_buffer(f"_prior_loc_{index}", loc)
            self.register_buffer(f"_prior_scale_{index}", scale)
            self.register_buffer(f"_prior_precision_{index}", scale.pow(-2))
            # sum of log s_0 over the weight's elements, the prior's normaliser
            log_scale_sum = scale.log().expand(weight.param.shape).sum()
            self.register_buffer(f"_prior_log_scale_sum_{index}", log_scale_sum)
        like = self._latents[0].param
        total = sum(getattr(self, f"_prior_log_scale_sum_{j}") for j in range(len(self._latents)))
        self.register_buffer("_prior_log_scale_total", torch.as_tensor(total, dtype=like.dtype))

    def set_prior(self, prior) -> None:
        """Replace the prior on the weights (``prior`` as in the constructor: a scale, or a dict
        per site); the model's next run and the fast path's next step use it (e.g. a prior set
        by an evidence estimate between steps, ``benchmarks/smalldata_probe.py``). A
        :class:`~pyro_ngvi.KroneckerNormal`'s next step folds the new prior into its factors
        whole and keeps their data part (unfolded with the prior they were folded with)."""
        self._set_priors(prior)
        self._forget_priors()

    def _forget_priors(self) -> None:
        """Drop the cached views of the buffers (``.to()``, ``.double()``, ... replace them) and
        give the prior a new :attr:`_prior_version` (a Kronecker step keys its priors by it)."""
        self._prior_cache = self._flat_prior_cache = self._prior_index_cache = None
        self._prior_version = next(_PRIOR_VERSIONS)

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

    def _prior_scale_name(self, weight: Weight) -> str:
        return weight.site + ".prior_scale"

    def _learned_scale(self, index: int) -> torch.Tensor:
        """The ``pyro.param`` holding the prior scale of the ``index``-th site (learned)."""
        initial = self._prior_buffers(index)[1]
        return pyro.param(self._prior_scale_name(self._latents[index]),
                          lambda: initial.clone(), constraint=constraints.positive)

    def _prior_scale(self, index: int) -> torch.Tensor:
        """The prior scale of the ``index``-th site now: the learned param or the given one."""
        return self._learned_scale(index) if self.learn_prior else self._prior_buffers(index)[1]

    def _weight_prior(self) -> WeightPrior:
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

    def _fixed_prior(self) -> WeightPrior:
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


class PriorTypeError(TypeError, ValueError):
    """A prior given as something that is not one: a ``TypeError`` (its type) that is also the
    ``ValueError`` every bad argument of the package raises."""


def _norm_weights(compact) -> Optional[torch.Tensor]:
    """:attr:`WeightPrior.norm_weights` of the per-site ``(m_0, lambda_0)``."""
    if not all(loc is None and precision.numel() == 1 for loc, precision in compact):
        return None
    precisions = torch.cat([precision.reshape(1) for _, precision in compact])
    return torch.cat([0.5 * precisions, torch.full_like(precisions, -0.5)])


def _as_loc_scale(spec, weight: Weight) -> Tuple[torch.Tensor, torch.Tensor]:
    """A prior spec as ``(loc, scale)`` tensors of the weight's dtype and device."""
    if isinstance(spec, torch.distributions.Independent):
        spec = spec.base_dist
    if isinstance(spec, torch.distributions.Normal):
        loc, scale = spec.loc, spec.scale
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        loc, scale = spec
    elif isinstance(spec, (numbers.Real, torch.Tensor)) and not isinstance(spec, bool):
        loc, scale = 0.0, spec
    else:
        raise PriorTypeError(
            f"Prior of site {weight.site!r}: expected a scale, a (loc, scale) pair "
            f"or a Normal distribution, got {type(spec).__name__}"
        )
    param = weight.param
    try:
        if any(isinstance(v, (bool, str, bytes)) for v in (loc, scale)):
            raise TypeError
        loc, scale = (torch.as_tensor(v, dtype=param.dtype, device=param.device).detach().clone()
                      for v in (loc, scale))
    except (TypeError, ValueError, RuntimeError) as error:
        raise PriorTypeError(f"Prior of site {weight.site!r}: loc and scale must be numbers or tensors, got "
                             f"{loc!r} and {scale!r}") from error
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
        raise ValueError(f"prior: the scale of site {weight.site!r} must be positive and finite")
    return loc, scale


def _is_positive(constraint) -> bool:
    """Whether ``constraint`` is ``constraints.positive``, or a copy of it (a param store
    loaded from a file holds unpickled copies, not the singleton)."""
    return constraint is constraints.positive or (
        type(constraint) is type(constraints.positive) and constraint.lower_bound == 0)
