"""Claims a lesson makes, checked where they are made.

A sentence in a lesson that compares or quantifies ("chunked attention keeps less than a tenth
of dense attention's memory") gets a code cell that computes it and calls :func:`claim`. The
cell prints the claim in words that hold on any CPU, so nbval compares it on every machine,
and it fails loudly, naming the claim and the measured figures, the day the claim stops
holding. Machine-dependent figures (timings, memory, exact training metrics) are printed in a
cell marked ``# NBVAL_IGNORE_OUTPUT`` just before.

Used by every lesson; the convention is described in the README (notebook conventions).
"""

from __future__ import annotations

__all__ = ["claim", "ClaimError"]


class ClaimError(AssertionError):
    """A lesson's claim did not hold on this machine."""


def claim(statement: str, holds: object, *, measured: str = "") -> None:
    """Print ``statement`` and assert that it ``holds``.

    Args:
        statement: the claim in words, true on any machine when ``holds`` is true
            (orderings, bounds, ratios with honest margins, never an exact timing).
        holds: the condition, e.g. ``chunked_peak < dense_peak / 8``. Anything truthy passes;
            a tensor must hold a single element.
        measured: the figures behind it, shown only when the claim fails (they may differ
            between machines, so they are not printed on success).
    """
    if not isinstance(statement, str) or not statement.strip():
        raise TypeError(f"statement must be a non-empty str, got {statement!r}")
    if not bool(holds):
        detail = f" (measured: {measured})" if measured else ""
        raise ClaimError(f"the lesson claims: {statement!r}, but it does not hold here{detail}")
    print(f"✓ {statement}")
