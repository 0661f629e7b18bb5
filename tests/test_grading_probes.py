"""Probes (attn_course.grading.probes): what they measure, what they catch, and that they leave no trace.

Every figure asserted here is exact (element counts and the probe's own FLOP rule), so these
tests are independent of the machine and its load.
"""

from __future__ import annotations

import io
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

import attn_course as ac
from attn_course.grading import TASKS, Case, CheckResult, Outcome, Task, grade_function, probe_call, run_cases
from attn_course.grading import runner
from attn_course.grading.probes import TORCH_ATTENTION, TORCH_MULTIHEAD, Probe, resolve_forbidden

MASKS = ("attn_course.masks.causal_mask",)
ATTENTION = ("attn_course.attention.scaled_dot_product_attention", *TORCH_ATTENTION, *TORCH_MULTIHEAD)


# --- largest intermediate -----------------------------------------------------------------------


def test_largest_counts_new_tensors_not_inputs_views_or_in_place_results():
    x = torch.randn(64, 64)  # an input: 4096 elements, not counted
    assert probe_call(lambda: x.sum(dim=0))["largest_numel"] == 64
    assert probe_call(lambda: x.t().expand(2, 64, 64))["largest_numel"] == 0  # views allocate nothing
    assert probe_call(lambda: x.clone().add_(1))["largest_numel"] == 4096  # the clone counts, add_ does not
    column = torch.randn(100, 1)
    found = probe_call(lambda: column.expand(100, 300).contiguous())
    assert (found["largest_numel"], found["largest_shape"]) == (30000, "100 x 300")
    assert probe_call(lambda: torch.zeros(7, 9, dtype=torch.bool))["largest_numel"] == 63  # factories count


def test_largest_sees_the_quadratic_matrix_however_it_was_built():
    q, k = torch.randn(2, 50, 4), torch.randn(2, 30, 4)
    assert probe_call(lambda: q @ k.transpose(-2, -1))["largest_numel"] == 2 * 50 * 30
    assert probe_call(lambda: torch.einsum("bld,bsd->bls", q, k))["largest_numel"] == 2 * 50 * 30
    found = probe_call(lambda: torch.ones(50, 30, dtype=torch.bool).tril())
    assert found["largest_numel"] == 1500 and found["largest_op"] in ("aten.ones", "aten.tril")


def test_flops_count_matrix_products_exactly_and_every_other_op_by_its_largest_tensor():
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    assert probe_call(lambda: a @ b)["flops"] == 2 * 8 * 5 * 3
    assert probe_call(lambda: a.exp())["flops"] == 40
    assert probe_call(lambda: a.sum())["flops"] == 40  # a reduction reads every element
    assert probe_call(lambda: a.t())["flops"] == 0  # a view does no work
    x = torch.randn(10, 4, 6)
    assert probe_call(lambda: x.cumsum(0))["flops"] == 240  # cumsum: FlopCounterMode alone would say 0


def test_ops_counts_every_aten_op_and_names_the_distinct_ones():
    x, index = torch.randn(6, 5), torch.tensor([[0, 1], [2, 3]])
    found = probe_call(lambda: x.t().exp().sum(), measure=("ops",))
    assert (found["op_count"], found["op_names"]) == (3, ["aten.exp", "aten.sum", "aten.t"])  # views count too
    assert "aten.gather" in probe_call(lambda: x.gather(1, index.repeat(3, 1)), measure=("ops",))["op_names"]
    loop = lambda n: probe_call(lambda: [x[i].exp() for i in range(n)], measure=("ops",))["op_count"]
    assert loop(6) - loop(3) == 6  # a Python loop over rows: two ops (select, exp) per row
    assert "op_count" not in probe_call(lambda: x.exp(), measure=("largest",))  # only when asked for


def test_measure_names_are_checked():
    with pytest.raises(ValueError, match="unknown measure"):
        Probe(measure=("largest", "memory"))


# --- forbidden calls ----------------------------------------------------------------------------


def _imported_by_name(L, S):
    from attn_course.masks import causal_mask

    return causal_mask(L, S)


