"""The classic bugs each exercise's checker catches, as the markdown an exercise notebook publishes.

Every task's catalogue (``Task.wrong``) is a list of wrong implementations the checker must reject;
their descriptions are what a learner can read without opening the grader's source (which also holds
reference implementations). Each solution notebook carries the cell :func:`catalogue_markdown`
returns for its lesson, right after its summary; ``tests/test_grading_notebooks.py`` checks that
the two agree, so the published list cannot drift from what the checker does.
"""

from __future__ import annotations

from .tasks import tasks_for_lesson

__all__ = ["CATALOGUE_HEADING", "catalogue_markdown"]

CATALOGUE_HEADING = "### Classic bugs the checker catches"

_KIND_NOTE = {
    "values": "",
    "algorithm": " (right values, wrong algorithm)",
    "contract": " (right values, broken contract)",
}


def catalogue_markdown(lesson: str) -> str:
    """The markdown cell listing, task by task, every catalogued mistake of lesson ``lesson`` (e.g. ``"05"``)."""
    lines = [
        CATALOGUE_HEADING,
        "",
        "Each of these is a wrong implementation the checker is tested against: it loses marks, with a hint",
        "that names the mistake. The list is generated from the checker's catalogue.",
        "",
    ]
    for task in tasks_for_lesson(lesson):
        entries = "; ".join(f"{name}{_KIND_NOTE[entry.kind]}" for name, entry in task.wrong.items())
        lines.append(f"- `{task.id}`{' (stretch)' if task.stretch else ''}: {entries}.")
    return "\n".join(lines)
