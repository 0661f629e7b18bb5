"""The lesson 04-07 tasks: fair to other correct solutions.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference scores full
marks; number tasks reject garbage; FLOP cases are counted by PyTorch; and a diagnosis is never
offered for a "bug" that gives the right answer on that case.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function
from attn_course.grading.tasks._variants import distinct_match

# Lessons 04 and 07 have their own files (tests/test_grading_lesson04.py, tests/test_grading_lesson07.py).
OURS = [task_id for task_id in TASKS if task_id.split(".")[0] in {"05", "06"}]


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


def _block_loop(q, k, v, block_size):
    outputs = []
    for start in range(0, q.shape[-2], block_size):  # the last slice is simply shorter: no padding needed
        block = slice(start, start + block_size)
        outputs.append(F.scaled_dot_product_attention(q[..., block, :], k[..., block, :], v[..., block, :]))
    return torch.cat(outputs, dim=-2)


def _block_einsum(q, k, v, block_size):
    L, D = q.shape[-2], q.shape[-1]
    nb = math.ceil(L / block_size)
    pad = nb * block_size - L
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)).unflatten(-2, (nb, block_size)) for x in (q, k, v))  # (..., nb, b, D)
    scores = torch.einsum("...nqd,...nkd->...nqk", qp, kp) / math.sqrt(D)  # (..., nb, b, b)
    real = (torch.arange(nb * block_size) < L).view(nb, 1, block_size)  # (nb, 1, b)
    weights = scores.masked_fill(~real, float("-inf")).softmax(-1)  # (..., nb, b, b)
    out = torch.einsum("...nqk,...nkd->...nqd", weights, vp)  # (..., nb, b, Dv)
    return out.flatten(-3, -2)[..., :L, :]  # (..., L, Dv)


def _linear_einsum(q, k, v, mask):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1).to(phi_k.dtype)  # (..., S, M), padding zeroed
    kv = torch.einsum("...sm,...sd->...md", phi_k, v)  # (..., M, Dv)
    z = phi_k.sum(-2)  # (..., M)
    num = torch.einsum("...lm,...md->...ld", phi_q, kv)  # (..., L, Dv)
    den = torch.einsum("...lm,...m->...l", phi_q, z)[..., None]  # (..., L, 1)
    return num / (den + 1e-6)


def _linear_key_chunks(q, k, v, mask, chunk=64):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M), padding zeroed
    kv, z = 0, 0
    for start in range(0, k.shape[-2], chunk):
        part = phi_k[..., start : start + chunk, :]  # (..., c, M)
        kv = kv + part.transpose(-2, -1) @ v[..., start : start + chunk, :]  # (..., M, Dv)
        z = z + part.sum(-2)  # (..., M)
    return (phi_q @ kv) / ((phi_q * z[..., None, :]).sum(-1, keepdim=True) + 1e-6)


def _causal_rnn(q, k, v):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    state = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype)  # (..., M, Dv)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], dtype=q.dtype)  # (..., M)
    outputs = []
    for t in range(q.shape[-2]):
        state = state + phi_k[..., t, :, None] * v[..., t, None, :]
        z = z + phi_k[..., t, :]
        num = (phi_q[..., t, :, None] * state).sum(-2)  # (..., Dv)
        outputs.append(num / ((phi_q[..., t, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outputs, dim=-2)


def _causal_chunked_cumsum(q, k, v, chunk=32):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    carry_kv, carry_z, outputs = 0, 0, []
    for start in range(0, q.shape[-2], chunk):
        pk, pq, pv = (x[..., start : start + chunk, :] for x in (phi_k, phi_q, v))  # (..., c, M or Dv)
        kv = carry_kv + (pk[..., :, :, None] * pv[..., :, None, :]).cumsum(-3)  # (..., c, M, Dv)
        z = carry_z + pk.cumsum(-2)  # (..., c, M)
        num = (pq[..., :, :, None] * kv).sum(-2)  # (..., c, Dv)
        outputs.append(num / ((pq * z).sum(-1, keepdim=True) + 1e-6))
        carry_kv, carry_z = kv[..., -1:, :, :], z[..., -1:, :]  # sums up to the chunk's end
    return torch.cat(outputs, dim=-2)


ALTERNATIVES = {
    "05.sliding_window_mask": [_window_triangles, _window_loop],
    "05.block_local_attention": [_block_loop, _block_einsum],
    # The quadratic (L, S) forms are rejected since issue 11 (catalogue entries of kind "algorithm").
    "06.linear_attention": [_linear_einsum, _linear_key_chunks],
    "06.causal_linear_attention": [_causal_rnn, _causal_chunked_cumsum],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lessons_04_to_07_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)
    assert {"05", "06"} == {task_id.split(".")[0] for task_id in OURS}
    for task_id in OURS:
        assert 2 <= sum(t.split(".")[0] == task_id.split(".")[0] for t in OURS) <= 4


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


# --- robustness ----------------------------------------------------------------------------


def test_a_variant_equal_to_the_right_answer_is_never_a_diagnosis():
    """Full attention IS block-local attention when the block covers the sequence: no bogus hint there."""
    task = TASKS["05.block_local_attention"]
    long_block = next(c for c in task.make_cases() if "block_size=8" in c.name)
    q, k, v, block = long_block.args
    right = task.reference(q, k, v, block)
    message = distinct_match(right, right, [(lambda: F.scaled_dot_product_attention(q, k, v), "full attention")])
    assert message is None
    wrong = right + 1
    assert distinct_match(wrong, right, [(lambda: wrong.clone(), "off by one")]) == "Off by one"
