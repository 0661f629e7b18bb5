"""Graded tasks for lesson 07 (chunked attention): merge two softmax chunks, attention with the online softmax.

* ``07.merge_partials``: the online-softmax step, rows with no key included.
* ``07.online_softmax_attention``: attention over key chunks, with masks and chunks in which a row
  has no allowed key; graded on its algorithm too: no intermediate may reach the size of the
  ``(..., L, S)`` score matrix (``measure=("largest",)``).
* ``07.causal_chunked_attention`` (stretch): causal attention over query and key chunks for queries
  that come after a cache of keys (the mask aligned bottom-right), never computing a block lying in
  the future, graded by the work it does (``measure=("flops",)``).

Calling the course's chunked attention (or its chunk statistics), its attention or PyTorch's fused
kernel gives a task zero (``forbidden``); the learner's own ``merge_partials`` (or the library's)
stays allowed in tasks 2 and 3.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .. import probes
from ...attention import scaled_dot_product_attention
from ...chunked import PartialAttention, finish_partial, merge_partials, partial_attention
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    expect_close,
    expect_dtype,
    expect_finite,
    expect_flops_at_most,
    expect_inputs_unchanged,
    expect_largest_below,
    expect_shape,
    expect_widest_below,
)
from ._common import answered, returned, same, seeded_randn
from ._variants import distinct_match

__all__ = ["MERGE_PARTIALS", "ONLINE_SOFTMAX_ATTENTION", "CAUSAL_CHUNKED_ATTENTION"]


# --- 07.merge_partials ---------------------------------------------------------------------
# The learner writes merge_partials(first, second) -> (acc, row_max, row_sum). Each argument
# is a tuple (acc (..., L, Dv), row_max (..., L, 1), row_sum (..., L, 1)) over a disjoint set
# of keys: acc = sum_j exp(s_j - m) v_j, row_max = m = max_j s_j (-inf if no key), row_sum =
# sum_j exp(s_j - m). The merged triple covers both sets of keys.


def _partial(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(partial_attention(scores, v))


def _merge_cases() -> list[Case]:
    randn = seeded_randn(707)

    # Case 0: two chunks of 5 and 3 keys; the second chunk's scores are larger for some rows.
    scores0 = torch.cat([randn(2, 2, 4, 5), randn(2, 2, 4, 3) + torch.tensor([3.0, -3.0, 0.0, 6.0])[:, None]], -1)
    v0 = randn(2, 2, 8, 3)
    # Case 1: logits x50 (a softmax of raw exp would overflow), 3D.
    scores1, v1 = 50 * randn(3, 6, 7), randn(3, 7, 4)
    # Case 2: some rows see no key in one chunk (max -inf), row 2 sees no key at all.
    scores2 = randn(1, 4, 6)
    blocked = torch.zeros(1, 4, 6, dtype=torch.bool)
    blocked[0, 0, :4] = True  # row 0: nothing in the first chunk
    blocked[0, 1, 4:] = True  # row 1: nothing in the second chunk
    blocked[0, 2, :] = True  # row 2: nothing at all
    scores2 = scores2.masked_fill(blocked, float("-inf"))
    v2 = randn(1, 6, 2)
    # Case 3: float32, (B, H) = (2, 2): rows 1 and 4 see no key in either chunk, row 0 none in the second.
    scores3 = randn(2, 2, 5, 7, dtype=torch.float32)
    blocked3 = torch.zeros(2, 2, 5, 7, dtype=torch.bool)
    blocked3[:, :, 1, :] = True
    blocked3[1, :, 4, :] = True
    blocked3[:, 0, 0, 3:] = True
    scores3 = scores3.masked_fill(blocked3, float("-inf"))
    v3 = randn(2, 2, 7, 3, dtype=torch.float32)
    cases = []
    for name, scores, v, split in (
        ("chunks of 5 and 3 keys, scores (2, 2, 4, 8), v (2, 2, 8, 3), float64", scores0, v0, 5),
        ("logits x50: scores (3, 6, 7) split 4 + 3, v (3, 7, 4), float64", scores1, v1, 4),
        ("rows with no key in one chunk (row_max -inf) and row 2 with no key at all, float64", scores2, v2, 4),
        ("float32 (2, 2, 5, 7) split 3 + 4: row 1 (and row 4 of the second sequence) with no key in either chunk",
         scores3, v3, 3),
    ):
        first = _partial(scores[..., :split], v[..., :split, :])
        second = _partial(scores[..., split:], v[..., split:, :])
        cases.append(Case(name, (first, second)))
    return cases


_TWO_CHUNKS, _LARGE, _EMPTY, _EMPTY_FLOAT32 = range(4)


def _merge_written_out(first, second):
    """The online-softmax step written out (the library's merge_partials is forbidden to the learner)."""
    (acc1, max1, sum1), (acc2, max2, sum2) = first, second
    new_max = torch.maximum(max1, max2)  # (..., L, 1)
    safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # 0 where no key at all
    scale1, scale2 = torch.exp(max1 - safe), torch.exp(max2 - safe)  # (..., L, 1), in [0, 1]
    return acc1 * scale1 + acc2 * scale2, new_max, sum1 * scale1 + sum2 * scale2


def _ground_truth(case: Case) -> torch.Tensor:
    """Dense attention over both chunks' keys, from the pieces (acc / row_sum of the library's merge)."""
    return finish_partial(merge_partials(PartialAttention(*case.args[0]), PartialAttention(*case.args[1])))


def _merge_naive_sum(first, second):
    return first[0] + second[0], torch.maximum(first[1], second[1]), first[2] + second[2]


def _merge_inverted(first, second):
    new_max = torch.maximum(first[1], second[1])
    safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
    s1, s2 = torch.exp(safe - first[1]), torch.exp(safe - second[1])
    s1, s2 = torch.nan_to_num(s1, posinf=0.0), torch.nan_to_num(s2, posinf=0.0)
    return first[0] * s1 + second[0] * s2, new_max, first[2] * s1 + second[2] * s2


def _merge_keeps_first_max(first, second):
    acc, _, row_sum = _merge_written_out(first, second)
    return acc, first[1], row_sum


def _merge_nan_on_empty(first, second):
    new_max = torch.maximum(first[1], second[1])
    s1, s2 = torch.exp(first[1] - new_max), torch.exp(second[1] - new_max)
    return first[0] * s1 + second[0] * s2, new_max, first[2] * s1 + second[2] * s2


def _merge_sum_not_rescaled(first, second):
    acc, row_max, _ = _merge_written_out(first, second)
    return acc, row_max, first[2] + second[2]


def _merge_normalised(first, second):
    acc, row_max, row_sum = _merge_written_out(first, second)
    return acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum), row_max, row_sum


