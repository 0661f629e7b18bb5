"""Grading: ``check("<task id>", fn)`` in a notebook, and the batch grader for instructors.

Tasks may measure the learner's algorithm while it runs (``probes``: largest intermediate
tensor, FLOPs, calls into forbidden implementations); see ``attn_course.grading.probes``.

Taught in lesson 00 (how exercises and grading work).
"""

from __future__ import annotations

from collections.abc import Callable

from .core import KINDS, Case, CheckResult, Fail, Outcome, Task, TaskResult, Wrong, grade_function, run_cases
from .probes import Probe, probe_call
from .tasks import TASKS, tasks_for_lesson

__all__ = [
    "KINDS",
    "Case",
    "CheckResult",
    "Fail",
    "Outcome",
    "Probe",
    "TASKS",
    "Task",
    "TaskResult",
    "check",
    "Wrong",
    "grade_function",
    "probe_call",
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
