"""Graded tasks for lesson 09 (Vision Transformer): patchify, class token + positions, the article's attention
fixed, and the stretch task, 2-D sine-cosine positions.

No delegation: ``09.patchify`` gives zero for calling the course's ``patchify`` / ``PatchEmbedding`` or
PyTorch's ``F.unfold`` (im2col, patch extraction itself; ``Tensor.unfold``, a view, stays allowed);
``09.vit_attention`` for calling a whole multi-head attention layer (the course's or PyTorch's), while
``split_heads`` and scaled dot-product attention, building blocks of lesson 01-02, stay allowed: the
task is the layout of the heads; ``09.sincos_positions_2d`` for calling the course's own table
(the 1-D ``sinusoidal_encoding`` of lesson 10 is a building block)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention
from ...multihead import merge_heads, split_heads
from ...positional import sinusoidal_encoding
from ...vit import patchify, sincos_positions_2d
from .. import probes
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned, same
from ._variants import consistent_match

__all__ = ["PATCHIFY", "CLASS_TOKEN_AND_POSITIONS", "VIT_ATTENTION", "SINCOS_POSITIONS_2D"]

_RESHAPE_HINTS = (
    ("is invalid for input of size", "the sizes in your reshape do not multiply to the tensor's size: N = (H/p)(W/p) "
     "patches of C*p*p values each, computed from the input's shape and patch_size (never fixed numbers)."),
    ("view size is not compatible", "after a permute the memory is no longer contiguous, so .view() refuses: a "
     "view needs contiguous memory (reshape copies when it must)."),
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


# (B, C, H, W, p): square and non-square images, 1, 2 and 3 channels, patches of 2, 3 and 4. Two cases
# with one channel and two with several, so that every bug is seen by two cases.
_PATCH_SIZES = [(2, 1, 8, 8, 4), (2, 1, 6, 9, 3), (2, 3, 4, 6, 2), (3, 2, 6, 6, 3)]
_PATCHIFY_FORBIDDEN = (
    "attn_course.vit.patchify",
    "attn_course.vit.PatchEmbedding",
    "torch.nn.functional.unfold",
    "torch.nn.Unfold",
    "aten.im2col",
)


_PATCH_BAD = [(2, 1, 6, 8, 4), (2, 3, 8, 10, 4)]  # p divides only one side: the library raises ValueError


def _patchify_cases() -> list[Case]:
    return [Case(f"patchify(images of shape {(B, C, H, W)}, patch_size={p})", (_pixel_codes(B, C, H, W), p))
            for B, C, H, W, p in _PATCH_SIZES + _PATCH_BAD]


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


def _patches_with_f_unfold(images, p):
    if images.shape[-2] % p or images.shape[-1] % p:
        raise ValueError(f"patch_size={p} must divide the image height and width")
    return F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)  # (B, N, C p p): PyTorch's im2col does it all


def _patches_with_the_library(images, p):
    return patchify(images, p)  # (B, N, C p p)


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
             "of consecutive pixels along the rows, not a p x p square: a patch takes p pixels from each of p "
             "different image rows."),
            (lambda: _patches_unfold_no_permute(images, p),
             "your patches are cut right (unfold) but the channel axis is still in front of the patch grid, so "
             "flattening mixes channels and patches: the patch grid must come before the channels when you flatten."),
            (lambda: _patches_channels_last(images, p),
             "your features are ordered (row, column, channel); order them (channel, row, column), like a Conv2d "
             "weight (E, C, p, p) flattened, so that patchify + Linear equals the strided conv."),
            (lambda: _patches_column_major(images, p),
             "your patches go column by column; they are numbered along each grid row first: patch n = r * (W/p) + c."),
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
    good = len(_PATCH_SIZES)
    with checklist.check("returns (B, N, C*p*p) with N = (H/p)(W/p)"):
        for case, _, got in answered(cases[:good], outcomes[:good], hints=_RESHAPE_HINTS):
            images, p = case.args
            B, C, H, W = images.shape
            expect_shape(got, (B, (H // p) * (W // p), C * p * p), what=case.name,
                         hint="One token per p x p square, holding its C*p*p values.")
    values_right = all(
        outcomes[i].error is None and isinstance(outcomes[i].returned, torch.Tensor)
        and same(outcomes[i].returned, patchify(*cases[i].args)) for i in range(good)
    )
    for title, indices in (("one channel: each token is one p x p square, row by row", (0, 1)),
                           ("several channels: features ordered (channel, row, column)", (2, 3))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                images, p = case.args
                got = returned(outcome, what=case.name, hints=_RESHAPE_HINTS)
                expected = patchify(images, p)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_patchify(got, images, p)}")
    def cropped(case, outcome) -> bool:
        images, p = case.args
        H, W = images.shape[-2:]
        return outcome.error is None and same(outcome.returned, patchify(images[..., : H // p * p, : W // p * p], p))

    crops = all(cropped(c, o) for c, o in zip(cases[good:], outcomes[good:]))  # the cropping story fits every case
    with checklist.check("raises ValueError when patch_size does not divide the height and the width"):
        for case, outcome in zip(cases[good:], outcomes[good:]):
            images, p = case.args
            if outcome.not_implemented:
                returned(outcome, what=case.name)
            if outcome.error is None:
                raise Fail(f"{case.name} returned a result; it should raise ValueError: {p} does not divide "
                           f"{tuple(images.shape[-2:])}, so some pixels belong to no patch."
                           + (" You cropped them: cropping them silently changes the image the model sees."
                              if crops else ""))
            if not outcome.error.startswith("ValueError"):
                story = ("your patches are right, but an image that p does not divide must be refused before any "
                         "reshape fails" if values_right else "an image that p does not divide must be refused")
                raise Fail(f"{case.name} raised {outcome.error[:200]}; {story}, with a ValueError that names the "
                           "patch size and the image size.")
    return checklist.results


def _patchify_reference(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"patch_size={p} must divide the image height and width, got {H} x {W}")
    grid = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)  # (B, N, C p p)


def _patches_cropped(images, p):
    """Issue 20's accepted-wrong answer: crops the pixels p does not cover, silently."""
    H, W = images.shape[-2:]
    return _patchify_reference(images[..., : H // p * p, : W // p * p], p)


def _patches_reshape_error(images, p):
    """Right patches, but a size p does not divide ends in reshape's RuntimeError, not a ValueError."""
    B, C, H, W = images.shape
    grid = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p): fails unless p divides H and W
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)


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
        "features ordered (row, column, channel)": Wrong(_patches_channels_last, "features are ordered (row, column, channel)"),
        "patches numbered column by column": Wrong(_patches_column_major, "patches go column by column"),
        "pixels transposed inside each patch": Wrong(_patches_transposed_pixels, "pixels are transposed"),
        "crops the pixels p does not cover": Wrong(_patches_cropped, "You cropped them"),
        "reshape's RuntimeError instead of a ValueError": Wrong(_patches_reshape_error, "your patches are right"),
        "calls F.unfold (PyTorch's patch extraction)": Wrong(
            _patches_with_f_unfold, "you called torch.nn.functional.unfold", kind="algorithm"),
        "calls attn_course's patchify": Wrong(_patches_with_the_library, "you called attn_course.patchify",
                                               kind="algorithm"),
    },
    forbidden=_PATCHIFY_FORBIDDEN,
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
    for title, indices in (("class token first, then the patches, each plus its position", (0, 1)),
                           ("one image (B = 1) of 16 patches", (2,))):
        with checklist.check(title):
            for case, outcome in ((cases[i], outcomes[i]) for i in indices):
                got = returned(outcome, what=case.name, hints=(
                    ("expected size", "the class token is (1, 1, E): .expand(B, -1, -1) it to the batch before torch.cat."),
                    ("must match the size", "the class token is (1, 1, E): .expand(B, -1, -1) it to the batch before "
                     "torch.cat."),
                ))
                expected = _embed_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-12, rtol=0,
                             hint=lambda: _diagnose_embed(got, *case.args) or "")
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


