"""The lesson 08 and 11 tasks: fair to other correct solutions.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference scores full
marks, and the NaN-hunting cases really hold their bugs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] in {"08", "11"}]


# --- other correct solutions ---------------------------------------------------------------


def _entropy_xlogy(weights):
    return -torch.special.xlogy(weights, weights).sum(dim=-1)


def _entropy_clamped_copy(weights):
    return -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(-1)


def _entropy_article_per_row(weights):
    return -(weights * torch.log(weights + 1e-9)).sum(-1)  # the article's fudge, kept per row: close enough


def _qk_functional(q, k, v, scale):
    return F.scaled_dot_product_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=scale)


def _qk_manual(q, k, v, scale):
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scores = scale * torch.einsum("...ld,...sd->...ls", q, k)  # (..., L, S)
    return torch.einsum("...ls,...sd->...ld", scores.softmax(-1), v)  # (..., L, Dv)


def _nonfinite_raise_at_first(model, x):
    class Found(Exception):
        pass

    handles = []
    for name, module in model.named_modules():
        def hook(module, args, output, name=name):
            if not torch.isfinite(output).all():
                raise Found(name)

        handles.append(module.register_forward_hook(hook))
    try:
        model(x)
    except Found as found:
        return found.args[0]
    finally:
        for handle in handles:
            handle.remove()
    return None


def _nonfinite_list(model, x):
    bad = []

    def record(module, args, out, name):
        if not out.isfinite().all():
            bad.append(name)

    handles = [
        module.register_forward_hook(lambda m, a, out, name=name: record(m, a, out, name))
        for name, module in model.named_modules()
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return bad[0] if bad else None


def _repeat_expand(x, groups):
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


def _repeat_index(x, groups):
    return x.index_select(1, torch.arange(x.shape[1] * groups) // groups)


def _decode_torch(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # (T, S), bottom-right aligned
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _decode_manual(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    future = torch.arange(S)[None, :] > torch.arange(S - T, S)[:, None]  # (T, S)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def _rotary_complex(x, positions):
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = positions.double()[:, None] * theta  # (L, D/2)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (D // 2, 2)).contiguous())  # (..., L, D/2)
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)  # (..., L, D/2)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)  # (..., L, D)


def _rotary_matrix(x, positions):
    D = x.shape[-1]
    angles = positions.to(x.dtype)[:, None] * 10000.0 ** (-torch.arange(0, D, 2, dtype=x.dtype) / D)  # (L, D/2)
    cos, sin = angles.cos(), angles.sin()
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


ALTERNATIVES = {
    "08.attention_entropy": [_entropy_xlogy, _entropy_clamped_copy, _entropy_article_per_row],
    "08.qk_norm_attention": [_qk_functional, _qk_manual],
    "08.first_nonfinite_module": [_nonfinite_raise_at_first, _nonfinite_list],
    "11.repeat_kv": [_repeat_expand, _repeat_index],
    "11.decode_attention": [_decode_torch, _decode_manual],
    "11.rotary": [_rotary_complex, _rotary_matrix],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lessons_08_and_11_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)
    assert {"08", "11"} == {task_id.split(".")[0] for task_id in OURS}


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_first_nonfinite_cases_really_hold_their_bugs():
    """Each culprit is where the case says; the judge's hints rely on it."""
    from attn_course.grading.tasks.lesson08 import _first_nonfinite_reference

    answers = [_first_nonfinite_reference(*case.args) for case in TASKS["08.first_nonfinite_module"].make_cases()]
    assert answers == ["1", "blocks.1.mlp.0", "1", "early", None]
