"""Every task: the reference scores full marks, a stub scores zero, every catalogued bug is caught.

Also what every task's judge must survive, whatever the lesson: the batch grader's round trip,
odd return values, an error in one case, and building its cases twice.
"""

from __future__ import annotations

import pytest
import torch

from attn_course.grading import TASKS, Outcome, grade_function, run_cases

WRONG = [(task_id, name) for task_id, task in TASKS.items() for name in task.wrong]
ALL = sorted(TASKS)


def _catalogue(task_id):
    task = TASKS[task_id]
    return [("reference", task.reference)] + [(name, fn) for name, (fn, _) in task.wrong.items()]


def _crashes(result) -> list[str]:
    return [c.message for c in result.checks if c.message.startswith("could not check your result")]


@pytest.mark.parametrize("task_id", ALL)
def test_reference_scores_full_marks(task_id):
    result = grade_function(TASKS[task_id], TASKS[task_id].reference)
    assert result.max_score > 0
    assert result.score == result.max_score, result.report()


@pytest.mark.parametrize("task_id", ALL)
def test_untouched_stub_scores_zero(task_id):
    def stub(*args, **kwargs):
        raise NotImplementedError("Your code here")

    result = grade_function(TASKS[task_id], stub)
    assert result.score == 0, result.report()
    assert "not implemented yet" in result.feedback


@pytest.mark.parametrize("task_id", ALL)
def test_catalogue_has_at_least_four_wrong_implementations(task_id):
    assert len(TASKS[task_id].wrong) >= 4


@pytest.mark.parametrize("task_id,name", WRONG, ids=[f"{t}:{n}" for t, n in WRONG])
def test_wrong_implementation_is_rejected_with_useful_feedback(task_id, name):
    task = TASKS[task_id]
    fn, expected_hint = task.wrong[name]
    result = grade_function(task, fn)
    assert result.score < result.max_score, f"{name!r} was accepted:\n{result.report()}"
    assert expected_hint in result.feedback, f"feedback for {name!r} lacks {expected_hint!r}:\n{result.report()}"


@pytest.mark.parametrize("task_id", ALL)
def test_verdicts_survive_the_batch_graders_round_trip(task_id):
    """The batch grader judges plain copies of the outcomes, on cases it builds again itself."""
    task = TASKS[task_id]
    for name, fn in _catalogue(task_id):
        cases = task.make_cases()
        outcomes = run_cases(fn, cases)
        direct = task.judge(cases, outcomes)
        plain = [Outcome.from_plain(o.to_plain()) for o in outcomes]
        again = task.judge(task.make_cases(), plain)
        assert [(c.name, c.passed, c.message) for c in direct] == [(c.name, c.passed, c.message) for c in again], name


@pytest.mark.parametrize("task_id", ALL)
def test_judges_never_crash_on_the_catalogue(task_id):
    for name, fn in _catalogue(task_id):
        assert not _crashes(grade_function(TASKS[task_id], fn)), name


@pytest.mark.parametrize("task_id", ALL)
def test_judges_survive_odd_return_values(task_id):
    for odd in (None, "text", 3, [1, 2], torch.zeros(0), (torch.zeros(2), torch.zeros(2)), float("nan")):
        result = grade_function(TASKS[task_id], lambda *args, odd=odd, **kwargs: odd)
        assert not _crashes(result), f"{odd!r}: {_crashes(result)}"
        assert result.score < result.max_score, f"{odd!r} was accepted"


@pytest.mark.parametrize("task_id", ALL)
def test_an_error_in_one_case_costs_only_that_cases_checks(task_id):
    """A function that raises on one input (say, only in float16) keeps the checks it earns elsewhere."""
    task = TASKS[task_id]
    cases = task.make_cases()
    calls = []

    def raises_on_last_case(*args, **kwargs):  # the grader calls once per case, in order
        calls.append(1)
        if len(calls) == len(cases):
            raise RuntimeError("boom")
        return task.reference(*args, **kwargs)

    result = grade_function(task, raises_on_last_case)
    assert 0 < result.score < result.max_score, result.report()
    assert "boom" in result.feedback and cases[-1].name in result.feedback


def _flat(args):
    for x in args:
        if isinstance(x, (tuple, list)):
            yield from _flat(x)
        elif isinstance(x, dict):
            yield from _flat(list(x.items()))
        else:
            yield x


@pytest.mark.parametrize("task_id", ALL)
def test_cases_are_deterministic_and_leave_the_global_rng_alone(task_id):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = TASKS[task_id].make_cases()
    assert torch.equal(torch.rand(3), expected_next), "building the cases changed the caller's random state"
    second = TASKS[task_id].make_cases()
    assert [c.name for c in first] == [c.name for c in second]
    for a, b in zip(first, second):
        for x, y in zip(_flat(a.args), _flat(b.args)):
            assert type(x) is type(y)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y) and x.dtype == y.dtype and x.requires_grad == y.requires_grad
            elif isinstance(x, torch.nn.Module):
                assert all(torch.equal(p, q) for p, q in zip(x.state_dict().values(), y.state_dict().values()))
            elif not callable(x):
                assert x == y


@pytest.mark.parametrize("task_id", ALL)
def test_grading_leaves_the_learners_random_state_alone(task_id):
    """`check(...)` in the middle of a notebook must not change what the next random draw gives."""
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    grade_function(TASKS[task_id], TASKS[task_id].reference)
    assert torch.equal(torch.rand(3), expected_next), "grading changed the caller's random state"
