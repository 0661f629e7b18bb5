"""The batch grader's child process: run one submission's cells, record what its functions return.

Started by ``attn_course.grading.batch`` (never by hand) as::

    python -m attn_course.grading.runner --cells CELLS.json --out OUTDIR --tasks 03.causal_mask ...

normally inside a bubblewrap sandbox (``attn_course.grading.sandbox``), under a wall-clock limit
kept by the grader. ``OUTDIR`` holds files the grader created empty: ``runner.json`` and one
``<task id>.pt`` per task; the runner opens them first and only ever writes into them (it never
creates, renames or deletes a file there). In order, it:

1. opens those files, silences its stdout/stderr, builds every task's cases and reads the cells,
   *before* any submission code runs;
2. sets its limits (address space ``--memory-mb``, file size ``--max-file-mb``, processes
   ``--max-processes``, no core dumps) and, started as root in the sandbox, becomes the unused
   uid ``--user``, which the notebook keeps (it can never get root back);
3. executes the notebook's code cells with IPython (so ``%magics`` work), each cell in its own
   ``try`` and under a per-cell time limit, so one endless loop or ``sys.exit()`` does not cost
   the other tasks; ``os._exit``/``os.abort``/killing itself are turned into ordinary errors;
4. for each task, calls the learner's function (``task.function_name``) on the cases with
   ``run_cases`` and saves the outcomes as plain tensors/lists/strings, one file per task, as
   soon as they exist (partial results survive a later crash).

Every byte it writes is untrusted by the grader, which validates it before judging.

It judges nothing: the parent rebuilds its own cases and judges the saved outcomes, so a
submission that rewrites anything in this process can at most change what its own functions
appear to return. Taught in lesson 00 (how exercises and grading work).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

# Bound now, before any submission code runs: a notebook that rewrites attn_course.grading.core
# or torch.save later cannot change what this module calls.
from .core import Outcome, _CallTimeout, run_cases
from .tasks import TASKS

_save = torch.save
_BytesIO = io.BytesIO

__all__ = ["main", "EXIT_OK", "EXIT_MEMORY", "EXIT_ERROR", "FORMAT"]

EXIT_OK = 0
EXIT_MEMORY = 3  # a MemoryError escaped the cells and the task calls
EXIT_ERROR = 4  # the runner itself failed (a bug, or a submission that broke it)
FORMAT = 1  # version of the per-task files
STATUS = "runner.json"

# Saved before any submission code runs: the submission may replace the os functions.
_real_exit = os._exit
_real_kill = os.kill
_real_killpg = getattr(os, "killpg", None)  # POSIX only; this module is imported everywhere by the CLI


class CellTimeout(BaseException):
    """Raised in a cell that runs past the per-cell limit (a BaseException, so `except Exception` does not swallow it)."""


class _Results:
    """The files the grader created in the output folder, opened before any submission code runs.

    They are rewritten in place (truncate, then write): the folder may be read-only (it is in the
    sandbox), and a torn file is simply a task without readable results for the grader.
    """

    def __init__(self, out: Path, names: list[str]) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        self.fds = {name: os.open(out / name, flags) for name in names}

    def write(self, name: str, data: bytes) -> None:
        fd = self.fds[name]
        os.ftruncate(fd, 0)
        view = memoryview(data)
        try:
            while view:
                view = view[os.pwrite(fd, view, len(data) - len(view)):]
        except BaseException:  # e.g. past the file-size limit: no torn file, the grader sees none
            os.ftruncate(fd, 0)
            raise

    def save(self, name: str, record: dict) -> None:
        buffer = _BytesIO()
        _save(record, buffer)
        self.write(name, buffer.getvalue())


class _Status:
    """``runner.json`` in the output folder: how far the runner got, and the errors the cells raised."""

    def __init__(self, results: _Results) -> None:
        self.results = results
        self.data: dict = {"stage": "starting", "cell_errors": [], "fatal": None}

    def update(self, **changes) -> None:
        self.data.update(changes)
        self.results.write(STATUS, json.dumps(self.data).encode())


def _describe(exc: BaseException) -> str:
    text = str(exc)
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _install_exit_guards() -> None:
    """Turn the usual ways a notebook ends its own process into exceptions inside the cell."""

    def refuse_exit(status=0):
        raise SystemExit(f"os._exit({status}) was ignored by the grader")

    def refuse_abort():
        raise SystemExit("os.abort() was ignored by the grader")

    def guarded_kill(pid, sig):
        if sig != 0 and pid in (0, os.getpid(), -os.getpgrp()):
            raise SystemExit(f"os.kill({pid}, {sig}) on the grading process was ignored by the grader")
        return _real_kill(pid, sig)

    def guarded_killpg(pgid, sig):
        if sig != 0 and pgid in (0, os.getpgrp()):
            raise SystemExit(f"os.killpg({pgid}, {sig}) on the grading process was ignored by the grader")
        return _real_killpg(pgid, sig)

    os._exit = refuse_exit
    os.abort = refuse_abort
    os.kill = guarded_kill
    os.killpg = guarded_killpg


def _on_alarm(signum, frame):
    raise CellTimeout("the cell ran past the per-cell time limit")


def _with_time_limit(seconds: float, fn, *args):
    """``fn(*args)`` interrupted by ``CellTimeout`` after ``seconds`` (0: no limit)."""
    signal.signal(signal.SIGALRM, _on_alarm)  # re-installed every time: a cell may have replaced it
    if seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _make_shell():
    """An IPython shell without history or colours (nothing written to the home folder)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "NoColor"
    return InteractiveShell.instance(config=config)


