"""The batch grader: grade many submitted notebooks, one row per submission and task.

``attn-course grade SUBMISSION... --csv grades.csv --json grades.json`` (SUBMISSION: notebooks or
folders of notebooks). For each notebook this process

1. reads the notebook as JSON (it never executes it);
2. starts a child process (``attn_course.grading.runner``) in its own process group, with a
   memory limit (``RLIMIT_AS``), a wall-clock limit, a fresh working folder and its output
   discarded; the child runs the cells and saves what the learner's functions return;
3. loads those results with ``torch.load(weights_only=True)`` (plain tensors and lists only),
   rebuilds its *own* cases with ``task.make_cases()`` and judges them with ``task.judge``.

So nothing a submission prints, defines or monkeypatches can change its grade, and a
submission that crashes, hangs or eats memory gets a zero row with a clear status while the
batch goes on. Statuses: ``graded``, ``missing`` (the function is not defined), ``timeout``,
``memory``, ``crashed``, ``unreadable`` (not a notebook), ``no-tasks`` (no lesson number in
the file name and no ``--tasks``). POSIX only (Linux, macOS). Taught in lesson 00.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from ..course import LESSONS
from . import runner
from .core import CheckResult, Outcome, Task
from .tasks import TASKS, tasks_for_lesson

__all__ = [
    "GradeRow",
    "SubmissionResult",
    "collect_submissions",
    "student_name",
    "tasks_for_notebook",
    "grade_notebook",
    "grade_batch",
    "write_csv",
    "write_json",
    "summary_table",
    "add_arguments",
    "run_from_args",
]

CSV_FIELDS = ["submission", "student", "task", "score", "max_score", "status", "feedback"]
_LESSON_FILES = {lesson.filename for lesson in LESSONS}
_MAX_RESULT_BYTES = 256 * 2**20  # a task's saved outcomes are a few kB; refuse to load a bomb


@dataclass
class GradeRow:
    """One (submission, task) row of the grade sheet."""

    submission: str
    student: str
    task: str
    score: float
    max_score: float
    status: str
    feedback: str
    checks: list[dict] = field(default_factory=list)  # name, passed, points, message (JSON only)

    def csv_row(self) -> dict:
        return {name: getattr(self, name) for name in CSV_FIELDS}


@dataclass
class SubmissionResult:
    """Every row of one submission, with totals and what the child process reported."""

    submission: str
    student: str
    rows: list[GradeRow]
    seconds: float = 0.0
    cell_errors: list[dict] = field(default_factory=list)  # reported by the child: info, never graded

    @property
    def score(self) -> float:
        return sum(row.score for row in self.rows)

    @property
    def max_score(self) -> float:
        return sum(row.max_score for row in self.rows)


# --- which notebooks, which student, which tasks ---------------------------------------------


def collect_submissions(paths: list[str | Path]) -> list[Path]:
    """Notebook files as given, and every ``*.ipynb`` under given folders (hidden folders such as
    ``.ipynb_checkpoints`` skipped), in order, each once."""
    found: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            for path in sorted(given.rglob("*.ipynb")):
                relative = path.relative_to(given).parts
                if not any(part.startswith(".") for part in relative) and path.is_file():
                    found.append(path)
        elif given.exists():
            found.append(given)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {given}")
    seen, unique = set(), []
    for path in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def student_name(path: Path) -> str:
    """The file name's stem, or the folder name when the file keeps the lesson's own name
    (``alice/03_masking.ipynb`` -> ``alice``; ``alice_03.ipynb`` -> ``alice_03``)."""
    if path.name in _LESSON_FILES and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def tasks_for_notebook(path: Path, task_ids: list[str] | None = None) -> list[Task]:
    """``task_ids`` when given, else the tasks of the lesson whose number starts the file name."""
    if task_ids:
        return [TASKS[task_id] for task_id in dict.fromkeys(task_ids)]  # each once, in order
    match = re.match(r"(\d\d)_", path.name)
    return tasks_for_lesson(match.group(1)) if match else []


def _code_cells(path: Path) -> list[str]:
    """The code cells' sources; ValueError when the file is not an nbformat-4 notebook."""
    try:
        notebook = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not a readable notebook (invalid JSON: {exc})") from None
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a Jupyter notebook in nbformat 4 (no list of cells)")
    sources = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            sources.append("")  # keep indices equal to the notebook's cell numbers
            continue
        source = cell.get("source", "")
        sources.append("".join(source) if isinstance(source, list) else str(source))
    return sources


