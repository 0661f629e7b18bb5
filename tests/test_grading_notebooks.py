"""What the exercise notebooks say about grading: the published catalogue, delegation, measured times.

Issue 20: exercises teach from the lesson, not from the grader's files (which hold reference
implementations), so each summary publishes the catalogue of classic bugs generated from
``Task.wrong``; every introduction says the same about delegation; headers state measured times.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from attn_course.grading.catalogue import CATALOGUE_HEADING, catalogue_markdown

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
DELEGATION = ("Write each function yourself: a function that calls the implementation the task asks for (the "
              "library's, or PyTorch's) scores zero. Once it passes, use the library to check it on inputs of your own.")


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_the_summary_publishes_the_generated_catalogue(path):
    cells = nbformat.read(path, as_version=4).cells
    published = [c.source for c in cells if c.cell_type == "markdown" and c.source.startswith(CATALOGUE_HEADING)]
    assert published == [catalogue_markdown(path.name[:2])], f"{path.name}: rerun the catalogue cell generator"
    summary = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and "## Summary" in c.source)
    assert cells[summary + 1].source.startswith(CATALOGUE_HEADING)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_no_pointer_at_the_graders_files_and_one_word_on_delegation(path):
    cells = nbformat.read(path, as_version=4).cells
    assert not [c for c in cells if "grading/tasks" in c.source]
    assert DELEGATION in cells[0].source


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_the_header_states_the_measured_time(path):
    header = nbformat.read(path, as_version=4).cells[0].source
    stated = re.search(r"\*\*Time to run\*\*: about (\d+) s solved", header)
    assert stated, f"{path.name}: the header should say '**Time to run**: about N s solved ...'"
    seconds = json.loads((ROOT / "notebooks" / "runtimes.json").read_text())["seconds"][f"solutions/{path.name}"]
    assert abs(float(stated.group(1)) - seconds) <= max(10.0, 0.3 * seconds)


def test_the_readme_says_the_graders_source_holds_reference_implementations():
    readme = (ROOT / "README.md").read_text()
    assert "reference implementations" in readme and "grading/tasks/lessonNN.py" not in readme
