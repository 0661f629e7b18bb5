"""Every task: the reference scores full marks, a stub scores zero, every catalogued bug is caught."""

from __future__ import annotations

import pytest

from attn_course.grading import TASKS, grade_function

WRONG = [(task_id, name) for task_id, task in TASKS.items() for name in task.wrong]


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_reference_scores_full_marks(task_id):
    result = grade_function(TASKS[task_id], TASKS[task_id].reference)
    assert result.max_score > 0
    assert result.score == result.max_score, result.report()


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_untouched_stub_scores_zero(task_id):
    def stub(*args, **kwargs):
        raise NotImplementedError("Your code here")

    result = grade_function(TASKS[task_id], stub)
    assert result.score == 0, result.report()
    assert "not implemented yet" in result.feedback


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_catalogue_has_at_least_four_wrong_implementations(task_id):
    assert len(TASKS[task_id].wrong) >= 4


@pytest.mark.parametrize("task_id,name", WRONG, ids=[f"{t}:{n}" for t, n in WRONG])
def test_wrong_implementation_is_rejected_with_useful_feedback(task_id, name):
    task = TASKS[task_id]
    fn, expected_hint = task.wrong[name]
    result = grade_function(task, fn)
    assert result.score < result.max_score, f"{name!r} was accepted:\n{result.report()}"
    assert expected_hint in result.feedback, f"feedback for {name!r} lacks {expected_hint!r}:\n{result.report()}"