# --- the child process -----------------------------------------------------------------------


def _limit_resources(memory_mb: int) -> None:
    """Runs in the child between fork and exec: cap its address space, no core dumps."""
    import resource  # POSIX only

    if memory_mb > 0:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class _ChildRun:
    out: Path
    returncode: int
    timed_out: bool
    status: dict
    seconds: float


def _run_child(cells: list[str], tasks: list[Task], work: Path, *, timeout_s: float, memory_mb: int,
               cell_timeout_s: float) -> _ChildRun:
    out, cwd = work / "out", work / "cwd"
    out.mkdir()
    cwd.mkdir()
    cells_file = work / "cells.json"
    cells_file.write_text(json.dumps(cells))
    package_parent = str(Path(__file__).resolve().parents[2])  # the child imports this very attn_course
    env = dict(os.environ)
    env.update(
        MPLBACKEND="Agg",
        IPYTHONDIR=str(work / "ipython"),
        PYTHONPATH=os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p),
    )
    command = [
        sys.executable, "-m", "attn_course.grading.runner",
        "--cells", str(cells_file), "--out", str(out),
        "--cell-timeout", str(cell_timeout_s), "--tasks", *[task.id for task in tasks],
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=partial(_limit_resources, memory_mb),
    )
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:  # the whole group: also whatever the notebook started in the background
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    seconds = time.perf_counter() - start
    try:
        status = json.loads((out / "runner.json").read_text())
        status = status if isinstance(status, dict) else {}
    except (OSError, ValueError):
        status = {}
    return _ChildRun(out, proc.returncode, timed_out, status, seconds)


# --- judging in this process -----------------------------------------------------------------


def _failed_checks(task: Task, message: str) -> list[CheckResult]:
    """Every check of ``task`` failed with ``message`` (the judge, run on empty outcomes, names them)."""
    cases = task.make_cases()
    names = task.judge(cases, [Outcome(error="not run") for _ in cases])
    return [CheckResult(check.name, False, message, check.points) for check in names]


def _row(path: Path, task: Task, status: str, checks: list[CheckResult], feedback: str | None = None) -> GradeRow:
    if feedback is None:
        failed = [c for c in checks if not c.passed]
        if failed and len(failed) == len(checks) and len({c.message for c in failed}) == 1:
            feedback = failed[0].message  # e.g. "not implemented yet", once rather than per check
        else:
            feedback = "\n".join(f"{c.name}: {c.message}" for c in failed)
    return GradeRow(
        submission=str(path),
        student=student_name(path),
        task=task.id,
        score=sum(c.earned for c in checks),
        max_score=sum(c.points for c in checks),
        status=status,
        feedback=feedback,
        checks=[asdict(c) for c in checks],
    )


def _zero_row(path: Path, task: Task, status: str, message: str) -> GradeRow:
    return _row(path, task, status, _failed_checks(task, message), feedback=message)


def _why_missing(run: _ChildRun, timeout_s: float, memory_mb: int) -> tuple[str, str]:
    """(status, message) for a task whose results the child never saved."""
    fatal = str(run.status.get("fatal") or "")
    if run.timed_out:
        return "timeout", f"the notebook timed out after {timeout_s:g} s before this task could be graded"
    if run.returncode == runner.EXIT_MEMORY or "MemoryError" in fatal or run.returncode == -signal.SIGKILL:
        return "memory", f"the notebook ran out of memory (limit {memory_mb} MB) before this task could be graded"
    if run.returncode < 0:
        name = signal.Signals(-run.returncode).name if -run.returncode in signal.valid_signals() else "?"
        return "crashed", f"the notebook crashed the grading process ({name}) before this task could be graded"
    return "crashed", (
        f"the grading process stopped early (exit code {run.returncode}) before this task could be graded; "
        "does the notebook end its own process?"
    )


