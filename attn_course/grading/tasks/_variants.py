"""Diagnosis helper for the lesson 04-07 judges: which classic bug explains a wrong answer?

``_common.first_match`` returns the first variant (the library's answer with one mistake put
in) that equals the learner's result. On some cases a variant *is* the right answer -- full
attention equals block-local attention when the block covers the sequence, ignoring the mask
changes nothing when there is no mask -- and it must not be offered as a diagnosis there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..core import Outcome
from ._common import first_match, same

__all__ = ["distinct_match", "consistent_match", "largest_dims"]


def distinct_match(
    got: torch.Tensor,
    expected: torch.Tensor,
    variants: Iterable[tuple[Callable[[], torch.Tensor], str]],
    *,
    atol: float = 1e-9,
    rtol: float = 1e-9,
) -> str | None:
    """``first_match`` over the variants that differ from ``expected`` on this case."""
    kept = []
    for make, message in variants:
        try:
            value = make()
        except Exception:  # a variant that cannot be formed for this case just does not match
            continue
        if not same(value, expected, atol=atol, rtol=rtol):
            kept.append((lambda value=value: value, message))
    return first_match(got, kept, atol=atol, rtol=rtol)


def largest_dims(outcome: Outcome) -> tuple[int, ...]:
    """The shape of the largest tensor the probe saw (``measure=("largest",)``), or ``()`` when it is unreadable.

    A judge tells the stories of a too-large tensor (an (L, L) matrix, too much padding) by its shape.
    """
    shape = outcome.probe.get("largest_shape") if isinstance(outcome.probe, dict) else None
    try:
        return tuple(int(n) for n in shape.split(" x ")) if isinstance(shape, str) else ()
    except ValueError:  # "scalar", or garbled probe data
        return ()


def consistent_match(
    index: int,
    cases,
    outcomes,
    *,
    expected: Callable[..., torch.Tensor],
    variants: Callable[..., list[tuple[Callable[[], torch.Tensor], str]]],
    tolerance: Callable[..., tuple[float, float]] = lambda *args: (1e-9, 1e-9),
) -> str | None:
    """``distinct_match`` on case ``index``, told only when that variant explains every other answer too.

    ``variants(*case.args)`` lists the same mistakes, in the same order, for every case. On one case two
    mistakes can give the same numbers (a window one step short and a window of ``window // dilation``
    steps, when both are 1); a mistake the learner's other answers rule out is not offered. A case
    that raised, or where the variant cannot be formed, neither confirms nor rules out a story.
    """

    def answer(j):
        outcome = outcomes[j]
        ok = outcome.error is None and not outcome.not_implemented and isinstance(outcome.returned, torch.Tensor)
        return outcome.returned if ok else None

    got = answer(index)
    if got is None:
        return None
    tables = {}

    def table(j):
        if j not in tables:
            tables[j] = variants(*cases[j].args)
        return tables[j]

    for n, (make, message) in enumerate(table(index)):
        atol, rtol = tolerance(*cases[index].args)
        try:
            value = make()
        except Exception:
            continue
        if same(value, expected(*cases[index].args), atol=atol, rtol=rtol) or not same(got, value, atol=atol, rtol=rtol):
            continue
        fits = True
        for j in range(len(cases)):
            other = answer(j)
            if j == index or other is None:
                continue
            atol_j, rtol_j = tolerance(*cases[j].args)
            try:
                value_j = table(j)[n][0]()
            except Exception:
                continue
            if not same(other, value_j, atol=atol_j, rtol=rtol_j):
                fits = False
                break
        if fits:
            return message[:1].upper() + message[1:]
    return None
