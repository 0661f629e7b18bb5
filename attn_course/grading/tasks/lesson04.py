"""Graded tasks for lesson 04 (the cost of attention): count the FLOPs, measure what backward keeps.

* ``04.attention_flops``: the FLOPs of attention's two matrix products for any shapes, compared with
  PyTorch's ``FlopCounterMode`` (on the library's explicit attention for the small cases, on the two
  products alone for cases far too large to run: so a learner must count, not measure).
* ``04.saved_tensor_bytes``: the bytes autograd keeps, each storage once.
* ``04.training_flops`` (stretch): the FLOPs of a forward and backward pass, storing the weights or
  recomputing them, compared with ``FlopCounterMode`` over the library's explicit and chunked attention.

Calling the library's own ``attention_flops`` or ``saved_tensor_bytes`` gives the task zero
(``forbidden``): the lesson uses them as black boxes, the exercise asks for the idea.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ...attention import scaled_dot_product_attention
from ...bench import attention_flops
from ...measure import saved_tensor_bytes
from ...chunked import chunked_attention
from ..core import Case, Fail, Outcome, Task, Wrong
from ..judging import NOT_IMPLEMENTED, Checklist

__all__ = ["ATTENTION_FLOPS", "SAVED_TENSOR_BYTES", "TRAINING_FLOPS"]


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
    """``(case, number)`` for every case; like ``_common.answered``, a case that raised fails the check."""
    return [(case, _returned_number(outcome, what=case.name, whole=whole)) for case, outcome in zip(cases, outcomes)]


class _PyTorchFlops(TorchDispatchMode):
    """``FlopCounterMode(display=False)``'s total: PyTorch's own formulas (``flop_registry``), summed per aten op.

    FlopCounterMode itself runs a dispatch mode that PyTorch wraps in ``torch._disable_dynamo``, whose
    first call imports ``torch._dynamo`` and sympy: about 2 s inside a learner's first ``check()``.
    ``tests/test_grading_lesson04.py`` checks that both give the same totals on every case.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: no Dynamo wrapper (see the class docstring)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


# --- 04.attention_flops --------------------------------------------------------------------
# The learner writes attention_flops(B, H, L, S, D, Dv) -> the FLOPs of the two matmuls of
# one forward pass of attention (Q K^T and weights @ V), 2 FLOPs per multiply-add; the
# softmax is not counted. The judge counts with PyTorch's own FlopCounterMode, not a formula.

_FLOP_SHAPES = [
    (2, 4, 16, 16, 8, 8),
    (3, 2, 32, 32, 16, 16),
    (2, 3, 5, 7, 4, 6),
    (4, 2, 16, 32, 8, 2),
    (1, 1, 1, 9, 3, 5),
    # Too large to run (these would need tens of GiB): the count must come from the shapes.
    (8, 32, 4096, 4096, 128, 128),
    (2, 16, 1024, 8192, 64, 96),
]
_SELF_ATTENTION, _CROSS_ATTENTION, _LARGE_MODELS = (0, 1), (2, 3, 4), (5, 6)
_RUNNABLE = 10**6  # B·H·L·S above this: counted on the two products of meta tensors instead of a real run


def _flop_cases() -> list[Case]:
    return [
        Case(f"attention_flops(B={B}, H={H}, L={L}, S={S}, D={D}, Dv={Dv})", (B, H, L, S, D, Dv))
        for B, H, L, S, D, Dv in _FLOP_SHAPES
    ]


def _counted_flops(B: int, H: int, L: int, S: int, D: int, Dv: int) -> int:
    """FLOPs PyTorch's ``FlopCounterMode`` counts for these shapes (its formulas, via :class:`_PyTorchFlops`).

    Small shapes: the library's explicit attention, run. Shapes too large to run: the same two
    products (scores, then weights times values) on ``meta`` tensors, which have shapes but no data
    (``tests/test_grading_lesson04.py`` checks that both routes agree where both can run).
    """
    with _PyTorchFlops() as counter:
        if B * H * L * S <= _RUNNABLE:
            q, k, v = torch.zeros(B, H, L, D), torch.zeros(B, H, S, D), torch.zeros(B, H, S, Dv)
            scaled_dot_product_attention(q, k, v, fused=False)
        else:
            q = torch.empty(B, H, L, D, device="meta")
            k, v = torch.empty(B, H, S, D, device="meta"), torch.empty(B, H, S, Dv, device="meta")
            torch.matmul(torch.matmul(q, k.transpose(-2, -1)), v)  # (B, H, L, S) @ (B, H, S, Dv)
    return counter.flops


