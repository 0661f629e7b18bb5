"""Graded tasks for lesson 05 (sparse attention): a sliding-window mask, block-local attention for any
length, and (stretch) dilated sliding-window attention.

The two attention tasks are about an algorithm, so their graders watch it run (``measure``). On two
long cases the largest intermediate must stay near what the algorithm needs -- block-local attention
holds ``ceil(L / b)`` blocks of ``(b, b)`` scores, so every tensor stays below 4x
``B H L_padded max(b, D, Dv)``; a dilated window never builds an ``(L, L)`` tensor, not even its
mask -- and the work must stay within 4x the intended algorithm's (a loop that scores every query
against every key is quadratic however small its pieces). Calling the course's own sparse
attention (or, for the mask, ``pattern_mask``) gives the task zero (``forbidden``); PyTorch's
attention on small pieces stays allowed, since it is a building block, and dense attention with
the pattern's mask is caught by its ``(L, L)`` tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention
from ...sparse import pattern_mask, sparse_attention
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    expect_close,
    expect_dtype,
    expect_flops_at_most,
    expect_inputs_unchanged,
    expect_largest_below,
    expect_shape,
)
from ._common import answered, returned, same, seeded_randn
from ._variants import consistent_match, distinct_match, largest_dims

__all__ = ["SLIDING_WINDOW_MASK", "BLOCK_LOCAL_ATTENTION", "DILATED_WINDOW_ATTENTION"]

# The work allowed, in multiples of the intended algorithm's count (_block_flops, _dilated_flops).
# Measured on the long cases: references and accepted forms 0.6-1.1x, every quadratic form 10x or more.
FLOP_FACTOR = 4
# The course's sparse attention: what the attention tasks ask the learner to write.
SPARSE = ("attn_course.sparse.sparse_attention", "attn_course.sparse.SparseAttention")


def _heads(q: torch.Tensor) -> int:
    """The number of (batch, head) slices: every axis before (L, D)."""
    return q[..., 0, 0].numel()


def _lengths_mask(lengths: list[int], L: int, *, head_axis: bool = True) -> torch.Tensor:
    """Key-padding mask, True = real token: (B, 1, 1, L), or (B, 1, L) for inputs without a head axis."""
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    return keep[:, None, None, :] if head_axis else keep[:, None, :]


# --- 05.sliding_window_mask ----------------------------------------------------------------
# The learner writes sliding_window_mask(L, window, is_causal) -> bool (L, L): query i may
# attend to key j when |i - j| <= window, and, if is_causal, only when j <= i.

_WINDOW_SIZES = [(8, 2, False), (9, 1, False), (8, 2, True), (10, 3, True), (5, 7, False), (1, 1, True)]
_WINDOW_PLAIN, _WINDOW_CAUSAL, _WINDOW_EDGE = (0, 1), (2, 3), (4, 5)


def _window_cases() -> list[Case]:
    return [
        Case(f"sliding_window_mask(L={L}, window={w}, is_causal={c})", (L, w, c)) for L, w, c in _WINDOW_SIZES
    ]


def _window_expected(L: int, window: int, is_causal: bool) -> torch.Tensor:
    return pattern_mask(L, pattern="sliding", size=window, is_causal=is_causal)


def _diagnose_window(got: torch.Tensor, L: int, window: int, is_causal: bool) -> str:
    expected = _window_expected(L, window, is_causal)
    i = torch.arange(L)[:, None]  # (L, 1)
    j = torch.arange(L)[None, :]  # (1, L)
    causal = j <= i  # (L, L)
    found = distinct_match(
        got,
        expected,
        [
            (lambda: ~expected,
             "True and False are swapped: in this course True means 'may attend'."),
            (lambda: ((i - j).abs() < window) & (causal if is_causal else True),
             "the window is one short on each side: a window of radius w lets query i see keys i-w .. i+w, "
             "|i - j| <= w (2w + 1 keys when nothing is cut off)."),
            (lambda: (i - j).abs() <= window,
             "with is_causal=True a query must not see keys after it: also require j <= i."),
            (lambda: (i - j >= 0) & (i - j <= window),
             "without is_causal the window looks both ways: query i sees keys i-w .. i+w, not only the past ones."),
            (lambda: ((i // window) == (j // window)) & (causal if is_causal else True),
             "that is a block-local mask (fixed blocks of w positions). A sliding window is centred on each query: "
             "|i - j| <= w."),
            (lambda: ((i - j).abs() <= window // 2) & (causal if is_causal else True),
             "you used window // 2 as the radius. Here window is the radius itself: |i - j| <= window."),
        ],
    )
    if found:
        return found
    a, b = (int(x) for x in (got != expected).nonzero()[0])
    state = "may" if got[a, b] else "may not"
    return f"query {a} {state} attend to key {b} in your mask; expected the opposite (|{a} - {b}| = {abs(a - b)})."


def _judge_window(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a bool tensor of shape (L, L)"):
        for case, _, got in answered(cases, outcomes):
            L = case.args[0]
            expect_shape(got, (L, L), what=case.name, hint="Rows are queries, columns keys: (L, L).")
            expect_dtype(got, torch.bool, what=case.name, hint="Comparisons such as a <= b give a bool tensor directly.")
    for title, indices in (("non-causal windows: |i - j| <= window", _WINDOW_PLAIN),
                           ("causal windows: also j <= i", _WINDOW_CAUSAL),
                           ("edge cases: a window wider than the sequence, a single position", _WINDOW_EDGE)):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name)
                expect_shape(got, (case.args[0], case.args[0]), what=case.name)
                if not torch.equal(got.bool(), _window_expected(*case.args)):
                    raise Fail(f"{case.name}: {_diagnose_window(got.bool(), *case.args)}")
    return checklist.results


def _offsets(L):
    return torch.arange(L)[:, None] - torch.arange(L)[None, :]  # (L, L), i - j


def _window_reference(L, window, is_causal):
    d = _offsets(L)  # (L, L), i - j
    return (d.abs() <= window) & ((d >= 0) if is_causal else True)


def _window_strict(L, window, is_causal):
    d = _offsets(L)
    return (d.abs() < window) & ((d >= 0) if is_causal else True)


def _window_flipped(L, window, is_causal):
    return ~_window_reference(L, window, is_causal)


def _window_ignores_causal(L, window, is_causal):
    return _offsets(L).abs() <= window


def _window_past_only(L, window, is_causal):
    d = _offsets(L)
    return (d >= 0) & (d <= window)


def _window_blocks(L, window, is_causal):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (i // window == j // window) & ((j <= i) if is_causal else True)


def _window_float(L, window, is_causal):
    return _window_reference(L, window, is_causal).float()


def _window_delegates(L, window, is_causal):
    import attn_course as ac

    return ac.pattern_mask(L, pattern="sliding", size=window, is_causal=is_causal)


SLIDING_WINDOW_MASK = Task(
    id="05.sliding_window_mask",
    title="Sliding-window mask",
    function_name="sliding_window_mask",
    make_cases=_window_cases,
    judge=_judge_window,
    reference=_window_reference,
    wrong={
        "window one short (< instead of <=)": Wrong(_window_strict, "one short on each side"),
        "polarity flipped": Wrong(_window_flipped, "swapped"),
        "ignores is_causal": Wrong(_window_ignores_causal, "require j <= i"),
        "looks only backwards when not causal": Wrong(_window_past_only, "looks both ways"),
        "block-local instead of sliding": Wrong(_window_blocks, "block-local mask"),
        "float 0/1 instead of bool": Wrong(_window_float, "dtype torch.float32", kind="contract"),
        "calls attn_course.pattern_mask": Wrong(
            _window_delegates, "you called attn_course.pattern_mask", kind="algorithm"
        ),
    },
    forbidden=("attn_course.sparse.pattern_mask",),
)


# --- 05.block_local_attention --------------------------------------------------------------
# The learner writes block_local_attention(q, k, v, block_size, mask) -> (..., L, Dv): queries in
# block i // block_size attend to the keys of the same block only, for ANY length L (pad to a
# multiple, mask the padded keys, slice the padding off), without an L x L matrix. mask is None
# or a key-padding mask (B, 1, 1, L) -- (B, 1, L) without a head axis --, True = real token; a
# query whose block holds no real key gets a zero row.


def _block_cases() -> list[Case]:
    randn = seeded_randn(505)

    def qkv(*shape, dv=None, dtype=torch.float64):
        value_shape = (*shape[:-1], dv or shape[-1])
        return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(*value_shape, dtype=dtype)

    return [
        Case("q, k, v (2, 2, 16, 8), block_size=4 (L a multiple of the block), no mask, float64",
             (*qkv(2, 2, 16, 8), 4, None)),
        Case("q, k (2, 3, 13, 8), v (2, 3, 13, 5), block_size=5 (13 = 2 blocks + 3), no mask, float64",
             (*qkv(2, 3, 13, 8, dv=5), 5, None)),
        Case("q, k, v (2, 10, 4) without a head axis, block_size=4, mask (2, 1, 10) with lengths 10 and 6 "
             "(the second sequence's last block is all padding), float64",
             (*qkv(2, 10, 4), 4, _lengths_mask([10, 6], 10, head_axis=False))),
        Case("q, k, v (2, 2, 6, 4), block_size=8 (one block longer than the sequence), no mask, float64",
             (*qkv(2, 2, 6, 4), 8, None)),
        Case("q, k, v (2, 2, 7, 8), block_size=3, mask (2, 1, 1, 7) with lengths 7 and 2, float32",
             (*qkv(2, 2, 7, 8, dtype=torch.float32), 3, _lengths_mask([7, 2], 7))),
        Case("q, k, v (2, 2, 11, 4), block_size=4, mask (2, 1, 1, 11) with lengths 11 and 9, float64",
             (*qkv(2, 2, 11, 4), 4, _lengths_mask([11, 9], 11))),
        # Long enough that a quadratic tensor dwarfs the blocks: (L, L) is 8x the limit below.
        Case("long: q, k, v (2, 2, 512, 8), block_size=16, no mask, float64", (*qkv(2, 2, 512, 8), 16, None)),
        Case("long: q, k (2, 2, 400, 8), v (2, 2, 400, 4), block_size=16, mask (2, 1, 1, 400) with lengths "
             "400 and 330, float64",
             (*qkv(2, 2, 400, 8, dv=4), 16, _lengths_mask([400, 330], 400))),
    ]


_MULTIPLE, _NOT_MULTIPLE, _NO_HEADS_MASKED, _LONG_BLOCK, _FLOAT32_MASKED, _MASKED, _LONG, _LONG_MASKED = range(8)


def _block_expected(q, k, v, block_size, mask):
    return sparse_attention(q, k, v, mask, pattern="block", size=block_size)


def _block_form(
    q, k, v, block_size, mask=None, *, padded=None, scale=None, mask_padding=True, use_mask=True,
    zero_empty_rows=True, slice_back=True, softmax_dim=-1,
):
    """Block-local attention written out (no library call), optionally with one classic mistake."""
    L, D = q.shape[-2], q.shape[-1]
    padded = math.ceil(L / block_size) * block_size if padded is None else padded
    nb = padded // block_size
    scale = 1 / math.sqrt(D) if scale is None else scale
    qb, kb, vb = (F.pad(x, (0, 0, 0, padded - L)).unflatten(-2, (nb, block_size)) for x in (q, k, v))  # (..., nb, b, D)
    scores = torch.matmul(qb, kb.transpose(-2, -1)) * scale  # (..., nb, b, b), one small matrix per block
    keep = torch.arange(padded) < L if mask_padding else torch.ones(padded, dtype=torch.bool)  # (Lp,)
    if use_mask and mask is not None:
        keep = keep & F.pad(mask[..., 0, :], (0, padded - L), value=False)  # (B, [1,] Lp), True = a real key
    keep = keep.unflatten(-1, (nb, block_size)).unsqueeze(-2)  # (..., nb, 1, b)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=softmax_dim)  # (..., nb, b, b)
    if zero_empty_rows:
        weights = torch.nan_to_num(weights, nan=0.0)  # a query with no real key in its block: a zero row
    out = torch.matmul(weights, vb).flatten(-3, -2)  # (..., Lp, Dv)
    return out[..., :L, :] if slice_back else out


def _block_interleaved(q, k, v, block_size, mask):
    """Position i put in block i % nblocks: reshaped (b, nb) instead of (nb, b)."""
    L = q.shape[-2]
    nb = math.ceil(L / block_size)
    i = torch.arange(L)
    allowed = (i[:, None] % nb) == (i[None, :] % nb)  # (L, L)
    if mask is not None:
        allowed = allowed & mask  # (..., L, L)
    return scaled_dot_product_attention(q, k, v, allowed)


def _dense_block_mask(q, k, v, block_size, mask):
    """Right values the O(L^2) way: dense attention with the block mask (and the padding mask)."""
    i = torch.arange(q.shape[-2])
    allowed = (i[:, None] // block_size) == (i[None, :] // block_size)  # (L, L), same block
    if mask is not None:
        allowed = allowed & mask  # (..., L, L)
    return scaled_dot_product_attention(q, k, v, allowed)


def _diagnose_block(got, q, k, v, block_size, mask) -> str | None:
    return distinct_match(
        got,
        _block_expected(q, k, v, block_size, mask),
        [
            (lambda: scaled_dot_product_attention(q, k, v, mask),
             "your output equals full attention: each query may only attend to the keys of its own block."),
            (lambda: _block_form(q, k, v, block_size, mask, mask_padding=False),
             "the zero rows you padded with took part as keys: a zero key scores 0, and exp(0) = 1 gives it weight. "
             "The last, shorter block must see only real keys."),
            (lambda: _block_form(q, k, v, block_size, mask, use_mask=False),
             "your output ignores the key-padding mask: a key whose mask entry is False must get no weight, "
             "in every block."),
            (lambda: _block_form(q, k, v, block_size, mask, scale=1.0),
             "the scores are not scaled: attention scales q @ k^T by 1 / sqrt(D), in every block."),
            (lambda: _block_form(q, k, v, block_size, mask, softmax_dim=-2),
             "the softmax ran over the queries (dim=-2): each query's weights over its block's keys must sum to 1, "
             "softmax over dim=-1."),
            (lambda: _block_interleaved(q, k, v, block_size, mask),
             "your blocks are interleaved: you put position i in block i % num_blocks, but a block is a run of "
             "block_size consecutive positions."),
        ],
    )


_BLOCK_ERROR_HINTS = (
    ("invalid for input of size",
     "a view into (L // block_size, block_size) blocks needs L to be a multiple of the block, the source article's "
     "bug. Any length must work: the last block is then shorter (or padded, the padding never seen as a key and "
     "not returned)."),
    ("not enough values to unpack",
     "do not assume a (B, H, L, D) layout: work on the last two axes, (..., L, D)."),
)


def _block_limit(q, v, block_size) -> int:
    """One more than the largest tensor block-local attention needs: B H L_padded max(b, D, Dv) elements.

    No allowance: the (b, b) scores of ceil(L / b) blocks are what the algorithm holds, and any padding
    beyond the next multiple of the block (a whole extra block when L is already a multiple, padding to
    2L) makes them larger. Measured: the reference and the accepted block loop stay at or below it.
    """
    L = q.shape[-2]
    padded = math.ceil(L / block_size) * block_size
    return _heads(q) * padded * max(block_size, q.shape[-1], v.shape[-1]) + 1


def _block_flops(q, k, v, block_size) -> int:
    """Block-local attention's work, counted like the probe: two products per block, a few passes over the scores."""
    L, D, Dv = q.shape[-2], q.shape[-1], v.shape[-1]
    padded = math.ceil(L / block_size) * block_size
    per_head = padded * block_size * (2 * D + 2 * Dv + 4) + padded * (3 * D + 2 * Dv)
    return _heads(q) * per_head