def _merge_averaged(first, second):
    acc, row_max, row_sum = _merge_written_out(first, second)
    return acc / 2, row_max, row_sum / 2


def _merge_library(first, second):
    return tuple(merge_partials(PartialAttention(*first), PartialAttention(*second)))


def _diagnose_merge_acc(got_acc, first, second) -> str | None:
    expected = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return distinct_match(
        got_acc,
        expected.acc,
        [
            (lambda: first[0] + second[0],
             "you added the two acc tensors as they are. Each is relative to its own max: both must be rescaled to "
             "the common max before they are added."),
            (lambda: _merge_inverted(first, second)[0],
             "your rescaling factor is upside down: it is exp(m_i - m), the old max minus the new one, which is <= 1."),
            (lambda: finish_partial(expected),
             "you returned acc / row_sum, the finished output. Keep acc unnormalised so more chunks can be merged; "
             "divide only at the very end."),
            (lambda: expected.acc / 2,
             "you averaged the two chunks. The merged acc is a sum over all keys: add the rescaled parts, do not "
             "divide by 2."),
        ],
    )


def _judge_merge(cases, outcomes):
    checklist = Checklist()

    def parts(index):
        case, outcome = cases[index], outcomes[index]
        acc = returned(outcome, what=case.name, index=0)
        row_max = returned(outcome, what=case.name, index=1)
        row_sum = returned(outcome, what=case.name, index=2)
        return case, acc, row_max, row_sum

    def ran() -> list[int]:
        """Every case: `parts(i)` fails the check for a case that raised (a failed case, not a skipped one)."""
        return list(range(len(outcomes)))

    with checklist.check("returns (acc, row_max, row_sum) with the inputs' shapes"):
        for index in ran():
            case, acc, row_max, row_sum = parts(index)
            first = case.args[0]
            for got, want, label in ((acc, first[0], "acc"), (row_max, first[1], "row_max"), (row_sum, first[2], "row_sum")):
                expect_shape(got, want.shape, what=f"{case.name}: {label}")
                expect_dtype(got, want.dtype, what=f"{case.name}: {label}")
    with checklist.check("row_max is the larger of the two maxima"):
        for index in (_TWO_CHUNKS, _EMPTY):
            case, _, row_max, _ = parts(index)
            expected = torch.maximum(case.args[0][1], case.args[1][1])
            expect_shape(row_max, expected.shape, what=f"{case.name}: row_max")
            if not torch.equal(row_max, expected):
                raise Fail(f"{case.name}: row_max should be max(m1, m2) per row, so later chunks are "
                           "rescaled against the largest score seen so far.")
    for title, index in (("acc and row_sum rescaled to the common max", _TWO_CHUNKS),
                         ("logits x50: no overflow", _LARGE)):
        with checklist.check(title):
            case, acc, _, row_sum = parts(index)
            first, second = case.args
            expected = merge_partials(PartialAttention(*first), PartialAttention(*second))
            expect_finite(acc, what=f"{case.name}: acc")
            expect_close(acc, expected.acc, what=f"{case.name}: acc", atol=1e-9, rtol=1e-7,
                         hint=lambda: _diagnose_merge_acc(acc, first, second) or "")
            hint = ""
            if torch.allclose(row_sum.double(), (first[2] + second[2]).double()):
                hint = "row_sum must be rescaled with the same factors as acc: l = l1 * exp(m1 - m) + l2 * exp(m2 - m)."
            elif torch.allclose(row_sum.double(), expected.row_sum.double() / 2):
                hint = "you averaged the two row sums: add the rescaled parts."
            expect_close(row_sum, expected.row_sum, what=f"{case.name}: row_sum", atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("acc / row_sum equals softmax attention over both chunks"):
        case, acc, _, row_sum = parts(_TWO_CHUNKS)
        out = acc / row_sum
        expect_shape(out, _ground_truth(case).shape, what=case.name)
        expect_close(out, _ground_truth(case), what=f"{case.name}: acc / row_sum", atol=1e-9, rtol=1e-7)
    with checklist.check("rows with no key in a chunk (max -inf) give no NaN: acc and row_sum 0"):
        for index in (_EMPTY, _EMPTY_FLOAT32):
            case, acc, row_max, row_sum = parts(index)
            if torch.isnan(acc).any() or torch.isnan(row_sum).any():
                raise Fail(
                    f"{case.name}: NaN in a row with no key at all. Both maxima are -inf there, and exp(-inf - (-inf)) "
                    "= exp(nan). Use a safe max of 0 where the merged max is -inf: the factors become exp(-inf) = 0."
                )
            expected = merge_partials(PartialAttention(*case.args[0]), PartialAttention(*case.args[1]))
            tolerance = 1e-9 if acc.dtype == torch.float64 else 1e-5
            expect_close(acc, expected.acc, what=f"{case.name}: acc", atol=tolerance, rtol=tolerance * 100)
            expect_close(row_sum, expected.row_sum, what=f"{case.name}: row_sum", atol=tolerance, rtol=tolerance * 100)
    with checklist.check("leaves both partials unchanged"):
        for index in ran():
            parts(index)  # a case that raised is a failed case here too
            case, outcome = cases[index], outcomes[index]
            for before, after in zip(case.args, outcome.args_after):
                if not all(torch.equal(b, a) for b, a in zip(before, after)):
                    raise Fail(f"{case.name}: your function changed an input tensor in place (e.g. acc *= ...). "
                               "Build new tensors: the caller may still need the partials.")
    return checklist.results


def _merge_reference(first, second):
    return _merge_written_out(first, second)


def _merge_in_place(first, second):
    acc, row_max, row_sum = _merge_written_out(first, second)
    first[0].copy_(acc)
    return acc.clone(), row_max, row_sum


MERGE_PARTIALS = Task(
    id="07.merge_partials",
    title="Merge two softmax chunks (the online-softmax step)",
    function_name="merge_partials",
    make_cases=_merge_cases,
    judge=_judge_merge,
    reference=_merge_reference,
    wrong={
        "adds without rescaling": Wrong(_merge_naive_sum, "relative to its own max"),
        "inverted rescaling factor": Wrong(_merge_inverted, "upside down"),
        "keeps the first chunk's max": Wrong(_merge_keeps_first_max, "max(m1, m2)"),
        "NaN when both maxima are -inf": Wrong(_merge_nan_on_empty, "exp(nan)"),
        "row_sum not rescaled": Wrong(_merge_sum_not_rescaled, "same factors as acc"),
        "returns the normalised output": Wrong(_merge_normalised, "Keep acc unnormalised"),
        "averages the chunks": Wrong(_merge_averaged, "do not divide by 2"),
        "writes into the first partial": Wrong(_merge_in_place, "in place", kind="contract"),
        "calls attn_course.merge_partials": Wrong(_merge_library, "you called attn_course.merge_partials",
                                                  kind="algorithm"),
    },
    forbidden=("attn_course.chunked.merge_partials",),
)


# --- 07.online_softmax_attention -----------------------------------------------------------
# The learner writes online_softmax_attention(q, k, v, chunk_size, mask=None) -> (..., L, Dv):
# exact attention that walks over the keys chunk_size at a time, keeping a running max, a
# running sum and a running (unnormalised) output per query; scale 1 / sqrt(D). mask: None or
# bool broadcastable to the scores (..., L, S) with S entries on its last axis, True = may
# attend; a chunk with no allowed key for a row must not produce NaN, and a row with no allowed
# key at all gives zeros. The algorithm's point is memory: the grader measures that no
# intermediate reaches the size of the (..., L, S) score matrix.

_NOT_ONLINE = (
    "attn_course.chunked.chunked_attention",
    "attn_course.chunked.query_chunked_attention",
    "attn_course.chunked.partial_attention",
    "attn_course.chunked.finish_partial",
    "attn_course.attention.scaled_dot_product_attention",
    *probes.TORCH_ATTENTION,
)


def _online_cases() -> list[Case]:
    randn = seeded_randn(717)

    # A mask with a chunk of 4 keys that row 0 cannot see at all (keys 0..3), a middle chunk that row 2
    # cannot see (keys 4..7), and row 3 of the first sequence that may attend to nothing.
    masked = torch.rand(2, 1, 6, 12, generator=torch.Generator().manual_seed(7)) < 0.7  # (B, 1, L, S)
    masked[:, :, :, 8] = True  # every row but the blocked ones keeps a key
    masked[:, :, 0, :4] = False
    masked[:, :, 2, 4:8] = False
    masked[0, :, 3, :] = False
    # Padding: the last 4 keys of the second sequence (a whole last chunk of 4), and query 1 of the first
    # sequence blocked everywhere.
    padded = torch.ones(2, 1, 5, 14, dtype=torch.bool)  # (B, 1, L, S)
    padded[1, ..., 10:] = False
    padded[0, :, 1, :] = False
    long_padding = torch.ones(2, 1, 1, 48, dtype=torch.bool)  # (B, 1, 1, S): a key-padding mask
    long_padding[1, ..., 41:] = False
    large_padding = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    large_padding[0, ..., 9:] = False
    return [
        Case("q (2, 2, 10, 8), k (2, 2, 12, 8), v (2, 2, 12, 6), chunk_size=4 (S a multiple), float64",
             (randn(2, 2, 10, 8), randn(2, 2, 12, 8), randn(2, 2, 12, 6), 4)),
        Case("q (2, 3, 5, 8), k (2, 3, 13, 8), v (2, 3, 13, 6), chunk_size=5 (13 = 2 chunks + 3), float64",
             (randn(2, 3, 5, 8), randn(2, 3, 13, 8), randn(2, 3, 13, 6), 5)),
        Case("q (2, 6, 4), k, v (2, 7, 4) without a head axis, chunk_size=1, float64",
             (randn(2, 6, 4), randn(2, 7, 4), randn(2, 7, 4), 1)),
        Case("q (2, 2, 6, 4), k, v (2, 2, 5, 4), chunk_size=16 (one chunk), float64",
             (randn(2, 2, 6, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4), 16)),
        Case("logits x50 in float32: q = 50 * randn (2, 2, 9, 8), key j scaled by j + 1, v (2, 2, 9, 8), chunk_size=3",
             (50 * randn(2, 2, 9, 8, dtype=torch.float32),
              randn(2, 2, 9, 8, dtype=torch.float32) * torch.arange(1.0, 10.0)[:, None],  # later keys score higher
              randn(2, 2, 9, 8, dtype=torch.float32), 3)),
        Case("mask (2, 1, 6, 12): row 0 sees nothing in keys 0..3, row 2 nothing in keys 4..7, row 3 of sequence 0 "
             "nothing at all; q (2, 2, 6, 8), k, v (2, 2, 12, 8), chunk_size=4, float64",
             (randn(2, 2, 6, 8), randn(2, 2, 12, 8), randn(2, 2, 12, 8), 4, masked)),
        Case("padding mask (2, 1, 5, 14): the last chunk of sequence 1 is all padding, query 1 of sequence 0 sees "
             "nothing; q (2, 3, 5, 8), k, v (2, 3, 14, 8), chunk_size=5 (5 + 5 + 4), float64",
             (randn(2, 3, 5, 8), randn(2, 3, 14, 8), randn(2, 3, 14, 8), 5, padded)),
        Case("long: q (2, 2, 40, 8), k (2, 2, 48, 8), v (2, 2, 48, 6), chunk_size=8, float64",
             (randn(2, 2, 40, 8), randn(2, 2, 48, 8), randn(2, 2, 48, 6), 8)),
        Case("long, key padding (2, 1, 1, 48): q (2, 2, 40, 8), k (2, 2, 48, 8), v (2, 2, 48, 6), chunk_size=12, "
             "float64",
             (randn(2, 2, 40, 8), randn(2, 2, 48, 8), randn(2, 2, 48, 6), 12, long_padding)),
        Case("logits x50 in float32 with key padding (2, 1, 1, 11): q = 50 * randn (2, 2, 7, 8), key j scaled by "
             "j + 1, v (2, 2, 11, 8), chunk_size=4",
             (50 * randn(2, 2, 7, 8, dtype=torch.float32),
              randn(2, 2, 11, 8, dtype=torch.float32) * torch.arange(1.0, 12.0)[:, None],
              randn(2, 2, 11, 8, dtype=torch.float32), 4, large_padding)),
    ]


(_ONLINE_MULTIPLE, _ONLINE_RAGGED, _ONLINE_ONE, _ONLINE_BIG_CHUNK, _ONLINE_LARGE, _ONLINE_MASKED, _ONLINE_PADDED,
 _ONLINE_LONG, _ONLINE_LONG_PADDED, _ONLINE_LARGE_PADDED) = range(10)


def _args(case: Case) -> tuple:
    """``(q, k, v, chunk_size, mask)`` of a case, mask None when it has none."""
    q, k, v, chunk_size, *rest = case.args
    return q, k, v, chunk_size, (rest[0] if rest else None)


def _expected_online(q, k, v, mask) -> torch.Tensor:
    """Dense attention in float64 (zeros for rows with no allowed key), cast to q's dtype's precision by the caller."""
    return scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)


