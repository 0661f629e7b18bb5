"""The lesson 05 tasks: fair to other correct solutions, strict about the algorithm.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why only one can), that the judges survive the batch grader's round trip, and that
``Task.accepted`` scores full marks. These tests add the other side for lesson 05: correct code
written differently from the reference scores full marks, the probes' limits sit where the
docstrings say (the reference at a quarter of the largest-tensor limit, the naive algorithms far
above), and a diagnosis is never offered for a "bug" that gives the right answer on that case.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function, run_cases
from attn_course.grading.tasks import lesson05
from attn_course.grading.tasks._variants import distinct_match

OURS = [task_id for task_id in TASKS if task_id.startswith("05.")]


# --- other correct solutions ---------------------------------------------------------------


def _window_triangles(L, window, is_causal):
    mask = torch.ones(L, L, dtype=torch.bool).triu(-window).tril(window)  # (L, L), a band
    return mask.tril() if is_causal else mask


def _window_loop(L, window, is_causal):
    mask = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        hi = i if is_causal else min(L - 1, i + window)
        mask[i, max(0, i - window): hi + 1] = True
    return mask


def _block_einsum(q, k, v, block_size, mask):
    L, D = q.shape[-2], q.shape[-1]
    nb = math.ceil(L / block_size)
    pad = nb * block_size - L
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)).unflatten(-2, (nb, block_size)) for x in (q, k, v))  # (..., nb, b, D)
    scores = torch.einsum("...nqd,...nkd->...nqk", qp, kp) / math.sqrt(D)  # (..., nb, b, b)
    real = torch.arange(nb * block_size) < L  # (Lp,)
    if mask is not None:
        real = real & F.pad(mask[..., 0, :], (0, pad), value=False)  # (B, [1,] Lp)
    real = real.unflatten(-1, (nb, block_size))[..., None, :]  # (..., nb, 1, b)
    weights = scores.masked_fill(~real, float("-inf")).softmax(-1)  # (..., nb, b, b)
    weights = torch.where(real.any(-1, keepdim=True), weights, torch.zeros_like(weights))  # empty rows -> 0
    out = torch.einsum("...nqk,...nkd->...nqd", weights, vp)  # (..., nb, b, Dv)
    return out.flatten(-3, -2)[..., :L, :]  # (..., L, Dv)


def _block_per_query(q, k, v, block_size, mask):
    """Each query against its own block's keys only: O(L b) work, one small slice at a time."""
    L, D = q.shape[-2], q.shape[-1]
    rows = []
    for i in range(L):
        start = i // block_size * block_size
        keys = slice(start, min(start + block_size, L))
        scores = torch.matmul(k[..., keys, :], q[..., i, :, None])[..., 0] / math.sqrt(D)  # (..., b)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., 0, keys], float("-inf"))
        weights = scores.softmax(-1).nan_to_num(0.0)  # (..., b)
        rows.append(torch.matmul(weights[..., None, :], v[..., keys, :])[..., 0, :])  # (..., Dv)
    return torch.stack(rows, dim=-2)


def _dilated_unfold(q, k, v, window, dilation):
    """The keys of every query as a strided view of the zero-padded keys (Tensor.unfold), then masked."""
    L, D = q.shape[-2], q.shape[-1]
    reach = window * dilation
    span = 2 * reach + 1
    keys = F.pad(k, (0, 0, reach, reach)).unfold(-2, span, 1)[..., ::dilation]  # (..., L, D, W), a view
    values = F.pad(v, (0, 0, reach, reach)).unfold(-2, span, 1)[..., ::dilation]  # (..., L, Dv, W)
    scores = torch.einsum("...ld,...ldw->...lw", q, keys) / math.sqrt(D)  # (..., L, W)
    position = torch.arange(L)[:, None] + dilation * torch.arange(-window, window + 1)  # (L, W)
    scores = scores.masked_fill((position < 0) | (position >= L), float("-inf"))
    return torch.einsum("...lw,...ldw->...ld", scores.softmax(-1), values)  # (..., L, Dv)


def _dilated_residue_classes(q, k, v, window, dilation):
    """Positions with the same i mod dilation form a sequence; inside it, a plain window of radius w."""
    L, D = q.shape[-2], q.shape[-1]
    n = math.ceil(L / dilation)
    pad = n * dilation - L

    def classes(x):
        return F.pad(x, (0, 0, 0, pad)).unflatten(-2, (n, dilation)).transpose(-3, -2)  # (..., d, n, D)

    qc, kc, vc = classes(q), classes(k), classes(v)
    real = (torch.arange(n * dilation) < L).view(n, dilation).T  # (d, n), True = a real position
    reach = window
    keys = F.pad(kc, (0, 0, reach, reach)).unfold(-2, 2 * reach + 1, 1)  # (..., d, n, D, W)
    values = F.pad(vc, (0, 0, reach, reach)).unfold(-2, 2 * reach + 1, 1)  # (..., d, n, Dv, W)
    usable = F.pad(real, (reach, reach)).unfold(-1, 2 * reach + 1, 1)  # (d, n, W)
    scores = torch.einsum("...nd,...ndw->...nw", qc, keys) / math.sqrt(D)  # (..., d, n, W)
    weights = scores.masked_fill(~usable, float("-inf")).softmax(-1)
    out = torch.einsum("...nw,...ndw->...nd", weights, values)  # (..., d, n, Dv)
    return out.transpose(-3, -2).flatten(-3, -2)[..., :L, :]  # (..., L, Dv)


