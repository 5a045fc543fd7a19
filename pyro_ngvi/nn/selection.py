"""
For users who hold a validation split: the prior scale and the training length of a
:class:`~pyro_ngvi.BayesianNet` chosen by the validation NLL of its predictive, the search
a MAP network's weight decay and epoch get (the same budget: four priors, twenty
checkpoints).

For each candidate prior :math:`w \\sim \\mathcal{N}(0, s^2)` the recipe
(``bnn.guide()``, ``NGVI()``, ``CurvatureELBO(curvature)``) trains for ``epochs`` epochs
of minibatches, from the same initial weights, minibatch order and training noise; at
``checkpoints`` evenly spaced epochs the guide :math:`q` is scored by the NLL of its
predictive on the validation split :math:`(x_m, y_m)_{m=1}^M`,

.. math:: \\mathrm{NLL} = -\\frac1M \\sum_{m=1}^M \\log \\frac1S \\sum_{s=1}^S
          p(y_m \\mid f(x_m; w_s)), \\qquad w_s \\sim q,

with the same noise for the :math:`S` draws at every checkpoint (common random numbers,
so that two checkpoints differ by their guides, not by the draws).

**The choice.** A validation split of a few hundred examples measures the NLL to about
0.01 nats, and the recipe's checkpoints often differ by less: the plain argmin would pick
noise. So the one-standard-error rule decides: with :math:`c^*` the checkpoint of the least
validation NLL and, for any other :math:`c`, the paired standard error
:math:`\\mathrm{se}_c = \\mathrm{sd}_m(\\ell_{mc^*} - \\ell_{mc}) / \\sqrt M` of the
difference of their per-example log predictive densities :math:`\\ell_{mc}`, every
:math:`c` with :math:`\\mathrm{NLL}_c - \\mathrm{NLL}_{c^*} \\le \\mathrm{se}_c` is as good
as the data can tell, and of those the one nearest the recipe is kept: the prior given
before the others, then the latest epoch (a posterior trained longer). The recipe as given
(the prior given, trained to the end) is chosen unless the validation split says clearly
that another prior or an earlier stop predicts better. The chosen guide is written into the
param store.

The default candidates are the prior given (``prior``, default 1) and the priors whose
precision per datum, :math:`s^{-2} / N`, is :math:`10^{-4}, 10^{-3}, 10^{-2}`: the
weight decays per datum a MAP network's search tries (the MAP objective per datum is the
mean NLL plus :math:`\\frac{\\lambda_0}{2N}\\lVert w\\rVert^2`).

A model chosen this way is no longer a posterior of the training data alone: the
validation split has been used (report it as such). Without a validation split, the
recipe at its defaults is the one to use.
"""

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.infer import SVI, Predictive

from ..elbo import CurvatureELBO
from ..guide_trace import forked_rng
from ..optim import NGVI
from ..policies import positive_numbers
from .model import BayesianNet

__all__ = ["ValidationSelection", "log_predictive_densities", "restore", "select_by_validation", "validation_nll"]

#: MAP's weight decays per datum; the default candidates are the priors of these precisions per datum
PRECISIONS_PER_DATUM = (1e-4, 1e-3, 1e-2)


@dataclass
class ValidationSelection:
    """
    What :func:`select_by_validation` chose: the model and guide of the best (prior, epoch),
    the guide's parameters in the param store, and every score.

    :ivar bnn: the :class:`~pyro_ngvi.BayesianNet` with the chosen prior (on its own copy of
        the network).
    :ivar guide: its :class:`~pyro.infer.autoguide.AutoNormal` guide, at the chosen checkpoint.
    :ivar float prior_scale: :math:`s`, the chosen prior's standard deviation.
    :ivar int epoch: the chosen checkpoint.
    :ivar float valid_nll: its validation NLL.
    :ivar dict scores: prior scale -> ``[(epoch, validation NLL), ...]``.
    :ivar float best_nll: the least validation NLL of all checkpoints (``valid_nll`` is within
        one standard error of it).
    """

    bnn: BayesianNet
    guide: object
    prior_scale: float
    epoch: int
    valid_nll: float
    scores: Dict[float, List[Tuple[int, float]]] = field(default_factory=dict)
    best_nll: float = math.nan


@torch.no_grad()
def validation_nll(bnn: BayesianNet, guide, x: torch.Tensor, y: torch.Tensor, num_samples: int = 32,
                   seed: int = 0) -> float:
    """
    The NLL per example of the guide's predictive on ``(x, y)`` (module docstring), from
    ``num_samples`` draws of the guide made with a generator seeded by ``seed`` (the global
    random state is left as it was); the network runs in eval mode (BatchNorm on its running
    statistics). A Gaussian likelihood uses the model's noise scale (fixed, or its
    ``pyro.param``).

    :raises ValueError: for ``num_samples < 1``.
    """
    value = -log_predictive_densities(bnn, guide, x, y, num_samples, seed).mean()
    return float(value) if bool(torch.isfinite(value)) else math.inf


