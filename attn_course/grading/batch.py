"""The batch grader: grade many submitted notebooks, one row per submission and task.

``attn-course grade SUBMISSION... --csv grades.csv --json grades.json`` (SUBMISSION: notebooks or
folders of notebooks). For each notebook this process

1. reads the notebook as JSON (it never executes it);
2. starts a child process (``attn_course.grading.runner``) in a bubblewrap sandbox of its own
   (``attn_course.grading.sandbox``: own PID and network namespaces, a read-only view of the
   Python environment, one small in-memory scratch folder, none of the host's files), under a
   memory limit and a wall-clock limit; the child runs the cells and writes what the learner's
   functions return into result files the grader created for it;
3. once every process of that sandbox is gone, reads those files back into memory, deletes
   them, and treats every byte as hostile: size caps, the zip rebuilt by this process before
   ``torch.load(weights_only=True)``, then a bounded check of the structure and the types
   (``_validate_record``); anything malformed is that submission's ``crashed`` row;
4. rebuilds its *own* cases with ``task.make_cases()`` and judges them with ``task.judge``.

So nothing a submission prints, defines or monkeypatches can change its grade, a submission that
crashes, hangs or eats memory gets a zero row with a clear status while the batch goes on, and
no submission can reach the grader, another submission or the instructor's files. ``jobs``
sandboxes run in parallel; rows come out in the order of a serial run, with the same grades.
``sandbox="off"`` runs the child without a sandbox (every row then says so).

Statuses: ``graded``, ``missing`` (the function is not defined), ``timeout``, ``memory``,
``crashed``, ``unreadable`` (not a notebook), ``no-tasks`` (no lesson number in the file name and
no ``--tasks``). The sandbox needs Linux; ``--sandbox off`` works on any POSIX system. Taught in
lesson 00.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import io
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..course import LESSONS
from . import runner
from . import sandbox as sandboxing
from .core import CheckResult, Outcome, Task
from .tasks import TASKS, tasks_for_lesson

__all__ = [
    "GradeRow",
    "SubmissionResult",
    "BatchInterrupted",
    "ProgressBar",
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

CSV_FIELDS = ["submission", "student", "task", "score", "max_score", "status", "stretch", "sandbox", "feedback"]
SANDBOXES = ("bwrap", "off")
_LESSON_FILES = {lesson.filename for lesson in LESSONS}
# Limits on what is read back from a child. A task's saved outcomes measure 2-37 kB on the
# course's solutions (`attn-course grade solutions/`); the caps leave room for wrong answers
# with big tensors, and stop a result file from being a memory bomb.
_MAX_RESULT_BYTES = 64 * 2**20  # also the child's largest file (RLIMIT_FSIZE)
_MAX_STATUS_BYTES = 2**20  # runner.json
_MAX_NOTEBOOK_BYTES = 100 * 2**20  # a submitted notebook (with its outputs and images: a few MB)
_MAX_ENTRIES = 10_000  # files in a saved result's zip
_MAX_VALUES = 100_000  # values (tensors, numbers, strings, containers) in one saved result
_MAX_DEPTH = 32
_MAX_STRING = 100_000  # characters
_MAX_INT_BITS = 1024
_MAX_ELEMENTS = 2**26  # in one tensor
_TENSOR_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})
_MAX_MESSAGE = 2000  # characters of one feedback message that quotes the child
_STDERR_BYTES = 8192  # of bwrap's own complaints, kept to explain a sandbox that did not start
# Processes and threads one sandboxed notebook may have: torch starts a thread per core.
_MAX_PROCESSES = max(256, 8 * (os.cpu_count() or 1))
_POLL_S = 0.05


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    stretch: bool = False  # a stretch task (past its lesson): counted apart from the core tasks
    sandbox: str = "bwrap"  # "bwrap", or "off" when graded without a sandbox

    def csv_row(self) -> dict:
        return {name: _csv_safe(getattr(self, name)) for name in CSV_FIELDS}


@dataclass
class SubmissionResult:
    """Every row of one submission, with totals and what the child process reported."""

    submission: str
    student: str
    rows: list[GradeRow]
    seconds: float = 0.0
    cell_errors: list[dict] = field(default_factory=list)  # reported by the child: info, never graded
    peak_memory_mb: float | None = None  # the largest resident size of one of its processes
    cpu_seconds: float | None = None  # user + system time of all its processes
    sandbox: str = "bwrap"

    @property
    def score(self) -> float:
        return sum(row.score for row in self.rows)

    @property
    def max_score(self) -> float:
        return sum(row.max_score for row in self.rows)

    def totals(self, *, stretch: bool) -> tuple[float, float]:
        """(score, max_score) over the core tasks (``stretch=False``) or the stretch tasks."""
        rows = [row for row in self.rows if row.stretch == stretch]
        return sum(row.score for row in rows), sum(row.max_score for row in rows)

    @property
    def failed(self) -> bool:
        """True when some task could not be graded (a status other than ``graded``)."""
        return any(row.status != "graded" for row in self.rows)


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``grade_batch``: ``results`` holds the notebooks finished so far, in order."""

    def __init__(self, results: list[SubmissionResult], total: int) -> None:
        super().__init__(f"interrupted after {len(results)} of {total} notebooks")
        self.results = results
        self.total = total


