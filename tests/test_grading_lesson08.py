"""The lesson 08 tasks: fair to other correct solutions, and their cases hold the bugs they claim.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected and
that the judges survive the batch grader's round trip, odd return values and errors. These
tests prove the other side: correct code written differently from the reference scores full
marks, and the NaN-hunting cases really hold their bugs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.startswith("08.")]


# --- other correct solutions ---------------------------------------------------------------


def _entropy_xlogy(weights):
    return -torch.special.xlogy(weights, weights).sum(dim=-1)


def _entropy_clamped_copy(weights):
    return -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(-1)


def _entropy_entr(weights):
    return torch.special.entr(weights).sum(-1)  # entr(0) = 0 by definition


def _entropy_nan_to_num_per_term(weights):
    return torch.nan_to_num(-(weights * torch.log(weights))).sum(-1)  # each 0 * log 0 = NaN term set to 0


def _entropy_wider_then_cast(weights):
    wide = weights.to(torch.promote_types(weights.dtype, torch.float32))  # half precision computed in float32
    return -torch.special.xlogy(wide, wide).sum(-1).to(weights.dtype)


def _qk_functional(q, k, v, scale):
    return F.scaled_dot_product_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=scale)


def _qk_manual(q, k, v, scale):
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scores = scale * torch.einsum("...ld,...sd->...ls", q, k)  # (..., L, S)
    return torch.einsum("...ls,...sd->...ld", scores.softmax(-1), v)  # (..., L, Dv)


def _nonfinite_raise_at_first(model, x):
    class Found(Exception):
        pass

    handles = []
    for name, module in model.named_modules():
        def hook(module, args, output, name=name):
            if not torch.isfinite(output).all():
                raise Found(name)

        handles.append(module.register_forward_hook(hook))
    try:
        model(x)
    except Found as found:
        return found.args[0]
    finally:
        for handle in handles:
            handle.remove()
    return None


def _nonfinite_list(model, x):
    bad = []

    def record(module, args, out, name):
        if not out.isfinite().all():
            bad.append(name)

    handles = [
        module.register_forward_hook(lambda m, a, out, name=name: record(m, a, out, name))
        for name, module in model.named_modules()
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return bad[0] if bad else None


def _nonfinite_one_hook_with_a_name_dict(model, x):
    names = {module: name for name, module in model.named_modules()}
    order = []

    def hook(module, args, output):  # one hook function for every module, named through the dict
        order.append((names[module], bool(torch.isfinite(output).all())))

    handles = [module.register_forward_hook(hook) for module in names]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return next((name for name, finite in order if not finite), None)


def _gradient_first_in_a_list(model, x):
    bad, handles = [], []
    for name, module in model.named_modules():
        def hook(module, grad_input, grad_output, name=name):
            if any(g is not None and not torch.isfinite(g).all() for g in grad_input):
                bad.append(name)

        handles.append(module.register_full_backward_hook(hook))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return bad[0] if bad else None


def _gradient_dict_of_first_reports(model, x):
    order = {}  # name -> the index at which its hook first reported a bad grad_input

    def make(name):
        def hook(module, grad_input, grad_output):  # returns None: a returned value would replace grad_input
            if any(isinstance(g, torch.Tensor) and (g.isnan() | g.isinf()).any() for g in grad_input):
                order.setdefault(name, len(order))

        return hook

    handles = [module.register_full_backward_hook(make(name)) for name, module in model.named_modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).sum().backward()
    for handle in handles:
        handle.remove()
    return min(order, key=order.get) if order else None


ALTERNATIVES = {
    "08.attention_entropy": [_entropy_xlogy, _entropy_clamped_copy, _entropy_entr, _entropy_nan_to_num_per_term,
                             _entropy_wider_then_cast],
    "08.qk_norm_attention": [_qk_functional, _qk_manual],
    "08.first_nonfinite_module": [_nonfinite_raise_at_first, _nonfinite_list, _nonfinite_one_hook_with_a_name_dict],
    "08.first_nonfinite_gradient": [_gradient_first_in_a_list, _gradient_dict_of_first_reports],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_08_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_first_nonfinite_cases_really_hold_their_bugs():
    """Each culprit is where the case says; the judge's hints rely on it."""
    from attn_course.grading.tasks.lesson08 import _first_nonfinite_reference

    from attn_course.diagnostics import find_nonfinite

    cases = TASKS["08.first_nonfinite_module"].make_cases()
    answers = [_first_nonfinite_reference(*case.args) for case in cases]
    assert answers == ["1", "blocks.1.mlp.0", "1", "early", None, "", "1", ""]
    for case in cases:  # every culprit is a module's OUTPUT, not plain code between modules
        with find_nonfinite(case.args[0]) as tracker:
            case.args[0](case.args[1])
        assert tracker.first is None or tracker.first.phase == "forward", case.name
        assert not case.args[0]._forward_hooks and all(not m._forward_hooks for m in case.args[0].modules())


