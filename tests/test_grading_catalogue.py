"""Every task: the reference scores full marks, a stub scores zero, every catalogued bug is caught.

Also what every task's judge must survive, whatever the lesson: the batch grader's round trip,
odd return values, an error in one case, and building its cases twice.

The catalogue (``Task.wrong``, ``{description: Wrong(fn, hint, kind=..., one_case=...)}``):

* every entry is rejected, and its feedback contains ``hint``;
* its ``kind`` is checked, not just stated: ``"values"`` returns wrong values (or raises) on some
  case; ``"contract"`` returns the reference's values on every case and is still rejected
  (in-place edits, the wrong dtype); ``"algorithm"`` returns the right values and scores full
  marks once its probe measurements are replaced by the reference's: only what it *did* (the
  quadratic form, a forbidden delegation) costs it marks;
* its feedback names its own bug and no other: it contains no other entry's ``hint`` (unless that
  hint is part of its own), so a hint's condition must test the behaviour the hint describes; two
  entries that behave the same on every case are duplicates, to merge or to tell apart with a case;
* it is rejected by at least two cases, so that one unlucky case cannot hide it. "Rejected by
  case i" means: the reference's outcomes with case i's outcome replaced by the entry's lose a
  mark. An entry that only one case can catch says why in ``one_case`` (e.g. only one case has
  an all ``-inf`` row); the test then checks that exactly one case catches it, so the list of
  one-case entries stays honest. ``pytest tests/test_grading_catalogue.py -k one_case -s``
  prints that list.

``Task.accepted`` holds other correct algorithms (the recurrent form of causal linear attention,
...): each must score full marks, which proves the probes do not reject honest work.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch

from attn_course.grading import KINDS, TASKS, Outcome, Task, Wrong, grade_function, run_cases
from attn_course.grading.probes import MEASURES, resolve_forbidden

WRONG = [(task_id, name) for task_id, task in TASKS.items() for name in task.wrong]
ACCEPTED = [(task_id, name) for task_id, task in TASKS.items() for name in task.accepted]
ALL = sorted(TASKS)


def _catalogue(task_id) -> list[tuple[str, list[Outcome]]]:
    """``(name, outcomes)`` for the reference and every wrong entry (each function run once per test session)."""
    names = list(TASKS[task_id].wrong)
    return [("reference", _reference_outcomes(task_id))] + [(name, _wrong_outcomes(task_id, name)) for name in names]


def _crashes(result) -> list[str]:
    return [c.message for c in result.checks if c.message.startswith("could not check your result")]


def _run(task: Task, fn) -> list[Outcome]:
    """``fn``'s outcomes on the task's cases, with the task's probes, as ``grade_function`` gets them."""
    with torch.random.fork_rng(devices=[]):
        cases = task.make_cases()
        return run_cases(fn, cases, timeout_s=task.timeout_s, measure=task.measure, forbidden=task.forbidden)


@lru_cache(maxsize=None)
def _reference_outcomes(task_id: str) -> list[Outcome]:
    return _run(TASKS[task_id], TASKS[task_id].reference)


@lru_cache(maxsize=None)
def _wrong_outcomes(task_id: str, name: str) -> list[Outcome]:
    return _run(TASKS[task_id], TASKS[task_id].wrong[name].fn)


@lru_cache(maxsize=None)
def _cases(task_id: str) -> list:
    return TASKS[task_id].make_cases()


def _full_marks(task: Task, outcomes: list[Outcome]) -> bool:
    return all(check.passed for check in task.judge(_cases(task.id), outcomes))


def _same_values(a, b) -> bool:
    """Equal returned values: tensors equal as float64 (bool masks as bool; dtype may differ), recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if a.dtype == torch.bool or b.dtype == torch.bool:
            return torch.equal(a.bool(), b.bool())
        return bool(torch.allclose(a.detach().double(), b.detach().double(), atol=1e-6, rtol=1e-5, equal_nan=True))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 + 1e-5 * abs(b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _same_result(wrong: Outcome, reference: Outcome) -> bool:
    """The same values, or, where the reference raises (a task whose contract is to raise), the same exception type."""
    if wrong.error is None and reference.error is None:
        return _same_values(wrong.returned, reference.returned)
    if wrong.error is None or reference.error is None or wrong.not_implemented or reference.not_implemented:
        return False
    return wrong.error.split(":")[0] == reference.error.split(":")[0]


def _cases_that_catch(task_id: str, name: str) -> list[str]:
    """The names of the cases that, alone, make the reference lose a mark when they hold this entry's outcome."""
    task = TASKS[task_id]
    cases = _cases(task_id)
    reference, wrong = _reference_outcomes(task_id), _wrong_outcomes(task_id, name)
    caught = []
    for index, case in enumerate(cases):
        if _identical(wrong[index], reference[index]):
            continue  # the hybrid would be the reference's own outcomes, which score full marks
        hybrid = list(reference)
        hybrid[index] = wrong[index]
        if not _full_marks(task, hybrid):
            caught.append(case.name)
    return caught