# --- text that came from a submission --------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _printable(text: str, limit: int = _MAX_MESSAGE) -> str:
    """``text`` without terminal escapes and other control characters (newlines and tabs stay), cut to ``limit``."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _csv_safe(value):
    """A text cell that a spreadsheet would run as a formula gets a leading apostrophe (OWASP's advice)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


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
    """The code cells' sources; ValueError when the file is not an nbformat-4 notebook.

    The file is the student's too: it is not followed if it is a symbolic link, read only up to
    ``_MAX_NOTEBOOK_BYTES``, and any JSON at all (nested deep, odd types) gives sources or a ValueError.
    """
    data = _read_back(path, _MAX_NOTEBOOK_BYTES)
    if isinstance(data, str):
        raise ValueError(f"not a readable notebook ({'a symbolic link' if path.is_symlink() else data})")
    try:
        notebook = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not a readable notebook (invalid JSON: {_printable(str(exc), 200)})") from None
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a Jupyter notebook in nbformat 4 (no list of cells)")
    sources = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            sources.append("")  # keep indices equal to the notebook's cell numbers
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(line, str) for line in source):
            source = "".join(source)
        if not isinstance(source, str):
            raise ValueError("not a Jupyter notebook in nbformat 4 (a cell's source is not text)")
        sources.append(source)
    return sources


# --- the child process -----------------------------------------------------------------------


@dataclass
class _ChildRun:
    """What came back from one child: its exit, and its files read into memory (hostile data)."""

    returncode: int
    timed_out: bool
    status: dict  # runner.json, checked to be a dict; its values are still untrusted
    files: dict[str, bytes | str]  # result file name -> its bytes, or why it could not be read
    seconds: float
    peak_memory_mb: float | None = None
    sandbox: str = "bwrap"
    setup_error: str = ""  # bwrap's complaint when the runner never started
    interrupted: bool = False  # stopped by Ctrl-C: not a result
    cpu_seconds: float | None = None


