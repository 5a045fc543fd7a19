import math

import pytest
import torch
from scipy.stats import norm
from sklearn.metrics import brier_score_loss, log_loss

from pyro_ngvi import metrics
from pyro_ngvi.metrics import (
    accuracy,
    brier_score,
    expected_calibration_error,
    gaussian_log_likelihood,
    interval_coverage,
    nll,
    predictive_entropy,
    predictive_probs,
    predictive_probs_from_logits,
    reliability_diagram_data,
    rmse,
)

# Four examples, three classes, used by the hand-computed tests below.
#   row  probs            y   conf  argmax  correct  p[y]
#   0    (0.7, 0.2, 0.1)  0   0.7   0       yes      0.7
#   1    (0.1, 0.6, 0.3)  2   0.6   1       no       0.3
#   2    (0.4, 0.5, 0.1)  1   0.5   1       yes      0.5
#   3    (0.0, 0.0, 1.0)  2   1.0   2       yes      1.0
PROBS = torch.tensor(
    [
        [0.7, 0.2, 0.1],
        [0.1, 0.6, 0.3],
        [0.4, 0.5, 0.1],
        [0.0, 0.0, 1.0],
    ],
    dtype=torch.float64,
)
Y = torch.tensor([0, 2, 1, 2])


def assert_close(actual, expected, **kwargs):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, **kwargs)


# ---------------------------------------------------------------------------
# predictive probabilities


def test_predictive_probs_is_mean_of_class_probability_samples():
    # S=2, N=1, K=3: ((0.2, 0.3, 0.5) + (0.6, 0.3, 0.1)) / 2 = (0.4, 0.3, 0.3)
    samples = torch.tensor(
        [[[0.2, 0.3, 0.5]], [[0.6, 0.3, 0.1]]], dtype=torch.float64
    )
    assert_close(predictive_probs(samples), [[0.4, 0.3, 0.3]])


def test_predictive_probs_binary_gives_two_columns():
    # S=2, N=2: mean p1 = ((0.2 + 0.6) / 2, (1.0 + 0.0) / 2) = (0.4, 0.5)
    samples = torch.tensor([[0.2, 1.0], [0.6, 0.0]], dtype=torch.float64)
    assert_close(predictive_probs(samples), [[0.6, 0.4], [0.5, 0.5]])


def test_predictive_probs_from_logits_is_mean_of_softmax():
    # softmax(0, log 3) = (1/4, 3/4), softmax(0, 0) = (1/2, 1/2); mean (3/8, 5/8)
    logits = torch.tensor([[[0.0, math.log(3)]], [[0.0, 0.0]]], dtype=torch.float64)
    assert_close(predictive_probs_from_logits(logits), [[3 / 8, 5 / 8]])


def test_predictive_probs_from_binary_logits_uses_sigmoid():
    # sigmoid(log 3) = 3/4, sigmoid(0) = 1/2; mean 5/8 -> (3/8, 5/8),
    # the same as the two-class logits (0, l) above.
    logits = torch.tensor([[math.log(3)], [0.0]], dtype=torch.float64)
    assert_close(predictive_probs_from_logits(logits), [[3 / 8, 5 / 8]])


# ---------------------------------------------------------------------------
# classification metrics


def test_nll_is_mean_minus_log_of_label_probabilities():
    # -(log 0.7 + log 0.3 + log 0.5 + log 1.0) / 4
    expected = -(math.log(0.7) + math.log(0.3) + math.log(0.5) + 0.0) / 4
    assert_close(nll(PROBS, Y), expected)


def test_nll_matches_sklearn_log_loss():
    expected = log_loss(Y.numpy(), PROBS.numpy(), labels=[0, 1, 2])
    assert_close(nll(PROBS, Y), expected)


def test_nll_clamps_zero_probability_at_machine_epsilon():
    # p[y] = 0 -> -log(eps), eps = finfo(dtype).eps
    probs = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([1])
    assert_close(nll(probs, y), -math.log(torch.finfo(torch.float64).eps))
    float32_eps = torch.finfo(torch.float32).eps
    assert_close(nll(probs.float(), y), -math.log(float32_eps), rtol=1e-6, atol=0)


