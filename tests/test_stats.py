"""attn_course.stats against SciPy's own t-tests (an outside oracle), plus coverage and verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from attn_course.stats import (
    Difference,
    bootstrap_difference,
    holm,
    paired_difference,
    t_quantile,
    verdicts_are_stable,
    welch_difference,
    wilcoxon_p,
)

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


# --- p-values, Holm's correction, negligible effects, stability, non-parametric checks ------------


def test_p_values_match_scipy():
    ours = paired_difference(A, B)
    assert ours.p_value == pytest.approx(scipy_stats.ttest_rel(A, B).pvalue, rel=1e-9)  # measured rel 1e-15
    b = B[:5] + [0.7]
    welch = welch_difference(A, b)
    assert welch.p_value == pytest.approx(scipy_stats.ttest_ind(A, b, equal_var=False).pvalue, rel=1e-9)
    assert ours.pairs == pytest.approx(tuple(np.subtract(A, B)), abs=1e-15)


def test_holm_by_hand():
    """p = (0.01, 0.04, 0.03, 0.005): sorted 0.005 x 4, 0.01 x 3, 0.03 x 2, 0.04 x 1, then made monotone."""
    family = [Difference("a", "b", "m", 0, 0, 0, -1, 1, 0.95, 8, "paired t", p_value=p) for p in (0.01, 0.04, 0.03, 0.005)]
    adjusted = [d.adjusted_p for d in holm(family)]
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert {d.family_size for d in holm(family)} == {4}


def _holm_step_down(p_values, alpha):
    """Holm (1979) as he states it: reject in order while p_(j) <= alpha / (m - j + 1); stop at the first failure."""
    m = len(p_values)
    rejected = [False] * m
    for j, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        if p_values[i] > alpha / (m - j):
            break
        rejected[i] = True
    return rejected


@pytest.mark.parametrize("seed", range(20))
def test_holm_adjusted_p_agrees_with_the_step_down_procedure(seed):
    rng = np.random.default_rng(seed)
    p_values = list(rng.uniform(0, 0.08, size=rng.integers(2, 9)))
    family = holm([Difference("a", "b", "m", 0, 0, 0, 0.1, 0.2, 0.95, 8, "paired t", p_value=p) for p in p_values])
    for alpha in (0.01, 0.05, 0.1):
        assert [d.adjusted_p <= alpha for d in family] == _holm_step_down(p_values, alpha)


def test_holm_turns_a_lucky_verdict_into_no_clear_difference():
    weak = paired_difference([1.0, 1.1, 1.3, 1.2], [0.9, 1.0, 1.0, 1.0], lower_is_better=True)  # p about 0.02
    strong = paired_difference([2.0, 2.1, 2.2, 2.05], [1.0, 1.05, 1.1, 1.0], lower_is_better=True)
    nothing = [paired_difference([1.0, 1.2, 0.9, 1.1], [1.1, 1.0, 1.0, 1.05]) for _ in range(4)]
    assert weak.clear and weak.verdict() == "higher (worse)"
    family = holm([weak, strong, *nothing])
    assert family[0].adjusted_p >= 0.05 and family[0].verdict() == "no clear difference"
    assert family[0].claim().endswith("no clear difference in value: its Holm-adjusted p (6 comparisons) is not below 0.05")
    assert weak.claim().endswith("the 95% interval of the difference excludes 0")  # alone, before the correction
    assert family[1].verdict() == "higher (worse)"
    assert family[1].claim().endswith("higher (worse): its Holm-adjusted p (6 comparisons) is below 0.05")
    with pytest.raises(ValueError, match="no p-value"):
        holm([bootstrap_difference([1, 2, 3], [0, 1, 1])])
    with pytest.raises(ValueError, match="same confidence"):
        holm([weak, paired_difference([1, 2, 3], [0, 1, 1], confidence=0.9)])


def test_negligible_when_the_interval_lies_within_the_smallest_effect():
    tiny = paired_difference([4.301, 4.300, 4.302], [4.304, 4.303, 4.305], metric="loss", smallest_effect=0.02)
    assert tiny.clear and tiny.negligible and tiny.verdict() == "negligible"
    assert "lies within +-0.02" in tiny.claim()
    wide = paired_difference([4.30, 4.20, 4.35], [4.304, 4.303, 4.305], smallest_effect=0.02)
    assert not wide.negligible
    with pytest.raises(ValueError, match="smallest_effect"):
        paired_difference([1, 2], [2, 3], smallest_effect=-1)


def test_shifted_moves_the_interval_and_recomputes_p():
    d = paired_difference(A, B)
    moved = d.shifted(0.05)
    assert (moved.low, moved.high) == pytest.approx((d.low + 0.05, d.high + 0.05), abs=1e-12)
    oracle = scipy_stats.ttest_rel(np.add(A, 0.05), B).pvalue
    assert moved.p_value == pytest.approx(oracle, rel=1e-9)


def test_verdicts_are_stable_flags_verdicts_near_their_lines():
    near = paired_difference([1.0, 1.1, 1.2], [0.9, 1.0, 1.1])  # every pair +0.1: a point interval
    assert verdicts_are_stable([near], tolerance=0.05) == [True]
    assert verdicts_are_stable([near], tolerance=0.2) == [False]
    spread = (0.1 - 0.005) / (t_quantile(0.975, 3) * math.sqrt(4 / 3) / 2)  # puts the lower bound at 0.005
    edge = paired_difference([0.1 - spread, 0.1 + spread, 0.1 - spread, 0.1 + spread], [0.0] * 4)
    assert edge.low == pytest.approx(0.005, abs=1e-12)  # clear, but by only 0.005
    assert verdicts_are_stable([edge], tolerance=1e-3) == [True]
    assert verdicts_are_stable([edge], tolerance=edge.low * 1.01) == [False]
    negligible = paired_difference([1.0, 1.01, 1.0], [1.0, 1.0, 1.0], smallest_effect=0.03)
    assert negligible.negligible
    assert verdicts_are_stable([negligible], tolerance=0.03 - negligible.high + 1e-3) == [False]
    family = holm([edge, near])  # edge's adjusted p is 0.044: clear, close to the line
    assert [d.verdict() for d in family] == ["higher", "higher"]
    assert verdicts_are_stable(family, tolerance=1e-4) == [True, True]
    assert verdicts_are_stable(family, tolerance=1e-2) == [False, True]
    twice = holm([edge, edge])  # both adjusted to 0.088: no clear difference after the correction
    assert [d.verdict() for d in twice] == ["no clear difference"] * 2
    assert verdicts_are_stable(twice, tolerance=1e-3) == [True, True]
    with pytest.raises(ValueError, match="one family at a time"):
        verdicts_are_stable([family[0], edge], tolerance=1e-3)


def test_wilcoxon_exact_value():
    """Ten positive differences: the exact two-sided p is 2 / 2**10 (every sign pattern equally likely)."""
    a = [1.0 + i / 10 for i in range(10)]
    assert wilcoxon_p(a, [0.0] * 10) == pytest.approx(2 / 2**10, rel=1e-12)
    assert wilcoxon_p([1.0, 2.0], [1.0, 2.0]) == 1.0


def test_bootstrap_matches_scipy_percentile_bootstrap():
    rng = np.random.default_rng(3)
    a, b = rng.normal(1.0, 1.0, size=10), rng.normal(0.0, 1.0, size=10)
    ours = bootstrap_difference(a, b, resamples=20_000)
    theirs = scipy_stats.bootstrap((np.subtract(a, b),), np.mean, method="percentile", n_resamples=20_000,
                                   random_state=1).confidence_interval
    # Two independent resamplings of the same distribution: measured |difference| about 0.005.
    assert ours.low == pytest.approx(theirs.low, abs=0.03) and ours.high == pytest.approx(theirs.high, abs=0.03)
    assert ours.method == "paired bootstrap" and math.isnan(ours.p_value)
    assert bootstrap_difference(a, b, resamples=20_000) == ours  # seeded: the same every time
