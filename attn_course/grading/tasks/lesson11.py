"""Graded tasks for lesson 11 (dynamic heads and beyond): repeat K/V heads, attention for cached decoding, rotary."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ...attention import scaled_dot_product_attention
from ...grouped import repeat_kv
from ...masks import causal_mask
from ...multihead import MultiHeadAttention, merge_heads, split_heads
from ...positional import apply_rotary
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    expect_close,
    expect_dtype,
    expect_flops_at_most,
    expect_inputs_unchanged,
    expect_shape,
)
from ..probes import probe_call
from ._common import answered, first_match, returned, seeded_randn

__all__ = ["REPEAT_KV", "DECODE_ATTENTION", "ROTARY", "ROPE_GENERATION"]


# --- 11.repeat_kv --------------------------------------------------------------------------
# The learner writes repeat_kv(x, n_rep): (B, Hkv, S, D) -> (B, Hkv * n_rep, S, D), each K/V
# head repeated for the n_rep = H / Hkv query heads that share it (query head h reads h // n_rep).


def _head_codes(B: int, H: int, S: int, D: int) -> torch.Tensor:
    """x[b, h, s, d] = 1000 b + 100 h + 10 s + d: every entry says where it came from."""
    b = torch.arange(B, dtype=torch.float64)[:, None, None, None]
    h = torch.arange(H, dtype=torch.float64)[None, :, None, None]
    s = torch.arange(S, dtype=torch.float64)[None, None, :, None]
    d = torch.arange(D, dtype=torch.float64)[None, None, None, :]
    return 1000 * b + 100 * h + 10 * s + d  # (B, H, S, D)


def _repeat_cases() -> list[Case]:
    return [
        Case("x (2, 2, 3, 4) with entries 1000 b + 100 h + 10 s + d, n_rep=3", (_head_codes(2, 2, 3, 4), 3)),
        Case("x (1, 3, 2, 2), n_rep=2", (_head_codes(1, 3, 2, 2), 2)),
        Case("multi-query: x (2, 1, 5, 2), n_rep=4", (_head_codes(2, 1, 5, 2), 4)),
        Case("n_rep=1 changes nothing: x (1, 4, 2, 3)", (_head_codes(1, 4, 2, 3), 1)),
    ]


def _repeat_shape_hint(got: torch.Tensor, x: torch.Tensor, groups: int) -> str:
    B, H, S, D = x.shape
    if tuple(got.shape) == (B, H, groups, S, D):
        return "You expanded a new axis but did not merge it into the head axis: reshape to (B, Hkv * n_rep, S, D)."
    if tuple(got.shape) == (B, H, S * groups, D):
        return "You repeated along the sequence axis (dim=2); the copies belong on the head axis (dim=1)."
    if got.dim() == 1:
        return "Your result is flat (1-D): keep the four axes and put the copies on the head axis, (B, Hkv * n_rep, S, D)."
    return "The result has Hkv * n_rep heads: (B, Hkv * n_rep, S, D)."


def _diagnose_repeat(got: torch.Tensor, x: torch.Tensor, groups: int) -> str | None:
    found = first_match(
        got,
        [
            (lambda: x.repeat(1, groups, 1, 1),
             "your heads come out in the order 0, 1, 0, 1, ... (torch.repeat tiles the whole head axis). Query head h "
             "must read K/V head h // n_rep, i.e. 0, 0, 1, 1, ...: each head repeated n_rep times in a row, next to "
             "itself."),
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
    return f"Output head {h} should be a copy of K/V head {h} // {groups} = {h // groups} (h // n_rep)."


def _judge_repeat(cases, outcomes):
    checklist = Checklist()
    with checklist.check("shape (B, Hkv * n_rep, S, D) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            x, groups = case.args
            B, H, S, D = x.shape
            expect_shape(got, (B, H * groups, S, D), what=case.name, hint=_repeat_shape_hint(got, x, groups))
            expect_dtype(got, x.dtype, what=case.name)
    with checklist.check("query head h reads K/V head h // n_rep"):
        for index in (0, 1, 2):
            case, outcome = cases[index], outcomes[index]
            x, groups = case.args
            got = returned(outcome, what=case.name)
            expect_shape(got, repeat_kv(x, groups).shape, what=case.name, hint=_repeat_shape_hint(got, x, groups))
            expect_close(got, repeat_kv(x, groups), what=case.name, atol=0.0, rtol=0.0,
                         hint=lambda: _diagnose_repeat(got, x, groups) or "")
    with checklist.check("n_rep=1 returns the same values"):
        case, outcome = cases[3], outcomes[3]
        x, groups = case.args
        got = returned(outcome, what=case.name)
        expect_close(got, x, what=case.name, atol=0.0, rtol=0.0)
    with checklist.check("leaves x unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _repeat_reference(x, groups):
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)  # (B, H * n_rep, S, D)


def _repeat_delegates(x, groups):
    return repeat_kv(x, groups)


def _repeat_interleaved(x, groups):
    return x.repeat_interleave(groups, dim=1)


def _repeat_tiled(x, groups):
    return x.repeat(1, groups, 1, 1)


def _repeat_sequence_axis(x, groups):
    B, H, S, D = x.shape
    return x[:, :, :, None].expand(B, H, S, groups, D).reshape(B, H, S * groups, D)  # copies next to each position


def _repeat_no_merge(x, groups):
    return x[:, :, None].expand(-1, -1, groups, -1, -1)


def _repeat_flattened(x, groups):
    return x.reshape(-1)[:, None].expand(-1, groups).reshape(-1)  # every entry repeated, the axes lost


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
        "tiles with torch.repeat (0, 1, 0, 1)": Wrong(_repeat_tiled, "each head repeated n_rep times in a row"),
        "repeats along the sequence axis": Wrong(_repeat_sequence_axis, "sequence axis"),
        "expands without merging the new axis": Wrong(_repeat_no_merge, "did not merge"),
        "repeats every entry, flattening the axes": Wrong(_repeat_flattened, "flat (1-D)"),
        "head h reads (h + 1) // groups": Wrong(_repeat_off_by_one, "should be a copy of K/V head"),
        "calls attn_course.repeat_kv": Wrong(_repeat_delegates, "you called attn_course.repeat_kv", kind="algorithm"),
        "calls x.repeat_interleave": Wrong(
            _repeat_interleaved, "you called torch.Tensor.repeat_interleave", kind="algorithm"
        ),
    },
    # The task is "each head repeated in place": torch's repeat_interleave is that, in one call.
    forbidden=("attn_course.repeat_kv", "torch.repeat_interleave", "torch.Tensor.repeat_interleave"),
)


# --- 11.decode_attention -------------------------------------------------------------------
# The learner writes decode_attention(q, k, v, lengths): a left-padded batch of cached sequences.
# Every sequence's cache has S slots; sequence b's real tokens are its LAST lengths[b] slots (the
# padding comes first), and the T newest tokens are the last T slots. New query i of sequence b
# may see slots S - lengths[b] .. S - T + i: a bottom-right causal mask AND the padding mask. A
# query that is itself padding (possible when the whole prompt is passed, T > lengths[b]) sees
# nothing: its output row must be zeros. Equal, for the real queries, to the last T rows of causal
# attention over each sequence's real tokens. The attention itself may be anyone's (exercise 01's,
# the course's, PyTorch's): the task is the mask, so only ready-made bottom-right masks count as
# delegation.


def _decode_mask(T: int, S: int, lengths: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, S), True = may attend: bottom-right causal within the last T of S slots, real slots only."""
    slots = torch.arange(S, device=lengths.device)  # (S,)
    causal = slots[None, :] <= torch.arange(S - T, S, device=lengths.device)[:, None]  # (T, S): query i sees 0 .. S - T + i
    real = slots[None, :] >= (S - lengths)[:, None]  # (B, S): left padding comes first
    return causal[None, None] & real[:, None, None, :]  # (B, 1, T, S)