def test_nll_accepts_whole_number_float_labels():
    assert_close(nll(PROBS, Y.double()), nll(PROBS, Y))


def test_accuracy_counts_correct_top_class():
    # rows 0, 2, 3 correct -> 3/4
    assert_close(accuracy(PROBS, Y), 0.75)


def test_ece_three_bins_by_hand_with_empty_bin_and_confidence_one():
    # Bins [0, 1/3), [1/3, 2/3), [2/3, 1]; confidences 0.7, 0.6, 0.5, 1.0.
    #   bin 0: empty (K=3 so conf >= 1/3)             -> contributes 0
    #   bin 1: rows 1, 2: conf (0.6+0.5)/2 = 0.55, acc 1/2
    #   bin 2: rows 0, 3 (1.0 in last bin): conf (0.7+1.0)/2 = 0.85, acc 1
    # ECE = 2/4 * |0.5 - 0.55| + 2/4 * |1 - 0.85| = 0.025 + 0.075 = 0.1
    assert_close(expected_calibration_error(PROBS, Y, num_bins=3), 0.1)


def test_ece_two_bins_puts_half_and_one_in_upper_bin():
    # Bins [0, 0.5), [0.5, 1]: 0.5 and 1.0 both land in bin 1, bin 0 is empty.
    #   bin 1: all rows: conf (0.7+0.6+0.5+1.0)/4 = 0.7, acc 3/4
    # ECE = |0.75 - 0.7| = 0.05
    assert_close(expected_calibration_error(PROBS, Y, num_bins=2), 0.05)


def test_ece_one_bin_is_gap_between_accuracy_and_mean_confidence():
    assert_close(expected_calibration_error(PROBS, Y, num_bins=1), 0.05)


def test_ece_of_perfectly_confident_correct_predictions_is_zero():
    probs = torch.eye(3, dtype=torch.float64)
    assert_close(expected_calibration_error(probs, torch.arange(3)), 0.0)


def test_reliability_diagram_data_by_hand():
    # As in the three-bin ECE test; empty bin gives NaN confidence/accuracy.
    confidence, acc, count = reliability_diagram_data(PROBS, Y, num_bins=3)
    assert_close(confidence, [math.nan, 0.55, 0.85], equal_nan=True)
    assert_close(acc, [math.nan, 0.5, 1.0], equal_nan=True)
    assert count.tolist() == [0, 2, 2]


def test_brier_score_by_hand():
    # row 0 (y=0): 0.3^2 + 0.2^2 + 0.1^2 = 0.14
    # row 1 (y=2): 0.1^2 + 0.6^2 + 0.7^2 = 0.86
    # row 2 (y=1): 0.4^2 + 0.5^2 + 0.1^2 = 0.42
    # row 3 (y=2): 0
    # mean = 1.42 / 4 = 0.355
    assert_close(brier_score(PROBS, Y), 0.355)


def test_brier_score_matches_sklearn_multiclass():
    expected = brier_score_loss(
        Y.numpy(), PROBS.numpy(), labels=[0, 1, 2], scale_by_half=False
    )
    assert_close(brier_score(PROBS, Y), expected)


def test_brier_score_binary_is_twice_sklearn_binary_score():
    # binary score: ((0.9-1)^2 + 0.2^2 + 0.6^2) / 3 = 0.41 / 3; ours doubles it
    p1 = torch.tensor([0.9, 0.2, 0.6], dtype=torch.float64)
    y = torch.tensor([1, 0, 0])
    probs = torch.stack([1 - p1, p1], dim=-1)
    assert_close(brier_score(probs, y), 0.82 / 3)
    assert_close(brier_score(probs, y), 2 * brier_score_loss(y.numpy(), p1.numpy()))


