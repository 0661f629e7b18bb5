"""Graded tasks for lesson 09 (Vision Transformer): patchify, class token + positions, the article's attention fixed."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention
from ...multihead import merge_heads, split_heads
from ...vit import patchify
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned

__all__ = ["PATCHIFY", "CLASS_TOKEN_AND_POSITIONS", "VIT_ATTENTION"]

_RESHAPE_HINTS = (
    ("is invalid for input of size", "the sizes in your reshape do not multiply to the tensor's size: N = (H/p)(W/p) "
     "patches of C*p*p values each, computed from the input's shape and patch_size (never fixed numbers)."),
    ("view size is not compatible", "after a permute the memory is no longer contiguous, so .view() refuses: use "
     ".reshape() (copies when needed)."),
)


# --- 09.patchify ----------------------------------------------------------------------------
# patchify(images, patch_size): (B, C, H, W) -> (B, N, C*p*p), patches row by row, features
# ordered (channel, row, column). Pixel "codes" say where each value came from.


def _pixel_codes(B: int, C: int, H: int, W: int) -> torch.Tensor:
    b = torch.arange(B, dtype=torch.float64)[:, None, None, None]  # (B, 1, 1, 1)
    c = torch.arange(C, dtype=torch.float64)[None, :, None, None]  # (1, C, 1, 1)
    r = torch.arange(H, dtype=torch.float64)[None, None, :, None]  # (1, 1, H, 1)
    w = torch.arange(W, dtype=torch.float64)[None, None, None, :]  # (1, 1, 1, W)
    return 1_000_000 * b + 10_000 * c + 100 * r + w  # (B, C, H, W)


def _decode_pixel(code: float) -> str:
    code = int(round(code))
    return f"pixel (row {code // 100 % 100}, column {code % 100}) of channel {code // 10_000 % 100}"


# (B, C, H, W, p): square and non-square images, 1 and 3 channels, patches of 2 and 4.
_PATCH_SIZES = [(2, 1, 8, 8, 4), (1, 3, 4, 6, 2), (2, 2, 6, 6, 3)]


def _patchify_cases() -> list[Case]:
    return [Case(f"patchify(images of shape {(B, C, H, W)}, patch_size={p})", (_pixel_codes(B, C, H, W), p))
            for B, C, H, W, p in _PATCH_SIZES]


def _patches_straight(images, p):
    B, C, H, W = images.shape
    return images.reshape(B, (H // p) * (W // p), C * p * p)  # (B, N, C p p), pixels of different patches


def _patches_channels_last(images, p):
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, -1, C * p * p)  # (B, N, p p C)


def _patches_column_major(images, p):
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p)
    return x.permute(0, 4, 2, 1, 3, 5).reshape(B, -1, C * p * p)  # (B, N, C p p), patches column by column


def _patches_unfold_no_permute(images, p):
    B, C, H, W = images.shape
    x = images.unfold(2, p, p).unfold(3, p, p)  # (B, C, H/p, W/p, p, p)
    return x.reshape(B, -1, C * p * p)  # channels not moved behind the grid


def _patches_transposed_pixels(images, p):
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p)
    return x.permute(0, 2, 4, 1, 5, 3).reshape(B, -1, C * p * p)  # (B, N, C p p), column before row


def _diagnose_patchify(got: torch.Tensor, images: torch.Tensor, p: int) -> str:
    found = first_match(
        got,
        [
            (lambda: _patches_straight(images, p),
             "you reshaped (B, C, H, W) straight to (B, N, C*p*p). reshape keeps memory order, so a 'patch' is a run "
             "of consecutive pixels along the rows, not a p x p square. Reshape to (B, C, H/p, p, W/p, p), permute "
             "to (B, H/p, W/p, C, p, p), then flatten."),
            (lambda: _patches_unfold_no_permute(images, p),
             "your patches are cut right (unfold) but the channel axis is still in front of the patch grid, so "
             "flattening mixes channels and patches: permute to (B, H/p, W/p, C, p, p) before the reshape."),
            (lambda: _patches_channels_last(images, p),
             "your features are ordered (row, column, channel); order them (channel, row, column), like a Conv2d "
             "weight (E, C, p, p) flattened, so that patchify + Linear equals the strided conv."),
            (lambda: _patches_column_major(images, p),
             "your patches go column by column. Number them row by row: patch n = r * (W/p) + c (grid rows before "
             "grid columns in the permute)."),
            (lambda: _patches_transposed_pixels(images, p),
             "inside each patch your pixels are transposed (column before row): keep the order (channel, row in the "
             "patch, column in the patch)."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    expected = patchify(images, p)
    wrong = (got.double() != expected).nonzero()
    if len(wrong) == 0:
        return ""
    index = tuple(int(i) for i in wrong[0])
    if not torch.equal(got.double().flatten().sort().values, expected.flatten().sort().values):
        return "your result is not a rearrangement of the pixels: patchify only moves values, it never changes them."
    return (f"out[{', '.join(map(str, index))}] holds {_decode_pixel(got[index].item())}, expected "
            f"{_decode_pixel(expected[index].item())}.")


def _judge_patchify(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, N, C*p*p) with N = (H/p)(W/p)"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_HINTS):
            images, p = case.args
            B, C, H, W = images.shape
            expect_shape(got, (B, (H // p) * (W // p), C * p * p), what=case.name,
                         hint="One token per p x p square, holding its C*p*p values.")
    for title, indices in (("one channel: each token is one p x p square, row by row", (0,)),
                           ("several channels and non-square images: features ordered (channel, row, column)", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                images, p = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_HINTS)
                expected = patchify(images, p)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_patchify(got, images, p)}")
    return checklist.results


def _patchify_reference(images, patch_size):
    return patchify(images, patch_size)


PATCHIFY = Task(
    id="09.patchify",
    title="Patchify: (B, C, H, W) -> (B, N, C*p*p)",
    function_name="patchify",
    make_cases=_patchify_cases,
    judge=_judge_patchify,
    reference=_patchify_reference,
    wrong={
        "reshape straight to (B, N, C*p*p)": Wrong(_patches_straight, "straight to (B, N, C*p*p)"),
        "unfold without moving the channels": Wrong(_patches_unfold_no_permute, "channel axis is still in front"),
        "features ordered (row, column, channel)": Wrong(_patches_channels_last, "(channel, row, column)"),
        "patches numbered column by column": Wrong(_patches_column_major, "row by row"),
        "pixels transposed inside each patch": Wrong(_patches_transposed_pixels, "transposed"),
    },
)


# --- 09.add_class_token_and_positions --------------------------------------------------------
# add_class_token_and_positions(patches (B, N, E), class_token (1, 1, E), positions (N+1, E))
# -> (B, N+1, E): the class token first, then the patches, every token plus its position.


def _embed_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(909)
    cases = []
    for B, N, E in [(2, 4, 6), (3, 9, 8), (1, 16, 4)]:
        patches = torch.randn(B, N, E, generator=gen, dtype=torch.float64)
        cls = torch.randn(1, 1, E, generator=gen, dtype=torch.float64)
        positions = torch.randn(N + 1, E, generator=gen, dtype=torch.float64)
        cases.append(Case(f"patches (B={B}, N={N}, E={E})", (patches, cls, positions)))
    return cases


def _embed_reference(patches, class_token, positions):
    B = patches.shape[0]
    cls = class_token.expand(B, -1, -1)  # (B, 1, E)
    return torch.cat((cls, patches), dim=1) + positions  # (B, N+1, E)


def _embed_cls_last(patches, class_token, positions):
    cls = class_token.expand(patches.shape[0], -1, -1)  # (B, 1, E)
    return torch.cat((patches, cls), dim=1) + positions  # (B, N+1, E), class token last


def _embed_cls_unpositioned(patches, class_token, positions):
    cls = class_token.expand(patches.shape[0], -1, -1)  # (B, 1, E)
    return torch.cat((cls, patches + positions[: patches.shape[1]]), dim=1)  # (B, N+1, E)


def _embed_no_positions(patches, class_token, positions):
    cls = class_token.expand(patches.shape[0], -1, -1)  # (B, 1, E)
    return torch.cat((cls, patches), dim=1)  # (B, N+1, E)


def _embed_add_cls(patches, class_token, positions):
    return patches + class_token + positions[1:]  # (B, N, E): the class token added, not prepended


def _embed_in_place(patches, class_token, positions):
    patches += positions[1:]  # edits the caller's tensor
    return torch.cat((class_token.expand(patches.shape[0], -1, -1) + positions[:1], patches), dim=1)


def _diagnose_embed(got, patches, class_token, positions) -> str | None:
    return first_match(
        got,
        [
            (lambda: _embed_cls_last(patches, class_token, positions),
             "your class token is the last token; it goes first (index 0), where the classifier reads it."),
            (lambda: _embed_cls_unpositioned(patches, class_token, positions),
             "the class token got no position and the patches got positions 0..N-1. The table has N + 1 rows: "
             "row 0 is the class token's, rows 1..N the patches'. Concatenate first, then add the whole table."),
            (lambda: _embed_no_positions(patches, class_token, positions),
             "you did not add the positions: attention is blind to order without them."),
        ],
        atol=1e-12,
        rtol=0,
    )


def _judge_embed(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, N+1, E) in the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            patches = case.args[0]
            B, N, E = patches.shape
            hint = ("You have N tokens: the class token must be prepended (torch.cat along dim 1), not added to the "
                    "patches." if tuple(got.shape) == (B, N, E) else "")
            expect_shape(got, (B, N + 1, E), what=case.name, hint=hint)
            expect_dtype(got, patches.dtype, what=case.name)
    with checklist.check("class token first, then the patches, each plus its position"):
        for case, outcome in zip(cases, outcomes):
            got = returned(outcome, what=case.name, hints=(
                ("expected size", "the class token is (1, 1, E): .expand(B, -1, -1) it to the batch before torch.cat."),
                ("must match the size", "the class token is (1, 1, E): .expand(B, -1, -1) it to the batch before "
                 "torch.cat."),
            ))
            expected = _embed_reference(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            expect_close(got, expected, what=case.name, atol=1e-12, rtol=0,
                         hint=_diagnose_embed(got, *case.args) or "")
    with checklist.check("leaves the patches, class token and positions unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


CLASS_TOKEN_AND_POSITIONS = Task(
    id="09.add_class_token_and_positions",
    title="Prepend the class token and add learned positions",
    function_name="add_class_token_and_positions",
    make_cases=_embed_cases,
    judge=_judge_embed,
    reference=_embed_reference,
    wrong={
        "class token appended last": Wrong(_embed_cls_last, "goes first"),
        "class token without a position": Wrong(_embed_cls_unpositioned, "row 0 is the class token's"),
        "no positions": Wrong(_embed_no_positions, "did not add the positions"),
        "class token added to every patch": Wrong(_embed_add_cls, "must be prepended"),
        "adds positions to the caller's patches in place": Wrong(_embed_in_place, "in place", kind="contract"),
    },
)


# --- 09.vit_attention ------------------------------------------------------------------------
# Spot the bug: vit_attention(x, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads), the
# article's ViT attention with its stacked qkv Linear (3E, E), fixed: (B, N, E) -> (B, N, E).


def _vit_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(919)
    cases = []
    for B, N, E, H in [(2, 5, 8, 1), (2, 5, 12, 3), (1, 4, 16, 4)]:  # the last has N == H: shapes cannot tell
        x = torch.randn(B, N, E, generator=gen, dtype=torch.float64)
        w = torch.randn(3 * E, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
        b = 0.5 * torch.randn(3 * E, generator=gen, dtype=torch.float64)
        wo = torch.randn(E, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
        bo = 0.5 * torch.randn(E, generator=gen, dtype=torch.float64)
        cases.append(Case(f"x (B={B}, N={N}, E={E}), num_heads={H}", (x, w, b, wo, bo, H)))
    return cases


def _vit_variant(x, w, b, wo, bo, H, *, layout="fixed", scale=None, softmax_dim=-1, merge="fixed"):
    """The article's attention with one choice switched: layout of qkv, scale, softmax axis, merge."""
    B, N, E = x.shape
    D = E // H
    qkv = F.linear(x, w, b)  # (B, N, 3E)
    scale = D**-0.5 if scale is None else scale
    if layout == "article":  # the published bug: heads stay behind the tokens
        q, k, v = qkv.reshape(B, N, 3, H, D).unbind(2)  # each (B, N, H, D)
    elif layout == "heads_then_qkv":  # (B, N, H, 3, D): slices every head's chunk into q, k, v
        q, k, v = qkv.reshape(B, N, H, 3, D).permute(3, 0, 2, 1, 4).unbind(0)  # each (B, H, N, D)
    else:
        q, k, v = (split_heads(t, H) for t in qkv.chunk(3, dim=-1))  # each (B, H, N, D)
    weights = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * scale, dim=softmax_dim)  # (B, ?, ?, ?)
    context = torch.matmul(weights, v)  # (B, H, N, D) (or (B, N, H, D) for the article)
    if merge == "straight":
        merged = context.reshape(B, N, E)  # tokens mixed
    else:
        merged = context.transpose(1, 2).reshape(B, N, E)  # (B, N, E)
    return F.linear(merged, wo, bo)  # (B, N, E)


