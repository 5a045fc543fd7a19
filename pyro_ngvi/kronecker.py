"""
Kronecker-factored Gaussians for the layers of a network (noisy K-FAC, Zhang
et al. 2018): a guide whose every fully-connected layer is a matrix normal, and
the natural-gradient step on its Kronecker-factored precision
(:func:`pyro_ngvi.update.kronecker.kronecker_step`).

A layer :math:`z = W a + b` with ``n`` outputs and ``m`` inputs is one matrix
:math:`\\bar W = [W, b]` of shape ``(n, p)``, :math:`p = m + 1` (``p = m``
without a bias), acting on :math:`\\bar a = (a, 1)`. Its guide is

.. math:: q(\\bar W) = \\mathcal{MN}(M, U, V), \\qquad
          \\mathrm{vec}(\\bar W) \\sim \\mathcal{N}\\big(\\mathrm{vec}(M),\\,
          U \\otimes V\\big), \\quad U = G_\\gamma^{-1}, \\; V = A_\\gamma^{-1},

(row-major ``vec``), so its precision is :math:`G_\\gamma \\otimes A_\\gamma`. The
generalised Gauss-Newton block of the layer is approximated by K-FAC,

.. math:: H \\approx \\sum_{i=1}^N G_i \\otimes \\bar a_i \\bar a_i^\\top
          \\approx \\hat G \\otimes \\hat A, \\qquad
          \\hat A = \\tfrac1B \\sum_{i \\in B} \\bar a_i \\bar a_i^\\top, \\quad
          \\hat G = \\tfrac{N}{B} \\sum_{i \\in B} J_i^\\top H_i J_i,

(:math:`J_i` the Jacobian of the network output w.r.t. :math:`z_i`; BackPACK's
``KFLR`` gives :math:`\\hat G` exactly, ``KFAC`` a one-sample Monte-Carlo
estimate). The step keeps moving averages of the two factors,

.. math:: A' = (1-\\beta) A + \\beta \\hat A, \\qquad
          G' = (1-\\beta) G + \\beta \\hat G / \\tau,

and folds an element-wise Normal prior with precision :math:`\\eta_j` on column
:math:`j` (one number per weight site), i.e. :math:`S_0 = I_n \\otimes D`,
:math:`D = \\mathrm{diag}(\\eta_j)`, into the factors as Zhang et al. do:

.. math:: A_\\gamma = A' + \\pi D, \\qquad G_\\gamma = G' + \\pi^{-1} I, \\qquad
          \\pi^2 = \\frac{\\mathrm{tr}(A') / \\mathrm{tr}(D)}{\\mathrm{tr}(G') / n},

so that :math:`G_\\gamma \\otimes A_\\gamma = G' \\otimes A' + I \\otimes D +
(\\pi^{-1} A' \\otimes I + \\pi\\, G' \\otimes D)`: the prior exactly, plus the
damping of the last bracket (balanced by :math:`\\pi`). The mean takes the
natural-gradient step under that precision,

.. math:: M' = M - \\alpha\\, G_\\gamma^{-1} \\big(\\bar g + (M - M_0) D\\big) A_\\gamma^{-1}.

Both :math:`A'` and :math:`G'` are recovered from the guide itself (no
optimizer state): given :math:`A_\\gamma, G_\\gamma` and :math:`D`,
:math:`\\pi^2 = n\\,\\mathrm{tr}(A_\\gamma) / (\\mathrm{tr}(D)\\,\\mathrm{tr}(G_\\gamma))`
(:func:`unfold_prior`).

**References**

[1] `Noisy Natural Gradient as Variational Inference`, Guodong Zhang, Shengyang
    Sun, David Duvenaud, Roger Grosse (ICML 2018)
[2] `Optimizing Neural Networks with Kronecker-factored Approximate Curvature`,
    James Martens, Roger Grosse (ICML 2015)
[3] `BackPACK: Packing more into Backprop`, Felix Dangel, Frederik Kunstner,
    Philipp Hennig (ICLR 2020)
"""

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch.distributions import constraints, transform_to

import pyro
import pyro.distributions as dist
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn.module import PyroModule, PyroParam

from .arguments import check_callable


__all__ = ["KroneckerCurvature", "KroneckerLayer", "KroneckerNormal", "KroneckerSite", "MatrixNormal", "fold_prior",
           "unfold_prior"]


# --------------------------------------------------------------------------- #
# The matrix normal distribution
# --------------------------------------------------------------------------- #


