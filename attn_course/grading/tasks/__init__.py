"""Every graded task, by id. Each lesson's tasks live in ``lessonNN.py``."""

from __future__ import annotations

from ..core import Task
from . import lesson01, lesson02, lesson03

__all__ = ["TASKS", "tasks_for_lesson"]

TASKS: dict[str, Task] = {
    task.id: task
    for task in (
        lesson01.STABLE_SOFTMAX,
        lesson01.ATTENTION,
        lesson02.SPLIT_HEADS,
        lesson02.MERGE_HEADS,
        lesson02.MHA_FORWARD,
        lesson03.CAUSAL_MASK,
        lesson03.PADDING_MASK,
        lesson03.MASKED_ATTENTION,
    )
}


def tasks_for_lesson(number: str) -> list[Task]:
    """The tasks of lesson ``number`` (e.g. ``"03"``), in definition order."""
    return [task for task in TASKS.values() if task.id.split(".")[0] == number]
