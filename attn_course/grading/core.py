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

A task about an algorithm's form or cost also says what to watch while the learner's function
runs (``Task.measure``: the largest intermediate tensor, FLOPs; ``Task.forbidden``: calls into
the implementation the task asks for). ``run_cases`` records that in ``Outcome.probe`` (see
:mod:`attn_course.grading.probes`), the judge turns it into verdicts, and ``Task.judge`` applies
the no-delegation rule on top of the lesson's judge: a forbidden call gives the task zero.
"""

from __future__ import annotations

import copy
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .probes import MEASURES, Probe, delegation_message

__all__ = [
    "Case",
    "Outcome",
    "CheckResult",
    "TaskResult",
    "Task",
    "Wrong",
    "KINDS",
    "Fail",
    "run_cases",
    "module_hooks",
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
    probe: dict = field(default_factory=dict)  # what the probes saw during the call (see probes.py)

    def to_plain(self) -> dict:
        """A dict of tensors, lists and strings, safe to save and load with ``weights_only=True``."""
        return {
            "returned": _plain(self.returned),
            "error": self.error,
            "args_after": [_plain_argument(a) for a in self.args_after],
            "not_implemented": self.not_implemented,
            "probe": _plain_probe(self.probe),
        }

    @classmethod
    def from_plain(cls, data: dict) -> Outcome:
        """Rebuild an outcome saved by ``to_plain`` (tuples come back as lists).

        Defensive, because the data comes from a process that ran submission code: a field of
        the wrong type becomes its safe default (an error text for ``error``), never something a
        judge would trip over. Only a ``data`` that is not a dict at all is an error.
        """
        if not isinstance(data, dict):
            raise TypeError(f"a saved outcome must be a dict, got {type(data).__name__}")
        error = data.get("error")
        if error is not None and not isinstance(error, str):
            error = f"<an error that could not be read back (a {type(error).__name__})>"
        args_after = data.get("args_after")
        not_implemented = data.get("not_implemented")
        return cls(
            returned=data.get("returned"),
            error=error,
            args_after=tuple(args_after) if isinstance(args_after, (list, tuple)) else (),
            not_implemented=not_implemented if isinstance(not_implemented, bool) else False,
            probe=_plain_probe(data.get("probe")),
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


def module_hooks(module: torch.nn.Module) -> dict[str, list[int]]:
    """The hooks registered on ``module`` and its submodules: ``{qualified name: [forward_pre, forward,
    backward_pre, backward]}`` counts, for the modules that have any (a judge checks a learner removed them)."""
    counts = {}
    for name, sub in module.named_modules():
        row = [len(sub._forward_pre_hooks), len(sub._forward_hooks), len(sub._backward_pre_hooks),
               len(sub._backward_hooks)]
        if any(row):
            counts[name] = row
    return counts


def _plain_argument(value: Any) -> Any:
    """An argument after the call, as ``_plain`` saves it; a module (which cannot be saved) becomes the
    record of the hooks left on it, ``{"module": class name, "hooks": module_hooks(...)}``."""
    if isinstance(value, torch.nn.Module):
        return {"module": type(value).__name__, "hooks": module_hooks(value)}
    return _plain(value)


_PROBE_SCALARS = (bool, int, float, str)


def _plain_probe(value: Any) -> dict:
    """Only ``str`` keys with bool/int/float/str values or lists of str survive; anything else is dropped."""
    if not isinstance(value, dict):
        return {}
    kept: dict = {}
    for key, item in value.items():
        if not isinstance(key, str):
            continue
        if isinstance(item, _PROBE_SCALARS):
            kept[key] = item[:2000] if isinstance(item, str) else item
        elif isinstance(item, (list, tuple)) and all(isinstance(x, str) for x in item):
            kept[key] = [x[:500] for x in item[:100]]
    return kept


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
    stretch: bool = False  # a stretch task: counted separately in grade sheets

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
        kind = " (stretch task)" if self.stretch else ""
        lines = [f"{self.task_id} - {self.title}{kind}: {self.score:g}/{self.max_score:g} points"]
        for c in self.checks:
            mark = "PASS" if c.passed else "FAIL"
            lines.append(f"  [{mark}] {c.name}" + (f": {c.message}" if c.message and not c.passed else ""))
        if self.score == self.max_score:
            lines.append("  All checks passed. Well done!")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TaskResult({self.task_id!r}, score={self.score:g}/{self.max_score:g})"


Judge = Callable[[Sequence[Case], Sequence[Outcome]], list[CheckResult]]

KINDS = ("values", "algorithm", "contract")


@dataclass(frozen=True)
class Wrong:
    """One entry of a task's catalogue of wrong implementations, which the task must reject.

    Attributes:
        fn: the wrong implementation.
        hint: a substring the feedback must contain (the teaching message the bug deserves).
        kind: why it is wrong, checked by ``tests/test_grading_catalogue.py``:
            ``"values"``: it returns wrong values (or raises) on some case;
            ``"algorithm"``: right values, wrong way to get them: the probes reject it (the
            quadratic form, a forbidden delegation); with its probes erased it scores full marks;
            ``"contract"``: right values, but it breaks the function's contract otherwise
            (changes its input in place, returns the wrong dtype).
        one_case: empty when at least two cases reject it (the rule); otherwise why only one
            case can (e.g. "only one case has an all -inf row").
    """

    fn: Callable
    hint: str
    kind: str = "values"
    one_case: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Wrong(kind={self.kind!r}): expected one of {KINDS}")
        if not callable(self.fn) or not isinstance(self.hint, str) or not self.hint:
            raise TypeError("Wrong(fn, hint): fn must be callable and hint a non-empty str")

    def __iter__(self):  # `fn, hint = task.wrong[name]` still works, as with the old tuples
        return iter((self.fn, self.hint))


class _RuledJudge:
    """The lesson's judge followed by the task-wide probe rules (a forbidden call gives zero)."""

    def __init__(self, judge: Judge, forbidden: tuple[str, ...]) -> None:
        self.raw = judge
        self.forbidden = forbidden

    def __call__(self, cases: Sequence[Case], outcomes: Sequence[Outcome]) -> list[CheckResult]:
        checks = self.raw(cases, outcomes)
        if not self.forbidden:
            return checks
        calls: list[str] = []
        for outcome in outcomes:
            found = outcome.probe.get("forbidden_calls") if isinstance(outcome.probe, dict) else None
            for name in found if isinstance(found, list) else ():
                if isinstance(name, str) and name not in calls:
                    calls.append(name)
        if not calls:
            return checks
        message = delegation_message(calls)
        see_above = "not graded: your function calls the implementation this task asks for (see above)"
        return [CheckResult(c.name, False, message if i == 0 else see_above, c.points) for i, c in enumerate(checks)]