# (B, N, E, H): every case has several heads and a batch; two have N == H, where the article's (B, N, H, H)
# weights have the shape real (B, H, N, N) weights have, so only the values can tell.
_VIT_SHAPES = [(2, 5, 12, 3), (3, 7, 8, 2), (2, 4, 16, 4), (2, 3, 12, 3)]
_VIT_FORBIDDEN = (
    "torch.nn.MultiheadAttention",
    "torch.nn.functional.multi_head_attention_forward",
    "aten._native_multi_head_attention",
    "attn_course.multihead.MultiHeadAttention",
)


def _vit_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(919)
    cases = []
    for B, N, E, H in _VIT_SHAPES:
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


def _vit_with_torch_layer(x, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads):
    E = x.shape[-1]
    layer = torch.nn.MultiheadAttention(E, num_heads, batch_first=True, dtype=x.dtype)
    with torch.no_grad():  # the same stacked [W_q; W_k; W_v] and output projection
        layer.in_proj_weight.copy_(qkv_weight)
        layer.in_proj_bias.copy_(qkv_bias)
        layer.out_proj.weight.copy_(proj_weight)
        layer.out_proj.bias.copy_(proj_bias)
        return layer(x, x, x, need_weights=False)[0]  # (B, N, E)


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
             "each other ((B, N, H, H) weights) and patches never exchange information: the heads axis must come before "
             "the patch axis when the scores are formed."),
            (variant(layout="heads_then_qkv"),
             "you cut the qkv output as (B, N, H, 3, D). nn.Linear(E, 3E) stacks [q; k; v] (all of q first), so its "
             "E outputs for q come first, then k's, then v's."),
            (variant(merge="straight"),
             "you merged the heads by reshaping (B, H, N, D) straight to (B, N, E), which mixes tokens: the heads axis "
             "must move back behind the patch axis before the heads are joined."),
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
    for title, indices in (("several heads: projections, heads in front, scale, softmax, merge, output projection",
                            (0, 1)),
                           ("N == H, where shapes cannot tell: patches attend to patches, not heads to heads", (2, 3))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name, hints=_RESHAPE_HINTS)
                expected = _vit_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                             hint=lambda: _diagnose_vit(got, case.args) or "")
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
        "calls nn.MultiheadAttention": Wrong(_vit_with_torch_layer, "you called torch.nn.MultiheadAttention",
                                              kind="algorithm"),
    },
    forbidden=_VIT_FORBIDDEN,
)


