"""Graded tasks for lesson 02 (multi-head attention), in PyTorch's default sequence-first layout.

Lesson 02 splits and merges heads for the batch-first layout ``(B, L, E)``; the exercise asks for
the same operations on ``nn.MultiheadAttention``'s default layout, ``(L, B, E)``
(``batch_first=False``), so the learner applies the idea instead of copying the lesson:

* ``02.split_heads``: ``(L, B, E)`` -> ``(B, H, L, D)``;
* ``02.merge_heads``: ``(B, H, L, D)`` -> ``(L, B, E)``;
* ``02.mha_forward``: the whole forward pass on ``(L, B, E)`` from ``nn.MultiheadAttention``'s
  parameters, equal to ``nn.MultiheadAttention(E, H)``;
* ``02.prune_heads`` (stretch): the weights of the same layer without some heads, which the
  lesson's "W^O is a sum over heads" makes possible.

Shape legend: B batch, H heads, K heads kept, L length, D head dim, E model dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention
from ...multihead import MultiHeadAttention, merge_heads, split_heads
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned, seeded_randn, softmax_over_queries

__all__ = ["SPLIT_HEADS", "MERGE_HEADS", "MHA_FORWARD", "PRUNE_HEADS"]

_RESHAPE_ERROR_HINTS = (
    ("is invalid for input of size", "the sizes in your view/reshape do not multiply to the tensor's size. Use the "
     "num_heads argument (never a fixed number) and D = E // num_heads."),
    ("view size is not compatible", "after a transpose or permute the memory is no longer contiguous, so .view() "
     "cannot flatten it: a view needs contiguous memory (reshape copies when it must)."),
)

# The course's own head bookkeeping, batch-first: calling it is not writing it.
_FORBIDDEN_SPLIT = ("attn_course.multihead.split_heads",)
_FORBIDDEN_MERGE = ("attn_course.multihead.merge_heads",)
# The whole layer, from PyTorch or from the course, by any route.
_FORBIDDEN_LAYER = (
    "torch.nn.MultiheadAttention",
    "torch.nn.functional.multi_head_attention_forward",
    "aten._native_multi_head_attention",
    "attn_course.multihead.MultiHeadAttention",
)


# Token "codes": x[l, b, e] = 10000 b + 100 l + e, so any entry of the learner's result says
# which batch element, token and feature it came from. Exact in float64 for our small sizes.


def _token_codes(L: int, B: int, E: int) -> torch.Tensor:
    l = torch.arange(L, dtype=torch.float64)[:, None, None]  # (L, 1, 1)
    b = torch.arange(B, dtype=torch.float64)[None, :, None]  # (1, B, 1)
    e = torch.arange(E, dtype=torch.float64)[None, None, :]  # (1, 1, E)
    return 10000 * b + 100 * l + e  # (L, B, E)


def _decode(code: float) -> str:
    code = int(round(code))
    return f"feature {code % 100} of token {code // 100 % 100} (batch {code // 10000})"


def _first_misplaced(got: torch.Tensor, expected: torch.Tensor, *, name: str) -> str | None:
    """'out[0, 1, 2, 0] holds feature 5 of token 0 (batch 0), expected feature 4 of token 2 (batch 0)'."""
    if tuple(got.shape) != tuple(expected.shape):
        return None
    wrong = (got.double() != expected).nonzero()
    if len(wrong) == 0:
        return None
    index = tuple(int(i) for i in wrong[0])
    value = got[index].item()
    where = f"{name}[{', '.join(str(i) for i in index)}]"
    if not torch.equal(got.double().flatten().sort().values, expected.flatten().sort().values):
        return (
            f"{where} is {value:g}: your result is not a rearrangement of the input's values. Splitting and "
            "merging heads only moves values around (view, transpose, permute, reshape), it never changes them."
        )
    return f"{where} holds {_decode(value)}, expected {_decode(expected[index].item())}."


# (L, B, E, H): L, B, H and D = E // H all different in the first three, so that no two axes can
# be swapped unnoticed; the last has B = 1.
_SIZES = [(5, 2, 12, 3), (3, 4, 10, 2), (6, 3, 8, 4), (4, 1, 6, 3)]


# --- 02.split_heads ------------------------------------------------------------------------
# The learner writes split_heads(x, num_heads): (L, B, E) -> (B, H, L, D), head h holding
# features h*D .. (h+1)*D - 1 of every token (the layout nn.MultiheadAttention uses).


def _split_cases() -> list[Case]:
    return [
        Case(f"split_heads(x of shape (L, B, E) = {(L, B, E)}, num_heads={H})", (_token_codes(L, B, E), H))
        for L, B, E, H in _SIZES
    ]


def _split_expected(x: torch.Tensor, H: int) -> torch.Tensor:
    return split_heads(x.transpose(0, 1), H)  # (B, H, L, D), through the batch-first library function


def _diagnose_split(got: torch.Tensor, x: torch.Tensor, H: int) -> str | None:
    L, B, E = x.shape
    D = E // H
    found = first_match(
        got,
        [
            (lambda: x.reshape(B, H, L, D),
             "you reshaped (L, B, E) straight to (B, H, L, D). reshape keeps the memory order, so a 'head' now holds "
             "pieces of several tokens and batch elements. First cut E into (H, D) with a view to (L, B, H, D), then "
             "move the axes with permute."),
            (lambda: x.transpose(0, 1).reshape(B, H, L, D),
             "you moved the batch axis first, then reshaped (B, L, E) straight to (B, H, L, D): that reshape mixes "
             "tokens. Cut E into (H, D) first, then move the head axis in front of the sequence axis."),
            (lambda: x.reshape(L, B, D, H).permute(1, 3, 0, 2),
             "your head h takes every H-th feature (h, h + H, ...); it must take the contiguous chunk h*D .. (h+1)*D - 1 "
             "(the layout nn.MultiheadAttention uses): view as (L, B, H, D), not (L, B, D, H)."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return _first_misplaced(got, _split_expected(x, H), name="out")


def _split_shape_hint(got: torch.Tensor, L: int, B: int, H: int, D: int) -> str:
    shape = tuple(got.shape)
    if shape == (L, H, B, D):
        return ("That is (L, H, B, D): you treated the first axis as the batch. The input is sequence-first, "
                "(L, B, E): axis 0 is the position, axis 1 the batch element.")
    if shape == (B, L, H, D):
        return ("That is (B, L, H, D): the head axis must come before the sequence axis, (B, H, L, D), so that "
                "attention runs over the positions of each head.")
    if shape == (H, B, L, D):
        return "That is (H, B, L, D): keep the batch axis first, (B, H, L, D)."
    if shape == (L, B, H, D):
        return "That is (L, B, H, D): E is cut into heads, now move the axes to (B, H, L, D) with permute."
    return "Split E = H * D into H heads of size D, then order the axes (B, H, L, D)."


def _judge_split(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns shape (B, H, L, D) from (L, B, E)"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            x, H = case.args
            L, B, E = x.shape
            expect_shape(got, (B, H, L, E // H), what=case.name, hint=_split_shape_hint(got, L, B, H, E // H))
    for title, indices in (("head h of token l in batch b holds features h*D .. (h+1)*D - 1 of x[l, b]", (0,)),
                           ("any number of heads, batch sizes and lengths", (1, 2, 3))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                x, H = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = _split_expected(x, H)
                expect_shape(got, expected.shape, what=case.name, hint=_split_shape_hint(got, *x.shape[:2], H, x.shape[2] // H))
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_split(got, x, H)}")
    return checklist.results


def _split_reference(x, num_heads):
    L, B, E = x.shape
    x = x.view(L, B, num_heads, E // num_heads)  # (L, B, H, D)
    return x.permute(1, 2, 0, 3)  # (B, H, L, D)


def _split_reshape_straight(x, num_heads):
    L, B, E = x.shape
    return x.reshape(B, num_heads, L, E // num_heads)  # the token-mixing bug


def _split_as_if_batch_first(x, num_heads):
    L, B, E = x.shape
    return x.view(L, B, num_heads, E // num_heads).transpose(1, 2)  # lesson 02's recipe on the wrong layout


def _split_heads_not_moved(x, num_heads):
    L, B, E = x.shape
    return x.view(L, B, num_heads, E // num_heads).transpose(0, 1)  # (B, L, H, D)


def _split_strided_heads(x, num_heads):
    L, B, E = x.shape
    return x.view(L, B, E // num_heads, num_heads).permute(1, 3, 0, 2)


def _split_heads_first(x, num_heads):
    L, B, E = x.shape
    return x.view(L, B, num_heads, E // num_heads).permute(2, 1, 0, 3)  # (H, B, L, D)


def _split_batch_first_then_reshape(x, num_heads):
    L, B, E = x.shape
    return x.transpose(0, 1).reshape(B, num_heads, L, E // num_heads)


def _split_fixed_heads(x, num_heads):
    L, B, E = x.shape
    return x.view(L, B, 3, E // 3).permute(1, 2, 0, 3)  # ignores num_heads


def _split_with_the_library(x, num_heads):
    import attn_course as ac

    return ac.split_heads(x.transpose(0, 1), num_heads)  # right values, the library's work


SPLIT_HEADS = Task(
    id="02.split_heads",
    title="Split heads: (L, B, E) -> (B, H, L, D)",
    function_name="split_heads",
    make_cases=_split_cases,
    judge=_judge_split,
    reference=_split_reference,
    wrong={
        "reshape straight to (B, H, L, D) (mixes tokens)": Wrong(_split_reshape_straight, "reshaped (L, B, E) straight to"),
        "lesson 02's batch-first recipe on (L, B, E)": Wrong(_split_as_if_batch_first, "treated the first axis as the batch"),
        "heads not moved: returns (B, L, H, D)": Wrong(_split_heads_not_moved, "before the sequence axis"),
        "head h takes every H-th feature": Wrong(_split_strided_heads, "every H-th feature"),
        "heads before the batch axis (H, B, L, D)": Wrong(_split_heads_first, "keep the batch axis first"),
        "batch moved first, then reshaped straight": Wrong(_split_batch_first_then_reshape, "moved the batch axis first"),
        "hard-coded number of heads": Wrong(_split_fixed_heads, "num_heads argument"),
        "calls attn_course.split_heads": Wrong(_split_with_the_library, "you called attn_course.split_heads", kind="algorithm"),
    },
    forbidden=_FORBIDDEN_SPLIT,
)


# --- 02.merge_heads ------------------------------------------------------------------------
# The learner writes merge_heads(x): (B, H, L, D) -> (L, B, E), the inverse of split_heads.


def _merge_cases() -> list[Case]:
    cases = []
    for L, B, E, H in _SIZES:
        x = _split_expected(_token_codes(L, B, E), H).contiguous()  # (B, H, L, D), as attention returns it
        cases.append(Case(f"merge_heads(x of shape (B, H, L, D) = {tuple(x.shape)})", (x,)))
    return cases


def _merge_expected(x: torch.Tensor) -> torch.Tensor:
    return merge_heads(x).transpose(0, 1)  # (L, B, E), through the batch-first library function


def _diagnose_merge(got: torch.Tensor, x: torch.Tensor) -> str | None:
    B, H, L, D = x.shape
    found = first_match(
        got,
        [
            (lambda: x.reshape(L, B, H * D),
             "you reshaped (B, H, L, D) straight to (L, B, E) without moving any axis: each output row now mixes "
             "features of different tokens, heads and batch elements. The axes must be moved into (L, B, H, D) "
             "order before H and D are joined."),
            (lambda: x.transpose(1, 2).reshape(B, L, H * D).reshape(L, B, H * D),
             "you merged to the batch-first (B, L, E), then reshaped that to (L, B, E). reshape never swaps axes: it "
             "re-reads the same memory, so batch elements and positions get mixed: only moving axes swaps them."),
            (lambda: x.permute(2, 0, 3, 1).reshape(L, B, H * D),
             "the features of head h must sit together at h*D .. (h+1)*D - 1; yours are interleaved (you flattened "
             "(D, H) instead of (H, D)): head must be the slower-varying of the two axes you join."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return _first_misplaced(got, _merge_expected(x), name="out")


def _merge_shape_hint(got: torch.Tensor, B: int, H: int, L: int, D: int) -> str:
    shape = tuple(got.shape)
    if shape == (B, L, H * D):
        return ("That is (B, L, E), the batch-first layout of lesson 02; this exercise works in PyTorch's default "
                "sequence-first layout, (L, B, E).")
    if shape == (L, B, H, D):
        return "That is (L, B, H, D), the heads not yet joined: the output has one axis of E = H * D features."
    if shape in ((L, B, D), (B, L, D), (B, H, D)):
        return "Merging concatenates the heads' features (E = H * D); summing or averaging over heads loses them."
    return "Move the axes to (L, B, H, D) with permute, then flatten H and D into E = H * D."


def _judge_merge(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns shape (L, B, E) with E = H * D"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            (x,) = case.args
            B, H, L, D = x.shape
            expect_shape(got, (L, B, H * D), what=case.name, hint=_merge_shape_hint(got, B, H, L, D))
    for title, indices in (("row (l, b) holds head 0's features of token l in batch b, then head 1's, ...", (0,)),
                           ("any number of heads, batch sizes and lengths", (1, 2, 3))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                (x,) = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = _merge_expected(x)
                expect_shape(got, expected.shape, what=case.name, hint=_merge_shape_hint(got, *x.shape))
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_merge(got, x)}")
    return checklist.results


def _merge_reference(x):
    B, H, L, D = x.shape
    return x.permute(2, 0, 1, 3).reshape(L, B, H * D)  # (L, B, H, D) -> (L, B, E), copies


def _merge_reshape_straight(x):
    B, H, L, D = x.shape
    return x.reshape(L, B, H * D)


def _merge_batch_first(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B, L, H * D)  # lesson 02's merge: the wrong layout for this task


def _merge_batch_first_then_reshape(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).reshape(B, L, H * D).reshape(L, B, H * D)


def _merge_view_after_permute(x):
    B, H, L, D = x.shape
    return x.permute(2, 0, 1, 3).view(L, B, H * D)


def _merge_interleaved(x):
    B, H, L, D = x.shape
    return x.permute(2, 0, 3, 1).reshape(L, B, H * D)


def _merge_not_flattened(x):
    return x.permute(2, 0, 1, 3)  # (L, B, H, D)


def _merge_sum_heads(x):
    return x.sum(dim=1).transpose(0, 1)  # (L, B, D)


def _merge_with_the_library(x):
    import attn_course as ac

    return ac.merge_heads(x).transpose(0, 1)


MERGE_HEADS = Task(
    id="02.merge_heads",
    title="Merge heads: (B, H, L, D) -> (L, B, E)",
    function_name="merge_heads",
    make_cases=_merge_cases,
    judge=_judge_merge,
    reference=_merge_reference,
    wrong={
        "reshape straight to (L, B, E) (mixes tokens)": Wrong(_merge_reshape_straight, "straight to (L, B, E)"),
        "returns the batch-first (B, L, E)": Wrong(_merge_batch_first, "sequence-first layout, (L, B, E)"),
        "batch-first merge reshaped to (L, B, E)": Wrong(_merge_batch_first_then_reshape, "reshape never swaps axes"),
        ".view() after .permute()": Wrong(_merge_view_after_permute, "a view needs contiguous memory"),
        "heads interleaved (flattens (D, H))": Wrong(_merge_interleaved, "interleaved"),
        "returns (L, B, H, D) without flattening": Wrong(_merge_not_flattened, "the heads not yet joined"),
        "sums over heads instead of concatenating": Wrong(_merge_sum_heads, "concatenates"),
        "calls attn_course.merge_heads": Wrong(_merge_with_the_library, "you called attn_course.merge_heads", kind="algorithm"),
    },
    forbidden=_FORBIDDEN_MERGE,
)


# --- 02.mha_forward ------------------------------------------------------------------------
# The learner writes the forward pass of multi-head self-attention from the weights of an
# nn.MultiheadAttention, in its default sequence-first layout: mha_forward(x, in_proj_weight,
# in_proj_bias, out_proj_weight, out_proj_bias, num_heads), x (L, B, E) -> (L, B, E).
# in_proj_weight is [W_q; W_k; W_v], shape (3E, E).

# (L, B, E, H): several heads and a batch of 2 or more in all but the last, which has one head
# (a learner right there but wrong elsewhere has the head bookkeeping to fix).
_MHA_SIZES = [(5, 2, 12, 3), (4, 3, 8, 2), (6, 2, 16, 4), (3, 2, 6, 1)]


def _mha_cases() -> list[Case]:
    randn = seeded_randn(202)
    cases = []
    for L, B, E, H in _MHA_SIZES:
        x = randn(L, B, E)
        in_w, in_b = randn(3 * E, E) / math.sqrt(E), 0.5 * randn(3 * E)
        out_w, out_b = randn(E, E) / math.sqrt(E), 0.5 * randn(E)
        cases.append(Case(f"x (L={L}, B={B}, E={E}), num_heads={H}", (x, in_w, in_b, out_w, out_b, H)))
    return cases


def _mha_expected(x, in_w, in_b, out_w, out_b, H):
    """What nn.MultiheadAttention(E, H) (sequence-first) with these weights returns."""
    E = x.shape[-1]
    module = nn.MultiheadAttention(E, H, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": in_w, "in_proj_bias": in_b, "out_proj.weight": out_w, "out_proj.bias": out_b})
    with torch.no_grad():
        return module.eval()(x, x, x, need_weights=False)[0]  # (L, B, E)


def _split_straight(x, H):
    B, L, E = x.shape
    return x.reshape(B, H, L, E // H)  # (B, H, L, D), tokens mixed


def _merge_straight(x):
    B, H, L, D = x.shape
    return x.reshape(B, L, H * D)  # (B, L, E), tokens mixed


def _mha_variant(
    x, in_w, in_b, out_w, out_b, H, *,
    scale=None, in_bias=True, out_bias=True, out_proj=True, transposed_weights=False,
    split=split_heads, merge=merge_heads, softmax_dim=-1, sequence_first=True,
):
    """The forward pass with one classic mistake switched on (library pieces only)."""
    E = x.shape[-1]

    def linear(inputs, weight, bias):
        return F.linear(inputs, weight.T if transposed_weights else weight, bias)

    xb = x.transpose(0, 1) if sequence_first else x  # (B, L, E); the bug reads (L, B, E) as (B, L, E)
    w_q, w_k, w_v = in_w.split(E, dim=0)  # 3 x (E, E)
    b_q, b_k, b_v = in_b.split(E) if in_bias else (None, None, None)
    q = split(linear(xb, w_q, b_q), H)  # (B, H, L, D)
    k = split(linear(xb, w_k, b_k), H)  # (B, H, L, D)
    v = split(linear(xb, w_v, b_v), H)  # (B, H, L, D)
    scale = 1.0 / math.sqrt(E // H) if scale is None else scale
    if softmax_dim == -1:
        context = scaled_dot_product_attention(q, k, v, scale=scale)  # (B, H, L, D)
    else:
        context = softmax_over_queries(q, k, v, scale=scale)  # (B, H, L, D)
    merged = merge(context)  # (B, L, E)
    out = linear(merged, out_w, out_b if out_bias else None) if out_proj else merged  # (B, L, E)
    return out.transpose(0, 1) if sequence_first else out  # (L, B, E)


def _mha_reshaped_sequence_first(x, in_w, in_b, out_w, out_b, H, *, split_straight=True, merge_straight=True):
    """The forward pass on (L, B, E) with the heads split and/or merged by one plain reshape (the token-mixing bug)."""
    L, B, E = x.shape
    D = E // H

    def split(t):  # (L, B, E) -> (B, H, L, D)
        return t.reshape(B, H, L, D) if split_straight else t.reshape(L, B, H, D).permute(1, 2, 0, 3)

    q, k, v = (split(t) for t in F.linear(x, in_w, in_b).chunk(3, dim=-1))  # (B, H, L, D) each
    context = scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    merged = context.reshape(L, B, E) if merge_straight else context.permute(2, 0, 1, 3).reshape(L, B, E)  # (L, B, E)
    return F.linear(merged, out_w, out_b)  # (L, B, E)


_RESHAPE_LESSON = (
    "reshape keeps the memory order, so it mixes tokens, batch elements and heads (even with one head: B and L trade "
    "places). Cut E into (H, D) with a view to (L, B, H, D) and permute to (B, H, L, D); to merge, permute back to "
    "(L, B, H, D) before flattening. Your split_heads and merge_heads from tasks 1 and 2 do exactly this."
)


def _diagnose_mha(got, args) -> str | None:
    x, E, H = args[0], args[0].shape[-1], args[-1]
    D = E // H

    def variant(**changes):
        return lambda: _mha_variant(*args, **changes)

    def reshaped(**changes):
        return lambda: _mha_reshaped_sequence_first(*args, **changes)

    return first_match(
        got,
        [
            (reshaped(),
             "you split (L, B, E) into (B, H, L, D) and merged (B, H, L, D) back into (L, B, E) with plain reshapes: "
             + _RESHAPE_LESSON),
            (reshaped(merge_straight=False),
             "you split (L, B, E) into (B, H, L, D) with one plain reshape: " + _RESHAPE_LESSON),
            (reshaped(split_straight=False),
             "you merged (B, H, L, D) back into (L, B, E) with one plain reshape: " + _RESHAPE_LESSON),
            (variant(sequence_first=False),
             "your output is what attention over the *batch* axis gives: you read x as (B, L, E). "
             "nn.MultiheadAttention's default layout is sequence-first, (L, B, E): axis 0 is the position."),
            (variant(out_proj=False),
             "your result is the merged heads before the output projection: finish with "
             "merged @ out_proj_weight.T + out_proj_bias."),
            (variant(in_bias=False, out_bias=False), "you dropped the biases: nn.Linear adds its bias, here in_proj_bias "
             "(split like the weight into b_q, b_k, b_v) and out_proj_bias."),
            (variant(in_bias=False), "you dropped in_proj_bias: split it into b_q, b_k, b_v like the weight."),
            (variant(out_bias=False), "you dropped out_proj_bias in the output projection."),
            (variant(transposed_weights=True),
             "you multiplied by the weights untransposed. nn.Linear stores a weight as (out_features, in_features) "
             "and computes x @ W.T + b (that is F.linear(x, W, b))."),
            (variant(scale=1.0),
             f"you did not scale the scores: multiply by 1/sqrt(head_dim) = 1/sqrt({D})."),
            (variant(scale=1.0 / math.sqrt(E)),
             f"you scaled by 1/sqrt(E) = 1/sqrt({E}); each head's dot product has head_dim = E // H = {D} terms, "
             f"so scale by 1/sqrt(head_dim) = 1/sqrt({D})."),
            (variant(softmax_dim=-2),
             "your weights sum to 1 over the queries (dim=-2): softmax over dim=-1, the keys."),
            (variant(split=_split_straight),
             "you split the heads by reshaping straight to (B, H, L, D), which mixes tokens: cut E into (H, D) "
             "first, then move the head axis in front of the sequence axis."),
            (variant(merge=_merge_straight),
             "you merge the heads by reshaping (B, H, L, D) straight to (B, L, E), which mixes tokens: "
             "move the head axis back next to D first, then reshape."),
            (variant(split=_split_straight, merge=_merge_straight),
             "you split and merge the heads by plain reshapes, without moving the head axis: tokens get mixed."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_mha(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (L, B, E) in the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            x = case.args[0]
            expect_shape(got, x.shape, what=case.name, hint="Self-attention returns one E-vector per token.")
            expect_dtype(got, x.dtype, what=case.name)
    single_head = [i for i, case in enumerate(cases) if case.args[-1] == 1]
    multi_head = [i for i, case in enumerate(cases) if case.args[-1] > 1]

    def right(index):
        outcome, case = outcomes[index], cases[index]
        got = outcome.returned
        if outcome.error is not None or not isinstance(got, torch.Tensor) or got.shape != case.args[0].shape:
            return False
        return bool(torch.allclose(got.detach().double(), _mha_expected(*case.args), atol=1e-9, rtol=1e-7))

    single_head_right = bool(single_head) and all(right(i) for i in single_head)
    sections = (
        ("several heads, batches of 2 or more: equal to nn.MultiheadAttention", multi_head),
        ("one head: projections, scale, softmax, output projection", single_head),
    )
    for title, indices in sections:
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = _mha_expected(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                hint = _diagnose_mha(got, case.args) or ""
                if not hint and single_head_right and index in multi_head:
                    hint = ("With one head you are right, so projections and softmax are fine: look at how you split "
                            "and merge the heads, and at the scale (1/sqrt(head_dim)).")
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("leaves x and the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _mha_reference(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads):
    # Written out: the task forbids calling the layer itself.
    L, B, E = x.shape
    D = E // num_heads
    q, k, v = F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1)  # 3 x (L, B, E)
    q, k, v = (t.reshape(L, B, num_heads, D).permute(1, 2, 0, 3) for t in (q, k, v))  # (B, H, L, D)
    context = scaled_dot_product_attention(q, k, v)  # (B, H, L, D)
    merged = context.permute(2, 0, 1, 3).reshape(L, B, E)  # (L, B, E)
    return F.linear(merged, out_proj_weight, out_proj_bias)  # (L, B, E)


def _mha_as_if_batch_first(*args):
    return _mha_variant(*args, sequence_first=False)


def _mha_no_out_proj(*args):
    return _mha_variant(*args, out_proj=False)


def _mha_merge_without_transpose(*args):
    return _mha_variant(*args, merge=_merge_straight)


def _mha_split_without_transpose(*args):
    return _mha_variant(*args, split=_split_straight)


def _mha_plain_reshapes(*args):
    return _mha_reshaped_sequence_first(*args)  # (L, B, E) -> (B, H, L, D) and back, by plain reshapes


def _mha_scale_by_d_model(*args):
    return _mha_variant(*args, scale=1.0 / math.sqrt(args[0].shape[-1]))


def _mha_no_biases(*args):
    return _mha_variant(*args, in_bias=False, out_bias=False)


def _mha_untransposed_weights(x, in_w, in_b, out_w, out_b, H):
    E = x.shape[-1]
    xb = x.transpose(0, 1)  # (B, L, E)
    w_q, w_k, w_v = in_w.split(E)  # 3 x (E, E)
    b_q, b_k, b_v = in_b.split(E)  # 3 x (E,)
    q, k, v = (split_heads(xb @ w + b, H) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))  # (B, H, L, D)
    return (merge_heads(scaled_dot_product_attention(q, k, v)) @ out_w + out_b).transpose(0, 1)  # (L, B, E)


def _mha_softmax_wrong_axis(*args):
    return _mha_variant(*args, softmax_dim=-2)


def _mha_scales_weights_in_place(x, in_w, in_b, out_w, out_b, H):
    E = x.shape[-1]
    scale = 1.0 / math.sqrt(E // H)
    in_w[:E] *= scale  # folds the scale into W_q and b_q ... of the caller's tensors
    in_b[:E] *= scale
    return _mha_variant(x, in_w, in_b, out_w, out_b, H, scale=1.0)


def _mha_torch_module(x, in_w, in_b, out_w, out_b, H):
    module = nn.MultiheadAttention(x.shape[-1], H, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": in_w, "in_proj_bias": in_b, "out_proj.weight": out_w, "out_proj.bias": out_b})
    return module(x, x, x, need_weights=False)[0]


def _mha_course_module(x, in_w, in_b, out_w, out_b, H):
    import attn_course as ac

    module = nn.MultiheadAttention(x.shape[-1], H, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": in_w, "in_proj_bias": in_b, "out_proj.weight": out_w, "out_proj.bias": out_b})
    return ac.MultiHeadAttention.from_torch(module)(x.transpose(0, 1)).transpose(0, 1)


MHA_FORWARD = Task(
    id="02.mha_forward",
    title="Multi-head attention forward pass (sequence-first)",
    function_name="mha_forward",
    make_cases=_mha_cases,
    judge=_judge_mha,
    reference=_mha_reference,
    wrong={
        "reads (L, B, E) as batch-first": Wrong(_mha_as_if_batch_first, "you read x as (B, L, E)"),
        "no output projection": Wrong(_mha_no_out_proj, "before the output projection"),
        "heads merged without the transpose": Wrong(_mha_merge_without_transpose, "merge the heads by reshaping"),
        "heads split without the transpose": Wrong(_mha_split_without_transpose, "split the heads by reshaping"),
        "(L, B, E) split and merged by plain reshapes": Wrong(_mha_plain_reshapes, "with plain reshapes"),
        "scale 1/sqrt(d_model) instead of 1/sqrt(head_dim)": Wrong(_mha_scale_by_d_model, "1/sqrt(head_dim)"),
        "biases dropped": Wrong(_mha_no_biases, "dropped the biases"),
        "x @ W instead of x @ W.T": Wrong(_mha_untransposed_weights, "x @ W.T + b"),
        "softmax over dim=-2": Wrong(_mha_softmax_wrong_axis, "softmax over dim=-1"),
        "folds the scale into the weights in place": Wrong(_mha_scales_weights_in_place, "in place", kind="contract"),
        "calls nn.MultiheadAttention": Wrong(_mha_torch_module, "you called torch.nn.MultiheadAttention", kind="algorithm"),
        "calls attn_course.MultiHeadAttention": Wrong(
            _mha_course_module, "you called attn_course.MultiHeadAttention", kind="algorithm"
        ),
    },
    forbidden=_FORBIDDEN_LAYER,
)


# --- 02.prune_heads (stretch) --------------------------------------------------------------
# Lesson 02 shows that a multi-head layer's output is a sum over heads, each head's output times
# its own block of W^O's columns. So a layer without some heads is the same layer with fewer rows
# of W_q, W_k, W_v (and of their biases) and fewer columns of W^O. The learner writes
# prune_heads(in_proj_weight, in_proj_bias, out_proj_weight, num_heads, keep) -> the weights of
# the pruned layer (K = len(keep) heads, each still of size D = E // num_heads):
# in_proj_weight (3 K D, E) = [W_q'; W_k'; W_v'], in_proj_bias (3 K D,), out_proj_weight (E, K D).
# out_proj_bias is unchanged. The grader runs both layers and compares: the pruned layer must give
# what the full layer gives when the other heads' outputs are set to zero.

# (E, H, keep): heads kept in the order given (the order is free, but must be the same in W_in and W^O).
_PRUNE_SETTINGS = [(12, 3, [0, 2]), (16, 4, [3, 1]), (8, 2, [0, 1]), (12, 4, [2, 0, 3]), (12, 4, [1])]


def _prune_cases() -> list[Case]:
    randn = seeded_randn(205)
    cases = []
    for E, H, keep in _PRUNE_SETTINGS:
        in_w, in_b, out_w = randn(3 * E, E) / math.sqrt(E), 0.5 * randn(3 * E), randn(E, E) / math.sqrt(E)
        cases.append(Case(f"E={E}, num_heads={H}, keep={keep}", (in_w, in_b, out_w, H, list(keep))))
    return cases


def _probe_input(E: int) -> torch.Tensor:
    return seeded_randn(206)(2, 5, E)  # (B, L, E): the grader's own input, batch-first (internal)


def _forward_with_heads(x, in_w, in_b, out_w, out_b, D, *, silenced=()):
    """Batch-first multi-head self-attention with heads of size D; the heads in ``silenced`` output zero."""
    H = in_w.shape[0] // (3 * D)
    q, k, v = (split_heads(t, H) for t in F.linear(x, in_w, in_b).chunk(3, dim=-1))  # (B, H, L, D) each
    context = scaled_dot_product_attention(q, k, v).clone()  # (B, H, L, D)
    for h in silenced:
        context[:, h] = 0.0
    return F.linear(merge_heads(context), out_w, out_b)  # (B, L, E)


def _prune_expected_output(in_w, in_b, out_w, H, keep):
    E = in_w.shape[1]
    x, out_b = _probe_input(E), torch.zeros(E, dtype=in_w.dtype)
    dropped = [h for h in range(H) if h not in keep]
    return _forward_with_heads(x, in_w, in_b, out_w, out_b, E // H, silenced=dropped)  # (B, L, E)


def _head_rows(H: int, D: int, heads, *, strided: bool = False) -> torch.Tensor:
    """Row indices, inside one (E, E) projection, of the given heads (head h: rows h*D .. (h+1)*D - 1)."""
    if strided:  # the bug: head h taken as rows h, h + H, h + 2H, ...
        return torch.cat([torch.arange(h, H * D, H) for h in heads])
    return torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads])


def _prune_variant(
    in_w, in_b, out_w, H, keep, *,
    strided=False, out_order=None, out_rows=False, out_rows_transposed=False, keep_all_values=False, offsets=True,
):
    """The pruned weights with one classic mistake switched on."""
    E = in_w.shape[1]
    D = E // H
    rows = _head_rows(H, D, keep, strided=strided)
    blocks = []
    for part in range(3):  # q, k, v
        if part == 2 and keep_all_values:
            blocks.append(torch.arange(2 * E, 3 * E))
        else:
            blocks.append(part * E + rows if offsets else rows)  # without the offsets: W_q's rows three times
    index = torch.cat(blocks)
    columns = _head_rows(H, D, keep if out_order is None else out_order, strided=strided)
    if out_rows:
        new_out = out_w[columns]  # (K*D, E)
    elif out_rows_transposed:
        new_out = out_w[columns].T  # (E, K*D): the right shape, from W^O's rows
    else:
        new_out = out_w[:, columns]  # (E, K*D)
    return in_w[index], in_b[index], new_out


def _prune_returned(outcome, case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The learner's three tensors, or Fail with a clear message."""
    value = outcome.returned
    if outcome.not_implemented or outcome.error is not None:
        returned(outcome, what=case.name)  # raises the right Fail
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(isinstance(t, torch.Tensor) for t in value):
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (tuple, list)) else type(value).__name__
        raise Fail(f"{case.name}: return a tuple of three tensors (in_proj_weight, in_proj_bias, out_proj_weight), "
                   f"got a {got}.")
    return tuple(value)


