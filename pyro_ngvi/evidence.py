"""
The prior precision of each weight tensor of a :class:`~pyro_ngvi.BayesianNet` by the
Laplace-GGN marginal likelihood at the guide's current mean, updated online while NGVI
trains (type-II maximum likelihood, MacKay's evidence framework [1]; online, as in [2]).

For weights :math:`w` with a Normal prior :math:`\\mathcal{N}(m_{0}, \\alpha_j^{-1})` on
every element of weight tensor :math:`j`, a mean :math:`\\mu` and the diagonal of the
generalised Gauss-Newton matrix of the negative log-likelihood there,
:math:`h = \\mathrm{diag} \\sum_n J_n^\\top H_n J_n` (:func:`diagonal_ggn`), the Laplace
approximation with the GGN and a diagonal precision :math:`\\alpha + h` gives

.. math::

    \\log p(\\mathcal{D} \\mid \\alpha) \\approx \\log p(\\mathcal{D} \\mid \\mu)
        - \\sum_j \\frac{\\alpha_j}{2} \\lVert \\mu_j - m_{0j} \\rVert^2
        + \\frac12 \\sum_i \\log \\frac{\\alpha_{j(i)}}{\\alpha_{j(i)} + h_i}

(:func:`log_evidence`). At fixed :math:`\\mu, h` it is concave in :math:`\\log\\alpha_j`,
and its maximiser solves MacKay's fixed-point equation

.. math:: \\alpha_j \\lVert \\mu_j - m_{0j} \\rVert^2 = \\gamma_j(\\alpha_j)
          = \\sum_{i \\in j} \\frac{h_i}{\\alpha_j + h_i},

:math:`\\gamma_j` the number of parameters of tensor :math:`j` the data determine
(:func:`evidence_precision`, solved to machine precision by bisection in
:math:`\\log\\alpha`: the left side increases, the right side decreases in
:math:`\\alpha`). Only the weights the data pin down count: a weight with
:math:`h_i \\ll \\alpha` adds nothing to :math:`\\gamma` and (a mean near the prior's)
little to the norm. The ELBO's own update of the prior, ``learn_prior``
(:math:`\\alpha_j^{-1} = \\mathrm{mean}(\\mu^2 + \\sigma^2)`), counts every weight alike, and
with the noise limit capping :math:`\\sigma` far below the prior's scale it shrinks the
prior without end (the README's "Priors learned by the evidence"); the Laplace-GGN
evidence reads the curvature, not the capped scales, and has no such fixed point.

For a linear-Gaussian model with an orthogonal design the formula is the exact log
marginal likelihood at the mode, and the fixed point its exact maximiser
(``tests/test_evidence.py``).

**References**

[1] `Bayesian Interpolation`, David J. C. MacKay (Neural Computation 1992)
[2] `Scalable Marginal Likelihood Estimation for Model Selection in Deep Learning`,
    Alexander Immer, Matthias Bauer, Vincent Fortuin, Gunnar Ratsch, Mohammad Emtiyaz
    Khan (ICML 2021)
"""

import math
from typing import Dict, List, Optional, Sequence

import torch

import pyro

from .curvature.backpack import network_curvature

__all__ = ["EvidencePrior", "diagonal_ggn", "evidence_precision", "log_evidence"]

#: the bisection brackets :math:`\\log\\alpha` in :math:`[\\log\\alpha_- , \\log\\alpha_+]`
_LOG_ALPHA_RANGE = (-30.0, 30.0)
_BISECTIONS = 100