def _block_memory_story(outcome, case, values_right: bool) -> str:
    """What the largest tensor says went wrong, from its shape; the general rule when the shape tells nothing."""
    q, _, v, block_size, _ = case.args
    L = q.shape[-2]
    padded = math.ceil(L / block_size) * block_size
    needed = padded // block_size
    dims = largest_dims(outcome)
    holds = (f"holds ceil(L / b) = {needed} blocks of (b, b) = ({block_size}, {block_size}) "
            f"scores per batch element and head, on a sequence of {L} positions padded to at most {padded}.")
    if values_right and dims.count(L) >= 2:
        return (f"your values are right, but you reached them through an (L, L) = ({L}, {L}) matrix or mask. "
                f"Block-local attention never needs an (L, L) tensor: it {holds}")
    if len(dims) >= 2 and dims[-2:] == (block_size, block_size) and math.prod(dims[:-2]) > _heads(q) * needed:
        blocks = math.prod(dims[:-2]) // _heads(q)
        return (f"that is {blocks} blocks of ({block_size}, {block_size}) scores per batch element and head where "
                f"{needed} suffice: pad the sequence only up to the next multiple of the block ({L} -> {padded}).")
    if len(dims) >= 2 and dims[-1] == L and dims[-2] < L:
        return (f"your scores have one column for every key of the sequence (the last axis is L = {L}), however few "
                f"queries each piece holds: a query needs only the {block_size} keys of its own block. Block-local attention {holds}")
    return f"block-local attention {holds} (A broadcast product instead of matmul holds D times more.)"