def _decode_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1111)

    def case(name, B, H, T, S, D, lengths, dtype=torch.float64):
        q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for n in (T, S, S))
        return Case(name, (q, k, v, torch.tensor(lengths)))

    return [
        case("one new token, no padding: q (2, 2, 1, 8), k, v (2, 2, 6, 8), lengths [6, 6], float64", 2, 2, 1, 6, 8, [6, 6]),
        case("three new tokens, left-padded: q (2, 3, 3, 4), k, v (2, 3, 7, 4), lengths [7, 4], float64",
             2, 3, 3, 7, 4, [7, 4]),
        case("the whole prompt (T = S), left-padded: q, k, v (2, 2, 5, 4), lengths [5, 3], float64: "
             "two padding queries", 2, 2, 5, 5, 4, [5, 3]),
        case("float32, two new tokens, left-padded: q (2, 2, 2, 8), k, v (2, 2, 9, 8), lengths [9, 5]",
             2, 2, 2, 9, 8, [9, 5], torch.float32),
        case("float16, one new token, left-padded: q (2, 2, 1, 16), k, v (2, 2, 10, 16), lengths [10, 4]",
             2, 2, 1, 10, 16, [10, 4], torch.float16),
        case("float16, the whole prompt (T = S), left-padded: q, k, v (2, 2, 6, 16), lengths [6, 3]: "
             "three padding queries", 2, 2, 6, 6, 16, [6, 3], torch.float16),
    ]


