"""Lesson 02's tasks (split/merge heads and the forward pass in the sequence-first layout, and the
02.prune_heads stretch task): fair to other correct solutions.

``test_grading_catalogue.py`` proves every catalogued bug is rejected; these tests prove that
correct code written differently scores full marks, that building blocks stay allowed while the
task's own concept does not, and that odd return values fail with a message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attn_course as ac
from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.startswith("02.")]


def _split_chunks(x, h):
    return torch.stack(x.chunk(h, -1), 0).permute(2, 0, 1, 3)  # (H, L, B, D) -> (B, H, L, D)


def _split_reshape_then_permute(x, h):
    L, B, E = x.shape
    return x.reshape(L, B, h, E // h).permute(1, 2, 0, 3).contiguous()


def _merge_unbind(x):
    return torch.cat(x.unbind(1), -1).transpose(0, 1)  # H x (B, L, D) -> (B, L, E) -> (L, B, E)


def _merge_two_transposes(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B, L, H * D).transpose(0, 1)


def _mha_fused_kernel(x, w, b, wo, bo, H):
    """Projections by hand, PyTorch's fused attention kernel for the per-head step: a building block here."""
    L, B, E = x.shape
    q, k, v = F.linear(x, w, b).chunk(3, -1)  # 3 x (L, B, E)
    q, k, v = (t.reshape(L, B, H, E // H).permute(1, 2, 0, 3) for t in (q, k, v))  # (B, H, L, D)
    context = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    return F.linear(context.permute(2, 0, 1, 3).reshape(L, B, E), wo, bo)  # (L, B, E)


def _mha_per_head_loop(x, w, b, wo, bo, H):
    """One head at a time, summing each head's share of the output projection (lesson 02's W^O view)."""
    L, B, E = x.shape
    D = E // H
    q, k, v = F.linear(x, w, b).transpose(0, 1).chunk(3, -1)  # 3 x (B, L, E)
    out = bo.expand(B, L, E).clone()
    for h in range(H):
        part = slice(h * D, (h + 1) * D)
        weights = torch.softmax(q[..., part] @ k[..., part].transpose(-2, -1) / D**0.5, dim=-1)  # (B, L, L)
        out = out + (weights @ v[..., part]) @ wo[:, part].T  # (B, L, E)
    return out.transpose(0, 1)  # (L, B, E)


def _prune_boolean_rows(in_w, in_b, out_w, H, keep):
    E = in_w.shape[1]
    kept = torch.zeros(H, dtype=torch.bool)
    kept[list(keep)] = True
    per_feature = kept.repeat_interleave(E // H)  # (E,): True for features of kept heads, in head order
    return in_w[per_feature.repeat(3)], in_b[per_feature.repeat(3)], out_w[:, per_feature]


def _prune_sorted_consistently(in_w, in_b, out_w, H, keep):
    """Heads in sorted order on both sides: a different order than keep's, and just as right."""
    E = in_w.shape[1]
    D = E // H
    rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in sorted(keep)])
    return in_w[torch.cat([rows, rows + E, rows + 2 * E])].clone(), in_b[torch.cat([rows, rows + E, rows + 2 * E])], out_w[:, rows]


ALTERNATIVES = {
    "02.split_heads": [_split_chunks, _split_reshape_then_permute],
    "02.merge_heads": [_merge_unbind, _merge_two_transposes],
    "02.mha_forward": [_mha_fused_kernel, _mha_per_head_loop],
    "02.prune_heads": [_prune_boolean_rows, _prune_sorted_consistently],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_02_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_a_function_returning_garbage_fails_with_a_message():
    for task_id in OURS:
        result = grade_function(TASKS[task_id], lambda *args: "not a tensor")
        assert result.score == 0
        expected = "tuple of three tensors" if task_id == "02.prune_heads" else "should return a torch.Tensor"
        assert expected in result.feedback, (task_id, result.feedback)


def test_the_tasks_use_pytorchs_default_layout():
    """mha_forward's expected output is nn.MultiheadAttention's with batch_first=False."""
    task = TASKS["02.mha_forward"]
    x, w, b, wo, bo, H = task.make_cases()[0].args
    L, B, E = x.shape
    assert L != B, "a case where the two leading axes have equal sizes could not tell the layouts apart"
    module = nn.MultiheadAttention(E, H, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": w, "in_proj_bias": b, "out_proj.weight": wo, "out_proj.bias": bo})
    torch.testing.assert_close(task.reference(*task.make_cases()[0].args), module(x, x, x)[0], rtol=1e-12, atol=1e-12)


def test_most_mha_cases_have_several_heads_and_a_batch():
    cases = TASKS["02.mha_forward"].make_cases()
    several = [c for c in cases if c.args[-1] >= 2 and c.args[0].shape[1] >= 2]
    assert len(several) >= len(cases) - 1


def test_pruned_weights_run_in_a_real_smaller_layer():
    """The reference's pruned weights, loaded into an nn.MultiheadAttention-shaped computation, match the silenced layer."""
    torch.manual_seed(0)
    full = nn.MultiheadAttention(12, 3, batch_first=True, dtype=torch.float64).eval()
    w, b, wo = TASKS["02.prune_heads"].reference(full.in_proj_weight, full.in_proj_bias, full.out_proj.weight, 3, [2, 0])
    x = torch.randn(2, 5, 12, dtype=torch.float64)  # (B, L, E)
    q, k, v = (ac.split_heads(t, 2) for t in F.linear(x, w, b).chunk(3, -1))  # (B, 2, L, 4)
    pruned = F.linear(ac.merge_heads(F.scaled_dot_product_attention(q, k, v)), wo, full.out_proj.bias)
    silenced = ac.MultiHeadAttention.from_torch(full)
    with torch.no_grad():
        silenced.out_proj.weight[:, 4:8] = 0  # head 1 removed
    torch.testing.assert_close(pruned, silenced(x), rtol=1e-12, atol=1e-12)