def evidence_precision(squared_norm: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor:
    """
    The prior precision :math:`\\alpha` that maximises the Laplace-GGN evidence of one
    weight tensor at fixed mean and curvature: the root of
    :math:`\\alpha S = \\sum_i h_i / (\\alpha + h_i)`, :math:`S` = ``squared_norm``
    :math:`\\lVert \\mu - m_0 \\rVert^2`, :math:`h` = ``curvature`` (non-negative; its
    elements are the tensor's). Bisection in :math:`\\log\\alpha` over
    :math:`[e^{-30}, e^{30}]` (a root outside is returned as the nearer end).
    """
    squared_norm = torch.as_tensor(squared_norm, dtype=torch.float64)
    h = curvature.detach().to(torch.float64).clamp(min=0).reshape(-1)
    low, high = (torch.tensor(v, dtype=torch.float64) for v in _LOG_ALPHA_RANGE)
    for _ in range(_BISECTIONS):
        middle = 0.5 * (low + high)
        alpha = middle.exp()
        excess = alpha * squared_norm - (h / (alpha + h)).sum()
        if excess > 0:
            high = middle
        else:
            low = middle
    return (0.5 * (low + high)).exp()


def log_evidence(log_likelihood: float, means: Sequence[torch.Tensor], prior_locs: Sequence[torch.Tensor],
                 precisions: Sequence[float], curvatures: Sequence[torch.Tensor]) -> float:
    """
    The Laplace-GGN log marginal likelihood with a diagonal precision (module docstring):
    :math:`\\log p(\\mathcal{D} \\mid \\mu) - \\sum_j \\frac{\\alpha_j}{2}\\lVert\\mu_j - m_{0j}\\rVert^2
    + \\frac12 \\sum_i \\log \\frac{\\alpha_j}{\\alpha_j + h_i}`, per weight tensor :math:`j` its
    mean, prior loc (broadcastable), prior precision :math:`\\alpha_j` and curvature.
    """
    total = float(log_likelihood)
    for mu, m0, alpha, h in zip(means, prior_locs, precisions, curvatures):
        mu, h = mu.detach().double(), h.detach().double().clamp(min=0)
        alpha = float(alpha)
        total -= 0.5 * alpha * float((mu - torch.as_tensor(m0, dtype=mu.dtype)).square().sum())
        total += 0.5 * float(torch.log(alpha / (alpha + h)).expand(mu.shape).sum())
    return total


@torch.no_grad()
def _guide_means(bnn, guide) -> List[torch.Tensor]:
    store = pyro.get_param_store()
    prefix = guide._pyro_name
    return [store[f"{prefix}.locs.{site}"].detach() for site in bnn.latent_sites]


def diagonal_ggn(bnn, weights: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 batch_size: int = 1024) -> (float, List[torch.Tensor]):
    """
    The log-likelihood :math:`\\log p(y \\mid x, w)` and the diagonal of its generalised
    Gauss-Newton matrix :math:`\\mathrm{diag}\\sum_n J_n^\\top H_n J_n` per latent site of
    ``bnn`` (a :class:`~pyro_ngvi.BayesianNet`) at ``weights`` (one tensor per site, in
    :attr:`~pyro_ngvi.BayesianNet.latent_sites` order), summed over the examples given and
    scaled to the net's effective data size :math:`N` (by :math:`N / \\text{len}(x)`): exact
    BackPACK ``DiagGGNExact`` on the net's fast path, in chunks of ``batch_size``.
    Point-estimated parameters (a learned noise scale, BatchNorm) are read from the param store.
    """
    fast = bnn._fast_path
    like = bnn._latents[0].param
    noise = None
    if bnn.likelihood == "gaussian":
        noise = torch.as_tensor(bnn._noise_scale(), dtype=like.dtype).detach()
    loss_scale = 1.0 if noise is None else 0.5 / noise**2
    with torch.no_grad():
        torch._foreach_copy_(bnn._latent_params, [w.detach() for w in weights])
        for weight in bnn._point_estimates:
            weight.param.copy_(bnn._point_estimate(weight).detach())
    for twin_module, module in fast.module_pairs:
        twin_module.training = module.training
    curvatures = None
    loss = 0.0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        result = network_curvature(fast.twin, fast.loss_module, xb, fast._loss_target(bnn, yb), "ggn",
                                   loss_scale=loss_scale, params=fast.params)
        site = [result.curvatures[w.index] for w in bnn._latents]
        curvatures = site if curvatures is None else [a + b for a, b in zip(curvatures, site)]
        loss = loss + float(result.loss)
    factor = bnn.effective_num_data / len(x)
    log_likelihood = -loss
    if noise is not None:  # -log p = c * squared error + log sigma + log(2 pi) / 2 per output
        outputs = y[0].numel() if y.dim() > 1 else 1
        log_likelihood -= len(x) * outputs * (float(noise.log()) + 0.5 * math.log(2 * math.pi))
    return factor * log_likelihood, [factor * h for h in curvatures]


def layer_precisions(bnn, means, locs, curvatures) -> List[torch.Tensor]:
    """One :func:`evidence_precision` per layer of ``bnn`` (its weight and bias tensors pooled:
    a bias alone has too few elements for its own evidence), per latent site."""
    groups: Dict[int, List[int]] = {}
    for j, weight in enumerate(bnn._latents):
        groups.setdefault(id(weight.module), []).append(j)
    alphas: List[Optional[torch.Tensor]] = [None] * len(means)
    for members in groups.values():
        norm = sum((means[j] - locs[j]).square().sum() for j in members)
        alpha = evidence_precision(norm, torch.cat([curvatures[j].reshape(-1) for j in members]))
        for j in members:
            alphas[j] = alpha
    return alphas


class EvidencePrior:
    """
    Online type-II maximum likelihood of a :class:`~pyro_ngvi.BayesianNet`'s prior: every
    call of :meth:`update` computes the diagonal GGN at the guide's mean on the data given
    (:func:`diagonal_ggn`), sets each weight tensor's prior precision to the maximiser of
    the Laplace-GGN evidence there (:func:`evidence_precision`) and writes it into the model
    (:meth:`~pyro_ngvi.BayesianNet.set_prior`; mean 0). NGVI's next step uses the new prior.

    :param bnn: the :class:`~pyro_ngvi.BayesianNet`.
    :param guide: its :class:`~pyro.infer.autoguide.AutoNormal` guide.
    """

    def __init__(self, bnn, guide):
        self.bnn, self.guide = bnn, guide
        self.precisions: Optional[Dict[str, float]] = None
        self.log_evidence: Optional[float] = None

    def update(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, float]:
        """Set the prior by the evidence at the guide's mean on ``(x, y)`` (the training set, or a
        subset: the sums are scaled to the net's N); returns ``{site: alpha}``."""
        bnn = self.bnn
        means = _guide_means(bnn, self.guide)
        log_likelihood, curvatures = diagonal_ggn(bnn, means, x, y)
        locs = [bnn.prior(site)[0] for site in bnn.latent_sites]
        alphas = layer_precisions(bnn, means, locs, curvatures)
        self.precisions = {site: float(a) for site, a in zip(bnn.latent_sites, alphas)}
        self.log_evidence = log_evidence(log_likelihood, means, locs, alphas, curvatures)
        bnn.set_prior({site: (m0, float(a) ** -0.5) for site, m0, a in zip(bnn.latent_sites, locs, alphas)})
        return self.precisions