_COUNTING_RULE = ("count each matrix product with the lesson's rule, (m, k) @ (k, n) costs 2·m·k·n FLOPs: "
                  "attention has two of them, Q K^T and weights @ V, for every batch element and every head.")


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
    big_o = {L * L * D, L * S * D, B * H * L * L * D, B * H * L * S * D, L * S * (D + Dv)}
    if any(math.isclose(got, value, rel_tol=1e-9) for value in big_o):
        return ("That is the article's O(N^2·d) read as a count. Big-O keeps only how the cost grows and drops the "
                f"constants and the other sizes; a count needs them all: {_COUNTING_RULE}")
    extra = got - expected
    cells = B * H * L * S
    if extra > 0 and extra % cells == 0 and extra / cells <= 10:
        return (f"You added {extra / cells:g} FLOPs per score for the softmax. The convention here (and in "
                "attn_course.bench.attention_flops and PyTorch's FlopCounterMode) counts the two matmuls only: the "
                "softmax is O(L·S), not O(L·S·D), and small next to them.")
    return f"Expected {expected:,} FLOPs, got {got:,.0f}: {_COUNTING_RULE}"


def _judge_flops(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a number for every case"):
        _numbers(cases, outcomes)
    for title, indices in (("self-attention shapes (L = S, D = Dv)", _SELF_ATTENTION),
                           ("cross-attention shapes (L != S, D != Dv)", _CROSS_ATTENTION),
                           ("models too large to run: count from the shapes", _LARGE_MODELS)):
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


def _flops_no_heads(B, H, L, S, D, Dv):
    return 2 * B * L * S * (D + Dv)


def _flops_with_softmax(B, H, L, S, D, Dv):
    return 2 * B * H * L * S * (D + Dv) + 5 * B * H * L * S


def _flops_big_o(B, H, L, S, D, Dv):
    return L * L * D  # the article's O(N^2 d), read as a count


def _flops_library(B, H, L, S, D, Dv):
    """Right for self-attention only, and a delegation anyway: the library's count."""
    from ...bench import AttentionBenchConfig

    return attention_flops("dense", L, AttentionBenchConfig(batch=B, heads=H, head_dim=D))


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
        "no heads": Wrong(_flops_no_heads, "left out the heads"),
        "softmax counted too": Wrong(_flops_with_softmax, "counts the two matmuls only"),
        "the article's O(N^2 d) as a count": Wrong(_flops_big_o, "Big-O keeps only how the cost grows"),
        "calls attn_course.bench.attention_flops": Wrong(_flops_library, "you called attn_course.bench.attention_flops"),
    },
    forbidden=("attn_course.bench.attention_flops",),
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


def _cos_of_diagonal(x):
    """``cos`` saves its input: here the diagonal, a view of 6 elements that keeps all 36 of ``x`` alive."""
    return torch.cos(x.diagonal())


def _saved_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(404)

    def leaf(*shape, dtype=torch.float64, grad=True):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)

    return [
        Case("fn = dense attention, q (2, 2, 12, 8), k and v (2, 2, 16, 8) float32",
             (_dense_attention, leaf(2, 2, 12, 8, dtype=torch.float32), leaf(2, 2, 16, 8, dtype=torch.float32),
              leaf(2, 2, 16, 8, dtype=torch.float32))),
        Case("fn = x * x, x (3, 5) float64", (_square, leaf(3, 5))),
        Case("fn = tanh(x) * 2, x (4, 6) float64", (_tanh_twice, leaf(4, 6))),
        Case("fn = sin(x[:, :2]), x (5, 8) float64", (_sin_of_slice, leaf(5, 8))),
        Case("fn = x * x, x (6, 6) float16", (_square, leaf(6, 6, dtype=torch.float16))),
        Case("fn = x * x, x (3, 5) float64 that does not require grad", (_square, leaf(3, 5, grad=False))),
        Case("fn = cos(x.diagonal()), x (6, 6) float32", (_cos_of_diagonal, leaf(6, 6, dtype=torch.float32))),
    ]


_ATTENTION, _SQUARE, _TANH, _SLICE, _HALF, _NO_GRAD, _DIAGONAL = range(7)


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


