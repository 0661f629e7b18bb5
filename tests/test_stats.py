"""attn_course.stats against SciPy's own t-tests (an outside oracle), plus coverage and verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from attn_course.stats import Difference, paired_difference, t_quantile, welch_difference

A = [1.05, 1.18, 1.19, 1.14, 0.88, 0.95, 1.17, 1.03]
B = [1.09, 1.28, 1.36, 1.24, 1.21, 1.35, 1.27, 1.02]


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_paired_interval_matches_scipy(confidence):
    ours = paired_difference(A, B, confidence=confidence)
    theirs = scipy_stats.ttest_rel(A, B).confidence_interval(confidence)
    # Measured |difference| about 2e-16: the same formula, summed in another order.
    assert ours.low == pytest.approx(theirs.low, abs=1e-12)
    assert ours.high == pytest.approx(theirs.high, abs=1e-12)
    assert ours.difference == pytest.approx(np.mean(np.subtract(A, B)), abs=1e-12)
    assert (ours.n, ours.method) == (8, "paired t")


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_welch_interval_matches_scipy(confidence):
    b = B[:5] + [0.7]  # a different number of runs: Welch needs no pairing
    ours = welch_difference(A, b, confidence=confidence)
    theirs = scipy_stats.ttest_ind(A, b, equal_var=False).confidence_interval(confidence)
    assert ours.low == pytest.approx(theirs.low, abs=1e-12)  # measured about 1e-16
    assert ours.high == pytest.approx(theirs.high, abs=1e-12)
    assert (ours.n, ours.method) == (6, "Welch t")


def test_t_quantile_known_values():
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451051977987, abs=1e-12)  # Student's table: 2.776
    assert t_quantile(0.975, 1e9) == pytest.approx(1.959963984540054, abs=1e-6)  # the normal limit
    with pytest.raises(ValueError, match="probability"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df"):
        t_quantile(0.5, 0)


@pytest.mark.parametrize("maker,shared_scale", [(paired_difference, 1.0), (welch_difference, 0.0)])
def test_coverage_is_close_to_the_nominal_level(maker, shared_scale):
    """Over many simulated experiments, the 95% interval contains the true difference ~95% of the time.

    Paired runs share noise per seed (what pairing removes); Welch's runs are independent, as it assumes.
    """
    rng = np.random.default_rng(0)
    trials, n, true_difference = 2000, 6, 0.3
    shared = shared_scale * rng.normal(size=(trials, n))
    a = true_difference + shared + 0.5 * rng.normal(size=(trials, n))
    b = shared + 0.5 * rng.normal(size=(trials, n))
    intervals = [maker(a[i], b[i]) for i in range(trials)]
    covered = sum(d.low <= true_difference <= d.high for d in intervals) / trials
    # Binomial(2000, 0.95) has sd 0.0049: 0.93..0.97 is four sd either side. Measured: 0.954 (paired), 0.957 (Welch).
    assert 0.93 <= covered <= 0.97, covered


def test_pairing_gives_a_narrower_interval_when_seeds_share_noise():
    rng = np.random.default_rng(1)
    shared = rng.normal(size=8)
    a, b = shared + 0.2 + 0.1 * rng.normal(size=8), shared + 0.1 * rng.normal(size=8)
    paired, welch = paired_difference(a, b), welch_difference(a, b)
    assert (paired.high - paired.low) < (welch.high - welch.low) / 3
    assert paired.verdict() == "higher" and welch.verdict() == "no clear difference"


def test_verdict_follows_the_interval():
    lower = paired_difference([1.0, 1.1, 0.9], [2.0, 2.1, 1.95], metric="loss", lower_is_better=True)
    assert lower.high < 0 and lower.verdict() == "lower (better)"
    assert "excludes 0" in lower.claim() and "lower (better)" in lower.claim()
    higher = paired_difference([0.9, 0.8, 0.85], [0.5, 0.55, 0.45], metric="accuracy", lower_is_better=False)
    assert higher.low > 0 and higher.verdict() == "higher (better)"
    unclear = paired_difference([1.0, 1.2, 0.9, 1.1], [1.1, 1.0, 1.0, 1.05])
    assert unclear.contains_zero and unclear.verdict() == "no clear difference"
    assert "contains 0" in unclear.claim()
    assert unclear.margin == pytest.approx(min(-unclear.low, unclear.high))
    neutral = paired_difference([2.0, 2.1, 2.2], [1.0, 1.0, 1.1])
    assert neutral.verdict() == "higher"  # lower_is_better=None: no better/worse
    assert "95% CI" in str(neutral) and "paired t, n = 3" in str(neutral)


def test_identical_runs_give_a_point_interval():
    same = paired_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert (same.low, same.high, same.verdict()) == (0.0, 0.0, "no clear difference")
    shifted = welch_difference([2.0, 2.0], [1.0, 1.0])
    assert (shifted.low, shifted.high, shifted.verdict()) == (1.0, 1.0, "higher")


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2 runs"):
        paired_difference([1], [2])
    with pytest.raises(ValueError, match="NaN or inf"):
        welch_difference([1.0, math.nan], [1.0, 2.0])
    with pytest.raises(ValueError, match="confidence"):
        paired_difference([1, 2], [2, 3], confidence=95)
    with pytest.raises(TypeError, match="sequence of numbers"):
        paired_difference(["x", "y"], [1, 2])


def test_difference_is_frozen():
    d = paired_difference([1.0, 2.0], [0.0, 1.5])
    assert isinstance(d, Difference)
    with pytest.raises(AttributeError):
        d.low = 0.0
