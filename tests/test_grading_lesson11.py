"""The lesson 11 tasks: fair to other correct solutions, and their cases hold the bugs they claim.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference scores full
marks, and the cases contain what the checks say they contain.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attn_course as ac
from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.startswith("11.")]


# --- other correct solutions ---------------------------------------------------------------


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


def _rotary_float32_angles_cast_cos_sin(x, positions):
    """Angles, cos and sin in float32 (float64 for float64 x); cos and sin cast to x's dtype; products in x's dtype."""
    D = x.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    angles = positions.to(dtype)[:, None] * 10000.0 ** (-torch.arange(0, D, 2, dtype=dtype) / D)  # (L, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def _generate_with_kv_cache_class(layer, prompt, steps):
    """Preallocated ac.KVCache buffers, ac.apply_rotary, every prompt query computed."""
    B, P, E = prompt.shape
    H = layer.num_heads
    cache = ac.KVCache(B, H, layer.head_dim, P + steps, dtype=prompt.dtype)

    def step(x, start):
        positions = torch.arange(start, start + x.shape[1])
        q = ac.apply_rotary(ac.split_heads(layer.q_proj(x), H), positions)
        k = ac.apply_rotary(ac.split_heads(layer.k_proj(x), H), positions)
        keys, values = cache.append(k, ac.split_heads(layer.v_proj(x), H))
        T, S = x.shape[1], keys.shape[2]
        context = ac.scaled_dot_product_attention(q, keys, values, ac.causal_mask(S)[S - T :])
        return layer.out_proj(ac.merge_heads(context))[:, -1:]

    with torch.no_grad():
        outputs = [step(prompt, 0)]
        for i in range(1, steps):
            outputs.append(step(outputs[-1], P + i - 1))
    return torch.cat(outputs, dim=1)


def _generate_last_query_only(layer, prompt, steps):
    """Only the last prompt position's query is computed: the others' outputs are never used."""
    B, P, E = prompt.shape
    H, D = layer.num_heads, layer.head_dim

    def heads(t):
        return t.view(B, -1, H, D).transpose(1, 2)  # (B, H, T, D)

    def rope(t, positions):
        return _rotary_complex(t, positions)

    with torch.no_grad():
        keys = rope(heads(layer.k_proj(prompt)), torch.arange(P))
        values = heads(layer.v_proj(prompt))
        x, outputs = prompt[:, -1:], []
        q = rope(heads(layer.q_proj(x)), torch.tensor([P - 1]))
        for i in range(steps):
            if i > 0:
                position = torch.tensor([P + i - 1])
                q = rope(heads(layer.q_proj(x)), position)
                keys = torch.cat([keys, rope(heads(layer.k_proj(x)), position)], dim=2)
                values = torch.cat([values, heads(layer.v_proj(x))], dim=2)
            weights = torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(D), dim=-1)  # (B, H, 1, S)
            x = layer.out_proj((weights @ values).transpose(1, 2).reshape(B, 1, E))  # (B, 1, E)
            outputs.append(x)
    return torch.cat(outputs, dim=1)


ALTERNATIVES = {
    "11.repeat_kv": [_repeat_expand, _repeat_index],
    "11.decode_attention": [_decode_torch, _decode_manual],
    "11.rotary": [_rotary_complex, _rotary_float32_angles_cast_cos_sin],
    "11.rope_generation": [_generate_with_kv_cache_class, _generate_last_query_only],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_11_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


# --- the cases hold what the checks claim ------------------------------------------------------


def test_decode_cases_have_a_batch_with_several_new_tokens():
    shapes = [tuple(case.args[0].shape) for case in TASKS["11.decode_attention"].make_cases()]
    assert any(B >= 2 and H >= 2 and T >= 2 for B, H, T, _ in shapes), shapes


def _rotary_angles_in_input_dtype(x, positions):
    """The solution the course shipped before issue 16: every angle in x's dtype."""
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=x.dtype) / D)
    angles = positions.to(x.dtype)[:, None] * theta
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def test_rotary_low_precision_cases_reject_angles_in_the_input_dtype():
    result = grade_function(TASKS["11.rotary"], _rotary_angles_in_input_dtype)
    failed = [c.name for c in result.checks if not c.passed]
    assert failed == ["bfloat16 and float16 at long positions: angles computed in float32 or float64"], result.report()
    assert "cannot even hold these positions" in result.feedback


def test_generation_cases_feed_outputs_back():
    """The generated vectors are the layer's outputs fed back: the full loop gives the same values."""
    from attn_course.grading.tasks.lesson11 import _generate_full_recompute, _generate_reference

    for case in TASKS["11.rope_generation"].make_cases():
        cached, full = _generate_reference(*case.args), _generate_full_recompute(*case.args)
        # float64: measured 2e-16; float32: 3e-8
        assert (cached.double() - full.double()).abs().max() < (1e-6 if cached.dtype == torch.float32 else 1e-12)