def _vit_reference(x, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads):
    E = x.shape[-1]
    q, k, v = (split_heads(t, num_heads) for t in F.linear(x, qkv_weight, qkv_bias).split(E, dim=-1))  # (B, H, N, D)
    return F.linear(merge_heads(scaled_dot_product_attention(q, k, v)), proj_weight, proj_bias)  # (B, N, E)


def _vit_article(*args):
    return _vit_variant(*args, layout="article")


def _vit_heads_then_qkv(*args):
    return _vit_variant(*args, layout="heads_then_qkv")


def _vit_merge_straight(*args):
    return _vit_variant(*args, merge="straight")


def _vit_scale_by_dim(*args):
    return _vit_variant(*args, scale=args[0].shape[-1] ** -0.5)


def _vit_softmax_queries(*args):
    return _vit_variant(*args, softmax_dim=-2)


def _diagnose_vit(got, args) -> str | None:
    E, H = args[0].shape[-1], args[-1]

    def variant(**changes):
        return lambda: _vit_variant(*args, **changes)

    return first_match(
        got,
        [
            (variant(layout="article"),
             "this is the article's bug: q, k, v are (B, N, H, D), so q @ k^T compares the heads of one token with "
             "each other ((B, N, H, H) weights) and patches never exchange information. Permute (B, N, 3, H, D) to "
             "(3, B, H, N, D) before multiplying."),
            (variant(layout="heads_then_qkv"),
             "you cut the qkv output as (B, N, H, 3, D). nn.Linear(E, 3E) stacks [q; k; v] (all of q first), so "
             "reshape to (B, N, 3, H, D), then permute to (3, B, H, N, D)."),
            (variant(merge="straight"),
             "you merged the heads by reshaping (B, H, N, D) straight to (B, N, E), which mixes tokens: "
             ".transpose(1, 2) back to (B, N, H, D) first."),
            (variant(scale=E**-0.5),
             f"you scaled by 1/sqrt(E) = 1/sqrt({E}); each head's scores have head_dim = {E // H} terms: scale by "
             f"1/sqrt(head_dim)."),
            (variant(softmax_dim=-2), "your weights sum to 1 over the queries: softmax over dim=-1, the keys."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_vit(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, N, E) in the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_RESHAPE_HINTS):
            x = case.args[0]
            expect_shape(got, x.shape, what=case.name)
            expect_dtype(got, x.dtype, what=case.name)
    for title, indices in (("one head: projections, scale, softmax, output projection", (0,)),
                           ("several heads: patches attend to patches (even when N == H)", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name, hints=_RESHAPE_HINTS)
                expected = _vit_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                             hint=_diagnose_vit(got, case.args) or "")
    with checklist.check("leaves x and the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_RESHAPE_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


VIT_ATTENTION = Task(
    id="09.vit_attention",
    title="Spot the bug: the article's ViT attention, fixed",
    function_name="vit_attention",
    make_cases=_vit_cases,
    judge=_judge_vit,
    reference=_vit_reference,
    wrong={
        "the article's attention (heads not moved in front)": Wrong(_vit_article, "the article's bug"),
        "qkv cut as (B, N, H, 3, D)": Wrong(_vit_heads_then_qkv, "(B, N, H, 3, D)"),
        "heads merged without the transpose": Wrong(_vit_merge_straight, "merged the heads by reshaping"),
        "scale 1/sqrt(E)": Wrong(_vit_scale_by_dim, "1/sqrt(head_dim)"),
        "softmax over the queries": Wrong(_vit_softmax_queries, "softmax over dim=-1"),
    },
)