@dataclass(frozen=True)
class Task:
    """A graded exercise.

    Attributes:
        id: ``"<lesson>.<name>"``, e.g. ``"03.causal_mask"``.
        title: shown in reports.
        function_name: the name the exercise notebook asks the learner to define.
        make_cases: builds the inputs (must be deterministic).
        judge: turns outcomes into verdicts. ``Task.judge`` is the lesson's judge followed by
            the no-delegation rule when ``forbidden`` is set (every check fails, naming the call).
        reference: a correct implementation; scores full marks. It must not call what
            ``forbidden`` names.
        wrong: the catalogue of wrong implementations this task must reject, as
            ``{description: Wrong(fn, hint, kind=..., one_case=...)}``; the older
            ``{description: (fn, hint)}`` form is still read (as ``kind="values"``).
        timeout_s: limit for one call of the learner's function.
        stretch: a graded stretch task that goes past its lesson; counted separately.
        measure: what the probes measure while the learner's function runs, from
            ``probes.MEASURES``: ``"largest"`` (largest intermediate tensor), ``"flops"``.
        forbidden: implementations the learner must not call (dotted names, or aten patterns;
            see ``probes.resolve_forbidden``): the task's own concept, never general building
            blocks. A call gives the whole task zero.
        accepted: other correct implementations (another algorithm the lesson teaches, e.g. the
            recurrent form) that must score full marks: proof that the probes leave honest work alone.
    """

    id: str
    title: str
    function_name: str
    make_cases: Callable[[], list[Case]]
    judge: Judge
    reference: Callable
    wrong: dict[str, Wrong]
    timeout_s: float = 20.0
    stretch: bool = False
    measure: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    accepted: dict[str, Callable] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.measure, str) or isinstance(self.forbidden, str):
            raise TypeError(f"task {self.id}: measure and forbidden are tuples of str, e.g. measure=(\"largest\",)")
        unknown = sorted(set(self.measure) - set(MEASURES))
        if unknown:
            raise ValueError(f"task {self.id}: unknown measure {unknown}; known: {list(MEASURES)}")
        wrong = {name: entry if isinstance(entry, Wrong) else Wrong(*entry) for name, entry in self.wrong.items()}
        object.__setattr__(self, "wrong", wrong)
        object.__setattr__(self, "measure", tuple(self.measure))
        object.__setattr__(self, "forbidden", tuple(self.forbidden))
        raw = self.judge.raw if isinstance(self.judge, _RuledJudge) else self.judge  # dataclasses.replace
        object.__setattr__(self, "judge", _RuledJudge(raw, self.forbidden))