def _judge_block(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_BLOCK_ERROR_HINTS):
            q, _, v = case.args[:3]
            hint = ""
            if got.dim() == q.dim() and got.shape[-2] > q.shape[-2]:
                hint = "You returned the padded length: the output has one row per position of the input, L of them."
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name, hint=hint)
            expect_dtype(got, q.dtype, what=case.name)

    def values(indices):
        for index in indices:
            case = cases[index]
            got = returned(outcomes[index], what=case.name, hints=_BLOCK_ERROR_HINTS)
            expected = _block_expected(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            if torch.isnan(got).any() and not torch.isnan(expected).any():
                raise Fail(
                    f"{case.name}: NaN in your output. A query whose block holds no real key has only -inf scores, "
                    "and softmax of nothing but -inf is 0/0. Such a query gets a zero row, as in dense attention."
                )
            atol = 1e-5 if case.args[0].dtype == torch.float32 else 1e-9
            expect_close(got, expected, what=case.name, atol=atol, rtol=atol, hint=lambda: _diagnose_block(got, *case.args) or "")

    for title, indices in (
        ("queries see only their own block (L a multiple of block_size)", (_MULTIPLE,)),
        ("any length: a last, shorter block sees only real keys", (_NOT_MULTIPLE, _LONG_BLOCK)),
        ("the key-padding mask: masked keys get no weight, a query with no real key gets a zero row",
         (_NO_HEADS_MASKED, _FLOAT32_MASKED, _MASKED)),
        ("long sequences (hundreds of positions) match the library", (_LONG, _LONG_MASKED)),
    ):
        with checklist.check(title):
            values(indices)
    values_right = all(  # the algorithm stories (an (L, L) matrix, ...) are told only for the right values
        o.error is None and same(o.returned, _block_expected(*c.args), atol=1e-5, rtol=1e-5)
        for c, o in zip(cases, outcomes)
    )
    with checklist.check("never more than ceil(L / b) blocks of (b, b) scores: every intermediate stays within "
                         "B·H·L_padded·max(b, D, Dv) elements, L_padded the next multiple of b"):
        for index in (_LONG, _LONG_MASKED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, _, v, block_size, _ = case.args
            L = q.shape[-2]
            padded = math.ceil(L / block_size) * block_size
            expect_largest_below(
                outcome, _block_limit(q, v, block_size), what=case.name,
                constraint=_block_memory_story(outcome, case, values_right),
            )
    with checklist.check(f"work grows like L·b, not L·L (within {FLOP_FACTOR}x block-local attention's)"):
        for index in (_LONG, _LONG_MASKED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            intended = _block_flops(*case.args[:4])
            expect_flops_at_most(
                outcome, FLOP_FACTOR * intended, what=case.name, intended=intended,
                hint="Score each block of queries against its own block of keys only: scoring every query against "
                "every key and masking afterwards costs O(L^2), even one query at a time.",
            )
    with checklist.check("leaves q, k, v and the mask unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_BLOCK_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _block_reference(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask)


def _block_article(q, k, v, block_size, mask):
    """The source article's forward: a view that needs L % block_size == 0 (and no mask)."""
    batch, heads, seq_len, dim = q.shape
    q = q.view(batch, heads, seq_len // block_size, block_size, dim)
    k = k.view(batch, heads, seq_len // block_size, block_size, dim)
    v = v.view(batch, heads, seq_len // block_size, block_size, v.shape[-1])
    attn = torch.softmax(torch.einsum("bhlqd,bhlkd->bhlqk", q, k) / dim**0.5, dim=-1)
    return torch.einsum("bhlqk,bhlkd->bhlqd", attn, v).reshape(batch, heads, seq_len, -1)


def _block_padding_unmasked(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask, mask_padding=False)


def _block_ignores_mask(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask, use_mask=False)


def _block_nan_rows(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask, zero_empty_rows=False)


def _block_unscaled(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask, scale=1.0)


def _block_softmax_queries(q, k, v, block_size, mask):
    return _block_form(q, k, v, block_size, mask, softmax_dim=-2)


def _block_not_sliced(q, k, v, block_size, mask):
    """Pads and masks the padded keys correctly, but returns the padded length."""
    return _block_form(q, k, v, block_size, mask, slice_back=False)


def _block_full(q, k, v, block_size, mask):
    return scaled_dot_product_attention(q, k, v, mask)


def _block_in_place(q, k, v, block_size, mask):
    q.mul_(1 / math.sqrt(q.shape[-1]))
    return _block_form(q, k, v, block_size, mask, scale=1.0)


def _block_oversized_padding(q, k, v, block_size, mask):
    """Right values, b times the memory: padded to L * block_size positions (L blocks, not ceil(L / b))."""
    return _block_form(q, k, v, block_size, mask, padded=q.shape[-2] * block_size)


def _block_extra_block(q, k, v, block_size, mask):
    """Right values, one block too many: pads block_size - L % block_size rows, a whole block when b divides L."""
    L = q.shape[-2]
    return _block_form(q, k, v, block_size, mask, padded=L + block_size - L % block_size)


def _block_padded_to_twice(q, k, v, block_size, mask):
    """Right values, twice the memory: padded to 2L (rounded up to a multiple of the block)."""
    return _block_form(q, k, v, block_size, mask, padded=math.ceil(2 * q.shape[-2] / block_size) * block_size)


def _block_query_chunks(q, k, v, block_size, mask, chunk=32):
    """Right values, small tensors, O(L^2) work: each chunk of queries scored against every key, then masked."""
    L, D = q.shape[-2], q.shape[-1]
    block_of = torch.arange(L) // block_size  # (L,)
    rows = []
    for start in range(0, L, chunk):
        queries = slice(start, start + chunk)
        scores = torch.matmul(q[..., queries, :], k.transpose(-2, -1)) / math.sqrt(D)  # (..., c, L), every key
        allowed = block_of[queries, None] == block_of[None, :]  # (c, L)
        if mask is not None:
            allowed = allowed & mask  # (B, [1,] c, L)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # (..., c, L)
        rows.append(torch.matmul(weights, v))  # (..., c, Dv)
    return torch.cat(rows, dim=-2)  # (..., L, Dv)


def _block_loop(q, k, v, block_size, mask):
    """Correct: one slice of queries and keys per block (the last one shorter, no padding), F.sdpa on each."""
    outputs = []
    for start in range(0, q.shape[-2], block_size):
        block = slice(start, start + block_size)
        keep = None if mask is None else mask[..., block]  # (B, [1,] 1, b)
        outputs.append(F.scaled_dot_product_attention(q[..., block, :], k[..., block, :], v[..., block, :], keep))
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _block_delegates(q, k, v, block_size, mask):
    import attn_course as ac

    return ac.sparse_attention(q, k, v, mask, pattern="block", size=block_size)


BLOCK_LOCAL_ATTENTION = Task(
    id="05.block_local_attention",
    title="Block-local attention for any length",
    function_name="block_local_attention",
    make_cases=_block_cases,
    judge=_judge_block,
    reference=_block_reference,
    wrong={
        "the article's view (L must be a multiple)": Wrong(_block_article, "the source article's bug"),
        "padded keys not masked": Wrong(_block_padding_unmasked, "padded with took part as keys"),
        "key-padding mask ignored": Wrong(_block_ignores_mask, "ignores the key-padding mask"),
        "NaN for a query with no real key": Wrong(_block_nan_rows, "nothing but -inf is 0/0"),
        "no 1/sqrt(D) scale": Wrong(_block_unscaled, "not scaled"),
        "softmax over the queries": Wrong(_block_softmax_queries, "softmax over dim=-1"),
        "interleaved blocks": Wrong(_block_interleaved, "blocks are interleaved"),
        "padding not sliced off": Wrong(_block_not_sliced, "You returned the padded length"),
        "full attention": Wrong(_block_full, "equals full attention"),
        "scales q in place": Wrong(_block_in_place, "in place", kind="contract"),
        "dense attention with the block mask": Wrong(_dense_block_mask, "never needs an (L, L) tensor", kind="algorithm"),
        "padded to L * block_size (L blocks, not ceil(L / b))": Wrong(
            _block_oversized_padding, "only up to the next multiple of the block", kind="algorithm"
        ),
        "a whole extra block of padding when L is a multiple of b": Wrong(
            _block_extra_block, "only up to the next multiple of the block", kind="algorithm"
        ),
        "padded to 2L": Wrong(_block_padded_to_twice, "only up to the next multiple of the block", kind="algorithm"),
        "chunks of queries scored against every key, then masked": Wrong(
            _block_query_chunks, "one column for every key of the sequence", kind="algorithm"
        ),
        "calls attn_course.sparse_attention": Wrong(
            _block_delegates, "you called attn_course.sparse_attention", kind="algorithm"
        ),
    },
    accepted={"a loop over the blocks, PyTorch's attention on each": _block_loop},
    measure=("largest", "flops"),
    forbidden=SPARSE,
)


# --- 05.dilated_window_attention (stretch) --------------------------------------------------
# The learner writes dilated_window_attention(q, k, v, window, dilation) -> (..., L, Dv): query
# i attends to the keys i + m * dilation for m = -window .. window that lie inside the sequence
# (2 * window + 1 keys at most, spread over 2 * window * dilation + 1 positions), with the 1/sqrt(D)
# scale; self-attention, no mask. It must never build an (L, L) tensor, not even the mask.


def _dilated_cases() -> list[Case]:
    randn = seeded_randn(515)

    def qkv(*shape, dv=None, dtype=torch.float64):
        value_shape = (*shape[:-1], dv or shape[-1])
        return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(*value_shape, dtype=dtype)

    return [
        Case("q, k (2, 2, 20, 4), v (2, 2, 20, 3), window=2, dilation=3, float64", (*qkv(2, 2, 20, 4, dv=3), 2, 3)),
        Case("q, k, v (2, 2, 17, 8), window=1, dilation=4, float64", (*qkv(2, 2, 17, 8), 1, 4)),
        Case("q, k, v (2, 2, 12, 4), window=3, dilation=1 (a plain sliding window), float64",
             (*qkv(2, 2, 12, 4), 3, 1)),
        Case("q, k, v (2, 9, 4) without a head axis, window=2, dilation=5 (the window reaches past both ends), "
             "float64", (*qkv(2, 9, 4), 2, 5)),
        Case("q, k, v (2, 2, 16, 8), window=2, dilation=2, float32", (*qkv(2, 2, 16, 8, dtype=torch.float32), 2, 2)),
        # Long enough that an (L, L) tensor is at least 4.8x every honest intermediate (B H L (2w+1) D).
        Case("long: q, k, v (2, 2, 512, 4), window=2, dilation=8, float64", (*qkv(2, 2, 512, 4), 2, 8)),
        Case("long: q, k (2, 2, 384, 4), v (2, 2, 384, 2), window=2, dilation=6, float64",
             (*qkv(2, 2, 384, 4, dv=2), 2, 6)),
    ]


_DILATED, _DILATED_2, _DILATION_ONE, _PAST_BOTH_ENDS, _DILATED_FLOAT32, _DILATED_LONG, _DILATED_LONG_2 = range(7)


def _dilated_mask(L, window, dilation):
    offset = torch.arange(L)[:, None] - torch.arange(L)[None, :]  # (L, L), i - j
    return (offset % dilation == 0) & (offset.abs() <= window * dilation)  # (L, L)


def _dilated_expected(q, k, v, window, dilation):
    return scaled_dot_product_attention(q, k, v, _dilated_mask(q.shape[-2], window, dilation))


def _dilated_form(q, k, v, window, dilation, *, steps=None, scale=None, edges="mask", softmax_dim=-1):
    """Dilated window attention written out by gathering each query's keys, optionally with one mistake.

    ``steps``: the m of the keys i + m * dilation (default -window .. window); ``edges``: what
    happens to keys outside the sequence: ``"mask"`` (right), ``"zeros"`` (zero keys take part),
    ``"wrap"`` (they come round from the other end).
    """
    L, D = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    steps = torch.arange(-window, window + 1) if steps is None else steps  # (W,)
    position = torch.arange(L)[:, None] + dilation * steps[None, :]  # (L, W), the keys of each query
    inside = (position >= 0) & (position < L)  # (L, W)
    if edges == "wrap":
        position = position % L  # (L, W), off one end, back in at the other
    keys = k[..., position.clamp(0, L - 1), :]  # (..., L, W, D)
    values = v[..., position.clamp(0, L - 1), :]  # (..., L, W, Dv)
    if edges == "zeros":
        keys, values = keys * inside[..., None], values * inside[..., None]  # zero keys score 0, exp(0) = 1
    scores = torch.matmul(keys, q[..., :, :, None])[..., 0] * scale  # (..., L, W)
    if edges == "mask":
        scores = scores.masked_fill(~inside, float("-inf"))  # (..., L, W)
    weights = torch.softmax(scores, dim=softmax_dim)  # (..., L, W)
    return torch.matmul(weights[..., None, :], values)[..., 0, :]  # (..., L, Dv)


def _dilated_variants(q, k, v, window, dilation):
    """The classic mistakes of dilated window attention on one case, as ``(make, message)``."""
    return [
            (lambda: _dilated_form(q, k, v, window, 1),
             "you ignored the dilation: that is a plain sliding window. Query i sees the keys i + m * dilation for "
             "m = -window .. window, so its reach is window * dilation positions each way."),
            (lambda: _dilated_form(q, k, v, window // dilation, dilation),
             "your window counts positions, |i - j| <= window: it counts steps of the dilation. Query i sees "
             "i + m * dilation for |m| <= window, reaching window * dilation positions each way."),
            (lambda: _dilated_form(q, k, v, window, dilation, steps=torch.arange(-window + 1, window)),
             "the window is one step short on each side: m runs from -window to +window inclusive, 2 * window + 1 "
             "keys when nothing is cut off."),
            (lambda: _dilated_form(q, k, v, window, dilation, steps=torch.arange(-window, 1)),
             "your window only looks backwards. Without a causal mask it looks both ways: m = -window .. +window."),
            (lambda: _dilated_form(q, k, v, window, dilation, edges="zeros"),
             "near the ends of the sequence, positions outside it took part as zero keys: a zero key scores 0 and "
             "exp(0) = 1 gives it weight. Keys that fall outside the sequence must get no weight at all."),
            (lambda: _dilated_form(q, k, v, window, dilation, edges="wrap"),
             "near the ends of the sequence your window wraps around to the other end (as torch.roll or an index "
             "modulo L do). Keys outside the sequence must be left out, not brought back in."),
            (lambda: _dilated_form(q, k, v, window, dilation, scale=1.0),
             "the scores are not scaled: attention scales them by 1 / sqrt(D)."),
            (lambda: _dilated_form(q, k, v, window, dilation, softmax_dim=-2),
             "the softmax ran over the queries: each query's weights over its own keys must sum to 1."),
    ]


def _diagnose_dilated(got, q, k, v, window, dilation) -> str | None:
    """The mistake that explains ``got`` on this one case (the judge also checks it against the other cases)."""
    return distinct_match(got, _dilated_expected(q, k, v, window, dilation), _dilated_variants(q, k, v, window, dilation))


def _dilated_tolerance(q, *args):
    return (1e-5, 1e-5) if q.dtype == torch.float32 else (1e-9, 1e-9)


def _dilated_flops(q, k, v, window, dilation) -> int:
    """Gathering each query's 2w + 1 keys and values, scoring them, mixing them: counted like the probe."""
    L, D, Dv = q.shape[-2], q.shape[-1], v.shape[-1]
    keys = 2 * window + 1
    return _heads(q) * L * keys * (3 * D + 3 * Dv + 4)


def _dilated_work_story(outcome, case) -> str:
    """Why the work is quadratic; "in small pieces" only when no (L, L) tensor was built (that check tells the rest)."""
    L = case.args[0].shape[-2]
    largest = outcome.probe.get("largest_numel") if isinstance(outcome.probe, dict) else None
    small = isinstance(largest, int) and not isinstance(largest, bool) and largest < L * L
    rule = "Score each query against its own 2 * window + 1 keys only"
    if small:
        return (f"{rule}: your tensors stay below (L, L), but you still score each query against every key and mask "
                "afterwards, which costs O(L^2) however small the pieces.")
    return f"{rule}: the other keys get no weight, so they need no score."


def _judge_dilated(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v = case.args[:3]
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices in (
        ("query i sees the keys i + m·dilation, |m| <= window (dilations 3 and 4)", (_DILATED, _DILATED_2)),
        ("dilation 1 is a sliding window; keys outside the sequence are left out", (_DILATION_ONE, _PAST_BOTH_ENDS)),
        ("float32 inputs", (_DILATED_FLOAT32,)),
        ("long sequences (hundreds of positions) match dense attention with the dilated mask",
         (_DILATED_LONG, _DILATED_LONG_2)),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name)
                expected = _dilated_expected(*case.args)
                atol = 1e-5 if case.args[0].dtype == torch.float32 else 1e-9
                expect_close(got, expected, what=case.name, atol=atol, rtol=atol,
                             hint=lambda: consistent_match(index, cases, outcomes, expected=_dilated_expected,
                                                           variants=_dilated_variants,
                                                           tolerance=_dilated_tolerance) or "")
    with checklist.check("never forms an (L, L) tensor, not even the mask: every intermediate stays below L * L"):
        for index in (_DILATED_LONG, _DILATED_LONG_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, _, _, window, dilation = case.args
            L = q.shape[-2]
            expect_largest_below(
                outcome, L * L, what=case.name,
                constraint=f"a dilated window gives each query {2 * window + 1} keys, so it never needs the (L, L) = "
                f"({L}, {L}) scores or mask: every query reads only positions i + m * {dilation} for "
                f"m = -{window} .. {window}.",
            )
    with checklist.check(f"work grows like L·(2·window + 1), not L·L (within {FLOP_FACTOR}x the gathered form's)"):
        for index in (_DILATED_LONG, _DILATED_LONG_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            intended = _dilated_flops(*case.args)
            expect_flops_at_most(
                outcome, FLOP_FACTOR * intended, what=case.name, intended=intended,
                hint=_dilated_work_story(outcome, case),
            )
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _dilated_reference(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation)


def _dilated_by_steps(q, k, v, window, dilation):
    """Correct: a loop over the 2w + 1 steps m, each shifting the whole sequence by m * dilation."""
    L, D = q.shape[-2], q.shape[-1]
    scores, shifted_values = [], []
    for m in range(-window, window + 1):
        shift = m * dilation
        position = torch.arange(L) + shift  # (L,), the key each query reads at this step
        inside = (position >= 0) & (position < L)  # (L,)
        index = position.clamp(0, L - 1)  # (L,)
        score = (q * k[..., index, :]).sum(dim=-1) / math.sqrt(D)  # (..., L)
        scores.append(score.masked_fill(~inside, float("-inf")))
        shifted_values.append(v[..., index, :])  # (..., L, Dv)
    weights = torch.softmax(torch.stack(scores, dim=-1), dim=-1)  # (..., L, W)
    return sum(weights[..., s, None] * value for s, value in enumerate(shifted_values))  # (..., L, Dv)


def _dilated_wrong_steps(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, 1)


def _dilated_positions(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window // dilation, dilation)


def _dilated_short(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation, steps=torch.arange(-window + 1, window))


def _dilated_backwards(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation, steps=torch.arange(-window, 1))


def _dilated_zero_keys(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation, edges="zeros")


def _dilated_wraps(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation, edges="wrap")


def _dilated_unscaled(q, k, v, window, dilation):
    return _dilated_form(q, k, v, window, dilation, scale=1.0)


def _dilated_dense(q, k, v, window, dilation):
    """Right values the O(L^2) way: dense attention with the dilated (L, L) mask."""
    return scaled_dot_product_attention(q, k, v, _dilated_mask(q.shape[-2], window, dilation))


def _dilated_query_chunks(q, k, v, window, dilation, chunk=32):
    """Right values, small tensors, O(L^2) work: each chunk of queries scored against every key, then masked."""
    L, D = q.shape[-2], q.shape[-1]
    position = torch.arange(L)
    rows = []
    for start in range(0, L, chunk):
        queries = slice(start, start + chunk)
        scores = torch.matmul(q[..., queries, :], k.transpose(-2, -1)) / math.sqrt(D)  # (..., c, L), every key
        offset = position[queries, None] - position[None, :]  # (c, L), i - j
        allowed = (offset % dilation == 0) & (offset.abs() <= window * dilation)  # (c, L)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (..., c, L)
        rows.append(torch.matmul(weights, v))  # (..., c, Dv)
    return torch.cat(rows, dim=-2)  # (..., L, Dv)


def _dilated_delegates(q, k, v, window, dilation):
    """Right values: the residue classes i mod dilation are plain sliding windows -- given to the library."""
    import attn_course as ac

    L = q.shape[-2]
    n = math.ceil(L / dilation)
    pad = n * dilation - L

    def classes(x):
        return F.pad(x, (0, 0, 0, pad)).unflatten(-2, (n, dilation)).transpose(-3, -2)  # (..., d, n, D)

    keep = (torch.arange(n * dilation) < L).view(n, dilation).T[:, None, :]  # (d, 1, n), real positions
    out = ac.sparse_attention(classes(q), classes(k), classes(v), keep, pattern="sliding", size=window)  # (..., d, n, Dv)
    return out.transpose(-3, -2).flatten(-3, -2)[..., :L, :]  # (..., L, Dv)


def _dilated_in_place(q, k, v, window, dilation):
    q.mul_(1 / math.sqrt(q.shape[-1]))
    return _dilated_form(q, k, v, window, dilation, scale=1.0)


DILATED_WINDOW_ATTENTION = Task(
    id="05.dilated_window_attention",
    title="Dilated sliding-window attention",
    function_name="dilated_window_attention",
    make_cases=_dilated_cases,
    judge=_judge_dilated,
    reference=_dilated_reference,
    wrong={
        "dilation ignored (a plain sliding window)": Wrong(_dilated_wrong_steps, "ignored the dilation"),
        "window counted in positions, not steps": Wrong(_dilated_positions, "counts steps of the dilation"),
        "one step short on each side": Wrong(_dilated_short, "one step short"),
        "looks only backwards": Wrong(_dilated_backwards, "only looks backwards"),
        "zero keys outside the sequence take part": Wrong(_dilated_zero_keys, "took part as zero keys"),
        "wraps around the ends": Wrong(_dilated_wraps, "wraps around"),
        "no 1/sqrt(D) scale": Wrong(_dilated_unscaled, "not scaled"),
        "scales q in place": Wrong(_dilated_in_place, "in place", kind="contract"),
        "dense attention with the dilated mask": Wrong(_dilated_dense, "never needs the (L, L)", kind="algorithm"),
        "chunks of queries scored against every key, then masked": Wrong(
            _dilated_query_chunks, "however small the pieces", kind="algorithm"
        ),
        "calls attn_course.sparse_attention on each residue class": Wrong(
            _dilated_delegates, "you called attn_course.sparse_attention", kind="algorithm"
        ),
    },
    accepted={"a loop over the 2w + 1 steps": _dilated_by_steps},
    measure=("largest", "flops"),
    forbidden=SPARSE,
    stretch=True,
)