def test_predictive_entropy_uniform_one_hot_and_half():
    # uniform over 4 -> log 4; one-hot -> 0 (0 log 0 = 0); (1/2, 1/2, 0, 0) -> log 2
    probs = torch.tensor(
        [
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 1.0, 0.0, 0.0],
            [0.5, 0.5, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    assert_close(predictive_entropy(probs), [math.log(4), 0.0, math.log(2)])


# ---------------------------------------------------------------------------
# regression metrics


def test_gaussian_log_likelihood_one_sample_matches_scipy():
    loc = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([0.5, 1.0, -1.0], dtype=torch.float64)
    expected = norm.logpdf(y.numpy(), loc=loc[0].numpy(), scale=0.5).mean()
    assert_close(gaussian_log_likelihood(loc, 0.5, y), expected)


def test_gaussian_log_likelihood_two_component_mixture_by_hand():
    # locs (0, 2), scale 1, phi(z) = exp(-z^2/2) / sqrt(2 pi):
    #   y = 1: (phi(1) + phi(1)) / 2 = phi(1) -> -1/2 - log(2 pi)/2
    #   y = 0: (phi(0) + phi(2)) / 2        -> log((1 + e^-2) / 2) - log(2 pi)/2
    loc = torch.tensor([[0.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0], dtype=torch.float64)
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    ll_1 = -0.5 - half_log_2pi
    ll_0 = math.log((1 + math.exp(-2)) / 2) - half_log_2pi
    assert_close(gaussian_log_likelihood(loc, 1.0, y), (ll_1 + ll_0) / 2)


def test_gaussian_log_likelihood_per_sample_scale():
    # locs (0, 0), scales (1, 2), y = 0: (phi(0)/1 + phi(0)/2) / 2 = 0.75 / sqrt(2 pi)
    loc = torch.zeros(2, 1, dtype=torch.float64)
    scale = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    y = torch.zeros(1, dtype=torch.float64)
    expected = math.log(0.75) - 0.5 * math.log(2 * math.pi)
    assert_close(gaussian_log_likelihood(loc, scale, y), expected)


def test_gaussian_log_likelihood_is_stable_far_in_the_tail():
    # two identical components: the mixture is the component itself, although
    # its density (log about -5000) underflows to 0 in exp.
    loc = torch.zeros(2, 1, dtype=torch.float64)
    y = torch.ones(1, dtype=torch.float64)
    expected = norm.logpdf(1.0, loc=0.0, scale=0.01)
    assert_close(gaussian_log_likelihood(loc, 0.01, y), expected)


def test_interval_coverage_on_constructed_samples():
    # 11 samples 0, 1, ..., 10 per point. level 0.8 -> quantiles 0.1, 0.9 at
    # positions 0.1 * 10 = 1 and 0.9 * 10 = 9, interval [1, 9] (endpoints in).
    # y = 0.5 (out), 1 (in), 5 (in), 9 (in), 9.5 (out) -> 3/5
    samples = torch.arange(11, dtype=torch.float64).unsqueeze(-1).expand(11, 5)
    y = torch.tensor([0.5, 1.0, 5.0, 9.0, 9.5], dtype=torch.float64)
    assert_close(interval_coverage(samples, y, level=0.8), 0.6)


def test_interval_coverage_interpolates_quantiles_linearly():
    # level 0.5 -> quantiles 0.25, 0.75 at positions 2.5, 7.5: interval [2.5, 7.5]
    # y = 2.4 (out), 2.5 (in), 7.5 (in), 7.6 (out) -> 2/4
    samples = torch.arange(11, dtype=torch.float64).unsqueeze(-1).expand(11, 4)
    y = torch.tensor([2.4, 2.5, 7.5, 7.6], dtype=torch.float64)
    assert_close(interval_coverage(samples, y, level=0.5), 0.5)


def test_interval_coverage_chunked_equals_unchunked(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(50, 37, generator=generator, dtype=torch.float64)
    y = 1.5 * torch.randn(37, generator=generator, dtype=torch.float64)
    expected = interval_coverage(samples, y, level=0.7)
    monkeypatch.setattr(metrics, "_QUANTILE_MAX_NUMEL", 120)  # 2 columns a chunk
    assert_close(interval_coverage(samples, y, level=0.7), expected)


def test_rmse_by_hand():
    # errors (0, 2, -4): sqrt((0 + 4 + 16) / 3)
    pred = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 7.0], dtype=torch.float64)
    assert_close(rmse(pred, y), math.sqrt(20 / 3))


# ---------------------------------------------------------------------------
# input validation

CLASSIFICATION_METRICS = [
    nll,
    accuracy,
    brier_score,
    expected_calibration_error,
    reliability_diagram_data,
]


@pytest.mark.parametrize("metric", CLASSIFICATION_METRICS)
@pytest.mark.parametrize(
    "y", [torch.tensor([0, 1, 2]), torch.tensor([[0, 1, 2, 0]])], ids=["short", "2d"]
)
def test_label_shape_mismatch_raises(metric, y):
    with pytest.raises(ValueError, match=r"^y must have shape \(4,\)"):
        metric(PROBS, y)


@pytest.mark.parametrize("metric", CLASSIFICATION_METRICS)
@pytest.mark.parametrize(
    "y",
    [
        torch.tensor([0, 1, 3, 0]),
        torch.tensor([0, -1, 2, 0]),
        torch.tensor([0.0, 0.5, 1.0, 2.0]),
    ],
    ids=["too-large", "negative", "fractional"],
)
def test_invalid_labels_raise(metric, y):
    with pytest.raises(ValueError, match=r"^y must hold"):
        metric(PROBS, y)


@pytest.mark.parametrize("metric", CLASSIFICATION_METRICS)
@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan], ids=["above", "below", "nan"])
def test_probs_outside_unit_interval_raise(metric, bad):
    probs = PROBS.clone()
    probs[0, 0] = bad
    with pytest.raises(ValueError, match=r"^probs must lie in \[0, 1\]"):
        metric(probs, Y)


