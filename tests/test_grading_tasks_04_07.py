"""The lesson 04 and 07 tasks: fair to other correct solutions (lessons 05 and 06: test_grading_lesson05/06.py).

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference scores full
marks; number tasks reject garbage; FLOP cases are counted by PyTorch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] in {"04", "07"}]  # lessons 05 and 06: test_grading_lesson05/06.py


# --- other correct solutions ---------------------------------------------------------------


def _flops_per_matmul(B, H, L, S, D, Dv):
    scores = 2 * L * D * S  # (L, D) @ (D, S)
    mix = 2 * L * S * Dv  # (L, S) @ (S, Dv)
    return B * H * (scores + mix)


def _flops_tensor(B, H, L, S, D, Dv):
    return torch.tensor(2.0 * B * H * L * S * (D + Dv))


def _saved_dict(fn, *args):
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)  # keeping the output keeps the graph, and every saved tensor, alive
    del out
    return sum(seen.values())


def _saved_storages(fn, *args):
    storages = []

    def pack(t):
        storages.append(t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    unique = {s.data_ptr(): s.nbytes() for s in storages}
    return int(sum(unique.values()))


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


def _online_lse(q, k, v, chunk_size):
    scale = q.shape[-1] ** -0.5
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)  # (..., L, 1), running log-sum-exp
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # (..., L, Dv), normalised so far
    for start in range(0, k.shape[-2], chunk_size):
        scores = q @ k[..., start:start + chunk_size, :].transpose(-2, -1) * scale  # (..., L, c)
        chunk_lse = torch.logsumexp(scores, -1, keepdim=True)
        new_lse = torch.logaddexp(lse, chunk_lse)
        chunk_out = torch.softmax(scores, -1) @ v[..., start:start + chunk_size, :]
        out = out * torch.exp(lse - new_lse) + chunk_out * torch.exp(chunk_lse - new_lse)
        lse = new_lse
    return out


def _online_both_chunked(q, k, v, chunk_size):
    rows = []
    for q0 in range(0, q.shape[-2], 2):  # queries two at a time, keys chunk by chunk
        qc = q[..., q0:q0 + 2, :] / math.sqrt(q.shape[-1])
        m = l = acc = None
        for k0 in range(0, k.shape[-2], chunk_size):
            s = qc @ k[..., k0:k0 + chunk_size, :].transpose(-2, -1)
            m_new = s.amax(-1, keepdim=True) if m is None else torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            if m is None:
                l, acc = p.sum(-1, keepdim=True), p @ v[..., k0:k0 + chunk_size, :]
            else:
                l = l * torch.exp(m - m_new) + p.sum(-1, keepdim=True)
                acc = acc * torch.exp(m - m_new) + p @ v[..., k0:k0 + chunk_size, :]
            m = m_new
        rows.append(acc / l)
    return torch.cat(rows, dim=-2)


ALTERNATIVES = {
    "04.attention_flops": [_flops_per_matmul, _flops_tensor],
    "04.saved_tensor_bytes": [_saved_dict, _saved_storages],
    "07.merge_partials": [_merge_where, _merge_nan_to_num],
    "07.online_softmax_attention": [_online_lse, _online_both_chunked],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lessons_04_and_07_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)
    assert {"04", "07"} == {task_id.split(".")[0] for task_id in OURS}
    for task_id in OURS:
        assert 2 <= sum(t.split(".")[0] == task_id.split(".")[0] for t in OURS) <= 4


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


# --- robustness ----------------------------------------------------------------------------


def test_number_tasks_reject_garbage_with_a_message():
    for task_id in ("04.attention_flops", "04.saved_tensor_bytes"):
        result = grade_function(TASKS[task_id], lambda *args: "not a number")
        assert result.score == 0 and "should return a number" in result.feedback
    result = grade_function(TASKS["04.saved_tensor_bytes"], lambda *args: 10.5)
    assert "whole number" in result.feedback


def test_flop_cases_are_counted_by_pytorch_not_by_our_formula():
    """The judge's expected counts come from FlopCounterMode; they agree with the formula of the lesson."""
    from attn_course.grading.tasks.lesson04 import _counted_flops

    for case in TASKS["04.attention_flops"].make_cases():
        B, H, L, S, D, Dv = case.args
        assert _counted_flops(*case.args) == 2 * B * H * L * S * (D + Dv)
