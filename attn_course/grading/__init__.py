"""Grading: ``check("<task id>", fn)`` in a notebook, and the batch grader for instructors.

Taught in lesson 00 (how exercises and grading work).
"""

from __future__ import annotations

from collections.abc import Callable

from .core import Case, CheckResult, Fail, Outcome, Task, TaskResult, grade_function, run_cases
from .tasks import TASKS, tasks_for_lesson

__all__ = [
    "Case",
    "CheckResult",
    "Fail",
    "Outcome",
    "TASKS",
    "Task",
    "TaskResult",
    "check",
    "grade_function",
    "run_cases",
    "tasks_for_lesson",
]


def check(task_id: str, fn: Callable, *, quiet: bool = False) -> TaskResult:
    """Grade the learner's ``fn`` for ``task_id``, print the feedback, and return the result."""
    if task_id not in TASKS:
        known = ", ".join(sorted(TASKS))
        raise KeyError(f"unknown task {task_id!r}; known tasks: {known}")
    result = grade_function(TASKS[task_id], fn)
    if not quiet:
        print(result.report())
    return result
