"""Graded tasks for lesson 02 (multi-head attention): split heads, merge heads, the forward pass."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention
from ...multihead import MultiHeadAttention, merge_heads, split_heads
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned, softmax_over_queries

__all__ = ["SPLIT_HEADS", "MERGE_HEADS", "MHA_FORWARD"]

_RESHAPE_ERROR_HINTS = (
    ("is invalid for input of size", "the sizes in your view/reshape do not multiply to the tensor's size. Use the "
     "num_heads argument (never a fixed number) and D = E // num_heads."),
    ("view size is not compatible", "after a transpose the memory is no longer contiguous, so .view() cannot "
     "flatten it: use .reshape() (copies when needed) or .contiguous().view()."),
)


# Token "codes": x[b, l, e] = 10000 b + 100 l + e, so any entry of the learner's result says
# which batch element, token and feature it came from. Exact in float64 for our small sizes.


def _token_codes(B: int, L: int, E: int) -> torch.Tensor:
    b = torch.arange(B, dtype=torch.float64)[:, None, None]  # (B, 1, 1)
    l = torch.arange(L, dtype=torch.float64)[None, :, None]  # (1, L, 1)
    e = torch.arange(E, dtype=torch.float64)[None, None, :]  # (1, 1, E)
    return 10000 * b + 100 * l + e  # (B, L, E)


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
            "merging heads only moves values around (view, transpose, reshape), it never changes them."
        )
    return f"{where} holds {_decode(value)}, expected {_decode(expected[index].item())}."


# (B, L, E, H): L != H everywhere, so (B, L, H, D) and (B, H, L, D) never coincide.
_SIZES = [(2, 5, 12, 3), (1, 3, 8, 4), (3, 6, 6, 2)]


# --- 02.split_heads ------------------------------------------------------------------------
# The learner writes split_heads(x, num_heads): (B, L, E) -> (B, H, L, D), head h holding
# features h*D .. (h+1)*D - 1 of every token (the layout nn.MultiheadAttention uses).


def _split_cases() -> list[Case]:
    return [Case(f"split_heads(x of shape {(B, L, E)}, num_heads={H})", (_token_codes(B, L, E), H)) for B, L, E, H in _SIZES]


def _diagnose_split(got: torch.Tensor, x: torch.Tensor, H: int) -> str | None:
    B, L, E = x.shape
    D = E // H
    found = first_match(
        got,
        [
            (lambda: x.reshape(B, H, L, D),
             "you reshaped (B, L, E) straight to (B, H, L, D). reshape keeps the memory order, so a 'head' now holds "
             "pieces of several different tokens. View as (B, L, H, D) first, then swap axes: .transpose(1, 2)."),
            (lambda: x.reshape(B, L, D, H).permute(0, 3, 1, 2),
             "your head h takes every H-th feature (h, h + H, ...); it must take the contiguous chunk h*D .. (h+1)*D - 1 "
             "(the layout nn.MultiheadAttention uses): view as (B, L, H, D), not (B, L, D, H)."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return _first_misplaced(got, split_heads(x, H), name="out")


def _split_shape_hint(got: torch.Tensor, B: int, L: int, H: int, D: int) -> str:
    shape = tuple(got.shape)
    if shape == (B, L, H, D):
        return ("That is (B, L, H, D): you did not move the head axis forward. Attention runs over the sequence axis "
                "per head, so heads go before it: .transpose(1, 2).")
    if shape == (H, B, L, D):
        return "That is (H, B, L, D): keep the batch axis first, (B, H, L, D)."
    return "Split E = H * D into H heads of size D and put the heads before the sequence axis."


def _judge_split(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns shape (B, H, L, D)"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            x, H = case.args
            B, L, E = x.shape
            expect_shape(got, (B, H, L, E // H), what=case.name, hint=_split_shape_hint(got, B, L, H, E // H))
    for title, indices in (("head h of token l holds features h*D .. (h+1)*D - 1 of token l", (0,)),
                           ("any number of heads and sizes", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                x, H = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = split_heads(x, H)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_split(got, x, H)}")
    return checklist.results


def _split_reference(x, num_heads):
    return split_heads(x, num_heads)


def _split_reshape_straight(x, num_heads):
    B, L, E = x.shape
    return x.reshape(B, num_heads, L, E // num_heads)  # the token-mixing bug


def _split_no_transpose(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, num_heads, E // num_heads)


def _split_strided_heads(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, E // num_heads, num_heads).permute(0, 3, 1, 2)


def _split_heads_first(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, num_heads, E // num_heads).permute(2, 0, 1, 3)


def _split_fixed_heads(x, num_heads):
    B, L, E = x.shape
    return x.view(B, L, 3, E // 3).transpose(1, 2)  # ignores num_heads


SPLIT_HEADS = Task(
    id="02.split_heads",
    title="Split heads: (B, L, E) -> (B, H, L, D)",
    function_name="split_heads",
    make_cases=_split_cases,
    judge=_judge_split,
    reference=_split_reference,
    wrong={
        "reshape straight to (B, H, L, D) (mixes tokens)": Wrong(_split_reshape_straight, "straight to (B, H, L, D)"),
        "no transpose: returns (B, L, H, D)": Wrong(_split_no_transpose, "did not move the head axis forward"),
        "head h takes every H-th feature": Wrong(_split_strided_heads, "every H-th feature"),
        "heads before the batch axis (H, B, L, D)": Wrong(_split_heads_first, "keep the batch axis first"),
        "hard-coded number of heads": Wrong(_split_fixed_heads, "num_heads argument"),
    },
)


# --- 02.merge_heads ------------------------------------------------------------------------
# The learner writes merge_heads(x): (B, H, L, D) -> (B, L, E), the inverse of split_heads.


def _merge_cases() -> list[Case]:
    cases = []
    for B, L, E, H in _SIZES:
        x = split_heads(_token_codes(B, L, E), H).contiguous()  # (B, H, L, D), as attention returns it
        cases.append(Case(f"merge_heads(x of shape {tuple(x.shape)})", (x,)))
    return cases


def _diagnose_merge(got: torch.Tensor, x: torch.Tensor) -> str | None:
    B, H, L, D = x.shape
    found = first_match(
        got,
        [
            (lambda: x.reshape(B, L, H * D),
             "you reshaped (B, H, L, D) straight to (B, L, E) without moving the head axis back: each output row now "
             "mixes features of different tokens (a classic bug in published ViT code). First .transpose(1, 2) to "
             "(B, L, H, D), then reshape to (B, L, E)."),
            (lambda: x.permute(0, 2, 3, 1).reshape(B, L, H * D),
             "the features of head h must sit together at h*D .. (h+1)*D - 1; yours are interleaved (you flattened "
             "(D, H) instead of (H, D)). Transpose to (B, L, H, D), then flatten the last two axes."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return _first_misplaced(got, merge_heads(x), name="out")


def _merge_shape_hint(got: torch.Tensor, B: int, H: int, L: int, D: int) -> str:
    shape = tuple(got.shape)
    if shape == (B, L, H, D):
        return "That is (B, L, H, D): flatten the last two axes into E = H * D, e.g. .reshape(B, L, H * D)."
    if shape in ((B, L, D), (B, H, D), (B, 1, L, D)):
        return "Merging concatenates the heads' features (E = H * D); summing or averaging over heads loses them."
    return "Move the head axis next to D (.transpose(1, 2)) and flatten H and D into E = H * D."


def _judge_merge(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns shape (B, L, E) with E = H * D"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            (x,) = case.args
            B, H, L, D = x.shape
            expect_shape(got, (B, L, H * D), what=case.name, hint=_merge_shape_hint(got, B, H, L, D))
    for title, indices in (("token l's row holds head 0's features, then head 1's, ... (no token mixing)", (0,)),
                           ("any number of heads and sizes", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                (x,) = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = merge_heads(x)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_merge(got, x)}")
    return checklist.results


def _merge_reference(x):
    return merge_heads(x)


def _merge_reshape_straight(x):
    B, H, L, D = x.shape
    return x.reshape(B, L, H * D)  # the source article's bug: tokens get mixed


def _merge_view_after_transpose(x):
    B, H, L, D = x.shape
    return x.transpose(1, 2).view(B, L, H * D)


def _merge_interleaved(x):
    B, H, L, D = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, L, H * D)


def _merge_not_flattened(x):
    return x.transpose(1, 2)


def _merge_sum_heads(x):
    return x.sum(dim=1)


MERGE_HEADS = Task(
    id="02.merge_heads",
    title="Merge heads: (B, H, L, D) -> (B, L, E)",
    function_name="merge_heads",
    make_cases=_merge_cases,
    judge=_judge_merge,
    reference=_merge_reference,
    wrong={
        "reshape without moving the head axis back (mixes tokens)": Wrong(
            _merge_reshape_straight, "straight to (B, L, E)"
        ),
        ".view() after .transpose()": Wrong(_merge_view_after_transpose, ".contiguous().view()"),
        "heads interleaved (flattens (D, H))": Wrong(_merge_interleaved, "interleaved"),
        "returns (B, L, H, D) without flattening": Wrong(_merge_not_flattened, "flatten the last two axes"),
        "sums over heads instead of concatenating": Wrong(_merge_sum_heads, "concatenates"),
    },
)


# --- 02.mha_forward ------------------------------------------------------------------------
# The learner writes the forward pass of multi-head self-attention from the weights of an
# nn.MultiheadAttention: mha_forward(x, in_proj_weight, in_proj_bias, out_proj_weight,
# out_proj_bias, num_heads) -> (B, L, E). in_proj_weight is [W_q; W_k; W_v], shape (3E, E).


def _mha_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(202)
    cases = []
    for B, L, E, H in [(2, 4, 6, 1), (2, 5, 12, 3), (1, 6, 8, 4)]:
        x = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
        in_w = torch.randn(3 * E, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
        in_b = 0.5 * torch.randn(3 * E, generator=gen, dtype=torch.float64)
        out_w = torch.randn(E, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
        out_b = 0.5 * torch.randn(E, generator=gen, dtype=torch.float64)
        cases.append(Case(f"x (B={B}, L={L}, E={E}), num_heads={H}", (x, in_w, in_b, out_w, out_b, H)))
    return cases


def _mha_expected(x, in_w, in_b, out_w, out_b, H):
    """What nn.MultiheadAttention with these weights returns, via the library's bridge."""
    E = x.shape[-1]
    module = nn.MultiheadAttention(E, H, batch_first=True, dtype=x.dtype)
    module.load_state_dict({"in_proj_weight": in_w, "in_proj_bias": in_b, "out_proj.weight": out_w, "out_proj.bias": out_b})
    with torch.no_grad():
        return MultiHeadAttention.from_torch(module.eval())(x)


