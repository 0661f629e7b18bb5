"""The lesson 09-10 tasks: fair to other correct solutions.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove that correct code written differently from the reference scores full marks, and
that the graded behaviour is the library's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_course.conformer import ConvolutionModule
from attn_course.grading import TASKS, grade_function
from attn_course.positional import rel_shift

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] in {"09", "10"}]


def test_lessons_09_and_10_have_graded_tasks():
    assert sorted(OURS) == [
        "09.add_class_token_and_positions",
        "09.patchify",
        "09.vit_attention",
        "10.conv_module",
        "10.rel_shift",
    ]


# --- other correct solutions -----------------------------------------------------------------


def _patchify_unfold(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    x = images.unfold(2, p, p).unfold(3, p, p)  # (B, C, H/p, W/p, p, p)
    return x.permute(0, 2, 3, 1, 4, 5).reshape(B, -1, C * p * p)  # (B, N, C p p)


def _patchify_f_unfold(images, patch_size):
    return F.unfold(images, kernel_size=patch_size, stride=patch_size).transpose(1, 2)  # (B, N, C p p)


def _embed_loop(patches, class_token, positions):
    rows = [torch.cat((class_token[0], patches[b]), dim=0) + positions for b in range(patches.shape[0])]
    return torch.stack(rows)  # (B, N+1, E)


def _embed_repeat(patches, class_token, positions):
    tokens = torch.cat((class_token.repeat(patches.shape[0], 1, 1), patches), dim=1)  # (B, N+1, E)
    return tokens + positions.unsqueeze(0)


def _vit_attention_einsum(x, w, b, wo, bo, H):
    B, N, E = x.shape
    D = E // H
    qkv = F.linear(x, w, b).view(B, N, 3, H, D)  # (B, N, 3, H, D)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, N, H, D) each
    weights = torch.einsum("bihd,bjhd->bhij", q, k).mul(D**-0.5).softmax(-1)  # (B, H, N, N)
    out = torch.einsum("bhij,bjhd->bihd", weights, v).reshape(B, N, E)  # (B, N, E)
    return out @ wo.T + bo


def _vit_attention_sdpa(x, w, b, wo, bo, H):
    B, N, E = x.shape
    q, k, v = F.linear(x, w, b).reshape(B, N, 3, H, E // H).permute(2, 0, 3, 1, 4)  # (B, H, N, D) each
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, D)
    return F.linear(out.transpose(1, 2).reshape(B, N, E), wo, bo)


def _rel_shift_gather(scores):
    L = scores.shape[-2]
    index = (L - 1) - torch.arange(L)[:, None] + torch.arange(L)[None, :]  # (L, L)
    return scores.gather(-1, index.expand(*scores.shape[:-1], L))  # (..., L, L)


def _rel_shift_loop(scores):
    L = scores.shape[-2]
    return torch.stack([scores[..., i, L - 1 - i : 2 * L - 1 - i] for i in range(L)], dim=-2)  # (..., L, L)


def _conv_module_via_library(x, keep, weights):
    module = ConvolutionModule(x.shape[-1], kernel_size=weights["depthwise.weight"].shape[-1], dropout=0.0,
                               dtype=x.dtype)
    module.load_state_dict(weights, strict=False)
    with torch.no_grad():
        return module.eval()(x, keep)


def _conv_module_zero_after_glu_by_multiply(x, keep, w):
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"])  # (B, T, E)
    y = torch.nn.functional.glu(F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"]), dim=1)
    y = y * keep[:, None, :].to(y.dtype)  # (B, E, T)
    K = w["depthwise.weight"].shape[-1]
    y = F.conv1d(F.pad(y, (K // 2, K // 2)), w["depthwise.weight"], w["depthwise.bias"], groups=y.shape[1])
    y = (y - w["batch_norm.running_mean"][:, None]) / torch.sqrt(w["batch_norm.running_var"][:, None] + 1e-5)
    y = y * w["batch_norm.weight"][:, None] + w["batch_norm.bias"][:, None]  # (B, E, T)
    return F.conv1d(y * torch.sigmoid(y), w["pointwise2.weight"], w["pointwise2.bias"]).transpose(1, 2)


OTHER_CORRECT = [
    ("09.patchify", _patchify_unfold),
    ("09.patchify", _patchify_f_unfold),
    ("09.add_class_token_and_positions", _embed_loop),
    ("09.add_class_token_and_positions", _embed_repeat),
    ("09.vit_attention", _vit_attention_einsum),
    ("09.vit_attention", _vit_attention_sdpa),
    ("10.rel_shift", _rel_shift_gather),
    ("10.rel_shift", _rel_shift_loop),
    ("10.conv_module", _conv_module_via_library),
    ("10.conv_module", _conv_module_zero_after_glu_by_multiply),
]


@pytest.mark.parametrize("task_id,fn", OTHER_CORRECT, ids=[f"{t}:{f.__name__}" for t, f in OTHER_CORRECT])
def test_other_correct_solutions_score_full_marks(task_id, fn):
    result = grade_function(TASKS[task_id], fn)
    assert result.score == result.max_score, result.report()


def test_conv_module_grading_ignores_padded_frames_but_not_leaks():
    """Garbage at padded output frames is fine; padding that leaks into real frames is not."""
    task = TASKS["10.conv_module"]

    def garbage_at_padding(x, keep, weights):
        out = task.reference(x, keep, weights)
        return out.masked_fill(~keep[:, :, None], 1e6)

    assert grade_function(task, garbage_at_padding).score == grade_function(task, task.reference).max_score
    cases = task.make_cases()
    assert any(not bool(case.args[1].all()) for case in cases), "some case must have padding"


def test_rel_shift_cases_include_l_equal_one_and_batches():
    shapes = [tuple(case.args[0].shape) for case in TASKS["10.rel_shift"].make_cases()]
    assert (1, 1, 1) in shapes and any(len(s) > 2 for s in shapes)
    for case in TASKS["10.rel_shift"].make_cases():
        (scores,) = case.args
        torch.testing.assert_close(_rel_shift_loop(scores), rel_shift(scores), rtol=0, atol=0)


def test_vit_attention_cases_include_n_equal_h():
    """With N == H the article's (B, N, H, H) weights have the right shape: only values can tell."""
    cases = TASKS["09.vit_attention"].make_cases()
    assert any(case.args[0].shape[1] == case.args[-1] for case in cases)
