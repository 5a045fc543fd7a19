"""
Uncertainty metrics for Bayesian predictions.

Classification metrics take the posterior predictive class probabilities
``probs`` of shape ``(N, K)`` and integer labels ``y`` of shape ``(N,)``; the
helpers :func:`predictive_probs` and :func:`predictive_probs_from_logits` build
``probs`` from the samples :class:`~pyro.infer.Predictive` returns. Regression
metrics take predictive samples of shape ``(S, N)`` and targets ``y`` of shape
``(N,)``. Scalar metrics are returned as 0-dim tensors.

Inputs are always checked (metrics run once per evaluation, outside the
training loop); a bad input raises :class:`ValueError` naming the argument.

**References**

[1] `On Calibration of Modern Neural Networks`,
    Chuan Guo, Geoff Pleiss, Yu Sun, Kilian Q. Weinberger (ICML 2017)
    https://arxiv.org/abs/1706.04599

[2] `Verification of Forecasts Expressed in Terms of Probability`,
    Glenn W. Brier (Monthly Weather Review, 1950)

[3] `Obtaining Well Calibrated Probabilities Using Bayesian Binning`,
    Mahdi Pakdaman Naeini, Gregory F. Cooper, Milos Hauskrecht (AAAI 2015)

[4] `A Baseline for Detecting Misclassified and Out-of-Distribution Examples in Neural Networks`,
    Dan Hendrycks, Kevin Gimpel (ICLR 2017)
    https://arxiv.org/abs/1610.02136

[5] `On a Test of Whether one of Two Random Variables is Stochastically Larger than the Other`,
    Henry B. Mann, Donald R. Whitney (Annals of Mathematical Statistics, 1947)
"""

import math
import numbers
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Union

import torch

# torch.quantile refuses inputs with more elements than this.
_QUANTILE_MAX_NUMEL = 2**24


class ReliabilityDiagram(NamedTuple):
    """
    Per-bin data of a reliability diagram, each of shape ``(num_bins,)``. Bin
    ``b`` spans confidences ``[b / B, (b + 1) / B)``; the last bin also holds 1.

    :param confidence: mean top-class confidence in the bin (NaN if empty).
    :param accuracy: fraction of correct top-class predictions (NaN if empty).
    :param count: number of examples in the bin.
    """

    confidence: torch.Tensor
    accuracy: torch.Tensor
    count: torch.Tensor


# ---------------------------------------------------------------------------
# input checks


def _as_float(x) -> torch.Tensor:
    """``x`` as a float tensor; integers take the default dtype, and half and bfloat16 are scored in
    float32 (their eps, 1e-3 and 8e-3, capped an example's NLL at 6.9 and 4.9 nats, and torch.quantile
    refuses them)."""
    x = torch.as_tensor(x)
    if not x.is_floating_point() or torch.finfo(x.dtype).bits < 32:
        x = x.to(torch.float32 if x.is_floating_point() else torch.get_default_dtype())
    return x


def _check_probs(probs, name: str = "probs", dim: int = 2) -> torch.Tensor:
    probs = _as_float(probs)
    if probs.dim() != dim:
        raise ValueError(
            f"{name} must have {dim} dimensions, got shape {tuple(probs.shape)}"
        )
    if probs.numel() and not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError(f"{name} must lie in [0, 1]")
    return probs


def _check_class_probs(probs, name: str = "probs") -> torch.Tensor:
    """``probs`` ``(N, K)`` whose rows sum to 1 (to ``1e-4 + K eps``), else a ValueError naming it."""
    given = torch.as_tensor(probs).dtype  # (rows of a half-precision softmax sum to 1 only to its eps)
    probs = _check_probs(probs, name)
    error = (probs.sum(-1) - 1).abs().max() if probs.numel() else 0.0
    if error > 1e-4 + probs.shape[-1] * torch.finfo(given if given.is_floating_point else probs.dtype).eps:
        raise ValueError(f"{name} must sum to 1 over the classes (dim -1), off by up to {float(error):.3g}: "
                         "class probabilities (N, K), e.g. predictive_probs_from_logits(logits)")
    return probs


