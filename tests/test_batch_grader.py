"""The batch grader (`attn-course grade`): honest per-task rows whatever a submission does.

Submissions are built here with nbformat. Most bad behaviours share ONE `attn-course grade` run
(each child process imports torch, a few seconds), with short limits: 3 s per cell and per
function call, 1 GiB of address space. They run in the bubblewrap sandbox where it works, else
with `--sandbox off` (what the grader checks is the same; the attacks on the sandbox itself are in
tests/test_sandbox.py, which needs it).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import time
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from attn_course import cli
from attn_course.grading import batch, runner, sandbox
from attn_course.grading.core import Outcome, grade_function
from attn_course.grading.tasks import TASKS, tasks_for_lesson

ROOT = Path(__file__).resolve().parents[1]
TASK = "03.causal_mask"
CELL_TIMEOUT = 3
CORRECT = "def causal_mask(L, S):\n    return torch.ones(L, S, dtype=torch.bool).tril()"
STUB = 'def causal_mask(L, S):\n    raise NotImplementedError("Your code here: replace this line with your solution.")'
# Shifted by one (diagonal=1), written without torch.tril, which the cheater below replaces.
SHIFTED = "def causal_mask(L, S):\n    return torch.arange(S)[None, :] <= torch.arange(L)[:, None] + 1  # (L, S)"
CHEAT = """\
import builtins, sys
import attn_course.grading as grading
import attn_course.grading.core as core
from attn_course.grading.core import CheckResult, Outcome, TaskResult
from attn_course.grading.tasks import TASKS

def always_pass(cases, outcomes):
    return [CheckResult("everything", True, "", 100.0)]

object.__setattr__(TASKS["03.causal_mask"], "judge", always_pass)
object.__setattr__(TASKS["03.causal_mask"], "make_cases", lambda: [])
core.grade_function = grading.grade_function = lambda task, fn: TaskResult(task.id, task.title, always_pass([], []))
core.run_cases = lambda fn, cases, **kwargs: [Outcome(returned=torch.ones(1)) for _ in cases]
torch.equal = lambda a, b: True
torch.tril = lambda x, diagonal=0: torch.ones_like(x, dtype=torch.bool)
torch.save = lambda *args, **kwargs: None
builtins.print = lambda *args, **kwargs: sys.stdout.write("03.causal_mask - Causal mask: 3/3 points\\n")"""
FAKE_PRINT = 'print("03.causal_mask - Causal mask: 3/3 points\\n  All checks passed. Well done!")\ngrading.check("03.causal_mask", causal_mask)'
INFINITE_CELL = "while True:\n    pass"


def _sandbox_mode() -> str:
    try:
        sandbox.check_available()
    except sandbox.SandboxUnavailable:
        return "off"
    return "bwrap"


MODE = _sandbox_mode()


def write_notebook(path: Path, *sources: str) -> Path:
    """A notebook with a title cell, then one code cell per source."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cells = [new_markdown_cell("# A submission")] + [new_code_cell(source) for source in sources]
    nbformat.write(new_notebook(cells=cells), path)
    return path


# --- one grader run over a folder of good and bad submissions --------------------------------

SUBMISSIONS = {
    "correct": ["import torch", CORRECT],
    "stub": ["import torch", STUB],
    "cheater": ["import torch", SHIFTED, CHEAT, FAKE_PRINT],
    # Defined before its import, and every cell in between misbehaves: the import still runs.
    "hostile": [
        CORRECT,
        "1 / 0",
        INFINITE_CELL,
        "import sys\nsys.exit()",
        "import os\nos._exit(0)",
        "raise KeyboardInterrupt",
        "x = [bytearray(10**8) for _ in range(10**4)]",
        "import torch",
    ],
    "function_loops": ["import torch", "def causal_mask(L, S):\n    while True:\n        pass"],
    "deleted": ["import torch", "x = 1"],
    "segfault": ["import torch", CORRECT, "import ctypes\nctypes.string_at(0)"],
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    for name, sources in SUBMISSIONS.items():
        write_notebook(folder / f"{name}.ipynb", *sources)
    (folder / "unreadable.ipynb").write_text('{"cells": [ this is not JSON')
    write_notebook(folder / ".ipynb_checkpoints" / "correct-checkpoint.ipynb", "import torch", CORRECT)
    out_csv, out_json = folder.parent / "grades.csv", folder.parent / "grades.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["grade", str(folder), "--tasks", TASK, "--csv", str(out_csv), "--json", str(out_json),
                         "--timeout", "120", "--cell-timeout", str(CELL_TIMEOUT), "--memory-mb", "1024",
                         "--sandbox", MODE, "--jobs", "1"])
    assert code == 0, stderr.getvalue()
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    data = json.loads(out_json.read_text())
    return {
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "rows": rows,
        "row": {row["student"]: row for row in rows},
        "json": {sub["student"]: sub for sub in data["submissions"]},
    }