class _CallTimeout(Exception):
    pass


def _call_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> Any:
    """Call ``fn``; on the main thread of a Unix process, interrupt it after ``timeout_s``."""
    use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not use_alarm:
        return fn(*args, **kwargs)

    running = [True]

    def on_alarm(signum, frame):
        if running[0]:
            raise _CallTimeout(f"took longer than {timeout_s:g} s (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # The alarm repeats: code that catches `Exception` (the learner's, or a library's) may swallow
    # one timeout, and a one-shot alarm would then leave an endless loop running for ever.
    signal.setitimer(signal.ITIMER_REAL, timeout_s, max(timeout_s, 0.05))
    try:
        return fn(*args, **kwargs)
    finally:
        running[0] = False  # from here on a late alarm is a no-op
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cases(
    fn: Callable,
    cases: Sequence[Case],
    *,
    timeout_s: float = 20.0,
    measure: Sequence[str] = (),
    forbidden: Sequence[str] = (),
) -> list[Outcome]:
    """Call ``fn`` on copies of each case's inputs and record what happened.

    ``measure`` and ``forbidden`` (a task's settings) switch on the probes for the duration of
    each call only (copying the inputs is not measured); what they saw goes in ``Outcome.probe``.
    """
    outcomes = []
    for case in cases:
        args = copy.deepcopy(case.args)
        kwargs = copy.deepcopy(case.kwargs)
        probe = Probe(measure=measure, forbidden=forbidden)
        try:
            with probe:
                returned = _call_with_timeout(fn, args, kwargs, timeout_s)
            outcomes.append(Outcome(returned=returned, args_after=args, probe=probe.result()))
        except NotImplementedError:
            outcomes.append(
                Outcome(error="NotImplementedError", args_after=args, not_implemented=True, probe=probe.result())
            )
        except _CallTimeout as exc:
            outcomes.append(Outcome(error=f"timeout: {exc}", args_after=args, probe=probe.result()))
        except Exception as exc:  # the learner's bug is feedback, not a crash
            outcomes.append(Outcome(error=f"{type(exc).__name__}: {exc}", args_after=args, probe=probe.result()))
    return outcomes


def grade_function(task: Task, fn: Callable) -> TaskResult:
    """Grade ``fn`` for ``task`` in this process."""
    if not callable(fn):
        checks = [CheckResult("definition", False, f"expected a function, got {type(fn).__name__}")]
        return TaskResult(task.id, task.title, checks, stretch=task.stretch)
    # Grading draws random numbers (module inits, dropout in the learner's code): a `check(...)` in
    # the middle of a notebook must leave the learner's random state as it found it.
    with torch.random.fork_rng(devices=[]):
        cases = task.make_cases()
        outcomes = run_cases(fn, cases, timeout_s=task.timeout_s, measure=task.measure, forbidden=task.forbidden)
        return TaskResult(task.id, task.title, task.judge(cases, outcomes), stretch=task.stretch)