def _check_labels(y, num_examples: int, num_classes: int, name: str = "y"):
    y = torch.as_tensor(y)
    if y.shape != (num_examples,):
        raise ValueError(
            f"{name} must have shape ({num_examples},) to match probs, "
            f"got {tuple(y.shape)}"
        )
    if y.is_floating_point():
        # Pyro's Bernoulli/Categorical sites may hand back whole-number floats.
        if not bool((y == y.round()).all()):
            raise ValueError(f"{name} must hold integer class labels")
    elif y.is_complex():
        raise ValueError(f"{name} must hold integer class labels")
    y = y.long()
    if y.numel() and not bool(((y >= 0) & (y < num_classes)).all()):
        raise ValueError(f"{name} must hold labels in [0, {num_classes})")
    return y


def _check_classification(probs, y):
    probs = _check_class_probs(probs)
    if probs.shape[0] == 0:
        raise ValueError("probs must hold at least one example")
    y = _check_labels(y, probs.shape[0], probs.shape[1]).to(probs.device)
    return probs, y


def _check_num_bins(num_bins: int) -> int:
    if (isinstance(num_bins, bool) or not isinstance(num_bins, numbers.Real) or not math.isfinite(num_bins)
            or int(num_bins) != num_bins or num_bins < 1):
        raise ValueError(f"num_bins must be a positive integer, got {num_bins}")
    return int(num_bins)


def _check_regression(samples, y, samples_name: str):
    samples = _as_float(samples)
    if samples.dim() != 2 or samples.shape[0] == 0 or samples.shape[1] == 0:
        raise ValueError(
            f"{samples_name} must have shape (S, N) with S, N >= 1, "
            f"got {tuple(samples.shape)}"
        )
    y = _as_float(y).to(samples.device)
    if y.shape != samples.shape[1:]:
        raise ValueError(
            f"y must have shape ({samples.shape[1]},) to match {samples_name}, "
            f"got {tuple(y.shape)}"
        )
    for name, value in ((samples_name, samples), ("y", y)):
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} must be finite (a NaN or inf sample has no quantile or density)")
    return samples, y


# ---------------------------------------------------------------------------
# predictive probabilities


def predictive_probs(samples) -> torch.Tensor:
    """
    Posterior predictive class probabilities from per-sample probabilities,

    .. math:: \\bar p_{nk} = \\frac{1}{S} \\sum_s p^{(s)}_{nk}.

    ``samples`` is what :class:`~pyro.infer.Predictive` returns for a site that
    records class probabilities (e.g. a ``pyro.deterministic`` site):

    - shape ``(S, N, K)``: probabilities of ``K`` classes, summing to 1 over
      ``K``; returns ``(N, K)``.
    - shape ``(S, N)``: binary, the probability of class 1; returns ``(N, 2)``
      with columns :math:`(1 - \\bar p_n, \\bar p_n)`.

    :param torch.Tensor samples: class-probability samples, ``(S, N, K)`` or
        ``(S, N)``.
    :returns: mean probabilities, ``(N, K)`` or ``(N, 2)``.
    :rtype: torch.Tensor
    """
    samples = _sample_stack(samples, "samples")
    samples = _check_probs(samples, "samples", dim=samples.dim())
    if samples.dim() == 2:
        p1 = samples.mean(0)
        return torch.stack([1 - p1, p1], dim=-1)
    totals = samples.sum(-1)
    if not torch.allclose(totals, torch.ones_like(totals), atol=1e-4):
        raise ValueError(
            "samples must sum to 1 over the last (class) dimension; "
            "for logits use predictive_probs_from_logits"
        )
    return samples.mean(0)


