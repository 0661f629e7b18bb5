"""The grading engine: a task is a set of *cases* (inputs) and a *judge* (verdicts).

Grading is split in two so that a submission can never grade itself:

1. ``task.make_cases()`` builds the inputs, deterministically (seeded).
2. The learner's function is called on each case (``run_cases``); what it returns, what it
   raised, and what its arguments look like afterwards are recorded as ``Outcome`` objects.
3. ``task.judge(cases, outcomes)`` turns outcomes into ``CheckResult`` verdicts with
   teaching feedback, comparing against the library.

In a notebook, ``check()`` does all three in the learner's kernel. The batch grader runs
step 2 in a child process that executed the submission, and steps 1 and 3 in the parent,
which never runs submission code: monkeypatching, printing fake scores or rewriting the
checker inside the submission cannot change a grade.
"""

from __future__ import annotations

import copy
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Case",
    "Outcome",
    "CheckResult",
    "TaskResult",
    "Task",
    "Fail",
    "run_cases",
    "grade_function",
]


class Fail(Exception):
    """Raised inside a check to fail it with a teaching message."""


@dataclass
class Case:
    """One call of the learner's function: ``fn(*args, **kwargs)``."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """What happened when the learner's function was called on one case."""

    returned: Any = None
    error: str | None = None  # "TypeError: ..." when the call raised
    args_after: tuple = ()  # the positional arguments after the call, to catch in-place edits
    not_implemented: bool = False

    def to_plain(self) -> dict:
        """A dict of tensors, lists and strings, safe to save and load with ``weights_only=True``."""
        return {
            "returned": _plain(self.returned),
            "error": self.error,
            "args_after": _plain(list(self.args_after)),
            "not_implemented": self.not_implemented,
        }

    @classmethod
    def from_plain(cls, data: dict) -> Outcome:
        """Rebuild an outcome saved by ``to_plain`` (tuples come back as lists)."""
        return cls(
            returned=data.get("returned"),
            error=data.get("error"),
            args_after=tuple(data.get("args_after") or ()),
            not_implemented=bool(data.get("not_implemented")),
        )


def _plain(value: Any) -> Any:
    """Tensors, numbers, strings and None as they are; tuples/lists/dicts recursively; else a repr."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    try:  # numpy arrays and friends
        return torch.as_tensor(value)
    except Exception:
        return f"<unsupported return value of type {type(value).__name__}>"


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str = ""
    points: float = 1.0

    @property
    def earned(self) -> float:
        return self.points if self.passed else 0.0


@dataclass
class TaskResult:
    task_id: str
    title: str
    checks: list[CheckResult]

    @property
    def score(self) -> float:
        return sum(c.earned for c in self.checks)

    @property
    def max_score(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def feedback(self) -> str:
        """The failed checks' messages, one per line (empty when everything passed)."""
        return "\n".join(f"{c.name}: {c.message}" for c in self.checks if not c.passed)

    def report(self) -> str:
        lines = [f"{self.task_id} - {self.title}: {self.score:g}/{self.max_score:g} points"]
        for c in self.checks:
            mark = "PASS" if c.passed else "FAIL"
            lines.append(f"  [{mark}] {c.name}" + (f": {c.message}" if c.message and not c.passed else ""))
        if self.score == self.max_score:
            lines.append("  All checks passed. Well done!")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TaskResult({self.task_id!r}, score={self.score:g}/{self.max_score:g})"


Judge = Callable[[Sequence[Case], Sequence[Outcome]], list[CheckResult]]


@dataclass(frozen=True)
class Task:
    """A graded exercise.

    Attributes:
        id: ``"<lesson>.<name>"``, e.g. ``"03.causal_mask"``.
        title: shown in reports.
        function_name: the name the exercise notebook asks the learner to define.
        make_cases: builds the inputs (must be deterministic).
        judge: turns outcomes into verdicts.
        reference: a correct implementation (built on the library); scores full marks.
        wrong: the catalogue of wrong implementations this task must reject, as
            ``{description: (function, substring its feedback must contain)}``.
        timeout_s: limit for one call of the learner's function.
    """

    id: str
    title: str
    function_name: str
    make_cases: Callable[[], list[Case]]
    judge: Judge
    reference: Callable
    wrong: dict[str, tuple[Callable, str]]
    timeout_s: float = 20.0


class _CallTimeout(Exception):
    pass


def _call_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """Call ``fn``; on the main thread of a Unix process, interrupt it after ``timeout_s``."""
    use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not use_alarm:
        return fn(*args, **kwargs)

    def on_alarm(signum, frame):
        raise _CallTimeout(f"took longer than {timeout_s:g} s (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cases(fn: Callable, cases: Sequence[Case], *, timeout_s: float = 20.0) -> list[Outcome]:
    """Call ``fn`` on copies of each case's inputs and record what happened."""
    outcomes = []
    for case in cases:
        args = copy.deepcopy(case.args)
        kwargs = copy.deepcopy(case.kwargs)
        try:
            returned = _call_with_timeout(fn, args, kwargs, timeout_s)
            outcomes.append(Outcome(returned=returned, args_after=args))
        except NotImplementedError:
            outcomes.append(Outcome(error="NotImplementedError", args_after=args, not_implemented=True))
        except _CallTimeout as exc:
            outcomes.append(Outcome(error=f"timeout: {exc}", args_after=args))
        except Exception as exc:  # the learner's bug is feedback, not a crash
            outcomes.append(Outcome(error=f"{type(exc).__name__}: {exc}", args_after=args))
    return outcomes


def grade_function(task: Task, fn: Callable) -> TaskResult:
    """Grade ``fn`` for ``task`` in this process."""
    if not callable(fn):
        checks = [CheckResult("definition", False, f"expected a function, got {type(fn).__name__}")]
        return TaskResult(task.id, task.title, checks)
    # Grading draws random numbers (module inits, dropout in the learner's code): a `check(...)` in
    # the middle of a notebook must leave the learner's random state as it found it.
    with torch.random.fork_rng(devices=[]):
        cases = task.make_cases()
        outcomes = run_cases(fn, cases, timeout_s=task.timeout_s)
        return TaskResult(task.id, task.title, task.judge(cases, outcomes))