def _run_cells(shell, cells: list[str], cell_timeout_s: float, status: _Status) -> None:
    errors = status.data["cell_errors"]
    for index, source in enumerate(cells):
        if not source.strip():
            continue
        error: BaseException | None = None
        try:
            result = _with_time_limit(cell_timeout_s, shell.run_cell, source)
            error = result.error_before_exec or result.error_in_exec
        except BaseException as exc:  # an alarm or exit that escaped IPython's own handler
            error = exc
        if isinstance(error, MemoryError):
            import gc

            gc.collect()
        if error is not None:
            message = _describe(error)
            if isinstance(error, CellTimeout):
                message = f"CellTimeout: the cell ran longer than {cell_timeout_s:g} s and was stopped"
            errors.append({"cell": index + 1, "error": message})  # counted from 1, markdown cells included
            status.update(cell_errors=errors)


class _Guarded:
    """Calls the learner's function; stops after a first timeout; turns exits into ordinary errors."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.call_timeout = _CallTimeout
        self.timed_out = False

    def __call__(self, *args, **kwargs):
        if self.timed_out:  # an endless loop would cost a full time limit per case
            raise self.call_timeout("not run, because an earlier case took too long")
        try:
            return self.fn(*args, **kwargs)
        except self.call_timeout:
            self.timed_out = True
            raise
        except Exception:
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CellTimeout...
            # Re-raised as an Exception of the same name, so run_cases records it as feedback.
            raise type(type(exc).__name__, (RuntimeError,), {})(str(exc)) from None


def _plain_tensors(value):
    """Every tensor as a plain, detached, CPU ``torch.Tensor`` (no subclasses), recursively."""
    if isinstance(value, torch.Tensor):
        # A subclass could lie in comparisons (and would not load with weights_only=True).
        plain = torch.Tensor.as_subclass(value.detach().cpu(), torch.Tensor).clone()
        if type(plain) is not torch.Tensor:
            raise TypeError(f"a tensor subclass ({type(value).__name__}) that will not become a plain tensor")
        return plain
    if isinstance(value, list):
        return [_plain_tensors(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain_tensors(v) for k, v in value.items()}
    return value


def _to_plain(outcome, timeout_s: float) -> dict:
    """``outcome.to_plain()`` with plain tensors, or an error outcome when the value cannot be saved."""
    try:
        # Converting odd return values may run learner code (__array__, __len__): keep it bounded.
        return _with_time_limit(timeout_s, lambda: _plain_tensors(outcome.to_plain()))
    except BaseException as exc:
        return Outcome(error=f"its return value could not be recorded ({_describe(exc)})").to_plain()


def _grade_task(shell, task, cases, out: _Results, call_timeout_s: float) -> None:
    fn = shell.user_ns.get(task.function_name)
    record: dict = {
        "format": FORMAT,
        "task": task.id,
        "defined": task.function_name in shell.user_ns,
        "callable": callable(fn),
        "type_name": type(fn).__name__,
        "outcomes": [],
    }
    if callable(fn):
        timeout = min(task.timeout_s, call_timeout_s) if call_timeout_s > 0 else task.timeout_s
        outcomes = run_cases(_Guarded(fn), cases, timeout_s=timeout, measure=task.measure, forbidden=task.forbidden)
        record["outcomes"] = [_to_plain(outcome, call_timeout_s) for outcome in outcomes]
    out.save(result_name(task.id), record)


def result_name(task_id: str) -> str:
    """The file a task's outcomes are saved to, in the output folder."""
    return f"{task_id}.pt"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m attn_course.grading.runner")
    parser.add_argument("--cells", required=True, help="JSON file: the notebook's code cell sources, in order")
    parser.add_argument("--out", required=True, help="folder for runner.json and one <task id>.pt per task")
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--cell-timeout", type=float, default=60.0, help="seconds per cell and per function call")
    parser.add_argument("--memory-mb", type=int, default=0, help="address-space limit of this process (0: none)")
    parser.add_argument("--max-file-mb", type=int, default=0, help="largest file it may write (0: no limit)")
    parser.add_argument("--max-processes", type=int, default=0,
                        help="processes and threads its user may have (0: no limit; only in a sandbox, where they are its own)")
    parser.add_argument("--user", type=int, default=None,
                        help="started as root (in the sandbox): become this uid before running any cell")
    return parser.parse_args(argv)