def predictive_probs_from_logits(logits) -> torch.Tensor:
    """
    Posterior predictive class probabilities from per-sample logits,

    .. math:: \\bar p_{nk} = \\frac{1}{S} \\sum_s \\mathrm{softmax}(f^{(s)}_n)_k.

    Binary logits of shape ``(S, N)`` (log-odds of class 1) use the sigmoid and
    give ``(N, 2)`` as in :func:`predictive_probs`; ``(S, N, 1)`` is refused (one class).

    :param torch.Tensor logits: logit samples, ``(S, N, K)`` or ``(S, N)``.
    :returns: mean probabilities, ``(N, K)`` or ``(N, 2)``.
    :rtype: torch.Tensor
    """
    logits = _sample_stack(logits, "logits")
    if logits.dim() == 2:
        p1 = torch.sigmoid(logits).mean(0)
        return torch.stack([1 - p1, p1], dim=-1)
    if logits.shape[-1] == 1:  # (a softmax over one class is 1 whatever the logit)
        raise ValueError(f"logits of shape {tuple(logits.shape)} hold one class; binary log-odds are (S, N): "
                         "logits.squeeze(-1)")
    if bool(torch.isneginf(logits).all(-1).any()):  # (its softmax is NaN)
        raise ValueError("logits must not be -inf for every class of an example (no class has a probability)")
    return torch.softmax(logits, dim=-1).mean(0)


# ---------------------------------------------------------------------------
# classification metrics


def nll(probs, y) -> torch.Tensor:
    """
    Mean negative log-likelihood of the labels,

    .. math:: \\mathrm{NLL} = -\\frac{1}{N} \\sum_n \\log \\max(p_{n y_n}, \\epsilon),

    with :math:`\\epsilon` the machine epsilon of ``probs.dtype``
    (``torch.finfo(dtype).eps``; float32's for half and bfloat16), so a zero probability costs
    :math:`-\\log\\epsilon` (about 15.9 in float32, 36.0 in float64) instead of
    infinity.

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :param torch.Tensor y: integer labels in ``[0, K)``, ``(N,)``.
    :rtype: torch.Tensor
    """
    probs, y = _check_classification(probs, y)
    eps = torch.finfo(probs.dtype).eps
    chosen = probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return -chosen.clamp(min=eps).log().mean()


def accuracy(probs, y) -> torch.Tensor:
    """
    Fraction of examples whose most probable class is the label,
    :math:`\\frac{1}{N} \\sum_n [\\arg\\max_k p_{nk} = y_n]` (ties go to the
    lowest class index).

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :param torch.Tensor y: integer labels in ``[0, K)``, ``(N,)``.
    :rtype: torch.Tensor
    """
    probs, y = _check_classification(probs, y)
    return (probs.argmax(-1) == y).to(probs.dtype).mean()


def reliability_diagram_data(probs, y, num_bins: int = 15) -> ReliabilityDiagram:
    """
    Per-bin confidence and accuracy for a reliability diagram [1].

    The top-class confidence :math:`c_n = \\max_k p_{nk}` is put in bin
    :math:`b_n = \\min(\\lfloor B c_n \\rfloor, B - 1)` of ``B`` equal-width bins
    on ``[0, 1]``, so bin ``b`` holds :math:`b/B \\le c < (b+1)/B` and a
    confidence of exactly 1 goes in the last bin. Per bin,

    .. math:: \\mathrm{conf}_b = \\frac{1}{n_b} \\sum_{n: b_n = b} c_n, \\qquad
              \\mathrm{acc}_b = \\frac{1}{n_b} \\sum_{n: b_n = b}
              [\\arg\\max_k p_{nk} = y_n],

    which are NaN for an empty bin (:math:`n_b = 0`), so plots skip it.

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :param torch.Tensor y: integer labels in ``[0, K)``, ``(N,)``.
    :param int num_bins: number of bins ``B`` (default: 15)
    :returns: ``(confidence, accuracy, count)``, each of shape ``(num_bins,)``.
    :rtype: ReliabilityDiagram
    """
    num_bins = _check_num_bins(num_bins)
    probs, y = _check_classification(probs, y)
    confidence, prediction = probs.max(-1)
    correct = (prediction == y).to(probs.dtype)
    bins = (confidence * num_bins).floor().long().clamp(max=num_bins - 1)

    count = torch.bincount(bins, minlength=num_bins)
    conf_sum = torch.zeros(num_bins, dtype=probs.dtype, device=probs.device)
    conf_sum.scatter_add_(0, bins, confidence)
    correct_sum = torch.zeros_like(conf_sum).scatter_add_(0, bins, correct)
    denom = count.to(probs.dtype)  # 0 / 0 = NaN marks an empty bin
    return ReliabilityDiagram(conf_sum / denom, correct_sum / denom, count)


