"""Lesson 07's tasks: fair to other correct solutions, and measuring the algorithm, not only the values.

``test_grading_catalogue.py`` proves that every catalogued bug is rejected, the right-values-wrong-algorithm
entries included (the dense softmax, computing every causal block). These tests prove the other side, and
record the measurements the algorithm checks rest on: correct code written differently from the reference
(including code that uses the library's merge_partials, a building block the tasks allow) scores full marks,
and the honest algorithms sit far from the limits that reject the naive ones.
"""

from __future__ import annotations

import math

import pytest
import torch

import attn_course as ac
from attn_course.grading import TASKS, grade_function, run_cases
from attn_course.grading.tasks import lesson07

LESSON = [task_id for task_id in TASKS if task_id.startswith("07.")]


def _merge_where(first, second):
    (a1, m1, l1), (a2, m2, l2) = first, second
    m = torch.maximum(m1, m2)
    f1 = torch.where(m1 == float("-inf"), torch.zeros_like(m1), torch.exp(m1 - m))
    f2 = torch.where(m2 == float("-inf"), torch.zeros_like(m2), torch.exp(m2 - m))
    return [a1 * f1 + a2 * f2, m, l1 * f1 + l2 * f2]


def _merge_nan_to_num(first, second):
    (a1, m1, l1), (a2, m2, l2) = first, second
    m = torch.maximum(m1, m2)
    f1, f2 = torch.nan_to_num(torch.exp(m1 - m)), torch.nan_to_num(torch.exp(m2 - m))
    return a1 * f1 + a2 * f2, m, l1 * f1 + l2 * f2


def _online_with_library_merge(q, k, v, chunk_size, mask=None):
    """Chunk statistics written out, merged with the library's merge_partials (a building block: allowed)."""
    running = None
    for start in range(0, k.shape[-2], chunk_size):
        scores = q @ k[..., start:start + chunk_size, :].mT / math.sqrt(q.shape[-1])  # (..., L, c)
        if mask is not None:
            scores = scores.masked_fill(~mask[..., start:start + chunk_size], -math.inf)
        row_max = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - row_max.nan_to_num(neginf=0.0))  # -inf rows shifted by 0
        part = ac.PartialAttention(p @ v[..., start:start + chunk_size, :], row_max, p.sum(-1, keepdim=True))
        running = part if running is None else ac.merge_partials(running, part)
    return running.acc / running.row_sum.clamp_min(torch.finfo(q.dtype).tiny)  # 0 / tiny = 0 for empty rows


def _online_both_chunked(q, k, v, chunk_size, mask=None):
    """Queries two at a time, keys chunk by chunk, a running max that starts at -inf."""
    rows = []
    for q0 in range(0, q.shape[-2], 2):
        qc = q[..., q0:q0 + 2, :] / math.sqrt(q.shape[-1])
        m = torch.full((*qc.shape[:-1], 1), -math.inf, dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qc.shape[:-1], v.shape[-1], dtype=q.dtype)
        for k0 in range(0, k.shape[-2], chunk_size):
            s = qc @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1)
            if mask is not None:
                allowed = mask[..., q0:q0 + 2, k0:k0 + chunk_size] if mask.shape[-2] > 1 else mask[..., k0:k0 + chunk_size]
                s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe)
            l = l * torch.exp(m - safe) + p.sum(-1, keepdim=True)
            acc = acc * torch.exp(m - safe) + p @ v[..., k0:k0 + chunk_size, :]
            m = m_new
        rows.append(torch.where(l > 0, acc / l.clamp_min(1e-300), torch.zeros_like(acc)))
    return torch.cat(rows, dim=-2)


def _causal_with_where(q, k, v, chunk_size):
    """Key chunks stop after the last query's last visible key; the future blocked with torch.where, and a
    row with no allowed key in a block kept finite with nan_to_num on its max."""
    L, S = q.shape[-2], k.shape[-2]
    out = []
    for q0 in range(0, L, chunk_size):
        q1 = min(q0 + chunk_size, L)
        running = None
        for k0 in range(0, min(q1 + S - L, S), chunk_size):
            k1 = min(k0 + chunk_size, S)
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].mT / math.sqrt(q.shape[-1])
            allowed = torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None] + (S - L)
            s = torch.where(allowed, s, torch.full_like(s, -math.inf))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m.nan_to_num(neginf=0.0))  # a row with no allowed key here: exp(-inf - 0) = 0
            part = ac.PartialAttention(p @ v[..., k0:k1, :], m, p.sum(-1, keepdim=True))
            running = part if running is None else ac.merge_partials(running, part)
        out.append(running.acc / running.row_sum)
    return torch.cat(out, dim=-2)