@pytest.mark.parametrize("metric", CLASSIFICATION_METRICS)
def test_probs_of_wrong_rank_raise(metric):
    with pytest.raises(ValueError, match=r"^probs must have 2 dimensions"):
        metric(PROBS.unsqueeze(0), Y)


@pytest.mark.parametrize("metric", CLASSIFICATION_METRICS + [lambda p, y: predictive_entropy(p),
                                                       lambda p, y: metrics.ood_auroc(p, p, "max_prob")])
def test_probs_whose_rows_do_not_sum_to_one_raise(metric):
    """Rows of per-class sigmoids or unnormalised scores in [0, 1] gave a number (nll 0.105 for
    rows (0.9, 0.9)); a float32 softmax of 1000 classes passes."""
    with pytest.raises(ValueError, match=r"must sum to 1 over the classes"):
        metric(torch.full((4, 3), 0.9), Y)
    probs = torch.randn(4, 1000).softmax(-1)
    metric(probs, torch.zeros(4, dtype=torch.long))


def test_logits_of_minus_inf_for_every_class_raise():
    """softmax of such a row is NaN: the predictive was NaN with no error."""
    with pytest.raises(ValueError, match=r"^logits must not be -inf for every class"):
        predictive_probs_from_logits(torch.tensor([[[0.0, 1.0], [-math.inf, -math.inf]]]))
    assert_close(predictive_probs_from_logits(torch.tensor([[[0.0, -math.inf]]])), torch.tensor([[1.0, 0.0]]))