def expected_calibration_error(probs, y, num_bins: int = 15) -> torch.Tensor:
    """
    Expected calibration error [1, 3] over ``B`` equal-width confidence bins,

    .. math:: \\mathrm{ECE} = \\sum_b \\frac{n_b}{N}
              \\left| \\mathrm{acc}_b - \\mathrm{conf}_b \\right|,

    with bins, :math:`\\mathrm{acc}_b` and :math:`\\mathrm{conf}_b` as in
    :func:`reliability_diagram_data`; empty bins contribute 0.

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :param torch.Tensor y: integer labels in ``[0, K)``, ``(N,)``.
    :param int num_bins: number of bins ``B`` (default: 15)
    :rtype: torch.Tensor
    """
    confidence, acc, count = reliability_diagram_data(probs, y, num_bins)
    gap = (acc - confidence).abs()
    weight = count.to(gap.dtype) / count.sum()
    return torch.where(count > 0, weight * gap, torch.zeros_like(gap)).sum()


def brier_score(probs, y) -> torch.Tensor:
    """
    Multi-class Brier score [2],

    .. math:: \\mathrm{BS} = \\frac{1}{N} \\sum_n \\sum_k (p_{nk} - [y_n = k])^2.

    For two classes this is twice the binary score :math:`\\frac{1}{N}\\sum_n
    (p_{n1} - y_n)^2`.

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :param torch.Tensor y: integer labels in ``[0, K)``, ``(N,)``.
    :rtype: torch.Tensor
    """
    probs, y = _check_classification(probs, y)
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).to(probs.dtype)
    return (probs - onehot).pow(2).sum(-1).mean()


def predictive_entropy(probs) -> torch.Tensor:
    """
    Entropy of each example's predictive distribution,
    :math:`H_n = -\\sum_k p_{nk} \\log p_{nk}` with :math:`0 \\log 0 = 0`.

    :param torch.Tensor probs: predictive probabilities, ``(N, K)``.
    :returns: entropies in nats, ``(N,)``.
    :rtype: torch.Tensor
    """
    probs = _check_class_probs(probs)
    return -torch.special.xlogy(probs, probs).sum(-1)


# ---------------------------------------------------------------------------
# out-of-distribution detection


def auroc(scores_negative, scores_positive) -> torch.Tensor:
    """
    Area under the ROC curve of a score that should be higher on the positive
    examples: the Mann-Whitney statistic [5]

    .. math:: \\mathrm{AUROC} = \\frac{1}{n_+ n_-} \\sum_{i \\in +} \\sum_{j \\in -}
              \\Big([s_i > s_j] + \\tfrac12 [s_i = s_j]\\Big),

    computed from ranks (ties get their average rank) in :math:`O(n \\log n)`.
    0.5 is chance, 1 a perfect separation.

    :param torch.Tensor scores_negative: scores of the negative examples, ``(n_-,)``.
    :param torch.Tensor scores_positive: scores of the positive examples, ``(n_+,)``.
    :rtype: torch.Tensor
    """
    negative = _check_scores(scores_negative, "scores_negative")
    positive = _check_scores(scores_positive, "scores_positive").to(negative.device)
    dtype = torch.promote_types(negative.dtype, positive.dtype)  # ranks of the scores as given
    scores = torch.cat([negative.to(dtype), positive.to(dtype)])
    order = scores.argsort()
    _, inverse, counts = scores[order].unique_consecutive(return_inverse=True, return_counts=True)
    # average rank (1-based) of each group of tied scores
    ends = counts.cumsum(0).to(torch.float64)
    average_rank = ends - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(average_rank[inverse])
    ranks[order] = average_rank[inverse]
    num_negative, num_positive = len(negative), len(positive)
    positive_rank_sum = ranks[num_negative:].sum()
    u = positive_rank_sum - num_positive * (num_positive + 1) / 2
    return (u / (num_positive * num_negative)).to(scores.dtype)