def _load_result(file: Path) -> dict:
    if file.stat().st_size > _MAX_RESULT_BYTES:
        raise ValueError(f"saved results are too large ({file.stat().st_size} bytes)")
    data = torch.load(file, weights_only=True)  # tensors, lists, dicts, strings: never arbitrary objects
    if not isinstance(data, dict) or data.get("format") != runner.FORMAT or not isinstance(data.get("outcomes"), list):
        raise ValueError("saved results are not in the expected format")
    return data


def _judge_task(path: Path, task: Task, run: _ChildRun, *, timeout_s: float, memory_mb: int) -> GradeRow:
    file = run.out / f"{task.id}.pt"
    if not file.exists():
        task_error = str((run.status.get("task_errors") or {}).get(task.id, ""))
        if task_error and not run.timed_out:
            status = "memory" if "MemoryError" in task_error else "crashed"
            return _zero_row(path, task, status, f"grading this task failed in the notebook's process ({task_error})")
        return _zero_row(path, task, *_why_missing(run, timeout_s, memory_mb))
    try:
        data = _load_result(file)
    except Exception as exc:
        return _zero_row(path, task, "crashed", f"the results of this task could not be read back ({exc})")
    name = task.function_name
    if not data.get("defined"):
        message = f"function `{name}` is not defined in the notebook (did you delete or rename its cell?)"
        errors = [e for e in run.status.get("cell_errors", []) if isinstance(e, dict)][:3]
        if errors:
            message += " Cells that raised an error: " + "; ".join(
                f"cell {e.get('cell')}: {str(e.get('error', ''))[:200]}" for e in errors
            )
        return _zero_row(path, task, "missing", message)
    if not data.get("callable"):
        kind = str(data.get("type_name", "?"))[:50]
        return _zero_row(path, task, "missing", f"`{name}` in the notebook is a {kind}, not a function")
    cases = task.make_cases()  # our own inputs: the child's copy is never trusted
    outcomes_data = data["outcomes"]
    if len(outcomes_data) != len(cases) or not all(isinstance(o, dict) for o in outcomes_data):
        return _zero_row(path, task, "crashed", "the saved results do not match this task's cases")
    outcomes = [Outcome.from_plain(o) for o in outcomes_data]
    try:
        checks = task.judge(cases, outcomes)
    except Exception as exc:  # a judge must not stop the batch, whatever it was given
        return _zero_row(path, task, "crashed", f"the results could not be judged ({type(exc).__name__}: {exc})")
    return _row(path, task, "graded", checks)


def grade_notebook(path: str | Path, *, task_ids: list[str] | None = None, timeout_s: float = 120.0,
                   memory_mb: int = 4096, cell_timeout_s: float = 60.0) -> SubmissionResult:
    """Grade one notebook in a child process; every task gets a row, whatever happens."""
    path = Path(path)
    tasks = tasks_for_notebook(path, task_ids)
    result = SubmissionResult(str(path), student_name(path), rows=[])
    if not tasks:
        message = ("no graded tasks: the file name does not start with the number of a lesson that has "
                   "exercises (like 03_masking.ipynb); pass --tasks to choose them")
        result.rows.append(GradeRow(str(path), student_name(path), "", 0.0, 0.0, "no-tasks", message))
        return result
    try:
        cells = _code_cells(path)
    except ValueError as exc:
        result.rows = [_zero_row(path, task, "unreadable", f"{path.name} is {exc}") for task in tasks]
        return result
    with tempfile.TemporaryDirectory(prefix="attn-course-grade-", ignore_cleanup_errors=True) as work:
        run = _run_child(cells, tasks, Path(work), timeout_s=timeout_s, memory_mb=memory_mb,
                         cell_timeout_s=cell_timeout_s)
        result.seconds = run.seconds
        result.cell_errors = [e for e in run.status.get("cell_errors", []) if isinstance(e, dict)][:50]
        result.rows = [_judge_task(path, task, run, timeout_s=timeout_s, memory_mb=memory_mb) for task in tasks]
    return result