def _diagnose_saved(got: float, fn, args, others=()) -> str:
    """The story that explains ``got`` on this case and is not ruled out by the learner's answers elsewhere.

    ``others`` holds ``(args, answer)`` for the other cases the learner answered: a variant is said only
    when it gives the learner's answer on every one of them too (issue 20: "4 bytes per element" was
    told to code that used element_size() but counted a tensor twice, which gives the same number in
    float16 and not in float64).
    """
    expected = saved_tensor_bytes(fn, *args)
    if expected == 0 and got != 0:
        return ("nothing here requires a gradient, so autograd saves nothing: 0 bytes. Count only what the pack "
                "hook of torch.autograd.graph.saved_tensors_hooks receives.")
    variants = [
        (lambda: _count(fn, *args, size="numel"),
         "you counted elements, not bytes: each element takes its dtype's size (8 bytes in float64, 2 in "
         "float16)."),
        (lambda: _count(fn, *args, size="float32"),
         "you assumed 4 bytes per element. float64 takes 8 and float16 takes 2: the size follows each tensor's "
         "dtype."),
        (lambda: _count(fn, *args, dedup=False),
         "you counted a tensor every time it was saved. x * x saves x twice, but it is one tensor in memory: "
         "each storage counts once, however often it is saved."),
        (lambda: _count(fn, *args, size="view"),
         "you counted the size of each saved view. A view (a slice, a transpose) keeps its whole storage alive: "
         "it is the storage's size that is held in memory."),
        (lambda: _output_bytes(fn, *args),
         "you measured the output of fn. Count what autograd saves for backward: the tensors the pack hook receives."),
        (lambda: _input_bytes(fn, *args),
         "you counted the inputs. Autograd saves what each operation's backward needs, which may be outputs or "
         "intermediates rather than the inputs: count what the pack hook receives."),
    ]
    for index, (make, message) in enumerate(variants):
        try:
            value = make()
        except Exception:
            continue
        if value != expected and got == value and all(_variant_gives(index, other_args, answer)
                                                        for other_args, answer in others):
            return message[:1].upper() + message[1:]
    return f"expected {expected} bytes, got {got:g}."


def _variant_gives(index: int, args, answer: float) -> bool:
    """Whether variant ``index`` of ``_diagnose_saved`` gives ``answer`` on the case with these arguments."""
    fn, rest = args[0], args[1:]
    makers = [lambda: _count(fn, *rest, size="numel"), lambda: _count(fn, *rest, size="float32"),
              lambda: _count(fn, *rest, dedup=False), lambda: _count(fn, *rest, size="view"),
              lambda: _output_bytes(fn, *rest), lambda: _input_bytes(fn, *rest)]
    try:
        return makers[index]() == answer
    except Exception:
        return False


def _judge_saved(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a whole number of bytes for every case"):
        _numbers(cases, outcomes, whole=True)
    for title, indices in (
        ("dense attention: the (L, S) matrices autograd keeps", (_ATTENTION,)),
        ("a tensor saved twice counts once; an output saved counts", (_SQUARE, _TANH)),
        ("a saved view counts the storage it keeps alive", (_SLICE, _DIAGONAL)),
        ("bytes per element follow the dtype (float16: 2)", (_HALF,)),
        ("nothing requires grad: nothing is saved", (_NO_GRAD,)),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = _returned_number(outcomes[index], what=case.name, whole=True)
                if got != saved_tensor_bytes(*case.args):
                    others = [(other.args, _returned_number(outcome, what=other.name, whole=True))
                              for i, (other, outcome) in enumerate(zip(cases, outcomes))
                              if i != index and outcome.error is None and _is_number(outcome)]
                    raise Fail(f"{case.name}: {_diagnose_saved(got, case.args[0], case.args[1:], others)}")
    return checklist.results


def _is_number(outcome) -> bool:
    try:
        _returned_number(outcome, what="", whole=True)
    except Fail:
        return False
    return True


def _saved_reference(fn, *args):
    return _count(fn, *args)  # written out: the library's saved_tensor_bytes is forbidden to the learner


def _saved_library(fn, *args):
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
        "a tensor saved twice counted twice": Wrong(_saved_duplicates, "each storage counts once"),
        "views counted by their own size": Wrong(_saved_views, "keeps its whole storage alive"),
        "the output's bytes": Wrong(_saved_output, "measured the output"),
        "the inputs' bytes": Wrong(_saved_inputs, "counted the inputs"),
        "calls the library's saved_tensor_bytes": Wrong(
            _saved_library, "you called attn_course.measure.saved_tensor_bytes", kind="algorithm"),
    },
    forbidden=("attn_course.measure.saved_tensor_bytes",),
)