def _chunk_statistics(scores, values, *, guard=True):
    """(acc, row_max, row_sum) of one chunk of scores (..., L, c); guard: shift rows with no allowed key by 0."""
    row_max = scores.amax(dim=-1, keepdim=True)  # (..., L, 1)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)) if guard else row_max
    weights = torch.exp(scores - shift)  # (..., L, c)
    return weights @ values, row_max, weights.sum(dim=-1, keepdim=True)


def _online_variant(q, k, v, chunk_size, mask=None, *, rescale=True, subtract_max=True, update_max=True,
                    skip_last=False, scale=None, average=False, guard=True, guard_empty_rows=True, flip_mask=False,
                    ignore_mask=False):
    """The online softmax, written out (no library call), with one classic mistake switched on."""
    S = k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    stop = S - S % chunk_size if skip_last and S % chunk_size else S
    m = l = acc = None
    outputs = []
    for k0 in range(0, stop, chunk_size):
        scores = (q @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1)) * scale  # (..., L, c)
        if mask is not None and not ignore_mask:
            allowed = mask[..., k0:k0 + chunk_size]  # (..., L or 1, c)
            scores = scores.masked_fill(allowed if flip_mask else ~allowed, float("-inf"))
        chunk_v = v[..., k0:k0 + chunk_size, :]  # (..., c, Dv)
        if average:
            outputs.append(torch.softmax(scores, dim=-1) @ chunk_v)
            continue
        if not subtract_max:
            chunk_max = torch.zeros_like(scores[..., :1])
        else:
            chunk_max = scores.amax(-1, keepdim=True)  # (..., L, 1)
        if m is None:
            m = chunk_max
            shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m)) if guard else m
            p = torch.exp(scores - shift)
            l, acc = p.sum(-1, keepdim=True), p @ chunk_v
            continue
        new_m = torch.maximum(m, chunk_max) if update_max else m
        shift = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m)) if guard else new_m
        p = torch.exp(scores - shift)
        factor = torch.exp(m - shift) if rescale else torch.ones_like(m)
        l = l * factor + p.sum(-1, keepdim=True)
        acc = acc * factor + p @ chunk_v
        m = new_m
    if average:
        return torch.stack(outputs).mean(0)
    if guard_empty_rows:
        return acc / torch.where(l == 0, torch.ones_like(l), l)
    return acc / l