ALTERNATIVES = {
    "05.sliding_window_mask": [_window_triangles, _window_loop],
    "05.block_local_attention": [_block_einsum, _block_per_query],
    "05.dilated_window_attention": [_dilated_unfold, _dilated_residue_classes],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_05_has_alternatives_and_a_stretch_task():
    assert set(ALTERNATIVES) == set(OURS)
    assert [TASKS[t].stretch for t in OURS].count(True) == 1


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


# --- the probes' limits --------------------------------------------------------------------


def _probes(task_id, fn, indices):
    task = TASKS[task_id]
    cases = task.make_cases()
    outcomes = run_cases(fn, [cases[i] for i in indices], measure=task.measure, forbidden=task.forbidden)
    return [cases[i] for i in indices], outcomes


def test_block_local_limits_sit_between_the_blocks_and_the_naive_forms():
    """Reference: exactly the largest-tensor limit less one (its (B, H, nb, b, b) scores) and about 1x the FLOPs.

    The naive forms: dense attention with the mask at 8x and 25x the limit, padding to L * b at 16x
    (b times the blocks), one extra block (L a multiple of b) and padding to 2L above it, chunks of
    queries against every key at 25-31x the FLOPs (measured). Issue 20: the old 4x allowance passed both paddings.
    """
    task_id = "05.block_local_attention"
    long_cases = (6, 7)
    cases, reference = _probes(task_id, TASKS[task_id].reference, long_cases)
    for case, outcome in zip(cases, reference):
        q, _, v, block_size, _ = case.args
        assert outcome.probe["largest_numel"] + 1 == lesson05._block_limit(q, v, block_size)
        assert 0.9 < outcome.probe["flops"] / lesson05._block_flops(*case.args[:4]) < 1.2
    for oversized in (lesson05._block_oversized_padding, lesson05._block_extra_block, lesson05._block_padded_to_twice):
        for case, outcome in zip(cases, _probes(task_id, oversized, long_cases)[1]):
            q, _, v, block_size, _ = case.args
            assert case.args[0].shape[-2] % block_size == 0  # both long cases: L a multiple of the block
            assert outcome.probe["largest_numel"] >= lesson05._block_limit(q, v, block_size), oversized.__name__


def test_dilated_limits_sit_between_the_gathered_form_and_the_naive_forms():
    """Reference: at most 0.21 of L * L (its (B, H, L, 2w + 1, D) gathered keys); the dense mask is L * L itself."""
    task_id = "05.dilated_window_attention"
    cases, reference = _probes(task_id, TASKS[task_id].reference, (5, 6))
    for case, outcome in zip(cases, reference):
        L = case.args[0].shape[-2]
        assert outcome.probe["largest_numel"] <= 0.21 * L * L
        assert 0.9 < outcome.probe["flops"] / lesson05._dilated_flops(*case.args) < 1.2
    _, dense = _probes(task_id, lesson05._dilated_dense, (5, 6))
    assert all(o.probe["largest_numel"] >= c.args[0].shape[-2] ** 2 for c, o in zip(cases, dense))


# --- diagnoses ------------------------------------------------------------------------------


def test_a_variant_equal_to_the_right_answer_is_never_a_diagnosis():
    """Full attention IS block-local attention when the block covers the sequence: no bogus hint there."""
    task = TASKS["05.block_local_attention"]
    long_block = next(c for c in task.make_cases() if "block_size=8" in c.name)
    q, k, v, block, mask = long_block.args
    right = task.reference(q, k, v, block, mask)
    message = distinct_match(right, right, [(lambda: F.scaled_dot_product_attention(q, k, v), "full attention")])
    assert message is None
    wrong = right + 1
    assert distinct_match(wrong, right, [(lambda: wrong.clone(), "off by one")]) == "Off by one"


def test_dilation_one_is_not_diagnosed_as_an_ignored_dilation():
    """With dilation 1 "dilation ignored" IS the right answer: the diagnosis must not offer it there."""
    task = TASKS["05.dilated_window_attention"]
    case = next(c for c in task.make_cases() if "dilation=1" in c.name)
    q, k, v, window, dilation = case.args
    plain_window = lesson05._dilated_form(q, k, v, window, 1)
    assert torch.allclose(plain_window, task.reference(*case.args))
    assert lesson05._diagnose_dilated(plain_window, *case.args) is None
    other = next(c for c in task.make_cases() if "dilation=3" in c.name)
    assert "ignored the dilation" in lesson05._diagnose_dilated(lesson05._dilated_form(*other.args[:4], 1), *other.args)