_DEC_ONE, _DEC_THREE, _DEC_PROMPT, _DEC_FLOAT32, _DEC_HALF_ONE, _DEC_HALF_PROMPT = range(6)


def _decode_reference(q, k, v, lengths):
    mask = _decode_mask(q.shape[-2], k.shape[-2], lengths.to(q.device))  # (B, 1, T, S)
    return scaled_dot_product_attention(q, k, v, mask)  # (B, H, T, D); padding queries: zero rows


def _decode_expected(q, k, v, lengths):
    """The answer, computed in float64 from the inputs as given (half precision ones included)."""
    return _decode_reference(q.double(), k.double(), v.double(), lengths)


def _decode_tolerance(q: torch.Tensor, expected: torch.Tensor) -> dict:
    """float64 to rounding; float32 to 1e-5; float16 to 4 units of the output's own rounding.

    Measured on these cases: float16 in float16 throughout (masked_fill with -inf, softmax, matmul), in
    float32 and cast back, or with F.scaled_dot_product_attention: 4e-4 to 1.3e-3, about 1.3 units.
    """
    if q.dtype == torch.float64:
        return {"atol": 1e-9, "rtol": 1e-7}
    if q.dtype == torch.float16:
        return {"atol": 4 * 2.0**-11 * max(1.0, expected.abs().max().item()), "rtol": 0.0}
    return {"atol": 1e-5, "rtol": 1e-4}


def _attend(q, k, v, mask):
    return scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)