def _through_a_helper(L, S):
    return _imported_by_name(L, S)


alias = ac.causal_mask


@pytest.mark.parametrize(
    "route",
    [
        lambda: ac.causal_mask(4, 4),
        lambda: _imported_by_name(4, 4),
        lambda: _through_a_helper(4, 4),
        lambda: alias(4, 4),
    ],
    ids=["ac.causal_mask", "from attn_course.masks import", "through a helper", "an alias"],
)
def test_a_forbidden_python_function_is_caught_whatever_the_route(route):
    assert probe_call(route, measure=(), forbidden=MASKS)["forbidden_calls"] == ["attn_course.masks.causal_mask"]


def test_building_blocks_stay_allowed():
    q = torch.randn(2, 5, 4)
    found = probe_call(lambda: ac.stable_softmax(q @ q.transpose(-2, -1)) @ q, measure=(), forbidden=ATTENTION)
    assert found["forbidden_calls"] == []
    found = probe_call(lambda: ac.padding_mask(torch.tensor([2, 3]), 4), measure=(), forbidden=MASKS)
    assert found["forbidden_calls"] == []


def test_pytorchs_attention_is_caught_through_every_door():
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    routes = {
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, q, q),
        "with dropout (math backend)": lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
        "torch.ops.aten, math backend": lambda: torch.ops.aten.scaled_dot_product_attention(q, q, q, mask, dropout_p=0.5),
        "the course's": lambda: ac.scaled_dot_product_attention(q, q, q),
        "a course module that uses it": lambda: ac.MultiHeadAttention(8, 2).double()(x),
        "nn.MultiheadAttention": lambda: mha(x, x, x),
    }
    for name, route in routes.items():
        assert probe_call(route, measure=(), forbidden=ATTENTION)["forbidden_calls"], name
    mha.eval()
    with torch.no_grad():  # the fast path runs one fused aten op
        assert probe_call(lambda: mha(x, x, x), measure=(), forbidden=ATTENTION)["forbidden_calls"]


def test_forbidden_names_must_exist():
    with pytest.raises(ValueError, match="does not resolve"):
        resolve_forbidden(("attn_course.masks.no_such_mask",))
    with pytest.raises(ValueError, match="does not resolve"):
        resolve_forbidden(("no_such_package.f",))


# --- no trace left ------------------------------------------------------------------------------


def _previous_profile(frame, event, arg):
    pass


def test_the_probes_restore_the_profiler_and_leave_no_dispatch_mode_even_on_errors():
    sys.setprofile(_previous_profile)
    try:
        with Probe(measure=("largest", "flops"), forbidden=MASKS):
            ac.causal_mask(3, 3)
        assert sys.getprofile() is _previous_profile and _get_current_dispatch_mode() is None
        with pytest.raises(ZeroDivisionError):
            with Probe(measure=("largest", "flops"), forbidden=MASKS):
                torch.ones(2) / 0 + (1 / 0)
        assert sys.getprofile() is _previous_profile and _get_current_dispatch_mode() is None
    finally:
        sys.setprofile(None)


def test_a_timeout_inside_the_probe_leaves_no_trace():
    def endless(x):
        while True:
            x = x + 1

    # The first op under the probes imports and caches things for longer than the 0.05 s below
    # (on a loaded machine the alarm then lands before any op is recorded): warm up once.
    run_cases(lambda x: x + 1, [Case("one", (torch.zeros(3),))], measure=("largest", "flops"), forbidden=MASKS)
    # The alarm lands anywhere, often inside the probe's own code: it must still end the call (a probe
    # that swallowed it once made this loop forever). Twenty tries give it many chances to land there.
    for _ in range(20):
        (outcome,) = run_cases(
            endless, [Case("one", (torch.zeros(3),))], timeout_s=0.05, measure=("largest", "flops"), forbidden=MASKS
        )
        assert outcome.error.startswith("timeout") and outcome.probe["largest_numel"] == 3
        assert sys.getprofile() is None and _get_current_dispatch_mode() is None


