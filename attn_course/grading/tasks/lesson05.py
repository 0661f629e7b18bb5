"""Graded tasks for lesson 05 (sparse attention): a sliding-window mask, block-local attention for any length."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention, stable_softmax
from ...sparse import pattern_mask, sparse_attention
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape, returned_tensor
from ._common import answered, returned, seeded_randn
from ._variants import distinct_match

__all__ = ["SLIDING_WINDOW_MASK", "BLOCK_LOCAL_ATTENTION"]


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


def _window_reference(L, window, is_causal):
    return pattern_mask(L, pattern="sliding", size=window, is_causal=is_causal)


def _offsets(L):
    return torch.arange(L)[:, None] - torch.arange(L)[None, :]  # (L, L), i - j


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
    },
)


# --- 05.block_local_attention --------------------------------------------------------------
# The learner writes block_local_attention(q, k, v, block_size) -> (..., L, Dv): queries in
# block b = i // block_size attend to the keys of the same block only, for ANY length L
# (pad to a multiple, mask the padded keys, slice the padding off), without an L x L matrix.


def _block_cases() -> list[Case]:
    randn = seeded_randn(505)

    return [
        Case("q, k, v (2, 2, 16, 8), block_size=4 (L a multiple of the block), float64",
             (randn(2, 2, 16, 8), randn(2, 2, 16, 8), randn(2, 2, 16, 8), 4)),
        Case("q, k (1, 3, 13, 8), v (1, 3, 13, 5), block_size=5 (13 = 2 blocks + 3), float64",
             (randn(1, 3, 13, 8), randn(1, 3, 13, 8), randn(1, 3, 13, 5), 5)),
        Case("q, k, v (2, 10, 4) without a head axis, block_size=4 (10 = 2 blocks + 2), float64",
             (randn(2, 10, 4), randn(2, 10, 4), randn(2, 10, 4), 4)),
        Case("q, k, v (1, 1, 6, 4), block_size=8 (one block longer than the sequence), float64",
             (randn(1, 1, 6, 4), randn(1, 1, 6, 4), randn(1, 1, 6, 4), 8)),
        Case("q, k, v (1, 2, 7, 8), block_size=3, float32",
             (randn(1, 2, 7, 8, dtype=torch.float32), randn(1, 2, 7, 8, dtype=torch.float32),
              randn(1, 2, 7, 8, dtype=torch.float32), 3)),
    ]


_MULTIPLE, _NOT_MULTIPLE, _NO_HEADS, _LONG_BLOCK, _FLOAT32 = range(5)


def _block_expected(q, k, v, block_size):
    return sparse_attention(q, k, v, pattern="block", size=block_size)


def _pad_to_blocks(x, block_size):
    L = x.shape[-2]
    padded = math.ceil(L / block_size) * block_size
    return F.pad(x, (0, 0, 0, padded - L))  # (..., Lp, D), zero rows appended


def _blocks(x, block_size):
    return x.reshape(*x.shape[:-2], x.shape[-2] // block_size, block_size, x.shape[-1])  # (..., nb, b, D)


def _block_unmasked_padding(q, k, v, block_size, *, scale=None, dim=-1):
    """Pads to a multiple of the block but lets the zero keys take part (the classic bug)."""
    L = q.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    qb, kb, vb = (_blocks(_pad_to_blocks(x, block_size), block_size) for x in (q, k, v))  # (..., nb, b, D)
    scores = torch.matmul(qb, kb.transpose(-2, -1)) * scale  # (..., nb, b, b)
    out = torch.matmul(torch.softmax(scores, dim=dim), vb)  # (..., nb, b, Dv)
    return out.reshape(*q.shape[:-2], -1, v.shape[-1])[..., :L, :]  # (..., L, Dv)


def _block_over_queries(q, k, v, block_size):
    """Softmax over the queries of a block (dim=-2) instead of its keys."""
    L = q.shape[-2]
    mask = pattern_mask(L, pattern="block", size=block_size)  # (L, L)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (..., L, S)
    weights = stable_softmax(scores.masked_fill(~mask, float("-inf")), dim=-2)  # (..., L, S)
    return torch.matmul(weights, v)


def _block_interleaved(q, k, v, block_size):
    """Position i put in block i % nblocks: reshaped (b, nb) instead of (nb, b)."""
    L = q.shape[-2]
    nb = math.ceil(L / block_size)
    i = torch.arange(L)
    mask = (i[:, None] % nb) == (i[None, :] % nb)  # (L, L)
    return scaled_dot_product_attention(q, k, v, mask)


def _diagnose_block(got, q, k, v, block_size) -> str | None:
    return distinct_match(
        got,
        _block_expected(q, k, v, block_size),
        [
            (lambda: scaled_dot_product_attention(q, k, v),
             "your output equals full attention: each query may only attend to the keys of its own block "
             "(block i // block_size)."),
            (lambda: _block_unmasked_padding(q, k, v, block_size),
             "the zero rows you padded with took part as keys: a zero key scores 0, and exp(0) = 1 gives it weight. "
             "Mask the padded keys (-inf before the softmax) so the last, shorter block only sees real keys."),
            (lambda: sparse_attention(q, k, v, pattern="block", size=block_size, scale=1.0),
             "the scores are not scaled: multiply q @ k^T by 1 / sqrt(D)."),
            (lambda: _block_over_queries(q, k, v, block_size),
             "the softmax ran over the queries (dim=-2): each query's weights over its block's keys must sum to 1, "
             "softmax over dim=-1."),
            (lambda: _block_interleaved(q, k, v, block_size),
             "your blocks are interleaved: position i belongs to block i // block_size (reshape the length axis to "
             "(L // block_size, block_size), in that order), not i % num_blocks."),
        ],
    )


_BLOCK_ERROR_HINTS = (
    ("invalid for input of size",
     "a view into (L // block_size, block_size) blocks needs L to be a multiple of the block, the source article's "
     "bug. Pad q, k, v with zero rows up to a multiple (F.pad), mask the padded keys, and slice the output back to L."),
    ("not enough values to unpack",
     "do not assume a (B, H, L, D) layout: work on the last two axes, (..., L, D)."),
)


def _judge_block(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_BLOCK_ERROR_HINTS):
            q, _, v, _ = case.args
            hint = ""
            if got.dim() == q.dim() and got.shape[-2] > q.shape[-2]:
                hint = "You returned the padded length: slice the output back to the first L positions."
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name, hint=hint)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices, atol in (
        ("queries see only their own block (L a multiple of block_size)", (_MULTIPLE,), 1e-9),
        ("any length: a last, shorter block sees only real keys", (_NOT_MULTIPLE, _NO_HEADS), 1e-9),
        ("block_size >= L is full attention", (_LONG_BLOCK,), 1e-9),
        ("float32 inputs", (_FLOAT32,), 1e-5),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name, hints=_BLOCK_ERROR_HINTS)
                expected = _block_expected(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                hint = _diagnose_block(got, *case.args) or ""
                expect_close(got, expected, what=case.name, atol=atol, rtol=atol, hint=hint)
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_BLOCK_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _block_reference(q, k, v, block_size):
    return sparse_attention(q, k, v, pattern="block", size=block_size)


def _block_article(q, k, v, block_size):
    """The source article's forward: a view that needs L % block_size == 0."""
    batch, heads, seq_len, dim = q.shape
    q = q.view(batch, heads, seq_len // block_size, block_size, dim)
    k = k.view(batch, heads, seq_len // block_size, block_size, dim)
    v = v.view(batch, heads, seq_len // block_size, block_size, v.shape[-1])
    attn = torch.softmax(torch.einsum("bhlqd,bhlkd->bhlqk", q, k) / dim**0.5, dim=-1)
    return torch.einsum("bhlqk,bhlkd->bhlqd", attn, v).reshape(batch, heads, seq_len, -1)


def _block_padding_unmasked(q, k, v, block_size):
    return _block_unmasked_padding(q, k, v, block_size)


def _block_unscaled(q, k, v, block_size):
    return sparse_attention(q, k, v, pattern="block", size=block_size, scale=1.0)


def _block_softmax_queries(q, k, v, block_size):
    return _block_over_queries(q, k, v, block_size)


def _block_not_sliced(q, k, v, block_size):
    """Pads and masks the padded keys correctly, but returns the padded length."""
    L = q.shape[-2]
    padded = math.ceil(L / block_size) * block_size
    real = (torch.arange(padded) < L)[None, :]  # (1, Lp), True = real key
    return sparse_attention(*(_pad_to_blocks(x, block_size) for x in (q, k, v)), real, pattern="block", size=block_size)


def _block_full(q, k, v, block_size):
    return scaled_dot_product_attention(q, k, v)


def _block_in_place(q, k, v, block_size):
    q.mul_(1 / math.sqrt(q.shape[-1]))
    return sparse_attention(q, k, v, pattern="block", size=block_size, scale=1.0)


BLOCK_LOCAL_ATTENTION = Task(
    id="05.block_local_attention",
    title="Block-local attention for any length",
    function_name="block_local_attention",
    make_cases=_block_cases,
    judge=_judge_block,
    reference=_block_reference,
    wrong={
        "the article's view (L must be a multiple)": Wrong(_block_article, "Pad q, k, v"),
        "padded keys not masked": Wrong(_block_padding_unmasked, "padded with took part as keys"),
        "no 1/sqrt(D) scale": Wrong(_block_unscaled, "not scaled"),
        "softmax over the queries": Wrong(_block_softmax_queries, "softmax over dim=-1"),
        "interleaved blocks": Wrong(_block_interleaved, "i // block_size"),
        "padding not sliced off": Wrong(_block_not_sliced, "slice the output back"),
        "full attention": Wrong(_block_full, "equals full attention"),
        "scales q in place": Wrong(_block_in_place, "in place", kind="contract"),
    },
)