def _diagnose_decode(got, q, k, v, lengths, *, overflows: bool = False) -> str | None:
    """``overflows``: another case raised float16's overflow, so the fill is -1e9-like, not finfo.min."""
    T, S = q.shape[-2], k.shape[-2]
    slots = torch.arange(S)
    real = (slots[None, :] >= (S - lengths)[:, None])[:, None, None, :]  # (B, 1, 1, S)
    right_padded = (slots[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S): padding at the end
    bottom_right = slots[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S)
    top_left = slots[None, :] <= torch.arange(T)[:, None]  # (T, S)
    got = got.double()
    if got.isnan().any():
        return (
            "Your result has NaN: a query that is itself padding (the whole prompt of a left-padded sequence) has "
            "no slot to attend to, and softmax over a row of -inf is 0 / 0. Such rows must come out as zeros."
        )
    return first_match(
        got,
        [
            (lambda: _attend(q, k, v, top_left & real),
             "your causal mask is aligned top-left (like is_causal=True), so new query i sees only slots 0..i. The "
             "new queries are the LAST T of S slots: query i sees slots up to S - T + i (bottom-right aligned)."),
            (lambda: _attend(q, k, v, real),
             "you masked the padding but not the future: with several new tokens, the earlier ones see the later "
             "ones. Query i of the new tokens may see slots up to S - T + i."),
            (lambda: _attend(q, k, v, bottom_right[None, None]),
             "your mask ignores lengths: the padding slots at the start of a shorter sequence get weight. Sequence b's "
             "real slots are its last lengths[b]: slots S - lengths[b] .. S - 1."),
            (lambda: _attend(q, k, v, bottom_right & right_padded),
             "you put the padding at the end: this cache is LEFT-padded (so that every sequence's newest token sits "
             "in the last slot). Sequence b's real slots are its last lengths[b]: S - lengths[b] .. S - 1."),
            (lambda: _attend(q, k[..., S - T :, :], v[..., S - T :, :], (bottom_right & real)[..., S - T :]),
             "you attended to the new keys only: the cache holds every earlier key and value, and the new queries "
             "must see them all."),
            (lambda: _attend(q, k, v, (slots[None, :] <= torch.arange(S - T, S)[:, None] - 1) & real),
             "no new query sees its own slot: the diagonal belongs in a causal mask (query i sees slot S - T + i)."),
            (lambda: softmax_with_fill(q, k, v, bottom_right & real),
             "the rows of padding queries should be zeros: a large negative fill (like -1e9) turns a row with nothing "
             "to attend to into an average of every slot. A blocked score needs a value whose exp is exactly 0."
             if overflows else
             "the rows of padding queries should be zeros, not uniform weights: even a fill that fits the dtype, like "
             "torch.finfo(dtype).min, turns a row with nothing to attend to into an average of every slot. A blocked "
             "score needs a value whose exp is exactly 0, and an empty row zero weights."),
        ],
        atol=1e-6,
        rtol=1e-5,
    )


def softmax_with_fill(q, k, v, mask):
    """A large finite fill value: fully masked rows become uniform averages instead of zeros."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    return torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float64).min), dim=-1) @ v


def _judge_decode(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (B, H, T, D) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, k, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    overflows = any("without overflow" in (o.error or "") for o in outcomes)
    for title, indices in (
        ("one new token: every real slot, no padding slot", (_DEC_ONE, _DEC_HALF_ONE)),
        ("several new tokens: bottom-right causal mask and the padding mask", (_DEC_THREE, _DEC_FLOAT32)),
        ("the whole prompt: causal, and padding queries give zero rows (no NaN)", (_DEC_PROMPT, _DEC_HALF_PROMPT)),
    ):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                q, k, v, lengths = case.args
                if outcome.error is not None and "without overflow" in outcome.error:
                    raise Fail(
                        f"{case.name}: your function raised {outcome.error}. A fill value such as -1e9 does not fit "
                        "in float16 (its largest magnitude is 65504): a blocked score needs a value every dtype holds "
                        "(-inf is one: float16, bfloat16, float32 and float64 hold it exactly)."
                    )
                got = returned(outcome, what=case.name)
                expected = _decode_expected(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                hint = lambda: _diagnose_decode(got, *case.args, overflows=overflows) or ""  # only for a wrong answer
                expect_close(got.double(), expected, what=case.name, hint=hint, **_decode_tolerance(q, expected))
    with checklist.check("leaves q, k, v and lengths unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _scores(q, k):
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)


def _decode_top_left(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    real = (torch.arange(S)[None, :] >= (S - lengths)[:, None])[:, None, None, :]  # (B, 1, 1, S)
    return scaled_dot_product_attention(q, k, v, torch.ones(T, S, dtype=torch.bool).tril() & real)  # like is_causal


def _decode_padding_only(q, k, v, lengths):
    S = k.shape[-2]
    real = (torch.arange(S)[None, :] >= (S - lengths)[:, None])[:, None, None, :]  # (B, 1, 1, S)
    return scaled_dot_product_attention(q, k, v, real)


def _decode_ignores_lengths(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    return scaled_dot_product_attention(q, k, v, causal_mask(S, device=q.device)[S - T :])


def _decode_right_padded(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    real = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S): padding at the end
    return scaled_dot_product_attention(q, k, v, causal_mask(S, device=q.device)[S - T :] & real)


def _decode_new_keys_only(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    mask = _decode_mask(T, S, lengths)[..., S - T :]  # (B, 1, T, T)
    return scaled_dot_product_attention(q, k[..., S - T :, :], v[..., S - T :, :], mask)


def _decode_strict(q, k, v, lengths):
    T, S = q.shape[-2], k.shape[-2]
    mask = _decode_mask(T, S, lengths) & torch.ones(T, S, dtype=torch.bool).tril(S - T - 1)  # own slot excluded
    return scaled_dot_product_attention(q, k, v, mask)


def _decode_nan_rows(q, k, v, lengths):
    scores = _scores(q, k).masked_fill(~_decode_mask(q.shape[-2], k.shape[-2], lengths), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # a row of -inf: 0 / 0 = NaN


def _decode_fill_minus_1e9(q, k, v, lengths):
    scores = _scores(q, k).masked_fill(~_decode_mask(q.shape[-2], k.shape[-2], lengths), -1e9)  # raises in float16
    return torch.softmax(scores, dim=-1) @ v


def _decode_fill_finfo_min(q, k, v, lengths):
    scores = _scores(q, k).masked_fill(~_decode_mask(q.shape[-2], k.shape[-2], lengths), torch.finfo(q.dtype).min)
    return torch.softmax(scores, dim=-1) @ v  # padding queries: a uniform average instead of zeros


def _decode_lower_right(q, k, v, lengths):
    from torch.nn.attention.bias import causal_lower_right

    T, S = q.shape[-2], k.shape[-2]
    causal = causal_lower_right(T, S)._materialize(q.device)  # (T, S), True = may attend
    real = (torch.arange(S)[None, :] >= (S - lengths)[:, None])[:, None, None, :]
    return scaled_dot_product_attention(q, k, v, causal & real)


DECODE_ATTENTION = Task(
    id="11.decode_attention",
    title="Attention for the newest tokens of a left-padded batch against its KV cache",
    function_name="decode_attention",
    make_cases=_decode_cases,
    judge=_judge_decode,
    reference=_decode_reference,
    wrong={
        "top-left causal mask (is_causal=True)": Wrong(_decode_top_left, "top-left"),
        "the padding mask only": Wrong(_decode_padding_only, "not the future"),
        "ignores lengths (no padding mask)": Wrong(_decode_ignores_lengths, "ignores lengths"),
        "padding on the right": Wrong(_decode_right_padded, "LEFT-padded"),
        "attends to the new keys only": Wrong(_decode_new_keys_only, "new keys only"),
        "diagonal excluded": Wrong(_decode_strict, "own slot"),
        "softmax over a row of -inf (NaN for padding queries)": Wrong(_decode_nan_rows, "no slot to attend to"),
        "fills with -1e9": Wrong(_decode_fill_minus_1e9, "does not fit in float16"),
        "fills with finfo.min (uniform rows for padding queries)": Wrong(_decode_fill_finfo_min, "even a fill that fits the dtype"),
        "torch's causal_lower_right": Wrong(_decode_lower_right, "you called torch.nn.attention.bias.causal_lower_right",
                                            kind="algorithm"),
    },
    # The task is the cache's mask: a ready-made bottom-right mask does it for the learner. Attention itself
    # (F.scaled_dot_product_attention, the course's) is allowed: exercise 01 was about that.
    forbidden=("torch.nn.attention.bias.causal_lower_right", "attn_course.decode_step"),
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
        Case("bfloat16: x (2, 3, 8, 64) at positions 1000..1003 and 5000..5003",
             (torch.randn(2, 3, 8, 64, generator=gen).to(torch.bfloat16),
              torch.cat([torch.arange(1000, 1004), torch.arange(5000, 5004)]))),
        Case("float16: x (2, 8, 32) at positions 4096..4103",
             (torch.randn(2, 8, 32, generator=gen).to(torch.float16), torch.arange(4096, 4104))),
    ]


_ROT_FROM_0, _ROT_FROM_7, _ROT_SCATTERED, _ROT_FLOAT32, _ROT_BF16, _ROT_FP16 = range(6)
_SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11}


def _low_precision_hint(got: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> str:
    """Say so when the result matches a rotation whose positions and angles were computed in x's dtype."""
    in_dtype = _rotate_pairs(x.double(), positions.to(x.dtype).double(), angle_dtype=x.dtype)  # float64, bad angles
    unit = 2.0 ** -_SIGNIFICANT_BITS[x.dtype] * in_dtype.abs().max().item()
    if tuple(got.shape) == tuple(x.shape) and (got.double() - in_dtype).abs().max().item() <= 8 * unit:
        rounded = positions.to(x.dtype).long()
        return (
            f"Your positions and angles were computed in {x.dtype}: it cannot even hold these positions "
            f"({positions[:4].tolist()} become {rounded[:4].tolist()}), and an angle of thousands of radians in it is "
            "off by whole radians. Compute the positions and angles in float32 or float64 (cos and sin too), and cast "
            "only the result to x.dtype."
        )
    return "At long positions, compute the positions and angles in float32 or float64 and cast only the result to x.dtype."


def _rotary_reference(x, positions):
    # Written out (the library's rotary is forbidden); rotated in float64 and cast once: right in every dtype.
    return _rotate_pairs(x.double(), positions).to(x.dtype)


def _rotary_delegates(x, positions):
    return apply_rotary(x.double(), positions).to(x.dtype)


def _rotary_angles_in_input_dtype(x, positions):
    """Positions, angles, cos and sin in x's dtype: right in float32/64, wrong by radians in bf16/fp16 at 1000+."""
    return _rotate_pairs(x, positions)


def _rotate_pairs(x, positions, *, exponent_step=2, sign=1.0, swap=False, half=False, angle_dtype=None):
    """Variants of the rotation for the diagnosis: a different pairing, frequencies, direction or angle dtype."""
    D = x.shape[-1]
    angle_dtype = x.dtype if angle_dtype is None else angle_dtype
    exponents = torch.arange(D // 2, dtype=angle_dtype) * exponent_step / D  # (D/2,)
    angles = sign * positions.to(angle_dtype)[:, None] * 10000.0 ** -exponents  # (L, D/2)
    angles = angles.to(x.dtype) if angle_dtype != x.dtype else angles
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
                     hint=lambda: _diagnose_rotary(got, x, positions) or "")
    with checklist.check("angles: position * 10000^(-2i/D) on the pair (2i, 2i+1)"):
        for index in (_ROT_FROM_0, _ROT_SCATTERED):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name)
            expected = _rotary_reference(*case.args)
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                         hint=lambda: _diagnose_rotary(got, *case.args) or "")
    with checklist.check("uses the given positions (they need not start at 0)"):
        case, outcome = cases[_ROT_FROM_7], outcomes[_ROT_FROM_7]
        got = returned(outcome, what=case.name)
        expect_close(got, _rotary_reference(*case.args), what=case.name, atol=1e-9, rtol=1e-7,
                     hint=lambda: _diagnose_rotary(got, *case.args) or "")
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
    with checklist.check("bfloat16 and float16 at long positions: angles computed in float32 or float64"):
        for index in (_ROT_BF16, _ROT_FP16):
            case, outcome = cases[index], outcomes[index]
            x, positions = case.args
            got = returned(outcome, what=case.name)
            expect_shape(got, x.shape, what=case.name)
            expect_dtype(got, x.dtype, what=case.name, hint="Cast the rotated result back to x.dtype.")
            reference = _rotary_reference(x.double(), positions)  # the same (rounded) input, rotated in float64
            # Four units of the output's own rounding: honest variants measure 0.5-1.5 (rotating in float64 or
            # float32 and casting once, or casting cos and sin first); angles in x's dtype measure 300-3500.
            unit = 2.0 ** -_SIGNIFICANT_BITS[x.dtype] * reference.abs().max().item()
            expect_close(got, reference, what=case.name, atol=4 * unit, rtol=0.0,
                         hint=_low_precision_hint(got, x, positions))
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
    rotated = _rotate_pairs(x.double(), positions).to(x.dtype)  # right values, in every dtype
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
        "positions and angles in bfloat16/float16": Wrong(
            _rotary_angles_in_input_dtype, "cannot even hold these positions"
        ),
        "calls attn_course.apply_rotary": Wrong(_rotary_delegates, "you called attn_course.apply_rotary", kind="algorithm"),
    },
    forbidden=("attn_course.apply_rotary", "attn_course.RotaryEmbedding", "attn_course.positional.rotary_angles"),
)