# --- 09.sincos_positions_2d (stretch) ----------------------------------------------------------
# sincos_positions_2d(grid_height, grid_width, dim) -> (grid_height * grid_width, dim): patch
# n = r * grid_width + c gets concat(PE_1d(c, dim/2), PE_1d(r, dim/2)), each half laid out like the
# course's 1-D table (sin, cos interleaved; frequencies base^(-k / (dim/4)), base 10000), and a
# dim that is not a multiple of 4 raises ValueError.

# (grid_height, grid_width, dim): two square and two non-square grids, then two dims that are not
# multiples of 4 (which must raise).
_GRIDS = [(4, 4, 8), (3, 3, 16), (3, 5, 16), (2, 7, 12)]
_BAD_DIMS = [(4, 4, 10), (2, 3, 6)]
_SINCOS_FORBIDDEN = ("attn_course.vit.sincos_positions_2d",)


def _sincos_cases() -> list[Case]:
    cases = [Case(f"sincos_positions_2d(grid_height={h}, grid_width={w}, dim={d})", (h, w, d)) for h, w, d in _GRIDS]
    cases += [Case(f"sincos_positions_2d({h}, {w}, dim={d}): dim not a multiple of 4", (h, w, d)) for h, w, d in _BAD_DIMS]
    return cases


_SQUARE = (0, 1)
_NON_SQUARE = (2, 3)
_BAD = (4, 5)


