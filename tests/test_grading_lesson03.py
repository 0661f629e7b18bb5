"""Lesson 03's tasks (causal and padding masks, masked attention, and the 03.cross_attention_mask
stretch task): fair to other correct solutions.

``test_grading_catalogue.py`` proves every catalogued bug is rejected; these tests prove that
correct code written differently scores full marks, that building blocks stay allowed while the
task's own concept does not, and that odd return values fail with a message.
"""

from __future__ import annotations

import math

import pytest
import torch

import attn_course as ac
from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.startswith("03.")]


def _padding_loop(lengths, max_len):
    mask = torch.zeros(len(lengths), max_len, dtype=torch.bool)
    for row, n in enumerate(lengths.tolist()):
        mask[row, :n] = True
    return mask


def _masked_finfo_min(q, k, v, mask):
    scores = q @ k.mT / math.sqrt(q.shape[-1])  # (..., L, S)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    out = torch.softmax(scores, -1) @ v  # (..., L, Dv)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))


def _masked_with_bias(q, k, v, mask):
    """The library's bias and softmax as building blocks: allowed (the attention is written here)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + ac.mask_to_bias(mask, q.dtype)  # (..., L, S)
    return ac.stable_softmax(scores) @ v  # (..., L, Dv)


def _cross_loops(query_lengths, key_lengths, L, S):
    mask = torch.zeros(len(query_lengths), 1, L, S, dtype=torch.bool)
    for b, (n_q, n_k) in enumerate(zip(query_lengths.tolist(), key_lengths.tolist())):
        mask[b, 0, :n_q, :n_k] = True
    return mask


def _cross_with_the_library_padding_mask(query_lengths, key_lengths, L, S):
    """The library's padding_mask is a building block of this task: allowed."""
    return ac.padding_mask(query_lengths, L)[:, None, :, None] & ac.padding_mask(key_lengths, S)[:, None, None, :]


