"""Graded tasks for lesson 11 (dynamic heads and beyond): repeat K/V heads, attention for cached decoding, rotary."""

from __future__ import annotations

import torch

from ...attention import scaled_dot_product_attention
from ...grouped import repeat_kv
from ...masks import causal_mask
from ...positional import apply_rotary
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned

__all__ = ["REPEAT_KV", "DECODE_ATTENTION", "ROTARY"]


# --- 11.repeat_kv --------------------------------------------------------------------------
# The learner writes repeat_kv(x, groups): (B, Hkv, S, D) -> (B, Hkv * groups, S, D), each
# K/V head repeated for the `groups` query heads that share it (query head h reads h // groups).


def _head_codes(B: int, H: int, S: int, D: int) -> torch.Tensor:
    """x[b, h, s, d] = 1000 b + 100 h + 10 s + d: every entry says where it came from."""
    b = torch.arange(B, dtype=torch.float64)[:, None, None, None]
    h = torch.arange(H, dtype=torch.float64)[None, :, None, None]
    s = torch.arange(S, dtype=torch.float64)[None, None, :, None]
    d = torch.arange(D, dtype=torch.float64)[None, None, None, :]
    return 1000 * b + 100 * h + 10 * s + d  # (B, H, S, D)


def _repeat_cases() -> list[Case]:
    return [
        Case("x (2, 2, 3, 4) with entries 1000 b + 100 h + 10 s + d, groups=3", (_head_codes(2, 2, 3, 4), 3)),
        Case("x (1, 3, 2, 2), groups=2", (_head_codes(1, 3, 2, 2), 2)),
        Case("multi-query: x (2, 1, 5, 2), groups=4", (_head_codes(2, 1, 5, 2), 4)),
        Case("groups=1 changes nothing: x (1, 4, 2, 3)", (_head_codes(1, 4, 2, 3), 1)),
    ]


def _repeat_shape_hint(got: torch.Tensor, x: torch.Tensor, groups: int) -> str:
    B, H, S, D = x.shape
    if tuple(got.shape) == (B, H, groups, S, D):
        return "You expanded a new axis but did not merge it into the head axis: reshape to (B, Hkv * groups, S, D)."
    if tuple(got.shape) == (B, H, S * groups, D):
        return "You repeated along the sequence axis (dim=2); the copies belong on the head axis (dim=1)."
    if got.dim() == 1:
        return "repeat_interleave without dim= flattens the tensor: pass dim=1."
    return "The result has Hkv * groups heads: (B, Hkv * groups, S, D)."


def _diagnose_repeat(got: torch.Tensor, x: torch.Tensor, groups: int) -> str | None:
    found = first_match(
        got,
        [
            (lambda: x.repeat(1, groups, 1, 1),
             "your heads come out in the order 0, 1, 0, 1, ... (torch.repeat tiles the whole head axis). Query head h "
             "must read K/V head h // groups, i.e. 0, 0, 1, 1, ...: use x.repeat_interleave(groups, dim=1)."),
        ],
        atol=0.0,
        rtol=0.0,
    )
    if found:
        return found
    expected = repeat_kv(x, groups)
    if tuple(got.shape) != tuple(expected.shape):
        return None
    wrong = (got.double() != expected).nonzero()
    if len(wrong) == 0:
        return None
    b, h, s, d = (int(i) for i in wrong[0])
    return f"Output head {h} should be a copy of K/V head {h} // {groups} = {h // groups}."