def _read_back(path: Path, limit: int) -> bytes | str:
    """The file's bytes, or a reason: never follows a link, never reads more than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        return f"it could not be opened ({exc.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "it is not a regular file"
        if info.st_size > limit:
            return f"it is too large ({info.st_size} bytes; the limit is {limit})"
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else f"it is too large (over {limit} bytes)"
    except OSError as exc:
        return f"it could not be read ({exc.strerror})"
    finally:
        os.close(fd)


def _status_from(data: bytes | str) -> dict:
    """runner.json as a dict, or {} when it is missing or malformed."""
    if not isinstance(data, bytes) or not data:
        return {}
    try:
        status = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return {}
    return status if isinstance(status, dict) else {}


def _exit_code(wait_status: int, *, sandboxed: bool) -> int:
    """Like ``Popen.returncode``; bwrap reports a child killed by signal N as 128 + N, turned back into -N."""
    code = os.waitstatus_to_exitcode(wait_status)
    if sandboxed and 128 < code < 128 + 65:
        return -(code - 128)
    return code


def _host_env(work: Path) -> dict:
    """The unsandboxed child's environment (``--sandbox off``): the grader's own, as before the sandbox."""
    package_parent = str(Path(__file__).resolve().parents[2])  # the child imports this very attn_course
    env = dict(os.environ)
    env.update(
        MPLBACKEND="Agg",
        IPYTHONDIR=str(work / "ipython"),
        PYTHONPATH=os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p),
    )
    return env


def _run_child(cells: list[str], tasks: list[Task], *, timeout_s: float, memory_mb: int, cell_timeout_s: float,
               sandbox_mode: str = "bwrap", scratch_mb: int = 256, slot: int = 0,
               stop: threading.Event | None = None) -> _ChildRun:
    """Run the cells in a child (sandboxed unless ``sandbox_mode == "off"``); return once all of it is gone."""
    sandboxed = sandbox_mode != "off"
    work = Path(tempfile.mkdtemp(prefix="attn-course-grade-"))  # 0700: only this user
    pipes: list[int] = []
    try:
        cells_file = work / "cells.json"
        cells_file.write_text(json.dumps(cells))
        os.chmod(cells_file, 0o600)
        results_dir = work / "results"
        results_dir.mkdir(mode=0o700)
        names = [runner.STATUS, *(runner.result_name(task.id) for task in tasks)]
        for name in names:
            (results_dir / name).touch(mode=0o600)
        options = ["--cell-timeout", str(cell_timeout_s), "--memory-mb", str(memory_mb),
                   "--max-file-mb", str(_MAX_RESULT_BYTES // 2**20)]
        handshake = None
        if sandboxed:
            if sandboxing.runs_as_root():
                options += ["--user", str(sandboxing.uid_for_slot(slot))]
            options += ["--max-processes", str(_MAX_PROCESSES)]
            inner = [sys.executable, "-m", "attn_course.grading.runner", "--cells", sandboxing.CELLS,
                     "--out", sandboxing.RESULTS, *options, "--tasks", *[task.id for task in tasks]]
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            pipes += [info_r, info_w, block_r, block_w]
            argv = sandboxing.command(inner, cells=cells_file, results={name: results_dir / name for name in names},
                                      scratch_mb=scratch_mb, info_fd=info_w, block_fd=block_r)
            package_parent = str(Path(__file__).resolve().parents[2])
            env, cwd, pass_fds = sandboxing.child_env(package_parent=package_parent), work, (info_w, block_r)
            handshake = (info_r, block_w)
        else:
            (work / "cwd").mkdir()
            argv = [sys.executable, "-m", "attn_course.grading.runner", "--cells", str(cells_file),
                    "--out", str(results_dir), *options, "--tasks", *[task.id for task in tasks]]
            env, cwd, pass_fds = _host_env(work), work / "cwd", ()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE if sandboxed else subprocess.DEVNULL,
                                pass_fds=pass_fds, start_new_session=True)
        for fd in pass_fds:  # the child's ends
            os.close(fd)
            pipes.remove(fd)
        try:
            waited = _wait(proc, handshake, deadline=start + timeout_s, stop=stop)
        finally:
            if proc.stderr is not None:
                proc.stderr.close()
        seconds = time.perf_counter() - start
        if waited.gone:  # every process of the sandbox is gone: read the results into memory, then delete them
            files = {name: _read_back(results_dir / name,
                                      _MAX_STATUS_BYTES if name == runner.STATUS else _MAX_RESULT_BYTES)
                     for name in names}
        else:
            files = {name: "its sandbox did not end, so its results were not read" for name in names}
    finally:
        for fd in pipes:
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    status = _status_from(files.pop(runner.STATUS))
    returncode = _exit_code(waited.wait_status, sandboxed=sandboxed)
    setup_error = ""
    if not waited.gone:
        setup_error = "its sandbox did not end, so its results were not read"
    elif sandboxed and not status and waited.stderr:
        setup_error = _printable(waited.stderr.decode("utf-8", errors="replace").strip(), 500)
    peak, cpu = _usage(status)
    return _ChildRun(returncode, waited.timed_out, status, files, seconds, peak, "bwrap" if sandboxed else "off",
                     setup_error, waited.interrupted, cpu)


def _usage(status: dict) -> tuple[float | None, float | None]:
    """(peak resident MB, CPU seconds) as the runner measured them on itself and its children.

    Reported by the child, so a hostile notebook can misstate them: they inform sizing a machine
    and never touch a grade. bwrap's own exit status cannot carry them (it does not wait for the
    namespace's processes), so they come through runner.json.
    """
    usage = status.get("usage")
    values = []
    for key in ("peak_memory_mb", "cpu_seconds"):
        value = usage.get(key) if isinstance(usage, dict) else None
        ok = type(value) in (int, float) and math.isfinite(value) and 0 <= value < 10**7
        values.append(float(value) if ok else None)
    return values[0], values[1]


@dataclass
class _Waited:
    wait_status: int
    timed_out: bool
    interrupted: bool
    gone: bool  # every process of the child is known to have ended
    stderr: bytes


def _wait(proc: subprocess.Popen, handshake: tuple[int, int] | None, *, deadline: float,
          stop: threading.Event | None) -> _Waited:
    """Wait for the child until ``deadline`` or ``stop``; kill it then; return once all of it is gone.

    In the sandbox (``handshake`` = bwrap's info pipe and block pipe), bwrap first reports the
    host pid of the namespace's first process; this takes a pidfd of it and only then lets the
    command start (so no notebook code runs before the grader holds it). Killing that process
    makes the kernel kill every other process of the namespace, and the pidfd becomes readable
    only when all of them are gone; bwrap itself may exit a little earlier.
    """
    stderr = bytearray()
    err = proc.stderr.fileno() if proc.stderr is not None else None
    if err is not None:
        os.set_blocking(err, False)
    info_r, block_w = handshake if handshake is not None else (None, None)
    info = bytearray()
    namespace = None  # a pidfd of the namespace's first process; -1 when there is none to have
    killed_at = None
    timed_out = interrupted = False
    while True:
        pid, wait_status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            break
        readable = [fd for fd in (info_r if namespace is None else None, err) if fd is not None]
        ready = select.select(readable, [], [], _POLL_S)[0] if readable else time.sleep(_POLL_S) or []
        if info_r is not None and info_r in ready:
            chunk = os.read(info_r, 4096)
            info += chunk
            match = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
            if match or not chunk:
                namespace = _open_namespace(int(match.group(1)), proc.pid) if match else -1
                try:
                    os.write(block_w, b"x")  # let the command start
                except OSError:  # bwrap already ended
                    pass
        if err is not None and err in ready:
            try:
                chunk = os.read(err, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"":  # end of file: bwrap is ending
                err = None
            elif chunk and len(stderr) < _STDERR_BYTES:
                stderr += chunk[: _STDERR_BYTES - len(stderr)]
        now = time.perf_counter()
        if killed_at is None and (now >= deadline or (stop is not None and stop.is_set())):
            timed_out, interrupted = now >= deadline, now < deadline
            killed_at = now
            _kill(proc, namespace)
        elif killed_at is not None and now - killed_at > 10:  # bwrap itself does not end: end it too
            _kill_group(proc)
            killed_at = now
    proc.returncode = _exit_code(wait_status, sandboxed=handshake is not None)  # reaped here, not by Popen
    gone = True
    if handshake is None:
        _kill_group(proc)  # whatever the notebook left behind in its process group (not setsid-ed ones)
    elif namespace is not None and namespace >= 0:
        if not select.select([namespace], [], [], 10)[0]:
            signal.pidfd_send_signal(namespace, signal.SIGKILL)
            gone = bool(select.select([namespace], [], [], 10)[0])
        os.close(namespace)
    # namespace None: bwrap ended before the handshake, so the command never started.
    return _Waited(wait_status, timed_out, interrupted, gone, bytes(stderr))


def _open_namespace(pid: int, monitor: int) -> int:
    """A pidfd of the namespace's first process ``pid``, or -1 when it is already gone.

    Checked to be the child of our bwrap (``monitor``): a pid that ended and was reused before
    the pidfd was opened would belong to someone else, whom we must never signal.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    try:
        found = re.search(r"^PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found is None or int(found.group(1)) != monitor:
        os.close(fd)
        return -1
    return fd


def _kill(proc: subprocess.Popen, namespace: int | None) -> None:
    if namespace is not None and namespace >= 0:
        try:
            signal.pidfd_send_signal(namespace, signal.SIGKILL)
            return
        except ProcessLookupError:
            pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- reading back what the child wrote (hostile data) ----------------------------------------


class _Malformed(ValueError):
    """Data read back from a child that is not what the runner writes."""


def _rebuilt_zip(data: bytes) -> bytes:
    """The torch file ``data`` rewritten by this process's own ``zipfile``, after checking every entry.

    ``torch.load`` then parses only a zip this process wrote: stored entries whose sizes were
    checked here, so no compressed bomb and no disagreement between two zip parsers.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            if len(entries) > _MAX_ENTRIES:
                raise _Malformed(f"{len(entries)} entries in its zip")
            total = 0
            for entry in entries:
                if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
                    raise _Malformed("a compressed entry in its zip")
                total += entry.file_size
                if total > len(data):
                    raise _Malformed("entries larger than the file")
            rebuilt = io.BytesIO()
            with zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as clean:
                for entry in entries:
                    clean.writestr(entry.filename, archive.read(entry))
            return rebuilt.getvalue()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, KeyError, UnicodeError) as exc:
        raise _Malformed(f"not a torch file ({type(exc).__name__})") from None


def _check_plain(value) -> None:
    """``value`` holds only what the runner saves: plain CPU tensors, None, bool, int, float, str,
    lists, tuples and dicts with str keys, within bounds of count, depth and size."""
    stack = [(value, 0)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > _MAX_VALUES:
            raise _Malformed(f"more than {_MAX_VALUES} values")
        if depth > _MAX_DEPTH:
            raise _Malformed(f"nested deeper than {_MAX_DEPTH}")
        kind = type(item)
        if item is None or kind is bool or kind is float:
            continue
        if kind is int:
            if item.bit_length() > _MAX_INT_BITS:
                raise _Malformed("an integer too large")
        elif kind is str:
            if len(item) > _MAX_STRING:
                raise _Malformed("a string too long")
        elif kind is torch.Tensor:
            _check_tensor(item)
        elif kind is list or kind is tuple:
            stack.extend((x, depth + 1) for x in item)
        elif kind is dict:
            for key, x in item.items():
                if type(key) is not str or len(key) > _MAX_STRING:
                    raise _Malformed("a dict key that is not a string")
                stack.append((x, depth + 1))
        else:
            raise _Malformed(f"a value of type {kind.__name__}")


def _check_tensor(t: torch.Tensor) -> None:
    if t.layout is not torch.strided or t.device.type != "cpu" or t.dtype not in _TENSOR_DTYPES:
        raise _Malformed(f"a tensor the runner never saves ({t.layout}, {t.device}, {t.dtype})")
    if t.requires_grad or t.is_quantized or t.is_conj() or t.is_neg():
        raise _Malformed("a tensor with flags the runner never saves")
    if t.numel() > _MAX_ELEMENTS or t.numel() * t.element_size() > t.untyped_storage().nbytes():
        raise _Malformed("a tensor larger than its data (or too large)")  # e.g. stride 0 over 10**12 elements


def _load_record(data: bytes, task: Task) -> dict:
    """A task's saved results, validated: the checks below are all the trust they get."""
    try:
        record = torch.load(io.BytesIO(_rebuilt_zip(data)), weights_only=True, map_location="cpu")
    except _Malformed:
        raise
    except Exception as exc:  # torch's own refusal (unknown globals, bad storage): its text can be long
        raise _Malformed(f"torch.load refused it ({type(exc).__name__})") from None
    _check_plain(record)
    if type(record) is not dict:
        raise _Malformed(f"a {type(record).__name__} instead of a dict")
    if record.get("format") != runner.FORMAT or type(record.get("format")) is not int:
        raise _Malformed("not in the expected format")
    if record.get("task") != task.id:
        raise _Malformed("saved for another task")
    for key in ("defined", "callable"):
        if type(record.get(key)) is not bool:
            raise _Malformed(f"`{key}` is not True or False")
    if type(record.get("type_name", "")) is not str:
        raise _Malformed("`type_name` is not a string")
    outcomes = record.get("outcomes")
    if type(outcomes) is not list:
        raise _Malformed("`outcomes` is not a list")
    for outcome in outcomes:
        if type(outcome) is not dict:
            raise _Malformed("an outcome is not a dict")
        error, args_after = outcome.get("error"), outcome.get("args_after", [])
        if error is not None and type(error) is not str:
            raise _Malformed("an outcome's `error` is not a string")
        if type(args_after) not in (list, tuple):
            raise _Malformed("an outcome's `args_after` is not a list")
        if type(outcome.get("not_implemented", False)) is not bool:
            raise _Malformed("an outcome's `not_implemented` is not True or False")
    return record


# --- judging in this process -----------------------------------------------------------------


def _judged(task: Task, cases, outcomes) -> list[CheckResult]:
    """``task.judge`` from the same random state every time, so grades do not depend on the order
    in which parallel jobs finish."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return task.judge(cases, outcomes)


def _failed_checks(task: Task, message: str) -> list[CheckResult]:
    """Every check of ``task`` failed with ``message`` (the judge, run on empty outcomes, names them)."""
    cases = task.make_cases()
    names = _judged(task, cases, [Outcome(error="not run") for _ in cases])
    return [CheckResult(check.name, False, message, check.points) for check in names]


def _row(path: Path, task: Task, status: str, checks: list[CheckResult], feedback: str | None = None,
         *, sandbox_mode: str = "bwrap") -> GradeRow:
    if feedback is None:
        failed = [c for c in checks if not c.passed]
        if failed and len(failed) == len(checks) and len({c.message for c in failed}) == 1:
            feedback = failed[0].message  # e.g. "not implemented yet", once rather than per check
        else:
            feedback = "\n".join(f"{c.name}: {c.message}" for c in failed)
    # Judges quote the learner's errors and values: no terminal escapes, bounded length.
    checks = [CheckResult(c.name, c.passed, _printable(str(c.message)), c.points) for c in checks]
    return GradeRow(
        submission=str(path),
        student=student_name(path),
        task=task.id,
        score=sum(c.earned for c in checks),
        max_score=sum(c.points for c in checks),
        status=status,
        feedback=_printable(feedback, 4 * _MAX_MESSAGE),
        checks=[asdict(c) for c in checks],
        stretch=bool(getattr(task, "stretch", False)),
        sandbox=sandbox_mode,
    )


def _zero_row(path: Path, task: Task, status: str, message: str, *, sandbox_mode: str = "bwrap") -> GradeRow:
    return _row(path, task, status, _failed_checks(task, message), feedback=message, sandbox_mode=sandbox_mode)


def _why_missing(run: _ChildRun, timeout_s: float, memory_mb: int) -> tuple[str, str]:
    """(status, message) for a task whose results the child never saved."""
    fatal = str(run.status.get("fatal") or "")
    if run.timed_out:
        return "timeout", f"the notebook timed out after {timeout_s:g} s before this task could be graded"
    if run.returncode == runner.EXIT_MEMORY or "MemoryError" in fatal or run.returncode == -signal.SIGKILL:
        return "memory", f"the notebook ran out of memory (limit {memory_mb} MB) before this task could be graded"
    if run.setup_error:
        return "crashed", f"the notebook could not be started ({run.setup_error})"
    if run.returncode < 0:
        name = signal.Signals(-run.returncode).name if -run.returncode in signal.valid_signals() else "?"
        return "crashed", f"the notebook crashed the grading process ({name}) before this task could be graded"
    return "crashed", (
        f"the grading process stopped early (exit code {run.returncode}) before this task could be graded; "
        "does the notebook end its own process?"
    )


def _judge_task(path: Path, task: Task, run: _ChildRun, *, timeout_s: float, memory_mb: int) -> GradeRow:
    """The row of one task; whatever the child wrote, this returns a row and raises nothing."""
    mode = run.sandbox
    try:
        return _judge_task_unguarded(path, task, run, timeout_s=timeout_s, memory_mb=memory_mb)
    except Exception as exc:  # a bug here must cost one row, never the batch
        return _zero_row(path, task, "crashed", f"the results could not be judged ({_printable(repr(exc), 300)})",
                         sandbox_mode=mode)


def _judge_task_unguarded(path: Path, task: Task, run: _ChildRun, *, timeout_s: float, memory_mb: int) -> GradeRow:
    mode = run.sandbox
    data = run.files.get(runner.result_name(task.id), b"")
    if isinstance(data, bytes) and not data:  # the child never saved this task
        task_errors = run.status.get("task_errors")
        task_error = task_errors.get(task.id) if isinstance(task_errors, dict) else None
        task_error = _printable(task_error, 300) if isinstance(task_error, str) else ""
        if task_error and not run.timed_out:
            status = "memory" if "MemoryError" in task_error else "crashed"
            return _zero_row(path, task, status, f"grading this task failed in the notebook's process ({task_error})",
                             sandbox_mode=mode)
        return _zero_row(path, task, *_why_missing(run, timeout_s, memory_mb), sandbox_mode=mode)
    if isinstance(data, str):
        return _zero_row(path, task, "crashed", f"the results of this task could not be read back ({data})",
                         sandbox_mode=mode)
    try:
        record = _load_record(data, task)
    except (_Malformed, RecursionError, MemoryError) as exc:
        return _zero_row(path, task, "crashed",
                         f"the results of this task could not be read back (malformed: {_printable(str(exc), 300)})",
                         sandbox_mode=mode)
    name = task.function_name
    if not record["defined"]:
        message = f"function `{name}` is not defined in the notebook (did you delete or rename its cell?)"
        errors = _cell_errors(run.status)[:3]
        if errors:
            message += " Cells that raised an error: " + "; ".join(f"cell {e['cell']}: {e['error'][:200]}" for e in errors)
        return _zero_row(path, task, "missing", message, sandbox_mode=mode)
    if not record["callable"]:
        kind = _printable(str(record.get("type_name", "?")), 50)
        return _zero_row(path, task, "missing", f"`{name}` in the notebook is a {kind}, not a function", sandbox_mode=mode)
    cases = task.make_cases()  # our own inputs: the child's copy is never trusted
    outcomes_data = record["outcomes"]
    if len(outcomes_data) != len(cases):
        return _zero_row(path, task, "crashed", "the saved results do not match this task's cases", sandbox_mode=mode)
    try:
        outcomes = [Outcome.from_plain(o) for o in outcomes_data]
        checks = _judged(task, cases, outcomes)
    except Exception as exc:  # a judge must not stop the batch, whatever it was given
        return _zero_row(path, task, "crashed",
                         f"the results could not be judged ({_printable(f'{type(exc).__name__}: {exc}', 300)})",
                         sandbox_mode=mode)
    return _row(path, task, "graded", checks, sandbox_mode=mode)


def _cell_errors(status: dict) -> list[dict]:
    """The child's list of cell errors, as ``{"cell": int, "error": str}`` (anything else dropped)."""
    errors = status.get("cell_errors")
    if not isinstance(errors, list):
        return []
    kept = []
    for error in errors[:50]:
        if isinstance(error, dict) and type(error.get("cell")) is int and isinstance(error.get("error"), str):
            kept.append({"cell": error["cell"], "error": _printable(error["error"], 300)})
    return kept


# --- one notebook ----------------------------------------------------------------------------

_OPTION_NAMES = ("task_ids", "timeout_s", "memory_mb", "cell_timeout_s", "sandbox", "scratch_mb")


def _prepare(path: Path, task_ids: list[str] | None, mode: str) -> tuple[list[Task], list[str] | None, SubmissionResult]:
    """The notebook's tasks and cells, and its result so far (complete when there is nothing to run)."""
    tasks = tasks_for_notebook(path, task_ids)
    result = SubmissionResult(str(path), student_name(path), rows=[], sandbox=mode)
    if not tasks:
        message = ("no graded tasks: the file name does not start with the number of a lesson that has "
                   "exercises (like 03_masking.ipynb); pass --tasks to choose them")
        result.rows.append(GradeRow(str(path), student_name(path), "", 0.0, 0.0, "no-tasks", message, sandbox=mode))
        return tasks, None, result
    try:
        cells = _code_cells(path)
    except ValueError as exc:
        result.rows = [_zero_row(path, task, "unreadable", _printable(f"{path.name} is {exc}"), sandbox_mode=mode)
                       for task in tasks]
        return tasks, None, result
    return tasks, cells, result


def _finish(path: Path, tasks: list[Task], run: _ChildRun, result: SubmissionResult, *, timeout_s: float,
            memory_mb: int) -> SubmissionResult:
    result.seconds = run.seconds
    result.peak_memory_mb = run.peak_memory_mb
    result.cpu_seconds = run.cpu_seconds
    result.cell_errors = _cell_errors(run.status)
    result.rows = [_judge_task(path, task, run, timeout_s=timeout_s, memory_mb=memory_mb) for task in tasks]
    return result


def grade_notebook(path: str | Path, *, task_ids: list[str] | None = None, timeout_s: float = 120.0,
                   memory_mb: int = 4096, cell_timeout_s: float = 60.0, sandbox: str = "bwrap",
                   scratch_mb: int = 256) -> SubmissionResult:
    """Grade one notebook in a child process (in a sandbox unless ``sandbox="off"``); every task gets a row.

    Raises ``attn_course.grading.sandbox.SandboxUnavailable`` when a sandbox is asked for and none can be made.
    """
    _check_mode(sandbox)
    path = Path(path)
    tasks, cells, result = _prepare(path, task_ids, sandbox)
    if cells is None:
        return result
    run = _run_child(cells, tasks, timeout_s=timeout_s, memory_mb=memory_mb, cell_timeout_s=cell_timeout_s,
                     sandbox_mode=sandbox, scratch_mb=scratch_mb)
    return _finish(path, tasks, run, result, timeout_s=timeout_s, memory_mb=memory_mb)


def _check_mode(mode: str) -> None:
    if mode not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {SANDBOXES}, got {mode!r}")
    if mode == "bwrap":
        sandboxing.check_available()


# --- many notebooks, in parallel -------------------------------------------------------------


def grade_batch(paths: list[str | Path], *, jobs: int = 1, progress: ProgressBar | None = None,
                task_ids: list[str] | None = None, timeout_s: float = 120.0, memory_mb: int = 4096,
                cell_timeout_s: float = 60.0, sandbox: str = "bwrap", scratch_mb: int = 256) -> list[SubmissionResult]:
    """Grade every notebook in ``paths`` (files or folders), ``jobs`` at a time.

    Results come in the order of ``collect_submissions`` and are the same for any ``jobs``: the
    children run in parallel (each in its own sandbox, each job as its own uid when root), while
    this thread reads back and judges each one as it ends. On Ctrl-C the running children are
    killed and ``BatchInterrupted`` carries the notebooks finished so far.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    _check_mode(sandbox)
    notebooks = collect_submissions(paths)
    if sandbox == "bwrap" and jobs > _root_jobs_limit():
        raise ValueError(f"at most {_root_jobs_limit()} jobs when grading as root (one unused uid per job)")
    slots: queue.SimpleQueue[int] = queue.SimpleQueue()
    for slot in range(jobs):
        slots.put(slot)
    stop = threading.Event()
    prepared: list[tuple[list[Task], list[str] | None, SubmissionResult]] = []
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb)

    def work(index: int) -> _ChildRun | None:
        tasks, cells, _ = prepared[index]
        if cells is None:
            return None  # nothing to run: its rows are already written
        if stop.is_set():
            return _ChildRun(0, False, {}, {}, 0.0, sandbox=sandbox, interrupted=True)
        slot = slots.get()
        try:
            return _run_child(cells, tasks, cell_timeout_s=cell_timeout_s, sandbox_mode=sandbox,
                              scratch_mb=scratch_mb, slot=slot, stop=stop, **limits)
        except Exception as exc:  # e.g. bwrap removed mid-batch: this notebook's rows say so
            return _ChildRun(-1, False, {}, {}, 0.0, sandbox=sandbox,
                             setup_error=_printable(f"{type(exc).__name__}: {exc}", 500))
        finally:
            slots.put(slot)

    results: dict[int, SubmissionResult] = {}
    runs: dict[int, _ChildRun | None] = {}

    def judge_finished() -> None:
        for index in sorted(set(runs) - set(results)):
            run = runs[index]
            path = notebooks[index]
            tasks, _, result = prepared[index]
            if run is None:
                results[index] = result
            elif not run.interrupted:
                results[index] = _finish(path, tasks, run, result, **limits)
            else:
                continue
            if progress is not None:
                progress.advance(results[index])

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="attn-course-grade")
    futures: dict[concurrent.futures.Future, int] = {}
    try:
        prepared.extend(_prepare(path, task_ids, sandbox) for path in notebooks)
        if progress is not None:
            progress.start(len(notebooks), jobs)
        for index in range(len(notebooks)):
            futures[executor.submit(work, index)] = index
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                runs[futures[future]] = future.result()
            judge_finished()
            if progress is not None:
                progress.refresh()
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() else None
        try:
            stop.set()  # the running children are killed within _POLL_S; queued ones never start
            executor.shutdown(wait=True, cancel_futures=True)
            for future, index in futures.items():
                if future.done() and not future.cancelled() and future.exception() is None:
                    runs.setdefault(index, future.result())
            judge_finished()
            finished = [results[index] for index in sorted(results)]
            if progress is not None:
                progress.close(interrupted=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        raise BatchInterrupted(finished, len(notebooks)) from None
    executor.shutdown(wait=True)
    if progress is not None:
        progress.close()
    return [results[index] for index in range(len(notebooks))]


def _root_jobs_limit() -> int:
    return len(sandboxing._free_uids()) if sandboxing.runs_as_root() else 10**9


class ProgressBar:
    """Notebooks done, failures so far (a task not ``graded``) and the time left, on ``stream``.

    On a terminal: one line redrawn in place, with a line above it for each failed notebook.
    Elsewhere (a log file, a pipe): one line per finished notebook.
    """

    def __init__(self, stream=None, *, tty: bool | None = None, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width
        self.total = self.done = self.failed = 0
        self.started = time.perf_counter()

    def start(self, total: int, jobs: int) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.started = time.perf_counter()
        self.refresh()

    def time_left(self) -> str:
        if self.done == 0:
            return "? left"
        if self.done >= self.total:
            return "done"
        seconds = (time.perf_counter() - self.started) / self.done * (self.total - self.done)
        return f"about {_clock(seconds)} left"

    def line(self) -> str:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        return f"grading [{bar}] {self.done}/{self.total} notebooks, {self.failed} failed, {self.time_left()}"

    def advance(self, result: SubmissionResult) -> None:
        self.done += 1
        self.failed += result.failed
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(Counter(row.status for row in result.rows).items()))
        where = _printable(result.submission, 200)
        if self.tty:
            if result.failed:
                self._write(f"\r\x1b[2KFAILED {where}: {statuses}\n")
            self.refresh()
        else:
            self._write(f"[{self.done}/{self.total}] {where}: {result.score:g}/{result.max_score:g} ({statuses}; "
                        f"{result.seconds:.1f} s) | {self.failed} failed, {self.time_left()}\n")

    def refresh(self) -> None:
        if self.tty:
            self._write("\r\x1b[2K" + self.line())

    def close(self, *, interrupted: bool = False) -> None:
        elapsed = _clock(time.perf_counter() - self.started)
        note = (f"interrupted: {self.done} of {self.total} notebooks graded" if interrupted
                else f"{self.done} notebooks graded")
        self._write(("\r\x1b[2K" + self.line() + "\n" if self.tty else "") + f"{note} in {elapsed}, {self.failed} failed\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(math.ceil(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# --- output ----------------------------------------------------------------------------------


def write_csv(results: list[SubmissionResult], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for result in results:
            for row in result.rows:
                writer.writerow(row.csv_row())


def write_json(results: list[SubmissionResult], path: str | Path, *, settings: dict | None = None) -> None:
    submissions = []
    for r in results:
        core, stretch = r.totals(stretch=False), r.totals(stretch=True)
        submissions.append({
            "submission": r.submission,
            "student": r.student,
            "score": r.score,
            "max_score": r.max_score,
            "core_score": core[0],
            "core_max_score": core[1],
            "stretch_score": stretch[0],
            "stretch_max_score": stretch[1],
            "sandbox": r.sandbox,
            "seconds": round(r.seconds, 2),
            "peak_memory_mb": None if r.peak_memory_mb is None else round(r.peak_memory_mb, 1),
            "cpu_seconds": None if r.cpu_seconds is None else round(r.cpu_seconds, 2),
            "cell_errors": r.cell_errors,
            "tasks": [asdict(row) for row in r.rows],
        })
    Path(path).write_text(json.dumps({"settings": settings or {}, "submissions": submissions}, indent=2) + "\n")


def summary_table(results: list[SubmissionResult]) -> str:
    """One line per row, then core and stretch totals per notebook, then a count per status."""
    rows = [row for r in results for row in r.rows]
    header = ("student", "task", "kind", "score", "status", "submission")
    lines = [header] + [(_printable(row.student, 80), row.task or "-", "stretch" if row.stretch else "core",
                         f"{row.score:g}/{row.max_score:g}", row.status, _printable(row.submission, 200)) for row in rows]
    text = _columns(lines)
    if any(row.stretch for row in rows):
        totals = [("student", "core", "stretch", "submission")]
        for r in results:
            (core, core_max), (extra, extra_max) = r.totals(stretch=False), r.totals(stretch=True)
            totals.append((_printable(r.student, 80), f"{core:g}/{core_max:g}", f"{extra:g}/{extra_max:g}",
                           _printable(r.submission, 200)))
        text += [""] + _columns(totals)
    counts = Counter(row.status for row in rows)
    text.append(f"{len(results)} notebooks, {len(rows)} rows: "
                + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    peaks = [r.peak_memory_mb for r in results if r.peak_memory_mb is not None]
    if peaks:
        text.append(f"largest memory of one notebook's process: {max(peaks):.0f} MB")
    if any(r.sandbox == "off" for r in results):
        text.append("WARNING: graded WITHOUT a sandbox (--sandbox off): every row says sandbox=off")
    return "\n".join(text)


def _columns(lines: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines]


# --- the command -----------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attn-course grade``."""
    parser.add_argument("submissions", nargs="+", help="notebooks, or folders searched for *.ipynb")
    parser.add_argument("--csv", default=None, help="write one row per submission and task to this CSV file")
    parser.add_argument("--json", default=None, help="write rows, checks and per-submission totals to this JSON file")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="ID",
                        help="grade these task ids (default: the lesson number that starts each file name)")
    parser.add_argument("--jobs", type=_positive_int, default=default_jobs(),
                        help="notebooks graded in parallel, each in its own sandbox (default: the number of cores)")
    parser.add_argument("--sandbox", choices=SANDBOXES, default="bwrap",
                        help="bwrap (default): each notebook in a bubblewrap sandbox, refused where none can be made; "
                             "off: no sandbox, for notebooks you trust (every row then says sandbox=off)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per notebook, all cells included")
    parser.add_argument("--cell-timeout", type=float, default=60.0,
                        help="seconds per cell and per call of a graded function")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space limit per process of a notebook (0: none)")
    parser.add_argument("--scratch-mb", type=_positive_int, default=256,
                        help="size of a sandboxed notebook's only writable folder, held in memory")


def run_from_args(args: argparse.Namespace) -> int:
    """``attn-course grade``: 0 when the batch ran (however bad the notebooks), 2 on a usage error or
    when no sandbox can be made, 130 on Ctrl-C (after writing the rows finished so far)."""
    if os.name != "posix":
        print("attn-course grade needs a POSIX system (Linux, or macOS with --sandbox off)", file=sys.stderr)
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
    try:
        _check_mode(args.sandbox)
    except sandboxing.SandboxUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    jobs = min(args.jobs, len(notebooks))
    if args.sandbox == "bwrap" and jobs > _root_jobs_limit():
        print(f"--jobs {args.jobs}: at most {_root_jobs_limit()} when grading as root", file=sys.stderr)
        return 2
    options = dict(task_ids=args.tasks, timeout_s=args.timeout, memory_mb=args.memory_mb,
                   cell_timeout_s=args.cell_timeout, sandbox=args.sandbox, scratch_mb=args.scratch_mb)
    if args.sandbox == "off":
        print("WARNING: grading WITHOUT a sandbox (--sandbox off): a notebook can read and change anything "
              "you can, including other submissions and their grades", file=sys.stderr)
    code = 0
    try:
        results = grade_batch(notebooks, jobs=jobs, progress=ProgressBar(sys.stderr), **options)
    except BatchInterrupted as interrupted:
        results, code = interrupted.results, 130
    settings = dict(options, jobs=jobs, interrupted=code != 0, notebooks=len(notebooks))
    if args.csv:
        write_csv(results, args.csv)
    if args.json:
        write_json(results, args.json, settings=settings)
    print(summary_table(results))
    if code:
        print(f"interrupted: {len(results)} of {len(notebooks)} notebooks graded; the files hold those rows",
              file=sys.stderr)
    return code
