"""The lesson 01-03 tasks: fair to other correct solutions.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference still scores
full marks, and a garbage return value fails with a message.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] in {"01", "02", "03"}]


def _softmax_where(x):
    m = x.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def _softmax_logsumexp(x):
    return torch.nan_to_num(torch.exp(x - torch.logsumexp(x, -1, keepdim=True)))


def _attention_einsum(q, k, v):
    scores = torch.einsum("...ld,...sd->...ls", q, k) * q.shape[-1] ** -0.5  # (..., L, S)
    return torch.einsum("...ls,...sd->...ld", torch.softmax(scores, -1), v)  # (..., L, Dv)


def _attention_logsumexp(q, k, v):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (..., L, S)
    return torch.exp(scores - scores.logsumexp(dim=-1, keepdim=True)) @ v  # (..., L, Dv)


def _mha_chunked_qkv(x, w, b, wo, bo, H):
    B, L, E = x.shape
    q, k, v = F.linear(x, w, b).chunk(3, -1)  # 3 x (B, L, E)
    q, k, v = (t.view(B, L, H, E // H).transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
    context = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    return F.linear(context.transpose(1, 2).reshape(B, L, E), wo, bo)  # (B, L, E)


def _mha_torch_module(x, w, b, wo, bo, H):
    module = nn.MultiheadAttention(x.shape[-1], H, batch_first=True, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": w, "in_proj_bias": b, "out_proj.weight": wo, "out_proj.bias": bo})
    return module(x, x, x, need_weights=False)[0]


def _padding_loop(lengths, max_len):
    mask = torch.zeros(len(lengths), max_len, dtype=torch.bool)
    for row, n in enumerate(lengths.tolist()):
        mask[row, :n] = True
    return mask


def _masked_torch_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _masked_finfo_min(q, k, v, mask):
    scores = q @ k.mT / math.sqrt(q.shape[-1])  # (..., L, S)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    out = torch.softmax(scores, -1) @ v  # (..., L, Dv)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))


ALTERNATIVES = {
    "01.stable_softmax": [_softmax_where, _softmax_logsumexp],
    # Calling F.scaled_dot_product_attention is delegation since issue 11: a catalogue entry of the task now.
    "01.attention": [_attention_einsum, _attention_logsumexp],
    "02.split_heads": [
        lambda x, h: torch.stack(x.chunk(h, -1), 1),
        lambda x, h: x.unflatten(-1, (h, -1)).permute(0, 2, 1, 3).contiguous(),
    ],
    "02.merge_heads": [lambda x: torch.cat(x.unbind(1), -1), lambda x: x.permute(0, 2, 1, 3).flatten(2)],
    "02.mha_forward": [_mha_chunked_qkv, _mha_torch_module],
    "03.causal_mask": [lambda L, S: torch.arange(S)[None, :] <= torch.arange(L)[:, None]],
    "03.padding_mask": [_padding_loop, lambda lengths, max_len: torch.arange(max_len) < lengths.unsqueeze(1)],
    "03.masked_attention": [_masked_torch_sdpa, _masked_finfo_min],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lessons_01_to_03_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)
    assert {"01", "02", "03"} == {task_id.split(".")[0] for task_id in OURS}


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_a_function_returning_garbage_fails_with_a_message():
    for task_id in OURS:
        result = grade_function(TASKS[task_id], lambda *args: "not a tensor")
        assert result.score == 0
        assert "should return a torch.Tensor" in result.feedback
