"""Lesson 10's tasks: fair to other correct solutions, cases that expose the bugs, the stretch task's oracle.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why one), that the judges survive the batch grader's round trip, odd return values
and errors. These tests prove that correct code written differently from the reference scores full
marks, that the cases can tell the wrong shifts apart, and that the graded behaviour is the library's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_course.conformer import ConvolutionModule
from attn_course.grading import TASKS, grade_function, run_cases
from attn_course.positional import rel_shift

OURS = sorted(task_id for task_id in TASKS if task_id.startswith("10."))


def test_lesson_10_has_two_tasks_and_a_stretch_task():
    assert OURS == ["10.conv_module", "10.rel_shift", "10.streaming_conv"]
    assert [TASKS[t].stretch for t in OURS] == [False, False, True]


# --- other correct solutions -----------------------------------------------------------------


def _rel_shift_loop(scores):
    """The definition, one row at a time: the oracle here (the task rejects it: a loop over positions)."""
    L = scores.shape[-2]
    return torch.stack([scores[..., i, L - 1 - i : 2 * L - 1 - i] for i in range(L)], dim=-2)  # (..., L, L)


def _rel_shift_unfold_diagonal(scores):
    """Views only: the windows of the flipped rows, and the diagonal that picks row i's window i."""
    L = scores.shape[-2]
    windows = scores.flip(-1).unfold(-1, L, 1)  # (..., L, L, L): window w of row i = flipped columns w..w+L-1
    return windows.diagonal(dim1=-3, dim2=-2).transpose(-1, -2).flip(-1)  # (..., L, L)


def _rel_shift_pad_twice(scores):
    """The trick written with two F.pad calls and explicit views, as some Conformer code does."""
    *batch, L, width = scores.shape
    padded = F.pad(scores, (1, 0)).view(*batch, 2 * L, L)  # (..., 2L, L)
    shifted = padded[..., 1:, :].contiguous().view(*batch, L, width)  # (..., L, 2L-1)
    return F.pad(shifted[..., :L], (0, 0))  # (..., L, L)