def _identical(a: Outcome, b: Outcome) -> bool:
    """Everything the judge can see is the same: values and dtypes, error, inputs afterwards, probes."""

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and (
                x.shape == y.shape and bool(torch.equal(x, y))
            )
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(same(u, w) for u, w in zip(x, y))
        return type(x) is type(y) and isinstance(x, (str, int, float, bool, type(None))) and x == y

    return (
        a.error == b.error and a.not_implemented == b.not_implemented and a.probe == b.probe
        and same(a.returned, b.returned) and same(a.args_after, b.args_after)
    )


# --- the task definitions ------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", ALL)
def test_task_settings_are_valid(task_id):
    task = TASKS[task_id]
    assert task.id == task_id and task.id.split(".")[0].isdigit()
    assert set(task.measure) <= set(MEASURES)
    resolve_forbidden(task.forbidden)  # raises ValueError naming a forbidden name that does not exist
    assert isinstance(task.stretch, bool)
    for name, entry in task.wrong.items():
        assert isinstance(entry, Wrong) and entry.kind in KINDS, name
        assert entry.kind != "algorithm" or task.measure or task.forbidden, f"{name}: an algorithm entry needs probes"


def test_old_tuple_entries_are_still_read_as_values():
    task = TASKS["03.causal_mask"]
    old = dataclasses.replace(task, wrong={"shifted": (lambda L, S: None, "hint")})
    assert old.wrong["shifted"].kind == "values" and old.wrong["shifted"].hint == "hint"
    fn, hint = old.wrong["shifted"]  # unpacks like the old tuple
    assert hint == "hint"
    assert old.judge.raw is task.judge.raw, "replace() must not wrap the judge twice"


# --- reference, stub, catalogue -----------------------------------------------------------------


@pytest.mark.parametrize("task_id", ALL)
def test_reference_scores_full_marks(task_id):
    result = grade_function(TASKS[task_id], TASKS[task_id].reference)
    assert result.max_score > 0
    assert result.score == result.max_score, result.report()


@pytest.mark.parametrize("task_id,name", ACCEPTED, ids=[f"{t}:{n}" for t, n in ACCEPTED])
def test_other_correct_algorithms_score_full_marks(task_id, name):
    result = grade_function(TASKS[task_id], TASKS[task_id].accepted[name])
    assert result.score == result.max_score, result.report()


@pytest.mark.parametrize("task_id", ALL)
def test_untouched_stub_scores_zero(task_id):
    def stub(*args, **kwargs):
        raise NotImplementedError("Your code here")

    result = grade_function(TASKS[task_id], stub)
    assert result.score == 0, result.report()
    assert "not implemented yet" in result.feedback


@pytest.mark.parametrize("task_id", ALL)
def test_catalogue_has_at_least_four_wrong_implementations(task_id):
    assert len(TASKS[task_id].wrong) >= 4


@pytest.mark.parametrize("task_id,name", WRONG, ids=[f"{t}:{n}" for t, n in WRONG])
def test_wrong_implementation_is_rejected_with_useful_feedback(task_id, name):
    task = TASKS[task_id]
    entry = task.wrong[name]
    result = grade_function(task, entry.fn)
    assert result.score < result.max_score, f"{name!r} was accepted:\n{result.report()}"
    assert entry.hint in result.feedback, f"feedback for {name!r} lacks {entry.hint!r}:\n{result.report()}"


# Pairs (task, entry, other entry) whose feedback may contain the other's hint, each with why no
# case can tell the two bugs apart. Keep it short: prefer a case, or a condition, that does.
SHARED_HINTS: dict[tuple[str, str, str], str] = {
    # The article's code has both bugs: its view needs L to be a multiple of the block, and it takes no mask.
    # On the long masked case (L a multiple) it returns exactly what ignoring the mask gives, and says so.
    ("05.block_local_attention", "the article's view (L must be a multiple)", "key-padding mask ignored"):
        "the article's code also ignores the mask",
    # Lesson 12's first attempt, the contiguous split, also never checks the length: both are its bugs, and
    # test_grading_lesson12 asks for both messages.
    ("12.zigzag_positions", "contiguous split", "no error when 2W does not divide L"):
        "the contiguous split also returns instead of raising",
}