def test_batch_goes_on_and_writes_one_row_per_submission_and_task(graded):
    expected = sorted([*SUBMISSIONS, "unreadable"])  # the checkpoint copy is skipped
    assert sorted(row["student"] for row in graded["rows"]) == expected
    assert all(row["task"] == TASK for row in graded["rows"])
    assert sorted(graded["json"]) == expected
    for sub in graded["json"].values():
        assert [t["task"] for t in sub["tasks"]] == [TASK]
        assert sub["score"] == sum(t["score"] for t in sub["tasks"])
        assert sub["max_score"] == sum(t["max_score"] for t in sub["tasks"]) == 3
    summary = graded["stdout"]
    progress = [line for line in graded["stderr"].splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{i}/{len(expected)}" for i in range(1, len(expected) + 1)]
    assert "8 notebooks graded in" in graded["stderr"]  # a progress line per notebook, then the total
    for name in expected:
        assert name in summary
    assert "8 notebooks, 8 rows" in summary
    assert {row["sandbox"] for row in graded["rows"]} == {MODE}


def test_correct_submission_gets_full_marks(graded):
    row = graded["row"]["correct"]
    assert (row["status"], float(row["score"]), float(row["max_score"])) == ("graded", 3.0, 3.0)
    assert row["feedback"] == ""
    usage = graded["json"]["correct"]
    assert usage["peak_memory_mb"] > 50 and usage["cpu_seconds"] > 0.1  # it imported torch: measured, not zero


def test_untouched_stub_gets_zero(graded):
    row = graded["row"]["stub"]
    assert (row["status"], float(row["score"])) == ("graded", 0.0)
    assert "not implemented yet" in row["feedback"]


def test_monkeypatching_and_fake_printed_scores_change_nothing(graded):
    # The cheater ran all its cells (no errors), yet gets exactly what its shifted mask earns.
    assert graded["json"]["cheater"]["cell_errors"] == []
    honest = grade_function(TASKS[TASK], lambda L, S: torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=1))
    assert 0 < honest.score < honest.max_score
    row = graded["row"]["cheater"]
    assert (row["status"], float(row["score"]), float(row["max_score"])) == ("graded", honest.score, honest.max_score)
    assert "shifted by one" in row["feedback"]


def test_misbehaving_cells_cost_only_themselves(graded):
    row = graded["row"]["hostile"]
    assert (row["status"], float(row["score"])) == ("graded", 3.0), row["feedback"]
    errors = {e["cell"]: e["error"] for e in graded["json"]["hostile"]["cell_errors"]}
    # Cell numbers count from 1 with the title cell: the function is cell 2.
    assert errors[3].startswith("ZeroDivisionError")
    assert errors[4].startswith("CellTimeout") and f"{CELL_TIMEOUT} s" in errors[4]
    assert errors[5].startswith("SystemExit")
    assert errors[6].startswith("SystemExit") and "os._exit(0) was ignored" in errors[6]
    assert errors[7].startswith("KeyboardInterrupt")
    assert errors[8].startswith("MemoryError")
    assert sorted(errors) == [3, 4, 5, 6, 7, 8]


def test_a_function_that_never_returns_gets_zero_with_feedback(graded):
    row = graded["row"]["function_loops"]
    assert (row["status"], float(row["score"])) == ("graded", 0.0)
    assert f"took longer than {CELL_TIMEOUT} s" in row["feedback"]
    assert "not run, because an earlier case took too long" in row["feedback"]  # one timeout, not five


def test_a_deleted_function_cell_is_reported_as_missing(graded):
    row = graded["row"]["deleted"]
    assert (row["status"], float(row["score"]), float(row["max_score"])) == ("missing", 0.0, 3.0)
    assert row["feedback"] == "function `causal_mask` is not defined in the notebook (did you delete or rename its cell?)"
    checks = graded["json"]["deleted"]["tasks"][0]["checks"]
    assert len(checks) == 3 and not any(check["passed"] for check in checks)