def test_predictive_entropy_rejects_invalid_probs():
    with pytest.raises(ValueError, match=r"^probs must lie in \[0, 1\]"):
        predictive_entropy(torch.tensor([[1.5, -0.5]]))
    with pytest.raises(ValueError, match=r"^probs must have 2 dimensions"):
        predictive_entropy(torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("num_bins", [0, -3, 2.5, math.nan, math.inf])
@pytest.mark.parametrize(
    "metric", [expected_calibration_error, reliability_diagram_data]
)
def test_invalid_num_bins_raise(metric, num_bins):
    with pytest.raises(ValueError, match=r"^num_bins must be a positive integer"):
        metric(PROBS, Y, num_bins=num_bins)


def test_predictive_probs_rejects_invalid_samples():
    with pytest.raises(ValueError, match=r"^samples must have shape"):
        predictive_probs(torch.full((4,), 0.5))
    with pytest.raises(ValueError, match=r"^samples must have shape"):
        predictive_probs(torch.full((2, 3, 4, 5), 0.5))
    with pytest.raises(ValueError, match=r"^samples must lie in \[0, 1\]"):
        predictive_probs(torch.tensor([[1.2, 0.3]]))
    with pytest.raises(ValueError, match=r"^samples must sum to 1"):
        predictive_probs(torch.tensor([[[0.2, 0.2, 0.2]]]))


def test_predictive_probs_from_logits_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"^logits must have shape"):
        predictive_probs_from_logits(torch.zeros(3))


def test_one_logit_per_example_is_refused_and_named_not_read_as_one_certain_class():
    """(S, N, 1) logits (a Linear(D, 1) head's Bernoulli log-odds, unsqueezed) gave probabilities of
    1.0 for every example (a softmax over one class): predictive_entropy 0 and ood_auroc 0.5 whatever
    the logits; they are refused now, and the squeezed logits give the sigmoid's mean."""
    logits = torch.tensor([[[2.0], [-1.0]], [[0.0], [3.0]]])
    with pytest.raises(ValueError, match=r"^logits of shape \(2, 2, 1\) hold one class.*squeeze\(-1\)"):
        predictive_probs_from_logits(logits)
    p1 = torch.sigmoid(logits.squeeze(-1)).mean(0)
    assert torch.allclose(predictive_probs_from_logits(logits.squeeze(-1)), torch.stack([1 - p1, p1], -1))