def _diagnose_online(got, q, k, v, chunk_size, mask=None) -> str | None:
    return distinct_match(
        got,
        _expected_online(q, k, v, mask).to(got.dtype),
        [
            (lambda: _online_variant(q, k, v, chunk_size, mask, rescale=False),
             "when the running max rises from m to m', the old sum and acc were computed with exp(s - m): multiply "
             "them by exp(m - m') before adding the new chunk."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, subtract_max=False),
             "exp of a raw score of a few hundred overflows float32 (max about 3.4e38, exp(89) already): subtract the "
             "running max before exp."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, update_max=False),
             "you subtract the first chunk's max only: a later chunk with larger scores still overflows exp. The "
             "running max must keep rising with every chunk (and the old sums be rescaled when it does)."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, average=True),
             "you averaged per-chunk softmax outputs. That weighs every chunk equally, whatever its scores: keep "
             "running sums instead and divide once at the end."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, skip_last=True),
             "your loop skips the last, shorter chunk of keys: every key counts, also when S is not a multiple of "
             "the chunk."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, scale=1.0),
             "the scores are not scaled: attention scales q @ k^T by 1 / sqrt(D)."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, flip_mask=True),
             "your mask is flipped: True means may attend, so the blocked scores are where the mask is False."),
            (lambda: _online_variant(q, k, v, chunk_size, mask, ignore_mask=True),
             "your output ignores the mask: blocked keys must get no weight, in every chunk."),
        ],
    )