# --- 11.rope_generation (stretch) ------------------------------------------------------------
# The learner writes generate(layer, prompt, steps): a toy autoregressive loop around one causal
# self-attention layer (an attn_course.MultiHeadAttention) with rotary positions. The next input
# is the layer's output at the last position. Returns the `steps` generated vectors (B, steps, E).
# The point is the KV cache: keys rotated once at their absolute positions and kept, one new token
# projected per step. Recomputing the whole prefix at every step gives the same values and is
# rejected by the work it does (see the FLOP check).


def _rope_qkv(layer, x: torch.Tensor, start: int, *, rotate=apply_rotary, rotate_values=False, rotate_keys=True):
    """Queries, keys, values ``(B, H, T, D)`` of ``x`` ``(B, T, E)`` at positions ``start ..``, rotated."""
    positions = torch.arange(start, start + x.shape[1], device=x.device)  # (T,)
    q = rotate(split_heads(layer.q_proj(x), layer.num_heads), positions)  # (B, H, T, D)
    k = split_heads(layer.k_proj(x), layer.num_heads)  # (B, H, T, D)
    v = split_heads(layer.v_proj(x), layer.num_heads)  # (B, H, T, D)
    k = rotate(k, positions) if rotate_keys else k
    v = rotate(v, positions) if rotate_values else v
    return q, k, v