def test_a_crashed_process_gets_zero_and_says_why(graded):
    row = graded["row"]["segfault"]
    assert (row["status"], float(row["score"])) == ("crashed", 0.0)
    assert "SIGSEGV" in row["feedback"] and "before this task could be graded" in row["feedback"]


def test_an_unreadable_file_gets_a_zero_row(graded):
    row = graded["row"]["unreadable"]
    assert (row["status"], float(row["score"]), float(row["max_score"])) == ("unreadable", 0.0, 3.0)
    assert "invalid JSON" in row["feedback"]
    assert graded["json"]["unreadable"]["seconds"] == 0  # never started a process


# --- limits that need their own run ----------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for a parent that does not reap it counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (the sandbox hides its pids from itself, not from us)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return [pid for pid in found if _alive(pid)]


def test_a_notebook_past_its_time_limit_is_killed_and_keeps_its_finished_tasks(tmp_path):
    other = next(task for task in TASKS.values() if task.id != TASK)  # any second task
    marker = f"{600 + os.getpid() % 1000}.25"  # sleep's argument: finds the process on the host
    path = write_notebook(
        tmp_path / "stubborn.ipynb",
        "import torch",
        CORRECT,
        # A background process in the notebook's process group...
        f"import subprocess\nsleeper = subprocess.Popen(['sleep', '{marker}'])",
        # ...and a function that swallows the per-call alarm, so only the notebook's limit stops it.
        f"def {other.function_name}(*args, **kwargs):\n    while True:\n        try:\n            while True:\n"
        "                pass\n        except BaseException:\n            pass",
    )
    start = time.perf_counter()
    result = batch.grade_notebook(path, task_ids=[TASK, other.id], timeout_s=20, cell_timeout_s=1, memory_mb=2048,
                                  sandbox=MODE)
    elapsed = time.perf_counter() - start
    # Killed at its 20 s limit, not left to the endless loop or waited for until the 600 s sleeper ends.
    # Orderings that hold under any load (the old "< 50 s" failed when kernel start-up was slow).
    assert 20 <= elapsed < 600 / 2, elapsed
    first, second = result.rows
    assert (first.task, first.status, first.score) == (TASK, "graded", 3.0)  # saved before the hang
    assert (second.task, second.status, second.score) == (other.id, "timeout", 0.0)
    assert second.max_score > 0
    assert second.feedback == "the notebook timed out after 20 s before this task could be graded"
    deadline = time.time() + 10
    while _processes_with(f"sleep {marker}") and time.time() < deadline:
        time.sleep(0.2)
    survivors = _processes_with(f"sleep {marker}")
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "the notebook's background process survived the timeout"
    assert result.seconds >= 20


@pytest.mark.parametrize(
    ("returncode", "timed_out", "fatal", "status", "words"),
    [
        (-signal.SIGKILL, True, None, "timeout", "timed out after 120 s"),
        (3, False, "MemoryError: ", "memory", "ran out of memory (limit 4096 MB)"),
        (-signal.SIGKILL, False, None, "memory", "ran out of memory"),
        (-signal.SIGSEGV, False, None, "crashed", "SIGSEGV"),
        (0, False, None, "crashed", "exit code 0"),
    ],
)
def test_why_a_task_has_no_results(tmp_path, returncode, timed_out, fatal, status, words):
    run = batch._ChildRun(returncode, timed_out, {"fatal": fatal}, {}, 1.0)
    row = batch._judge_task(tmp_path / "x.ipynb", TASKS[TASK], run, timeout_s=120, memory_mb=4096)
    assert (row.status, row.score, row.max_score) == (status, 0.0, 3.0)
    assert words in row.feedback