def _conv_module_zero_after_glu_by_multiply(x, keep, w):
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"])  # (B, T, E)
    y = F.glu(F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"]), dim=1)  # (B, E, T)
    y = y * keep[:, None, :].to(y.dtype)  # (B, E, T)
    K = w["depthwise.weight"].shape[-1]
    y = F.conv1d(F.pad(y, (K // 2, K // 2)), w["depthwise.weight"], w["depthwise.bias"], groups=y.shape[1])
    y = (y - w["batch_norm.running_mean"][:, None]) / torch.sqrt(w["batch_norm.running_var"][:, None] + 1e-5)
    y = y * w["batch_norm.weight"][:, None] + w["batch_norm.bias"][:, None]  # (B, E, T)
    return F.conv1d(y * torch.sigmoid(y), w["pointwise2.weight"], w["pointwise2.bias"]).transpose(1, 2)


def _stream_frame_by_frame(chunk, cache, w):
    """One frame at a time, the window written out as a sum over taps."""
    K = w["depthwise.weight"].shape[-1]
    y = F.layer_norm(chunk, chunk.shape[-1:], w["norm.weight"], w["norm.bias"])  # (B, C, E)
    a, b = (y @ w["pointwise1.weight"][:, :, 0].T + w["pointwise1.bias"]).chunk(2, dim=-1)  # (B, C, E) each
    history = torch.cat((cache, a * torch.sigmoid(b)), dim=1)  # (B, K-1+C, E)
    taps = w["depthwise.weight"][:, 0, :]  # (E, K)
    frames = []
    for t in range(chunk.shape[1]):
        window = history[:, t : t + K]  # (B, K, E): frames t-K+1 .. t of the chunk's clock
        z = (window * taps.T).sum(dim=1) + w["depthwise.bias"]  # (B, E)
        z = (z - w["batch_norm.running_mean"]) / torch.sqrt(w["batch_norm.running_var"] + 1e-5)
        z = F.silu(z * w["batch_norm.weight"] + w["batch_norm.bias"])  # (B, E)
        frames.append(z @ w["pointwise2.weight"][:, :, 0].T + w["pointwise2.bias"])
    return torch.stack(frames, dim=1), history[:, history.shape[1] - (K - 1) :].clone()


OTHER_CORRECT = [
    ("10.rel_shift", _rel_shift_unfold_diagonal),
    ("10.rel_shift", _rel_shift_pad_twice),
    ("10.conv_module", _conv_module_zero_after_glu_by_multiply),
    ("10.streaming_conv", _stream_frame_by_frame),
]


@pytest.mark.parametrize("task_id,fn", OTHER_CORRECT, ids=[f"{t}:{f.__name__}" for t, f in OTHER_CORRECT])
def test_other_correct_solutions_score_full_marks(task_id, fn):
    result = grade_function(TASKS[task_id], fn)
    assert result.score == result.max_score, result.report()


# --- 10.rel_shift: cases that can tell the shifts apart --------------------------------------


def test_rel_shift_reference_is_the_librarys_shift():
    task = TASKS["10.rel_shift"]
    for case in task.make_cases():
        (scores,) = case.args
        torch.testing.assert_close(task.reference(scores), rel_shift(scores), rtol=0, atol=0)
        torch.testing.assert_close(_rel_shift_loop(scores), rel_shift(scores), rtol=0, atol=0)
    noise = torch.randn(2, 3, 6, 11, dtype=torch.float64)
    torch.testing.assert_close(task.reference(noise), rel_shift(noise), rtol=0, atol=0)


def test_rel_shift_cases_have_batches_and_every_case_but_one_tells_every_wrong_shift_apart():
    """The old (1, 1, 1) case could not tell any shift from another; now only the L = 1 edge case is blind."""
    task = TASKS["10.rel_shift"]
    cases = task.make_cases()
    shapes = [tuple(case.args[0].shape) for case in cases]
    assert sum(len(shape) > 2 and shape[0] >= 2 for shape in shapes) >= 3, shapes
    values_entries = [entry.fn for entry in task.wrong.values() if entry.kind == "values"]
    blind = []
    for case in cases:
        (scores,) = case.args
        right = rel_shift(scores)
        if any(torch.equal(fn(scores).double(), right) for fn in values_entries):
            blind.append(tuple(scores.shape))
    assert blind == [(1, 1, 1)]


def test_rel_shift_largest_intermediate_solution_vs_selection_tensor():
    """Measured with the grader's probe on the long cases: the pad trick stays at the input's size."""
    task = TASKS["10.rel_shift"]
    cases = [case for case in task.make_cases() if case.args[0].shape[-2] >= 32]
    assert len(cases) == 2
    selection = task.wrong["one-hot (L, L, 2L-1) selection tensor"].fn
    for case, ours, naive in zip(cases, run_cases(task.reference, cases, measure=("largest",)),
                                 run_cases(selection, cases, measure=("largest",))):
        size = case.args[0].numel()
        assert ours.probe["largest_numel"] <= 1.1 * size  # the (..., L, 2L) padded copy
        assert naive.probe["largest_numel"] >= 16 * size  # (L, L, 2L-1) and the product before the sum


def test_rel_shift_rejects_index_tensors_and_loops_but_not_other_views():
    """The task is the Transformer-XL shift: the lesson's direct indexing and a row loop lose the "re-cuts" check only."""
    task = TASKS["10.rel_shift"]
    title = "re-cuts the memory of scores: no index tensor, gather or loop over positions"
    for name in ("gather with an (L, L) index", "rows indexed with their columns", "a Python loop over the rows"):
        result = grade_function(task, task.wrong[name].fn)
        failed = [c.name for c in result.checks if not c.passed]
        assert failed == [title], (name, result.report())
    for fn in (_rel_shift_unfold_diagonal, _rel_shift_pad_twice, *task.accepted.values()):
        (outcome, *_) = run_cases(fn, task.make_cases()[3:4], measure=task.measure)
        assert outcome.probe["op_count"] <= 10, (fn, outcome.probe)  # well inside the limit of 20


# --- 10.conv_module --------------------------------------------------------------------------


def test_conv_module_grading_ignores_padded_frames_but_not_leaks():
    """Garbage at padded output frames is fine; padding that leaks into real frames is not."""
    task = TASKS["10.conv_module"]

    def garbage_at_padding(x, keep, weights):
        out = task.reference(x, keep, weights)
        return out.masked_fill(~keep[:, :, None], 1e6)

    assert grade_function(task, garbage_at_padding).score == grade_function(task, task.reference).max_score
    cases = task.make_cases()
    assert sum(not bool(case.args[1].all()) for case in cases) >= 2, "two cases must have padding"
    assert sum(case.args[0].shape[0] >= 2 for case in cases) >= 2


def test_conv_module_failure_names_batch_frame_and_channel():
    """A wrong real frame is reported as (b, t, e) of the learner's output, not as an index into the real frames."""
    task = TASKS["10.conv_module"]

    def one_wrong_frame(x, keep, weights):
        out = task.reference(x, keep, weights).clone()
        out[1, 3, 2] += 1.0  # a real frame of the second clip in every case with B >= 2
        return out

    result = grade_function(task, one_wrong_frame)
    assert result.score < result.max_score
    assert "at index (1, 3, 2)" in result.feedback, result.feedback


def test_conv_module_reference_is_the_librarys_module():
    task = TASKS["10.conv_module"]
    for case in task.make_cases():
        x, keep, weights = case.args
        module = ConvolutionModule(x.shape[-1], kernel_size=weights["depthwise.weight"].shape[-1], dropout=0.0,
                                   dtype=x.dtype)
        module.load_state_dict(weights, strict=False)
        with torch.no_grad():
            expected = module.eval()(x, keep)
        torch.testing.assert_close(task.reference(x, keep, weights)[keep], expected[keep], atol=1e-12, rtol=1e-12)


# --- 10.streaming_conv -----------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [(1,) * 9, (2, 3, 4), (9,), (4, 1, 1, 3)], ids=str)
def test_streaming_the_reference_step_equals_the_causal_module_on_the_whole_stream(chunks):
    """The outside oracle: ConvolutionModule(causal=True) run on the whole stream at once."""
    task = TASKS["10.streaming_conv"]
    torch.manual_seed(0)
    module = ConvolutionModule(5, kernel_size=4, dropout=0.0, causal=True, dtype=torch.float64).eval()
    with torch.no_grad():
        module.batch_norm.running_mean.uniform_(-1, 1)
        module.batch_norm.running_var.uniform_(0.5, 2)
    weights = {k: v for k, v in module.state_dict().items() if k != "batch_norm.num_batches_tracked"}
    x = torch.randn(2, sum(chunks), 5, dtype=torch.float64)
    cache, outputs, start = torch.zeros(2, 3, 5, dtype=torch.float64), [], 0
    for size in chunks:
        out, cache = task.reference(x[:, start : start + size], cache, weights)
        outputs.append(out)
        start += size
    with torch.no_grad():
        whole = module(x)
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, atol=1e-12, rtol=1e-12)


def test_streaming_cases_are_steps_of_real_streams():
    """Each case's cache is what the previous steps of its stream leave; first chunks start from zeros."""
    task = TASKS["10.streaming_conv"]
    cases = task.make_cases()
    assert any(not case.args[1].any() for case in cases), "a first chunk, with a zero cache"
    assert any(case.args[0].shape[1] == 1 for case in cases), "a chunk of one frame"
    assert any(case.args[0].shape[1] < case.args[1].shape[1] for case in cases), "a chunk shorter than the cache"
    assert sum(case.args[0].shape[0] >= 2 for case in cases) == len(cases)
    previous = None
    for case in cases:
        chunk, cache, weights = case.args
        if previous is not None and previous[2] is weights:  # the same stream: chain the reference
            _, expected_cache = task.reference(*previous)
            torch.testing.assert_close(cache, expected_cache, atol=1e-12, rtol=1e-12)
        previous = case.args
