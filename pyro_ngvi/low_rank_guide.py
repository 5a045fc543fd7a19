"""
A guide whose precision is low rank plus diagonal (SLANG's family), the family that is
closed under the natural-gradient step (:mod:`pyro_ngvi.low_rank`), beside Pyro's
:class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`, whose *covariance* is low
rank plus diagonal (a family the step leaves: the inverse of diagonal plus low rank plus
a curvature is not diagonal plus low rank).
"""

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributions import transform_to
from torch.distributions.utils import lazy_property

import pyro
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn.module import PyroParam

from . import low_rank
from .arguments import check_callable
from .handover import live_handover

__all__ = ["LowRankCurvature", "LowRankPrecisionMultivariateNormal", "LowRankPrecisionNormal", "LowRankSite"]


class LowRankPrecisionMultivariateNormal(TorchDistribution):
    """
    :math:`\\mathcal{N}(\\mu, S^{-1})` with :math:`S = UU^\\top + \\mathrm{diag}(d)`, over vectors
    of size :math:`D`. Draws :math:`\\mu + S^{-1}(d^{1/2}\\epsilon + U\\xi)`, with
    :math:`\\epsilon \\sim \\mathcal{N}(0, I_D)` and :math:`\\xi \\sim \\mathcal{N}(0, I_k)`
    (exact, reparameterised, :math:`O(Dk^2)`: one :math:`k \\times k` Cholesky factor);
    :math:`\\log q` by the determinant lemma.

    :param torch.Tensor loc: :math:`\\mu`, ``(D,)``.
    :param torch.Tensor precision_factor: :math:`U`, ``(D, k)``.
    :param torch.Tensor precision_diag: :math:`d > 0`, ``(D,)``.
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "precision_factor": constraints.independent(constraints.real, 2),
        "precision_diag": constraints.independent(constraints.positive, 1),
    }
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc, precision_factor, precision_diag, validate_args=None, record=None):
        if loc.dim() != 1 or precision_factor.dim() != 2 or precision_diag.shape != loc.shape \
                or precision_factor.shape[0] != loc.shape[0]:
            raise ValueError(
                "LowRankPrecisionMultivariateNormal takes loc (D,), precision_factor (D, k) and "
                f"precision_diag (D,), got {tuple(loc.shape)}, {tuple(precision_factor.shape)} and "
                f"{tuple(precision_diag.shape)}")
        self.loc, self.precision_factor, self.precision_diag = loc, precision_factor, precision_diag
        self._record = record  # told every draw's displacement z (the guide's, for NGVI)
        super().__init__(torch.Size(), loc.shape, validate_args=validate_args)

    @lazy_property
    def _tril(self):
        return low_rank.capacitance_cholesky(self.precision_factor, self.precision_diag)

    def rsample(self, sample_shape=torch.Size()):
        shape = torch.Size(sample_shape)
        eps = torch.randn(shape + self.loc.shape, dtype=self.loc.dtype, device=self.loc.device)
        xi = torch.randn(shape + self.precision_factor.shape[-1:], dtype=self.loc.dtype, device=self.loc.device)
        z = low_rank.displacement(self.precision_factor, self.precision_diag, eps, xi, self._tril)
        if self._record is not None:
            self._record(z.detach())
        return self.loc + z

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        z = value - self.loc
        quadratic = (z * low_rank.precision_matvec(self.precision_factor, self.precision_diag, z)).sum(-1)
        size = self.loc.shape[-1]
        log_det = low_rank.log_det(self.precision_factor, self.precision_diag, self._tril)
        return -0.5 * (size * math.log(2 * math.pi) + quadratic - log_det)

    def entropy(self):
        size = self.loc.shape[-1]
        log_det = low_rank.log_det(self.precision_factor, self.precision_diag, self._tril)
        return 0.5 * (size * (1 + math.log(2 * math.pi)) - log_det)

    @property
    def mean(self):
        return self.loc

    @property
    def variance(self):
        return low_rank.marginal_variance(self.precision_factor, self.precision_diag, self._tril)

    @property
    def precision_matrix(self):
        return self.precision_factor @ self.precision_factor.T + torch.diag_embed(self.precision_diag)


class LowRankPrecisionNormal(AutoContinuous):
    """
    A Gaussian over the whole (unconstrained) latent vector :math:`u` of a model whose
    *precision* is low rank plus diagonal,

    .. math:: q(u) = \\mathcal{N}(\\mu, (UU^\\top + \\mathrm{diag}(d))^{-1}),

    SLANG's family [1]: the natural-gradient step keeps it (its precision moves by a moving
    average, projected back to rank :math:`k` with the diagonal exact,
    :func:`pyro_ngvi.low_rank.low_rank_step`). Works with ``SVI`` under any optimizer,
    ``median``, ``quantiles`` and :class:`~pyro.infer.Predictive`, as Pyro's
    ``AutoLowRankMultivariateNormal`` does.

    Params in the param store: ``<name>.loc`` (:math:`\\mu`, ``(D,)``),
    ``<name>.precision_factor`` (:math:`U`, ``(D, k)``) and ``<name>.precision_diag``
    (:math:`d`, ``(D,)``, softplus-positive).

    :param callable model: a Pyro model.
    :param callable init_loc_fn: per-site initial values (default: ``init_to_median``).
    :param float init_scale: initial standard deviation of every latent, about
        :math:`d^{-1/2}` (default: 0.1).
    :param int rank: :math:`k` (default: :math:`\\lceil\\sqrt{D}\\,\\rceil`, as Pyro's
        low-rank guide).

    **References**

    [1] `SLANG: Fast Structured Covariance Approximations for Bayesian Deep Learning with Natural Gradient`,
        Aaron Mishkin, Frederik Kunstner, Didrik Nielsen, Mark Schmidt, Mohammad Emtiyaz Khan
        (NeurIPS 2018)
    """

    diag_constraint = constraints.softplus_positive

    def __init__(self, model, init_loc_fn=init_to_median, init_scale: float = 0.1, rank=None):
        check_callable(model, "LowRankPrecisionNormal: model", "a Pyro model (a callable)")
        check_callable(init_loc_fn, "LowRankPrecisionNormal: init_loc_fn", "a function of a site, as Pyro's init_to_*")
        if not (isinstance(init_scale, float) and 0 < init_scale < math.inf):  # (a float, as Pyro's AutoNormal)
            raise ValueError(f"init_scale must be a positive float, got {init_scale!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1):
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        self._init_scale, self._rank = init_scale, None if rank is None else int(rank)
        super().__init__(model, init_loc_fn=init_loc_fn)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self.loc = torch.nn.Parameter(self._init_loc())
        size = self.latent_dim
        rank = self._rank if self._rank is not None else int(math.ceil(size**0.5))
        if rank > size:  # (a factor of more columns than coordinates: nothing more to represent)
            raise ValueError(f"rank must be at most the model's {size} latent coordinates, got {rank}")
        diag = torch.full_like(self.loc, self._init_scale**-2)
        # a small factor, not zero: gradient-based optimizers cannot leave U = 0 (a saddle)
        factor = 0.1 * self._init_scale**-1 * torch.randn(size, rank, dtype=self.loc.dtype,
                                                           device=self.loc.device) / rank**0.5
        self.precision_factor = torch.nn.Parameter(factor)
        self.precision_diag = PyroParam(diag, self.diag_constraint)

    def get_posterior(self, *args, **kwargs):
        return LowRankPrecisionMultivariateNormal(self.loc, self.precision_factor, self.precision_diag,
                                                  record=self._record_draw)

    def _record_draw(self, displacement: torch.Tensor) -> None:
        """Keep the latest draw made since NGVI's last step (under the live hand-over): its Price
        curvature needs the draw the ELBO's gradients were taken at, the last one before the step
        (a run of the guide between steps, ``Predictive`` or ``evaluate_loss``, comes before it)."""
        self._draws = (live_handover(), displacement)

    def draws(self) -> list:
        """The latest displacement :math:`z = u - \\mu` drawn since NGVI's last step (a list of
        one; empty when none was)."""
        kept = getattr(self, "_draws", None)
        return [] if kept is None or kept[0] != live_handover() else [kept[1]]

    def _loc_scale(self, *args, **kwargs):
        variance = low_rank.marginal_variance(self.precision_factor, self.precision_diag)
        return self.loc, variance.sqrt()


@dataclass
class LowRankCurvature:
    """
    The statistics of a :class:`LowRankSite` for one step: the gradient :math:`g` at the
    draw and the Price curvature :math:`\\hat H = G_+G_+^\\top - G_-G_-^\\top` as factors
    (:func:`~pyro_ngvi.low_rank.price_factors`), plus ``level`` :math:`c` times the current
    precision once the control variate (:func:`~pyro_ngvi.variance.low_rank_control_variate`)
    has used the ``displacement`` :math:`z` of the draw.
    """

    grad: torch.Tensor
    plus: torch.Tensor
    minus: torch.Tensor
    sampled: bool = True
    displacement: Optional[torch.Tensor] = None
    level: float = 0.0

    @property
    def tensors(self):
        return self.grad, self.plus, self.minus


@dataclass
class LowRankSite:
    """
    The tensors of a :class:`LowRankPrecisionNormal` in the param store, for an optimizer:
    ``loc`` :math:`\\mu`, ``raw_factor`` :math:`U` (unconstrained: the factor itself) and
    ``raw_diag`` (:math:`d` through its constraint's bijection), and the guide (its draws).
    """

    name: str
    loc: torch.Tensor
    raw_factor: torch.Tensor
    raw_diag: torch.Tensor
    diag_name: str
    guide: object = None

    @classmethod
    def of(cls, guide: LowRankPrecisionNormal) -> "LowRankSite":
        """The site of a set-up guide (its params read from the param store)."""
        store, prefix = pyro.get_param_store(), guide._pyro_name
        names = [f"{prefix}.{kind}" for kind in ("loc", "precision_factor", "precision_diag")]
        return cls(prefix, *(store._params[name] for name in names), names[2], guide)

    @property
    def key(self) -> str:
        return pyro.get_param_store().param_name(self.loc) or self.name

    @property
    def scale_name(self) -> str:  # the name by which NGVI checks the param store still holds it
        return self.diag_name

    @property
    def raw_scale(self) -> torch.Tensor:
        return self.raw_diag

    @torch.no_grad()
    def statistics(self, one_draw: bool, control_variate: bool = True) -> LowRankCurvature:
        """:math:`g` = ``loc.grad`` and the Price factors at the one draw the ELBO took (and the
        draw, for the control variate, with ``control_variate``).

        :raises ValueError: unless the gradients come from one draw (a one-particle
            ``Trace_ELBO``, ``TraceGraph_ELBO`` or ``TraceEnum_ELBO``), the only case where the draw they were taken at is known."""
        draws = self.guide.draws()
        if not one_draw or len(draws) != 1 or self.loc.grad is None:
            raise ValueError(
                f"NGVI's step for the LowRankPrecisionNormal '{self.name}' reads its curvature off the "
                "draw its gradients were taken at (Price's theorem): train it with a one-particle "
                "pyro.infer.Trace_ELBO, TraceGraph_ELBO or TraceEnum_ELBO ("
                + ("the loss is not one of those with num_particles=1" if not one_draw else
                   f"found {len(draws)} draws since the last step")  # (vectorised particles: one batched draw)
                + f"{'' if self.loc.grad is not None else ' and no gradient on its loc'}).")
        grad = self.loc.grad.detach()
        plus, minus = low_rank.price_factors(self.factor, self.diag, draws[0][None], grad[None])
        return LowRankCurvature(grad, plus, minus, displacement=draws[0].detach() if control_variate else None)

    @property
    def tensors(self):
        return self.loc, self.raw_factor, self.raw_diag

    @property
    def _diag_transform(self):
        return transform_to(pyro.get_param_store()._constraints[self.diag_name])

    @property
    def mean(self) -> torch.Tensor:
        return self.loc.detach()

    @property
    def factor(self) -> torch.Tensor:
        return self.raw_factor.detach()

    @property
    def diag(self) -> torch.Tensor:
        return self._diag_transform(self.raw_diag.detach())

    @torch.no_grad()
    def write(self, mean: torch.Tensor, factor: torch.Tensor, diag: torch.Tensor) -> None:
        """Set :math:`\\mu`, :math:`U` and :math:`d` in place."""
        self.loc.copy_(mean)
        self.raw_factor.copy_(factor)
        self.raw_diag.copy_(self._diag_transform.inv(diag))