class _Liar(torch.Tensor):
    """A tensor that claims to equal anything: how a submission could fool an in-process judge."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.equal:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def test_returned_tensor_subclasses_are_saved_as_plain_tensors(tmp_path):
    liar = torch.zeros(4, 4, dtype=torch.bool).as_subclass(_Liar)
    assert torch.equal(liar, torch.ones(4, 4, dtype=torch.bool))  # it lies in this process
    task = TASKS[TASK]
    cases = task.make_cases()
    outcomes = [runner._to_plain(Outcome(returned=liar, args_after=case.args), 5.0) for case in cases]
    torch.save({"outcomes": outcomes}, tmp_path / "saved.pt")
    loaded = torch.load(tmp_path / "saved.pt", weights_only=True)["outcomes"]
    assert type(loaded[0]["returned"]) is torch.Tensor
    result = task.judge(cases, [Outcome.from_plain(o) for o in loaded])
    assert not result[1].passed and "cannot see position" in result[1].message


# --- naming, task selection, usage errors (no child process) ---------------------------------


def test_students_and_tasks_come_from_the_file_names(tmp_path):
    assert batch.student_name(Path("submissions/alice/03_masking.ipynb")) == "alice"
    assert batch.student_name(Path("submissions/bob_03.ipynb")) == "bob_03"
    assert batch.tasks_for_notebook(Path("alice/03_masking.ipynb")) == tasks_for_lesson("03") != []
    assert batch.tasks_for_notebook(Path("bob.ipynb")) == []
    assert [t.id for t in batch.tasks_for_notebook(Path("bob.ipynb"), [TASK, TASK])] == [TASK]
    write_notebook(tmp_path / "b" / "1.ipynb", "x = 1")
    write_notebook(tmp_path / "a.ipynb", "x = 1")
    found = batch.collect_submissions([tmp_path, tmp_path / "a.ipynb"])
    assert found == [tmp_path / "a.ipynb", tmp_path / "b" / "1.ipynb"]


def test_a_notebook_without_a_lesson_number_gets_a_no_tasks_row(tmp_path):
    result = batch.grade_notebook(write_notebook(tmp_path / "scratch.ipynb", "x = 1"), sandbox=MODE)
    [row] = result.rows
    assert (row.status, row.score, row.max_score) == ("no-tasks", 0.0, 0.0)
    assert "--tasks" in row.feedback


@pytest.mark.parametrize("text", ['{"cells": 3}', "[]", "\xff\xfe not utf-8"])
def test_json_that_is_not_a_notebook_is_unreadable(tmp_path, text):
    path = tmp_path / "03_x.ipynb"
    path.write_bytes(text.encode("latin-1"))
    [row] = batch.grade_notebook(path, task_ids=[TASK], sandbox=MODE).rows
    assert (row.status, row.score) == ("unreadable", 0.0)


def test_usage_errors_exit_non_zero(tmp_path, capsys):
    notebook = write_notebook(tmp_path / "a.ipynb", "x = 1")
    assert cli.main(["grade", str(tmp_path / "missing.ipynb")]) == 2
    assert cli.main(["grade", str(notebook), "--tasks", "99.nope"]) == 2
    assert cli.main(["grade", str(tmp_path / "empty_folder")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli.main(["grade", str(tmp_path / "empty")]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["grade"])
    assert exc.value.code == 2
    assert "99.nope" in capsys.readouterr().err


# --- the course's own notebooks --------------------------------------------------------------


def _course_notebooks(folder: str) -> list:
    found = sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{folder}/ has no notebooks yet"), id="none")]
    return [pytest.param(path, id=path.name) for path in found]


@pytest.fixture(scope="module")
def course_grades():
    """Every solution and exercise notebook, graded in one batch with the default limits, two at a time
    (tests/test_sandbox.py grades lesson 03's with --jobs 1 among hostile notebooks)."""
    paths = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    results = batch.grade_batch(paths, timeout_s=300, jobs=2, sandbox=MODE)
    return {Path(r.submission): r for r in results}


@pytest.mark.parametrize("path", _course_notebooks("solutions"))
def test_solutions_get_full_marks(course_grades, path):
    result = course_grades[path]
    expected = [task.id for task in tasks_for_lesson(path.name[:2])]
    assert expected, f"lesson {path.name[:2]} has a solution notebook but no graded tasks"
    assert [row.task for row in result.rows] == expected
    for row in result.rows:
        assert (row.status, row.score) == ("graded", row.max_score), row.feedback
        assert row.max_score > 0


@pytest.mark.parametrize("path", _course_notebooks("exercises"))
def test_untouched_exercises_get_zero(course_grades, path):
    result = course_grades[path]
    assert [row.task for row in result.rows] == [task.id for task in tasks_for_lesson(path.name[:2])]
    for row in result.rows:
        assert (row.status, row.score) == ("graded", 0.0), row.feedback
        assert "not implemented yet" in row.feedback