def _half(coordinate: torch.Tensor, half_dim: int, *, layout: str = "interleaved", spacing: str = "quarter") -> torch.Tensor:
    """One axis's table (N, half_dim): sines and cosines of ``coordinate`` at half_dim / 2 frequencies."""
    count = half_dim // 2
    k = torch.arange(count, dtype=torch.float64)  # (dim/4,)
    exponent = {"quarter": k / count, "last_is_one": k / max(count - 1, 1), "whole": k / (2 * half_dim)}[spacing]
    angles = coordinate.double().reshape(-1, 1) * 10000.0 ** -exponent  # (N, dim/4)
    if layout == "blocks":  # MAE's layout: all sines, then all cosines
        return torch.cat((angles.sin(), angles.cos()), dim=-1)  # (N, half_dim)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)  # (N, half_dim), interleaved


def _sincos_variant(grid_height, grid_width, dim, *, order="columns_first", numbering="rows", layout="interleaved",
                    spacing="quarter", check_dim=True):
    if check_dim and dim % 4:
        raise ValueError(f"dim must be divisible by 4, got {dim}")
    n = torch.arange(grid_height * grid_width)  # (N,)
    if numbering == "rows":
        r, c = n // grid_width, n % grid_width  # patch n = r * W + c
    elif numbering == "columns":
        r, c = n % grid_height, n // grid_height  # patch n = c * H + r: the grid read column by column
    else:  # "swapped": grid_height and grid_width confused
        r, c = n // grid_height, n % grid_height
    columns = _half(c, dim // 2, layout=layout, spacing=spacing)  # (N, dim/2)
    rows = _half(r, dim // 2, layout=layout, spacing=spacing)  # (N, dim/2)
    return torch.cat((columns, rows) if order == "columns_first" else (rows, columns), dim=-1)  # (N, dim)


def _sincos_reference(grid_height, grid_width, dim):
    return _sincos_variant(grid_height, grid_width, dim)


def _sincos_rows_first(h, w, d):
    return _sincos_variant(h, w, d, order="rows_first")


def _sincos_column_major(h, w, d):
    return _sincos_variant(h, w, d, numbering="columns")


def _sincos_swapped_sizes(h, w, d):
    return _sincos_variant(h, w, d, numbering="swapped")


def _sincos_blocks(h, w, d):
    return _sincos_variant(h, w, d, layout="blocks")


def _sincos_whole_dim_frequencies(h, w, d):
    return _sincos_variant(h, w, d, spacing="whole")


def _sincos_big_vision_spacing(h, w, d):
    return _sincos_variant(h, w, d, spacing="last_is_one")


def _sincos_flat_index(h, w, d):
    if d % 4:
        raise ValueError(f"dim must be divisible by 4, got {d}")
    return sinusoidal_encoding(torch.arange(h * w, dtype=torch.float64), d)  # (N, dim): the grid read as a sequence


def _sincos_no_dim_check(h, w, d):
    quarter = d // 4  # dim 10 silently becomes a table of 8 features
    return _sincos_variant(h, w, 4 * quarter, check_dim=False)


def _sincos_with_the_library(h, w, d):
    return sincos_positions_2d(h, w, d, dtype=torch.float64)


def _sincos_variants(*args):
    """The classic mistakes of the 2-D sin-cos table on one case, as ``(make, message)``."""
    def variant(**changes):
        return lambda: _sincos_variant(*args, **changes)

    return [
            (variant(order="rows_first"),
             "your first half encodes the row and the second the column: the first dim/2 features are the column's "
             "table (x), the second half the row's (y), as in MAE."),
            (variant(numbering="columns"),
             "your patches go down the columns: patch n = r * grid_width + c (row by row, as patchify numbers them), "
             "so r = n // grid_width and c = n % grid_width."),
            (variant(numbering="swapped"),
             "you mixed up grid_height and grid_width: on a grid of grid_height rows, patch n sits in row "
             "n // grid_width and column n % grid_width."),
            (variant(layout="blocks"),
             "each half holds all its sines, then all its cosines (MAE's layout). This task lays each half out like "
             "the course's 1-D table: sin and cos of one frequency side by side (interleaved)."),
            (variant(spacing="whole"),
             "your frequencies are spaced over the whole dim: each half is a 1-D table of dim/2 features, so its "
             "frequencies are 10000^(-k / (dim/4)), k = 0 .. dim/4 - 1."),
            (variant(spacing="last_is_one"),
             "your frequencies go down to exactly 1/10000 (k / (dim/4 - 1), big_vision's spacing). This task uses "
             "10000^(-k / (dim/4)), as the 1-D table does."),
            (lambda: sinusoidal_encoding(torch.arange(args[0] * args[1], dtype=torch.float64), args[2]),
             "you encoded the patch index n as a 1-D position: the grid's rows and columns each get half the "
             "features, from the patch's row r and column c."),
    ]


def _diagnose_sincos(got, args) -> str | None:
    """The mistake that explains ``got`` on this one case (the judge also checks it against the other cases)."""
    return first_match(got, _sincos_variants(*args), atol=1e-5, rtol=1e-5)


def _judge_sincos(cases, outcomes):
    checklist = Checklist()
    good = [(cases[i], outcomes[i]) for i in (*_SQUARE, *_NON_SQUARE)]
    with checklist.check("returns a floating-point (grid_height * grid_width, dim) table"):
        for case, _, got in answered([c for c, _ in good], [o for _, o in good]):
            h, w, d = case.args
            expect_shape(got, (h * w, d), what=case.name, hint="One row per patch, dim features each.")
            if not got.dtype.is_floating_point:
                raise Fail(f"{case.name}: returned dtype {got.dtype}; sines and cosines are floating point.")
    for title, indices in (("square grids: column half, then row half, sin and cos interleaved", _SQUARE),
                           ("non-square grids: patches row by row, rows and columns not swapped", _NON_SQUARE)):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name)
                expected = _sincos_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-5,
                             hint=lambda: consistent_match(index, cases, outcomes, expected=_sincos_reference,
                                                           variants=_sincos_variants,
                                                           tolerance=lambda *args: (1e-5, 1e-5)) or "")
    with checklist.check("a dim that is not a multiple of 4 raises ValueError"):
        for index in _BAD:
            case, outcome = cases[index], outcomes[index]
            if outcome.not_implemented:
                returned(outcome, what=case.name)
            if outcome.error is None:
                raise Fail(f"{case.name} returned a result; it should raise ValueError: dim/4 frequencies per sine and "
                           "cosine, for rows and for columns, need dim divisible by 4 "
                           "(`if dim % 4: raise ValueError(...)`).")
            if not outcome.error.startswith("ValueError"):
                raise Fail(f"{case.name} raised {outcome.error[:200]}; raise ValueError, naming dim.")
    return checklist.results