def _diagnose_prune(got, in_w, in_b, out_w, H, keep) -> str | None:
    def matches(variant):
        try:
            expected = variant()
        except Exception:
            return False
        return all(g.shape == e.shape and torch.allclose(g.double(), e.double()) for g, e in zip(got, expected))

    dropped = [h for h in range(H) if h not in keep]
    checks = [
        (lambda: _prune_variant(in_w, in_b, out_w, H, keep, strided=True),
         "you took head h as every H-th row (h, h + H, ...). In nn.MultiheadAttention head h is the contiguous "
         "block of rows h*D .. (h+1)*D - 1 of each of W_q, W_k, W_v, and the same block of W^O's columns."),
        (lambda: _prune_variant(in_w, in_b, out_w, H, sorted(keep), out_order=keep),
         "your W_in takes the kept heads in sorted order but your W^O in the order of keep: head i of the pruned "
         "W_in must meet head i of the pruned W^O. Use one order for both."),
        (lambda: _prune_variant(in_w, in_b, out_w, H, keep, out_order=sorted(keep)),
         "your W_in takes the kept heads in the order of keep but your W^O in sorted order: head i of the pruned "
         "W_in must meet head i of the pruned W^O. Use one order for both."),
        (lambda: _prune_variant(in_w, in_b, out_w, H, keep, offsets=False),
         "your in_proj_weight repeats the same rows three times: the kept heads' rows of W_q. in_proj_weight stacks "
         "[W_q; W_k; W_v], each (E, E), so the same heads' rows of W_k start at row E and those of W_v at row 2E: "
         "each block (and in_proj_bias alike) must be pruned at its own offset."),
        (lambda: _prune_variant(in_w, in_b, out_w, H, keep, out_rows_transposed=True),
         "your out_proj_weight holds the kept heads' rows of W^O, transposed to fit the shape. W^O (out_proj.weight, "
         "(E, E), used as x @ W^O.T) reads head h through its columns h*D .. (h+1)*D - 1: it is those columns that "
         "must be pruned, not rows."),
        (lambda: _prune_variant(in_w, in_b, out_w, H, dropped),
         f"you returned the heads that should go ({dropped}) and removed the ones in keep ({keep})."),
    ]
    first = list(range(len(keep)))
    if first != keep:  # where keep is 0 .. K-1 the first K heads are the right answer
        checks.append((lambda: _prune_variant(in_w, in_b, out_w, H, first),
                       f"you kept heads {first}, the first {len(keep)}, whatever keep says: keep the heads listed in "
                       f"keep ({keep}), in that order."))
    for variant, message in checks:
        if dropped or "should go" not in message:
            if matches(variant):
                return message[:1].upper() + message[1:]
    return None