#: OOD scores of :func:`ood_auroc`: name -> (predictive probs ``(N, K)`` -> score, higher = more OOD).
OOD_SCORES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "entropy": lambda probs: predictive_entropy(probs),
    "max_prob": lambda probs: -_check_class_probs(probs).max(-1).values,
}


def ood_auroc(probs_in, probs_out, score: str = "entropy") -> torch.Tensor:
    """
    How well the predictive tells out-of-distribution inputs from
    in-distribution ones: the :func:`auroc` of a per-example score, with the
    out-of-distribution examples as the positives [4]. Scores (higher means
    "more likely out of distribution"):

    * ``"entropy"``: the predictive entropy :math:`-\\sum_k \\bar p_k \\log \\bar p_k`;
    * ``"max_prob"``: minus the top-class probability, :math:`-\\max_k \\bar p_k`.

    Use the posterior predictive :math:`\\bar p` (:func:`predictive_probs_from_logits`):
    its entropy includes the disagreement between weight samples.

    :param torch.Tensor probs_in: predictive probabilities on in-distribution
        inputs, ``(N_in, K)``.
    :param torch.Tensor probs_out: the same on out-of-distribution inputs, ``(N_out, K)``.
    :param str score: ``"entropy"`` or ``"max_prob"`` (default: ``"entropy"``)
    :rtype: torch.Tensor
    """
    if not isinstance(score, str) or score not in OOD_SCORES:
        raise ValueError(f"score must be one of {list(OOD_SCORES)}, got {score!r}")
    probs_in, probs_out = _check_probs(probs_in, "probs_in"), _check_probs(probs_out, "probs_out")
    for name, probs in (("probs_in", probs_in), ("probs_out", probs_out)):
        if probs.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one example")
    if probs_in.shape[1] != probs_out.shape[1]:
        raise ValueError(
            f"probs_in and probs_out must have the same number of classes, got "
            f"{probs_in.shape[1]} and {probs_out.shape[1]}"
        )
    probs_in, probs_out = _check_class_probs(probs_in, "probs_in"), _check_class_probs(probs_out, "probs_out")
    return auroc(OOD_SCORES[score](probs_in), OOD_SCORES[score](probs_out))


# ---------------------------------------------------------------------------
# the number of test-time samples

#: Metrics :func:`metrics_by_num_samples` reports by default.
DEFAULT_SAMPLE_METRICS = {
    "nll": lambda probs, y: nll(probs, y),
    "accuracy": lambda probs, y: accuracy(probs, y),
    "ece": lambda probs, y: expected_calibration_error(probs, y),
}