def _close(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Whether ``expect_close`` would pass (same shape, finite where expected is, within the tolerance)."""
    if got.shape != expected.shape:
        return False
    return bool(torch.allclose(got.detach().double(), expected.detach().double(), atol=tolerance, rtol=tolerance))


_EMPTY_CHUNK_HINT = (
    "a chunk where a row may attend to no key has max = -inf, and exp(-inf - (-inf)) = exp(nan): such rows must be "
    "shifted by a finite number instead (0 will do), so that their exp terms are exp(-inf) = 0."
)
_EMPTY_ROW_HINT = (
    "a row with no allowed key at all ends with row_sum = 0, and acc / 0 is NaN: such a row's output is zeros, so "
    "its division must not be by 0."
)


def _nan_story(got, case, cases, outcomes) -> str | None:
    """Why the output has NaN on a masked case, told from where the NaN are and which variant they match.

    On some cases the two NaN bugs give the same output (no chunk is empty for a row that has keys), so
    a variant's story is told only when the answers on every masked case match it.
    """
    q, k, v, chunk_size, mask = _args(case)

    def fits(**mistake) -> bool:
        for other, outcome in zip(cases, outcomes):
            oq, ok, ov, oc, omask = _args(other)
            if omask is None or outcome.error is not None or not isinstance(outcome.returned, torch.Tensor):
                continue
            if not same(outcome.returned, _online_variant(oq, ok, ov, oc, omask, **mistake)):
                return False
        return True

    nan_rows = torch.isnan(got).any(dim=-1)  # (B, H, L)
    if not nan_rows.any():
        return None
    empty_rows = ~mask.any(dim=-1)  # (B, 1, L): rows with no allowed key at all
    where = "a row that has allowed keys" if (nan_rows & ~empty_rows).any() else "a row with no allowed key"
    if fits(guard=False):
        return f"NaN in {where}: {_EMPTY_CHUNK_HINT}"
    if (nan_rows & ~empty_rows).any():
        return "NaN in a row that has allowed keys: a chunk, or a row, with no allowed key must add nothing."
    if fits(guard_empty_rows=False):
        return f"NaN in a row with no allowed key: {_EMPTY_ROW_HINT}"
    return "NaN in a row with no allowed key: the course's convention gives such a row zeros."


def _online_width_story(outcome, q, k, chunk_size) -> str:
    """Why an op spanned all S keys, told from the shape it read (a chunk of queries, one (batch, head) slice)."""
    L, S = q.shape[-2], k.shape[-2]
    rule = (f"the online softmax reads the keys {chunk_size} at a time, so no softmax, max, sum or product in it ever "
            f"spans all S = {S} keys of a row: it walks over the keys, keeping a running max, sum and output per query.")
    shape = outcome.probe.get("widest_shape") if isinstance(outcome.probe, dict) else None
    try:
        dims = tuple(int(n) for n in shape.split(" x ")) if isinstance(shape, str) else ()
    except ValueError:
        dims = ()
    if len(dims) >= 2 and dims[-1] == S and dims[-2] < L:
        return (f"you take a full softmax over S for chunks of {dims[-2]} queries. Chunking the queries (the source "
                f"article's MemoryEfficientAttention) still reads every key of a row at once: {rule}")
    if len(dims) == 2 and dims == (L, S) and q.dim() > 2:
        return (f"your (L, S) = ({L}, {S}) softmax is one (batch, head) slice's: looping over (batch, head) slices "
                f"still reads every key of a row at once: {rule}")
    return rule


def _judge_online(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v, _, _ = _args(case)
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices, tolerance in (
        ("equals softmax attention (S a multiple of the chunk, L != S)", (_ONLINE_MULTIPLE, _ONLINE_LONG), 1e-9),
        ("any S: a last, shorter chunk counts too", (_ONLINE_RAGGED, _ONLINE_PADDED), 1e-9),
        ("chunk_size = 1 and chunk_size >= S", (_ONLINE_ONE, _ONLINE_BIG_CHUNK), 1e-9),
        ("logits x50: finite and accurate (subtract the running max)", (_ONLINE_LARGE, _ONLINE_LARGE_PADDED), 1e-4),
        ("blocked keys get no weight (masks, key padding)", (_ONLINE_MASKED, _ONLINE_PADDED, _ONLINE_LONG_PADDED), 1e-9),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name)
                q, k, v, chunk_size, mask = _args(case)
                expected = _expected_online(q, k, v, mask).to(got.dtype)
                expect_shape(got, expected.shape, what=case.name)
                if _close(got, expected, tolerance):
                    continue
                hint = _diagnose_online(got, q, k, v, chunk_size, mask) or ""  # only for a wrong answer: it is slow
                if tolerance > 1e-9:
                    expect_finite(got, what=case.name, hint=hint or (_nan_story(got, case, cases, outcomes) if mask is not None else ""))
                elif torch.isnan(got).any() and mask is not None:
                    raise Fail(f"{case.name}: {_nan_story(got, case, cases, outcomes)}")
                expect_close(got, expected, what=case.name, atol=tolerance, rtol=tolerance, hint=hint)
    with checklist.check("a chunk with no allowed key adds nothing; a row with no allowed key at all gives zeros"):
        for index in (_ONLINE_MASKED, _ONLINE_PADDED):
            case = cases[index]
            got = returned(outcomes[index], what=case.name)
            q, k, v, chunk_size, mask = _args(case)
            expected = _expected_online(q, k, v, mask)
            expect_shape(got, expected.shape, what=case.name)
            story = _nan_story(got, case, cases, outcomes)
            if story:
                raise Fail(f"{case.name}: {story}")
            if not _close(got, expected, 1e-9):
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-9,
                             hint=lambda: _diagnose_online(got, q, k, v, chunk_size, mask) or "")
    with checklist.check("never forms an (L, S) matrix: every intermediate stays below one (..., L, S) score matrix"):
        for index in (_ONLINE_LONG, _ONLINE_LONG_PADDED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, k, _, chunk_size, _ = _args(case)
            L, S = q.shape[-2], k.shape[-2]
            scores = q[..., 0, 0].numel() * L * S  # elements of the (..., L, S) score matrix
            expect_largest_below(
                outcome, scores, what=case.name,
                constraint=f"the online softmax never holds all the scores at once: it reads the keys {chunk_size} "
                f"at a time, so its largest intermediate is one (..., L, chunk_size) = (..., {L}, {chunk_size}) "
                f"block, not the (..., L, S) = (..., {L}, {S}) matrix. Compute each chunk's scores, its (acc, "
                "row_max, row_sum), merge, and move on.",
            )
    with checklist.check("never looks at all S keys of a row at once: no softmax, sum or product over S, "
                         "not even one (batch, head) slice or one chunk of queries at a time"):
        for index in (_ONLINE_LONG, _ONLINE_LONG_PADDED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, k, _, chunk_size, _ = _args(case)
            expect_widest_below(
                outcome, k.shape[-2], what=case.name,
                constraint=_online_width_story(outcome, q, k, chunk_size),
            )
    with checklist.check("leaves q, k, v and the mask unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _online_reference(q, k, v, chunk_size, mask=None):
    """The online softmax written out (the library's chunked_attention is forbidden to the learner)."""
    scale = 1 / math.sqrt(q.shape[-1])
    running = None
    for k0 in range(0, k.shape[-2], chunk_size):
        scores = (q @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1)) * scale  # (..., L, c)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., k0:k0 + chunk_size], float("-inf"))
        chunk = _chunk_statistics(scores, v[..., k0:k0 + chunk_size, :])
        running = chunk if running is None else _merge_written_out(running, chunk)
    acc, _, row_sum = running
    return acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)  # (..., L, Dv), zeros for empty rows


def _online_log_sum_exp(q, k, v, chunk_size, mask=None):
    """Correct too: a running log-sum-exp and a *normalised* running output, rescaled at every chunk."""
    scale = q.shape[-1] ** -0.5
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)  # (..., L, 1)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # (..., L, Dv)
    for k0 in range(0, k.shape[-2], chunk_size):
        scores = q @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1) * scale  # (..., L, c)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., k0:k0 + chunk_size], float("-inf"))
        chunk_lse = torch.logsumexp(scores, -1, keepdim=True)  # -inf where the chunk allows no key
        new_lse = torch.logaddexp(lse, chunk_lse)
        safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
        weights = torch.exp(scores - safe)  # (..., L, c): this chunk's share of the final softmax
        out = out * torch.exp(lse - safe) + weights @ v[..., k0:k0 + chunk_size, :]
        lse = new_lse
    return out


def _online_no_rescale(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, rescale=False)


def _online_averaged(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, average=True)


def _online_raw_exp(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, subtract_max=False)


def _online_skip_last(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, skip_last=True)


def _online_unscaled(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, scale=1.0)


def _online_first_max_only(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, update_max=False)


def _online_nan_on_empty_chunk(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, guard=False)


def _online_nan_on_empty_row(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, guard_empty_rows=False)


def _online_mask_flipped(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, flip_mask=True)


def _online_mask_ignored(q, k, v, chunk_size, mask=None):
    return _online_variant(q, k, v, chunk_size, mask, ignore_mask=True)