def grade_batch(paths: list[str | Path], *, progress=None, **options) -> list[SubmissionResult]:
    """Grade every notebook in ``paths`` (files or folders), one after another."""
    notebooks = collect_submissions(paths)
    results = []
    for index, path in enumerate(notebooks, 1):
        result = grade_notebook(path, **options)
        if progress is not None:
            progress(f"[{index}/{len(notebooks)}] {path}: {result.score:g}/{result.max_score:g} "
                     f"({result.seconds:.1f} s)")
        results.append(result)
    return results


# --- output ----------------------------------------------------------------------------------


def write_csv(results: list[SubmissionResult], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for result in results:
            for row in result.rows:
                writer.writerow(row.csv_row())


def write_json(results: list[SubmissionResult], path: str | Path, *, settings: dict | None = None) -> None:
    data = {
        "settings": settings or {},
        "submissions": [
            {
                "submission": r.submission,
                "student": r.student,
                "score": r.score,
                "max_score": r.max_score,
                "seconds": round(r.seconds, 2),
                "cell_errors": r.cell_errors,
                "tasks": [asdict(row) for row in r.rows],
            }
            for r in results
        ],
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def summary_table(results: list[SubmissionResult]) -> str:
    """One line per row, then a count per status."""
    rows = [row for r in results for row in r.rows]
    header = ("student", "task", "score", "status", "submission")
    lines = [header] + [(row.student, row.task or "-", f"{row.score:g}/{row.max_score:g}", row.status,
                         row.submission) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines]
    counts = Counter(row.status for row in rows)
    text.append(f"{len(results)} notebooks, {len(rows)} rows: "
                + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return "\n".join(text)


# --- the command -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attn-course grade``."""
    parser.add_argument("submissions", nargs="+", help="notebooks, or folders searched for *.ipynb")
    parser.add_argument("--csv", default=None, help="write one row per submission and task to this CSV file")
    parser.add_argument("--json", default=None, help="write rows, checks and per-submission totals to this JSON file")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="ID",
                        help="grade these task ids (default: the lesson number that starts each file name)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per notebook, all cells included")
    parser.add_argument("--cell-timeout", type=float, default=60.0,
                        help="seconds per cell and per call of a graded function")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space limit per notebook (0: none)")


def run_from_args(args: argparse.Namespace) -> int:
    """``attn-course grade``: 0 when the batch ran (however bad the notebooks), 2 on a usage error."""
    if os.name != "posix":
        print("attn-course grade needs a POSIX system (Linux or macOS)", file=sys.stderr)
        return 2
    unknown = [task_id for task_id in args.tasks or [] if task_id not in TASKS]
    if unknown:
        print(f"unknown task id(s): {', '.join(unknown)}; known: {', '.join(sorted(TASKS))}", file=sys.stderr)
        return 2
    try:
        notebooks = collect_submissions(args.submissions)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not notebooks:
        print(f"no notebooks found in {' '.join(args.submissions)}", file=sys.stderr)
        return 2
    options = dict(task_ids=args.tasks, timeout_s=args.timeout, memory_mb=args.memory_mb,
                   cell_timeout_s=args.cell_timeout)
    results = grade_batch(notebooks, progress=lambda line: print(line, file=sys.stderr, flush=True), **options)
    if args.csv:
        write_csv(results, args.csv)
    if args.json:
        write_json(results, args.json, settings=options)
    print(summary_table(results))
    return 0
