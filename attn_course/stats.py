"""Comparing seeded runs: the difference between two settings, with a confidence interval.

Training the same model twice with two seeds gives two different results. Before saying that
setting A beats setting B, compare the gap with that seed-to-seed noise. Here that is done with a
**t-interval** for the mean difference (Student, 1908):

* ``paired_difference(a, b)``: ``a[i]`` and ``b[i]`` come from the same seed ``i``. In the
  course a seed fixes the initial weights of everything the two settings share and the order of
  the minibatches, so the runs form pairs, and the interval is built from the per-seed
  differences ``d_i = a_i - b_i``: ``mean(d) +- t(n - 1) * sd(d) / sqrt(n)``. Pairing removes the
  noise both runs of a pair share, so it needs fewer seeds than an unpaired comparison.
* ``welch_difference(a, b)``: independent runs (other seeds, or a different number of them):
  Welch's interval, ``mean(a) - mean(b) +- t(df) * sqrt(var(a)/n_a + var(b)/n_b)``, with the
  Welch-Satterthwaite ``df``.

The verdict follows the interval: "no clear difference" when it contains 0, otherwise "lower"
or "higher". An interval that excludes 0 says the sign of the difference is clear on this task,
budget and set of seeds; it says nothing about whether the difference is large enough to matter.
Two additions make the verdicts honest about that and about how many were made:

* ``smallest_effect``: the smallest difference that would matter for the question asked. When
  the whole interval lies within ``+-smallest_effect`` the verdict is "negligible", whatever its
  sign.
* ``holm(differences)``: with many comparisons at 95%, about one in twenty comparisons of two
  equal settings excludes 0 by chance. Holm's step-down correction (Holm, 1979) adjusts the
  p-values of a family of comparisons so that the chance of *any* false "clear" verdict stays
  below 5%; a comparison whose adjusted p is not below 5% reads "no clear difference".

``verdicts_are_stable`` checks that each verdict would read the same if every mean difference
moved by a small amount either way: CPUs with other vector units round differently and training
turns that into small changes of the final metrics, so a lesson states a verdict as a checked
claim only when it is that far from its lines. Two checks that do not assume normal
differences back up a t-interval when the differences look skewed: ``wilcoxon_p`` (the
Wilcoxon signed-rank test) and ``bootstrap_difference`` (a percentile bootstrap of the mean).
The t quantiles and the Wilcoxon test come from SciPy (a dependency of scikit-learn).

Taught in lesson 08 (training & debugging); used in lessons 08 and 11.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Difference",
    "paired_difference",
    "welch_difference",
    "bootstrap_difference",
    "holm",
    "verdicts_are_stable",
    "wilcoxon_p",
    "t_quantile",
]


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t distribution with ``df`` degrees of freedom."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    from scipy.stats import t  # imported here: only this module needs SciPy

    return float(t.ppf(probability, df))


def _t_p_value(difference: float, standard_error: float, df: float) -> float:
    """Two-sided p of "the true difference is 0" for a t statistic ``difference / standard_error``."""
    if standard_error == 0.0:  # every run identical: the point itself
        return 1.0 if difference == 0.0 else 0.0
    from scipy.stats import t

    return float(2.0 * t.sf(abs(difference) / standard_error, df))


@dataclass(frozen=True)
class Difference:
    """``mean(a) - mean(b)`` of a metric over seeded runs, with its confidence interval.

    Attributes:
        name_a, name_b: the two settings.
        metric: what was measured, e.g. ``"test loss"``.
        mean_a, mean_b: the mean of each setting over its runs.
        difference: ``mean_a - mean_b`` (for paired runs, also the mean of the per-seed differences).
        low, high: the confidence interval of the difference.
        confidence: e.g. 0.95.
        n: the number of runs (pairs for a paired comparison; the smaller group for Welch's).
        method: ``"paired t"``, ``"Welch t"`` or ``"paired bootstrap"``.
        lower_is_better: True for a loss, False for an accuracy, None when neither; only the
            wording of the verdict uses it.
        p_value: two-sided p of "no difference" from the test behind the interval (NaN for the
            bootstrap, which gives only an interval).
        standard_error, df: the t-interval's standard error and degrees of freedom (the interval
            is ``difference +- t(df) * standard_error``); NaN for the bootstrap.
        pairs: the per-seed differences ``a_i - b_i`` of a paired comparison (empty for Welch's).
        smallest_effect: the smallest difference that matters, or None; an interval inside
            ``+-smallest_effect`` reads "negligible".
        adjusted_p, family_size: set by :func:`holm`: the adjusted p and the number of
            comparisons in the family.
    """

    name_a: str
    name_b: str
    metric: str
    mean_a: float
    mean_b: float
    difference: float
    low: float
    high: float
    confidence: float
    n: int
    method: str
    lower_is_better: bool | None = None
    p_value: float = math.nan
    standard_error: float = math.nan
    df: float = math.nan
    pairs: tuple[float, ...] = ()
    smallest_effect: float | None = None
    adjusted_p: float | None = None
    family_size: int = 1

    @property
    def alpha(self) -> float:
        """``1 - confidence``: the false-verdict rate a single comparison allows."""
        return 1.0 - self.confidence

    @property
    def contains_zero(self) -> bool:
        """The interval contains 0: the data do not tell which setting is ahead."""
        return self.low <= 0.0 <= self.high

    @property
    def negligible(self) -> bool:
        """The whole interval lies strictly within ``+-smallest_effect``: too small to matter, either way."""
        return self.smallest_effect is not None and -self.smallest_effect < self.low and self.high < self.smallest_effect

    @property
    def clear(self) -> bool:
        """The sign is clear: the interval excludes 0 and, in a Holm family, the adjusted p passes too."""
        return not self.contains_zero and (self.adjusted_p is None or self.adjusted_p < self.alpha)

    @property
    def margin(self) -> float:
        """How far the interval's nearest bound lies from 0, whichever side of it."""
        return min(abs(self.low), abs(self.high))

    def verdict(self) -> str:
        """``"negligible"``, ``"no clear difference"``, or A's metric ``"lower"`` / ``"higher"`` (with better/worse)."""
        if self.negligible:
            return "negligible"
        if not self.clear:
            return "no clear difference"
        direction = "lower" if self.high < 0 else "higher"
        if self.lower_is_better is None:
            return direction
        better = (direction == "lower") == self.lower_is_better
        return f"{direction} ({'better' if better else 'worse'})"

    def _holm_words(self) -> str:
        return f"Holm-adjusted p ({self.family_size} comparisons)"

    def claim(self) -> str:
        """The verdict in words, without machine-dependent figures: stable enough to compare.

        In a Holm family a verdict other than "negligible" is worded by the adjusted p alone (an
        interval is not adjusted), so the words do not depend on where an end of the unadjusted
        interval falls.
        """
        level = f"{self.confidence:.0%}"
        head = f"{self.name_a} vs {self.name_b}:"
        if self.negligible:
            return (f"{head} negligible difference in {self.metric} (the {level} interval lies within "
                    f"+-{self.smallest_effect:g})")
        if self.adjusted_p is not None:
            relation = "below" if self.clear else "not below"
            words = f"no clear difference in {self.metric}" if not self.clear else f"{self.metric} {self.verdict()}"
            return f"{head} {words}: its {self._holm_words()} is {relation} {self.alpha:g}"
        if self.contains_zero:
            return f"{head} no clear difference in {self.metric} (the {level} interval contains 0)"
        return f"{head} {self.metric} {self.verdict()}; the {level} interval of the difference excludes 0"

    def shifted(self, delta: float) -> Difference:
        """The same comparison with every difference moved by ``delta`` (the spread unchanged).

        What a CPU that rounds differently can do to a verdict, at most, when its runs end
        within ``delta`` of these: the interval moves by ``delta`` and the p-value follows.
        """
        p_value = self.p_value
        if not math.isnan(self.standard_error):
            p_value = _t_p_value(self.difference + delta, self.standard_error, self.df)
        return dataclasses.replace(
            self, mean_a=self.mean_a + delta, difference=self.difference + delta, low=self.low + delta,
            high=self.high + delta, p_value=p_value, pairs=tuple(d + delta for d in self.pairs),
        )

    def __str__(self) -> str:
        level = f"{self.confidence:.0%}"
        p = "" if math.isnan(self.p_value) else f", p = {self.p_value:.2g}"
        if self.adjusted_p is not None:
            p += f", Holm-adjusted {self.adjusted_p:.2g}"
        return (
            f"{self.name_a} vs {self.name_b}: {self.metric} {self.mean_a:.3f} vs {self.mean_b:.3f}, "
            f"difference {self.difference:+.3f}, {level} CI [{self.low:+.3f}, {self.high:+.3f}] "
            f"({self.method}, n = {self.n}{p}): {self.verdict()}"
        )


def _values(name: str, values: Sequence[float]) -> list[float]:
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}") from None
    if len(floats) < 2:
        raise ValueError(f"{name} needs at least 2 runs (seeds) for an interval, got {len(floats)}")
    if not all(math.isfinite(v) for v in floats):
        raise ValueError(f"{name} holds a NaN or inf: {floats}; a diverged run needs a look, not an average")
    return floats