SINCOS_POSITIONS_2D = Task(
    id="09.sincos_positions_2d",
    title="Stretch: 2-D sine-cosine positions for a grid of patches",
    function_name="sincos_positions_2d",
    make_cases=_sincos_cases,
    judge=_judge_sincos,
    reference=_sincos_reference,
    wrong={
        "row half first": Wrong(_sincos_rows_first, "first half encodes the row"),
        "patches numbered column by column": Wrong(_sincos_column_major, "patches go down the columns"),
        "grid_height and grid_width swapped": Wrong(_sincos_swapped_sizes, "mixed up grid_height and grid_width"),
        "MAE's layout (sines, then cosines)": Wrong(_sincos_blocks, "MAE's layout"),
        "frequencies spaced over the whole dim": Wrong(_sincos_whole_dim_frequencies, "spaced over the whole dim"),
        "big_vision's spacing k / (dim/4 - 1)": Wrong(_sincos_big_vision_spacing, "big_vision's spacing"),
        "the flat patch index as a 1-D position": Wrong(_sincos_flat_index, "encoded the patch index n"),
        "no error for a dim that is not a multiple of 4": Wrong(_sincos_no_dim_check, "should raise ValueError"),
        "calls attn_course's sincos_positions_2d": Wrong(
            _sincos_with_the_library, "you called attn_course.sincos_positions_2d", kind="algorithm"),
    },
    stretch=True,
    forbidden=_SINCOS_FORBIDDEN,
)