def _prune_shape_hint(got, E, K, D) -> str:
    in_w, in_b, out_w = got
    H = E // D
    if K != H - K and tuple(in_w.shape) == (3 * (H - K) * D, E):
        return f"You returned {H - K} heads: the heads that should go. Keep the {K} heads listed in keep."
    if tuple(out_w.shape) == (K * D, E):
        return ("Your out_proj_weight is (K*D, E): W^O maps the merged heads (in_features = K*D) to E outputs, so "
                "prune its columns, not its rows: shape (E, K*D).")
    if tuple(in_w.shape) == (2 * K * D + E, E):
        return "You pruned W_q and W_k but kept every head of W_v: the values of a removed head go too."
    if tuple(in_b.shape) == (3 * E,):
        return "in_proj_bias holds [b_q; b_k; b_v] for every head: prune it like the weight's rows."
    return ""


def _judge_prune(cases, outcomes):
    checklist = Checklist()
    answered_cases = []
    with checklist.check("returns (in_proj_weight (3*K*D, E), in_proj_bias (3*K*D,), out_proj_weight (E, K*D))"):
        for case, outcome in zip(cases, outcomes):  # a case that raised fails this check (a failed case)
            in_w, in_b, out_w, H, keep = case.args
            E, K = in_w.shape[1], len(keep)
            D = E // H
            got = _prune_returned(outcome, case)
            shapes = [tuple(t.shape) for t in got]
            wanted = [(3 * K * D, E), (3 * K * D,), (E, K * D)]
            if shapes != wanted:
                raise Fail(f"{case.name}: you returned shapes {shapes}, expected {wanted}. "
                           + _prune_shape_hint(got, E, K, D))
            answered_cases.append(case)
    sections = (
        ("the pruned layer computes the full layer with the other heads silenced", (0, 1)),
        ("keeping every head gives the same layer; three of four, or one head, work too", (2, 3, 4)),
    )
    for title, indices in sections:
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                in_w, in_b, out_w, H, keep = case.args
                E, K = in_w.shape[1], len(keep)
                D = E // H
                got = _prune_returned(outcome, case)
                if [tuple(t.shape) for t in got] != [(3 * K * D, E), (3 * K * D,), (E, K * D)]:
                    raise Fail(f"{case.name}: wrong shapes (see the first check). " + _prune_shape_hint(got, E, K, D))
                expected = _prune_expected_output(in_w, in_b, out_w, H, keep)
                x = _probe_input(E)
                pruned = _forward_with_heads(x, *(t.detach().double() for t in got[:2]), got[2].detach().double(),
                                             torch.zeros(E, dtype=torch.float64), D)
                hint = _diagnose_prune(got, in_w, in_b, out_w, H, keep) or ""
                expect_close(pruned, expected, what=f"{case.name}: the pruned layer's output", atol=1e-9, rtol=1e-7,
                             hint=hint)
    with checklist.check("leaves the original weights unchanged"):
        for case, outcome in zip(cases, outcomes):  # a case that raised fails this check too
            _prune_returned(outcome, case)  # something that is not three tensors earns nothing here either
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _prune_reference(in_proj_weight, in_proj_bias, out_proj_weight, num_heads, keep):
    E = in_proj_weight.shape[1]
    D = E // num_heads
    rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in keep])  # the kept heads' rows in one (E, E) block
    index = torch.cat([rows, E + rows, 2 * E + rows])  # the same rows of W_q, W_k and W_v
    return in_proj_weight[index], in_proj_bias[index], out_proj_weight[:, rows]


