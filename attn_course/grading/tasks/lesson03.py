"""Graded tasks for lesson 03 (masking): causal and padding masks, masked attention, and the stretch
task, the cross-attention mask of an encoder-decoder model with padding on both sides."""

from __future__ import annotations

import math

import torch

from ..._checks import broadcast_shapes
from ...attention import scaled_dot_product_attention, stable_softmax
from ...masks import causal_mask, combine_masks, padding_mask
from .. import probes
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    expect_close,
    expect_dtype,
    expect_inputs_unchanged,
    expect_shape,
    returned_tensor,
    worst_index,
)
from ._common import answered, first_match, returned, seeded_randn
from .lesson01 import COURSE_ATTENTION

__all__ = ["CAUSAL_MASK", "PADDING_MASK", "MASKED_ATTENTION", "CROSS_ATTENTION_MASK"]


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
        return ("row 0 can see position 1: your causal mask is shifted by one, so every query also sees the key "
                "just after it. Query i may see keys 0..i, none after.")
    if torch.equal(got, torch.tril(ones, diagonal=-1)):
        return "no query can see its own position: the diagonal must be True (a query may attend to itself)."
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
            square = tuple(mask.shape) == (L, L) and L != S
            expect_shape(mask, (L, S), what=case.name, hint="Your mask is (L, L): it ignores S. Rows are queries (L), "
                         "columns are keys (S)." if square else "Rows are queries (L), columns are keys (S).")
            expect_dtype(mask, torch.bool, what=case.name, hint="Return a boolean mask: True = may attend.")
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
    # Written out: the task forbids calling the library's causal_mask.
    return torch.arange(S)[None, :] <= torch.arange(L)[:, None]  # (L, S): key j allowed for query i when j <= i


def _causal_with_the_library(L, S):
    import attn_course as ac

    return ac.causal_mask(L, S)


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


def _causal_from_torch_transformer(L, S):
    n = max(L, S)
    float_mask = torch.nn.Transformer.generate_square_subsequent_mask(n)  # (n, n): 0 allowed, -inf blocked
    return ~torch.isinf(float_mask)[:L, :S]  # PyTorch's causal mask, cut to (L, S): right values


def _causal_from_sparse_pattern(L, S):
    import attn_course as ac

    n = max(L, S)  # a causal sliding window as wide as the sequence is the causal mask
    return ac.pattern_mask(n, pattern="sliding", size=n, is_causal=True)[:L, :S]


CAUSAL_MASK = Task(
    id="03.causal_mask",
    title="Causal mask",
    function_name="causal_mask",
    make_cases=_causal_cases,
    judge=_judge_causal,
    reference=_causal_reference,
    wrong={
        "shifted by one (diagonal=1)": Wrong(_causal_shifted, "shifted by one"),
        "diagonal excluded (diagonal=-1)": Wrong(_causal_strict, "own position"),
        "polarity flipped (True = blocked)": Wrong(_causal_flipped, "swapped"),
        "float 0/1 instead of bool": Wrong(_causal_float, "dtype torch.float32", kind="contract"),
        "ignores S (always square)": Wrong(_causal_square_only, "it ignores S"),
        "bottom-right aligned": Wrong(_causal_bottom_right, "bottom-right aligned"),
        "calls attn_course.causal_mask": Wrong(_causal_with_the_library, "you called attn_course.causal_mask", kind="algorithm"),
        "PyTorch's nn.Transformer.generate_square_subsequent_mask": Wrong(
            _causal_from_torch_transformer, "you called torch.nn.Transformer.generate_square_subsequent_mask",
            kind="algorithm",
        ),
        "attn_course.pattern_mask with is_causal": Wrong(
            _causal_from_sparse_pattern, "you called attn_course.pattern_mask", kind="algorithm"
        ),
    },
    # The causal mask itself, from the course or from PyTorch (its Transformer's mask, its CausalBias),
    # and the course's sparse patterns, which build it when asked for is_causal.
    forbidden=(
        "attn_course.masks.causal_mask",
        "torch.nn.Transformer.generate_square_subsequent_mask",
        "torch.nn.modules.transformer._generate_square_subsequent_mask",
        "torch.nn.attention.bias.CausalBias._materialize",
        "attn_course.sparse.pattern_mask",
    ),
)


