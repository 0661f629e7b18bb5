"""Diagnosis helper for the lesson 04-07 judges: which classic bug explains a wrong answer?

``_common.first_match`` returns the first variant (the library's answer with one mistake put
in) that equals the learner's result. On some cases a variant *is* the right answer -- full
attention equals block-local attention when the block covers the sequence, ignoring the mask
changes nothing when there is no mask -- and it must not be offered as a diagnosis there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ._common import first_match, same

__all__ = ["distinct_match"]


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
