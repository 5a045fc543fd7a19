"""
A task: the data split (train / validation / test), the plain network, its
likelihood and the Normal prior on its weights; and how every method's
predictions on it are scored.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pyro

from pyro_ngvi import metrics

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


@dataclass
class Split:
    """Standardised float32 features; targets as the likelihood takes them (see :func:`make_split`)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_valid: Optional[torch.Tensor] = None
    y_valid: Optional[torch.Tensor] = None


def make_split(x, y, likelihood: str, test_size: float = 0.2, validation_size: float = 0.0,
               seed: int = 0, per_feature: bool = True) -> Split:
    """
    Arrays ``x, y`` (a scikit-learn data set, or generated data) split into train
    and test, and a ``validation_size`` fraction of the training part held out for
    validation (stratified for classification); features standardised with the
    training part's mean and standard deviation (each feature's; with
    ``per_feature=False`` one for all, as for images). Targets as ``likelihood`` takes
    them: class indices (int64) for ``"categorical"``, 0 / 1 (float32) for
    ``"bernoulli"``, standardised like the features (float32) for ``"gaussian"``.
    """
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    classification = likelihood != "gaussian"

    def cut(x, y, size):
        return train_test_split(x, y, test_size=size, random_state=seed, stratify=y if classification else None)

    x_train, x_test, y_train, y_test = cut(x, y, test_size)
    if validation_size:
        x_train, x_valid, y_train, y_valid = cut(x_train, y_train, validation_size)
    # per_feature=False: one mean and standard deviation for all features (images: a shift
    # moves a pixel's value to where the same scale applies)
    scaler = StandardScaler().fit(x_train if per_feature else x_train.reshape(-1, 1))

    def features(x_part):
        scaled = scaler.transform(x_part if per_feature else x_part.reshape(-1, 1)).reshape(x_part.shape)
        return torch.as_tensor(scaled, dtype=torch.float32)

    def targets(y_part):
        if likelihood == "categorical":
            return torch.as_tensor(y_part).long()
        if likelihood == "bernoulli":
            return torch.as_tensor(y_part, dtype=torch.float32)
        return torch.as_tensor((y_part - y_train.mean()) / y_train.std(), dtype=torch.float32)

    split = Split(features(x_train), targets(y_train), features(x_test), targets(y_test))
    if validation_size:
        split.x_valid, split.y_valid = features(x_valid), targets(y_valid)
    return split


def minibatches(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                generator: torch.Generator) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One epoch: a fresh permutation of the examples cut into minibatches (the last may be smaller)."""
    return [(x[index], y[index]) for index in torch.randperm(len(x), generator=generator).split(batch_size)]


@dataclass
class Task:
    """
    One Bayesian-network problem, the same for every method: ``make_net()`` builds
    the plain network, ``likelihood`` is that of :class:`~pyro_ngvi.BayesianNet`
    (``"categorical"``, ``"bernoulli"`` or ``"gaussian"`` with a learned noise
    scale), the prior is :math:`\\mathcal{N}(0, s_0^2)` on every weight, and
    ``seed`` fixes the initial weights, the training noise and the minibatch order
    (and the draws of ``augment``).
    """

    name: str
    split: Split
    make_net: Callable[[], nn.Module]
    likelihood: str
    prior_scale: float = 1.0
    batch_size: int = 128
    seed: int = 0
    #: ``augment(x, generator)``: a random transform of each training minibatch (data
    #: augmentation, the same draws for every method), or ``None``
    augment: Optional[Callable] = None
    #: the factor by which augmentation multiplies the data (BayesianNet's
    #: ``augmentation_factor``; ivon-opt's ``ess``)
    augmentation_factor: float = 1.0
    #: inputs from outside the task's distribution (standardised as its inputs), for OOD
    #: detection, or ``None``
    ood: Optional[torch.Tensor] = None

    @property
    def num_data(self) -> int:
        """N, the size of the training set."""
        return len(self.split.x_train)

    @property
    def prior_precision(self) -> float:
        return self.prior_scale**-2

    @property
    def effective_num_data(self) -> int:
        """The data size the Bayesian methods use: ``num_data`` times the augmentation factor."""
        return max(1, round(self.num_data * self.augmentation_factor))

    def network(self) -> nn.Module:
        """The network with the task's initial weights; seeds every RNG, so each method starts alike."""
        pyro.set_rng_seed(self.seed)
        return self.make_net()