def test_a_swallowed_timeout_comes_back_until_the_call_ends():
    def swallows_the_first_timeout(x):
        try:
            while True:
                x = x + 1
        except Exception:  # a learner's catch-all (or a library's) eats the first timeout
            pass
        stop = time.perf_counter() + 10  # with a one-shot alarm this loop would run to the end
        while time.perf_counter() < stop:
            x = x + 1
        return x

    (outcome,) = run_cases(swallows_the_first_timeout, [Case("one", (torch.zeros(3),))], timeout_s=0.05)
    assert outcome.error is not None and outcome.error.startswith("timeout"), outcome.error
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_running_c_profiler_is_left_alone_and_reported():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        found = probe_call(lambda: ac.causal_mask(3, 3), forbidden=MASKS)
        still_profiling = sys.getprofile() is profiler
    finally:
        profiler.disable()
    assert still_profiling and found["largest_numel"] == 9
    assert "profiler was running" in found["probe_error"]


def test_a_function_that_removes_the_profile_hook_is_reported():
    def unhooks():
        sys.setprofile(None)
        return ac.causal_mask(3, 3)

    found = probe_call(unhooks, measure=(), forbidden=MASKS)
    assert "profile hook was replaced" in found["probe_error"]


# --- outcomes carry the probe, plainly ----------------------------------------------------------


def test_probe_data_survives_a_weights_only_round_trip():
    cases = [Case("n=6", (6,))]
    (outcome,) = run_cases(lambda n: ac.causal_mask(n, n), cases, measure=("largest", "flops"), forbidden=MASKS)
    buffer = io.BytesIO()
    torch.save(outcome.to_plain(), buffer)
    buffer.seek(0)
    again = Outcome.from_plain(torch.load(buffer, weights_only=True))
    assert again.probe == outcome.probe and again.probe["forbidden_calls"] == ["attn_course.masks.causal_mask"]
    assert again.probe["largest_numel"] == 36


def test_from_plain_turns_wrong_types_into_safe_defaults():
    odd = Outcome.from_plain(
        {"error": 3, "args_after": "abc", "not_implemented": "yes", "probe": {"flops": {"a": 1}, 4: 5, "ok": ["a", 1]}}
    )
    assert odd.error.startswith("<an error") and odd.args_after == () and odd.not_implemented is False
    assert odd.probe == {}
    assert Outcome.from_plain({"probe": ["not", "a", "dict"]}).probe == {}
    plain = {"largest_numel": 5, "largest_shape": "5", "forbidden_calls": ["x"], "b": True}
    assert Outcome.from_plain({"probe": plain}).probe == plain
    with pytest.raises(TypeError, match="must be a dict"):
        Outcome.from_plain(["not", "a", "dict"])


# --- the rules: delegation gives zero, stretch tasks say so -------------------------------------


def _toy_task(**settings) -> Task:
    def judge(cases, outcomes):
        return [CheckResult("values", outcomes[0].error is None), CheckResult("shape", True, "", 2.0)]

    return Task(
        id="99.toy", title="Toy", function_name="toy", make_cases=lambda: [Case("n=3", (3,))], judge=judge,
        reference=lambda n: torch.ones(n, n).tril().bool(), wrong={}, **settings,
    )


def test_a_forbidden_call_gives_the_whole_task_zero_with_the_hint_first():
    task = _toy_task(forbidden=MASKS)
    assert grade_function(task, task.reference).score == 3
    result = grade_function(task, lambda n: ac.causal_mask(n, n))
    assert result.score == 0 and result.max_score == 3
    assert result.checks[0].message.startswith("you called attn_course.causal_mask: write it yourself")
    assert all("not graded" in c.message for c in result.checks[1:])


def test_stretch_tasks_say_so_in_the_report():
    result = grade_function(_toy_task(stretch=True), lambda n: torch.ones(n, n).tril().bool())
    assert result.stretch and "(stretch task)" in result.report().splitlines()[0]
    assert "stretch" not in grade_function(_toy_task(), lambda n: None).report()


def test_task_settings_are_validated():
    with pytest.raises(TypeError, match="tuples of str"):
        _toy_task(measure="largest")
    with pytest.raises(ValueError, match="unknown measure"):
        _toy_task(measure=("memory",))


