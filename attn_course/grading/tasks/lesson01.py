"""Graded tasks for lesson 01 (scaled dot-product attention): a stable softmax, attention, and the
stretch task, additive (Bahdanau) attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._checks import broadcast_shapes
from ...attention import scaled_dot_product_attention, stable_softmax
from .. import probes
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned, same, seeded_randn, softmax_over_queries

__all__ = ["STABLE_SOFTMAX", "ATTENTION", "ADDITIVE_ATTENTION", "COURSE_ATTENTION"]

# Every softmax-attention implementation in the library, by the name a hint gives it. Any of them
# does a softmax-attention task for the learner (chunked and sparse attention, the online softmax's
# first step, the multi-head modules), so tasks whose concept is attention itself forbid them all,
# besides PyTorch's own. With values set to the identity they compute a softmax, so
# 01.stable_softmax forbids them too. (Linear attention is not here: it computes other values.)
COURSE_ATTENTION = (
    "attn_course.attention.scaled_dot_product_attention",
    "attn_course.chunked.query_chunked_attention",
    "attn_course.chunked.chunked_attention",
    "attn_course.chunked.partial_attention",
    "attn_course.sparse.sparse_attention",
    "attn_course.sparse.SparseAttention",
    "attn_course.grouped.grouped_attention",
    "attn_course.multihead.MultiHeadAttention",
    "attn_course.dynamic.DynamicHeadAttention",
    "attn_course.positional.RelativePositionMultiHeadAttention",
    "attn_course.distributed.ring.ring_step",
    "attn_course.distributed.ring.ring_attention",
    "attn_course.distributed.ulysses.ulysses_attention",
)

_SHAPE_ERROR_HINTS = (
    ("must match the size", "two tensors do not line up. A row-wise max or sum must keep the reduced axis "
     "(as a size-1 axis) so that it broadcasts back over the row it came from."),
)


def _precision_hint(got: torch.Tensor, x: torch.Tensor) -> str:
    if got.dtype != x.dtype:
        return f"You computed in {got.dtype}; stay in the input's dtype ({x.dtype}) to keep its precision."
    return ""


# --- 01.stable_softmax ---------------------------------------------------------------------
# The learner writes stable_softmax(scores) -> softmax over the last dim, safe for huge logits,
# and 0 (not NaN) for a row that is entirely -inf (a query with nothing to attend to).


def _softmax_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(101)
    small = 3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    batched = 2 * torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    huge = torch.tensor(
        [[1000.0, 999.0, 0.0, -5.0], [-1000.0, -1001.0, -1003.0, -1010.0], [2.0, 1.0, 0.0, -1.0]],
        dtype=torch.float32,
    )
    half = torch.tensor([[20.0, 10.0, 0.0, -10.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float16)
    inf = float("-inf")
    with_inf = torch.tensor([[1.0, inf, 2.0, inf], [inf, inf, inf, inf], [0.5, 0.0, -0.5, 0.0]], dtype=torch.float64)
    # A batch of masked score rows, as attention produces them: (B, L, S) with two empty rows.
    masked = 4 * torch.randn(2, 3, 5, generator=gen, dtype=torch.float32)
    masked[0, :, 3:] = inf  # padding: keys 3, 4 blocked everywhere in batch 0
    masked[0, 1] = inf  # a query with nothing to attend to
    masked[1, 2] = inf  # and another, in batch 1
    masked[1, 0, 0] = 900.0  # a huge logit in a row that also has -inf entries
    masked[1, 0, 1] = inf
    return [
        Case("small scores (3, 5), float64", (small,)),
        Case("batched scores (2, 3, 4, 4), float64", (batched,)),
        Case("huge logits (+-1000), float32", (huge,)),
        Case("logits up to 20, float16", (half,)),
        Case("rows with -inf, one entirely -inf, float64", (with_inf,)),
        Case("masked scores (2, 3, 5): two rows entirely -inf, one logit of 900, float32", (masked,)),
    ]


_SMALL, _BATCHED, _HUGE, _HALF, _WITH_INF, _MASKED = range(6)


def _exp_minus_row_max(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x - x.amax(dim=-1, keepdim=True))


def _diagnose_softmax_values(got: torch.Tensor, x: torch.Tensor) -> str | None:
    """Name the classic mistake behind a wrong result on ordinary (finite) scores."""
    found = first_match(
        got,
        [
            (lambda: stable_softmax(x, dim=-2),
             "your values sum to 1 down each column, not along each row: take the max and the sum over "
             "dim=-1 (the last axis), so that each row is a probability distribution."),
            (lambda: _exp_minus_row_max(x),
             "you return exp(x - max) without dividing by the row sum: each row must be divided by the sum of "
             "its own exponentials."),
            (lambda: _exp_minus_row_max(x) / x.sum(dim=-1, keepdim=True),
             "you divide the exponentials by the sum of the raw scores; the denominator is the sum of the "
             "exponentials themselves, which makes each row sum to 1."),
            (lambda: torch.exp(x),
             "you return exp(x) without dividing by the row sum (and without subtracting the max)."),
        ],
    )
    if found:
        return found
    sums = got.detach().double().sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-6):
        worst = (sums - 1).abs().nan_to_num(nan=float("inf")).argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, sums.shape))
        row = index[0] if len(index) == 1 else index
        return (
            f"Each row should sum to 1, but row {row} sums to {sums[index].item():.4g}: divide exp(x - max) by the "
            "sum of those same exponentials over the last axis."
        )
    return None


def _unguarded_softmax(x: torch.Tensor) -> torch.Tensor:
    """The max-subtracted softmax without the empty-row guard: NaN on an all -inf row."""
    exps = _exp_minus_row_max(x)
    return exps / exps.sum(dim=-1, keepdim=True)


def _diagnose_non_finite(got: torch.Tensor, x: torch.Tensor) -> str:
    """Why a row came out NaN/inf although its logits are finite."""
    bad_rows = (~torch.isfinite(got)).flatten(0, -2).any(dim=-1).nonzero()
    row = int(bad_rows[0])
    logits = x.flatten(0, -2)[row]
    largest = torch.finfo(x.dtype).max
    if logits.max().item() > math.log(largest):
        return (
            f"row {row} has logits up to {logits.max().item():g} and exp() of that overflows to inf in "
            f"{x.dtype} (inf / inf = NaN). Shifting a row by a constant does not change its softmax: shift it so "
            "that every exponent is <= 0."
        )
    if logits.max().item() < x.max().item() - 80:
        return (
            f"row {row} holds ordinary logits (max {logits.max().item():g}) yet comes out NaN: subtracting the max "
            "of the whole tensor is mathematically fine but makes exp() underflow to 0 for every entry of rows far "
            "below that max (0 / 0 = NaN). The shift must be each row's own max, one per row."
        )
    return f"row {row} contains NaN/inf: subtract each row's maximum before exp."


def _judge_softmax(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a tensor of the input's shape and dtype"):
        for case, _, got in answered(cases, outcomes, hints=_SHAPE_ERROR_HINTS):
            (x,) = case.args
            expect_shape(got, x.shape, what=case.name, hint="Softmax keeps the shape of the scores.")
            expect_dtype(got, x.dtype, what=case.name, hint="Compute in the input's dtype, or cast back with .to(scores.dtype).")
    with checklist.check("each row is a probability distribution over the last dim"):
        for index in (_SMALL, _BATCHED):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name, hints=_SHAPE_ERROR_HINTS)
            (x,) = case.args
            expect_shape(got, x.shape, what=case.name)
            hint = lambda: _diagnose_softmax_values(got, x) or _precision_hint(got, x)
            expect_close(got, stable_softmax(x), what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("huge logits do not overflow (float32 and float16)"):
        for index, atol in ((_HUGE, 1e-6), (_HALF, 2e-3)):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name, hints=_SHAPE_ERROR_HINTS)
            (x,) = case.args
            expect_shape(got, x.shape, what=case.name)
            if not torch.isfinite(got).all():
                raise Fail(f"{case.name}: {_diagnose_non_finite(got, x)}")
            expect_close(got, stable_softmax(x.double()), what=case.name, atol=atol, rtol=1e-3)
    with checklist.check("a row of all -inf (nothing to attend to) gives zeros, not NaN"):
        # The "-inf - (-inf)" story fits only a softmax that is right except for the empty rows, on both cases
        # (no max subtraction and a global max also give NaN there, and go wrong elsewhere).
        unguarded = all(
            outcomes[i].error is None and same(outcomes[i].returned, _unguarded_softmax(cases[i].args[0]))
            for i in (_WITH_INF, _MASKED)
        )
        for index, atol in ((_WITH_INF, 1e-9), (_MASKED, 1e-6)):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name, hints=_SHAPE_ERROR_HINTS)
            (x,) = case.args
            expect_shape(got, x.shape, what=case.name)
            empty = torch.isneginf(x).all(dim=-1)  # (...,): rows with nothing to attend to
            if torch.isnan(got[empty]).any():
                row = tuple(int(i) for i in empty.nonzero()[0])
                why = (
                    "Its max is -inf, and -inf - (-inf) is NaN. Shift a row whose max is not finite by 0 instead: "
                    "exp(-inf) = 0, so all its exps are 0, and then its sum is 0 too: make sure the division does "
                    "not compute 0 / 0." if unguarded else
                    "exp(-inf) = 0, so all its exps are 0 and so is their sum: make sure the division does not "
                    "compute 0 / 0."
                )
                raise Fail(
                    f"{case.name}: row {row[0] if len(row) == 1 else row} is all -inf and you return NaN there. The "
                    f"course's convention: such a row is all zeros. {why}"
                )
            if not torch.isfinite(got).all():
                raise Fail(f"{case.name}: {_diagnose_non_finite(got.masked_fill(empty[..., None], 0.0), x)}")
            expect_close(
                got,
                stable_softmax(x.double()),
                what=case.name,
                atol=atol,
                rtol=1e-7 if atol < 1e-6 else 1e-5,
                hint="Entries that are -inf get weight exactly 0, and an all -inf row is all zeros.",
            )
    with checklist.check("leaves its input unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_SHAPE_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _softmax_reference(scores):
    # Written out: the task forbids calling a softmax implementation (the library's included).
    row_max = scores.amax(dim=-1, keepdim=True)  # (..., 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty rows: shift by 0
    exps = torch.exp(scores - row_max)  # (..., S), every exponent <= 0
    return exps / exps.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def _softmax_no_max(scores):
    exps = torch.exp(scores)
    return exps / exps.sum(dim=-1, keepdim=True)


def _softmax_wrong_axis(scores):
    exps = torch.exp(scores - scores.amax(dim=-2, keepdim=True))
    return exps / exps.sum(dim=-2, keepdim=True)


def _softmax_global_max(scores):
    exps = torch.exp(scores - scores.max())
    return exps / exps.sum(dim=-1, keepdim=True)


def _softmax_unnormalised(scores):
    return torch.exp(scores - scores.amax(dim=-1, keepdim=True))


def _softmax_divides_by_raw_sum(scores):
    exps = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return exps / scores.sum(dim=-1, keepdim=True)


def _softmax_no_keepdim(scores):
    exps = torch.exp(scores - scores.amax(dim=-1))
    return exps / exps.sum(dim=-1)


def _softmax_nan_on_empty_rows(scores):
    exps = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return exps / exps.sum(dim=-1, keepdim=True)


def _softmax_torch_nan_to_num(scores):
    return torch.nan_to_num(torch.softmax(scores, dim=-1))  # right values, but PyTorch did the work


def _softmax_torch(scores):
    return torch.softmax(scores, dim=-1)


def _softmax_course(scores):
    import attn_course as ac

    return ac.stable_softmax(scores)


def _softmax_through_log_softmax(scores):
    return torch.nan_to_num(torch.log_softmax(scores, dim=-1).exp())


def _softmax_through_partial_attention(scores):
    import attn_course as ac

    identity = torch.eye(scores.shape[-1], dtype=scores.dtype)  # (S, S): values that spell out the weights
    return ac.finish_partial(ac.partial_attention(scores, identity))  # the online softmax's first step does it


def _softmax_in_place(scores):
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    scores.sub_(row_max).exp_()  # saves memory, but overwrites the caller's tensor
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


STABLE_SOFTMAX = Task(
    id="01.stable_softmax",
    title="Numerically stable softmax",
    function_name="stable_softmax",
    make_cases=_softmax_cases,
    judge=_judge_softmax,
    reference=_softmax_reference,
    wrong={
        "no max subtraction (exp overflows)": Wrong(_softmax_no_max, "overflows to inf"),
        "softmax over dim=-2": Wrong(_softmax_wrong_axis, "down each column"),
        "subtracts the max of the whole tensor": Wrong(_softmax_global_max, "whole tensor"),
        "exp without normalising": Wrong(_softmax_unnormalised, "without dividing by the row sum"),
        "divides by the sum of the raw scores": Wrong(_softmax_divides_by_raw_sum, "sum of the raw scores"),
        "max without keepdim=True": Wrong(_softmax_no_keepdim, "must keep the reduced axis"),
        "NaN on an all -inf row": Wrong(_softmax_nan_on_empty_rows, "-inf - (-inf) is NaN"),
        "overwrites its input in place": Wrong(_softmax_in_place, "in place", kind="contract"),
        "calls torch.softmax (NaN on empty rows)": Wrong(_softmax_torch, "you called torch.softmax"),
        "torch.softmax with nan_to_num": Wrong(_softmax_torch_nan_to_num, "you called torch.softmax", kind="algorithm"),
        "calls attn_course.stable_softmax": Wrong(_softmax_course, "you called attn_course.stable_softmax", kind="algorithm"),
        "exp of torch.log_softmax": Wrong(_softmax_through_log_softmax, "you called torch.log_softmax"),
        "attn_course.partial_attention with identity values": Wrong(
            _softmax_through_partial_attention, "you called attn_course.partial_attention", kind="algorithm"
        ),
    },
    # The task is the softmax itself: PyTorch's softmax (by any route) and the course's are off limits.
    forbidden=(
        "attn_course.attention.stable_softmax",
        "torch.softmax",
        "torch.log_softmax",
        "torch.nn.functional.softmax",
        "torch.nn.functional.log_softmax",
        "aten._softmax",
        "aten._log_softmax",
        "aten._safe_softmax",
        *COURSE_ATTENTION,  # attention with identity values is a softmax
        *probes.TORCH_ATTENTION,
    ),
)


# --- 01.attention --------------------------------------------------------------------------
# The learner writes attention(q, k, v) = softmax(q k^T / sqrt(D)) v over the last two dims:
# q (..., L, D), k (..., S, D), v (..., S, Dv) -> (..., L, Dv).


def _attention_cases() -> list[Case]:
    randn = seeded_randn(102)

    return [
        # D = 9 so that 1/sqrt(D), 1/D and 1/sqrt(L) are all different.
        Case("square: q, k, v (2, 4, 9), float64", (randn(2, 4, 9), randn(2, 4, 9), randn(2, 4, 9))),
        Case(
            "L=5 queries, S=7 keys, heads: q (2, 3, 5, 8), k (2, 3, 7, 8), v (2, 3, 7, 6), float64",
            (randn(2, 3, 5, 8), randn(2, 3, 7, 8), randn(2, 3, 7, 6)),
        ),
        Case("unbatched: q (3, 4), k (6, 4), v (6, 2), float64", (randn(3, 4), randn(6, 4), randn(6, 2))),
        Case(
            "large scores (|q.k| ~ 1000): q (2, 6, 8), k, v (2, 5, 8), float32",
            (randn(2, 6, 8, dtype=torch.float32, std=30.0), randn(2, 5, 8, dtype=torch.float32, std=30.0),
             randn(2, 5, 8, dtype=torch.float32)),
        ),
        Case(
            "large scores with heads: q (2, 2, 3, 16), k (2, 2, 4, 16), v (2, 2, 4, 3), float32",
            (randn(2, 2, 3, 16, dtype=torch.float32, std=25.0), randn(2, 2, 4, 16, dtype=torch.float32, std=25.0),
             randn(2, 2, 4, 3, dtype=torch.float32)),
        ),
    ]


_SQUARE, _RECT, _UNBATCHED, _LARGE, _LARGE_HEADS = range(5)


def _diagnose_attention(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    L, D, S = q.shape[-2], q.shape[-1], k.shape[-2]

    def with_scale(scale):
        return lambda: scaled_dot_product_attention(q, k, v, scale=scale)

    def k_reshaped():
        k_as_reshaped = k.reshape(*k.shape[:-2], D, S).transpose(-2, -1)  # (..., S, D): what q @ k.reshape(.., D, S) uses
        return scaled_dot_product_attention(q, k_as_reshaped, v)

    return first_match(
        got,
        [
            (with_scale(1.0), f"you did not scale the scores: multiply q @ k^T by 1/sqrt(D), with D = q.shape[-1] = {D}."),
            (with_scale(1.0 / D), f"you divided the scores by D = {D}; divide by sqrt(D) = {math.sqrt(D):.4g}."),
            (with_scale(math.sqrt(D)), "you multiplied the scores by sqrt(D); divide by it: scale = 1/sqrt(D)."),
            (with_scale(1.0 / math.sqrt(L)),
             f"your scale uses the number of queries L = {L}; it must use the head dim D = q.shape[-1] = {D}."),
            (with_scale(1.0 / math.sqrt(S)),
             f"your scale uses the number of keys S = {S}; it must use the head dim D = q.shape[-1] = {D}."),
            (lambda: softmax_over_queries(q, k, v, scale=1.0 / math.sqrt(D)),
             "your weights sum to 1 down each column (over the queries), not along each row: softmax over dim=-1, "
             "the keys, so that each query distributes its attention over the keys."),
            (k_reshaped,
             "you reshaped k from (..., S, D) to (..., D, S). reshape keeps the memory order, so it scrambles keys and "
             "features; k^T must swap the last two axes, so that each key keeps its own features."),
        ],
        atol=1e-7,
    )


_ATTENTION_ERROR_HINTS = (
    ("must match the size", "for batched tensors, k^T must swap only the last two axes of k (k.T and "
     "k.transpose(0, 1) also move the batch axes)."),
    ("cannot be multiplied", "q (..., L, D) @ k^T needs k^T of shape (..., D, S): the last two axes of k, swapped."),
)


def _judge_attention(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_ATTENTION_ERROR_HINTS):
            q, k, v = case.args
            expected_shape = (*q.shape[:-1], v.shape[-1])
            if tuple(got.shape) == (*q.shape[:-1], k.shape[-2]) and tuple(got.shape) != expected_shape:
                raise Fail(
                    f"{case.name}: you returned a (..., L, S) tensor: the attention weights. The output is "
                    "weights @ v, of shape (..., L, Dv)."
                )
            expect_shape(got, expected_shape, what=case.name, hint="Each query gets a weighted average of the values.")
            expect_dtype(got, q.dtype, what=case.name)
    sections = (
        ("queries and keys of the same length match the library", (_SQUARE,)),
        ("L != S, with batch and head dims, and unbatched inputs", (_RECT, _UNBATCHED)),
    )
    for title, indices in sections:
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                q, k, v = case.args
                got = returned(outcome, what=case.name, hints=_ATTENTION_ERROR_HINTS)
                expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
                hint = lambda: _diagnose_attention(got, q, k, v) or _precision_hint(got, q)
                expect_close(got, scaled_dot_product_attention(q, k, v), what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("large scores stay finite (float32)"):
        for index in (_LARGE, _LARGE_HEADS):
            case, outcome = cases[index], outcomes[index]
            q, k, v = case.args
            got = returned(outcome, what=case.name, hints=_ATTENTION_ERROR_HINTS)
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            if not torch.isfinite(got).all():
                raise Fail(
                    f"{case.name}: your output contains NaN/inf. Scores in the hundreds make exp() overflow; use a "
                    "softmax that subtracts the row max first (your stable_softmax, or torch.softmax)."
                )
            expected = scaled_dot_product_attention(q.double(), k.double(), v.double())
            hint = lambda: _diagnose_attention(got, q, k, v) or ""  # computed only for a wrong answer
            expect_close(got, expected, what=case.name, atol=1e-4, rtol=1e-4, hint=hint)
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_ATTENTION_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _attention_reference(q, k, v):
    # Written out: the task forbids calling an attention implementation (the library's included).
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., L, S)
    return stable_softmax(scores) @ v  # (..., L, Dv)


def _attention_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def _attention_scale_by_d(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def _attention_scale_by_length(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2]), dim=-1) @ v


def _attention_wrong_axis(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def _attention_k_reshaped(q, k, v):
    k_t = k.reshape(*k.shape[:-2], k.shape[-1], k.shape[-2])
    return torch.softmax(q @ k_t / math.sqrt(q.shape[-1]), dim=-1) @ v


def _attention_k_transposed_first_axes(q, k, v):
    return torch.softmax(q @ k.transpose(0, 1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _attention_returns_weights(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def _attention_naive_softmax(q, k, v):
    exps = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return exps / exps.sum(dim=-1, keepdim=True) @ v


def _attention_delegates_to_torch(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _attention_delegates_to_the_course(q, k, v):
    import attn_course as ac

    return ac.scaled_dot_product_attention(q, k, v)


def _attention_through_torch_ops(q, k, v):
    return torch.ops.aten.scaled_dot_product_attention(q, k, v)


def _attention_through_chunked(q, k, v):
    import attn_course as ac

    return ac.chunked_attention(q, k, v)  # lesson 07's online softmax: right values, not this task's work


def _attention_through_partial(q, k, v):
    import attn_course as ac

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., L, S)
    return ac.finish_partial(ac.partial_attention(scores, v))  # the softmax and weighted sum, done by the library


def _attention_scales_q_in_place(q, k, v):
    q.mul_(1 / math.sqrt(q.shape[-1]))  # "saves a multiplication" but changes the caller's q
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


ATTENTION = Task(
    id="01.attention",
    title="Scaled dot-product attention",
    function_name="attention",
    make_cases=_attention_cases,
    judge=_judge_attention,
    reference=_attention_reference,
    wrong={
        "missing the 1/sqrt(D) scale": Wrong(_attention_no_scale, "did not scale"),
        "divides by D instead of sqrt(D)": Wrong(_attention_scale_by_d, "divide by sqrt(D)"),
        "scales with the sequence length": Wrong(_attention_scale_by_length, "uses the number of queries"),
        "softmax over dim=-2": Wrong(_attention_wrong_axis, "down each column"),
        "k reshaped instead of transposed": Wrong(_attention_k_reshaped, "reshape keeps the memory order"),
        "k.transpose(0, 1) on batched input": Wrong(
            _attention_k_transposed_first_axes, "swap only the last two axes"
        ),
        "returns the weights instead of the output": Wrong(_attention_returns_weights, "weights @ v"),
        "softmax without max subtraction": Wrong(_attention_naive_softmax, "overflow"),
        "scales q in place": Wrong(_attention_scales_q_in_place, "in place"),
        "delegates to F.scaled_dot_product_attention": Wrong(
            _attention_delegates_to_torch, "you called torch.nn.functional.scaled_dot_product_attention", kind="algorithm"
        ),
        "delegates to attn_course.scaled_dot_product_attention": Wrong(
            _attention_delegates_to_the_course, "you called attn_course.scaled_dot_product_attention", kind="algorithm"
        ),
        "reaches PyTorch's kernel through torch.ops.aten": Wrong(
            _attention_through_torch_ops, "you called PyTorch's aten.", kind="algorithm"
        ),
        # Its float32 outputs differ from the reference's in the last bits (another summation order), which
        # the catalogue's exact comparison counts as "values"; the delegation rule is what rejects it.
        "calls attn_course.chunked_attention": Wrong(_attention_through_chunked, "you called attn_course.chunked_attention"),
        "softmax and weighted sum by attn_course.partial_attention": Wrong(
            _attention_through_partial, "you called attn_course.partial_attention", kind="algorithm"
        ),
    },
    # The task is the attention formula itself: no attention implementation may do it for the learner.
    forbidden=(
        *COURSE_ATTENTION,
        *probes.TORCH_ATTENTION,
        *probes.TORCH_MULTIHEAD,
    ),
)


# --- 01.additive_attention (stretch) ------------------------------------------------------------
# The learner writes additive (Bahdanau) attention: score(q_i, k_j) = w . tanh(W_q q_i + W_k k_j),
# then the softmax over the keys and the weighted sum of the values, as in lesson 01:
# q (..., L, Dq), k (..., S, Dk), v (..., S, Dv); w_q (A, Dq), w_k (A, Dk), w (A,) -> (..., L, Dv).
# Queries and keys need not have the same size: each is projected to A features first.


def _additive_cases() -> list[Case]:
    randn = seeded_randn(104)

    def weights(A, Dq, Dk, *, dtype=torch.float64, std=1.0):
        return (randn(A, Dq, dtype=dtype) / math.sqrt(Dq), randn(A, Dk, dtype=dtype) / math.sqrt(Dk),
                randn(A, dtype=dtype, std=std))

    return [
        Case("batched, Dq=5 != Dk=3, L=4 != S=6, A=7: q (2, 4, 5), k (2, 6, 3), v (2, 6, 2), float64",
             (randn(2, 4, 5), randn(2, 6, 3), randn(2, 6, 2), *weights(7, 5, 3))),
        Case("heads, Dq = Dk = 5, A=6: q (2, 3, 4, 5), k (2, 3, 7, 5), v (2, 3, 7, 4), float64",
             (randn(2, 3, 4, 5), randn(2, 3, 7, 5), randn(2, 3, 7, 4), *weights(6, 5, 5))),
        Case("unbatched, Dq=4, Dk=6, A=8: q (3, 4), k (5, 6), v (5, 3), float64",
             (randn(3, 4), randn(5, 6), randn(5, 3), *weights(8, 4, 6))),
        Case("large scores (|w| ~ 40, scores up to a few hundred): q (2, 3, 4), k (2, 5, 4), v (2, 5, 2), A=8, float32",
             (randn(2, 3, 4, dtype=torch.float32), randn(2, 5, 4, dtype=torch.float32),
              randn(2, 5, 2, dtype=torch.float32), *weights(8, 4, 4, dtype=torch.float32, std=40.0))),
        Case("large scores, unbatched, Dq=3 != Dk=5: q (4, 3), k (6, 5), v (6, 2), A=12, float32",
             (randn(4, 3, dtype=torch.float32), randn(6, 5, dtype=torch.float32),
              randn(6, 2, dtype=torch.float32), *weights(12, 3, 5, dtype=torch.float32, std=40.0))),
        # L = S, so that scores laid out (S, L) instead of (L, S) have the right shape and can be recognised.
        Case("as many queries as keys, L = S = 4, Dq=5 != Dk=3, A=6: q (2, 4, 5), k (2, 4, 3), v (2, 4, 3), float64",
             (randn(2, 4, 5), randn(2, 4, 3), randn(2, 4, 3), *weights(6, 5, 3))),
    ]


_ADD_BATCHED, _ADD_HEADS, _ADD_UNBATCHED, _ADD_LARGE, _ADD_LARGE_UNBATCHED, _ADD_SQUARE = range(6)


def _additive_scores(q, k, w_q, w_k, w, *, squash=torch.tanh):
    qa = q @ w_q.transpose(-2, -1)  # (..., L, A)
    ka = k @ w_k.transpose(-2, -1)  # (..., S, A)
    return squash(qa.unsqueeze(-2) + ka.unsqueeze(-3)) @ w  # (..., L, S, A) @ (A,) -> (..., L, S)


def _additive_reference(q, k, v, w_q, w_k, w):
    return stable_softmax(_additive_scores(q, k, w_q, w_k, w)) @ v  # (..., L, Dv)


def _diagnose_additive(got, q, k, v, w_q, w_k, w) -> str | None:
    A = w.shape[-1]
    return first_match(
        got,
        [
            (lambda: stable_softmax(_additive_scores(q, k, w_q, w_k, w, squash=lambda t: t)) @ v,
             "without the tanh the score is w.(W_q q) + w.(W_k k): the query's part is the same for every key and "
             "cancels in the softmax over the keys, so every query gets the same weights. Apply tanh to "
             "W_q q + W_k k before projecting with w."),
            (lambda: stable_softmax(_additive_scores(q, k, w_q, w_k, w), dim=-2) @ v,
             "your weights sum to 1 over the queries (dim=-2): softmax over dim=-1, the keys."),
            (lambda: stable_softmax(_additive_scores(q, k, w_q, w_k, w).transpose(-2, -1)) @ v,
             "your scores are laid out (..., S, L), keys by queries: the queries' projections broadcast along the key "
             "axis and the keys' along the query axis. Each row of the scores must belong to one query."),
            (lambda: stable_softmax(_additive_scores(q, k, w_q, w_k, w) / math.sqrt(A)) @ v,
             f"you divided the scores by sqrt(A) = sqrt({A}): additive attention has no such scale (the tanh already "
             "bounds each feature in [-1, 1]; w sets the size of the scores)."),
            (lambda: stable_softmax(_additive_scores(q, k, w_q, w_k, torch.ones_like(w))) @ v,
             "you summed the tanh features instead of projecting them with w: score = tanh(...) @ w."),
            (lambda: scaled_dot_product_attention(q, k, v),
             "this is scaled dot-product attention: the task asks for additive scores, "
             "score(q_i, k_j) = w . tanh(W_q q_i + W_k k_j)."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


_STEP_BY_STEP = ("check the shapes step by step: the projected queries are (..., L, A) and the projected keys "
                 "(..., S, A); every query meets every key in an (..., L, S, A) sum, which w reduces to the "
                 "(..., L, S) scores.")
_ADDITIVE_ERROR_HINTS = (
    ("cannot be multiplied", "check the shapes step by step: w_q is (A, Dq), stored like an nn.Linear weight, and "
     "the projected queries must come out (..., L, A), the projected keys (..., S, A)."),
    ("must match the size", _STEP_BY_STEP),
    ("expected size", _STEP_BY_STEP),
)


def _judge_additive(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_ADDITIVE_ERROR_HINTS):
            q, k, v = case.args[:3]
            expected_shape = (*broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], v.shape[-1])
            if tuple(got.shape) == (*expected_shape[:-1], k.shape[-2]) and k.shape[-2] != v.shape[-1]:
                raise Fail(f"{case.name}: you returned a (..., L, S) tensor: the attention weights. The output is "
                           "weights @ v, of shape (..., L, Dv).")
            expect_shape(got, expected_shape, what=case.name, hint="Each query gets a weighted average of the values.")
            expect_dtype(got, q.dtype, what=case.name)
    sections = (
        ("batched, queries and keys of different sizes (Dq != Dk, L != S)", (_ADD_BATCHED,)),
        ("with heads, and unbatched", (_ADD_HEADS, _ADD_UNBATCHED)),
        ("as many queries as keys (L = S)", (_ADD_SQUARE,)),  # where scores laid out (S, L) can be recognised
    )
    for title, indices in sections:
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name, hints=_ADDITIVE_ERROR_HINTS)
                expected = _additive_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                hint = lambda: _diagnose_additive(got, *case.args) or _precision_hint(got, case.args[0])
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("large scores stay finite (float32)"):
        for index in (_ADD_LARGE, _ADD_LARGE_UNBATCHED):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name, hints=_ADDITIVE_ERROR_HINTS)
            expected = _additive_reference(*(t.double() for t in case.args))
            expect_shape(got, expected.shape, what=case.name)
            if not torch.isfinite(got).all():
                raise Fail(f"{case.name}: your output contains NaN/inf. These scores reach a few hundred and exp() "
                           "overflows float32 beyond 88: use a softmax that subtracts the row max (your stable_softmax).")
            expect_close(got, expected, what=case.name, atol=1e-4, rtol=1e-4,
                         hint=lambda: _diagnose_additive(got, *case.args) or "")
    with checklist.check("leaves its inputs unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_ADDITIVE_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _additive_no_tanh(q, k, v, w_q, w_k, w):
    return torch.softmax((q @ w_q.T).unsqueeze(-2) @ w + ((k @ w_k.T) @ w).unsqueeze(-2), dim=-1) @ v


def _additive_softmax_over_queries(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w  # (..., L, S)
    return torch.softmax(scores, dim=-2) @ v


def _additive_untransposed(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q).unsqueeze(-2) + (k @ w_k).unsqueeze(-3)) @ w
    return torch.softmax(scores, dim=-1) @ v


def _additive_scaled(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w
    return torch.softmax(scores / math.sqrt(w.shape[0]), dim=-1) @ v


def _additive_summed_features(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)).sum(-1)
    return torch.softmax(scores, dim=-1) @ v


def _additive_keys_and_queries_swapped(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-3) + (k @ w_k.T).unsqueeze(-2)) @ w  # (..., S, L)
    return torch.softmax(scores, dim=-1) @ v


def _additive_is_dot_product(q, k, v, w_q, w_k, w):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _additive_naive_softmax(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w
    exps = scores.exp()
    return exps / exps.sum(dim=-1, keepdim=True) @ v


def _additive_returns_weights(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w
    return torch.softmax(scores, dim=-1)


def _additive_centres_v_in_place(q, k, v, w_q, w_k, w):
    scores = torch.tanh((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w
    mean = v.mean(dim=-2, keepdim=True)
    v -= mean  # weights sum to 1, so centring v and adding the mean back is harmless... to the result
    out = torch.softmax(scores, dim=-1) @ v + mean
    return out


ADDITIVE_ATTENTION = Task(
    id="01.additive_attention",
    title="Additive (Bahdanau) attention",
    function_name="additive_attention",
    make_cases=_additive_cases,
    judge=_judge_additive,
    reference=_additive_reference,
    stretch=True,
    wrong={
        "no tanh": Wrong(_additive_no_tanh, "the query's part is the same for every key"),
        "softmax over the queries": Wrong(_additive_softmax_over_queries, "softmax over dim=-1"),
        "weights not transposed (q @ w_q)": Wrong(_additive_untransposed, "like an nn.Linear weight"),
        "divides by sqrt(A)": Wrong(_additive_scaled, "no such scale"),
        "sums the tanh features instead of projecting with w": Wrong(_additive_summed_features, "projecting them with w"),
        "queries and keys broadcast the wrong way round": Wrong(_additive_keys_and_queries_swapped, "laid out (..., S, L)"),
        "dot-product attention instead": Wrong(_additive_is_dot_product, "is scaled dot-product attention"),
        "softmax without max subtraction": Wrong(_additive_naive_softmax, "overflows"),
        "returns the weights instead of the output": Wrong(_additive_returns_weights, "weights @ v"),
        "centres v in place": Wrong(_additive_centres_v_in_place, "in place", kind="contract"),
    },
)