def test_gaussian_log_likelihood_rejects_invalid_inputs():
    loc = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"^y must have shape \(3,\)"):
        gaussian_log_likelihood(loc, 1.0, torch.zeros(2))
    with pytest.raises(ValueError, match=r"^loc_samples must have shape \(S, N\)"):
        gaussian_log_likelihood(torch.zeros(3), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^scale of shape \(4,\) does not broadcast"):
        gaussian_log_likelihood(loc, torch.ones(4), torch.zeros(3))
    with pytest.raises(ValueError, match=r"^scale of shape \(2, 2, 3\) does not"):
        gaussian_log_likelihood(loc, torch.ones(2, 2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"^scale must be positive"):
        gaussian_log_likelihood(loc, torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3))
    with pytest.raises(ValueError, match=r"^scale must be positive and finite"):  # (was -inf, silently)
        gaussian_log_likelihood(loc, math.inf, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^loc_samples must be finite"):
        gaussian_log_likelihood(torch.tensor([[0.0, math.nan, 0.0], [0.0] * 3]), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^y must be finite"):
        gaussian_log_likelihood(loc, 1.0, torch.tensor([0.0, math.inf, 0.0]))


def test_interval_coverage_rejects_non_finite_samples():
    """A NaN sample used to count its point as outside the interval (coverage 0, silently)."""
    samples = torch.randn(20, 3)
    samples[4, 1] = math.nan
    with pytest.raises(ValueError, match=r"^samples must be finite"):
        interval_coverage(samples, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^y must be finite"):
        interval_coverage(torch.randn(20, 3), torch.tensor([0.0, -math.inf, 0.0]))


@pytest.mark.parametrize("level", [0.0, 1.0, -0.1, 1.5, math.nan, "0.9", None])
def test_interval_coverage_rejects_level_outside_unit_interval(level):
    with pytest.raises(ValueError, match=r"^level must lie in \(0, 1\)"):
        interval_coverage(torch.zeros(5, 2), torch.zeros(2), level=level)


def test_interval_coverage_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"^y must have shape \(2,\)"):
        interval_coverage(torch.zeros(5, 2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"^samples must have shape \(S, N\)"):
        interval_coverage(torch.zeros(5), torch.zeros(5))


def test_rmse_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"^y must have shape \(3,\)"):
        rmse(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"^pred_mean must have shape \(N,\)"):
        rmse(torch.zeros(3, 1), torch.zeros(3, 1))


# ---------------------------------------------------------------------------
# out-of-distribution detection


def brute_force_auroc(negative, positive):
    """Pair count: P(s+ > s-) + P(s+ = s-) / 2 over all pairs."""
    wins = sum(float(p > n) + 0.5 * float(p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


@pytest.mark.parametrize("seed", range(3))
def test_auroc_matches_sklearn_and_pair_count_with_ties(seed):
    from sklearn.metrics import roc_auc_score

    generator = torch.Generator().manual_seed(seed)
    negative = torch.randint(0, 6, (37,), generator=generator).double()  # many ties
    positive = torch.randint(2, 9, (23,), generator=generator).double()
    expected = roc_auc_score([0] * 37 + [1] * 23, torch.cat([negative, positive]).numpy())
    assert_close(metrics.auroc(negative, positive), expected, rtol=1e-12, atol=0)
    assert_close(metrics.auroc(negative, positive), brute_force_auroc(negative, positive),
                 rtol=1e-12, atol=0)


def test_auroc_extremes():
    assert metrics.auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 1.0
    assert metrics.auroc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 0.0
    assert metrics.auroc(torch.tensor([1.0, 1.0]), torch.tensor([1.0])) == 0.5


@pytest.mark.parametrize("score", ["entropy", "max_prob"])
def test_ood_auroc_scores_out_of_distribution_as_positives(score):
    from sklearn.metrics import roc_auc_score

    generator = torch.Generator().manual_seed(0)
    probs_in = torch.softmax(3 * torch.randn(40, 4, generator=generator, dtype=torch.float64), -1)
    probs_out = torch.softmax(torch.randn(30, 4, generator=generator, dtype=torch.float64), -1)
    probs = torch.cat([probs_in, probs_out])
    if score == "entropy":
        values = -(probs * probs.log()).sum(-1)
    else:
        values = -probs.max(-1).values
    expected = roc_auc_score([0] * 40 + [1] * 30, values.numpy())
    assert_close(metrics.ood_auroc(probs_in, probs_out, score=score), expected, rtol=1e-12, atol=0)


def test_ood_auroc_input_errors():
    with pytest.raises(ValueError, match="score"):
        metrics.ood_auroc(PROBS, PROBS, score="energy")
    with pytest.raises(ValueError, match="number of classes"):
        metrics.ood_auroc(PROBS, PROBS[:, :2])
    with pytest.raises(ValueError, match="probs_out"):
        metrics.ood_auroc(PROBS, PROBS[0])
    with pytest.raises(ValueError, match="scores_positive"):
        metrics.auroc(torch.ones(3), torch.tensor([]))
    with pytest.raises(ValueError, match="finite"):
        metrics.auroc(torch.ones(3), torch.tensor([float("nan")]))


# ---------------------------------------------------------------------------
# the number of test-time samples


def test_metrics_by_num_samples_averages_disjoint_groups():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 30, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=generator)
    result = metrics.metrics_by_num_samples(logits, y, [1, 3, 7])
    assert set(result) == {"nll", "accuracy", "ece"}
    for name, metric in [("nll", nll), ("accuracy", accuracy), ("ece", expected_calibration_error)]:
        # S = 1: the mean single-network score; S = 3: groups (0-2), (3-5), sample 6 unused;
        # S = 7: the predictive of all samples
        single = sum(metric(torch.softmax(logits[s], -1), y) for s in range(7)) / 7
        triples = sum(metric(torch.softmax(logits[g:g + 3], -1).mean(0), y) for g in (0, 3)) / 2
        full = metric(torch.softmax(logits, -1).mean(0), y)
        assert_close(result[name], torch.stack([single, triples, full]), rtol=1e-12, atol=1e-15)


def test_metrics_by_num_samples_custom_metric_and_errors():
    logits = torch.zeros(4, 2, 3)
    result = metrics.metrics_by_num_samples(logits, torch.tensor([0, 1]), [2], {"brier": brier_score})
    assert_close(result["brier"], [2 / 3], rtol=1e-6, atol=0)
    for bad in ([], [0], [5], [1.5]):
        with pytest.raises(ValueError, match="num_samples"):
            metrics.metrics_by_num_samples(logits, torch.tensor([0, 1]), bad)


def test_auroc_ranks_scores_as_given_whatever_their_dtypes():
    """Scores of mixed precision, or integers beyond 2^24, are ranked as given: casting to the
    negatives' float32 (or to the default float) would merge them into ties (0.5, not 0 or 1)."""
    low = torch.tensor([0.1], dtype=torch.float32)
    high = low.double() + 1e-12  # the same number in float32
    assert metrics.auroc(low, high) == 1.0 and metrics.auroc(high, low) == 0.0
    assert metrics.auroc(torch.tensor([16777217]), torch.tensor([16777216])) == 0.0
    assert metrics.auroc(torch.tensor([16777216]), torch.tensor([16777217])) == 1.0


def test_ood_auroc_and_metrics_by_num_samples_name_the_bad_argument():
    with pytest.raises(ValueError, match="score must be one of"):
        metrics.ood_auroc(PROBS, PROBS, score=["entropy"])
    with pytest.raises(ValueError, match="probs_in must hold at least one example"):
        metrics.ood_auroc(PROBS[:0], PROBS)
    with pytest.raises(ValueError, match="probs_out must hold at least one example"):
        metrics.ood_auroc(PROBS, PROBS[:0])
    logits, y = torch.zeros(4, 2, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="num_samples"):
        metrics.metrics_by_num_samples(logits, y, 2)
    for bad in ({}, {"a": 3}, [brier_score]):
        with pytest.raises(ValueError, match="metrics must be"):
            metrics.metrics_by_num_samples(logits, y, [1], bad)
    with pytest.raises(ValueError, match="metric 'mean' must return one number"):
        metrics.metrics_by_num_samples(logits, y, [1, 2], {"mean": lambda probs, y: probs.mean(0)})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="logits must not be NaN"):
            metrics.metrics_by_num_samples(torch.full((4, 2, 3), bad), y, [1])
    # -inf is a probability of 0, single-class labels are labels
    logits[:, :, 2] = -math.inf
    result = metrics.metrics_by_num_samples(logits, torch.tensor([0, 0]), [1, 4])
    assert_close(result["nll"], torch.full((2,), math.log(2.0)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_scored_in_float32(dtype):
    # Logits of a network under torch.autocast come out in half precision. Their eps
    # (1e-3, 8e-3) capped an example's NLL at 6.9 / 4.9 nats: the one-sample NLL of these
    # logits read 3.09 (float16) and 2.70 (bfloat16) against 3.27; interval_coverage raised
    # torch.quantile's "input tensor must be either float or double dtype".
    torch.manual_seed(0)
    logits = torch.randn(8, 50, 4, dtype=torch.float64) * 3
    y = torch.randint(0, 4, (50,))
    exact = metrics.metrics_by_num_samples(logits, y, [1, 8])
    half = metrics.metrics_by_num_samples(logits.to(dtype), y, [1, 8])
    for name in exact:
        torch.testing.assert_close(half[name].double(), exact[name], rtol=0, atol=5e-3)
    probs = torch.softmax(logits[0].to(dtype), -1)  # (rows sum to 1 only to the dtype's eps)
    assert abs(nll(probs, y).item() - nll(torch.softmax(logits[0], -1), y).item()) < 5e-3
    samples, target = torch.randn(200, 30, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    assert interval_coverage(samples.to(dtype), target.to(dtype)).item() == pytest.approx(
        interval_coverage(samples, target).item(), abs=1 / 30 + 1e-6)
