"""Graded tasks for lesson 07 (chunked attention): merge two softmax chunks, attention with the online softmax."""

from __future__ import annotations

import math

import torch

from ...attention import scaled_dot_product_attention
from ...chunked import PartialAttention, chunked_attention, finish_partial, merge_partials, partial_attention
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_finite, expect_inputs_unchanged, expect_shape
from ._common import answered, returned, seeded_randn
from ._variants import distinct_match

__all__ = ["MERGE_PARTIALS", "ONLINE_SOFTMAX_ATTENTION"]


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
    cases = []
    for name, scores, v, split in (
        ("chunks of 5 and 3 keys, scores (2, 2, 4, 8), v (2, 2, 8, 3), float64", scores0, v0, 5),
        ("logits x50: scores (3, 6, 7) split 4 + 3, v (3, 7, 4), float64", scores1, v1, 4),
        ("rows with no key in one chunk (row_max -inf) and row 2 with no key at all, float64", scores2, v2, 4),
    ):
        first = _partial(scores[..., :split], v[..., :split, :])
        second = _partial(scores[..., split:], v[..., split:, :])
        cases.append(Case(name, (first, second)))
    return cases


_TWO_CHUNKS, _LARGE, _EMPTY = range(3)


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
    merged = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return merged.acc, first[1], merged.row_sum


def _merge_nan_on_empty(first, second):
    new_max = torch.maximum(first[1], second[1])
    s1, s2 = torch.exp(first[1] - new_max), torch.exp(second[1] - new_max)
    return first[0] * s1 + second[0] * s2, new_max, first[2] * s1 + second[2] * s2


def _merge_sum_not_rescaled(first, second):
    merged = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return merged.acc, merged.row_max, first[2] + second[2]


def _merge_normalised(first, second):
    merged = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return finish_partial(merged), merged.row_max, merged.row_sum


def _merge_averaged(first, second):
    merged = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return merged.acc / 2, merged.row_max, merged.row_sum / 2


