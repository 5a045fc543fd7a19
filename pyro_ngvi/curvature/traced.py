"""
The curvature :math:`h` of :math:`\\ell` at one traced particle, per source (the
registry :data:`ESTIMATORS`), for :class:`~pyro_ngvi.CurvatureELBO`'s traced path.

:math:`\\ell` is the negative log joint less the conjugate priors (:class:`Terms`):

.. math:: \\ell = \\ell_{\\text{prior}} - \\sum_{\\text{observed}} \\log p(y \\mid \\cdot),

and per source

- ``"reparam"``: Price's theorem, :math:`h = g\\,\\epsilon/\\sigma` (dense: the
  whitened :math:`\\mathrm{tril}(g\\epsilon^\\top)`,
  :func:`~pyro_ngvi.full_covariance.whitened_price_curvature`);
- ``"hessian"``: :math:`\\nabla^2 \\ell`, exact;
- ``"ef"``, ``"ggn"``, ``"ggn_mc"``: :math:`\\nabla^2 \\ell_{\\text{prior}} +
  \\sum_{\\text{observed}} \\frac{N}{B} \\sum_{i \\in B} C_i`, with :math:`C_i` the
  empirical Fisher :math:`g_i g_i^\\top`, the GGN :math:`J_i^\\top F_i J_i` or its
  Monte-Carlo estimate, over each observed site's data plate (its ``poutine.mask`` and
  scale applied, as in ``log_prob_sum``).

The same estimators serve both guide families through their coordinates:
:class:`Diagonal` (one leaf per mean-field site, diagonals by :mod:`.autograd`) and
:class:`Dense` (a full-covariance guide's latent vector, matrices by :mod:`.dense`).
Each result is a list with one tensor per coordinate block.
"""

from functools import partial
from typing import List, NamedTuple, Optional

import torch

from ..full_covariance import whitened_price_curvature
from .autograd import diag_hessian, empirical_fisher_diag, ggn_diag, is_factor, mc_ggn_diag, per_example_log_prob
from .dense import empirical_fisher_matrix, ggn_matrix, hessian_matrix, mc_ggn_matrix

Tensor = torch.Tensor


class Terms(NamedTuple):
    """The parts of :math:`\\ell` of one particle (``None`` where there is none)."""

    objective: Optional[Tensor]  #: :math:`\ell`, the sum of the two below
    prior: Optional[Tensor]  #: :math:`\ell_{\text{prior}}`: non-conjugate priors and log|det J|
    observed: List[dict]  #: the observed sites of the model trace (the likelihood)


class Diagonal(NamedTuple):
    """Mean-field coordinates: a leaf :math:`u_j = \\mu_j + \\sigma_j\\epsilon_j` per site."""

    inputs: List[Tensor]
    locs: List[Tensor]
    scales: List[Tensor]

    def zeros(self) -> List[Tensor]:
        return [torch.zeros_like(x) for x in self.inputs]

    def hessian(self, loss) -> List[Tensor]:
        return diag_hessian(loss, self.inputs)

    def empirical_fisher(self, terms) -> List[Tensor]:
        return empirical_fisher_diag(terms, self.inputs)

    def ggn(self, fn, data_dim) -> List[Tensor]:
        return ggn_diag(fn, self.inputs, data_dim)

    def mc_ggn(self, fn, data_dim, mc_samples) -> List[Tensor]:
        return mc_ggn_diag(fn, self.inputs, data_dim, mc_samples)

    def price(self, grads) -> List[Tensor]:
        """:math:`h = g\\,(u - \\mu)/\\sigma^2 = g\\,\\epsilon/\\sigma`."""
        return [g * (x - loc) / scale.square() for g, x, loc, scale in zip(grads, self.inputs, self.locs, self.scales)]


class Dense(NamedTuple):
    """Full-covariance coordinates: the latent vector :math:`z = \\mu + C\\epsilon` (``factor`` :math:`C`)."""

    z: Tensor
    loc: Tensor
    factor: Tensor

    def zeros(self) -> List[Tensor]:
        size = self.z.numel()
        return [self.z.new_zeros(size, size)]

    def hessian(self, loss) -> List[Tensor]:
        return [hessian_matrix(loss, self.z)]

    def empirical_fisher(self, terms) -> List[Tensor]:
        return [empirical_fisher_matrix(terms, self.z)]

    def ggn(self, fn, data_dim) -> List[Tensor]:
        return [ggn_matrix(fn, self.z, data_dim)]

    def mc_ggn(self, fn, data_dim, mc_samples) -> List[Tensor]:
        return [mc_ggn_matrix(fn, self.z, data_dim, mc_samples)]

    def price(self, grads) -> List[Tensor]:
        """:math:`C^\\top H C` estimated by :math:`\\mathrm{tril}(g\\epsilon^\\top)`,
        :math:`\\epsilon = C^{-1}(z - \\mu)`, whitened."""
        (grad,) = grads
        noise = torch.linalg.solve_triangular(self.factor, (self.z.detach() - self.loc).unsqueeze(-1),
                                              upper=False).squeeze(-1)
        return [whitened_price_curvature(self.factor, torch.outer(grad.detach(), noise).tril())]