def _online_dense(q, k, v, chunk_size, mask=None):
    """Right values, wrong algorithm: the softmax of the whole (..., L, S) score matrix."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num() @ v


def _online_query_chunks(q, k, v, chunk_size, mask=None):
    """Right values, the algorithm lesson 07 replaces: chunks of queries, each a full softmax over all S keys."""
    scale = 1 / math.sqrt(q.shape[-1])
    outputs = []
    for q0 in range(0, q.shape[-2], chunk_size):
        scores = q[..., q0:q0 + chunk_size, :] @ k.transpose(-2, -1) * scale  # (..., c, S): every key at once
        if mask is not None:
            rows = mask[..., q0:q0 + chunk_size, :] if mask.shape[-2] > 1 else mask  # (..., c or 1, S)
            scores = scores.masked_fill(~rows, float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1).nan_to_num() @ v)  # (..., c, Dv)
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _online_dense_per_slice(q, k, v, chunk_size, mask=None):
    """Right values, dense attention one (batch, head) slice at a time: no (..., L, S) tensor, still (L, S) per slice."""
    L, S = q.shape[-2], k.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # (..., L, Dv)
    for index in itertools.product(*(range(n) for n in q.shape[:-2])):  # one (batch, head) slice at a time
        scores = q[index] @ k[index].T / math.sqrt(q.shape[-1])  # (L, S): one slice's whole score matrix
        if mask is not None:
            scores = scores.masked_fill(~mask.expand(*q.shape[:-2], *mask.shape[-2:])[index], float("-inf"))
        out[index] = torch.softmax(scores, dim=-1).nan_to_num() @ v[index]  # (L, Dv)
    return out


def _online_einsum_lists(q, k, v, chunk_size, mask=None):
    """Correct: einsum for every product, the running statistics kept as Python lists of per-chunk pieces."""
    scale = q.shape[-1] ** -0.5
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)  # (..., L, 1)
    l = torch.zeros_like(m)  # (..., L, 1)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # (..., L, Dv)
    for k0 in range(0, k.shape[-2], chunk_size):
        scores = torch.einsum("...ld,...sd->...ls", q, k[..., k0:k0 + chunk_size, :]) * scale  # (..., L, c)
        if mask is not None:
            scores = torch.where(mask[..., k0:k0 + chunk_size], scores, float("-inf"))
        new_m = torch.maximum(m, scores.amax(-1, keepdim=True))
        shift = torch.where(new_m == float("-inf"), 0.0, new_m)  # rows with no key yet: shift by 0
        p = torch.exp(scores - shift)  # (..., L, c)
        factor = torch.exp(m - shift)
        acc = acc * factor + torch.einsum("...ls,...sd->...ld", p, v[..., k0:k0 + chunk_size, :])
        l, m = l * factor + p.sum(-1, keepdim=True), new_m
    return acc / l.clamp_min(torch.finfo(l.dtype).tiny) * (l > 0)


def _online_unfold(q, k, v, chunk_size, mask=None):
    """Correct: the keys padded to a multiple of the chunk and cut with unfold; padded keys masked."""
    S = k.shape[-2]
    pad = (-S) % chunk_size
    keep = torch.ones(S + pad, dtype=torch.bool)
    keep[S:] = False  # (S_padded,): the padding is not a key
    if mask is not None:
        keep = keep & F.pad(mask, (0, pad), value=False)  # (..., L or 1, S_padded)
    k_chunks = F.pad(k, (0, 0, 0, pad)).unfold(-2, chunk_size, chunk_size)  # (..., n, D, c)
    v_chunks = F.pad(v, (0, 0, 0, pad)).unfold(-2, chunk_size, chunk_size)  # (..., n, Dv, c)
    keep_chunks = keep.unfold(-1, chunk_size, chunk_size)  # (..., n, c)
    scale = q.shape[-1] ** -0.5
    running = None
    for n in range(k_chunks.shape[-3]):
        scores = q @ k_chunks[..., n, :, :] * scale  # (..., L, c)
        scores = scores.masked_fill(~keep_chunks[..., n, :], float("-inf"))
        chunk = _chunk_statistics(scores, v_chunks[..., n, :, :].transpose(-2, -1))
        running = chunk if running is None else _merge_written_out(running, chunk)
    acc, _, row_sum = running
    return acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)


def _online_library(q, k, v, chunk_size, mask=None):
    from ...chunked import chunked_attention

    return chunked_attention(q, k, v, mask, query_chunk_size=q.shape[-2], key_chunk_size=chunk_size)


def _online_torch(q, k, v, chunk_size, mask=None):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _online_masked_in_place(q, k, v, chunk_size, mask=None):
    """Right values, but it scales q in place: the caller's queries change."""
    q.mul_(1 / math.sqrt(q.shape[-1]))
    return _online_variant(q, k, v, chunk_size, mask, scale=1.0)


ONLINE_SOFTMAX_ATTENTION = Task(
    id="07.online_softmax_attention",
    title="Attention over key chunks with the online softmax",
    function_name="online_softmax_attention",
    make_cases=_online_cases,
    judge=_judge_online,
    reference=_online_reference,
    wrong={
        "old sum and acc not rescaled": Wrong(_online_no_rescale, "multiply them by exp(m - m')"),
        "averages per-chunk softmaxes": Wrong(_online_averaged, "weighs every chunk equally"),
        "no max subtracted": Wrong(_online_raw_exp, "a raw score of a few hundred overflows float32"),
        "last chunk skipped": Wrong(_online_skip_last, "skips the last, shorter chunk"),
        "no 1/sqrt(D) scale": Wrong(_online_unscaled, "not scaled"),
        "running max never updated": Wrong(_online_first_max_only, "subtract the first chunk's max only"),
        "NaN on a chunk with no allowed key": Wrong(_online_nan_on_empty_chunk, "exp(-inf - (-inf)) = exp(nan)"),
        "NaN on a row with no allowed key": Wrong(_online_nan_on_empty_row, "acc / 0 is NaN"),
        "mask flipped": Wrong(_online_mask_flipped, "mask is flipped"),
        "mask ignored": Wrong(_online_mask_ignored, "ignores the mask"),
        "softmax of the whole score matrix": Wrong(_online_dense, "never holds all the scores at once",
                                                   kind="algorithm"),
        "chunks of queries, each a full softmax over every key (the article's MemoryEfficientAttention)": Wrong(
            _online_query_chunks, "Chunking the queries", kind="algorithm"),
        "dense attention one (batch, head) slice at a time": Wrong(
            _online_dense_per_slice, "looping over (batch, head) slices", kind="algorithm"),
        "calls attn_course.chunked_attention": Wrong(_online_library, "you called attn_course.chunked_attention",
                                                     kind="algorithm"),
        "calls F.scaled_dot_product_attention": Wrong(_online_torch, "you called", kind="algorithm"),
        "scales q in place": Wrong(_online_masked_in_place, "in place", kind="contract"),
    },
    accepted={"running log-sum-exp with a normalised output": _online_log_sum_exp,
              "einsum and torch.where, statistics updated in a loop": _online_einsum_lists,
              "keys cut into chunks with unfold (padded, the padding masked)": _online_unfold},
    measure=("largest", "widest"),
    forbidden=_NOT_ONLINE,
)


# --- 07.causal_chunked_attention (stretch) --------------------------------------------------
# The learner writes causal_chunked_attention(q, k, v, chunk_size) -> (..., L, Dv): causal attention
# for L queries that are the LAST L of S >= L positions (chunked prefill after a KV cache of S - L
# keys), so the mask is aligned bottom-right: query i sees keys 0..i + S - L, as
# torch.ones(L, S).tril(diagonal=S - L) or PyTorch's CausalBias lower-right. The lesson's
# chunked_attention (and the backward pass it prints) skips blocks for the top-left mask of
# is_causal=True; this variant moves the diagonal, and when S - L is not a multiple of the chunk a
# block that must be computed holds rows with no allowed key (the empty-chunk guard of task 2).
# Query and key chunks are merged with the online softmax, never computing a block that lies
# entirely in the future. The grader counts the work (the probe's FLOP count, matrix products
# exactly) on two long cases. Every case has S >= L, as the task states.

