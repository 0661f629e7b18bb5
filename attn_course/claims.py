"""Claims a lesson makes, checked where they are made.

A sentence in a lesson that compares or quantifies ("chunked attention keeps less than a tenth
of dense attention's memory") gets a code cell that computes it and calls :func:`claim`. The
cell prints the claim in words that hold on any CPU, so nbval compares it on every machine,
and it fails loudly, naming the claim and the measured figures, the day the claim stops
holding. Machine-dependent figures (timings, memory, exact training metrics) are printed in a
cell marked ``# NBVAL_IGNORE_OUTPUT`` just before.

A lesson that shows an error wraps the failing line in :func:`shows_error`: the error is printed
(so learners read it), the notebook carries on (Colab's "Run all" stops at the first uncaught
error and ignores cell tags), and the cell fails if the line stops raising.

Used by every lesson; the convention is described in the README (notebook conventions).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["claim", "ClaimError", "shows_error"]


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


@contextmanager
def shows_error(*expected: type[BaseException]) -> Iterator[None]:
    """Run the ``with`` block, which must raise one of ``expected``; print the error and carry on.

    ``with ac.shows_error(RuntimeError): x.view(B, L, E)`` prints ``RuntimeError: view size is not
    compatible ...``. A block that raises nothing, or another kind of error, fails the cell.
    """
    if not expected or not all(isinstance(kind, type) and issubclass(kind, BaseException) for kind in expected):
        raise TypeError(f"shows_error needs the exception types the block must raise, got {expected!r}")
    names = " or ".join(kind.__name__ for kind in expected)
    try:
        yield
    except expected as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"{type(error).__name__}: {first_line}")
    else:
        raise ClaimError(f"the lesson says this line raises {names}, but it ran without an error")