def scalar_scale(site) -> float:
    """A site's ``poutine.scale`` (a subsampled plate's :math:`N/B`) as a float."""
    scale = site["scale"]
    if torch.is_tensor(scale):
        if scale.numel() != 1:
            raise NotImplementedError(
                f"CurvatureELBO needs a scalar scale at site '{site['name']}', got a tensor of "
                f"shape {tuple(scale.shape)}"
            )
        scale = float(scale)
    return float(scale)


def data_dim(site, curvature) -> int:
    """The plate dimension that indexes examples of an observed site: its plate, or of several its
    subsampled one (for ``'ef'``, whose squares depend on it, another choice is refused)."""
    frames = [f for f in site["cond_indep_stack"] if f.vectorized]
    if not frames:
        what = "pyro.factor term" if is_factor(site["fn"]) else "observed site"
        raise ValueError(
            f"curvature='{curvature}' sums per-example terms over a data plate, but the {what} "
            f"'{site['name']}' is in no pyro.plate, so it cannot be split into examples. Put the "
            "observations in `with pyro.plate('data', N):`, or use curvature='hessian' or 'reparam'."
        )
    subsampled = [f for f in frames if f.full_size is not None and f.full_size != f.size]
    if curvature == "ef" and len(subsampled) != 1 and len(frames) > 1:  # ('ggn', 'ggn_mc': any dim gives the same)
        raise ValueError(
            f"curvature='ef' squares per-example gradients, but the observed site '{site['name']}' is in "
            f"several plates ({', '.join(repr(f.name) for f in frames)}), and which one indexes the examples "
            "is not known (the squares differ). Subsample that plate (pyro.plate(..., subsample_size=...)), "
            "or use curvature='ggn', 'ggn_mc', 'hessian' or 'reparam'.")
    frame = (subsampled or sorted(frames, key=lambda f: -f.size))[0]
    return frame.dim


def _price(terms: Terms, coordinates, grads, mc_samples: int) -> List[Tensor]:
    return coordinates.price(grads)


def _exact(loss: Optional[Tensor], coordinates) -> List[Tensor]:
    """:math:`\\nabla^2` ``loss`` (zeros where there is none, or it is constant: a masked prior)."""
    if loss is None or not loss.requires_grad:
        return coordinates.zeros()
    return coordinates.hessian(loss)


def masked_likelihood(site):
    """An observed site's ``fn`` with the site's ``poutine.mask`` applied (``fn.mask(m)``), as
    ``log_prob_sum`` has it: per-example terms are read off ``fn``, which does not carry it."""
    mask = site["mask"]
    return site["fn"] if mask is None or mask is True else site["fn"].mask(mask)


def _hessian(terms: Terms, coordinates, grads, mc_samples: int) -> List[Tensor]:
    return _exact(terms.objective, coordinates)


def _per_example(source: str, terms: Terms, coordinates, grads, mc_samples: int) -> List[Tensor]:
    curvatures = _exact(terms.prior, coordinates)
    for site in terms.observed:
        dim, scale, fn = data_dim(site, source), scalar_scale(site), masked_likelihood(site)
        if source == "ef":
            site_curvature = coordinates.empirical_fisher(-per_example_log_prob(fn, site["value"], dim))
        elif source == "ggn":
            site_curvature = coordinates.ggn(fn, dim)
        else:
            site_curvature = coordinates.mc_ggn(fn, dim, mc_samples)
        curvatures = [c + scale * h for c, h in zip(curvatures, site_curvature)]
    return curvatures


#: Source -> estimator ``(terms, coordinates, grads, mc_samples) -> [h per block]``
#: (``grads``: :math:`\nabla\ell` per block). Adding a source is adding an entry
#: here and a line in :data:`pyro_ngvi.curvature.SOURCES`.
ESTIMATORS = {
    "reparam": _price,
    "hessian": _hessian,
    "ef": partial(_per_example, "ef"),
    "ggn": partial(_per_example, "ggn"),
    "ggn_mc": partial(_per_example, "ggn_mc"),
}


def traced_curvature(source: str, terms: Terms, coordinates, grads, mc_samples: int = 1) -> List[Tensor]:
    """:math:`h` of ``terms`` by ``source`` in ``coordinates`` (:class:`Diagonal` or :class:`Dense`)."""
    return ESTIMATORS[source](terms, coordinates, grads, mc_samples)
