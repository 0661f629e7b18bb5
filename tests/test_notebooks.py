"""Notebook hygiene: headers from one place, exercises generated from solutions, lessons in order."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from attn_course.course import (
    COURSE_MAP_HEADING,
    LESSON_BUDGET_S,
    LESSONS,
    RUNTIMES_FILE,
    SOLUTION_BUDGET_S,
    Runtimes,
    colab_badge,
    course_map_markdown,
    load_runtimes,
    setup_cell_source,
)
from attn_course.notebooks import (
    BEGIN, END, STUB, exercise_is_current, final_progress_text, merge_adjacent_streams, strip_solutions,
)

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


# --- the course map of 00_welcome and the measured runtimes behind it --------------------------

RUNTIMES = ROOT / RUNTIMES_FILE
MEASURED = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def _course_map_cell() -> str:
    cells = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4).cells
    maps = [c.source for c in cells if c.cell_type == "markdown" and c.source.startswith(COURSE_MAP_HEADING)]
    assert len(maps) == 1, f"00_welcome needs exactly one cell starting {COURSE_MAP_HEADING!r}, found {len(maps)}"
    return maps[0]


def test_course_map_is_generated_from_lessons_and_measured_runtimes():
    assert _course_map_cell() == course_map_markdown(load_runtimes()), (
        "00_welcome's course map is stale: run `make runtimes`"
    )


def test_course_map_links_every_lesson_and_exercise_in_order_and_the_files_exist():
    links = re.findall(r"\]\(([^)]+\.ipynb)\)", _course_map_cell())
    expected = []
    for lesson in LESSONS:
        expected.append(lesson.filename)
        if lesson.number != "00":
            expected.append(f"../exercises/{lesson.filename}")
    assert links == expected
    for link in links:
        assert (ROOT / "notebooks" / link).resolve().exists(), f"the course map links {link}, which does not exist"


def test_every_lesson_and_solution_has_a_measured_runtime():
    measured = set(load_runtimes().seconds)
    present = {_rel(p) for p in MEASURED}
    assert present - measured == set(), f"not timed yet (run `make runtimes`): {sorted(present - measured)}"
    assert measured - present == set(), f"timed but gone: {sorted(measured - present)}"


@pytest.mark.parametrize("path", MEASURED, ids=_rel)
def test_measured_runtime_is_within_budget(path):
    seconds = load_runtimes().seconds[_rel(path)]
    budget = LESSON_BUDGET_S if path.parent.name == "notebooks" else SOLUTION_BUDGET_S
    assert 0 < seconds <= budget, f"{_rel(path)} took {seconds:.1f} s when last measured; the budget is {budget:.0f} s"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=_rel)
def test_time_to_run_in_the_header_agrees_with_the_measurement(path):
    header = nbformat.read(path, as_version=4).cells[0].source
    stated = re.search(r"\*\*Time to run\*\*: about (\d+) s|\*\*Time to run\*\*: about (a) minute", header)
    assert stated, f"{_rel(path)}: the header should say '**Time to run**: about N s ...'"
    claimed = 60.0 if stated.group(2) else float(stated.group(1))
    seconds = load_runtimes().seconds[_rel(path)]
    assert abs(claimed - seconds) <= max(10.0, 0.3 * seconds), (
        f"{_rel(path)} says about {claimed:.0f} s but took {seconds:.1f} s when last measured"
    )


def test_header_times_follow_the_measurement(tmp_path):
    from attn_course.notebooks import write_header_times

    folder = tmp_path / "notebooks"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T\n\n**Time to run**: about 5 s on a 2-core laptop CPU; most of it training.")]
    nbformat.write(nb, folder / "04_x.ipynb")
    other = nbformat.v4.new_notebook()
    other.cells = [nbformat.v4.new_markdown_cell("# T\n\nno time stated")]
    nbformat.write(other, folder / "05_y.ipynb")
    runtimes = Runtimes(machine="m", threads=2, date="2026-01-01",
                        seconds={"notebooks/04_x.ipynb": 14.6, "notebooks/05_y.ipynb": 3.0})
    assert write_header_times(runtimes, root=tmp_path) == [folder / "04_x.ipynb"]
    header = nbformat.read(folder / "04_x.ipynb", as_version=4).cells[0].source
    assert header == "# T\n\n**Time to run**: about 15 s on a 2-core laptop CPU; most of it training."
    assert write_header_times(runtimes, root=tmp_path) == [], "a second run changes nothing"


def test_course_map_says_when_a_notebook_was_not_measured():
    runtimes = Runtimes(machine="a test machine", threads=2, date="2026-01-01", seconds={"notebooks/00_welcome.ipynb": 9.6})
    table = course_map_markdown(runtimes)
    assert "| 00 | [Welcome & setup](00_welcome.ipynb) | 10 s | – | – |" in table
    assert "| 01 | [Scaled dot-product attention](01_scaled_dot_product_attention.ipynb) | not measured |" in table
    assert "a test machine, 2 PyTorch threads, on 2026-01-01" in table


# --- tqdm bars: stored as their final state, compared by nbval as "a bar" -----------------------


def _progress_notebook(value: float, total: float) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    widget = {"model_id": "box", "version_major": 2, "version_minor": 0}
    bar_text = "training:   0%|          | 0/6 [00:00<?, ?it/s]"
    other = {"model_id": "slider", "version_major": 2, "version_minor": 0}
    nb.cells = [nbformat.v4.new_code_cell("fit(...)", outputs=[
        nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": widget, "text/plain": bar_text}),
        nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": other, "text/plain": "IntSlider(value=3)"}),
    ])]
    state = {
        "box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_a", "IPY_MODEL_b", "IPY_MODEL_c"]}},
        "a": {"model_name": "HTMLModel", "state": {"value": "training:\u2007100%"}},
        "b": {"model_name": "FloatProgressModel", "state": {"value": value, "max": total}},
        "c": {"model_name": "HTMLModel", "state": {"value": "\u20076/6\u2007[00:26&lt;00:00,\u2007\u20074.25s/it]"}},
        "slider": {"model_name": "IntSliderModel", "state": {"value": 3}},
    }
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": state, "version_major": 2, "version_minor": 0}}
    return nb


def test_stored_progress_bars_show_their_final_state():
    nb = _progress_notebook(6.0, 6.0)
    assert final_progress_text(nb) == 1
    bar, slider = nb.cells[0].outputs
    assert bar.data["text/plain"] == "training: 100%|██████████| 6/6 [00:26<00:00,  4.25s/it]"
    assert slider.data["text/plain"] == "IntSlider(value=3)", "other widgets keep their text"
    half = _progress_notebook(3.0, 6.0)
    final_progress_text(half)
    assert "|█████     |" in half.cells[0].outputs[0].data["text/plain"]


def test_nbval_sanitizer_reads_a_bar_at_0_and_at_100_percent_alike():
    from nbval.plugin import get_sanitize_patterns  # how nbval itself reads the file

    rules = get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize.cfg").read_text())

    def sanitize(text: str) -> str:
        for pattern, replacement in rules:
            text = re.sub(pattern, replacement, text)
        return text

    start = "training:   0%|          | 0/6 [00:00<?, ?it/s]"
    end = "training: 100%|██████████| 6/6 [00:26<00:00,  4.25s/it]"
    assert sanitize(start) == sanitize(end) == "training:PROGRESS"
    assert sanitize("max |diff| < 1e-6: True") == "max |diff| < 1e-6: True", "ordinary output keeps its text"


@pytest.mark.parametrize(
    "path", [p for folder in ("notebooks", "solutions") for p in sorted((ROOT / folder).glob("*.ipynb"))], ids=_rel
)
def test_every_code_cell_is_stored_executed(path):
    """Lessons and solutions are committed with their outputs: a learner reads the feedback, nbval compares it."""
    nb = nbformat.read(path, as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    unexecuted = [i for i, c in code if c.execution_count is None]
    assert not unexecuted, (
        f"{_rel(path)}: code cells {unexecuted} are stored unexecuted (execution_count None). Regenerate it: "
        f"OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 ATTN_COURSE_THREADS=2 .venv/bin/attn-course regenerate {_rel(path)}"
    )


@pytest.mark.parametrize("path", [p for p in ALL if p.parent.name != "exercises"], ids=_rel)
def test_no_cell_relies_on_the_raises_exception_tag(path):
    """Colab's "Run all" stops at the first error and ignores cell tags: a lesson shows an error with
    ``with ac.shows_error(SomeError): ...`` (printed, checked, and the notebook carries on)."""
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "raises-exception" in c.get("metadata", {}).get("tags", [])]
    errors = [i for i, c in enumerate(nb.cells) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not tagged and not errors, (
        f"{_rel(path)}: cells {sorted(set(tagged + errors))} stop on an error; wrap the failing line in "
        "`with ac.shows_error(TheError):` so the notebook runs to the end everywhere"
    )


def test_sync_headers_changes_nothing_here_and_points_a_fork_at_itself(tmp_path, monkeypatch):
    """`python -m attn_course.course` rewrites badges and setup cells from course.py, and only them."""
    from attn_course import course

    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        for path in sorted((ROOT / folder).glob("*.ipynb"))[:2]:
            (tmp_path / folder / path.name).write_bytes(path.read_bytes())
    (tmp_path / "CITATION.cff").write_bytes((ROOT / "CITATION.cff").read_bytes())
    originals = {p: p.read_bytes() for p in tmp_path.rglob("*.*")}
    assert course.sync_headers(tmp_path) == [], "a notebook's header disagrees with attn_course/course.py"
    assert {p: p.read_bytes() for p in originals} == originals

    fork = "someone/attn-course-fork"
    monkeypatch.setattr(course, "REPO_SLUG", fork)
    monkeypatch.setattr(course, "INSTALL_SOURCE", f"attn-course @ git+https://github.com/{fork}.git@main")
    assert sorted(course.sync_headers(tmp_path)) == sorted(originals)
    assert f'repository-code: "https://github.com/{fork}"' in (tmp_path / "CITATION.cff").read_text()
    for path in originals:
        if path.suffix != ".ipynb":
            continue
        nb = nbformat.read(path, as_version=4)
        assert f"colab.research.google.com/github/{fork}/blob/main/{path.parent.name}/{path.name}" in nb.cells[0].source
        assert f"git+https://github.com/{fork}.git" in nb.cells[1].source
        assert "attn-course/attn-course" not in nb.cells[0].source + nb.cells[1].source
    monkeypatch.undo()
    course.sync_headers(tmp_path)  # back to this repository: byte for byte what was there
    assert {p: p.read_bytes() for p in originals} == originals


def test_the_repository_address_is_written_only_in_course_py():
    """Badges, setup cells (above) and the web book's Colab links (docs/build_site.py, checked page by
    page in tests/test_site.py) are made from attn_course/course.py; nothing else spells the address."""
    from attn_course.course import REPO_SLUG, REPO_URL

    others = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.*")), *sorted((ROOT / ".github").rglob("*.yml"))]
    for path in others:
        text = path.read_text()
        assert REPO_SLUG not in text and "colab.research.google.com/github/" not in text, (
            f"{_rel(path)} spells the repository's address: take it from attn_course/course.py"
        )
    citation = (ROOT / "CITATION.cff").read_text()
    assert f'repository-code: "{REPO_URL}"' in citation, "CITATION.cff's repository-code must be course.py's REPO_URL"


def test_consecutive_prints_are_stored_as_one_output_and_figures_stay_between():
    """Regeneration joins the prints a loaded kernel sent one by one, but never moves them past a figure."""
    out = nbformat.v4.new_output
    cell = nbformat.v4.new_code_cell("...", outputs=[
        out("stream", name="stdout", text="a\n"), out("stream", name="stdout", text="b\n"),
        out("stream", name="stderr", text="warning\n"),
        out("display_data", data={"text/plain": "<figure>"}),
        out("stream", name="stdout", text="c\n"), out("stream", name="stdout", text="d\n"),
    ])
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("text")])
    assert merge_adjacent_streams(nb) == 2
    assert [(o.output_type, o.get("name"), o.get("text")) for o in cell.outputs] == [
        ("stream", "stdout", "a\nb\n"), ("stream", "stderr", "warning\n"), ("display_data", None, None),
        ("stream", "stdout", "c\nd\n"),
    ]
