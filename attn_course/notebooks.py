"""Notebook tooling: generate exercises from solutions, re-execute notebooks in place.

* ``make_exercise(solution)``: every code cell's ``### BEGIN SOLUTION`` ... ``### END SOLUTION``
  block becomes a stub that raises ``NotImplementedError``; outputs are cleared.
* ``regenerate(paths)``: executes notebooks top to bottom in a fresh kernel and stores the
  outputs without timestamps, so the committed files only change when results do. A tqdm
  bar's stored text is its final state (``100%|██████████| 6/6 ...``), not the ``0%`` it showed
  when it was created, so the notebook reads right where widgets do not render (GitHub).
* ``measure_runtimes(paths)``: executes them the same way without writing anything, and
  returns the wall time of each run (kernel start included).
* ``write_course_map(runtimes)``: rewrites the course-map cell of ``00_welcome`` from measured
  runtimes (the cell's text is ``attn_course.course.course_map_markdown``).
* ``write_header_times(runtimes)``: rewrites each timed notebook's "**Time to run**: about N s"
  from the same measurements, so headers, the course map and ``runtimes.json`` agree.

Used by ``attn-course make-exercises``, ``attn-course regenerate`` and ``attn-course runtimes``.
"""

from __future__ import annotations

import copy
import html
import os
import re
import time
from pathlib import Path

import nbformat

from .course import COURSE_MAP_HEADING, Runtimes, course_map_markdown, project_root

__all__ = [
    "strip_solutions",
    "make_exercise",
    "make_exercises",
    "regenerate",
    "measure_runtimes",
    "final_progress_text",
    "exercise_is_current",
    "write_course_map",
    "write_header_times",
]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("Your code here: replace this line with your solution.")'
_BLOCK = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*$", re.M | re.S)


def strip_solutions(source: str) -> str:
    """Replace each marked solution block with an indented ``NotImplementedError`` stub."""
    if source.count(BEGIN) != source.count(END):
        raise ValueError(f"unbalanced solution markers in cell:\n{source}")
    return _BLOCK.sub(lambda m: f"{m.group(1)}{STUB}", source)