# --- 04.training_flops (stretch) -----------------------------------------------------------
# The learner writes training_flops(B, H, L, S, D, Dv, recompute=False) -> the FLOPs of the
# matrix products of one forward and backward pass of attention, with gradients for q, k and v.
# Each forward product C = A @ B costs two backward products (dA = dC @ B^T, dB = A^T @ dC), the
# same size each: 3x the forward. recompute=True (FlashAttention, lesson 07's chunked attention)
# also recomputes Q K^T in the backward pass. The judge counts with FlopCounterMode over the
# library's explicit attention (recompute=False) and chunked_attention (recompute=True).

_TRAINING_SHAPES = [
    ((2, 2, 8, 8, 4, 4), False),
    ((2, 3, 5, 7, 4, 6), False),
    ((2, 2, 9, 4, 2, 5), False),
    ((2, 2, 8, 8, 4, 4), True),
    ((3, 2, 6, 10, 8, 2), True),
    ((1, 4, 12, 5, 6, 3), True),
]
_STORED, _RECOMPUTED = (0, 1, 2), (3, 4, 5)


def _training_cases() -> list[Case]:
    return [
        Case(f"training_flops(B={B}, H={H}, L={L}, S={S}, D={D}, Dv={Dv}, recompute={recompute})",
             (B, H, L, S, D, Dv), {"recompute": recompute})
        for (B, H, L, S, D, Dv), recompute in _TRAINING_SHAPES
    ]


def _counted_training_flops(B: int, H: int, L: int, S: int, D: int, Dv: int, recompute: bool) -> int:
    """FlopCounterMode's count (:class:`_PyTorchFlops`) of a forward and backward pass (gradients for q, k, v)."""
    q = torch.zeros(B, H, L, D, requires_grad=True)
    k, v = torch.zeros(B, H, S, D, requires_grad=True), torch.zeros(B, H, S, Dv, requires_grad=True)
    with _PyTorchFlops() as counter:
        if recompute:  # chunks smaller than L and S: the backward pass recomputes block by block
            out = chunked_attention(q, k, v, query_chunk_size=3, key_chunk_size=4, recompute=True)
        else:
            out = scaled_dot_product_attention(q, k, v, fused=False)
        out.sum().backward()
    return counter.flops


def _training_stories(B: int, H: int, L: int, S: int, D: int, Dv: int, recompute: bool) -> list[tuple[float, str]]:
    """What each classic mistake counts on one case, with its message (in the order the judge tries them)."""
    forward = 2 * B * H * L * S * (D + Dv)
    scores = 2 * B * H * L * S * D  # one Q K^T
    extra = scores if recompute else 0
    return [
        (forward + extra, "you counted the forward pass only. Training also runs the backward pass: every forward "
                          "product C = A @ B needs dA = dC @ B^T and dB = A^T @ dC."),
        (2 * forward + extra, "your backward pass has one product per forward product. It needs two: dA = dC @ B^T "
                              "and dB = A^T @ dC, one gradient for each input of the product."),
        (3 * forward, "with recompute=True the backward pass has no weights to read: it recomputes the scores "
                      "Q K^T first (one more 2·L·S·D per batch element and head) -- only those, not the product "
                      "with V."),
        (4 * forward if recompute else 3 * forward,
         "recomputing redoes the scores Q K^T only, not the whole forward pass: the product with V is "
         "not needed again (its output was kept)."),
        (3 * forward + (2 * B * H * L * S * Dv if recompute else 0),
         "the backward pass recomputes Q K^T (2·L·S·D), not the weights @ V (2·L·S·Dv)."),
        (6 * B * H * L * S * (2 * D) + extra,
         "you used D for Dv. The product with V costs 2·L·S·Dv forward, and so does each of its two gradients."),
        (forward + 2 * B * H * L * S * (2 * D + Dv) + extra,
         "your backward pass leaves out a gradient: dV = P^T @ dO is a product too, (S, L) @ (L, Dv)."),
        ((3 * forward + extra) / (B * H), "you counted one batch element and one head: multiply by B·H."),
        (3 * forward + extra - forward, "the forward pass is part of the training step too: add it."),
    ]