def _mha_variant(
    x, in_w, in_b, out_w, out_b, H, *,
    scale=None, in_bias=True, out_bias=True, out_proj=True, transposed_weights=False,
    split=split_heads, merge=merge_heads, softmax_dim=-1,
):
    """The forward pass with one classic mistake switched on (library pieces only)."""
    E = x.shape[-1]

    def linear(inputs, weight, bias):
        return F.linear(inputs, weight.T if transposed_weights else weight, bias)

    w_q, w_k, w_v = in_w.split(E, dim=0)  # 3 x (E, E)
    b_q, b_k, b_v = in_b.split(E) if in_bias else (None, None, None)
    q = split(linear(x, w_q, b_q), H)  # (B, H, L, D)
    k = split(linear(x, w_k, b_k), H)  # (B, H, L, D)
    v = split(linear(x, w_v, b_v), H)  # (B, H, L, D)
    scale = 1.0 / math.sqrt(E // H) if scale is None else scale
    if softmax_dim == -1:
        context = scaled_dot_product_attention(q, k, v, scale=scale)  # (B, H, L, D)
    else:
        context = softmax_over_queries(q, k, v, scale=scale)  # (B, H, L, D)
    merged = merge(context)  # (B, L, E)
    if not out_proj:
        return merged
    return linear(merged, out_w, out_b if out_bias else None)  # (B, L, E)


def _split_straight(x, H):
    B, L, E = x.shape
    return x.reshape(B, H, L, E // H)  # (B, H, L, D), tokens mixed


def _merge_straight(x):
    B, H, L, D = x.shape
    return x.reshape(B, L, H * D)  # (B, L, E), tokens mixed


def _diagnose_mha(got, args) -> str | None:
    x, E, H = args[0], args[0].shape[-1], args[-1]
    D = E // H

    def variant(**changes):
        return lambda: _mha_variant(*args, **changes)

    return first_match(
        got,
        [
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
             "you split the heads by reshaping (B, L, E) straight to (B, H, L, D), which mixes tokens: view as "
             "(B, L, H, D), then .transpose(1, 2)."),
            (variant(merge=_merge_straight),
             "you merge the heads by reshaping (B, H, L, D) straight to (B, L, E), which mixes tokens: "
             ".transpose(1, 2) to (B, L, H, D) first, then reshape."),
            (variant(split=_split_straight, merge=_merge_straight),
             "you split and merge the heads by plain reshapes, without moving the head axis: tokens get mixed. "
             "Split: view (B, L, H, D) then .transpose(1, 2); merge: the reverse."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_mha(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, L, E) in the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            x = case.args[0]
            expect_shape(got, x.shape, what=case.name, hint="Self-attention returns one E-vector per token.")
            expect_dtype(got, x.dtype, what=case.name)
    single_head = [i for i, case in enumerate(cases) if case.args[-1] == 1]
    multi_head = [i for i, case in enumerate(cases) if case.args[-1] > 1]
    sections = (
        ("one head: projections, scale, softmax, output projection", single_head),
        ("several heads match nn.MultiheadAttention", multi_head),
    )
    single_head_passed = False
    for title, indices in sections:
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name, hints=_RESHAPE_ERROR_HINTS)
                expected = _mha_expected(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                hint = _diagnose_mha(got, case.args) or ""
                if not hint and single_head_passed:
                    hint = ("With one head you are right, so projections and softmax are fine: look at how you split "
                            "and merge the heads, and at the scale (1/sqrt(head_dim)).")
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
        single_head_passed = single_head_passed or (indices is single_head and checklist.results[-1].passed)
    with checklist.check("leaves x and the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_RESHAPE_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _mha_reference(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads):
    return _mha_variant(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads)


def _mha_no_out_proj(*args):
    return _mha_variant(*args, out_proj=False)


def _mha_merge_without_transpose(*args):
    return _mha_variant(*args, merge=_merge_straight)


def _mha_split_without_transpose(*args):
    return _mha_variant(*args, split=_split_straight)


def _mha_scale_by_d_model(*args):
    return _mha_variant(*args, scale=1.0 / math.sqrt(args[0].shape[-1]))


def _mha_no_biases(*args):
    return _mha_variant(*args, in_bias=False, out_bias=False)


def _mha_untransposed_weights(x, in_w, in_b, out_w, out_b, H):
    E = x.shape[-1]
    w_q, w_k, w_v = in_w.split(E)  # 3 x (E, E)
    b_q, b_k, b_v = in_b.split(E)  # 3 x (E,)
    q, k, v = (split_heads(x @ w + b, H) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))  # (B, H, L, D)
    return merge_heads(scaled_dot_product_attention(q, k, v)) @ out_w + out_b  # (B, L, E)


def _mha_softmax_wrong_axis(*args):
    return _mha_variant(*args, softmax_dim=-2)


def _mha_scales_weights_in_place(x, in_w, in_b, out_w, out_b, H):
    E = x.shape[-1]
    scale = 1.0 / math.sqrt(E // H)
    in_w[:E] *= scale  # folds the scale into W_q and b_q ... of the caller's tensors
    in_b[:E] *= scale
    return _mha_variant(x, in_w, in_b, out_w, out_b, H, scale=1.0)


MHA_FORWARD = Task(
    id="02.mha_forward",
    title="Multi-head attention forward pass",
    function_name="mha_forward",
    make_cases=_mha_cases,
    judge=_judge_mha,
    reference=_mha_reference,
    wrong={
        "no output projection": Wrong(_mha_no_out_proj, "before the output projection"),
        "heads merged without the transpose": Wrong(_mha_merge_without_transpose, "merge the heads by reshaping"),
        "heads split without the transpose": Wrong(_mha_split_without_transpose, "split the heads by reshaping"),
        "scale 1/sqrt(d_model) instead of 1/sqrt(head_dim)": Wrong(_mha_scale_by_d_model, "1/sqrt(head_dim)"),
        "biases dropped": Wrong(_mha_no_biases, "dropped the biases"),
        "x @ W instead of x @ W.T": Wrong(_mha_untransposed_weights, "x @ W.T + b"),
        "softmax over dim=-2": Wrong(_mha_softmax_wrong_axis, "softmax over dim=-1"),
        "folds the scale into the weights in place": Wrong(_mha_scales_weights_in_place, "in place", kind="contract"),
    },
)
