"""Graded tasks for lesson 04 (the cost of attention): count the FLOPs, measure what backward keeps."""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from ...attention import scaled_dot_product_attention
from ...bench import saved_tensor_bytes
from ..core import Case, Fail, Outcome, Task, Wrong
from ..judging import NOT_IMPLEMENTED, Checklist

__all__ = ["ATTENTION_FLOPS", "SAVED_TENSOR_BYTES"]


def _returned_number(outcome: Outcome, *, what: str, whole: bool = False) -> float:
    """The number the learner returned (a Python number or a one-element tensor); Fail otherwise."""
    if outcome.not_implemented:
        raise Fail(NOT_IMPLEMENTED)
    if outcome.error is not None:
        raise Fail(f"{what} raised {outcome.error}")
    value = outcome.returned
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Fail(f"{what} should return a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise Fail(f"{what} returned {value}: expected a finite count.")
    if whole and value != int(value):
        raise Fail(f"{what} returned {value}: a count of bytes is a whole number.")
    return float(value)


def _numbers(cases, outcomes, *, whole: bool = False) -> list[tuple[Case, float]]:
    """``(case, number)`` for the cases where the learner returned; like ``_common.answered`` for numbers."""
    results, first_failure = [], None
    for case, outcome in zip(cases, outcomes):
        try:
            results.append((case, _returned_number(outcome, what=case.name, whole=whole)))
        except Fail as failure:
            if outcome.not_implemented or outcome.error is None:
                raise
            first_failure = first_failure or failure
    if not results and first_failure is not None:
        raise first_failure
    return results


# --- 04.attention_flops --------------------------------------------------------------------
# The learner writes attention_flops(B, H, L, S, D, Dv) -> the FLOPs of the two matmuls of
# one forward pass of attention (Q K^T and weights @ V), 2 FLOPs per multiply-add; the
# softmax is not counted. The judge counts with PyTorch's own FlopCounterMode, not a formula.

_FLOP_SHAPES = [
    (1, 1, 4, 4, 8, 8),
    (2, 8, 64, 64, 16, 16),
    (2, 3, 5, 7, 4, 6),
    (4, 2, 16, 32, 8, 2),
    (1, 1, 1, 9, 3, 5),
]
_SELF_ATTENTION, _CROSS_ATTENTION = (0, 1), (2, 3, 4)


def _flop_cases() -> list[Case]:
    return [
        Case(f"attention_flops(B={B}, H={H}, L={L}, S={S}, D={D}, Dv={Dv})", (B, H, L, S, D, Dv))
        for B, H, L, S, D, Dv in _FLOP_SHAPES
    ]


def _counted_flops(B: int, H: int, L: int, S: int, D: int, Dv: int) -> int:
    """FLOPs PyTorch's ``FlopCounterMode`` counts for the library's explicit attention on these shapes."""
    q, k, v = torch.zeros(B, H, L, D), torch.zeros(B, H, S, D), torch.zeros(B, H, S, Dv)
    with FlopCounterMode(display=False) as counter:
        scaled_dot_product_attention(q, k, v, fused=False)
    return counter.get_total_flops()


def _diagnose_flops(got: float, B: int, H: int, L: int, S: int, D: int, Dv: int) -> str:
    expected = _counted_flops(B, H, L, S, D, Dv)
    per_head = 2 * L * S * (D + Dv)
    candidates = [
        (expected / 2, "you counted multiply-adds. Each multiply-add is 2 FLOPs (a multiply and an add): "
                       "a (L, D) @ (D, S) product costs 2·L·S·D."),
        (2 * B * H * L * S * D, "you counted Q K^T only. The weights times V is a second matmul, (L, S) @ (S, Dv): "
                                "another 2·L·S·Dv per batch element and head."),
        (4 * B * H * L * S * D, "you used D for both matmuls. The second one multiplies (L, S) by (S, Dv), so it "
                                "costs 2·L·S·Dv, and Dv may differ from D."),
        (4 * B * H * L * S * Dv, "you used Dv for both matmuls. Q K^T multiplies (L, D) by (D, S): 2·L·S·D."),
        (2 * B * H * L * L * (D + Dv), "you used L where S belongs. The score matrix is (L, S): L queries against "
                                       "S keys, which differ in cross-attention."),
        (per_head, "you counted one batch element and one head. Every (batch, head) pair does the same work: "
                   "multiply by B·H."),
        (B * per_head, "you left out the heads: every head does its own two matmuls, multiply by H too."),
        (H * per_head, "you left out the batch: every batch element does the same work, multiply by B too."),
    ]
    if D == Dv and math.isclose(got, expected / 2, rel_tol=1e-9):
        return ("You got half the count: either you counted multiply-adds (each is 2 FLOPs, a multiply and an add), "
                "or only one of the two matmuls (Q K^T costs 2·L·S·D, weights @ V another 2·L·S·Dv).")
    for value, message in candidates:
        if value != expected and math.isclose(got, value, rel_tol=1e-9):
            return message[:1].upper() + message[1:]
    extra = got - expected
    cells = B * H * L * S
    if extra > 0 and extra % cells == 0 and extra / cells <= 10:
        return (f"You added {extra / cells:g} FLOPs per score for the softmax. The convention here (and in "
                "attn_course.bench.attention_flops and PyTorch's FlopCounterMode) counts the two matmuls only: the "
                "softmax is O(L·S), not O(L·S·D), and small next to them.")
    return f"Expected {expected:,} FLOPs, got {got:,.0f}: count 2·L·S·D for Q K^T plus 2·L·S·Dv for weights @ V, per head."


def _judge_flops(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a number for every case"):
        _numbers(cases, outcomes)
    for title, indices in (("self-attention shapes (L = S, D = Dv)", _SELF_ATTENTION),
                           ("cross-attention shapes (L != S, D != Dv)", _CROSS_ATTENTION)):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = _returned_number(outcomes[index], what=case.name)
                expected = _counted_flops(*case.args)
                if not math.isclose(got, expected, rel_tol=1e-9):
                    raise Fail(f"{case.name}: {_diagnose_flops(got, *case.args)}")
    return checklist.results


def _flops_reference(B, H, L, S, D, Dv):
    return 2 * B * H * L * S * (D + Dv)


def _flops_macs(B, H, L, S, D, Dv):
    return B * H * L * S * (D + Dv)


def _flops_scores_only(B, H, L, S, D, Dv):
    return 2 * B * H * L * S * D


def _flops_same_dim(B, H, L, S, D, Dv):
    return 4 * B * H * L * S * D


def _flops_square(B, H, L, S, D, Dv):
    return 2 * B * H * L * L * (D + Dv)


def _flops_per_head(B, H, L, S, D, Dv):
    return 2 * L * S * (D + Dv)


def _flops_with_softmax(B, H, L, S, D, Dv):
    return 2 * B * H * L * S * (D + Dv) + 5 * B * H * L * S


def _flops_big_o(B, H, L, S, D, Dv):
    return L * L * D  # the article's O(N^2 d), read as a count


ATTENTION_FLOPS = Task(
    id="04.attention_flops",
    title="Count the FLOPs of attention",
    function_name="attention_flops",
    make_cases=_flop_cases,
    judge=_judge_flops,
    reference=_flops_reference,
    wrong={
        "multiply-adds instead of FLOPs": Wrong(_flops_macs, "multiply-add is 2 FLOPs"),
        "Q K^T only": Wrong(_flops_scores_only, "Q K^T only"),
        "D for both matmuls": Wrong(_flops_same_dim, "used D for both"),
        "L for S": Wrong(_flops_square, "used L where S belongs"),
        "one batch element and head": Wrong(_flops_per_head, "multiply by B·H"),
        "softmax counted too": Wrong(_flops_with_softmax, "counts the two matmuls only"),
        "the article's O(N^2 d) as a count": Wrong(_flops_big_o, "Expected"),
    },
)


# --- 04.saved_tensor_bytes -----------------------------------------------------------------
# The learner writes saved_tensor_bytes(fn, *args) -> int: the bytes autograd keeps for the
# backward pass of fn(*args), counting each saved storage once at its full size, with
# torch.autograd.graph.saved_tensors_hooks.


def _dense_attention(q, k, v):
    """Explicit attention (lesson 01): keeps (L, S) matrices for its backward pass."""
    return scaled_dot_product_attention(q, k, v, fused=False)


def _square(x):
    """``x * x``: the multiplication saves ``x`` twice (once per operand)."""
    return x * x


def _tanh_twice(x):
    """``tanh`` saves its *output*, not its input; multiplying by a Python number saves nothing."""
    return torch.tanh(x) * 2.0


def _sin_of_slice(x):
    """``sin`` saves its input: here a view of two columns, which keeps all of ``x`` alive."""
    return torch.sin(x[:, :2])


def _saved_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(404)

    def leaf(*shape, dtype=torch.float64, grad=True):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)

    return [
        Case("fn = dense attention, q, k, v (1, 2, 16, 8) float32",
             (_dense_attention, leaf(1, 2, 16, 8, dtype=torch.float32), leaf(1, 2, 16, 8, dtype=torch.float32),
              leaf(1, 2, 16, 8, dtype=torch.float32))),
        Case("fn = x * x, x (3, 5) float64", (_square, leaf(3, 5))),
        Case("fn = tanh(x) * 2, x (4, 6) float64", (_tanh_twice, leaf(4, 6))),
        Case("fn = sin(x[:, :2]), x (5, 8) float64", (_sin_of_slice, leaf(5, 8))),
        Case("fn = x * x, x (6, 6) float16", (_square, leaf(6, 6, dtype=torch.float16))),
        Case("fn = x * x, x (3, 5) float64 that does not require grad", (_square, leaf(3, 5, grad=False))),
    ]


_ATTENTION, _SQUARE, _TANH, _SLICE, _HALF, _NO_GRAD = range(6)


def _count(fn, *args, size: str = "storage", dedup: bool = True) -> int:
    """Saved bytes counted the right way (``size="storage"``, deduplicated) or one classic wrong way."""
    seen: dict[object, int] = {}
    total = 0
    kept = []

    def pack(t):
        nonlocal total
        kept.append(t)
        if size == "storage":
            nbytes = t.untyped_storage().nbytes()
        elif size == "view":
            nbytes = t.numel() * t.element_size()
        elif size == "numel":
            nbytes = t.numel()
        else:  # "float32": four bytes per element, whatever the dtype
            nbytes = 4 * t.numel()
        if dedup:
            seen[t.untyped_storage().data_ptr()] = nbytes
        else:
            total += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total + sum(seen.values())


def _output_bytes(fn, *args) -> int:
    out = fn(*args)
    return out.numel() * out.element_size()


def _input_bytes(fn, *args) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _diagnose_saved(got: float, fn, args) -> str:
    expected = saved_tensor_bytes(fn, *args)
    if expected == 0 and got != 0:
        return ("nothing here requires a gradient, so autograd saves nothing: 0 bytes. Count only what the pack "
                "hook of torch.autograd.graph.saved_tensors_hooks receives.")
    variants = [
        (lambda: _count(fn, *args, size="numel"),
         "you counted elements, not bytes: multiply by the element size (t.element_size(), 8 for float64, 2 for "
         "float16), or use t.untyped_storage().nbytes()."),
        (lambda: _count(fn, *args, size="float32"),
         "you assumed 4 bytes per element. float64 takes 8 and float16 takes 2: use t.element_size() or "
         "t.untyped_storage().nbytes()."),
        (lambda: _count(fn, *args, dedup=False),
         "you counted a tensor every time it was saved. x * x saves x twice, but it is one tensor in memory: "
         "count each storage once (key a dict by t.untyped_storage().data_ptr())."),
        (lambda: _count(fn, *args, size="view"),
         "you counted the size of each saved view. A view (a slice, a transpose) keeps its whole storage alive: "
         "count t.untyped_storage().nbytes()."),
        (lambda: _output_bytes(fn, *args),
         "you measured the output of fn. Count what autograd saves for backward: the tensors the pack hook receives."),
        (lambda: _input_bytes(fn, *args),
         "you counted the inputs. Autograd saves what each operation's backward needs, which may be outputs or "
         "intermediates rather than the inputs: count what the pack hook receives."),
    ]
    for make, message in variants:
        try:
            value = make()
        except Exception:
            continue
        if value != expected and got == value:
            return message[:1].upper() + message[1:]
    return f"expected {expected} bytes, got {got:g}."


def _judge_saved(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a whole number of bytes for every case"):
        _numbers(cases, outcomes, whole=True)
    for title, indices in (
        ("dense attention: the (L, S) matrices autograd keeps", (_ATTENTION,)),
        ("a tensor saved twice counts once; an output saved counts", (_SQUARE, _TANH)),
        ("a saved view counts the storage it keeps alive", (_SLICE,)),
        ("bytes per element follow the dtype (float16: 2)", (_HALF,)),
        ("nothing requires grad: nothing is saved", (_NO_GRAD,)),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = _returned_number(outcomes[index], what=case.name, whole=True)
                if got != saved_tensor_bytes(*case.args):
                    raise Fail(f"{case.name}: {_diagnose_saved(got, case.args[0], case.args[1:])}")
    return checklist.results


def _saved_reference(fn, *args):
    return saved_tensor_bytes(fn, *args)


def _saved_numel(fn, *args):
    return _count(fn, *args, size="numel")


def _saved_float32(fn, *args):
    return _count(fn, *args, size="float32")


def _saved_duplicates(fn, *args):
    return _count(fn, *args, dedup=False)


def _saved_views(fn, *args):
    return _count(fn, *args, size="view")


def _saved_output(fn, *args):
    return _output_bytes(fn, *args)


def _saved_inputs(fn, *args):
    return _input_bytes(fn, *args)


SAVED_TENSOR_BYTES = Task(
    id="04.saved_tensor_bytes",
    title="Measure what autograd keeps for backward",
    function_name="saved_tensor_bytes",
    make_cases=_saved_cases,
    judge=_judge_saved,
    reference=_saved_reference,
    wrong={
        "elements instead of bytes": Wrong(_saved_numel, "counted elements, not bytes"),
        "4 bytes per element whatever the dtype": Wrong(_saved_float32, "assumed 4 bytes per element"),
        "a tensor saved twice counted twice": Wrong(_saved_duplicates, "count each storage once"),
        "views counted by their own size": Wrong(_saved_views, "keeps its whole storage alive"),
        "the output's bytes": Wrong(_saved_output, "measured the output"),
        "the inputs' bytes": Wrong(_saved_inputs, "counted the inputs"),
    },
)