def _usage() -> dict:
    """Peak resident memory (MB) of this process or a child, and CPU seconds of both: for sizing a machine."""
    import resource  # POSIX only

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    scale = 2**20 if sys.platform == "darwin" else 2**10  # bytes on macOS, kB on Linux
    return {"peak_memory_mb": max(own.ru_maxrss, children.ru_maxrss) / scale * 1.0,
            "cpu_seconds": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime}


def _silence() -> None:
    """stdout and stderr to /dev/null: nothing a notebook prints reaches the grader."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _set_limits(memory_mb: int, max_file_mb: int, max_processes: int) -> None:
    import resource  # POSIX only

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, amount in ((resource.RLIMIT_AS, memory_mb * 2**20), (resource.RLIMIT_FSIZE, max_file_mb * 2**20),
                          (resource.RLIMIT_NPROC, max_processes)):
        if amount > 0:
            resource.setrlimit(limit, (amount, amount))


def _become(uid: int) -> None:
    """Drop root for good: no groups, uid and gid ``uid`` (real, effective, saved), no capabilities."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    capabilities = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:")]
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid) or os.getgroups():
        raise RuntimeError(f"could not become uid {uid}")
    if not capabilities or int(capabilities[0].split()[1], 16) != 0:
        raise RuntimeError(f"uid {uid} kept capabilities: {capabilities}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    out = Path(args.out)
    results = _Results(out, [STATUS, *(result_name(task_id) for task_id in args.tasks)])
    status = _Status(results)
    status.update(stage="cases")
    _silence()
    try:
        tasks = [TASKS[task_id] for task_id in args.tasks]
        cases = {task.id: task.make_cases() for task in tasks}  # before any submission code
        cells = json.loads(Path(args.cells).read_text())
        _set_limits(args.memory_mb, args.max_file_mb, args.max_processes)
        if args.user is not None and os.geteuid() == 0:
            _become(args.user)
        shell = _make_shell()
        _install_exit_guards()
        status.update(stage="cells")
        _run_cells(shell, cells, args.cell_timeout, status)
        task_errors = status.data.setdefault("task_errors", {})
        for task in tasks:
            status.update(stage=f"task {task.id}")
            try:
                _grade_task(shell, task, cases[task.id], results, args.cell_timeout)
            except BaseException as exc:  # keep going: the other tasks still deserve a grade
                task_errors[task.id] = _describe(exc)
                status.update(task_errors=task_errors)
        status.update(stage="done", usage=_usage())
        return EXIT_OK
    except MemoryError as exc:
        status.update(fatal=_describe(exc))
        return EXIT_MEMORY
    except BaseException as exc:
        status.update(fatal="".join(traceback.format_exception(exc))[-2000:])
        return EXIT_ERROR


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Leave at once: threads the submission started must not keep the process alive.
    _real_exit(code)
