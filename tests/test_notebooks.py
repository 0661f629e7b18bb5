"""Notebook hygiene: headers from one place, exercises generated from solutions, lessons in order."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from attn_course.course import LESSONS, colab_badge, setup_cell_source
from attn_course.notebooks import BEGIN, END, STUB, exercise_is_current, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "solutions", "exercises")
ALL = [p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))]
LESSON_FILES = {lesson.filename for lesson in LESSONS}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_there_are_notebooks():
    assert (ROOT / "notebooks" / "00_welcome.ipynb").exists()


@pytest.mark.parametrize("path", ALL, ids=_rel)
def test_notebook_header_matches_course(path):
    nb = nbformat.read(path, as_version=4)
    assert path.name in LESSON_FILES, f"{path.name} is not a lesson in attn_course.course.LESSONS"
    first, second = nb.cells[0], nb.cells[1]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "first cell: a markdown title"
    assert colab_badge(path.parent.name, path.name) in first.source, "first cell must carry this notebook's Colab badge"
    assert second.cell_type == "code" and second.source == setup_cell_source(), "second cell: the shared setup cell"


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=_rel)
def test_exercise_is_generated_from_solution(path):
    assert exercise_is_current(path, ROOT / "exercises" / path.name), (
        f"exercises/{path.name} is stale: run `attn-course make-exercises`"
    )
    text = path.read_text()
    assert BEGIN in text and END in text, "a solution notebook marks its solutions"


def test_every_exercise_has_a_solution():
    exercises = {p.name for p in (ROOT / "exercises").glob("*.ipynb")}
    solutions = {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    assert exercises == solutions


def test_strip_solutions_keeps_indentation_and_code_around():
    source = f"def f(x):\n    y = 1\n    {BEGIN}\n    return x + y\n    {END}\n\nprint(f)"
    assert strip_solutions(source) == f"def f(x):\n    y = 1\n    {STUB}\n\nprint(f)"
    with pytest.raises(ValueError, match="unbalanced"):
        strip_solutions(f"{BEGIN}\nx = 1")