def _generate_cached(layer, prompt, steps, *, position=None, see_self=True, **rotation):
    """Cached generation; the keyword arguments put in one classic mistake each (for the catalogue).

    The explicit attention path (``fused=False``): for these tiny shapes PyTorch's fused CPU kernel
    wakes its thread pool at every call, which costs more than the arithmetic on a loaded machine.
    """
    P = prompt.shape[1]
    position = position or (lambda i: P + i - 1)  # the absolute position of the input of step i >= 1
    q, keys, values = _rope_qkv(layer, prompt, 0, **rotation)  # (B, H, P, D) each
    # Only the last prompt position's output is used, and it sees the whole prompt: causal or not, the same.
    context = scaled_dot_product_attention(q, keys, values, is_causal=True, fused=False)  # (B, H, P, D)
    generated = [layer.out_proj(merge_heads(context[:, :, -1:]))]  # [(B, 1, E)]
    for i in range(1, steps):
        q, k, v = _rope_qkv(layer, generated[-1], position(i), **rotation)  # (B, H, 1, D) each
        if see_self:
            keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)  # (B, H, S, D)
            context = scaled_dot_product_attention(q, keys, values, fused=False)  # (B, H, 1, D): one query sees all
        else:
            context = scaled_dot_product_attention(q, keys, values, fused=False)  # the new key is not in the cache yet
            keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        generated.append(layer.out_proj(merge_heads(context)))  # (B, 1, E)
    return torch.cat(generated, dim=1)  # (B, steps, E)