def _feedback(task: Task, outcomes: list[Outcome]) -> str:
    """The feedback these outcomes get, as ``grade_function`` would give it."""
    checks = task.judge(_cases(task.id), outcomes)
    return "\n".join(f"{c.name}: {c.message}" for c in checks if not c.passed)


@pytest.mark.parametrize("task_id", ALL)
def test_no_two_catalogue_entries_behave_the_same(task_id):
    """Two entries with different hints that the judge cannot tell apart (the same feedback) are one bug told two
    ways: merge them, or add a case that separates them. (Entries with one hint, e.g. two routes into a forbidden
    call, share their feedback on purpose.)"""
    task = TASKS[task_id]
    feedback = {name: _feedback(task, _wrong_outcomes(task_id, name)) for name in task.wrong}
    names = list(feedback)
    same = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if feedback[a] == feedback[b] and task.wrong[a].hint != task.wrong[b].hint]
    assert not same, f"{task_id}: entries that get the same feedback on every case: {same}"


@pytest.mark.parametrize("task_id", ALL)
def test_feedback_names_only_its_own_bug(task_id):
    """Issue 20: a hint fires only when the submission's behaviour fits it, so no entry's feedback names another's bug."""
    task = TASKS[task_id]
    wrong = [(name, outcomes) for name, outcomes in _catalogue(task_id) if name != "reference"]
    found = []
    for name, outcomes in wrong:
        feedback = _feedback(task, outcomes)
        assert task.wrong[name].hint in feedback, f"feedback for {name!r} lacks its hint:\n{feedback}"
        for other, entry in task.wrong.items():
            if other == name or entry.hint in task.wrong[name].hint or (task_id, name, other) in SHARED_HINTS:
                continue
            if entry.hint in feedback:
                found.append(f"{name!r} gets {other!r}'s hint {entry.hint!r}")
    assert not found, f"{task_id}: feedback that names another entry's bug:\n" + "\n".join(found)


def test_shared_hints_are_real_pairs():
    """Every exception names two entries of one task whose hints really do show up in each other's feedback."""
    for (task_id, name, other), why in SHARED_HINTS.items():
        task = TASKS[task_id]
        assert name in task.wrong and other in task.wrong and why.strip(), (task_id, name, other)
        assert task.wrong[other].hint in _feedback(task, _wrong_outcomes(task_id, name)), (
            f"{task_id}: {name!r} no longer gets {other!r}'s hint: remove the exception"
        )


@pytest.mark.parametrize("task_id,name", WRONG, ids=[f"{t}:{n}" for t, n in WRONG])
def test_wrong_implementation_is_of_its_kind(task_id, name):
    task, entry = TASKS[task_id], TASKS[task_id].wrong[name]
    reference, wrong = _reference_outcomes(task_id), _wrong_outcomes(task_id, name)
    right_values = all(_same_result(w, r) for w, r in zip(wrong, reference))
    with_reference_probes = [dataclasses.replace(w, probe=r.probe) for w, r in zip(wrong, reference)]
    if entry.kind == "values":
        assert not right_values, f"{name!r} returns the reference's values on every case: label it contract or algorithm"
    elif entry.kind == "contract":
        assert right_values, f"{name!r} returns wrong values on some case: label it 'values'"
        assert not _full_marks(task, with_reference_probes), f"{name!r} is rejected only by its probes: label it algorithm"
    else:
        assert right_values, f"{name!r} returns wrong values on some case: label it 'values'"
        assert _full_marks(task, with_reference_probes), (
            f"{name!r} loses marks even with the reference's probe measurements: label it 'contract' or 'values'"
        )


@pytest.mark.parametrize("task_id,name", WRONG, ids=[f"{t}:{n}" for t, n in WRONG])
def test_wrong_implementation_is_rejected_by_two_cases_or_says_why_not(task_id, name):
    entry = TASKS[task_id].wrong[name]
    caught = _cases_that_catch(task_id, name)
    if entry.one_case:
        assert len(caught) == 1, (
            f"{name!r} says only one case can catch it ({entry.one_case!r}), but {len(caught)} do: {caught}. "
            "Remove one_case (or fix the reason)."
        )
    else:
        assert len(caught) >= 2, (
            f"{task_id}: {name!r} is caught by {len(caught)} case(s) only: {caught}. Add a case that exposes it "
            "(another shape, dtype, mask...), or, when no other case can, say why in Wrong(..., one_case='...')."
        )


def test_one_case_list():
    """Prints the documented list of entries caught by one case only (run with -s to read it)."""
    rows = [(t, n, TASKS[t].wrong[n].one_case) for t, n in WRONG if TASKS[t].wrong[n].one_case]
    for task_id, name, why in rows:
        print(f"{task_id}: {name}: {why}")
    assert all(why.strip() for _, _, why in rows)