def _diagnose_merge_acc(got_acc, first, second) -> str | None:
    expected = merge_partials(PartialAttention(*first), PartialAttention(*second))
    return distinct_match(
        got_acc,
        expected.acc,
        [
            (lambda: first[0] + second[0],
             "you added the two acc tensors as they are. Each is relative to its own max: rescale to the common max "
             "m = max(m1, m2) first, acc = acc1 * exp(m1 - m) + acc2 * exp(m2 - m)."),
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
        """Indices of the cases where the function returned; if none did, fail with the first case's error."""
        indices = [i for i, outcome in enumerate(outcomes) if outcome.error is None]
        if not indices:
            parts(0)  # raises the Fail that explains the error (or "not implemented yet")
        return indices

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
                raise Fail(f"{case.name}: row_max should be max(m1, m2) per row (torch.maximum), so later chunks are "
                           "rescaled against the largest score seen so far.")
    for title, index in (("acc and row_sum rescaled to the common max", _TWO_CHUNKS),
                         ("logits x50: no overflow", _LARGE)):
        with checklist.check(title):
            case, acc, _, row_sum = parts(index)
            first, second = case.args
            expected = merge_partials(PartialAttention(*first), PartialAttention(*second))
            expect_finite(acc, what=f"{case.name}: acc")
            expect_close(acc, expected.acc, what=f"{case.name}: acc", atol=1e-9, rtol=1e-7,
                         hint=_diagnose_merge_acc(acc, first, second) or "")
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
    with checklist.check("rows with no key in a chunk (max -inf) stay finite"):
        case, acc, row_max, row_sum = parts(_EMPTY)
        if torch.isnan(acc).any() or torch.isnan(row_sum).any():
            raise Fail(
                f"{case.name}: NaN in the row with no key at all. Both maxima are -inf there, and exp(-inf - (-inf)) "
                "= exp(nan). Use a safe max of 0 where the merged max is -inf: the factors become exp(-inf) = 0."
            )
        expected = merge_partials(PartialAttention(*case.args[0]), PartialAttention(*case.args[1]))
        expect_close(acc, expected.acc, what=f"{case.name}: acc", atol=1e-9, rtol=1e-7)
        expect_close(row_sum, expected.row_sum, what=f"{case.name}: row_sum", atol=1e-9, rtol=1e-7)
    with checklist.check("leaves both partials unchanged"):
        for index in ran():
            case, outcome = cases[index], outcomes[index]
            for before, after in zip(case.args, outcome.args_after):
                if not all(torch.equal(b, a) for b, a in zip(before, after)):
                    raise Fail(f"{case.name}: your function changed an input tensor in place (e.g. acc *= ...). "
                               "Build new tensors: the caller may still need the partials.")
    return checklist.results


def _merge_reference(first, second):
    return tuple(merge_partials(PartialAttention(*first), PartialAttention(*second)))


def _merge_in_place(first, second):
    merged = merge_partials(PartialAttention(*first), PartialAttention(*second))
    first[0].copy_(merged.acc)
    return merged.acc.clone(), merged.row_max, merged.row_sum


MERGE_PARTIALS = Task(
    id="07.merge_partials",
    title="Merge two softmax chunks (the online-softmax step)",
    function_name="merge_partials",
    make_cases=_merge_cases,
    judge=_judge_merge,
    reference=_merge_reference,
    wrong={
        "adds without rescaling": Wrong(_merge_naive_sum, "rescale to the common max"),
        "inverted rescaling factor": Wrong(_merge_inverted, "upside down"),
        "keeps the first chunk's max": Wrong(_merge_keeps_first_max, "max(m1, m2)"),
        "NaN when both maxima are -inf": Wrong(_merge_nan_on_empty, "exp(nan)"),
        "row_sum not rescaled": Wrong(_merge_sum_not_rescaled, "same factors as acc"),
        "returns the normalised output": Wrong(_merge_normalised, "Keep acc unnormalised"),
        "averages the chunks": Wrong(_merge_averaged, "do not divide by 2"),
        "writes into the first partial": Wrong(_merge_in_place, "in place", kind="contract"),
    },
)


# --- 07.online_softmax_attention -----------------------------------------------------------
# The learner writes online_softmax_attention(q, k, v, chunk_size) -> (..., L, Dv): exact
# attention that walks over the keys chunk_size at a time, keeping a running max, a running
# sum and a running (unnormalised) output per query; scale 1 / sqrt(D).


def _online_cases() -> list[Case]:
    randn = seeded_randn(717)

    return [
        Case("q, k, v (2, 2, 12, 8), chunk_size=4 (S a multiple), float64",
             (randn(2, 2, 12, 8), randn(2, 2, 12, 8), randn(2, 2, 12, 8), 4)),
        Case("q (1, 3, 5, 8), k (1, 3, 13, 8), v (1, 3, 13, 6), chunk_size=5 (13 = 2 chunks + 3), float64",
             (randn(1, 3, 5, 8), randn(1, 3, 13, 8), randn(1, 3, 13, 6), 5)),
        Case("q, k, v (2, 7, 4) without a head axis, chunk_size=1, float64",
             (randn(2, 7, 4), randn(2, 7, 4), randn(2, 7, 4), 1)),
        Case("q, k, v (1, 1, 6, 4), chunk_size=16 (one chunk), float64",
             (randn(1, 1, 6, 4), randn(1, 1, 6, 4), randn(1, 1, 6, 4), 16)),
        Case("logits x50 in float32: q = 50 * randn (1, 2, 9, 8), key j scaled by j + 1, v (1, 2, 9, 8), chunk_size=3",
             (50 * randn(1, 2, 9, 8, dtype=torch.float32),
              randn(1, 2, 9, 8, dtype=torch.float32) * torch.arange(1.0, 10.0)[:, None],  # later keys score higher
              randn(1, 2, 9, 8, dtype=torch.float32), 3)),
    ]


_ONLINE_MULTIPLE, _ONLINE_RAGGED, _ONLINE_ONE, _ONLINE_BIG_CHUNK, _ONLINE_LARGE = range(5)


def _online_variant(q, k, v, chunk_size, *, rescale=True, subtract_max=True, update_max=True,
                    skip_last=False, scale=None, average=False):
    """The online softmax with one classic mistake switched on."""
    S = k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    stop = S - S % chunk_size if skip_last and S % chunk_size else S
    m = l = acc = None
    outputs = []
    for k0 in range(0, stop, chunk_size):
        scores = (q @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1)) * scale  # (..., L, c)
        chunk_v = v[..., k0:k0 + chunk_size, :]  # (..., c, Dv)
        if average:
            outputs.append(torch.softmax(scores, dim=-1) @ chunk_v)
            continue
        chunk_max = scores.amax(-1, keepdim=True) if subtract_max else torch.zeros_like(scores[..., :1])
        if m is None:
            m = chunk_max
            p = torch.exp(scores - m)
            l, acc = p.sum(-1, keepdim=True), p @ chunk_v
            continue
        new_m = torch.maximum(m, chunk_max) if update_max else m
        p = torch.exp(scores - new_m)
        factor = torch.exp(m - new_m) if rescale else torch.ones_like(m)
        l = l * factor + p.sum(-1, keepdim=True)
        acc = acc * factor + p @ chunk_v
        m = new_m
    if average:
        return torch.stack(outputs).mean(0)
    return acc / l


def _diagnose_online(got, q, k, v, chunk_size) -> str | None:
    return distinct_match(
        got,
        scaled_dot_product_attention(q, k, v),
        [
            (lambda: _online_variant(q, k, v, chunk_size, rescale=False),
             "when the running max rises from m to m', the old sum and acc were computed with exp(s - m): multiply "
             "them by exp(m - m') before adding the new chunk."),
            (lambda: _online_variant(q, k, v, chunk_size, average=True),
             "you averaged per-chunk softmax outputs. That weighs every chunk equally, whatever its scores: keep "
             "running sums instead and divide once at the end."),
            (lambda: _online_variant(q, k, v, chunk_size, skip_last=True),
             "your loop skips the last, shorter chunk of keys: use range(0, S, chunk_size) and slice k[..., start:"
             "start + chunk_size] (slicing past the end is fine)."),
            (lambda: _online_variant(q, k, v, chunk_size, scale=1.0),
             "the scores are not scaled: multiply q @ k^T by 1 / sqrt(D)."),
            (lambda: scaled_dot_product_attention(q, k[..., :chunk_size, :], v[..., :chunk_size, :]),
             "your output only uses the first chunk of keys: loop over all chunks."),
        ],
    )


def _judge_online(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices in (("equals softmax attention (S a multiple of the chunk)", (_ONLINE_MULTIPLE,)),
                           ("any S: a last, shorter chunk counts too", (_ONLINE_RAGGED,)),
                           ("chunk_size = 1 and chunk_size >= S", (_ONLINE_ONE, _ONLINE_BIG_CHUNK))):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name)
                q, k, v, chunk_size = case.args
                expected = scaled_dot_product_attention(q, k, v)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                             hint=_diagnose_online(got, *case.args) or "")
    with checklist.check("logits x50: finite and accurate (subtract the running max)"):
        case = cases[_ONLINE_LARGE]
        got = returned(outcomes[_ONLINE_LARGE], what=case.name)
        q, k, v, chunk_size = case.args
        expected = scaled_dot_product_attention(q.double(), k.double(), v.double())
        expect_shape(got, expected.shape, what=case.name)
        expect_finite(got, what=case.name, hint=(
            "exp of a raw score of a few hundred overflows float32 (max about 3.4e38, exp(89) already): subtract the "
            "running max before exp, and keep updating it as new chunks arrive."))
        expect_close(got, expected, what=case.name, atol=1e-4, rtol=1e-4, hint=_diagnose_online(got, *case.args) or "")
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _online_reference(q, k, v, chunk_size):
    return chunked_attention(q, k, v, query_chunk_size=q.shape[-2], key_chunk_size=chunk_size)


def _online_no_rescale(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, rescale=False)


def _online_averaged(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, average=True)


def _online_raw_exp(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, subtract_max=False)


def _online_skip_last(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, skip_last=True)


def _online_unscaled(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, scale=1.0)


def _online_first_max_only(q, k, v, chunk_size):
    return _online_variant(q, k, v, chunk_size, update_max=False)


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
        "no max subtracted": Wrong(_online_raw_exp, "subtract the running max"),
        "last chunk skipped": Wrong(_online_skip_last, "skips the last, shorter chunk"),
        "no 1/sqrt(D) scale": Wrong(_online_unscaled, "not scaled"),
        "running max never updated": Wrong(_online_first_max_only, "keep updating it"),
    },
)