def _paired_values(a: Sequence[float], b: Sequence[float]) -> tuple[list[float], list[float]]:
    a, b = _values("a", a), _values("b", b)
    if len(a) != len(b):
        raise ValueError(f"paired runs need the same seeds on both sides: got {len(a)} and {len(b)} runs")
    return a, b


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence}")
    return float(confidence)


def _check_smallest_effect(smallest_effect: float | None) -> float | None:
    if smallest_effect is None:
        return None
    if not (isinstance(smallest_effect, (int, float)) and math.isfinite(smallest_effect) and smallest_effect > 0):
        raise ValueError(f"smallest_effect must be a positive number or None, got {smallest_effect!r}")
    return float(smallest_effect)


def _mean_var(values: list[float]) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    return mean, math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)  # sample variance, n - 1


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "value",
    confidence: float = 0.95,
    lower_is_better: bool | None = None,
    smallest_effect: float | None = None,
) -> Difference:
    """``mean(a - b)`` with a paired t-interval; ``a[i]`` and ``b[i]`` share seed ``i``.

    ``mean(d) +- t_{(1 + confidence) / 2}(n - 1) * sd(d) / sqrt(n)`` over ``d_i = a_i - b_i``.
    """
    a, b = _paired_values(a, b)
    confidence = _check_confidence(confidence)
    n = len(a)
    pairs = [x - y for x, y in zip(a, b)]
    mean_d, var_d = _mean_var(pairs)
    standard_error = math.sqrt(var_d / n)
    half = t_quantile((1 + confidence) / 2, n - 1) * standard_error
    return Difference(
        name_a=names[0], name_b=names[1], metric=metric,
        mean_a=math.fsum(a) / n, mean_b=math.fsum(b) / n, difference=mean_d,
        low=mean_d - half, high=mean_d + half, confidence=confidence, n=n, method="paired t",
        lower_is_better=lower_is_better, p_value=_t_p_value(mean_d, standard_error, n - 1),
        standard_error=standard_error, df=float(n - 1), pairs=tuple(pairs),
        smallest_effect=_check_smallest_effect(smallest_effect),
    )