def make_exercise(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise version of a solution notebook: solutions stubbed, outputs cleared."""
    exercise = copy.deepcopy(solution)
    for cell in exercise.cells:
        if cell.cell_type == "markdown":
            cell.source = cell.source.replace("/solutions/", "/exercises/")
        if cell.cell_type != "code":
            continue
        cell.source = strip_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
    exercise.metadata.pop("widgets", None)
    return exercise


def _write(nb: nbformat.NotebookNode, path: Path) -> None:
    path.write_text(nbformat.writes(nb) + "\n")


def exercise_is_current(solution_path: Path, exercise_path: Path) -> bool:
    """True when ``exercise_path`` is exactly what ``make_exercise`` produces from the solution."""
    if not exercise_path.exists():
        return False
    expected = nbformat.writes(make_exercise(nbformat.read(solution_path, as_version=4))) + "\n"
    return exercise_path.read_text() == expected


def make_exercises(root: Path | None = None) -> list[Path]:
    """Regenerate ``exercises/`` from ``solutions/``; return the files written."""
    root = root or project_root()
    written = []
    for solution_path in sorted((root / "solutions").glob("*.ipynb")):
        exercise_path = root / "exercises" / solution_path.name
        exercise = make_exercise(nbformat.read(solution_path, as_version=4))
        _write(exercise, exercise_path)
        written.append(exercise_path)
    return written


def _execute(path: Path, *, timeout: int) -> tuple[nbformat.NotebookNode, float]:
    """Run one notebook top to bottom in a fresh kernel (cwd = its folder); return it and the wall time in s.

    The kernel runs with strict claims (``ATTN_COURSE_STRICT_CLAIMS=1``): a claim that does not
    hold stops the regeneration instead of storing a ✗ line.
    """
    from nbclient import NotebookClient

    from .claims import STRICT_ENV

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
        allow_error_names=["NotImplementedError"] if path.parent.name == "exercises" else [],
    )
    start = time.perf_counter()
    saved = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"  # the kernel inherits this process's environment
    try:
        client.execute()  # starts the kernel, runs every cell, shuts the kernel down
    finally:
        if saved is None:
            del os.environ[STRICT_ENV]
        else:
            os.environ[STRICT_ENV] = saved
    merge_adjacent_streams(nb)
    return nb, time.perf_counter() - start


def merge_adjacent_streams(nb: nbformat.NotebookNode) -> int:
    """Join each run of consecutive stdout (or stderr) outputs of a cell into one; return how many were joined.

    How a kernel's prints are split into messages depends on timing (under load one print per
    message), so the stored file would change from run to run. Outputs of other kinds between two
    prints (a figure, a progress bar) stay where they were.
    """
    joined = 0
    for cell in nb.cells:
        merged = []
        for output in cell.get("outputs", []):
            previous = merged[-1] if merged else None
            if (output.output_type == "stream" and previous is not None and previous.output_type == "stream"
                    and previous.name == output.name):
                previous.text += output.text
                joined += 1
            else:
                merged.append(output)
        if "outputs" in cell:
            cell.outputs = merged
    return joined


_PROGRESS_TEXT = re.compile(r"\d+%\|[█▏▎▍▌▋▊▉ ]*\|")  # tqdm's "37%|███▋      |"
_PROGRESS_PARTS = ["HTMLModel", "FloatProgressModel", "HTMLModel"]  # tqdm's widget: label, bar, counts


def final_progress_text(nb: nbformat.NotebookNode) -> int:
    """Set the text of every tqdm widget output to the bar's final state; return how many changed.

    A widget output stores its text form from the moment it was displayed (``0%``); the final
    values live in the notebook's saved widget state, which is where this reads them.
    """
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    changed = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            view = data.get("application/vnd.jupyter.widget-view+json")
            if view is None or not _PROGRESS_TEXT.search(data.get("text/plain", "")):
                continue
            box = state.get(view["model_id"], {}).get("state", {})
            parts = [state.get(child.removeprefix("IPY_MODEL_"), {}) for child in box.get("children", [])]
            if [part.get("model_name") for part in parts] != _PROGRESS_PARTS:
                continue
            label, bar, counts = (part["state"] for part in parts)
            filled = round(10 * bar["value"] / bar["max"]) if bar.get("max") else 0
            text = f"{label['value']}|{'█' * filled}{' ' * (10 - filled)}|{counts['value']}"
            data["text/plain"] = html.unescape(text).replace("\u2007", " ")  # tqdm pads with figure spaces
            changed += 1
    return changed


def regenerate(paths: list[Path], *, timeout: int = 600) -> list[tuple[Path, float]]:
    """Execute each notebook in place in a fresh kernel (cwd = its folder); return runtimes in s."""
    results = []
    for path in paths:
        nb, seconds = _execute(path, timeout=timeout)
        final_progress_text(nb)
        _write(nb, path)
        results.append((path, seconds))
    return results


def measure_runtimes(paths: list[Path], *, timeout: int = 600) -> list[tuple[Path, float]]:
    """Execute each notebook in a fresh kernel without saving it; return the wall time of each run in s."""
    return [(path, _execute(path, timeout=timeout)[1]) for path in paths]


def write_course_map(runtimes: Runtimes, *, root: Path | None = None) -> Path:
    """Rewrite the course-map cell of ``notebooks/00_welcome.ipynb`` for ``runtimes``; return the path.

    The cell is the markdown cell starting with ``COURSE_MAP_HEADING``; nothing else changes
    (re-execute 00 afterwards: its checked cell reads the runtimes file).
    """
    path = (root or project_root()) / "notebooks" / "00_welcome.ipynb"
    welcome = nbformat.read(path, as_version=4)
    cells = [c for c in welcome.cells if c.cell_type == "markdown" and c.source.startswith(COURSE_MAP_HEADING)]
    if len(cells) != 1:
        raise ValueError(f"{path} must have one markdown cell starting with {COURSE_MAP_HEADING!r}, found {len(cells)}")
    cells[0].source = course_map_markdown(runtimes)
    _write(welcome, path)
    return path


_TIME_TO_RUN = re.compile(r"(\*\*Time to run:?\*\*:? )about (?:\d+ s|a minute)")


def _about(seconds: float) -> str:
    return f"about {max(1, round(seconds))} s"


def write_header_times(runtimes: Runtimes, *, root: Path | None = None) -> list[Path]:
    """Rewrite "**Time to run**: about N s" in the header of every timed notebook; return those changed.

    Only the figure changes (the rest of the sentence, e.g. "on a 2-core laptop CPU", stays); a
    header without that phrase is left alone (``tests/test_notebooks.py`` asks for it in lessons).
    """
    root = root or project_root()
    changed = []
    for key, seconds in sorted(runtimes.seconds.items()):
        path = root / key
        if not path.exists():
            continue
        nb = nbformat.read(path, as_version=4)
        header = nb.cells[0]
        if header.cell_type != "markdown":
            continue
        new = _TIME_TO_RUN.sub(lambda m: m.group(1) + _about(seconds), header.source, count=1)
        if new != header.source:
            header.source = new
            _write(nb, path)
            changed.append(path)
    return changed