def _diagnose_training(index: int, cases, answers: list[float | None]) -> str:
    """The story that explains the answer on case ``index``, told only if it explains every other answer too.

    On some shapes two mistakes give the same count (with D = Dv, leaving out dV and ignoring
    recompute do), so one case alone cannot tell them apart; every case together can.
    """
    case = cases[index]
    got = answers[index]
    expected = _counted_training_flops(*case.args, **case.kwargs)
    stories = [_training_stories(*c.args, **c.kwargs) for c in cases]
    for n, (value, message) in enumerate(stories[index]):
        if value == expected or not math.isclose(got, value, rel_tol=1e-9):
            continue
        if all(a is None or math.isclose(a, story[n][0], rel_tol=1e-9) for a, story in zip(answers, stories)):
            return message[:1].upper() + message[1:]
    return (f"Expected {expected:,} FLOPs, got {got:,.0f}. Count every matrix product of the forward pass, then "
            "the two products each one needs in the backward pass (one per input), with the rule 2·m·k·n.")


def _judge_training(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns a number for every case"):
        _numbers(cases, outcomes)
    answers = []
    for case, outcome in zip(cases, outcomes):
        try:
            answers.append(_returned_number(outcome, what=case.name))
        except Fail:
            answers.append(None)
    for title, indices in (("forward and backward, the weights stored (recompute=False)", _STORED),
                           ("the backward pass recomputes the scores (recompute=True)", _RECOMPUTED)):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = _returned_number(outcomes[index], what=case.name)
                expected = _counted_training_flops(*case.args, **case.kwargs)
                if not math.isclose(got, expected, rel_tol=1e-9):
                    raise Fail(f"{case.name}: {_diagnose_training(index, cases, answers)}")
    return checklist.results


def _training_reference(B, H, L, S, D, Dv, recompute=False):
    forward = 2 * B * H * L * S * (D + Dv)
    return 3 * forward + (2 * B * H * L * S * D if recompute else 0)


def _training_forward_only(B, H, L, S, D, Dv, recompute=False):
    return 2 * B * H * L * S * (D + Dv) + (2 * B * H * L * S * D if recompute else 0)


def _training_one_backward_product(B, H, L, S, D, Dv, recompute=False):
    return 2 * 2 * B * H * L * S * (D + Dv) + (2 * B * H * L * S * D if recompute else 0)


def _training_ignores_recompute(B, H, L, S, D, Dv, recompute=False):
    return 3 * 2 * B * H * L * S * (D + Dv)


def _training_recomputes_everything(B, H, L, S, D, Dv, recompute=False):
    return (4 if recompute else 3) * 2 * B * H * L * S * (D + Dv)


def _training_recomputes_values(B, H, L, S, D, Dv, recompute=False):
    return 3 * 2 * B * H * L * S * (D + Dv) + (2 * B * H * L * S * Dv if recompute else 0)


def _training_d_for_dv(B, H, L, S, D, Dv, recompute=False):
    return _training_reference(B, H, L, S, D, D, recompute)


def _training_no_dv(B, H, L, S, D, Dv, recompute=False):
    return _training_reference(B, H, L, S, D, Dv, recompute) - 2 * B * H * L * S * Dv


def _training_per_head(B, H, L, S, D, Dv, recompute=False):
    return _training_reference(1, 1, L, S, D, Dv, recompute)


TRAINING_FLOPS = Task(
    id="04.training_flops",
    title="Count the FLOPs of a training step, with and without recomputation",
    function_name="training_flops",
    make_cases=_training_cases,
    judge=_judge_training,
    reference=_training_reference,
    wrong={
        "forward pass only": Wrong(_training_forward_only, "counted the forward pass only"),
        "one backward product per forward product": Wrong(_training_one_backward_product, "It needs two"),
        "recompute ignored": Wrong(_training_ignores_recompute, "has no weights to read"),
        "recomputes the whole forward pass": Wrong(_training_recomputes_everything, "not the whole forward pass"),
        "recomputes the product with V instead of the scores": Wrong(_training_recomputes_values,
                                                                     "not the weights @ V"),
        "D for Dv": Wrong(_training_d_for_dv, "used D for Dv"),
        "no gradient for v": Wrong(_training_no_dv, "leaves out a gradient"),
        "one batch element and head": Wrong(_training_per_head, "multiply by B·H"),
    },
    stretch=True,
)