def metrics_by_num_samples(
    logits,
    y,
    num_samples: Sequence[int],
    metrics: Optional[Dict[str, Callable]] = None,
) -> Dict[str, torch.Tensor]:
    """
    The effect of the number :math:`S` of test-time weight samples on the
    predictive: for each :math:`S` in ``num_samples``, the ``T`` samples are cut
    into :math:`G = \\lfloor T / S \\rfloor` disjoint consecutive groups, each
    group's :math:`S`-sample predictive
    :math:`\\bar p^{(g)} = \\frac1S \\sum_{s \\in g} \\mathrm{softmax}(f^{(s)})` is
    scored, and the scores are averaged over the groups,

    .. math:: m(S) = \\frac1G \\sum_{g=1}^G m(\\bar p^{(g)}, y),

    an estimate of the expected metric of a predictive made from :math:`S`
    samples (averaging over groups lowers its variance; :math:`S = T` is the
    predictive of all samples). :math:`S = 1` is the average single-network
    score; NLL and ECE usually fall as :math:`S` grows while accuracy changes
    little.

    :param torch.Tensor logits: per-sample logits, ``(T, N, K)`` (or binary
        ``(T, N)``), as :class:`~pyro.infer.Predictive` returns them for the
        ``"output"`` site of a :class:`~pyro_ngvi.BayesianNet`.
    :param torch.Tensor y: integer labels, ``(N,)``.
    :param num_samples: the values of :math:`S`, each in ``[1, T]``.
    :param dict metrics: name -> ``metric(probs, y)`` (default: ``nll``,
        ``accuracy`` and ``ece``, i.e. :func:`nll`, :func:`accuracy`,
        :func:`expected_calibration_error`)
    :returns: name -> tensor of shape ``(len(num_samples),)``.
    :rtype: dict
    """
    logits = _sample_stack(logits, "logits")
    total = logits.shape[0]
    sizes = list(num_samples) if isinstance(num_samples, (list, tuple, range, torch.Tensor)) else None
    if not sizes or any(isinstance(s, bool) or int(s) != s or not 1 <= s <= total for s in sizes):
        raise ValueError(
            f"num_samples must be a non-empty list of integers in [1, {total}] "
            f"(the number of samples in logits), got {num_samples!r}"
        )
    metrics = DEFAULT_SAMPLE_METRICS if metrics is None else metrics
    if not isinstance(metrics, dict) or not metrics or not all(callable(m) for m in metrics.values()):
        raise ValueError(f"metrics must be a non-empty dict of name -> metric(probs, y), got {metrics!r}")
    results = {name: [] for name in metrics}
    for size in map(int, sizes):
        groups = total // size
        scores = {name: 0.0 for name in metrics}
        for group in logits[: groups * size].split(size):
            probs = predictive_probs_from_logits(group)
            for name, metric in metrics.items():
                score = torch.as_tensor(metric(probs, y), dtype=probs.dtype)
                if score.numel() != 1:
                    raise ValueError(f"metric {name!r} must return one number, got shape {tuple(score.shape)}")
                scores[name] = scores[name] + score.reshape(())
        for name in metrics:
            results[name].append(scores[name] / groups)
    return {name: torch.stack(values) for name, values in results.items()}


# ---------------------------------------------------------------------------
# regression metrics


def gaussian_log_likelihood(
    loc_samples, scale: Union[float, torch.Tensor], y
) -> torch.Tensor:
    """
    Mean log-likelihood of ``y`` under the Gaussian mixture predictive,

    .. math:: \\frac{1}{N} \\sum_n \\log \\frac{1}{S} \\sum_s
              \\mathcal{N}(y_n; \\mu^{(s)}_n, \\sigma^{(s)}_n)
              = \\frac{1}{N} \\sum_n \\left[ \\mathrm{logsumexp}_s
              \\log \\mathcal{N}(y_n; \\mu^{(s)}_n, \\sigma^{(s)}_n)
              - \\log S \\right].

    :param torch.Tensor loc_samples: predictive means :math:`\\mu`, ``(S, N)``.
    :param scale: observation noise :math:`\\sigma > 0`: a scalar or a tensor
        broadcastable to ``(S, N)``.
    :param torch.Tensor y: targets, ``(N,)``.
    :rtype: torch.Tensor
    """
    loc_samples, y = _check_regression(loc_samples, y, "loc_samples")
    scale = torch.as_tensor(scale, dtype=loc_samples.dtype, device=loc_samples.device)
    try:
        shape = torch.broadcast_shapes(scale.shape, loc_samples.shape)
    except RuntimeError:
        shape = None
    if shape != loc_samples.shape:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} does not broadcast to "
            f"loc_samples' shape {tuple(loc_samples.shape)}"
        )
    if not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError("scale must be positive and finite")
    log_prob = torch.distributions.Normal(loc_samples, scale).log_prob(y)
    num_samples = loc_samples.shape[0]
    return (torch.logsumexp(log_prob, dim=0) - math.log(num_samples)).mean()