def test_the_batch_runner_records_the_probes_in_its_saved_outcomes(tmp_path: Path):
    """The child's _grade_task passes the task's probe settings; the parent reads them back (validated)."""
    from attn_course.grading import batch

    task = TASKS["06.linear_attention"]

    class Shell:  # what _grade_task reads from IPython's shell
        user_ns = {"linear_attention": task.wrong["the quadratic form phi(Q) phi(K)^T"].fn}

    name = runner.result_name(task.id)
    (tmp_path / name).touch()  # the grader creates the result files before the child starts
    runner._grade_task(Shell(), task, task.make_cases(), runner._Results(tmp_path, [name]), call_timeout_s=20)
    record = batch._load_record((tmp_path / name).read_bytes(), task)  # the parent's hostile-data checks
    outcomes = [Outcome.from_plain(o) for o in record["outcomes"]]
    assert all("largest_numel" in o.probe and "flops" in o.probe and o.probe["forbidden_calls"] == [] for o in outcomes)
    checks = task.judge(task.make_cases(), outcomes)
    assert [c.name for c in checks if not c.passed] == [
        c.name for c in grade_function(task, Shell.user_ns["linear_attention"]).checks if not c.passed
    ]
    assert any("never forms the (L, S)" in c.message for c in checks)


def test_widest_sees_one_slices_softmax_as_wide_as_the_batched_one():
    """Issue 20: a limit per batch let dense attention done one (batch, head) slice at a time through."""
    import torch

    from attn_course.grading.probes import probe_call

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 10, 4, generator=g), torch.randn(2, 2, 12, 4, generator=g)
    batched = probe_call(lambda: torch.softmax(q @ k.mT, -1), measure=("widest",))
    sliced = probe_call(lambda: [torch.softmax(q[b, h] @ k[b, h].T, -1) for b in range(2) for h in range(2)],
                        measure=("widest",))
    chunked = probe_call(lambda: [(q @ k[..., s:s + 3, :].mT).amax(-1) for s in range(0, 12, 3)], measure=("widest",))
    bookkeeping = probe_call(lambda: (torch.rand(10, 12) < 0.5).any(-1), measure=("widest",))
    assert batched["widest_reduction"] == sliced["widest_reduction"] == 12
    assert (batched["widest_op"], sliced["widest_shape"]) == ("aten._softmax", "10 x 12")
    assert chunked["widest_reduction"] == 4  # the products contract over D = 4, the maxima span 3 keys
    assert bookkeeping["widest_reduction"] == 0  # a bool reduction is not a softmax


def test_the_first_probe_does_not_import_torch_dynamo():
    """Issue 20 item 9: PyTorch's dispatch-mode wrapper imported torch._dynamo (about 800 modules) on the first op."""
    import subprocess
    import sys

    code = ("import sys, torch\nfrom attn_course.grading.probes import Probe\nx = torch.randn(3, 3)\n"
            "with Probe(measure=('largest', 'flops', 'widest')):\n    torch.softmax(x @ x, -1)\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_forbidden_names_in_unimported_modules_cost_nothing_until_used():
    """03.causal_mask forbids torch.nn.attention.bias's CausalBias, whose import loads torch._dynamo (seconds):
    it is resolved only when code from that file runs, and a submission that imports and calls it is still caught."""
    import subprocess
    import sys

    code = (
        "import sys, time, torch\nfrom attn_course.grading import check\n"
        "def honest(L, S):\n    return torch.ones(L, S, dtype=torch.bool).tril()\n"
        "start = time.perf_counter()\nfirst = check('03.causal_mask', honest, quiet=True)\n"
        "print(first.score == first.max_score, 'torch._dynamo' in sys.modules, time.perf_counter() - start < 1.0)\n"
        "def cheat(L, S):\n    from torch.nn.attention.bias import causal_upper_left\n"
        "    return causal_upper_left(L, S)._materialize()\n"
        "caught = check('03.causal_mask', cheat, quiet=True)\n"
        "print(caught.score == 0, any('CausalBias._materialize' in c.message for c in caught.checks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "True", "True", "True"], out