def welch_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "value",
    confidence: float = 0.95,
    lower_is_better: bool | None = None,
    smallest_effect: float | None = None,
) -> Difference:
    """``mean(a) - mean(b)`` with Welch's t-interval, for independent runs (no pairing)."""
    a, b = _values("a", a), _values("b", b)
    confidence = _check_confidence(confidence)
    mean_a, var_a = _mean_var(a)
    mean_b, var_b = _mean_var(b)
    se2_a, se2_b = var_a / len(a), var_b / len(b)
    se2 = se2_a + se2_b
    difference = mean_a - mean_b
    if se2 == 0.0:  # every run of both settings identical: the interval is the point itself
        low = high = difference
        df = float(len(a) + len(b) - 2)
    else:
        df = se2**2 / (se2_a**2 / (len(a) - 1) + se2_b**2 / (len(b) - 1))  # Welch-Satterthwaite
        half = t_quantile((1 + confidence) / 2, df) * math.sqrt(se2)
        low, high = difference - half, difference + half
    return Difference(
        name_a=names[0], name_b=names[1], metric=metric, mean_a=mean_a, mean_b=mean_b,
        difference=difference, low=low, high=high, confidence=confidence, n=min(len(a), len(b)),
        method="Welch t", lower_is_better=lower_is_better, p_value=_t_p_value(difference, math.sqrt(se2), df),
        standard_error=math.sqrt(se2), df=df, smallest_effect=_check_smallest_effect(smallest_effect),
    )