@torch.no_grad()
def log_predictive_densities(bnn: BayesianNet, guide, x: torch.Tensor, y: torch.Tensor, num_samples: int = 32,
                             seed: int = 0) -> torch.Tensor:
    """:math:`\\ell_m = \\log \\frac1S \\sum_s p(y_m \\mid f(x_m; w_s))` per example, ``(M,)``, as
    :func:`validation_nll` draws them (its mean is minus the validation NLL)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    training = bnn.training
    bnn.eval()
    try:
        with forked_rng():
            torch.manual_seed(seed)
            outputs = Predictive(bnn, guide=guide, num_samples=num_samples, return_sites=("output",))(x)["output"]
    finally:
        bnn.train(training)
    if bnn.likelihood == "categorical":
        log_lik = dist.Categorical(logits=outputs).log_prob(y)
    elif bnn.likelihood == "bernoulli":
        log_lik = dist.Bernoulli(logits=outputs).log_prob(y.to(outputs.dtype))
    else:
        scale = bnn.noise_scale if bnn.noise_scale is not None else pyro.param(bnn.prefix + "noise_scale")
        log_lik = dist.Normal(outputs, scale).log_prob(y.to(outputs.dtype))
    if log_lik.dim() > 2:  # vector events: one log-likelihood per example
        log_lik = log_lik.flatten(2).sum(-1)
    return torch.logsumexp(log_lik, 0) - math.log(num_samples)


def _default_scales(prior: float, num_data: int) -> List[float]:
    """``prior`` and the scales of :data:`PRECISIONS_PER_DATUM` (one of equal value dropped)."""
    scales = [float(prior)]
    for rate in PRECISIONS_PER_DATUM:
        scale = (rate * num_data) ** -0.5
        if all(not math.isclose(scale, s, rel_tol=1e-9) for s in scales):
            scales.append(scale)
    return scales


def _check(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _candidate_scales(prior_scales, prior, num_data: int) -> List[float]:
    """The candidate prior scales (the defaults from ``prior``), checked (``prior`` also where
    ``prior_scales`` are given, and unused: a bad value is a mistake either way)."""
    if isinstance(prior, bool) or not isinstance(prior, numbers.Real) or not 0 < prior < math.inf:
        raise ValueError(f"prior must be a positive finite number, got {prior!r}")
    if prior_scales is None:
        return _default_scales(prior, num_data)
    return positive_numbers("prior_scales", prior_scales)


def _check_split(bnn: BayesianNet, x, y, names: str) -> None:
    """Refuse a split (``names``: its inputs' and targets' names) that the likelihood of ``bnn`` (a
    copy of the net) would refuse mid-training: of another length, empty, or targets of another
    shape, dtype or value range, or inputs the net cannot take (torch's RuntimeError, named)."""
    if not (torch.is_tensor(x) and torch.is_tensor(y)) or y.dim() == 0 or len(x) != len(y) or len(x) == 0:
        raise ValueError(f"{names} must be non-empty and of one length (tensors), got "
                         f"{getattr(x, 'shape', type(x).__name__)} and {getattr(y, 'shape', type(y).__name__)}")
    if not all(bool(torch.isfinite(t).all()) for t in (x, y) if t.is_floating_point()):
        raise ValueError(f"{names} must be finite (every step on them would be skipped), got a nan or inf")
    try:
        with torch.no_grad(), pyro.validation_enabled():
            bnn._check_targets(y, bnn.net(x))
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"{names}: {error}") from error


