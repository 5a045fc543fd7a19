"""
The noise limit of a :class:`~pyro_ngvi.BayesianNet`'s variational family: the
weight noise may add at most :math:`v` of the signal's variance along the network,
:math:`v / L` per layer with a fan-in (:math:`L` of them), so a weight of a layer
with fan-in :math:`n` has

.. math:: \\sigma \\le \\sqrt{v / (L n)}, \\qquad \\text{i.e.} \\quad
          \\lambda \\ge \\lambda_{\\min} = L n / v,

which :class:`~pyro_ngvi.NGVI` keeps (the step projected on the family). A
mean-field Gaussian whose scales sit at a wide prior's swamps every unit with
noise and predicts little better than chance. The floor reaches NGVI through
:meth:`NoiseLimit.statistics_hints`, with the data size :math:`N` the minibatch
statistics stand for (NGVI's minibatch defaults follow from it).

With ``noise_limit_mode="mean"`` the signal of a weight is its own mean where that is
larger than a weight of variance :math:`1/n`:

.. math:: \\sigma_{ij}^2 \\le \\frac{v}{L}\\,\\max\\big(\\mu_{ij}^2, 1/n\\big), \\qquad
          \\lambda_{ij} \\ge \\frac{L}{v \\max(\\mu_{ij}^2, 1/n)}

(a bias: :math:`\\mu_{ij}^2` replaced by the mean square weight of its unit :math:`i`), taken
from the guide's means as the fast path reads them, so the floor follows the means step by
step: a large weight's noise is multiplicative (Gaussian dropout of rate :math:`v/L`), a small
one keeps the fixed limit. A network cannot make its noise negligible by growing its weights,
as it can under the fixed limit, which is how the recipe over-fits small data with training
(``benchmarks/results/smalldata_noise_mode.md``).
The family then moves with its mean: the objective is not exactly the ELBO of one family,
so NGVI's ELBO watch is not fed on that path.
"""

import math
from typing import Dict, List, Optional

import torch

from .checks import positive_finite
from .weights import fan_in


#: What :attr:`NoiseLimit.noise_limit` may be relative to.
NOISE_LIMIT_MODES = ("fan_in", "mean")