def _prune_strided(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, strided=True)


def _prune_out_rows(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, out_rows=True)


def _prune_out_sorted(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, out_order=sorted(keep))


def _prune_complement(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, [h for h in range(H) if h not in keep])


def _prune_no_offsets(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, offsets=False)


def _prune_out_rows_transposed(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, out_rows_transposed=True)


def _prune_all_values(in_w, in_b, out_w, H, keep):
    return _prune_variant(in_w, in_b, out_w, H, keep, keep_all_values=True)


def _prune_bias_untouched(in_w, in_b, out_w, H, keep):
    new_w, _, new_out = _prune_variant(in_w, in_b, out_w, H, keep)
    return new_w, in_b, new_out


def _prune_first_rows(in_w, in_b, out_w, H, keep):
    """Keeps the right number of rows, but always the first ones (heads 0 .. K-1)."""
    return _prune_variant(in_w, in_b, out_w, H, list(range(len(keep))))


def _prune_zeroes_in_place(in_w, in_b, out_w, H, keep):
    E = in_w.shape[1]
    D = E // H
    for h in range(H):  # "silence" the dropped heads in the caller's weights first...
        if h not in keep:
            out_w[:, h * D:(h + 1) * D] = 0.0
    return _prune_variant(in_w, in_b, out_w, H, keep)  # ... right values, but the full layer is changed too