# --- 03.padding_mask -----------------------------------------------------------------------
# The learner writes padding_mask(lengths, max_len) -> bool (B, max_len), True where a
# position holds a real token; real tokens come first (padding on the right).

_PADDING_CASES = [([3, 1, 4], 5), ([2, 2], 2), ([0, 3, 1], 4), ([6], 9)]


def _padding_cases() -> list[Case]:
    return [
        Case(f"padding_mask(lengths=tensor({lengths}), max_len={max_len})", (torch.tensor(lengths), max_len))
        for lengths, max_len in _PADDING_CASES
    ]


def _diagnose_padding(got: torch.Tensor, lengths: torch.Tensor, max_len: int) -> str:
    positions = torch.arange(max_len)[None, :]  # (1, max_len)
    expected = padding_mask(lengths, max_len)
    found = first_match(
        got,
        [
            (lambda: positions <= lengths[:, None],
             "off by one: a sequence of length n has real tokens at positions 0 .. n-1, so position n is padding. "
             "Compare positions < length, not <=."),
            (lambda: ~expected,
             "True and False are swapped: in this course True means 'real token, may be attended to' "
             "(nn.MultiheadAttention's key_padding_mask uses the opposite)."),
            (lambda: positions >= max_len - lengths[:, None],
             "your real tokens sit at the end: in this task real tokens come first and padding is on the right."),
        ],
    )
    if found:
        return found
    b, j = (int(i) for i in (got != expected).nonzero()[0])
    n = int(lengths[b])
    state = "real" if got[b, j] else "padding"
    return f"sequence {b} has length {n}, and you mark position {j} as {state}: positions 0 .. {n - 1} are real."


def _padding_shape_hint(got: torch.Tensor, B: int, max_len: int, lengths: torch.Tensor) -> str:
    if tuple(got.shape) == (max_len, B):
        return "Rows are sequences (B), columns are positions (max_len): you returned the transpose."
    if got.dim() == 2 and got.shape[0] == B and got.shape[1] == int(lengths.max()):
        return ("You used max(lengths) columns; the mask must have max_len columns, even when every sequence is "
                "shorter (batches are padded to a fixed size).")
    return "One row per sequence, one column per position: (B, max_len)."