def test_gradient_cases_are_finite_forward_and_hold_their_bugs():
    """Every forward pass is finite (a forward hook sees nothing); the culprits are where the cases say."""
    from attn_course.grading.tasks.lesson08 import _backward_reports, _first_nonfinite_gradient_reference

    cases = TASKS["08.first_nonfinite_gradient"].make_cases()
    for case in cases:
        model, x = case.args
        assert torch.isfinite(model(x)).all(), case.name
    answers = [_first_nonfinite_gradient_reference(copy.deepcopy(c.args[0]), c.args[1]) for c in cases]
    assert answers == ["1", "blocks.0.norm", "2", "2", "culprit", None, "culprit"]
    reports = [_backward_reports(copy.deepcopy(c.args[0]), c.args[1]) for c in cases]
    assert [bool(r["input"]) and not r["nan_input"] for r in reports] == [False, False, True, True, False, False, False], (
        "cases 2 and 3 pass back an inf and no NaN: the isnan-only mistake is caught by them"
    )
    assert reports[4]["input"] == ["culprit", "inner"]  # 'inner' is defined first but reports second
    # The last to report ('first') is not the first bad one in definition order ('second'): it tells those bugs apart.
    assert reports[6]["input"] == ["culprit", "second", "first"]


def test_gradient_task_leaves_the_case_models_untouched():
    """The judge works on its own copies: building the cases twice gives models with no .grad."""
    task = TASKS["08.first_nonfinite_gradient"]
    grade_function(task, task.reference)
    for case in task.make_cases():
        assert all(p.grad is None for p in case.args[0].parameters())


def test_the_articles_fudge_is_rejected_in_float64_and_in_float16():
    """log(w + 1e-9) per row: 1e-9 too low per key in float64 (above the tolerance), NaN in float16."""
    from attn_course.grading.tasks.lesson08 import _entropy_article_per_row

    result = grade_function(TASKS["08.attention_entropy"], _entropy_article_per_row)
    failed = {c.name: c.message for c in result.checks if not c.passed}
    assert len(failed) == 3, result.report()
    assert "You added about 1e-09 inside the log" in failed["rows without zero weights: -sum w log w, in nats, exactly (no fudge)"]
    assert "1e-9 is below its smallest number" in failed["float16 and bfloat16 with zero weights: no NaN, no fudge"]


def test_entropy_cases_hold_zero_weights_in_every_low_precision_case():
    cases = TASKS["08.attention_entropy"].make_cases()
    low = [case.args[0] for case in cases if case.args[0].dtype in (torch.float16, torch.bfloat16)]
    assert len(low) == 3 and all((w == 0).any() for w in low)
    assert any((w == 0).all(-1).any() for w in low), "a fully masked row in half precision"


def test_checking_grad_output_is_not_told_it_kept_the_last_module():
    """Issue 20: keeping the first report but testing grad_output was told "You kept the LAST module to report"."""
    from attn_course.grading import TASKS, grade_function

    task = TASKS["08.first_nonfinite_gradient"]
    feedback = grade_function(task, task.wrong["checks grad_output instead of grad_input"].fn).feedback
    assert "ARRIVING" in feedback and "LAST module" not in feedback
    last = grade_function(task, task.wrong["returns the last module to report"].fn).feedback
    assert "LAST module" in last and "ARRIVING" not in last


# --- issue 19: hints that are true, hooks that are removed, culprits that are not leaves --------


def _entropy_eps_on_every_weight(weights):
    wide = weights.to(torch.promote_types(weights.dtype, torch.float32))
    return -((wide + 1e-12) * torch.log(wide + 1e-12)).sum(-1).to(weights.dtype)


def _qk_plus_eps(eps):
    def qk(q, k, v, scale):
        q = q / (q.norm(dim=-1, keepdim=True) + eps)
        k = k / (k.norm(dim=-1, keepdim=True) + eps)
        return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v

    return qk