class MatrixNormal(TorchDistribution):
    """
    :math:`X = M + L_U Z L_V^\\top`, :math:`Z` standard normal of shape ``(n, p)``:
    :math:`\\mathrm{vec}(X) \\sim \\mathcal{N}(\\mathrm{vec}(M), U \\otimes V)`
    (row-major ``vec``), :math:`U = L_U L_U^\\top`, :math:`V = L_V L_V^\\top`,

    .. math:: \\log q(X) = -\\tfrac{np}{2}\\log 2\\pi - p \\sum_i \\log (L_U)_{ii}
              - n \\sum_j \\log (L_V)_{jj} - \\tfrac12 \\|L_U^{-1}(X - M) L_V^{-\\top}\\|^2.

    :param loc: :math:`M`, shape ``(n, p)``.
    :param row_scale_tril: :math:`L_U`, ``(n, n)`` lower triangular.
    :param col_scale_tril: :math:`L_V`, ``(p, p)`` lower triangular.
    """

    arg_constraints = {"loc": constraints.real, "row_scale_tril": constraints.lower_cholesky,
                       "col_scale_tril": constraints.lower_cholesky}
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(self, loc, row_scale_tril, col_scale_tril, validate_args=None):
        self.loc, self.row_scale_tril, self.col_scale_tril = loc, row_scale_tril, col_scale_tril
        super().__init__(loc.shape[:-2], loc.shape[-2:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(MatrixNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new.loc = self.loc.expand(batch_shape + self.event_shape)
        new.row_scale_tril, new.col_scale_tril = self.row_scale_tril, self.col_scale_tril
        super(MatrixNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def rsample(self, sample_shape=torch.Size()):
        return self.transform(torch.randn(self._extended_shape(sample_shape), dtype=self.loc.dtype,
                                          device=self.loc.device))

    def transform(self, noise: torch.Tensor) -> torch.Tensor:
        """:math:`M + L_U Z L_V^\\top` for standard-normal ``noise`` :math:`Z`."""
        return self.loc + self.row_scale_tril @ noise @ self.col_scale_tril.transpose(-1, -2)

    def noise_log_prob(self, noise: torch.Tensor) -> torch.Tensor:
        """:math:`\\log q` at :meth:`transform` ``(noise)``, without solving for the noise."""
        n, p = self.event_shape
        log_det = (p * self.row_scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
                   + n * self.col_scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1))
        return -0.5 * noise.square().sum((-1, -2)) - log_det - 0.5 * n * p * math.log(2 * math.pi)

    def log_prob(self, value):
        # Z = L_U^{-1} (X - M) L_V^{-T}
        noise = torch.linalg.solve_triangular(self.row_scale_tril, value - self.loc, upper=False)
        noise = torch.linalg.solve_triangular(self.col_scale_tril, noise.transpose(-1, -2),
                                              upper=False).transpose(-1, -2)
        return self.noise_log_prob(noise)

    @property
    def mean(self):
        return self.loc


# --------------------------------------------------------------------------- #
# The guide
# --------------------------------------------------------------------------- #


class KroneckerLayer(NamedTuple):
    """A fully-connected layer as a model offers it (``model.kronecker_layers()``)."""

    name: str  # the layer's name (e.g. "0" for the first module of a Sequential)
    weight_site: str
    bias_site: Optional[str]
    out_features: int
    in_features: int


class KroneckerNormal(AutoGuide):
    """
    A guide with one matrix normal per fully-connected layer of a network model
    (see the module docstring): :math:`\\bar W = [W, b] \\sim \\mathcal{MN}(M, U,
    V)`, sampled as an auxiliary site per layer and split into the layer's
    weight and bias sites (``Delta``). Works with ``SVI`` (any optimizer; with
    :class:`~pyro_ngvi.NGVI` and :class:`~pyro_ngvi.CurvatureELBO` ``"ggn"``
    (``KFLR``) or ``"ggn_mc"`` (``KFAC``) on a model's own fast path it takes
    noisy K-FAC steps) and :class:`~pyro.infer.Predictive`.

    The model says which layers it has through a small protocol:
    ``model.kronecker_layers()`` returns :class:`~pyro_ngvi.kronecker.KroneckerLayer` s, and every
    latent site of the model must be the weight or bias of one of them
    (:meth:`~pyro_ngvi.BayesianNet.kronecker_layers` serves it for networks of
    ``Linear`` layers).

    Parameters in the param store, per layer ``L``: ``<name>.locs.L`` (``(n, p)``),
    ``<name>.row_scale_tril.L`` (:math:`L_U`, ``(n, n)``) and
    ``<name>.col_scale_tril.L`` (:math:`L_V`, ``(p, p)``), lower Cholesky factors.

    :param model: a model with ``kronecker_layers()``, e.g. a
        :class:`~pyro_ngvi.BayesianNet` of ``Linear`` layers.
    :param callable init_loc_fn: per-site initial values (default: the model's
        ``init_loc_fn`` if it has one, e.g. the network's current weights, else
        ``init_to_feasible``).
    :param float init_scale: initial standard deviation of every weight,
        :math:`\\sqrt{U_{ii} V_{jj}}` (default: 0.1).
    """

    def __init__(self, model, init_loc_fn=None, init_scale: float = 0.1):
        check_callable(model, "KroneckerNormal: model", "a BayesianNet of Linear layers")  # (a number is no model)
        layers = getattr(model, "kronecker_layers", None)
        if not callable(layers):
            raise NotImplementedError(
                f"KroneckerNormal needs a model that offers kronecker_layers() (a BayesianNet of "
                f"Linear layers), got {type(model).__name__}"
            )
        if not (isinstance(init_scale, float) and 0 < init_scale < math.inf):  # (a float, as Pyro's AutoNormal)
            raise ValueError(f"init_scale must be a positive float, got {init_scale!r}")
        self.layers: List[KroneckerLayer] = list(layers())
        if not (init_loc_fn is None or callable(init_loc_fn)):  # (else a TypeError at the first call)
            raise ValueError(f"init_loc_fn must be a callable of the site or None, got {init_loc_fn!r}")
        self.init_loc_fn = init_loc_fn or getattr(model, "init_loc_fn", init_to_feasible)
        self._init_scale = init_scale
        super().__init__(model)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        covered = {s for layer in self.layers for s in (layer.weight_site, layer.bias_site) if s}
        latent = [name for name, _ in self.prototype_trace.iter_stochastic_nodes()]
        if set(latent) != covered:
            raise NotImplementedError(
                "KroneckerNormal covers the weights and biases of fully-connected layers only; the "
                f"model's latent sites {sorted(set(latent) - covered)} belong to no such layer"
            )
        self.locs, self.row_scale_tril, self.col_scale_tril = PyroModule(), PyroModule(), PyroModule()
        factor = math.sqrt(self._init_scale)
        for layer in self.layers:
            nodes = self.prototype_trace.nodes
            weight = self.init_loc_fn(nodes[layer.weight_site]).detach()
            columns = [weight] if layer.bias_site is None else [
                weight, self.init_loc_fn(nodes[layer.bias_site]).detach().unsqueeze(-1)]
            loc = torch.cat(columns, -1)
            n, p = loc.shape
            eye = torch.eye(n, dtype=loc.dtype, device=loc.device), torch.eye(p, dtype=loc.dtype, device=loc.device)
            deep_setattr(self.locs, layer.name, PyroParam(loc, constraints.real, 2))
            deep_setattr(self.row_scale_tril, layer.name, PyroParam(factor * eye[0], constraints.lower_cholesky))
            deep_setattr(self.col_scale_tril, layer.name, PyroParam(factor * eye[1], constraints.lower_cholesky))

    def get_layer(self, name: str) -> MatrixNormal:
        """The matrix normal of layer ``name``."""
        loc, row, col = (attrgetter(name)(part) for part in (self.locs, self.row_scale_tril, self.col_scale_tril))
        layer = next(layer for layer in self.layers if layer.name == name)
        n, p = layer.out_features, layer.in_features + (layer.bias_site is not None)
        if (loc.shape, row.shape, col.shape) != ((n, p), (n, n), (p, p)):
            raise ValueError(
                f"KroneckerNormal: the param store holds layer {name!r}'s mean of shape {tuple(loc.shape)}, "
                f"factors {tuple(row.shape)} and {tuple(col.shape)}; the layer needs ({n}, {p}), ({n}, {n}) and "
                f"({p}, {p}): a guide of another model named {self._pyro_name!r} (or a loaded param store) left "
                "them there. Call pyro.clear_param_store() or give this guide another name")
        return MatrixNormal(loc, row, col)

    def forward(self, *args, **kwargs):
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        result = {}
        for layer in self.layers:
            value = pyro.sample(f"_{self._pyro_name}.{layer.name}_latent", self.get_layer(layer.name),
                                infer={"is_auxiliary": True})
            result.update(self._split(layer, value))
        return result

    def _split(self, layer: KroneckerLayer, value: torch.Tensor, sample: bool = True):
        weight = value[..., : layer.in_features]
        parts = {layer.weight_site: weight}
        if layer.bias_site is not None:
            parts[layer.bias_site] = value[..., layer.in_features]
        if not sample:
            return parts
        return {site: pyro.sample(site, dist.Delta(part, event_dim=part.dim() - (value.dim() - 2)))
                for site, part in parts.items()}

    @torch.no_grad()
    def median(self, *args, **kwargs):
        """The means :math:`M`, split into the weight and bias sites."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        result = {}
        for layer in self.layers:
            result.update(self._split(layer, attrgetter(layer.name)(self.locs).detach(), sample=False))
        return result


# --------------------------------------------------------------------------- #
# The Gaussian site NGVI updates, and what an ELBO hands it
# --------------------------------------------------------------------------- #


@dataclass
class KroneckerSite:
    """
    One layer of a :class:`KroneckerNormal` as stored in the param store: ``loc``
    :math:`M` and the raw (unconstrained) lower Cholesky factors of :math:`U`
    and :math:`V`.
    """

    name: str
    loc: torch.Tensor
    raw_row_scale_tril: torch.Tensor
    row_name: str
    raw_col_scale_tril: torch.Tensor
    col_name: str

    def __post_init__(self):
        self.key = pyro.get_param_store().param_name(self.loc) or self.name

    @property
    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self.loc, self.raw_row_scale_tril, self.raw_col_scale_tril

    def _transform(self, name):
        return transform_to(pyro.get_param_store()._constraints[name])

    @property
    def mean(self) -> torch.Tensor:
        return self.loc.detach()

    @property
    def row_factor(self) -> torch.Tensor:
        """:math:`L_U`, the lower Cholesky factor of :math:`U = G_\\gamma^{-1}`."""
        return self._transform(self.row_name)(self.raw_row_scale_tril.detach())

    @property
    def col_factor(self) -> torch.Tensor:
        """:math:`L_V`, the lower Cholesky factor of :math:`V = A_\\gamma^{-1}`."""
        return self._transform(self.col_name)(self.raw_col_scale_tril.detach())

    @torch.no_grad()
    def write(self, mean, row_factor, col_factor) -> None:
        self.loc.copy_(mean)
        self.raw_row_scale_tril.copy_(self._transform(self.row_name).inv(row_factor))
        self.raw_col_scale_tril.copy_(self._transform(self.col_name).inv(col_factor))


@dataclass
class KroneckerCurvature:
    """
    What an ELBO hands :class:`~pyro_ngvi.NGVI` for one :class:`KroneckerSite`
    (attached to its ``loc`` like a :class:`~pyro_ngvi.handover.SiteCurvature`).

    :param grad: :math:`\\bar g`, the gradient of the negative log-likelihood
        w.r.t. :math:`\\bar W`, ``(n, p)``, scaled to the full data.
    :param input_factor: :math:`\\hat A`, ``(p, p)``.
    :param output_factor: :math:`\\hat G`, ``(n, n)``, scaled to the full data.
    :param prior_loc: :math:`M_0`, ``(n, p)``.
    :param prior_precision: :math:`\\eta_j` per column, ``(p,)``.
    :param int handover: set by :func:`~pyro_ngvi.handover.attach_curvature`.
    """

    grad: torch.Tensor
    input_factor: torch.Tensor
    output_factor: torch.Tensor
    prior_loc: torch.Tensor
    prior_precision: torch.Tensor
    handover: int = 0

    @property
    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self.grad, self.input_factor, self.output_factor


def fold_prior(input_factor, output_factor, prior_precision) -> Tuple[torch.Tensor, torch.Tensor]:
    """:math:`(A_\\gamma, G_\\gamma) = (A + \\pi D, G + \\pi^{-1} I)` (module docstring)."""
    n = output_factor.shape[-1]
    pi = ((input_factor.trace() / prior_precision.sum()) / (output_factor.trace() / n)).sqrt()
    eye = torch.eye(n, dtype=output_factor.dtype, device=output_factor.device)
    return input_factor + pi * torch.diag(prior_precision), output_factor + eye / pi


def unfold_prior(damped_input, damped_output, prior_precision) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fold_prior`: :math:`\\pi^2 = n\\,\\mathrm{tr}(A_\\gamma) /
    (\\mathrm{tr}(D)\\,\\mathrm{tr}(G_\\gamma))`, then :math:`A = A_\\gamma - \\pi D`,
    :math:`G = G_\\gamma - \\pi^{-1} I`."""
    n = damped_output.shape[-1]
    pi = (n * damped_input.trace() / (prior_precision.sum() * damped_output.trace())).sqrt()
    eye = torch.eye(n, dtype=damped_output.dtype, device=damped_output.device)
    return damped_input - pi * torch.diag(prior_precision), damped_output - eye / pi


def _sym(matrix: torch.Tensor) -> torch.Tensor:
    return 0.5 * (matrix + matrix.transpose(-1, -2))