def _judge_repeat(cases, outcomes):
    checklist = Checklist()
    with checklist.check("shape (B, Hkv * groups, S, D) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            x, groups = case.args
            B, H, S, D = x.shape
            expect_shape(got, (B, H * groups, S, D), what=case.name, hint=_repeat_shape_hint(got, x, groups))
            expect_dtype(got, x.dtype, what=case.name)
    with checklist.check("query head h reads K/V head h // groups"):
        for index in (0, 1, 2):
            case, outcome = cases[index], outcomes[index]
            x, groups = case.args
            got = returned(outcome, what=case.name)
            expect_shape(got, repeat_kv(x, groups).shape, what=case.name, hint=_repeat_shape_hint(got, x, groups))
            expect_close(got, repeat_kv(x, groups), what=case.name, atol=0.0, rtol=0.0,
                         hint=_diagnose_repeat(got, x, groups) or "")
    with checklist.check("groups=1 returns the same values"):
        case, outcome = cases[3], outcomes[3]
        x, groups = case.args
        got = returned(outcome, what=case.name)
        expect_close(got, x, what=case.name, atol=0.0, rtol=0.0)
    with checklist.check("leaves x unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _repeat_reference(x, groups):
    return repeat_kv(x, groups)


def _repeat_tiled(x, groups):
    return x.repeat(1, groups, 1, 1)


def _repeat_sequence_axis(x, groups):
    return x.repeat_interleave(groups, dim=2)


def _repeat_no_merge(x, groups):
    return x[:, :, None].expand(-1, -1, groups, -1, -1)


def _repeat_flattened(x, groups):
    return x.repeat_interleave(groups)


def _repeat_off_by_one(x, groups):
    index = (torch.arange(x.shape[1] * groups) + 1) // groups % x.shape[1]  # head h reads (h + 1) // groups
    return x[:, index]


REPEAT_KV = Task(
    id="11.repeat_kv",
    title="Repeat K/V heads for grouped-query attention",
    function_name="repeat_kv",
    make_cases=_repeat_cases,
    judge=_judge_repeat,
    reference=_repeat_reference,
    wrong={
        "tiles with torch.repeat (0, 1, 0, 1)": Wrong(_repeat_tiled, "repeat_interleave(groups, dim=1)"),
        "repeats along the sequence axis": Wrong(_repeat_sequence_axis, "sequence axis"),
        "expands without merging the new axis": Wrong(_repeat_no_merge, "did not merge"),
        "repeat_interleave without dim": Wrong(_repeat_flattened, "without dim="),
        "head h reads (h + 1) // groups": Wrong(_repeat_off_by_one, "should be a copy of K/V head"),
    },
)


# --- 11.decode_attention -------------------------------------------------------------------
# The learner writes decode_attention(q, k, v): the T newest queries (B, H, T, D), which sit at
# the LAST T of S positions, against every key and value so far (B, H, S, D), causally.
# Equal to the last T rows of full causal attention (a bottom-right aligned mask).


def _decode_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1111)

    def qkv(B, H, T, S, D, dtype=torch.float64):
        return tuple(torch.randn(B, H, n, D, generator=gen, dtype=dtype) for n in (T, S, S))

    return [
        Case("one new token: q (2, 2, 1, 8), k, v (2, 2, 6, 8), float64", qkv(2, 2, 1, 6, 8)),
        Case("three new tokens: q (1, 3, 3, 4), k, v (1, 3, 7, 4), float64", qkv(1, 3, 3, 7, 4)),
        Case("the prompt (T = S): q, k, v (2, 1, 5, 4), float64", qkv(2, 1, 5, 5, 4)),
        Case("float32, two new tokens: q (1, 2, 2, 8), k, v (1, 2, 9, 8)", qkv(1, 2, 2, 9, 8, torch.float32)),
    ]


def _decode_reference(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    return scaled_dot_product_attention(q, k, v, causal_mask(S, device=q.device)[S - T :])  # (B, H, T, D)


def _diagnose_decode(got, q, k, v) -> str | None:
    T, S = q.shape[-2], k.shape[-2]
    return first_match(
        got,
        [
            (lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
             "your causal mask is aligned top-left (like is_causal=True), so new query i sees only keys 0..i. The "
             "new queries are the LAST T of S positions: query i sees keys 0 .. S - T + i, i.e. "
             "causal_mask(S)[S - T:] (bottom-right aligned)."),
            (lambda: scaled_dot_product_attention(q, k, v),
             "you used no mask: with several new tokens, the earlier ones see the later ones. Query i of the chunk may "
             "see keys 0 .. S - T + i (causal_mask(S)[S - T:])."),
            (lambda: scaled_dot_product_attention(q, k[..., S - T :, :], v[..., S - T :, :], is_causal=True),
             "you attended to the new keys only: the cache holds every earlier key and value, and the new queries "
             "must see them all."),
            (lambda: scaled_dot_product_attention(q, k, v, torch.tril(torch.ones(T, S, dtype=torch.bool), S - T - 1)),
             "no new query sees its own position: the diagonal belongs in a causal mask (query i sees key S - T + i)."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_decode(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (B, H, T, D) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, k, v = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, index in (
        ("one new token sees every cached key", 0),
        ("several new tokens: bottom-right causal mask", 1),
        ("the whole prompt at once equals causal attention", 2),
    ):
        with checklist.check(title):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name)
            expected = _decode_reference(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            hint = _diagnose_decode(got, *case.args) or ""
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("works in float32"):
        case, outcome = cases[3], outcomes[3]
        got = returned(outcome, what=case.name)
        expected = _decode_reference(*(x.double() for x in case.args))
        expect_shape(got, expected.shape, what=case.name)
        expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-4)
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _decode_top_left(q, k, v):
    return scaled_dot_product_attention(q, k, v, is_causal=True)


def _decode_no_mask(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


def _decode_new_keys_only(q, k, v):
    T = q.shape[-2]
    return scaled_dot_product_attention(q, k[..., -T:, :], v[..., -T:, :], is_causal=True)


def _decode_strict(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T - 1)  # (T, S), own position excluded
    return scaled_dot_product_attention(q, k, v, mask)


def _decode_first_rows(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    return scaled_dot_product_attention(q, k, v, causal_mask(S)[:T])


DECODE_ATTENTION = Task(
    id="11.decode_attention",
    title="Attention for the newest tokens against a KV cache",
    function_name="decode_attention",
    make_cases=_decode_cases,
    judge=_judge_decode,
    reference=_decode_reference,
    wrong={
        "top-left causal mask (is_causal=True)": Wrong(_decode_top_left, "bottom-right"),
        "no mask": Wrong(_decode_no_mask, "no mask"),
        "attends to the new keys only": Wrong(_decode_new_keys_only, "new keys only"),
        "diagonal excluded": Wrong(_decode_strict, "own position"),
        "first T rows of the causal mask": Wrong(_decode_first_rows, "top-left"),
    },
)


# --- 11.rotary -----------------------------------------------------------------------------
# The learner writes apply_rotary(x, positions): rotate each feature pair (x[2i], x[2i+1]) of
# x (..., L, D) by the angle positions[l] * base ** (-2i / D), base = 10000 (RoFormer's pairing).


def _rotary_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1112)
    x = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64)  # (B, H, L, D)
    return [
        Case("x (2, 3, 6, 8) at positions 0..5, float64", (x, torch.arange(6))),
        Case("the same x at positions 7..12 (as after 7 cached tokens), float64", (x.clone(), torch.arange(7, 13))),
        Case("x (4, 16) at positions [3, 0, 100, 2000], float64",
             (torch.randn(4, 16, generator=gen, dtype=torch.float64), torch.tensor([3, 0, 100, 2000]))),
        Case("float32: x (1, 5, 4) at positions 0..4", (torch.randn(1, 5, 4, generator=gen), torch.arange(5))),
    ]


_ROT_FROM_0, _ROT_FROM_7, _ROT_SCATTERED, _ROT_FLOAT32 = range(4)


def _rotary_reference(x, positions):
    return apply_rotary(x, positions)


def _rotate_pairs(x, positions, *, exponent_step=2, sign=1.0, swap=False, half=False):
    """Variants of the rotation for the diagnosis: a different pairing, frequencies or direction."""
    D = x.shape[-1]
    exponents = torch.arange(D // 2, dtype=x.dtype) * exponent_step / D  # (D/2,)
    angles = sign * positions.to(x.dtype)[:, None] * 10000.0 ** -exponents  # (L, D/2)
    cos, sin = (angles.sin(), angles.cos()) if swap else (angles.cos(), angles.sin())
    if half:
        first, second = x[..., : D // 2], x[..., D // 2 :]  # (..., L, D/2) each
        return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)  # (..., L, D)
    even, odd = x[..., 0::2], x[..., 1::2]  # (..., L, D/2) each
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)  # (..., L, D)


def _diagnose_rotary(got, x, positions) -> str | None:
    return first_match(
        got,
        [
            (lambda: _rotate_pairs(x, positions, half=True),
             "you paired feature i with feature i + D/2 (the 'rotate half' layout of GPT-NeoX and LLaMA code). It "
             "has the same relative property, but this task pairs neighbours (2i, 2i+1) as in RoFormer."),
            (lambda: _rotate_pairs(x, positions, exponent_step=1),
             "your frequencies fall too slowly: pair i turns by position * base^(-2i/D), not base^(-i/D)."),
            (lambda: _rotate_pairs(x, positions, sign=-1.0),
             "you rotate the other way (by -angle). Rotate (a, b) to (a cos t - b sin t, a sin t + b cos t)."),
            (lambda: _rotate_pairs(x, positions, swap=True),
             "sin and cos are swapped: at position 0 the rotation must be the identity (cos 0 = 1, sin 0 = 0)."),
            (lambda: _rotate_pairs(x, torch.arange(x.shape[-2])),
             "you ignored the positions you were given and used 0..L-1. Rotate by the positions argument: after a KV "
             "cache the new tokens do not start at 0, and positions need not be consecutive."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_rotary(cases, outcomes):
    checklist = Checklist()
    with checklist.check("same shape and dtype as x"):
        for case, _, got in answered(cases, outcomes):
            x, _ = case.args
            expect_shape(got, x.shape, what=case.name)
            expect_dtype(got, x.dtype, what=case.name)
    with checklist.check("a rotation: every pair keeps its length, position 0 changes nothing"):
        case, outcome = cases[_ROT_FROM_0], outcomes[_ROT_FROM_0]
        x, positions = case.args
        got = returned(outcome, what=case.name)
        expect_shape(got, x.shape, what=case.name)
        pair_length = got.double().unflatten(-1, (-1, 2)).norm(dim=-1)  # (..., L, D/2)
        if not torch.allclose(pair_length, x.unflatten(-1, (-1, 2)).norm(dim=-1), atol=1e-9, rtol=1e-7):
            raise Fail(
                f"{case.name}: the pairs (x[2i], x[2i+1]) change length, so this is not a rotation of each pair"
                + (f". {_diagnose_rotary(got, x, positions)}" if _diagnose_rotary(got, x, positions) else
                   ": each pair must become (a cos t - b sin t, a sin t + b cos t).")
            )
        expect_close(got[..., 0, :], x[..., 0, :], what=f"{case.name}, position 0", atol=1e-9, rtol=1e-7,
                     hint=_diagnose_rotary(got, x, positions) or "")
    with checklist.check("angles: position * 10000^(-2i/D) on the pair (2i, 2i+1)"):
        for index in (_ROT_FROM_0, _ROT_SCATTERED):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name)
            expected = _rotary_reference(*case.args)
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                         hint=_diagnose_rotary(got, *case.args) or "")
    with checklist.check("uses the given positions (they need not start at 0)"):
        case, outcome = cases[_ROT_FROM_7], outcomes[_ROT_FROM_7]
        got = returned(outcome, what=case.name)
        expect_close(got, _rotary_reference(*case.args), what=case.name, atol=1e-9, rtol=1e-7,
                     hint=_diagnose_rotary(got, *case.args) or "")
    with checklist.check("relative: q_m . k_n depends only on m - n"):
        # Cases 0 and 1 rotate the same x by positions shifted by 7: dot products must agree.
        first = returned(outcomes[_ROT_FROM_0], what=cases[_ROT_FROM_0].name).double()
        second = returned(outcomes[_ROT_FROM_7], what=cases[_ROT_FROM_7].name).double()
        expect_shape(first, cases[_ROT_FROM_0].args[0].shape, what=cases[_ROT_FROM_0].name)
        expect_shape(second, first.shape, what=cases[_ROT_FROM_7].name)
        before = first @ first.transpose(-2, -1)  # (B, H, L, L): rotated x_m . rotated x_n at positions m, n
        after = second @ second.transpose(-2, -1)  # the same pairs, both 7 positions later
        if not torch.allclose(before, after, atol=1e-9, rtol=1e-7):
            raise Fail(
                "shifting every position by 7 changed the dot products between rotated vectors, so the scores "
                "depend on absolute positions. Rotate every pair by an angle proportional to the position."
            )
    with checklist.check("works in float32"):
        case, outcome = cases[_ROT_FLOAT32], outcomes[_ROT_FLOAT32]
        x, positions = case.args
        got = returned(outcome, what=case.name)
        expect_close(got, _rotary_reference(x.double(), positions), what=case.name, atol=1e-5, rtol=1e-4)
    with checklist.check("leaves x unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _rotary_rotate_half(x, positions):
    return _rotate_pairs(x, positions, half=True)


def _rotary_slow_frequencies(x, positions):
    return _rotate_pairs(x, positions, exponent_step=1)


def _rotary_clockwise(x, positions):
    return _rotate_pairs(x, positions, sign=-1.0)


def _rotary_sin_cos_swapped(x, positions):
    return _rotate_pairs(x, positions, swap=True)


def _rotary_ignores_positions(x, positions):
    return _rotate_pairs(x, torch.arange(x.shape[-2]))


def _rotary_in_place(x, positions):
    rotated = _rotate_pairs(x, positions)
    x.copy_(rotated)
    return x


ROTARY = Task(
    id="11.rotary",
    title="Rotary position embeddings (RoPE)",
    function_name="apply_rotary",
    make_cases=_rotary_cases,
    judge=_judge_rotary,
    reference=_rotary_reference,
    wrong={
        "pairs i with i + D/2 (rotate half)": Wrong(_rotary_rotate_half, "rotate half"),
        "frequencies base^(-i/D)": Wrong(_rotary_slow_frequencies, "base^(-2i/D)"),
        "rotates by -angle": Wrong(_rotary_clockwise, "other way"),
        "sin and cos swapped": Wrong(_rotary_sin_cos_swapped, "swapped"),
        "ignores the positions argument": Wrong(_rotary_ignores_positions, "ignored the positions"),
        "rotates x in place": Wrong(_rotary_in_place, "in place", kind="contract"),
    },
)