# Work allowed, in multiples of the intended algorithm's count (_causal_intended_flops: the matrix
# products of the blocks that hold an allowed key plus 8 passes over each block). Measured on the two
# long cases (tests/test_grading_lesson07.py): the reference 1.13x on both, the accepted
# query-at-once form 0.96x and 0.88x; computing every block with the future masked 2.01x and 1.78x,
# the dense causal softmax 1.70x and 1.50x.
_CAUSAL_FLOP_FACTOR = 1.35


def _causal_cases() -> list[Case]:
    randn = seeded_randn(727)
    return [
        Case("q, k, v (2, 2, 16, 8), chunk_size=4 (L = S, 4 x 4 blocks), float64",
             (randn(2, 2, 16, 8), randn(2, 2, 16, 8), randn(2, 2, 16, 8), 4)),
        Case("q (2, 3, 10, 8), k (2, 3, 15, 8), v (2, 3, 15, 6), chunk_size=4 (a cache of 5 keys: rows with no "
             "allowed key in a computed block), float64",
             (randn(2, 3, 10, 8), randn(2, 3, 15, 8), randn(2, 3, 15, 6), 4)),
        Case("q (2, 2, 5, 8), k (2, 2, 21, 8), v (2, 2, 21, 5), chunk_size=4 (a cache of 16 keys), float64",
             (randn(2, 2, 5, 8), randn(2, 2, 21, 8), randn(2, 2, 21, 5), 4)),
        Case("q (2, 2, 1, 8), k, v (2, 2, 9, 8), chunk_size=4 (one new query: it sees every key), float64",
             (randn(2, 2, 1, 8), randn(2, 2, 9, 8), randn(2, 2, 9, 8), 4)),
        Case("q (2, 2, 5, 8), k, v (2, 2, 7, 8), chunk_size=16 (one block, a cache of 2 keys), float64",
             (randn(2, 2, 5, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8), 16)),
        Case("long: q, k, v (2, 2, 64, 16), chunk_size=8 (L = S, 8 x 8 blocks), float64",
             (randn(2, 2, 64, 16), randn(2, 2, 64, 16), randn(2, 2, 64, 16), 8)),
        Case("long: q (2, 2, 64, 16), k, v (2, 2, 68, 16), chunk_size=8 (a cache of 4 keys, 8 x 9 blocks), float64",
             (randn(2, 2, 64, 16), randn(2, 2, 68, 16), randn(2, 2, 68, 16), 8)),
    ]


(_CAUSAL_SQUARE, _CAUSAL_RAGGED_CACHE, _CAUSAL_LONG_CACHE, _CAUSAL_ONE_QUERY, _CAUSAL_ONE_BLOCK, _CAUSAL_LONG,
 _CAUSAL_LONG_CACHED) = range(7)


def _causal_allowed(L: int, S: int) -> torch.Tensor:
    """(L, S) bool, True = may attend: the causal mask aligned bottom-right (query i sees keys 0..i + S - L)."""
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)


def _causal_expected(q, k, v):
    return scaled_dot_product_attention(q, k, v, _causal_allowed(q.shape[-2], k.shape[-2]))


def _causal_blocks(L: int, S: int, chunk: int) -> list[tuple[int, int]]:
    """(query rows, key columns) of every block holding a key that a query of its chunk may see (bottom-right)."""
    blocks = []
    for q0 in range(0, L, chunk):
        q1 = min(q0 + chunk, L)
        for k0 in range(0, min(S, q1 + S - L), chunk):
            blocks.append((q1 - q0, min(k0 + chunk, S) - k0))
    return blocks


def _causal_intended_flops(q, k, v, chunk: int) -> float:
    """The intended algorithm's work as the probe counts it: 2 (D + Dv) per computed score for the matrix
    products, plus about 8 passes over each computed block (scale, mask, max, shift, exp, sum, ...)."""
    heads = q[..., 0, 0].numel()
    D, Dv = q.shape[-1], v.shape[-1]
    pairs = sum(rows * cols for rows, cols in _causal_blocks(q.shape[-2], k.shape[-2], chunk))
    return heads * pairs * (2 * (D + Dv) + 8)


def _causal_variant(q, k, v, chunk, *, skip=True, offset=0, top_left=False, mask_inside=True,
                    skip_diagonal=False, guard=True):
    """Bottom-right causal chunked attention written out, with one mistake switched on."""
    L, S = q.shape[-2], k.shape[-2]
    diagonal = 0 if top_left else S - L  # query i sees keys 0..i + diagonal
    scale = 1 / math.sqrt(q.shape[-1])
    outputs = []
    for q0 in range(0, L, chunk):
        q1 = min(q0 + chunk, L)
        rows = torch.arange(q0, q1)[:, None]  # (cq, 1)
        stop = S if not skip else min(S, max(0, (q0 if skip_diagonal else q1) + diagonal))
        running = None
        for k0 in range(0, stop, chunk):
            k1 = min(k0 + chunk, S)
            scores = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) * scale  # (..., cq, ck)
            if mask_inside:
                future = torch.arange(k0, k1)[None, :] > rows + diagonal - offset  # (cq, ck)
                scores = scores.masked_fill(future, float("-inf"))
            chunk_stats = _chunk_statistics(scores, v[..., k0:k1, :], guard=guard)
            running = chunk_stats if running is None else _merge_written_out(running, chunk_stats)
        if running is None:
            outputs.append(torch.zeros(*q.shape[:-2], q1 - q0, v.shape[-1], dtype=q.dtype))
            continue
        acc, _, row_sum = running
        outputs.append(acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum))
    return torch.cat(outputs, dim=-2)