# --- what every judge must survive --------------------------------------------------------------


@pytest.mark.parametrize("task_id", ALL)
def test_verdicts_survive_the_batch_graders_round_trip(task_id):
    """The batch grader judges plain copies of the outcomes, saved and loaded with weights_only=True."""
    import io

    task = TASKS[task_id]
    for name, outcomes in _catalogue(task_id):
        direct = task.judge(task.make_cases(), outcomes)
        buffer = io.BytesIO()
        torch.save([o.to_plain() for o in outcomes], buffer)
        buffer.seek(0)
        plain = [Outcome.from_plain(o) for o in torch.load(buffer, weights_only=True)]
        assert [o.probe for o in plain] == [o.probe for o in outcomes], name
        again = task.judge(task.make_cases(), plain)
        assert [(c.name, c.passed, c.message) for c in direct] == [(c.name, c.passed, c.message) for c in again], name


@pytest.mark.parametrize("task_id", ALL)
def test_judges_never_crash_on_the_catalogue(task_id):
    for name, outcomes in _catalogue(task_id):
        checks = TASKS[task_id].judge(_cases(task_id), outcomes)
        assert not [c.message for c in checks if c.message.startswith("could not check your result")], name


@pytest.mark.parametrize("task_id", ALL)
def test_judges_survive_odd_return_values(task_id):
    for odd in (None, "text", 3, [1, 2], torch.zeros(0), (torch.zeros(2), torch.zeros(2)), float("nan")):
        result = grade_function(TASKS[task_id], lambda *args, odd=odd, **kwargs: odd)
        assert not _crashes(result), f"{odd!r}: {_crashes(result)}"
        assert result.score < result.max_score, f"{odd!r} was accepted"


@pytest.mark.parametrize("task_id", ALL)
def test_judges_survive_missing_or_garbled_probe_data(task_id):
    """Probe data from the batch grader's child may be missing or odd: a verdict, never a crash."""
    task = TASKS[task_id]
    reference = _reference_outcomes(task_id)
    for garbage in ({}, {"largest_numel": "many", "flops": [1], "forbidden_calls": "aten.mm"}, {"largest_numel": True}):
        outcomes = [Outcome.from_plain({**o.to_plain(), "probe": garbage}) for o in reference]
        checks = task.judge(task.make_cases(), outcomes)
        assert not [c.message for c in checks if c.message.startswith("could not check your result")], garbage


@pytest.mark.parametrize("task_id", ALL)
def test_an_error_in_one_case_costs_only_that_cases_checks(task_id):
    """A function that raises on one input (say, only in float16) keeps the checks it earns elsewhere."""
    task = TASKS[task_id]
    cases = task.make_cases()
    calls = []

    def raises_on_last_case(*args, **kwargs):  # the grader calls once per case, in order
        calls.append(1)
        if len(calls) == len(cases):
            raise RuntimeError("boom")
        return task.reference(*args, **kwargs)

    result = grade_function(task, raises_on_last_case)
    assert 0 < result.score < result.max_score, result.report()
    assert "boom" in result.feedback and cases[-1].name in result.feedback


def _flat(args):
    for x in args:
        if isinstance(x, (tuple, list)):
            yield from _flat(x)
        elif isinstance(x, dict):
            yield from _flat(list(x.items()))
        else:
            yield x


@pytest.mark.parametrize("task_id", ALL)
def test_cases_are_deterministic_and_leave_the_global_rng_alone(task_id):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = TASKS[task_id].make_cases()
    assert torch.equal(torch.rand(3), expected_next), "building the cases changed the caller's random state"
    second = TASKS[task_id].make_cases()
    assert [c.name for c in first] == [c.name for c in second]
    for a, b in zip(first, second):
        for x, y in zip(_flat(a.args), _flat(b.args)):
            assert type(x) is type(y)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y) and x.dtype == y.dtype and x.requires_grad == y.requires_grad
            elif isinstance(x, torch.nn.Module):
                assert all(torch.equal(p, q) for p, q in zip(x.state_dict().values(), y.state_dict().values()))
            elif not callable(x):
                assert x == y


@pytest.mark.parametrize("task_id", ALL)
def test_grading_leaves_the_learners_random_state_alone(task_id):
    """`check(...)` in the middle of a notebook must not change what the next random draw gives."""
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    grade_function(TASKS[task_id], TASKS[task_id].reference)
    assert torch.equal(torch.rand(3), expected_next), "grading changed the caller's random state"