class NoiseLimit:
    """
    The noise limit and statistics hints of :class:`~pyro_ngvi.BayesianNet` (a mixin
    of the model: it reads ``_latents`` and ``effective_num_data``).
    """

    @property
    def noise_limit(self) -> Optional[float]:
        """:math:`v`, the variance the weight noise may add to a unit (``None``: no limit; may be set)."""
        return self._noise_limit

    @noise_limit.setter
    def noise_limit(self, value) -> None:
        self._noise_limit = None if value is None else positive_finite("noise_limit", value)
        self._forget_noise_floor()

    @property
    def noise_limit_mode(self) -> str:
        """What :attr:`noise_limit` is relative to: ``"fan_in"`` or ``"mean"`` (may be set)."""
        return self._noise_limit_mode

    @noise_limit_mode.setter
    def noise_limit_mode(self, value) -> None:
        if value not in NOISE_LIMIT_MODES:
            raise ValueError(f"noise_limit_mode must be one of {', '.join(map(repr, NOISE_LIMIT_MODES))}, got {value!r}")
        self._noise_limit_mode = value
        self._forget_noise_floor()

    def _forget_noise_floor(self) -> None:
        """Drop the cached floor (a new limit; ``.to()``, ``.double()``, ... change the weights)."""
        self._noise_floor_cache = None

    def max_scale(self, site: str) -> Optional[float]:
        """
        The largest standard deviation :attr:`noise_limit` allows the weights of
        ``site``, :math:`\\sqrt{v / (L n)}` with :math:`n` the fan-in of its layer and
        :math:`L` the number of layers with a fan-in (``None`` when unlimited, or
        when the layer has no fan-in: a weight of fewer than two dimensions, an
        embedding).

        :raises ValueError: when ``site`` is not one of ``latent_sites``.
        """
        weight = self._latents[self._latent_index(site)]
        layer_fan_in = fan_in(weight.module)
        if self.noise_limit is None or layer_fan_in is None:
            return None
        return math.sqrt(self.noise_limit / (self._layers_with_fan_in() * layer_fan_in))

    def _layers_with_fan_in(self) -> int:
        """:math:`L`, the number of layers with a fan-in."""
        return len({id(w.module) for w in self._latents if fan_in(w.module) is not None})

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

    def _mean_floor(self, means: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Per site, :math:`\\min(L n / v,\\ L / (v \\mu^2))` (the :meth:`_noise_floor`, lowered
        where the mean is larger than :math:`1/\\sqrt n`) from the guide's ``means`` (one per latent
        site, in order; a bias: its unit's mean square weight), ``noise_limit_mode="mean"``;
        ``None`` without a limit."""
        fixed = self._noise_floor()
        if fixed is None:
            return None
        ratio = self._layers_with_fan_in() / self.noise_limit
        weight_of = {id(w.module): mean for w, mean in zip(self._latents, means) if w.param_name == "weight"}
        floors = []
        with torch.no_grad():
            for w, mean, floor in zip(self._latents, means, fixed):
                weight = weight_of.get(id(w.module))
                if weight is None:  # (no weight to measure against: the fixed floor)
                    floors.append(floor)
                    continue
                square = mean.square() if weight is mean else \
                    weight.square().reshape(len(weight), -1).mean(1).reshape(mean.shape)
                # (a mean at 0: an infinite bound, the fixed floor; no fan-in: the fixed 0)
                floors.append(torch.minimum(floor, square.reciprocal_().mul_(ratio)))
        return floors

    def _site_hints(self, index: int, deterministic: bool, floors=None) -> Dict[str, object]:
        """:meth:`statistics_hints` of the ``index``-th latent site (``floors``: the fast path's
        :meth:`_mean_floor`)."""
        return self._sites_hints(deterministic, floors)[index]

    def _sites_hints(self, deterministic: bool, floors=None) -> List[Dict[str, object]]:
        """:meth:`statistics_hints` of every latent site, in order (``floors``: the fast path's
        :meth:`_mean_floor`)."""
        if deterministic:
            floors = None
        elif floors is None:
            if self.noise_limit_mode == "mean" and self.noise_limit is not None:
                raise NotImplementedError(
                    "BayesianNet(noise_limit_mode='mean') takes its noise floor from the guide's means, "
                    "which only the net's fast path reads (CurvatureELBO with the BayesianNet as SVI's model); "
                    "use noise_limit_mode='fan_in' on this path"
                )
            floors = self._noise_floor()
        num_data = self.effective_num_data
        if floors is None:
            return [{"num_data": num_data, "min_precision": None} for _ in self._latents]
        return [{"num_data": num_data, "min_precision": floor} for floor in floors]

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
        that is not one of ``latent_sites`` (another part of a bigger model):
        ``{}``, nothing to say, so that the hints of a net inside a bigger model can
        be given to that model (``model.statistics_hints = bnn.statistics_hints``, or
        merged with another net's).
        """
        if site not in self.latent_sites:
            return {}
        return self._site_hints(self.latent_sites.index(site), deterministic)

    @torch.no_grad()
    def share_at_noise_limit(self, guide, tolerance: float = 0.01) -> float:
        """
        The share of the weights with a noise limit whose standard deviation in ``guide`` (this
        net's :meth:`~pyro_ngvi.BayesianNet.guide`, trained) sits at it, :math:`\\sigma \\ge (1 - \\text{tolerance})
        \\,\\lambda_{\\min}^{-1/2}` (``nan`` without a limit). Near 1, the family is a point
        estimate with fixed jitter: its spread is the limit's, not what the data left uncertain,
        and longer training can over-fit as a MAP network does (the small-data pages of the docs).

        :param guide: this net's trained :meth:`~pyro_ngvi.BayesianNet.guide` (an AutoNormal).
        :param float tolerance: in :math:`(0, 1)` (default: 0.01).
        """
        tolerance = positive_finite("tolerance", tolerance)
        if tolerance >= 1:  # ((1 - tolerance)^2 below: a tolerance of 2 counted as one of 0)
            raise ValueError(f"tolerance must lie in (0, 1), got {tolerance!r}")
        if not hasattr(guide, "_get_loc_and_scale"):
            raise TypeError(f"guide must be this net's mean-field guide (bnn.guide(), an AutoNormal), got "
                            f"{type(guide).__name__}: the noise limit binds the mean-field family only")
        if not hasattr(guide, "locs"):
            raise ValueError("guide has not run yet: take a step (or call guide(x, y)) first")
        means_scales = [guide._get_loc_and_scale(site) for site in self.latent_sites]
        floors = (self._mean_floor([mean for mean, _ in means_scales]) if self.noise_limit_mode == "mean"
                  else self._noise_floor())
        if floors is None:
            return math.nan
        at, total = 0, 0
        for (_, scale), floor in zip(means_scales, floors):
            capped = floor > 0
            at += int((scale.square() * floor >= (1 - tolerance) ** 2)[capped].sum())
            total += int(capped.sum())
        return at / total if total else math.nan
