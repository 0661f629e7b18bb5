"""Graded tasks for lesson 03 (masking)."""

from __future__ import annotations

import torch

from ...masks import causal_mask
from ..core import Case, Fail, Task
from ..judging import Checklist, expect_dtype, expect_shape, returned_tensor

__all__ = ["CAUSAL_MASK"]


# --- 03.causal_mask ------------------------------------------------------------------------
# The learner writes causal_mask(L, S) -> bool (L, S), True = may attend, top-left aligned.

_CAUSAL_SIZES = [(4, 4), (7, 7), (1, 1), (3, 6), (6, 3)]


def _causal_cases() -> list[Case]:
    return [Case(f"causal_mask({L}, {S})", (L, S)) for L, S in _CAUSAL_SIZES]


def _diagnose_causal(got: torch.Tensor, L: int, S: int) -> str:
    """A message that names the first wrong cell and guesses the classic mistake."""
    expected = causal_mask(L, S)
    ones = torch.ones(L, S, dtype=torch.bool)
    if torch.equal(got, torch.tril(ones, diagonal=1)):
        return "row 0 can see position 1: is your causal mask shifted by one? (diagonal=0, not 1)"
    if torch.equal(got, torch.tril(ones, diagonal=-1)):
        return "no query can see its own position: the diagonal must be True (torch.tril with diagonal=0)."
    if L != S and torch.equal(got, torch.tril(ones, diagonal=S - L)):
        return "your mask is bottom-right aligned; PyTorch's is_causal (and this course) aligns it top-left: query i sees keys 0..i."
    if torch.equal(got, ~expected):
        return "True and False are swapped: in this course True means 'may attend' (nn.MultiheadAttention uses the opposite)."
    wrong = (got != expected).nonzero()
    i, j = (int(x) for x in wrong[0])
    if got[i, j]:
        return f"row {i} can see position {j}, which is in its future."
    return f"row {i} cannot see position {j}, which is not in its future (j <= i)."


def _judge_causal(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a bool tensor of shape (L, S)"):
        for case, outcome in zip(cases, outcomes):
            L, S = case.args
            mask = returned_tensor(outcome, what=case.name)
            expect_shape(mask, (L, S), what=case.name, hint="Rows are queries (L), columns are keys (S).")
            expect_dtype(mask, torch.bool, what=case.name, hint="Return a boolean mask, e.g. with torch.ones(..., dtype=torch.bool).")
    with checklist.check("square masks: query i sees keys 0..i"):
        for case, outcome in zip(cases, outcomes):
            L, S = case.args
            if L != S:
                continue
            mask = returned_tensor(outcome, what=case.name).bool()
            expect_shape(mask, (L, S), what=case.name)
            if not torch.equal(mask, causal_mask(L, S)):
                raise Fail(f"{case.name}: {_diagnose_causal(mask, L, S)}")
    with checklist.check("rectangular masks (L != S) are aligned top-left like PyTorch"):
        for case, outcome in zip(cases, outcomes):
            L, S = case.args
            if L == S:
                continue
            mask = returned_tensor(outcome, what=case.name).bool()
            expect_shape(mask, (L, S), what=case.name)
            if not torch.equal(mask, causal_mask(L, S)):
                raise Fail(f"{case.name}: {_diagnose_causal(mask, L, S)}")
    return checklist.results


def _causal_reference(L, S):
    return causal_mask(L, S)


def _causal_shifted(L, S):
    return torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=1)


def _causal_strict(L, S):
    return torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=-1)


def _causal_flipped(L, S):
    return torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)


def _causal_float(L, S):
    return torch.tril(torch.ones(L, S))


def _causal_square_only(L, S):
    return torch.tril(torch.ones(L, L, dtype=torch.bool))


def _causal_bottom_right(L, S):
    return torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=S - L)


CAUSAL_MASK = Task(
    id="03.causal_mask",
    title="Causal mask",
    function_name="causal_mask",
    make_cases=_causal_cases,
    judge=_judge_causal,
    reference=_causal_reference,
    wrong={
        "shifted by one (diagonal=1)": (_causal_shifted, "shifted by one"),
        "diagonal excluded (diagonal=-1)": (_causal_strict, "own position"),
        "polarity flipped (True = blocked)": (_causal_flipped, "swapped"),
        "float 0/1 instead of bool": (_causal_float, "dtype torch.float32"),
        "ignores S (always square)": (_causal_square_only, "shape"),
        "bottom-right aligned": (_causal_bottom_right, "top-left"),
    },
)