def _judge_padding(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a bool tensor of shape (B, max_len)"):
        for case, _, got in answered(cases, outcomes):
            lengths, max_len = case.args
            B = len(lengths)
            expect_shape(got, (B, max_len), what=case.name, hint=_padding_shape_hint(got, B, max_len, lengths))
            expect_dtype(got, torch.bool, what=case.name, hint="Comparisons such as a < b give a bool tensor directly.")
    for title, indices in (("True exactly at the first lengths[b] positions", (0, 3)),
                           ("edge cases: empty sequences (length 0) and full ones (length = max_len)", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                lengths, max_len = case.args
                got = returned(outcome, what=case.name)
                expect_shape(got, (len(lengths), max_len), what=case.name)
                if not torch.equal(got.bool(), padding_mask(lengths, max_len)):
                    raise Fail(f"{case.name}: {_diagnose_padding(got.bool(), lengths, max_len)}")
    return checklist.results


def _padding_reference(lengths, max_len):
    # Written out: the task forbids calling the library's padding_mask.
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, max_len)


def _padding_with_the_library(lengths, max_len):
    import attn_course as ac

    return ac.padding_mask(lengths, max_len)


def _padding_off_by_one(lengths, max_len):
    return torch.arange(max_len)[None, :] <= lengths[:, None]


def _padding_flipped(lengths, max_len):
    return torch.arange(max_len)[None, :] >= lengths[:, None]


def _padding_ignores_max_len(lengths, max_len):
    return torch.arange(int(lengths.max()))[None, :] < lengths[:, None]


def _padding_float(lengths, max_len):
    return (torch.arange(max_len)[None, :] < lengths[:, None]).float()


def _padding_left(lengths, max_len):
    return torch.arange(max_len)[None, :] >= max_len - lengths[:, None]


def _padding_transposed(lengths, max_len):
    return torch.arange(max_len)[:, None] < lengths[None, :]


PADDING_MASK = Task(
    id="03.padding_mask",
    title="Padding mask",
    function_name="padding_mask",
    make_cases=_padding_cases,
    judge=_judge_padding,
    reference=_padding_reference,
    wrong={
        "off by one (<= instead of <)": Wrong(_padding_off_by_one, "Off by one"),
        "polarity flipped (True = padding)": Wrong(_padding_flipped, "swapped"),
        "ignores max_len": Wrong(_padding_ignores_max_len, "max_len columns"),
        "float 0/1 instead of bool": Wrong(_padding_float, "dtype torch.float32", kind="contract"),
        "real tokens at the end (left padding)": Wrong(_padding_left, "come first"),
        "transposed (max_len, B)": Wrong(_padding_transposed, "Rows are sequences"),
        "calls attn_course.padding_mask": Wrong(_padding_with_the_library, "you called attn_course.padding_mask", kind="algorithm"),
    },
    forbidden=("attn_course.masks.padding_mask",),
)


# --- 03.masked_attention -------------------------------------------------------------------
# The learner writes masked_attention(q, k, v, mask): scaled dot-product attention where a
# bool mask broadcastable to (..., L, S) says which keys each query may attend to (True =
# may attend). A query that may attend to nothing gets a zero output row, never NaN.


def _masked_cases() -> list[Case]:
    randn = seeded_randn(303)

    pad = padding_mask([6, 3])[:, None, None, :]  # (B, 1, 1, S)
    causal_and_pad = combine_masks(causal_mask(5), padding_mask([5, 2])[:, None, None, :])  # (B, 1, L, S)
    with_empty_row = torch.tensor(
        [[True, False, True, False], [False, False, False, False], [True, True, True, True]]
    )  # (L, S); query 1 may attend to nothing
    # Left padding under a causal mask: the padding queries of sequence 1 may attend to nothing.
    left_padded = combine_masks(causal_mask(5), padding_mask([5, 3], 5).flip(-1)[:, None, None, :])  # (B, 1, L, S)
    return [
        Case("padding mask (2, 1, 1, 6): q (2, 2, 4, 8), k, v (2, 2, 6, 8), float64",
             (randn(2, 2, 4, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 8), pad)),
        Case("causal + padding mask (2, 1, 5, 5): q, k, v (2, 3, 5, 4), float64",
             (randn(2, 3, 5, 4), randn(2, 3, 5, 4), randn(2, 3, 5, 4), causal_and_pad)),
        Case("query 1 may attend to nothing: mask (3, 4), q (2, 3, 8), k, v (2, 4, 8), float64",
             (randn(2, 3, 8), randn(2, 4, 8), randn(2, 4, 8), with_empty_row)),
        Case("float16 with a causal mask (4, 4): q, k, v (1, 2, 4, 8)",
             (randn(1, 2, 4, 8, dtype=torch.float16), randn(1, 2, 4, 8, dtype=torch.float16),
              randn(1, 2, 4, 8, dtype=torch.float16), causal_mask(4))),
        Case("causal + left padding (2, 1, 5, 5), queries 0 and 1 of sequence 1 may attend to nothing: "
             "q, k, v (2, 2, 5, 6), float32",
             (randn(2, 2, 5, 6, dtype=torch.float32), randn(2, 2, 5, 6, dtype=torch.float32),
              randn(2, 2, 5, 6, dtype=torch.float32), left_padded)),
    ]


_PADDED, _CAUSAL_PADDED, _EMPTY_ROW, _HALF_CAUSAL, _LEFT_PADDED = range(5)


def _scores(q, k):
    return torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (..., L, S)


def _diagnose_masked(got, q, k, v, mask, *, atol=1e-9, rtol=1e-7) -> str | None:
    if q.dtype in (torch.float16, torch.bfloat16):  # compare in float64, with half precision's tolerance
        got, (q, k, v) = got.double(), (t.double() for t in (q, k, v))
        atol, rtol = max(atol, 1e-2), max(rtol, 1e-2)
    return first_match(
        got,
        [
            (lambda: scaled_dot_product_attention(q, k, v),
             "your output ignores the mask (it equals unmasked attention): set the scores of blocked keys to "
             "-inf before the softmax."),
            (lambda: scaled_dot_product_attention(q, k, v, ~mask),
             "you blocked exactly the keys that are allowed: True and False are swapped. In this course True means "
             "'may attend', so the blocked keys are where the mask is False."),
            (lambda: torch.matmul(torch.softmax(_scores(q, k), dim=-1) * mask, v),
             "you zeroed the blocked weights after the softmax without renormalising: the remaining weights no "
             "longer sum to 1. Mask the scores (with -inf) before the softmax instead."),
            (lambda: torch.matmul(stable_softmax(_scores(q, k) * mask), v),
             "multiplying the scores by the mask sets blocked scores to 0, and exp(0) = 1 still gives those keys "
             "weight. Fill blocked scores with -inf instead."),
        ],
        atol=atol,
        rtol=rtol,
    )


def _close_enough(got, expected, *, atol, rtol) -> bool:
    return bool(torch.allclose(got.detach().double(), expected.double(), atol=atol, rtol=rtol))


_MASKED_ERROR_HINTS = (
    ("without overflow", "a fill value such as -1e9 does not fit in float16 (largest magnitude 65504). Fill with "
     "float('-inf'), which float16, bfloat16, float32 and float64 hold exactly, and give rows with nothing to attend to zeros."),
)


def _judge_masked(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_MASKED_ERROR_HINTS):
            q, k, v, mask = case.args
            expect_shape(got, (*broadcast_shapes(q.shape[:-1], mask.shape[:-1]), v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    with checklist.check("blocked keys get no weight (padding and causal masks)"):
        for index in (_PADDED, _CAUSAL_PADDED):
            case, outcome = cases[index], outcomes[index]
            q, k, v, mask = case.args
            got = returned(outcome, what=case.name, hints=_MASKED_ERROR_HINTS)
            expected = scaled_dot_product_attention(q, k, v, mask)
            expect_shape(got, expected.shape, what=case.name)
            hint = lambda: _diagnose_masked(got, q, k, v, mask) or ""  # computed only for a wrong answer
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("a query with nothing to attend to gets zeros, not NaN"):
        for index, atol in ((_EMPTY_ROW, 1e-9), (_LEFT_PADDED, 1e-5)):
            case, outcome = cases[index], outcomes[index]
            q, k, v, mask = case.args
            got = returned(outcome, what=case.name, hints=_MASKED_ERROR_HINTS)
            expected = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)
            expect_shape(got, expected.shape, what=case.name)
            empty = ~mask.any(dim=-1).expand(got.shape[:-1])  # (..., L): queries with nothing to attend to
            if torch.isnan(got[empty]).any():
                raise Fail(
                    f"{case.name}: the rows of queries with nothing to attend to are NaN. All their scores are -inf, "
                    "and softmax of an all -inf row is 0 / 0. Such rows must come out as zeros, as your stable_softmax "
                    "from lesson 01 gives for an all -inf row."
                )
            uniform = v.double().mean(dim=-2, keepdim=True).expand(got.shape)  # (..., L, Dv)
            if torch.allclose(got.double()[empty], uniform[empty], atol=1e-3):
                raise Fail(
                    f"{case.name}: the queries that may attend to nothing get the plain average of all values: a "
                    "finite fill value (like -1e9 or finfo.min) makes those rows uniform. Fill with -inf and give "
                    "empty rows zeros."
                )
            rtol = 1e-5 if atol > 1e-9 else 1e-7
            hint = _diagnose_masked(got, q, k, v, mask) or ""
            row = None
            if got.shape == expected.shape and not _close_enough(got, expected, atol=atol, rtol=rtol):
                row = worst_index(got, expected, atol=atol, rtol=rtol)[:-1]  # the row expect_close names below
            if row is not None and not empty[row] and not torch.isnan(got[empty]).any():
                # The empty rows are fine; say so, so that this check's title does not send the learner there.
                hint = (f"The empty rows are right, but row {row} of your output belongs to a query that may attend to "
                        f"some keys, and it is wrong. " + hint).strip()
            expect_close(got, expected, what=case.name, atol=atol, rtol=rtol, hint=hint)
    with checklist.check("works in float16 (blocked scores need a fill value float16 can hold)"):
        case, outcome = cases[_HALF_CAUSAL], outcomes[_HALF_CAUSAL]
        q, k, v, mask = case.args
        got = returned(outcome, what=case.name, hints=_MASKED_ERROR_HINTS)
        expected = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)
        expect_shape(got, expected.shape, what=case.name)
        hint = _diagnose_masked(got, q, k, v, mask) or (
            "The float64 cases pass, so the algorithm is right: look for a step that loses float16's range or "
            "precision (a fill value it cannot hold, a softmax computed in float16 without subtracting the max).")
        expect_close(got, expected, what=case.name, atol=1e-2, rtol=1e-2, hint=hint)
    with checklist.check("leaves q, k, v and the mask unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_MASKED_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _masked_reference(q, k, v, mask):
    # Written out: the task forbids calling an attention implementation (the library's included).
    # Half-precision inputs: scores and softmax in float32 (as the library does), weights rounded back.
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = _scores(q.to(work), k.to(work)).masked_fill(~mask, float("-inf"))  # (..., L, S)
    return stable_softmax(scores).to(q.dtype) @ v  # (..., L, Dv); rows with nothing allowed give 0


def _masked_torch_sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _masked_course_sdpa(q, k, v, mask):
    import attn_course as ac

    return ac.scaled_dot_product_attention(q, k, v, mask)


def _masked_minus_1e9(q, k, v, mask):
    scores = _scores(q, k).masked_fill(~mask, -1e9)
    return torch.softmax(scores, dim=-1) @ v


def _masked_flipped(q, k, v, mask):
    scores = _scores(q, k).masked_fill(mask, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v


def _masked_nan_on_empty_rows(q, k, v, mask):
    scores = _scores(q, k).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _masked_after_softmax(q, k, v, mask):
    return (torch.softmax(_scores(q, k), dim=-1) * mask) @ v


def _masked_multiplies_scores(q, k, v, mask):
    return torch.softmax(_scores(q, k) * mask, dim=-1) @ v


def _masked_ignores_mask(q, k, v, mask):
    return torch.softmax(_scores(q, k), dim=-1) @ v


def _masked_chunked(q, k, v, mask):
    import attn_course as ac

    return ac.chunked_attention(q, k, v, mask)  # lesson 07's online softmax does the masking and the rest


def _masked_partial(q, k, v, mask):
    import attn_course as ac

    scores = _scores(q, k).masked_fill(~mask, float("-inf"))  # (..., L, S)
    return ac.finish_partial(ac.partial_attention(scores, v))  # the softmax and weighted sum, by the library


def _masked_scales_q_in_place(q, k, v, mask):
    q /= math.sqrt(q.shape[-1])  # "saves a division" but changes the caller's q
    scores = torch.matmul(q, k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))  # (..., L, S)
    return torch.matmul(stable_softmax(scores), v)  # (..., L, Dv)


MASKED_ATTENTION = Task(
    id="03.masked_attention",
    title="Attention with a boolean mask",
    function_name="masked_attention",
    make_cases=_masked_cases,
    judge=_judge_masked,
    reference=_masked_reference,
    wrong={
        "fills with -1e9": Wrong(_masked_minus_1e9, "does not fit in float16"),
        "polarity flipped (masked_fill(mask, -inf))": Wrong(_masked_flipped, "swapped"),
        "NaN for a query with nothing to attend to": Wrong(_masked_nan_on_empty_rows, "nothing to attend to are NaN"),
        "masks after the softmax without renormalising": Wrong(_masked_after_softmax, "without renormalising"),
        "multiplies the scores by the mask": Wrong(_masked_multiplies_scores, "exp(0) = 1"),
        "ignores the mask": Wrong(_masked_ignores_mask, "ignores the mask"),
        "scales q in place": Wrong(_masked_scales_q_in_place, "in place"),
        # Delegations. Their float16 outputs differ from the reference's in the last bit (another summation
        # order), which the catalogue's exact value comparison counts as "values"; the delegation rule is what
        # rejects them (every other case: equal values).
        "calls F.scaled_dot_product_attention": Wrong(
            _masked_torch_sdpa, "you called torch.nn.functional.scaled_dot_product_attention"
        ),
        "calls attn_course.scaled_dot_product_attention": Wrong(
            _masked_course_sdpa, "you called attn_course.scaled_dot_product_attention"
        ),
        "calls attn_course.chunked_attention": Wrong(_masked_chunked, "you called attn_course.chunked_attention"),
        "softmax and weighted sum by attn_course.partial_attention": Wrong(
            _masked_partial, "you called attn_course.partial_attention"
        ),
    },
    # The task is masked attention itself: no attention implementation, the library's (any of them)
    # or PyTorch's, may do it for the learner. The library's stable_softmax and mask_to_bias stay allowed.
    forbidden=(
        *COURSE_ATTENTION,
        *probes.TORCH_ATTENTION,
        *probes.TORCH_MULTIHEAD,
    ),
)


# --- 03.cross_attention_mask (stretch) -------------------------------------------------------
# In an encoder-decoder model, the decoder's queries (target tokens) attend to the encoder's
# outputs (source tokens). Both batches are padded, so both sides have padding. The learner writes
# cross_attention_mask(query_lengths, key_lengths, L, S) -> bool (B, 1, L, S), True where query i
# is a real target token AND key j is a real source token (real tokens first). A padded query
# attends to nothing: its row is empty, and the course's attention gives it a zero output.

_CROSS_SETTINGS = [([3, 5], [6, 2], 5, 7), ([4, 1, 2], [2, 3, 3], 4, 3), ([0, 2], [4, 0], 3, 4), ([6], [6], 6, 6)]


def _cross_cases() -> list[Case]:
    return [
        Case(f"cross_attention_mask(query_lengths=tensor({ql}), key_lengths=tensor({kl}), L={L}, S={S})",
             (torch.tensor(ql), torch.tensor(kl), L, S))
        for ql, kl, L, S in _CROSS_SETTINGS
    ]


def _cross_expected(query_lengths, key_lengths, L, S):
    real_queries = padding_mask(query_lengths, L)  # (B, L)
    real_keys = padding_mask(key_lengths, S)  # (B, S)
    return real_queries[:, None, :, None] & real_keys[:, None, None, :]  # (B, 1, L, S)


def _diagnose_cross(got, query_lengths, key_lengths, L, S) -> str:
    real_queries = padding_mask(query_lengths, L)[:, None, :, None]  # (B, 1, L, 1)
    real_keys = padding_mask(key_lengths, S)[:, None, None, :]  # (B, 1, 1, S)
    expected = real_queries & real_keys
    found = first_match(
        got,
        [
            (lambda: real_keys.expand_as(expected),
             "your mask blocks the padded keys but lets padded queries attend: block the whole row of a query that "
             "is padding (query i is real when i < query_lengths[b])."),
            (lambda: real_queries.expand_as(expected),
             "your mask blocks padded queries but lets every query read padded keys: key j is real only when "
             "j < key_lengths[b]."),
            (lambda: real_queries | real_keys,
             "you combined the two paddings with OR: a pair (i, j) may attend only when query i AND key j are real."),
            (lambda: ~expected,
             "True and False are swapped: in this course True means 'may attend'."),
            (lambda: (torch.arange(L)[None, :] < key_lengths[:, None])[:, None, :, None]
             & (torch.arange(S)[None, :] < query_lengths[:, None])[:, None, None, :],
             "you used key_lengths for the queries (rows) and query_lengths for the keys (columns): the rows are the "
             "decoder's target tokens, counted by query_lengths."),
        ],
    )
    if found:
        return found
    b, _, i, j = (int(n) for n in (got != expected).nonzero()[0])
    should = "may" if expected[b, 0, i, j] else "must not"
    return (f"in batch element {b}, query {i} (query length {int(query_lengths[b])}) {should} attend to key {j} "
            f"(key length {int(key_lengths[b])}).")


def _cross_shape_hint(got, B, L, S) -> str:
    shape = tuple(got.shape)
    if shape == (B, L, S):
        return ("Add the head axis: (B, 1, L, S) broadcasts over the heads of (B, H, L, S) scores, "
                "while (B, L, S) would be read as (H, L, S) for a single sequence.")
    if shape == (B, 1, S, L):
        return "Rows are queries (L), columns are keys (S): you returned the transpose."
    return "One mask per batch element, broadcast over heads: (B, 1, L, S)."


def _judge_cross(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a bool tensor of shape (B, 1, L, S)"):
        for case, _, got in answered(cases, outcomes):
            query_lengths, key_lengths, L, S = case.args
            B = len(query_lengths)
            expect_shape(got, (B, 1, L, S), what=case.name, hint=_cross_shape_hint(got, B, L, S))
            expect_dtype(got, torch.bool, what=case.name, hint="Comparisons and & give bool tensors directly.")
    for title, indices in (("query i may read key j exactly when both are real tokens (L != S)", (0, 1)),
                           ("edge cases: empty sequences on either side, and no padding at all", (2, 3))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                query_lengths, key_lengths, L, S = case.args
                got = returned(outcome, what=case.name)
                expect_shape(got, (len(query_lengths), 1, L, S), what=case.name,
                             hint=_cross_shape_hint(got, len(query_lengths), L, S))
                if not torch.equal(got.bool(), _cross_expected(query_lengths, key_lengths, L, S)):
                    raise Fail(f"{case.name}: {_diagnose_cross(got.bool(), query_lengths, key_lengths, L, S)}")
    with checklist.check("leaves the lengths unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _cross_reference(query_lengths, key_lengths, L, S):
    real_queries = torch.arange(L)[None, :] < query_lengths[:, None]  # (B, L)
    real_keys = torch.arange(S)[None, :] < key_lengths[:, None]  # (B, S)
    return real_queries[:, None, :, None] & real_keys[:, None, None, :]  # (B, 1, L, S)


def _cross_keys_only(query_lengths, key_lengths, L, S):
    real_keys = torch.arange(S)[None, :] < key_lengths[:, None]  # (B, S)
    return real_keys[:, None, None, :].expand(len(query_lengths), 1, L, S)


def _cross_queries_only(query_lengths, key_lengths, L, S):
    real_queries = torch.arange(L)[None, :] < query_lengths[:, None]  # (B, L)
    return real_queries[:, None, :, None].expand(len(query_lengths), 1, L, S)


def _cross_or(query_lengths, key_lengths, L, S):
    real_queries = torch.arange(L)[None, :] < query_lengths[:, None]
    real_keys = torch.arange(S)[None, :] < key_lengths[:, None]
    return real_queries[:, None, :, None] | real_keys[:, None, None, :]


def _cross_lengths_swapped(query_lengths, key_lengths, L, S):
    return _cross_reference(key_lengths, query_lengths, L, S)


def _cross_no_head_axis(query_lengths, key_lengths, L, S):
    return _cross_reference(query_lengths, key_lengths, L, S)[:, 0]  # (B, L, S)


def _cross_transposed(query_lengths, key_lengths, L, S):
    return _cross_reference(query_lengths, key_lengths, L, S).transpose(-2, -1)  # (B, 1, S, L)


def _cross_flipped(query_lengths, key_lengths, L, S):
    return ~_cross_reference(query_lengths, key_lengths, L, S)


def _cross_float(query_lengths, key_lengths, L, S):
    return _cross_reference(query_lengths, key_lengths, L, S).float()


CROSS_ATTENTION_MASK = Task(
    id="03.cross_attention_mask",
    title="Encoder-decoder (cross-attention) mask, padding on both sides",
    function_name="cross_attention_mask",
    make_cases=_cross_cases,
    judge=_judge_cross,
    reference=_cross_reference,
    stretch=True,
    wrong={
        "key padding only": Wrong(_cross_keys_only, "lets padded queries attend"),
        "query padding only": Wrong(_cross_queries_only, "read padded keys"),
        "OR instead of AND": Wrong(_cross_or, "with OR"),
        "query and key lengths swapped": Wrong(_cross_lengths_swapped, "used key_lengths for the queries"),
        "no head axis (B, L, S)": Wrong(_cross_no_head_axis, "Add the head axis"),
        "transposed (B, 1, S, L)": Wrong(_cross_transposed, "you returned the transpose"),
        "polarity flipped": Wrong(_cross_flipped, "swapped"),
        "float 0/1 instead of bool": Wrong(_cross_float, "dtype torch.float32", kind="contract"),
    },
)