@pytest.mark.parametrize("task_id,fn,cause", [
    ("08.attention_entropy", _entropy_eps_on_every_weight, "You added 1e-12 to every weight before the log"),
    ("08.qk_norm_attention", _qk_plus_eps(1e-6), "You divided by the length plus 1e-06"),
    ("08.qk_norm_attention", _qk_plus_eps(1e-8), "You divided by the length plus 1e-08"),
])
def test_an_eps_is_not_called_float32_rounding(task_id, fn, cause):
    """All-float64 code off by an eps was told "An error this size is float32 rounding ... keep every step in float64"."""
    result = grade_function(TASKS[task_id], fn)
    assert result.score < result.max_score
    assert cause in result.feedback, result.report()
    assert "float32" not in result.feedback.replace("float32 weights", ""), result.report()


def test_float32_computation_is_said_once_per_message_and_only_when_true():
    def entropy_in_float32(weights):
        wide = weights.float()
        return -torch.special.xlogy(wide, wide).sum(-1).to(weights.dtype)

    def qk_in_float32(q, k, v, scale):
        return _qk_functional(q.float(), k.float(), v.float(), scale).to(q.dtype)

    for task_id, fn in (("08.attention_entropy", entropy_in_float32), ("08.qk_norm_attention", qk_in_float32)):
        result = grade_function(TASKS[task_id], fn)
        failed = [c.message for c in result.checks if not c.passed]
        assert failed, result.report()
        for message in failed:
            assert message.count("float32 number cast to float64") == 1, message
            assert "float32 rounding" not in message, message


def _first_nonfinite_never_removing_hooks(model, x):
    found = []
    for name, module in model.named_modules():
        module.register_forward_hook(
            lambda module, args, output, name=name: found.append(name) if not torch.isfinite(output).all() else None
        )
    model(x)
    return found[0] if found else None


def test_hooks_left_behind_cost_a_mark_in_both_hook_tasks():
    """ "Remove your hooks afterwards" was never checked: three calls left three hooks on every module."""
    result = grade_function(TASKS["08.first_nonfinite_module"], _first_nonfinite_never_removing_hooks)
    failed = {c.name: c.message for c in result.checks if not c.passed}
    assert list(failed) == ["removes its hooks: none are left on the model after the call"], result.report()
    assert "forward hook" in next(iter(failed.values()))
    task = TASKS["08.first_nonfinite_gradient"]
    result = grade_function(task, task.wrong["never removes its hooks"].fn)
    assert [c.name for c in result.checks if not c.passed] == ["removes its hooks: none are left on the model after the call"]
    assert "backward hook" in result.feedback


def test_the_hook_check_reads_the_batch_graders_record_too():
    """In the batch grader the model comes back as a record of its hooks, and the verdict is the same."""
    from attn_course.grading import Outcome, run_cases

    task = TASKS["08.first_nonfinite_module"]
    for fn in (task.reference, _first_nonfinite_never_removing_hooks):
        cases = task.make_cases()
        outcomes = run_cases(fn, cases)
        plain = [Outcome.from_plain(o.to_plain()) for o in outcomes]
        assert isinstance(plain[0].args_after[0], dict) and "hooks" in plain[0].args_after[0]
        direct, again = task.judge(task.make_cases(), outcomes), task.judge(task.make_cases(), plain)
        assert [(c.passed, c.message) for c in direct] == [(c.passed, c.message) for c in again]


class _Root(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        return self.block(self.lin(x)) * float("inf")  # the root makes the inf itself


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.a(x) - 100)  # the container's own op makes the NaN


def test_skipping_the_model_or_hooking_only_leaves_is_rejected():
    """Both scored full marks: no case had the bad value made by a container's or the model's own forward."""
    from attn_course.grading.tasks.lesson08 import _first_nonfinite_written_out

    x = torch.randn(3, 4)
    assert _first_nonfinite_written_out(_Root(), x) == ""
    assert _first_nonfinite_written_out(torch.nn.Sequential(torch.nn.Linear(4, 4), _Block(), torch.nn.Linear(4, 2)), x) == "1"
    task = TASKS["08.first_nonfinite_module"]
    leaves = grade_function(task, task.wrong["hooks on the leaf modules only"].fn)
    skips = grade_function(task, task.wrong['skips the model itself (name "")'].fn)
    assert leaves.score < leaves.max_score and "You watched only the leaf modules" in leaves.feedback
    assert skips.score < skips.max_score and "The model is a module too" in skips.feedback
    assert "leaf" not in skips.feedback


def test_the_gradient_statement_asks_nothing_the_grader_does_not_check():
    """Task 4 used to require silencing a warning that no check looks at."""
    import json
    from pathlib import Path

    solution = json.loads(Path(__file__).parents[1].joinpath("solutions/08_training_and_debugging.ipynb").read_text())
    statement = next("".join(c["source"]) for c in solution["cells"] if "(`08.first_nonfinite_gradient`)" in "".join(c["source"]))
    assert "silence that warning" not in statement
