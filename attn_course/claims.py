"""Claims a lesson makes, checked where they are made.

A sentence in a lesson that compares or quantifies ("chunked attention keeps less than a tenth
of dense attention's memory") gets a code cell that computes it and calls :func:`claim`. The
cell prints the claim in words that hold on any CPU, so nbval compares it on every machine.
Machine-dependent figures (timings, memory, exact training metrics) are printed in a cell
marked ``# NBVAL_IGNORE_OUTPUT`` just before.

A claim that does not hold never stops a learner's "Run all": on a learner's machine (a GPU in
Colab, an Apple laptop, a busy CPU) it prints a visible mark,
``✗ <statement> — not on this machine: <measured>``, with one line on why machines differ, and
the lesson goes on. Maintainers are strict: with ``ATTN_COURSE_STRICT_CLAIMS=1`` (set by the
Makefile, ``.ci/run`` and ``attn-course regenerate``) it raises :class:`ClaimError` instead, so
regeneration and CI fail loudly. nbval fails on a ✗ line in either mode, since the stored line
is the ✓ one.

A lesson that shows an error wraps the failing line in :func:`shows_error`: the error is printed
(so learners read it) and the notebook carries on (Colab's "Run all" stops at the first uncaught
error and ignores cell tags). If the line stops raising, or raises another kind of error, the
same two modes apply: a ✗ mark for a learner, :class:`ClaimError` (or the other error) when strict.

Used by every lesson; the convention is described in the README (notebook conventions).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["claim", "ClaimError", "shows_error", "strict_claims", "STRICT_ENV"]

STRICT_ENV = "ATTN_COURSE_STRICT_CLAIMS"
# Printed under a ✗ mark: why a claim can hold on the machine that stored the lesson and not here.
WHY_MACHINES_DIFFER = (
    "  (timings, memory and rounding depend on the processor, its load and the PyTorch build; "
    "the lesson goes on)"
)


class ClaimError(AssertionError):
    """A lesson's claim did not hold on this machine (raised only in strict mode)."""


def strict_claims() -> bool:
    """True when ``ATTN_COURSE_STRICT_CLAIMS`` is set to anything but ``""``/``0``: claims raise."""
    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


def _not_here(statement: str, measured: str) -> None:
    detail = f" — not on this machine: {measured}" if measured else " — not on this machine"
    print(f"✗ {statement}{detail}")
    print(WHY_MACHINES_DIFFER)


def claim(statement: str, holds: object, *, measured: str = "") -> None:
    """Print ``statement`` with a ✓ when it ``holds``; otherwise mark it ✗ (or raise, when strict).

    Args:
        statement: the claim in words, true on any machine when ``holds`` is true
            (orderings, bounds, ratios with honest margins, never an exact timing).
        holds: the condition, e.g. ``chunked_peak < dense_peak / 8``. Anything truthy passes;
            a tensor must hold a single element.
        measured: the figures behind it, shown only when the claim fails (they may differ
            between machines, so they are not printed on success).

    Raises:
        ClaimError: when the claim does not hold and ``ATTN_COURSE_STRICT_CLAIMS=1``.
    """
    if not isinstance(statement, str) or not statement.strip():
        raise TypeError(f"statement must be a non-empty str, got {statement!r}")
    if bool(holds):
        print(f"✓ {statement}")
        return
    if strict_claims():
        detail = f" (measured: {measured})" if measured else ""
        raise ClaimError(f"the lesson claims: {statement!r}, but it does not hold here{detail}")
    _not_here(statement, measured)


@contextmanager
def shows_error(*expected: type[BaseException]) -> Iterator[None]:
    """Run the ``with`` block, which must raise one of ``expected``; print the error and carry on.

    ``with ac.shows_error(RuntimeError): x.view(B, L, E)`` prints ``RuntimeError: view size is not
    compatible ...``. A block that raises nothing, or another kind of error, prints a ✗ mark and
    carries on; with ``ATTN_COURSE_STRICT_CLAIMS=1`` it fails the cell instead (:class:`ClaimError`
    when nothing was raised, the other error itself otherwise).
    """
    if not expected or not all(isinstance(kind, type) and issubclass(kind, BaseException) for kind in expected):
        raise TypeError(f"shows_error needs the exception types the block must raise, got {expected!r}")
    names = " or ".join(kind.__name__ for kind in expected)
    try:
        yield
    except expected as error:
        print(f"{type(error).__name__}: {_first_line(error)}")
    except Exception as error:
        if strict_claims():
            raise
        _not_here(f"this line raises {names}", f"it raised {type(error).__name__}: {_first_line(error)}")
    else:
        if strict_claims():
            raise ClaimError(f"the lesson says this line raises {names}, but it ran without an error")
        _not_here(f"this line raises {names}", "it ran without an error")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