def select_by_validation(
    net: nn.Module,
    likelihood: str,
    x: torch.Tensor,
    y: torch.Tensor,
    x_valid: torch.Tensor,
    y_valid: torch.Tensor,
    epochs: int,
    prior_scales: Optional[Sequence[float]] = None,
    checkpoints: int = 20,
    batch_size: int = 128,
    curvature: str = "ggn",
    num_samples: int = 32,
    seed: int = 0,
    prior: float = 1.0,
    **model_args,
) -> ValidationSelection:
    """
    Train the recipe once per candidate prior scale and keep the (prior, epoch) whose guide
    predicts the validation split best (module docstring)::

        chosen = select_by_validation(net, "categorical", x, y, x_valid, y_valid, epochs=300)
        chosen.prior_scale, chosen.epoch          # what was chosen
        Predictive(chosen.bnn, guide=chosen.guide, num_samples=32)(x_test)

    Each candidate trains on its own copy of ``net`` (the same initial weights), in a param
    store scope of its own, with the global random state forked and seeded by ``seed`` (the
    same training noise for every candidate; the caller's random state is left as it was);
    the chosen guide's parameters are then written into the current param store.

    :param torch.nn.Module net: the network, at its initial weights (not modified).
    :param str likelihood: as for :class:`~pyro_ngvi.BayesianNet`.
    :param x: training inputs. :param y: training targets.
    :param x_valid: validation inputs. :param y_valid: validation targets.
    :param int epochs: epochs of minibatches each candidate trains for.
    :param prior_scales: the candidate prior standard deviations (default: ``prior`` and the
        scales of precision per datum 1e-4, 1e-3, 1e-2, :math:`s = (10^{-k} N)^{-1/2}`).
    :param int checkpoints: scored epochs per candidate, evenly spaced, the last included
        (default: 20).
    :param int batch_size: minibatch size (default: 128).
    :param str curvature: the ``CurvatureELBO`` source (default: "ggn").
    :param int num_samples: draws of the predictive (default: 32).
    :param int seed: seeds the minibatch order, the training noise and the scoring draws
        (default: 0).
    :param float prior: the prior scale given, the first default candidate (default: 1.0).
    :param model_args: other arguments of :class:`~pyro_ngvi.BayesianNet` (``noise_scale``,
        ``noise_limit``, ``augmentation_factor``, ``name``, ...).
    :raises ValueError: for a non-positive ``epochs``, ``checkpoints``, ``batch_size`` or
        ``num_samples``, a negative ``seed``, an empty or non-positive list of scales, or a
        split whose targets the likelihood refuses (another length, shape or dtype, a class out
        of range), before any training.
    """
    epochs, checkpoints, batch_size = (_check(name, value) for name, value in
                                       (("epochs", epochs), ("checkpoints", checkpoints), ("batch_size", batch_size)))
    num_samples, seed = _check("num_samples", num_samples), _check("seed", seed, low=0)
    probe = BayesianNet(copy.deepcopy(net), likelihood, num_data=1, **model_args)  # (its checks, before training)
    _check_split(probe, x_valid, y_valid, "x_valid and y_valid")
    _check_split(probe, x, y, "x and y")
    num_data = len(x)
    scales = _candidate_scales(prior_scales, prior, num_data)
    every = max(1, epochs // checkpoints)
    scored = sorted(set(range(every, epochs + 1, every)) | {epochs})
    store = pyro.get_param_store()
    checkpoints_kept = []  # (scale, epoch, per-example log densities, param-store state, (bnn, guide))
    for scale in scales:
        bnn = BayesianNet(copy.deepcopy(net), likelihood, num_data=num_data, prior=scale, **model_args)
        order = torch.Generator().manual_seed(seed)
        with store.scope(), forked_rng():
            torch.manual_seed(seed)
            guide = bnn.guide()
            svi = SVI(bnn, guide, NGVI(), CurvatureELBO(curvature))
            for epoch in range(1, epochs + 1):
                for index in torch.randperm(num_data, generator=order).split(batch_size):
                    svi.step(x[index], y[index])
                if epoch in scored:
                    densities = log_predictive_densities(bnn, guide, x_valid, y_valid, num_samples, seed)
                    state = store.get_state()
                    params = {name: value.detach().clone() for name, value in state["params"].items()}
                    checkpoints_kept.append((scale, epoch, densities, (params, state["constraints"]), (bnn, guide)))
    scale, epoch, densities, (params, constraints), (bnn, guide), best_nll = _choose(checkpoints_kept, scales[0])
    restore(guide, params, constraints, x_valid[:1], y_valid[:1])
    scores: Dict[float, List[Tuple[int, float]]] = {}
    for s, e, d, _, _ in checkpoints_kept:
        scores.setdefault(s, []).append((e, _nll(d)))
    return ValidationSelection(bnn, guide, scale, epoch, _nll(densities), scores, best_nll)


def restore(guide, params: Dict[str, torch.Tensor], constraints: Dict[str, object], x: torch.Tensor,
            y: torch.Tensor) -> None:
    """
    Write a checkpoint (unconstrained ``params`` and their ``constraints``, as
    ``ParamStoreDict.get_state()`` holds them) into the current param store, and into the
    ``guide``'s own attributes: a ``PyroModule`` reads the store only while it runs, so the guide
    runs once on ``(x, y)`` (its draws blocked, the global random state left as it was).
    """
    pyro.get_param_store().set_state({"params": {name: value.detach().clone().requires_grad_()
                                                 for name, value in params.items()},
                                      "constraints": dict(constraints)})
    with forked_rng(), pyro.poutine.block():
        guide(x, y)


def _nll(densities: torch.Tensor) -> float:
    value = -float(densities.mean())
    return value if math.isfinite(value) else math.inf


def _choose(kept, given_scale: float):
    """The one-standard-error rule of the module docstring over ``kept`` checkpoints
    ``(scale, epoch, densities, ...)``; returns the chosen entry and the least NLL."""
    nlls = [_nll(entry[2]) for entry in kept]
    best = min(range(len(kept)), key=nlls.__getitem__)
    if not math.isfinite(nlls[best]):
        raise RuntimeError("every checkpoint of every candidate predicts the validation split with a "
                           "non-finite NLL: the runs diverged")
    reference = kept[best][2]
    as_good = []
    for k, entry in enumerate(kept):
        difference = reference - entry[2]  # per example, >= 0 on average where entry is worse
        spread = float(difference.std()) / math.sqrt(len(difference)) if len(difference) > 1 else 0.0
        if math.isfinite(nlls[k]) and nlls[k] - nlls[best] <= spread:
            as_good.append(k)
    chosen = max(as_good, key=lambda k: (kept[k][0] == given_scale, kept[k][1], -nlls[k]))
    return (*kept[chosen], nlls[best])
