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


def _decode_torch(q, k, v, lengths):
    """PyTorch's attention with a mask built by hand: allowed (the task is the mask, not attention)."""
    T, S = q.shape[-2], k.shape[-2]
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # (T, S), bottom-right aligned
    real = torch.arange(S) >= (S - lengths)[:, None]  # (B, S), left padding
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & real[:, None, None, :])


def _decode_manual(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    future = torch.arange(S)[None, :] > torch.arange(S - T, S)[:, None]  # (T, S)
    padding = torch.arange(S)[None, :] < (S - lengths)[:, None]  # (B, S)
    blocked = future | padding[:, None, None, :]  # (B, 1, T, S)
    weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
    weights = torch.where(blocked.all(-1, keepdim=True), 0.0, weights)  # padding queries: no weights, no NaN
    return weights @ v


def _decode_float32_inside(q, k, v, lengths):
    """Half precision computed in float32 and cast back, with the course's attention."""
    T, S = q.shape[-2], k.shape[-2]
    slots = torch.arange(S)
    allowed = (slots <= torch.arange(S - T, S)[:, None]) & (slots >= (S - lengths)[:, None, None, None])
    wide = torch.promote_types(q.dtype, torch.float32)
    return ac.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide), allowed).to(q.dtype)


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
    "11.decode_attention": [_decode_torch, _decode_manual, _decode_float32_inside],
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


def test_decode_cases_have_a_padded_batch_with_several_new_tokens_and_padding_queries():
    cases = TASKS["11.decode_attention"].make_cases()
    shapes = [(tuple(c.args[0].shape), c.args[1].shape[-2], c.args[3].tolist(), c.args[0].dtype) for c in cases]
    assert any(B >= 2 and H >= 2 and 2 <= T < S and min(lengths) < S for (B, H, T, _), S, lengths, _ in shapes), shapes
    padding_queries = [dtype for (_, _, T, _), S, lengths, dtype in shapes if T > min(lengths)]
    assert torch.float64 in padding_queries and torch.float16 in padding_queries, shapes
    assert sum(dtype == torch.float16 for *_, dtype in shapes) == 2, shapes


def test_repeat_interleave_is_delegation_by_every_route():
    for fn in (lambda x, n: x.repeat_interleave(n, dim=1), lambda x, n: torch.repeat_interleave(x, n, dim=1)):
        result = grade_function(TASKS["11.repeat_kv"], fn)
        assert result.score == 0 and "repeat_interleave" in result.feedback, result.report()


def test_generation_that_recomputes_the_prefix_loses_every_generating_check():
    from attn_course.grading.tasks.lesson11 import _generate_full_recompute

    result = grade_function(TASKS["11.rope_generation"], _generate_full_recompute)
    passed = {c.name for c in result.checks if c.passed}
    assert passed == {"returns (B, steps, E) in the prompt's dtype", "the prompt step: the output at the last prompt position",
                      "leaves the prompt unchanged"}, result.report()


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