def _causal_diagonal_aligned(q, k, v, chunk_size):
    """Key chunks cut at the diagonal (S - L plus multiples of the chunk, the cache's remainder first), so no
    computed block has a row without a key; a running max that starts at -inf and no merge helper."""
    L, S = q.shape[-2], k.shape[-2]
    cached = S - L
    first = cached % chunk_size
    bounds = ([0] if first else []) + list(range(first, S, chunk_size)) + [S]
    scale = 1 / math.sqrt(q.shape[-1])
    out = []
    for q0 in range(0, L, chunk_size):
        q1 = min(q0 + chunk_size, L)
        m = torch.full((*q.shape[:-2], q1 - q0, 1), -math.inf, dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q.shape[:-2], q1 - q0, v.shape[-1], dtype=q.dtype)
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            if k0 > q1 - 1 + cached:  # no query of this chunk sees key k0 or any later one
                break
            s = q[..., q0:q1, :] @ k[..., k0:k1, :].transpose(-2, -1) * scale
            future = torch.arange(k0, k1)[None, :] > torch.arange(q0, q1)[:, None] + cached
            s = s.masked_fill(future, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # finite: every row sees key k0 or the past
            p = torch.exp(s - m_new)
            l = l * torch.exp(m - m_new) + p.sum(-1, keepdim=True)
            acc = acc * torch.exp(m - m_new) + p @ v[..., k0:k1, :]
            m = m_new
        out.append(acc / l)
    return torch.cat(out, dim=-2)


ALTERNATIVES = {
    "07.merge_partials": [_merge_where, _merge_nan_to_num],
    "07.online_softmax_attention": [_online_with_library_merge, _online_both_chunked],
    "07.causal_chunked_attention": [_causal_with_where, _causal_diagonal_aligned],
}
CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_07_has_alternatives_and_one_is_a_stretch():
    assert set(ALTERNATIVES) == set(LESSON)
    assert [TASKS[t].stretch for t in LESSON] == [False, False, True]


@pytest.mark.parametrize("task_id,index", CASES, ids=[f"{t}:{i}" for t, i in CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def _probe(task_id, fn, index):
    task = TASKS[task_id]
    case = task.make_cases()[index]
    return run_cases(fn, [case], measure=("largest", "flops"), forbidden=task.forbidden)[0].probe


def test_online_softmax_largest_intermediate_solution_against_the_dense_form():
    """On the long cases the online softmax's largest tensor is one (..., L, chunk) block, the dense form's the whole
    (..., L, S) matrix, which the limit rejects. Measured: the reference 1,280 and 1,920 elements (one 4 x 40 x 8
    and 4 x 40 x 12 block of scores), the dense form 7,680 (4 x 40 x 48); the limit is 7,680."""
    task_id = "07.online_softmax_attention"
    for index in (lesson07._ONLINE_LONG, lesson07._ONLINE_LONG_PADDED):
        q, k = TASKS[task_id].make_cases()[index].args[:2]
        limit = q[..., 0, 0].numel() * q.shape[-2] * k.shape[-2]
        honest = _probe(task_id, TASKS[task_id].reference, index)["largest_numel"]
        dense = _probe(task_id, TASKS[task_id].wrong["softmax of the whole score matrix"].fn, index)["largest_numel"]
        assert honest <= limit / 4 and dense >= limit, (honest, dense, limit)


def test_causal_stretch_work_solution_against_computing_every_block():
    """The work of the reference sits near the intended count (blocks that hold an allowed key, the mask
    aligned bottom-right) and the every-block form far above it, on both sides of the allowed factor.
    Measured: reference 1.13x on both long cases, accepted 0.96x and 0.88x, every block 2.01x (L = S, 8 x 8
    chunks) and 1.78x (a cache of 4 keys, 8 x 9 chunks)."""
    task_id = "07.causal_chunked_attention"
    task = TASKS[task_id]
    for index in (lesson07._CAUSAL_LONG, lesson07._CAUSAL_LONG_CACHED):
        q, k, v, chunk = task.make_cases()[index].args
        intended = lesson07._causal_intended_flops(q, k, v, chunk)
        honest = _probe(task_id, task.reference, index)["flops"] / intended
        accepted = _probe(task_id, task.accepted["each query chunk against all the keys it may see at once"],
                          index)["flops"]
        every_block = _probe(task_id, task.wrong["every key chunk computed, the future masked"].fn, index)["flops"]
        assert 0.8 < honest < 1.15 and 0.8 < accepted / intended < 1.15, (honest, accepted / intended)
        assert every_block / intended > 1.6 > lesson07._CAUSAL_FLOP_FACTOR, every_block / intended


def test_causal_stretch_cases_have_a_cache_and_rows_without_a_key_in_a_computed_block():
    """The stretch task states S >= L; its cases respect it, some have a cache (S > L, where the top-left
    mask of is_causal=True is wrong), and some have S - L off the chunk grid, where a computed block holds
    rows with no allowed key (the guard of task 2 is needed)."""
    cases = TASKS["07.causal_chunked_attention"].make_cases()
    shapes = [(q.shape[-2], k.shape[-2], chunk) for q, k, _, chunk in (case.args for case in cases)]
    assert all(S >= L for L, S, _ in shapes), shapes
    assert sum(S > L for L, S, _ in shapes) >= 3, shapes

    def has_a_row_without_a_key(L, S, chunk):
        allowed = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)  # (L, S), bottom-right
        for q0 in range(0, L, chunk):
            for k0 in range(0, min(S, q0 + chunk + S - L), chunk):  # the blocks that must be computed
                if not allowed[q0:q0 + chunk, k0:k0 + chunk].any(-1).all():
                    return True
        return False

    assert sum(has_a_row_without_a_key(*shape) for shape in shapes) >= 2, shapes
