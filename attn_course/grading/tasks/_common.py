"""Helpers shared by the lesson task modules: error hints and "which classic bug is this?".

A judge first compares the learner's result with the library. When they differ, it asks
:func:`first_match` which of a short list of *variants* (the library's answer with one
classic mistake put in on purpose) the learner's result equals, and returns that variant's
teaching message. Variants are built from library pieces, never from a second copy of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ...attention import stable_softmax
from ..core import Case, Fail, Outcome
from ..judging import returned_tensor

__all__ = ["returned", "answered", "first_match", "same", "softmax_over_queries", "seeded_randn"]


def seeded_randn(seed: int) -> Callable[..., torch.Tensor]:
    """A ``randn(*shape, dtype=float64, std=1.0)`` that draws from its own generator seeded with ``seed``.

    Case builders use it so their inputs are the same on every call and never touch the
    learner's global random state.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float64, std: float = 1.0) -> torch.Tensor:
        return std * torch.randn(*shape, generator=generator, dtype=dtype)

    return randn


def returned(
    outcome: Outcome, *, what: str, hints: Iterable[tuple[str, str]] = (), index: int | None = None
) -> torch.Tensor:
    """Like ``returned_tensor``, adding a hint when the learner's error contains a known text.

    ``hints`` pairs a substring of the error message (case-insensitive) with a hint.
    """
    try:
        return returned_tensor(outcome, what=what, index=index)
    except Fail as failure:
        error = (outcome.error or "").lower()
        for needle, hint in hints:
            if needle.lower() in error:
                raise Fail(f"{failure} Hint: {hint}") from None
        raise


def answered(
    cases: Sequence[Case], outcomes: Sequence[Outcome], *, hints: Iterable[tuple[str, str]] = ()
) -> list[tuple[Case, Outcome, torch.Tensor]]:
    """``(case, outcome, returned tensor)`` for every case, for checks that look at every case.

    A case where the function *raised* (or returned something that is not a tensor) is a failed
    case: the check fails with that case's error, named. A check that read only the cases that
    returned would pass a function that crashes on most inputs (issue 20: an IndexError for every
    W >= 2 scored full marks). Checks about other cases keep their points.
    """
    return [(case, outcome, returned(outcome, what=case.name, hints=hints)) for case, outcome in zip(cases, outcomes)]


def same(got: torch.Tensor, expected: torch.Tensor, *, atol: float = 1e-6, rtol: float = 1e-5) -> bool:
    """True when ``got`` has ``expected``'s shape and values (NaN only equals NaN)."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return False
    if got.dtype == torch.bool or expected.dtype == torch.bool:
        return bool(torch.equal(got.bool(), expected.bool()))
    got64, expected64 = got.detach().double(), expected.detach().double()
    return bool(torch.allclose(got64, expected64, atol=atol, rtol=rtol, equal_nan=True))


def first_match(
    got: torch.Tensor,
    variants: Iterable[tuple[Callable[[], torch.Tensor], str]],
    *,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> str | None:
    """The message of the first variant whose (lazily computed) value equals ``got``, else None.

    Variants are tried in order, so put the specific ones first.
    """
    for make, message in variants:
        try:
            candidate = make()
        except Exception:  # a variant that cannot be formed for this case just does not match
            continue
        if same(got, candidate, atol=atol, rtol=rtol):
            return message[:1].upper() + message[1:]  # it often follows another sentence
    return None


def softmax_over_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The classic wrong-axis bug: softmax over dim=-2 (the queries) instead of dim=-1 (the keys)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., L, S)
    return torch.matmul(stable_softmax(scores, dim=-2), v)  # (..., L, Dv), columns sum to 1