PRUNE_HEADS = Task(
    id="02.prune_heads",
    title="Prune heads from a multi-head layer",
    function_name="prune_heads",
    make_cases=_prune_cases,
    judge=_judge_prune,
    reference=_prune_reference,
    stretch=True,
    wrong={
        "heads taken as strided rows": Wrong(_prune_strided, "every H-th row"),
        "W^O's rows pruned instead of its columns": Wrong(_prune_out_rows, "prune its columns"),
        "W^O's rows, transposed to the right shape": Wrong(_prune_out_rows_transposed, "transposed to fit the shape"),
        "W_q's rows three times (no E and 2E offsets)": Wrong(_prune_no_offsets, "repeats the same rows three times"),
        "W^O in sorted order, W_in in keep's order": Wrong(_prune_out_sorted, "Use one order for both"),
        "keeps the dropped heads": Wrong(_prune_complement, "the heads that should go"),
        "every value head kept": Wrong(_prune_all_values, "every head of W_v"),
        "in_proj_bias not pruned": Wrong(_prune_bias_untouched, "prune it like the weight's rows"),
        "always the first K heads": Wrong(_prune_first_rows, "whatever keep says"),
        "zeroes the dropped heads in the caller's W^O": Wrong(_prune_zeroes_in_place, "in place", kind="contract"),
    },
)
