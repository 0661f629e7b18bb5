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
budget and set of seeds; it says nothing about whether the difference is large enough to matter
(print the difference, and judge that too). The t quantiles come from ``scipy.stats.t``
(SciPy is a dependency of scikit-learn).

Taught in lesson 08 (training & debugging); used in lessons 08 and 11.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Difference", "paired_difference", "welch_difference", "t_quantile"]


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t distribution with ``df`` degrees of freedom."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    from scipy.stats import t  # imported here: only this module needs SciPy

    return float(t.ppf(probability, df))


@dataclass(frozen=True)
class Difference:
    """``mean(a) - mean(b)`` of a metric over seeded runs, with its confidence interval.

    Attributes:
        name_a, name_b: the two settings.
        metric: what was measured, e.g. ``"final training loss"``.
        mean_a, mean_b: the mean of each setting over its runs.
        difference: ``mean_a - mean_b`` (for paired runs, also the mean of the per-seed differences).
        low, high: the confidence interval of the difference.
        confidence: e.g. 0.95.
        n: the number of runs (pairs for a paired comparison; the smaller group for Welch's).
        method: ``"paired t"`` or ``"Welch t"``.
        lower_is_better: True for a loss, False for an accuracy, None when neither; only the
            wording of the verdict uses it.
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

    @property
    def contains_zero(self) -> bool:
        """The interval contains 0: the data do not tell which setting is ahead."""
        return self.low <= 0.0 <= self.high

    @property
    def margin(self) -> float:
        """How far the interval's nearest bound lies from 0, whichever side of it.

        A verdict with a margin far above the rounding noise between machines (the course
        measures about 1e-5 on its final losses) reads the same on every CPU.
        """
        return min(abs(self.low), abs(self.high))

    def verdict(self) -> str:
        """``"no clear difference"``, or A's metric ``"lower"`` / ``"higher"`` (with better/worse)."""
        if self.contains_zero:
            return "no clear difference"
        direction = "lower" if self.high < 0 else "higher"
        if self.lower_is_better is None:
            return direction
        better = (direction == "lower") == self.lower_is_better
        return f"{direction} ({'better' if better else 'worse'})"

    def claim(self) -> str:
        """The verdict in words, without machine-dependent figures: stable enough to compare."""
        level = f"{self.confidence:.0%}"
        if self.contains_zero:
            return f"{self.name_a} vs {self.name_b}: no clear difference in {self.metric} (the {level} interval contains 0)"
        return (
            f"{self.name_a} vs {self.name_b}: {self.metric} {self.verdict()}; "
            f"the {level} interval of the difference excludes 0"
        )

    def __str__(self) -> str:
        level = f"{self.confidence:.0%}"
        return (
            f"{self.name_a} vs {self.name_b}: {self.metric} {self.mean_a:.3f} vs {self.mean_b:.3f}, "
            f"difference {self.difference:+.3f}, {level} CI [{self.low:+.3f}, {self.high:+.3f}] "
            f"({self.method}, n = {self.n}): {self.verdict()}"
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


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence}")
    return float(confidence)


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
) -> Difference:
    """``mean(a - b)`` with a paired t-interval; ``a[i]`` and ``b[i]`` share seed ``i``.

    ``mean(d) +- t_{(1 + confidence) / 2}(n - 1) * sd(d) / sqrt(n)`` over ``d_i = a_i - b_i``.
    """
    a, b = _values("a", a), _values("b", b)
    if len(a) != len(b):
        raise ValueError(f"paired runs need the same seeds on both sides: got {len(a)} and {len(b)} runs")
    confidence = _check_confidence(confidence)
    n = len(a)
    mean_d, var_d = _mean_var([x - y for x, y in zip(a, b)])
    half = t_quantile((1 + confidence) / 2, n - 1) * math.sqrt(var_d / n)
    return Difference(
        name_a=names[0], name_b=names[1], metric=metric,
        mean_a=math.fsum(a) / n, mean_b=math.fsum(b) / n, difference=mean_d,
        low=mean_d - half, high=mean_d + half, confidence=confidence, n=n, method="paired t",
        lower_is_better=lower_is_better,
    )


def welch_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "value",
    confidence: float = 0.95,
    lower_is_better: bool | None = None,
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
    else:
        df = se2**2 / (se2_a**2 / (len(a) - 1) + se2_b**2 / (len(b) - 1))  # Welch-Satterthwaite
        half = t_quantile((1 + confidence) / 2, df) * math.sqrt(se2)
        low, high = difference - half, difference + half
    return Difference(
        name_a=names[0], name_b=names[1], metric=metric, mean_a=mean_a, mean_b=mean_b,
        difference=difference, low=low, high=high, confidence=confidence, n=min(len(a), len(b)),
        method="Welch t", lower_is_better=lower_is_better,
    )