def interval_coverage(samples, y, level: float = 0.9) -> torch.Tensor:
    """
    Fraction of targets inside the central ``level`` predictive interval,

    .. math:: \\frac{1}{N} \\sum_n [q_n(\\alpha/2) \\le y_n \\le q_n(1 - \\alpha/2)],
              \\qquad \\alpha = 1 - \\text{level},

    where :math:`q_n` are the empirical quantiles of the ``S`` samples of point
    ``n`` (:func:`torch.quantile`, linear interpolation). A calibrated
    predictive has coverage close to ``level``.

    :param torch.Tensor samples: predictive samples, ``(S, N)``.
    :param torch.Tensor y: targets, ``(N,)``.
    :param float level: interval probability mass, in ``(0, 1)`` (default: 0.9)
    :rtype: torch.Tensor
    """
    if torch.is_tensor(level) and level.numel() == 1:
        level = level.item()
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    samples, y = _check_regression(samples, y, "samples")
    alpha = 1 - level
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=samples.dtype, device=samples.device)
    # torch.quantile has a size limit, so go through the points in chunks.
    chunk = max(1, _QUANTILE_MAX_NUMEL // samples.shape[0])
    bounds = torch.cat(
        [torch.quantile(part, q, dim=0) for part in samples.split(chunk, dim=1)],
        dim=1,
    )
    inside = (bounds[0] <= y) & (y <= bounds[1])
    return inside.to(samples.dtype).mean()


def rmse(pred_mean, y) -> torch.Tensor:
    """
    Root mean squared error :math:`\\sqrt{\\frac{1}{N} \\sum_n (\\hat y_n - y_n)^2}`.

    :param torch.Tensor pred_mean: point predictions :math:`\\hat y`, ``(N,)``.
    :param torch.Tensor y: targets, ``(N,)``.
    :rtype: torch.Tensor
    """
    pred_mean = _as_float(pred_mean)
    y = _as_float(y).to(pred_mean.device)
    if pred_mean.dim() != 1 or pred_mean.shape[0] == 0:
        raise ValueError(
            f"pred_mean must have shape (N,) with N >= 1, got {tuple(pred_mean.shape)}"
        )
    if y.shape != pred_mean.shape:
        raise ValueError(
            f"y must have shape {tuple(pred_mean.shape)} to match pred_mean, "
            f"got {tuple(y.shape)}"
        )
    return (pred_mean - y).pow(2).mean().sqrt()


def _check_scores(scores, name: str) -> torch.Tensor:
    scores = torch.as_tensor(scores)
    # integers as float64: float32 would merge those above 2^24 into ties
    scores = scores if scores.is_floating_point() else scores.to(torch.float64)
    if scores.dim() != 1 or scores.shape[0] == 0:
        raise ValueError(f"{name} must have shape (n,) with n >= 1, got {tuple(scores.shape)}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{name} must be finite")
    return scores


def _sample_stack(value, name: str) -> torch.Tensor:
    """``value`` as a float tensor of per-sample predictions, ``(S, N, K)`` or ``(S, N)`` with S >= 1."""
    value = _as_float(value)
    if value.dim() not in (2, 3):
        raise ValueError(f"{name} must have shape (S, N, K) or (S, N), got {tuple(value.shape)}")
    if value.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one sample")
    if bool(torch.any(torch.isnan(value) | (value == math.inf))):
        raise ValueError(f"{name} must not be NaN or +inf (-inf is a probability of 0)")
    return value