def _diagnose_causal(got, q, k, v, chunk) -> str | None:
    return distinct_match(
        got,
        _causal_expected(q, k, v),
        [
            (lambda: _causal_variant(q, k, v, chunk, offset=1),
             "your causal mask is off by one: a query may attend to the key at its own position (query i to key "
             "i + S - L), only the keys after it are blocked."),
            (lambda: _causal_variant(q, k, v, chunk, top_left=True),
             "your causal mask is aligned top-left (query i sees keys 0..i, as is_causal=True does). Here the queries "
             "are the last L of S positions, after a cache of S - L keys: query i sees keys 0..i + S - L."),
            (lambda: _causal_variant(q, k, v, chunk, mask_inside=False),
             "inside the blocks you compute, the future pairs are not masked: a query chunk's last block reaches "
             "past the diagonal, and the keys past it are the future."),
            (lambda: _causal_variant(q, k, v, chunk, skip_diagonal=True),
             "you skip the diagonal block too: the key chunk that holds a query's own position and its recent past "
             "must be computed. Skip only the key chunks in which no query of the chunk may see any key."),
            (lambda: _causal_variant(q, k, v, chunk, guard=False),
             "a block you compute can hold rows with no allowed key (when S - L is not a multiple of the chunk, the "
             "diagonal cuts across the blocks): their max is -inf, and exp(-inf - (-inf)) = exp(nan). Shift such rows "
             "by 0 instead, as in task 2, so their exp terms are exp(-inf) = 0."),
        ],
    )


def _judge_causal(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices in (("L = S: equals causal attention (no cache: the diagonal is the main one)",
                            (_CAUSAL_SQUARE, _CAUSAL_LONG)),
                           ("after a cache of S - L keys: query i sees keys 0..i + S - L",
                            (_CAUSAL_RAGGED_CACHE, _CAUSAL_LONG_CACHE, _CAUSAL_ONE_QUERY, _CAUSAL_LONG_CACHED)),
                           ("one chunk covering the whole sequence", (_CAUSAL_ONE_BLOCK,))):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name)
                q, k, v, chunk = case.args
                expected = _causal_expected(q, k, v)
                expect_shape(got, expected.shape, what=case.name)
                if not _close(got, expected, 1e-9):
                    expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-9,
                                 hint=lambda: _diagnose_causal(got, q, k, v, chunk) or "")
    causal_values_right = all(  # "you compute the future and mask it" is told only for the right values
        o.error is None and same(o.returned, _causal_expected(*c.args[:3]), atol=1e-9, rtol=1e-9)
        for c, o in zip(cases, outcomes)
    )
    with checklist.check("skips the future: the work of the blocks that hold an allowed key only "
                         f"(within {_CAUSAL_FLOP_FACTOR}x)"):
        for index in (_CAUSAL_LONG, _CAUSAL_LONG_CACHED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, k, v, chunk = case.args
            intended = _causal_intended_flops(q, k, v, chunk)
            L, S = q.shape[-2], k.shape[-2]
            n_q, n_k = math.ceil(q.shape[-2] / chunk), math.ceil(k.shape[-2] / chunk)
            computed = len(_causal_blocks(q.shape[-2], k.shape[-2], chunk))
            largest = outcome.probe.get("largest_numel") if isinstance(outcome.probe, dict) else None
            blocks = causal_values_right and isinstance(largest, int) and largest < q[..., 0, 0].numel() * L * S
            story = (" You compute them and mask them: masking them to -inf still costs the work." if blocks else "")
            expect_flops_at_most(
                outcome, _CAUSAL_FLOP_FACTOR * intended, what=case.name, intended=intended,
                hint=f"Of the {n_q} x {n_k} blocks, only {computed} hold a key that some query of their chunk may see: "
                "a key chunk that starts after the last key its query chunk's last query may see is entirely in the "
                f"future, and needs no scores at all.{story}",
            )
    with checklist.check("never forms an (L, S) matrix"):
        for index in (_CAUSAL_LONG, _CAUSAL_LONG_CACHED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, k, _, chunk = case.args
            L, S = q.shape[-2], k.shape[-2]
            expect_largest_below(
                outcome, q[..., 0, 0].numel() * L * S, what=case.name,
                constraint=f"chunked attention holds one (chunk, chunk) = ({chunk}, {chunk}) block of scores per "
                f"head at a time, never the (L, S) = ({L}, {S}) matrix.",
            )
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _causal_reference(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size)


def _causal_query_chunks_all_past_keys(q, k, v, chunk_size):
    """Correct too: each chunk of queries against all the keys it may see at once, future never computed."""
    L, S = q.shape[-2], k.shape[-2]
    outputs = []
    for q0 in range(0, L, chunk_size):
        q1 = min(q0 + chunk_size, L)
        keys = min(S, q1 + S - L)
        future = torch.arange(keys)[None, :] > torch.arange(q0, q1)[:, None] + S - L  # (cq, keys)
        scores = q[..., q0:q1, :] @ k[..., :keys, :].transpose(-2, -1) / math.sqrt(q.shape[-1])
        outputs.append(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v[..., :keys, :])
    return torch.cat(outputs, dim=-2)


def _causal_no_skip(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, skip=False)


def _causal_dense(q, k, v, chunk_size):
    blocked = ~_causal_allowed(q.shape[-2], k.shape[-2])  # (L, S), True = blocked
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _causal_off_by_one(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, offset=1)


def _causal_top_left(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, top_left=True)


def _causal_unmasked_blocks(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, mask_inside=False)


def _causal_skips_diagonal(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, skip_diagonal=True)


def _causal_nan_on_empty_rows(q, k, v, chunk_size):
    return _causal_variant(q, k, v, chunk_size, guard=False)


def _causal_library(q, k, v, chunk_size):
    from ...chunked import chunked_attention

    allowed = _causal_allowed(q.shape[-2], k.shape[-2])  # (L, S): the right mask, every block computed
    return chunked_attention(q, k, v, allowed, query_chunk_size=chunk_size, key_chunk_size=chunk_size)


CAUSAL_CHUNKED_ATTENTION = Task(
    id="07.causal_chunked_attention",
    title="Causal chunked attention after a cache, skipping the future",
    function_name="causal_chunked_attention",
    make_cases=_causal_cases,
    judge=_judge_causal,
    reference=_causal_reference,
    wrong={
        "every key chunk computed, the future masked": Wrong(_causal_no_skip, "masking them to -inf still costs",
                                                             kind="algorithm"),
        "dense causal softmax": Wrong(_causal_dense, "never the (L, S)", kind="algorithm"),
        "causal mask off by one (key < query)": Wrong(_causal_off_by_one, "off by one"),
        "causal mask aligned top-left (is_causal=True)": Wrong(_causal_top_left, "aligned top-left"),
        "no mask inside the diagonal blocks": Wrong(_causal_unmasked_blocks, "are not masked"),
        "skips the diagonal block too": Wrong(_causal_skips_diagonal, "skip the diagonal block too"),
        "NaN on a computed block's rows with no allowed key": Wrong(_causal_nan_on_empty_rows,
                                                                     "exp(-inf - (-inf)) = exp(nan)"),
        "calls chunked_attention with the bottom-right mask": Wrong(
            _causal_library, "you called attn_course.chunked_attention", kind="algorithm"),
    },
    accepted={"each query chunk against all the keys it may see at once": _causal_query_chunks_all_past_keys},
    measure=("largest", "flops"),
    forbidden=_NOT_ONLINE,
    stretch=True,
)
