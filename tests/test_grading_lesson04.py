"""Lesson 04's tasks: fair to other correct solutions, counted by PyTorch, and deaf to garbage.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why only one can) and that the judges survive the batch grader's round trip. These
tests prove the other side: correct code written differently from the reference scores full marks;
the expected counts come from PyTorch's FlopCounterMode, not from our own formula; number tasks
reject what is not a number.
"""

from __future__ import annotations

import pytest
import torch

from attn_course.grading import TASKS, grade_function
from attn_course.grading.tasks.lesson04 import _RUNNABLE, _counted_flops, _counted_training_flops

LESSON = [task_id for task_id in TASKS if task_id.startswith("04.")]


def _flops_per_matmul(B, H, L, S, D, Dv):
    scores = 2 * L * D * S  # (L, D) @ (D, S)
    mix = 2 * L * S * Dv  # (L, S) @ (S, Dv)
    return B * H * (scores + mix)


def _flops_tensor(B, H, L, S, D, Dv):
    return torch.tensor(2.0 * B * H * L * S * (D + Dv), dtype=torch.float64)  # a 0-d tensor is a number too


def _saved_dict(fn, *args):
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)  # keeping the output keeps the graph, and every saved tensor, alive
    del out
    return sum(seen.values())


def _saved_storages(fn, *args):
    storages = []

    def pack(t):
        storages.append(t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    unique = {s.data_ptr(): s.nbytes() for s in storages}
    return int(sum(unique.values()))


def _training_by_product(B, H, L, S, D, Dv, recompute=False):
    """Every product written out: forward QK^T, PV; backward dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q."""
    products = [(L, D, S), (L, S, Dv), (L, Dv, S), (S, L, Dv), (L, S, D), (S, L, D)]  # (m, k, n)
    if recompute:
        products.append((L, D, S))  # Q K^T again, to rebuild the weights
    return B * H * sum(2 * m * k * n for m, k, n in products)


def _training_float(B, H, L, S, D, Dv, recompute=False):
    forward = 2.0 * B * H * L * S * (D + Dv)
    return 3.0 * forward + (2.0 * B * H * L * S * D if recompute else 0.0)


ALTERNATIVES = {
    "04.attention_flops": [_flops_per_matmul, _flops_tensor],
    "04.saved_tensor_bytes": [_saved_dict, _saved_storages],
    "04.training_flops": [_training_by_product, _training_float],
}
CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_04_has_alternatives_and_one_is_a_stretch():
    assert set(ALTERNATIVES) == set(LESSON)
    assert [TASKS[t].stretch for t in LESSON] == [False, False, True]


@pytest.mark.parametrize("task_id,index", CASES, ids=[f"{t}:{i}" for t, i in CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_number_tasks_reject_garbage_with_a_message():
    for task_id in LESSON:
        result = grade_function(TASKS[task_id], lambda *args, **kwargs: "not a number")
        assert result.score == 0 and "should return a number" in result.feedback
    result = grade_function(TASKS["04.saved_tensor_bytes"], lambda *args: 10.5)
    assert "whole number" in result.feedback


def test_flop_cases_are_counted_by_pytorch_and_both_routes_agree():
    """Small cases run the library's attention under FlopCounterMode; large ones count the two products on meta
    tensors. Where both can run they agree, and they agree with the lesson's rule."""
    cases = TASKS["04.attention_flops"].make_cases()
    assert any(B * H * L * S > _RUNNABLE for B, H, L, S, D, Dv in (c.args for c in cases)), "a case too large to run"
    for case in cases:
        B, H, L, S, D, Dv = case.args
        assert _counted_flops(*case.args) == 2 * B * H * L * S * (D + Dv)
    import attn_course.grading.tasks.lesson04 as lesson04

    runnable = lesson04._RUNNABLE
    try:
        lesson04._RUNNABLE = 0  # every shape through the meta route
        meta = [_counted_flops(*case.args) for case in cases[:5]]
    finally:
        lesson04._RUNNABLE = runnable
    assert meta == [_counted_flops(*case.args) for case in cases[:5]]


def test_training_cases_are_counted_by_pytorch():
    """Storing: 3x the forward products (2 per forward product in backward). Recomputing: one more Q K^T."""
    for case in TASKS["04.training_flops"].make_cases():
        B, H, L, S, D, Dv = case.args
        forward = 2 * B * H * L * S * (D + Dv)
        extra = 2 * B * H * L * S * D if case.kwargs["recompute"] else 0
        assert _counted_training_flops(*case.args, **case.kwargs) == 3 * forward + extra


def test_the_big_o_hint_teaches_the_rule_without_the_answer():
    """The lesson shows this first attempt; its hint must name the counting rule, not print the formula."""
    result = grade_function(TASKS["04.attention_flops"], lambda B, H, L, S, D, Dv: L * L * D)
    assert "Big-O keeps only how the cost grows" in result.feedback and "2·m·k·n" in result.feedback
    assert "2·L·S·D" not in result.feedback and "D + Dv" not in result.feedback


def test_a_hint_is_said_only_when_the_learners_other_answers_fit_it():
    """Issue 20: counting a tensor every time it is saved, with element_size() right, gives 4 bytes per element in
    float16 (x * x saves x twice); the float64 cases rule the "4 bytes per element" story out, so it is not told."""
    from attn_course.grading import TASKS, grade_function

    task = TASKS["04.saved_tensor_bytes"]
    feedback = grade_function(task, task.wrong["a tensor saved twice counted twice"].fn).feedback
    assert "counted a tensor every time it was saved" in feedback
    assert "assumed 4 bytes per element" not in feedback
    float32 = grade_function(task, task.wrong["4 bytes per element whatever the dtype"].fn).feedback
    assert "assumed 4 bytes per element" in float32 and "every time it was saved" not in float32


def test_the_judges_counter_gives_flopcountermodes_totals_without_importing_dynamo():
    """The judges count with PyTorch's FLOP formulas in their own dispatch mode: the same totals as FlopCounterMode
    on every case (forward and forward+backward, storing or recomputing), and a first check that loads no Dynamo."""
    import subprocess
    import sys

    from torch.utils.flop_counter import FlopCounterMode

    from attn_course.chunked import chunked_attention
    from attn_course.grading.tasks.lesson04 import _PyTorchFlops

    def both(fn):
        with FlopCounterMode(display=False) as theirs:
            fn()
        with _PyTorchFlops() as ours:
            fn()
        return ours.flops, theirs.get_total_flops()

    for case in TASKS["04.training_flops"].make_cases():
        B, H, L, S, D, Dv = case.args
        q, k, v = (torch.randn(B, H, n, d, requires_grad=True) for n, d in ((L, D), (S, D), (S, Dv)))
        for recompute in (False, True):
            ours, theirs = both(lambda: chunked_attention(q, k, v, query_chunk_size=3, key_chunk_size=4,
                                                          recompute=recompute).sum().backward())
            assert ours == theirs > 0, (case.name, recompute)
        ours, theirs = both(lambda: torch.softmax(q @ k.transpose(-2, -1), -1) @ v)
        assert ours == theirs > 0
    code = ("import sys\nfrom attn_course.grading import TASKS, check\n"
            "for task_id in ('04.attention_flops', '04.training_flops'):\n"
            "    result = check(task_id, TASKS[task_id].reference, quiet=True)\n"
            "    assert result.score == result.max_score\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