def bootstrap_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "value",
    confidence: float = 0.95,
    lower_is_better: bool | None = None,
    resamples: int = 10_000,
    seed: int = 0,
) -> Difference:
    """``mean(a - b)`` with a paired percentile-bootstrap interval (no normality assumed).

    Draws ``resamples`` sets of ``n`` seeds with replacement (a seeded NumPy generator, so the
    result is reproducible), takes the mean per-seed difference of each, and returns the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those means. With few
    seeds it is somewhat narrower than the t-interval: read it as a cross-check, not a cure.
    """
    import numpy as np

    a, b = _paired_values(a, b)
    confidence = _check_confidence(confidence)
    if not (isinstance(resamples, int) and resamples >= 100):
        raise ValueError(f"resamples must be an int >= 100, got {resamples!r}")
    pairs = np.subtract(a, b)  # (n,)
    rng = np.random.default_rng(seed)
    means = pairs[rng.integers(0, len(pairs), size=(resamples, len(pairs)))].mean(axis=1)  # (resamples,)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    n = len(a)
    return Difference(
        name_a=names[0], name_b=names[1], metric=metric, mean_a=math.fsum(a) / n, mean_b=math.fsum(b) / n,
        difference=float(pairs.mean()), low=float(low), high=float(high), confidence=confidence, n=n,
        method="paired bootstrap", lower_is_better=lower_is_better, pairs=tuple(float(d) for d in pairs),
    )


def holm(differences: Sequence[Difference]) -> list[Difference]:
    """The family of comparisons with Holm's step-down adjusted p-values (Holm, 1979).

    Sort the ``m`` p-values from smallest to largest; the ``r``-th (from 0) is multiplied by
    ``m - r``, and the adjusted values are made non-decreasing in that order (capped at 1). A
    comparison stays "clear" when its adjusted p is below ``1 - confidence``: the chance that any
    comparison of the family is called clear by luck stays below that level. Holm is never less
    powerful than Bonferroni (every p times ``m``) and assumes nothing about how the comparisons
    depend on each other. Returns new ``Difference`` objects, in the order given.
    """
    differences = list(differences)
    if not differences:
        raise ValueError("holm needs at least one comparison")
    for d in differences:
        if not isinstance(d, Difference):
            raise TypeError(f"holm takes Difference objects, got {type(d).__name__}")
        if math.isnan(d.p_value):
            raise ValueError(f"{d.name_a} vs {d.name_b} ({d.method}) has no p-value to adjust")
    if len({d.confidence for d in differences}) > 1:
        raise ValueError("every comparison of a family must use the same confidence level")
    m = len(differences)
    order = sorted(range(m), key=lambda i: differences[i].p_value)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * differences[i].p_value))
        adjusted[i] = running
    return [dataclasses.replace(d, adjusted_p=p, family_size=m) for d, p in zip(differences, adjusted)]


def verdicts_are_stable(differences: Sequence[Difference], *, tolerance: float) -> list[bool]:
    """For each comparison: does its verdict read the same if the mean differences move by ``tolerance``?

    Four scenarios are tried: every difference moved up by ``tolerance``, every one moved down,
    every one moved towards 0, every one moved away from 0 (a Holm family is re-adjusted in
    each). A verdict that depends only on its own interval (clear sign, negligible) is covered
    by the first two; a Holm verdict also depends on the others' p-values, and moving every one
    towards (away from) 0 makes every p larger (smaller), the worst case either way.
    """
    differences = list(differences)
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    in_family = [d.adjusted_p is not None for d in differences]
    if any(in_family) and not all(in_family):
        raise ValueError("mix of Holm-adjusted and unadjusted comparisons: pass one family at a time")

    def sign(d: Difference) -> float:
        return 1.0 if d.difference >= 0 else -1.0

    scenarios = (lambda d: tolerance, lambda d: -tolerance, lambda d: -sign(d) * tolerance, lambda d: sign(d) * tolerance)
    stable = [True] * len(differences)
    for move in scenarios:
        moved = [d.shifted(move(d)) for d in differences]
        if all(in_family) and moved:
            moved = holm(moved)
        for i, (before, after) in enumerate(zip(differences, moved)):
            stable[i] = stable[i] and before.verdict() == after.verdict()
    return stable


def wilcoxon_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p of the Wilcoxon signed-rank test on the paired differences ``a_i - b_i``.

    It uses only the signs and the ranks of the differences, so one large difference cannot
    dominate it: a check on a t-interval when the differences look skewed.
    """
    from scipy.stats import wilcoxon

    a, b = _paired_values(a, b)
    if all(x == y for x, y in zip(a, b)):
        return 1.0
    return float(wilcoxon(a, b).pvalue)