def _generate_reference(layer, prompt, steps):
    with torch.no_grad():
        return _generate_cached(layer, prompt, steps)


def _generate_full_recompute(layer, prompt, steps):
    """Right values, wrong algorithm: the whole prefix projected and attended again at every step."""
    sequence = prompt  # (B, t, E)
    with torch.no_grad():
        for _ in range(steps):
            q, k, v = _rope_qkv(layer, sequence, 0)  # (B, H, t, D) each
            context = scaled_dot_product_attention(q, k, v, is_causal=True, fused=False)  # (B, H, t, D)
            sequence = torch.cat([sequence, layer.out_proj(merge_heads(context))[:, -1:]], dim=1)
    return sequence[:, prompt.shape[1] :]  # (B, steps, E)


def _generation_cases() -> list[Case]:
    def layer(E, H, seed, dtype=torch.float64):
        with torch.random.fork_rng():  # seeded initialisation, without touching the caller's RNG
            torch.manual_seed(seed)
            return MultiHeadAttention(E, H, dtype=dtype)

    randn = seeded_randn(1113)
    return [
        Case("B = 2, E = 16, H = 2, a 3-token prompt, 5 steps, float64", (layer(16, 2, 1), randn(2, 3, 16), 5)),
        Case("B = 1, E = 32, H = 4, a one-token prompt, 6 steps, float64", (layer(32, 4, 2), randn(1, 1, 32), 6)),
        Case("B = 3, E = 16, H = 4, a 5-token prompt, 1 step (the prompt only), float64",
             (layer(16, 4, 3), randn(3, 5, 16), 1)),
        Case("B = 2, E = 64, H = 4, a 4-token prompt, 8 steps, float64", (layer(64, 4, 4), randn(2, 4, 64), 8)),
        Case("float32: B = 2, E = 24, H = 3, a 2-token prompt, 4 steps",
             (layer(24, 3, 5, torch.float32), randn(2, 2, 24, dtype=torch.float32), 4)),
    ]


_GEN_SMALL, _GEN_ONE_TOKEN, _GEN_PREFILL, _GEN_LONG, _GEN_FLOAT32 = range(5)


def _diagnose_generation(got, layer, prompt, steps) -> str | None:
    P = prompt.shape[1]
    with torch.no_grad():
        return first_match(
            got,
            [
                (lambda: _generate_cached(layer, prompt, steps, position=lambda i: 0),
                 "every new token is rotated as if it stood at position 0. Rotate the input of step i at its "
                 "absolute position, P + i - 1 for a prompt of P tokens: positions continue where the cache ends."),
                (lambda: _generate_cached(layer, prompt, steps, position=lambda i: i),
                 "your new tokens' positions do not count the prompt: the input of step i stands at position P + i - 1, "
                 "not i."),
                (lambda: _generate_cached(layer, prompt, steps, rotate_values=True),
                 "you rotated the values too. RoPE rotates queries and keys only (their dot product is what must "
                 "depend on the offset); the values are mixed as they are."),
                (lambda: _generate_cached(layer, prompt, steps, rotate_keys=False),
                 "your keys are not rotated: rotate every key once, at its own position, before it goes into the "
                 "cache."),
                (lambda: _generate_cached(layer, prompt, steps, see_self=False),
                 "each new query attends to the cache before its own key and value are in it: append the new key and "
                 "value first, then attend (a token sees itself)."),
                (lambda: _generate_cached(layer, prompt, steps, rotate=lambda x, p: _rotate_pairs(x, p, half=True)),
                 "you paired feature i with i + D/2 ('rotate half'); this task pairs neighbours (2i, 2i+1), as in "
                 "exercise 11.rotary."),
            ],
            atol=1e-9,
            rtol=1e-7,
        )