def nll(likelihood: str, output: torch.Tensor, y: torch.Tensor, noise_scale=None,
        reduction: str = "none") -> torch.Tensor:
    """
    :math:`-\\log p(y_i \\mid f_i)` per example (``reduction="none"``) or its mean
    (``"mean"``), for network outputs ``(..., N, K)`` (``K = 1`` for Bernoulli and
    Gaussian), as :class:`~pyro_ngvi.BayesianNet` defines the likelihood; leading
    sample dimensions broadcast.
    """
    if likelihood == "categorical":
        if output.dim() > 2:  # samples first: torch wants the classes in dimension 1
            output, y = output.movedim(-1, 1), y.expand(output.shape[:-1])
        return F.cross_entropy(output, y, reduction=reduction)
    output = output.squeeze(-1)
    if likelihood == "bernoulli":
        return F.binary_cross_entropy_with_logits(output, y.expand_as(output), reduction=reduction)
    noise_scale = torch.as_tensor(noise_scale)
    value = 0.5 * ((y - output) / noise_scale).square() + noise_scale.log() + _HALF_LOG_TWO_PI
    return value.mean() if reduction == "mean" else value


def predictive_metrics(likelihood: str, outputs: torch.Tensor, y: torch.Tensor,
                       noise_scale: Optional[float] = None) -> Dict[str, float]:
    """
    Test metrics of output samples ``(S, N, K)``: accuracy, NLL, ECE (15 bins)
    and Brier score of the predictive (probabilities averaged over samples) for
    classification; for regression those of :func:`regression_metrics`. A
    diverged run scores NaN.
    """
    if not bool(torch.isfinite(outputs).all()):
        keys = ("rmse", "loglik", "coverage50", "coverage90") if likelihood == "gaussian" else \
            ("accuracy", "nll", "ece", "brier")
        return dict.fromkeys(keys, math.nan)
    if likelihood == "gaussian":
        return regression_metrics(outputs.squeeze(-1), noise_scale, y)
    probs = metrics.predictive_probs_from_logits(outputs.squeeze(-1) if likelihood == "bernoulli" else outputs)
    y = y.long()  # class indices (Bernoulli targets are 0. / 1.)
    return {
        "accuracy": float(metrics.accuracy(probs, y)),
        "nll": float(metrics.nll(probs, y)),
        "ece": float(metrics.expected_calibration_error(probs, y)),
        "brier": float(metrics.brier_score(probs, y)),
    }


def regression_metrics(loc_samples: torch.Tensor, noise_scale: float, y: torch.Tensor,
                       draws: int = 400) -> Dict[str, float]:
    """
    RMSE of the predictive mean, log-likelihood of the Gaussian-mixture predictive,
    and coverage of its central 50 % / 90 % intervals, estimated from ``draws``
    predictive samples per point (network samples, each plus fresh noise from a
    private generator, so scoring never moves the training RNG).
    """
    repeats = math.ceil(draws / len(loc_samples))
    noisy = loc_samples.repeat(repeats, 1)
    noisy = noisy + noise_scale * torch.randn(noisy.shape, generator=torch.Generator().manual_seed(0))
    return {
        "rmse": float(metrics.rmse(loc_samples.mean(0), y)),
        "loglik": float(metrics.gaussian_log_likelihood(loc_samples, noise_scale, y)),
        "coverage50": float(metrics.interval_coverage(noisy, y, 0.5)),
        "coverage90": float(metrics.interval_coverage(noisy, y, 0.9)),
    }
