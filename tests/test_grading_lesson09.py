"""The lesson 09 tasks: fair to other correct solutions, strict about delegation, cases that expose bugs.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why one) and that the judges survive the batch grader's round trip, odd return
values and errors. These tests prove that correct code written differently from the reference
scores full marks, that calling the implementation a task asks for scores zero whichever way it is
reached, and that the cases are the ones the issue asks for (several heads and a batch, N == H).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn_course as ac
from attn_course.grading import TASKS, grade_function
from attn_course.positional import sinusoidal_encoding
from attn_course.vit import sincos_positions_2d

OURS = [task_id for task_id in TASKS if task_id.split(".")[0] == "09"]


def test_lesson_09_has_graded_tasks_and_a_stretch_task():
    assert sorted(OURS) == [
        "09.add_class_token_and_positions",
        "09.patchify",
        "09.sincos_positions_2d",
        "09.vit_attention",
    ]
    assert [t for t in OURS if TASKS[t].stretch] == ["09.sincos_positions_2d"]


# --- other correct solutions -----------------------------------------------------------------


def _divides(images, p):
    if images.shape[-2] % p or images.shape[-1] % p:
        raise ValueError(f"patch_size={p} does not divide {tuple(images.shape[-2:])}")


def _patchify_unfold(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    _divides(images, p)
    x = images.unfold(2, p, p).unfold(3, p, p)  # (B, C, H/p, W/p, p, p): Tensor.unfold is a view, allowed
    return x.permute(0, 2, 3, 1, 4, 5).reshape(B, -1, C * p * p)  # (B, N, C p p)


def _patchify_loop(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    _divides(images, p)
    squares = [images[:, :, r : r + p, c : c + p].reshape(B, -1) for r in range(0, H, p) for c in range(0, W, p)]
    return torch.stack(squares, dim=1)  # (B, N, C p p)


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
    """Scaled dot-product attention is a building block here: the task is where the heads go."""
    B, N, E = x.shape
    q, k, v = F.linear(x, w, b).reshape(B, N, 3, H, E // H).permute(2, 0, 3, 1, 4)  # (B, H, N, D) each
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, D)
    return F.linear(out.transpose(1, 2).reshape(B, N, E), wo, bo)


def _vit_attention_course_blocks(x, w, b, wo, bo, H):
    """Lesson 02's split_heads / merge_heads and lesson 01's attention, as building blocks."""
    q, k, v = (ac.split_heads(t, H) for t in F.linear(x, w, b).chunk(3, dim=-1))  # (B, H, N, D) each
    return F.linear(ac.merge_heads(ac.scaled_dot_product_attention(q, k, v)), wo, bo)  # (B, N, E)


def _sincos_from_the_1d_table(grid_height, grid_width, dim):
    if dim % 4:
        raise ValueError(f"dim must be a multiple of 4, got {dim}")
    rows, cols = torch.meshgrid(torch.arange(grid_height), torch.arange(grid_width), indexing="ij")  # (Hg, Wg)
    return torch.cat((sinusoidal_encoding(cols.flatten(), dim // 2), sinusoidal_encoding(rows.flatten(), dim // 2)), -1)


def _sincos_loop(grid_height, grid_width, dim):
    if dim % 4:
        raise ValueError("dim % 4 != 0")
    table = torch.zeros(grid_height * grid_width, dim, dtype=torch.float64)
    for n in range(grid_height * grid_width):
        r, c = divmod(n, grid_width)
        for k in range(dim // 4):
            w = 10000.0 ** (-k / (dim // 4))
            table[n, 2 * k], table[n, 2 * k + 1] = torch.tensor(c * w).sin(), torch.tensor(c * w).cos()
            j = dim // 2 + 2 * k
            table[n, j], table[n, j + 1] = torch.tensor(r * w).sin(), torch.tensor(r * w).cos()
    return table


OTHER_CORRECT = [
    ("09.patchify", _patchify_unfold),
    ("09.patchify", _patchify_loop),
    ("09.add_class_token_and_positions", _embed_loop),
    ("09.add_class_token_and_positions", _embed_repeat),
    ("09.vit_attention", _vit_attention_einsum),
    ("09.vit_attention", _vit_attention_sdpa),
    ("09.vit_attention", _vit_attention_course_blocks),
    ("09.sincos_positions_2d", _sincos_from_the_1d_table),
    ("09.sincos_positions_2d", _sincos_loop),
]


@pytest.mark.parametrize("task_id,fn", OTHER_CORRECT, ids=[f"{t}:{f.__name__}" for t, f in OTHER_CORRECT])
def test_other_correct_solutions_score_full_marks(task_id, fn):
    result = grade_function(TASKS[task_id], fn)
    assert result.score == result.max_score, result.report()


def test_the_graded_behaviour_is_the_librarys():
    for case in TASKS["09.patchify"].make_cases():
        images, p = case.args
        if images.shape[-2] % p or images.shape[-1] % p:  # both raise ValueError (issue 20: cropping was accepted)
            for fn in (TASKS["09.patchify"].reference, ac.patchify):
                with pytest.raises(ValueError):
                    fn(*case.args)
            continue
        torch.testing.assert_close(TASKS["09.patchify"].reference(*case.args), ac.patchify(*case.args), rtol=0, atol=0)
    for case in TASKS["09.sincos_positions_2d"].make_cases()[:4]:
        torch.testing.assert_close(TASKS["09.sincos_positions_2d"].reference(*case.args),
                                   sincos_positions_2d(*case.args, dtype=torch.float64), rtol=0, atol=1e-12)


# --- delegation scores zero, however the implementation is reached -------------------------------


def _patchify_via_module(images, patch_size):
    return torch.nn.Unfold(kernel_size=patch_size, stride=patch_size)(images).transpose(1, 2)


def _patchify_via_package(images, patch_size):
    return ac.patchify(images, patch_size)


def _sincos_via_model(grid_height, grid_width, dim):
    from attn_course import vit

    return vit.sincos_positions_2d(grid_height, grid_width, dim, dtype=torch.float64)


def _vit_attention_via_course_layer(x, w, b, wo, bo, H):
    E = x.shape[-1]
    layer = ac.MultiHeadAttention(E, H, dtype=x.dtype)
    with torch.no_grad():
        for proj, weight, bias in zip((layer.q_proj, layer.k_proj, layer.v_proj), w.chunk(3), b.chunk(3)):
            proj.weight.copy_(weight)
            proj.bias.copy_(bias)
        layer.out_proj.weight.copy_(wo)
        layer.out_proj.bias.copy_(bo)
        return layer(x)


DELEGATING = [
    ("09.patchify", _patchify_via_module, "torch.nn.Unfold"),
    ("09.patchify", _patchify_via_package, "patchify"),
    ("09.vit_attention", _vit_attention_via_course_layer, "MultiHeadAttention"),
    ("09.sincos_positions_2d", _sincos_via_model, "sincos_positions_2d"),
]


@pytest.mark.parametrize("task_id,fn,named", DELEGATING, ids=[f"{t}:{f.__name__}" for t, f, _ in DELEGATING])
def test_calling_the_implementation_scores_zero(task_id, fn, named):
    result = grade_function(TASKS[task_id], fn)
    assert result.score == 0, result.report()
    assert "you called" in result.feedback and named in result.feedback, result.report()


# --- the cases --------------------------------------------------------------------------------


def test_vit_attention_cases_have_heads_and_batches_and_include_n_equal_h():
    """With N == H the article's (B, N, H, H) weights have the right shape: only values can tell."""
    cases = TASKS["09.vit_attention"].make_cases()
    assert all(case.args[-1] >= 2 and case.args[0].shape[0] >= 2 for case in cases), "every case: H >= 2 and B >= 2"
    assert sum(case.args[0].shape[1] == case.args[-1] for case in cases) >= 2
    assert any(case.args[0].shape[1] != case.args[-1] for case in cases)


def test_patchify_cases_cover_channels_and_non_square_images():
    shapes = [tuple(case.args[0].shape) + (case.args[1],) for case in TASKS["09.patchify"].make_cases()]
    assert sum(C == 1 for _, C, _, _, _ in shapes) >= 2 and sum(C > 1 for _, C, _, _, _ in shapes) >= 2
    assert any(H != W for _, _, H, W, _ in shapes) and all(B >= 2 for B, *_ in shapes)
    assert sum(H % p != 0 for _, _, H, _, p in shapes) >= 1 and sum(W % p != 0 for *_, W, p in shapes) >= 1


def test_sincos_cases_have_non_square_grids_and_bad_dims():
    args = [case.args for case in TASKS["09.sincos_positions_2d"].make_cases()]
    assert sum(h != w for h, w, d in args if d % 4 == 0) >= 2
    assert sum(d % 4 != 0 for _, _, d in args) >= 2