def _judge_generation(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, steps, E) in the prompt's dtype"):
        for case, _, got in answered(cases, outcomes):
            _, prompt, steps = case.args
            expect_shape(got, (prompt.shape[0], steps, prompt.shape[2]), what=case.name,
                         hint="Return the generated vectors only, (B, steps, E), not the prompt.")
            expect_dtype(got, prompt.dtype, what=case.name)
    # Generation is graded on its values AND its work: recomputing the prefix at every step gives the right
    # values, so every check that generates more than one step also asks for the work of a cache.
    for title, indices in (
        ("the prompt step: the output at the last prompt position", (_GEN_PREFILL,)),
        ("generation with a cache: every step rotated at its absolute position, one new token projected",
         (_GEN_SMALL, _GEN_LONG)),
        ("a one-token prompt, with a cache", (_GEN_ONE_TOKEN,)),
    ):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                got = returned(outcome, what=case.name)
                expected = _generate_reference(*case.args)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7,
                             hint=lambda: _diagnose_generation(got, *case.args) or "")
                if case.args[2] > 1:
                    _expect_cached_work(outcome, index, what=case.name)
    with checklist.check("each step projects only the new token (the work of cached decoding)"):
        for index in (_GEN_SMALL, _GEN_ONE_TOKEN, _GEN_LONG):
            case = cases[index]
            returned(outcomes[index], what=case.name)
            _expect_cached_work(outcomes[index], index, what=case.name)
    with checklist.check("works in float32, with a cache"):
        case, outcome = cases[_GEN_FLOAT32], outcomes[_GEN_FLOAT32]
        layer, prompt, steps = case.args
        got = returned(outcome, what=case.name)
        expected = _generate_reference(layer.double(), prompt.double(), steps)
        expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-4)
        _expect_cached_work(outcome, _GEN_FLOAT32, what=case.name)
    with checklist.check("leaves the prompt unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _expect_cached_work(outcome, index: int, *, what: str) -> None:
    intended = _cached_flops(index)
    expect_flops_at_most(
        outcome, 2 * intended, what=what, intended=intended,
        hint="That is the work of recomputing the prefix at every step: keep every rotated key and every value "
        "in a cache, and at each step project, rotate and append only the new token.",
    )


@lru_cache(maxsize=None)
def _cached_flops(index: int) -> int:
    """The work of cached generation on case ``index``, counted by the same probe as the learner's.

    Measured on the checked cases (0, 1, 3, 4): honest variants (preallocated ac.KVCache, torch.cat,
    only the last prompt query, the fused kernel) 0.85-1.07 times this; recomputing the prefix at
    every step 3.5-5.8 times, only its keys and values 3.0-4.8 times.
    """
    return int(probe_call(_generate_reference, *_generation_cases()[index].args, measure=("flops",))["flops"])


def _generate_prefix_keys_again(layer, prompt, steps):
    """Right values, wrong algorithm: only the newest query, but every key and value projected again each step."""
    sequence, outputs = prompt, []
    with torch.no_grad():
        for _ in range(steps):
            t = sequence.shape[1]
            _, keys, values = _rope_qkv(layer, sequence, 0)  # (B, H, t, D): the whole prefix again
            q, _, _ = _rope_qkv(layer, sequence[:, -1:], t - 1)  # (B, H, 1, D)
            context = scaled_dot_product_attention(q, keys, values)  # (B, H, 1, D)
            outputs.append(layer.out_proj(merge_heads(context)))  # (B, 1, E)
            sequence = torch.cat([sequence, outputs[-1]], dim=1)
    return torch.cat(outputs, dim=1)


def _generation_wrong(**mistake):
    def generate(layer, prompt, steps):
        with torch.no_grad():
            return _generate_cached(layer, prompt, steps, **mistake)

    return generate


ROPE_GENERATION = Task(
    id="11.rope_generation",
    title="Generation with a KV cache and rotary positions",
    function_name="generate",
    make_cases=_generation_cases,
    judge=_judge_generation,
    reference=_generate_reference,
    wrong={
        "new tokens rotated at position 0": Wrong(_generation_wrong(position=lambda i: 0), "position 0"),
        "positions that do not count the prompt": Wrong(_generation_wrong(position=lambda i: i), "do not count the prompt"),
        "values rotated too": Wrong(_generation_wrong(rotate_values=True), "rotated the values too"),
        "keys not rotated": Wrong(_generation_wrong(rotate_keys=False), "keys are not rotated"),
        "new key appended after attending": Wrong(_generation_wrong(see_self=False), "append the new key"),
        "rotate-half pairing": Wrong(
            _generation_wrong(rotate=lambda x, p: _rotate_pairs(x, p, half=True)), "rotate half"),
        "recomputes the whole prefix at every step": Wrong(
            _generate_full_recompute, "recomputing the prefix at every step", kind="algorithm"
        ),
        "projects every key and value again at every step": Wrong(
            _generate_prefix_keys_again, "recomputing the prefix at every step", kind="algorithm"
        ),
    },
    stretch=True,
    measure=("flops",),
    forbidden=("attn_course.decode_step",),
)