ALTERNATIVES = {
    "03.causal_mask": [
        lambda L, S: torch.arange(S)[None, :] <= torch.arange(L)[:, None],
        lambda L, S: ~torch.ones(L, S, dtype=torch.bool).triu(diagonal=1),
    ],
    "03.padding_mask": [_padding_loop, lambda lengths, max_len: torch.arange(max_len) < lengths.unsqueeze(1)],
    "03.masked_attention": [_masked_finfo_min, _masked_with_bias],
    "03.cross_attention_mask": [_cross_loops, _cross_with_the_library_padding_mask],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_03_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_a_function_returning_garbage_fails_with_a_message():
    for task_id in OURS:
        result = grade_function(TASKS[task_id], lambda *args: "not a tensor")
        assert result.score == 0
        assert "should return a torch.Tensor" in result.feedback


@pytest.mark.parametrize("task_id,call", [
    ("03.causal_mask", lambda L, S: ac.causal_mask(L, S)),
    ("03.padding_mask", lambda lengths, max_len: ac.padding_mask(lengths, max_len)),
    ("03.masked_attention", lambda q, k, v, mask: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
], ids=["causal_mask", "padding_mask", "masked_attention"])
def test_delegating_to_the_library_or_pytorch_scores_zero_with_a_hint(task_id, call):
    result = grade_function(TASKS[task_id], call)
    assert result.score == 0
    assert "write it yourself" in result.feedback


def test_masked_attention_has_two_cases_with_queries_that_may_attend_to_nothing():
    cases = TASKS["03.masked_attention"].make_cases()
    with_empty_rows = [c for c in cases if (~c.args[3].any(dim=-1)).any()]
    assert len(with_empty_rows) >= 2
    assert any(c.args[0].shape[-2] != c.args[1].shape[-2] for c in cases), "a case with L != S"


def test_cross_attention_mask_gives_padded_queries_zero_outputs_in_the_library():
    mask = TASKS["03.cross_attention_mask"].reference(torch.tensor([3, 1]), torch.tensor([2, 4]), 4, 5)  # (B, 1, L, S)
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = ac.scaled_dot_product_attention(q, k, v, mask)
    assert (out[0, :, 3:] == 0).all() and (out[1, :, 1:] == 0).all()
    assert torch.isfinite(out).all()


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., L, S)


MASK_ROUTES = {
    "nn.Transformer.generate_square_subsequent_mask": lambda L, S: ~torch.isinf(
        torch.nn.Transformer.generate_square_subsequent_mask(max(L, S)))[:L, :S],
    "CausalBias": lambda L, S: torch.nn.attention.bias.causal_upper_left(L, S)._materialize(),
    "ac.pattern_mask, causal sliding window": lambda L, S: ac.pattern_mask(
        max(L, S), pattern="sliding", size=max(L, S), is_causal=True)[:L, :S],
}
ATTENTION_ROUTES = {
    "ac.chunked_attention": lambda q, k, v, mask: ac.chunked_attention(q, k, v, mask),
    "ac.partial_attention + finish_partial": lambda q, k, v, mask: ac.finish_partial(
        ac.partial_attention(_scores(q, k).masked_fill(~mask, float("-inf")), v)),
    "ac.grouped_attention": lambda q, k, v, mask: ac.grouped_attention(q, k, v, mask),
}
ROUTES = [("03.causal_mask", n) for n in MASK_ROUTES] + [("03.masked_attention", n) for n in ATTENTION_ROUTES]


@pytest.mark.parametrize("task_id,name", ROUTES, ids=[f"{t}:{n}" for t, n in ROUTES])
def test_library_and_pytorch_shortcuts_score_zero(task_id, name):
    """Review of lessons 00-03: these scored full marks (PyTorch's Transformer mask 3/3, ac.chunked_attention 5/5)."""
    import torch.nn.attention.bias  # noqa: F401  (not imported by `import torch`)

    fn = (MASK_ROUTES if task_id == "03.causal_mask" else ATTENTION_ROUTES)[name]
    result = grade_function(TASKS[task_id], fn)
    assert result.score == 0, result.report()
    assert "write it yourself" in result.feedback


def test_the_float16_hint_does_not_suggest_a_fill_value_that_fails_the_empty_row_check():
    """finfo.min without zeroing the empty rows fails this very task: the hint must not send learners there."""
    result = grade_function(TASKS["03.masked_attention"], TASKS["03.masked_attention"].wrong["fills with -1e9"].fn)
    assert "does not fit in float16" in result.feedback
    assert "finfo" not in result.feedback.replace("like -1e9 or finfo.min", "")


def test_zeroing_after_the_softmax_gets_the_same_diagnosis_in_every_check_it_fails():
    """Lesson 03's shown attempt: the float16 check and the empty-row check both name the renormalisation."""
    result = grade_function(TASKS["03.masked_attention"], TASKS["03.masked_attention"].wrong[
        "masks after the softmax without renormalising"].fn)
    failed = [c for c in result.checks if not c.passed]
    assert len(failed) == 3 and all("without renormalising" in c.message for c in failed), result.report()
    empty_row_check = next(c for c in failed if "nothing to attend to" in c.name)
    assert "The empty rows are right" in empty_row_check.message


def test_the_lessons_wrong_first_attempts_get_the_feedback_the_lessons_show():
    """attn_course.grading.examples holds the attempts lessons 00 and 03 grade without printing their code."""
    from attn_course.grading import examples

    shifted = grade_function(TASKS["03.causal_mask"], examples.causal_mask_shifted_by_one)
    assert shifted.score == 1 and "shifted by one" in shifted.feedback, shifted.report()
    zeroing = grade_function(TASKS["03.masked_attention"], examples.masked_attention_zeroing_after_softmax)
    assert zeroing.score == 2 and "without renormalising" in zeroing.feedback, zeroing.report()
