"""The lesson 09 tasks: fair to other correct solutions (lesson 10's are in test_grading_lesson10.py).

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove that correct code written differently from the reference scores full marks, and
that the graded behaviour is the library's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] == "09"]


def test_lesson_09_has_graded_tasks():
    assert sorted(OURS) == [
        "09.add_class_token_and_positions",
        "09.patchify",
        "09.vit_attention",
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


OTHER_CORRECT = [
    ("09.patchify", _patchify_unfold),
    ("09.patchify", _patchify_f_unfold),
    ("09.add_class_token_and_positions", _embed_loop),
    ("09.add_class_token_and_positions", _embed_repeat),
    ("09.vit_attention", _vit_attention_einsum),
    ("09.vit_attention", _vit_attention_sdpa),
]


@pytest.mark.parametrize("task_id,fn", OTHER_CORRECT, ids=[f"{t}:{f.__name__}" for t, f in OTHER_CORRECT])
def test_other_correct_solutions_score_full_marks(task_id, fn):
    result = grade_function(TASKS[task_id], fn)
    assert result.score == result.max_score, result.report()


def test_vit_attention_cases_include_n_equal_h():
    """With N == H the article's (B, N, H, H) weights have the right shape: only values can tell."""
    cases = TASKS["09.vit_attention"].make_cases()
    assert any(case.args[0].shape[1] == case.args[-1] for case in cases)
