"""Graded tasks for lesson 08 (training & debugging): attention entropy, QK-norm, the first bad module."""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import scaled_dot_product_attention, stable_softmax
from ...diagnostics import attention_entropy, find_nonfinite
from ...masks import causal_mask
from ..core import Case, Fail, Outcome, Task, Wrong, module_hooks
from ..judging import NOT_IMPLEMENTED, Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned, same, seeded_randn, softmax_over_queries

__all__ = ["ATTENTION_ENTROPY", "QK_NORM_ATTENTION", "FIRST_NONFINITE_MODULE", "FIRST_NONFINITE_GRADIENT"]


def _computed_in_float32(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a float64 answer was computed in float32 and cast back: every value is a float32 number.

    Said only when true (issue 19): an error of float32's size can also come from an ``eps`` (a
    ``+ 1e-6`` on a length, a ``+ 1e-12`` inside a log), which this test does not mistake for float32.
    """
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or not torch.isfinite(got).all():
        return False
    got64, expected64 = got.detach().double(), expected.detach().double()
    as_float32 = lambda t: torch.equal(t, t.float().double())  # noqa: E731
    return as_float32(got64) and not as_float32(expected64) and not torch.equal(got64, expected64)


_FLOAT32_MESSAGE = (
    "Every value you return is a float32 number cast to float64: the computation ran in float32 (e.g. a .float() "
    "on the way). Keep float64 inputs in float64"
)


# --- 08.attention_entropy ------------------------------------------------------------------
# The learner writes attention_entropy(weights) -> (..., L): the entropy of every row of
# attention weights (..., L, S), in nats, with 0 * log 0 taken as 0 (no NaN), and no fudge such
# as the source article's log(w + 1e-9): it biases every row and gives NaN again in float16.


def _entropy_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(808)
    dense = torch.softmax(2 * torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64), dim=-1)  # (B, H, L, S)
    scores = 2 * torch.randn(1, 2, 5, 5, generator=gen, dtype=torch.float64)  # (B, H, L, S)
    causal = stable_softmax(scores.masked_fill(~causal_mask(5), float("-inf")))  # (B, H, L, S), 0 above the diagonal
    edge = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],  # all weight on one key: entropy 0
            [0.0, 0.0, 0.0, 0.0],  # a fully masked row: all weights 0, entropy 0
            [0.25, 0.25, 0.25, 0.25],  # uniform over 4 keys: log 4
            [0.5, 0.0, 0.5, 0.0],  # uniform over 2 keys, 2 masked: log 2
        ],
        dtype=torch.float64,
    )  # (L, S)
    single = torch.softmax(torch.randn(3, 2, 5, generator=gen), dim=-1)  # (B, L, S), float32
    # Low precision, with zero weights: a padded batch (B, H, L, S) whose sequence 1 has 3 real keys,
    # one of its rows fully masked (a padding query), and a causal half-precision batch.
    padded_scores = 3 * torch.randn(2, 2, 4, 7, generator=gen)  # (B, H, L, S)
    allowed = torch.ones(2, 1, 4, 7, dtype=torch.bool)  # (B, 1, L, S)
    allowed[1, :, :, 3:] = False  # sequence 1: keys 3.. are padding
    allowed[1, :, 3] = False  # and its query 3 is padding: a fully masked row
    padded = stable_softmax(padded_scores.masked_fill(~allowed, float("-inf")))  # (B, H, L, S), float32
    causal16 = stable_softmax((3 * torch.randn(2, 3, 6, 6, generator=gen)).masked_fill(~causal_mask(6), float("-inf")))
    return [
        Case("dense weights (2, 3, 4, 6), float64", (dense,)),
        Case("causal weights (1, 2, 5, 5) with zeros above the diagonal, float64", (causal,)),
        Case("edge rows (4, 4): one-hot, all zeros (fully masked), uniform, half masked, float64", (edge,)),
        Case("float32 weights (3, 2, 5)", (single,)),
        Case("float16 padded weights (2, 2, 4, 7): masked keys and a fully masked row", (padded.half(),)),
        Case("float16 causal weights (2, 3, 6, 6) with zeros above the diagonal", (causal16.half(),)),
        Case("bfloat16 padded weights (2, 2, 4, 7): masked keys and a fully masked row", (padded.bfloat16(),)),
    ]


_DENSE, _CAUSAL, _EDGE, _FLOAT32, _PADDED16, _CAUSAL16, _PADDED_BF16 = range(7)
_SIGNIFICANT_BITS = {torch.float16: 11, torch.bfloat16: 8}


def _entropy_tolerance(weights: torch.Tensor, expected: torch.Tensor) -> dict:
    """How close an honest answer gets: float64 to rounding, float32 to 1e-5, half precision to a few of its units.

    Measured: the reference, xlogy, entr, clamp-then-log and float32-then-cast variants are 0 to 3e-16 off in
    float64; in float16 and bfloat16 they are within 1.5 units of the output's own rounding (2^-11, 2^-8 of the
    largest entropy). The source article's log(w + 1e-9) is 6e-9 off in float64 (1e-9 per key): rejected.
    """
    if weights.dtype == torch.float64:
        return {"atol": 1e-12, "rtol": 1e-10}
    if weights.dtype in _SIGNIFICANT_BITS:
        unit = 2.0 ** -_SIGNIFICANT_BITS[weights.dtype] * max(1.0, expected.abs().max().item())
        return {"atol": 4 * unit, "rtol": 0.0}
    return {"atol": 1e-5, "rtol": 1e-4}


def _entropy_shape_hint(got: torch.Tensor, weights: torch.Tensor) -> str:
    if got.dim() == 0:
        return (
            "You returned one number. Return one entropy per row (per query), shape (..., L): an average over "
            "every head and query (like the source article's check) hides one collapsed head among healthy ones."
        )
    if tuple(got.shape) == tuple(weights.shape):
        return "You returned one value per weight: sum -w * log(w) over the keys (dim=-1) to get one value per row."
    if tuple(got.shape) == tuple(weights.shape[:-2]) + (weights.shape[-1],):
        return (
            "You summed over the queries (dim=-2). Each row (one query) is a distribution over the keys: "
            "sum over dim=-1."
        )
    return "Rows are queries: weights (..., L, S) give entropies (..., L)."


def _added_constant(got: torch.Tensor, weights: torch.Tensor) -> float | None:
    """The ``eps`` of ``-(w * log(w + eps)).sum(-1)`` if ``got`` is that (to 2%), else None."""
    if got.shape != weights.shape[:-1] or not torch.isfinite(got).all():
        return None
    expected = attention_entropy(weights.double())  # (..., L)
    count = (weights > 0).sum(-1)  # (..., L): keys with a weight above 0
    lowered = expected - got.double()  # the fudge lowers each row by about eps per such key
    rows = count > 0
    if not rows.any() or not (lowered[rows] > 0).all():
        return None
    eps = lowered[rows] / count[rows]
    if eps.max() > 1e-3 or (eps.max() - eps.min()) > 0.02 * eps.max():
        return None
    return eps.mean().item()


_EPS_GUESSES = (1e-12, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)  # the constants people add


def _added_to_weights(got: torch.Tensor, weights: torch.Tensor) -> float | None:
    """The ``eps`` of ``-((w + eps) * log(w + eps)).sum(-1)`` if ``got`` is that (float64 weights), else None."""
    if weights.dtype != torch.float64 or not isinstance(got, torch.Tensor) or got.shape != weights.shape[:-1]:
        return None
    for eps in _EPS_GUESSES:
        shifted = weights + eps
        if same(got, -(shifted * torch.log(shifted)).sum(-1), atol=1e-14, rtol=1e-12):
            return eps
    return None


def _diagnose_entropy(got: torch.Tensor, weights: torch.Tensor) -> str | None:
    expected = attention_entropy(weights)  # (..., L)
    S = weights.shape[-1]
    found = first_match(
        got,
        [
            (lambda: expected / math.log(2),
             "your entropies are in bits (log base 2). Use the natural log, torch.log, for nats."),
            (lambda: -expected,
             "your entropies are negative: entropy is -sum w log w (log w <= 0, so the minus sign makes it >= 0)."),
            (lambda: expected / S,
             "you averaged over the keys: entropy is a sum over the keys, not a mean."),
            (lambda: expected / math.log(S),
             "you divided by log(S): that is the normalised entropy (0..1). This task asks for plain nats."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )
    if found:
        return found
    eps = _added_constant(got, weights)
    if eps is not None:
        return (
            f"You added about {eps:.0e} inside the log, like the source article's log(w + 1e-9): that lowers every row's "
            "entropy by about that much per key, and in float16 it is no fix at all (1e-9 rounds to 0 there, and "
            "0 * log 0 is NaN again). A zero weight must add exactly 0, and leave every other term as it is."
        )
    eps = _added_to_weights(got, weights)
    if eps is not None:
        return (
            f"You added {eps:g} to every weight before the log, (w + eps) log(w + eps): that changes every term "
            "(a zero weight adds -eps log eps > 0 instead of exactly 0, the others move by about eps (log w + 1)). "
            "A zero weight must add exactly 0, and leave every other term as it is."
        )
    if weights.dtype == torch.float64 and _computed_in_float32(got, expected):
        return (_FLOAT32_MESSAGE + ". Half precision may be computed in float32 and cast back, but never narrow "
                "the input's dtype.")
    return None


def _nan_message(case: Case, weights: torch.Tensor, *, fudged: bool) -> str:
    """Why a result with zero weights is NaN; ``fudged``: the other cases show a constant added inside the log."""
    if fudged and weights.dtype == torch.float16:
        return (
            f"{case.name}: your result has NaN where a row holds zero weights. Adding a tiny constant inside the log "
            "does not help in float16: 1e-9 is below its smallest number and rounds to 0, so the zero weights meet "
            "log 0 again."
        )
    return (
        f"{case.name}: your result has NaN where a row holds zero weights. 0 * log(0) is 0 * -inf = NaN "
        "in floating point, but its limit is 0: a zero weight must add exactly 0 to the sum."
    )


def _judge_entropy(cases, outcomes):
    checklist = Checklist()
    with checklist.check("one entropy per row: shape (..., L), the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            (weights,) = case.args
            expect_shape(got, weights.shape[:-1], what=case.name, hint=_entropy_shape_hint(got, weights))
            expect_dtype(got, weights.dtype, what=case.name)
    fudged = any(  # the other cases show a constant added inside the log (the article's fudge)
        outcomes[i].error is None and isinstance(outcomes[i].returned, torch.Tensor)
        and _added_constant(outcomes[i].returned, cases[i].args[0]) is not None
        for i in range(len(cases)) if cases[i].args[0].dtype == torch.float64
    )
    for title, indices in (
        ("rows without zero weights: -sum w log w, in nats, exactly (no fudge)", (_DENSE, _FLOAT32)),
        ("zero weights (masked keys, fully masked rows) add nothing, and no NaN", (_CAUSAL, _EDGE)),
        ("float16 and bfloat16 with zero weights: no NaN, no fudge", (_PADDED16, _CAUSAL16, _PADDED_BF16)),
    ):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                (weights,) = case.args
                got = returned(outcome, what=case.name)
                expect_shape(got, weights.shape[:-1], what=case.name, hint=_entropy_shape_hint(got, weights))
                if torch.isnan(got).any() and ((weights == 0).any() or weights.dtype == torch.float16):
                    raise Fail(_nan_message(case, weights, fudged=fudged))
                expected = attention_entropy(weights.double())  # the exact entropy of the weights as given
                expect_close(got.double(), expected, what=case.name, hint=lambda: _diagnose_entropy(got, weights) or "",
                             float32_hint=False, **_entropy_tolerance(weights, expected))
    with checklist.check("leaves the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _entropy_reference(weights):
    safe = torch.where(weights > 0, weights, torch.ones_like(weights))  # log 1 = 0 where w = 0
    return -(weights * torch.log(safe)).sum(dim=-1)  # (..., L)


def _entropy_delegates(weights):
    return attention_entropy(weights)


def _entropy_bits(weights):
    safe = torch.where(weights > 0, weights, torch.ones_like(weights))
    return -(weights * torch.log2(safe)).sum(dim=-1)


def _entropy_nan_on_zeros(weights):
    return -(weights * torch.log(weights)).sum(dim=-1)


def _entropy_article_per_row(weights):
    return -(weights * torch.log(weights + 1e-9)).sum(-1)  # the article's fudge, kept per row


def _entropy_eps_on_the_weights(weights):
    wide = weights.to(torch.promote_types(weights.dtype, torch.float32))  # half precision in float32: no NaN there
    return -((wide + 1e-6) * torch.log(wide + 1e-6)).sum(-1).to(weights.dtype)


def _entropy_float64_in_float32(weights):
    narrow = weights.float() if weights.dtype == torch.float64 else weights  # float64 narrowed to float32
    safe = torch.where(narrow > 0, narrow, torch.ones_like(narrow))
    return -(narrow * torch.log(safe)).sum(dim=-1).to(weights.dtype)


def _entropy_no_minus(weights):
    return torch.special.xlogy(weights, weights).sum(dim=-1)


def _entropy_mean_over_keys(weights):
    return -torch.special.xlogy(weights, weights).mean(dim=-1)


def _entropy_over_queries(weights):
    return -torch.special.xlogy(weights, weights).sum(dim=-2)


def _entropy_article_scalar(weights):
    return -(weights * torch.log(weights + 1e-9)).sum(-1).mean()


def _entropy_ones_in_place(weights):
    weights[weights == 0] = 1.0  # right values (1 * log 1 = 0), but the caller's weights are changed
    return -(weights * torch.log(weights)).sum(dim=-1)


def _entropy_normalized(weights):
    safe = torch.where(weights > 0, weights, torch.ones_like(weights))
    return -(weights * torch.log(safe)).sum(dim=-1) / math.log(weights.shape[-1])


ATTENTION_ENTROPY = Task(
    id="08.attention_entropy",
    title="Attention entropy per row",
    function_name="attention_entropy",
    make_cases=_entropy_cases,
    judge=_judge_entropy,
    reference=_entropy_reference,
    wrong={
        "log base 2 (bits)": Wrong(_entropy_bits, "bits"),
        "0 * log 0 gives NaN": Wrong(_entropy_nan_on_zeros, "0 * log(0)"),
        "the article's log(w + 1e-9), per row": Wrong(_entropy_article_per_row, "inside the log"),
        "(w + 1e-6) log(w + 1e-6)": Wrong(_entropy_eps_on_the_weights, "to every weight before the log"),
        "float64 computed in float32": Wrong(
            _entropy_float64_in_float32, "a float32 number cast to float64", kind="contract"
        ),
        "missing minus sign": Wrong(_entropy_no_minus, "negative"),
        "mean over the keys instead of sum": Wrong(_entropy_mean_over_keys, "averaged over the keys"),
        "sums over the queries (dim=-2)": Wrong(_entropy_over_queries, "summed over the queries"),
        "one number for everything (the article's check)": Wrong(_entropy_article_scalar, "You returned one number"),
        "sets zero weights to 1 in place": Wrong(_entropy_ones_in_place, "in place", kind="contract"),
        "normalised by log(S)": Wrong(_entropy_normalized, "normalised entropy"),
        "calls attn_course.attention_entropy": Wrong(
            _entropy_delegates, "you called attn_course.attention_entropy", kind="algorithm"
        ),
    },
    # The task is the entropy with 0 log 0 = 0: the course's diagnostics may not compute it for the learner.
    forbidden=("attn_course.diagnostics.attention_entropy", "attn_course.diagnostics.attention_stats"),
)


# --- 08.qk_norm_attention ------------------------------------------------------------------
# The learner writes qk_norm_attention(q, k, v, scale): attention on unit-length queries and
# keys (Henry et al., 2020), scores = scale * cos(q_i, k_j), no 1/sqrt(D). The scale g multiplies
# the scores (an inverse temperature); "temperature" in the course is always a divisor.


def _qk_cases() -> list[Case]:
    randn = seeded_randn(818)

    zero_query = randn(1, 2, 4, 8, std=5.0)  # (B, H, L, D)
    zero_query[0, 1, 2] = 0.0  # one query vector is exactly zero
    zero_key = randn(2, 3, 8, std=20.0, dtype=torch.float32)  # (B, S, D)
    zero_key[1, 2] = 0.0  # one key vector is exactly zero
    return [
        Case("huge q and k (std 30): q (2, 2, 5, 8), k, v (2, 2, 6, 8), scale 4.0, float64",
             (randn(2, 2, 5, 8, std=30.0), randn(2, 2, 6, 8, std=30.0), randn(2, 2, 6, 8), 4.0)),
        Case("q (3, 4, 16), k (3, 7, 16), v (3, 7, 5), scale 10.0, float64",
             (randn(3, 4, 16), randn(3, 7, 16, std=0.1), randn(3, 7, 5), 10.0)),
        Case("one query vector is all zeros: q (1, 2, 4, 8), k, v (1, 2, 4, 8), scale 2.0, float64",
             (zero_query, randn(1, 2, 4, 8), randn(1, 2, 4, 8), 2.0)),
        Case("float32, one key vector all zeros: q (2, 3, 8), k, v (2, 3, 8), scale 5.0",
             (randn(2, 3, 8, dtype=torch.float32), zero_key, randn(2, 3, 8, dtype=torch.float32), 5.0)),
    ]


_QK_HUGE, _QK_RECT, _QK_ZERO, _QK_FLOAT32 = range(4)


def _unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return F.normalize(x, dim=dim)


def _qk_reference(q, k, v, scale):
    return scaled_dot_product_attention(_unit(q), _unit(k), v, scale=scale)


def _lengthened(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / (|x| + eps)``: the classic ``+ eps`` on the length, which shortens every vector a little."""
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def _diagnose_qk(got, q, k, v, scale) -> str | None:
    D = q.shape[-1]
    for eps in _EPS_GUESSES:
        if q.dtype == torch.float64 and same(
            got, scaled_dot_product_attention(_lengthened(q, eps), _lengthened(k, eps), v, scale=scale),
            atol=1e-13, rtol=1e-11,
        ):
            return (
                f"You divided by the length plus {eps:g}: every vector then comes out a little shorter than 1 "
                "(|x| / (|x| + eps)), so every score is off, not only a zero vector's. Give the length a floor "
                "that leaves every length above it exactly as it is."
            )
    found = first_match(
        got,
        [
            (lambda: scaled_dot_product_attention(_unit(q), _unit(k), v, scale=scale / math.sqrt(D)),
             "you scaled by 1/sqrt(D) as well. With unit vectors the scores are cosines in [-1, 1]; the scale g "
             "alone sets how sharp the softmax can get, so drop the 1/sqrt(D)."),
            (lambda: scaled_dot_product_attention(_unit(q), _unit(k), v, scale=1.0 / scale),
             "you divided by the scale. Here g multiplies the cosines (an inverse temperature): "
             "scores = g * cos(q_i, k_j)."),
            (lambda: scaled_dot_product_attention(_unit(q, -2), _unit(k, -2), v, scale=scale),
             "you normalised over the sequence axis (dim=-2). Normalise each query and key vector over its features "
             "(dim=-1)."),
            (lambda: scaled_dot_product_attention(_unit(q), k, v, scale=scale),
             "you normalised q but not k: both must have unit length, or large keys still saturate the softmax."),
            (lambda: scaled_dot_product_attention(q, _unit(k), v, scale=scale),
             "you normalised k but not q: both must have unit length, or large queries still saturate the softmax."),
            (lambda: scaled_dot_product_attention(q, k, v, scale=scale),
             "your q and k are not normalised at all: each vector must have unit length before the dot product."),
            (lambda: softmax_over_queries(_unit(q), _unit(k), v, scale=scale),
             "your softmax runs over the queries (dim=-2). Each query's weights over the keys must sum to 1 (dim=-1)."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )
    if found:
        return found
    if q.dtype == torch.float64 and _computed_in_float32(got, _qk_reference(q, k, v, scale)):
        return _FLOAT32_MESSAGE + "."
    return None


def _judge_qk(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, k, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    with checklist.check("scores are scale * cosine similarity (huge inputs cannot saturate)"):
        for index in (_QK_HUGE, _QK_RECT):
            case, outcome = cases[index], outcomes[index]
            got = returned(outcome, what=case.name)
            expected = _qk_reference(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, float32_hint=False,
                         hint=lambda: _diagnose_qk(got, *case.args) or "")
    with checklist.check("a zero query vector gives a finite (uniform) row, not NaN"):
        case, outcome = cases[_QK_ZERO], outcomes[_QK_ZERO]
        got = returned(outcome, what=case.name)
        expected = _qk_reference(*case.args)
        expect_shape(got, expected.shape, what=case.name)
        if torch.isnan(got).any():
            raise Fail(
                f"{case.name}: NaN where the query is all zeros. Its length is 0 and 0 / 0 = NaN: a zero vector must stay "
                "zero, so the length you divide by needs a small floor (as F.normalize has)."
            )
        expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, float32_hint=False,
                     hint=lambda: _diagnose_qk(got, *case.args) or "")
    with checklist.check("works in float32"):
        case, outcome = cases[_QK_FLOAT32], outcomes[_QK_FLOAT32]
        got = returned(outcome, what=case.name)
        expected = _qk_reference(*(x.double() if isinstance(x, torch.Tensor) else x for x in case.args))
        expect_shape(got, expected.shape, what=case.name)
        expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-4)
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _qk_extra_sqrt_d(q, k, v, scale):
    q, k = _unit(q), _unit(k)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _qk_divides(q, k, v, scale):
    q, k = _unit(q), _unit(k)
    return torch.softmax((q @ k.transpose(-2, -1)) / scale, dim=-1) @ v


def _qk_wrong_axis(q, k, v, scale):
    q, k = F.normalize(q, dim=-2), F.normalize(k, dim=-2)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def _qk_only_q(q, k, v, scale):
    q = _unit(q)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def _qk_nan_for_zero(q, k, v, scale):
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def _qk_eps_on_the_length(q, k, v, scale):
    q = q / (q.norm(dim=-1, keepdim=True) + 1e-3)  # no NaN for a zero vector, but every vector a little short
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-3)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def _qk_not_normalised(q, k, v, scale):
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def _qk_normalises_in_place(q, k, v, scale):
    q /= q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k /= k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


QK_NORM_ATTENTION = Task(
    id="08.qk_norm_attention",
    title="QK-norm attention (a cure for entropy collapse)",
    function_name="qk_norm_attention",
    make_cases=_qk_cases,
    judge=_judge_qk,
    reference=_qk_reference,
    wrong={
        "scales by 1/sqrt(D) as well": Wrong(_qk_extra_sqrt_d, "1/sqrt(D) as well"),
        "divides by the scale": Wrong(_qk_divides, "divided by the scale"),
        "normalises over the sequence axis": Wrong(_qk_wrong_axis, "sequence axis"),
        "normalises q only": Wrong(_qk_only_q, "but not k"),
        "NaN for a zero vector": Wrong(_qk_nan_for_zero, "0 / 0 = NaN"),
        "no normalisation": Wrong(_qk_not_normalised, "not normalised at all"),
        "adds 1e-3 to each length": Wrong(_qk_eps_on_the_length, "a little shorter than 1"),
        "normalises q and k in place": Wrong(_qk_normalises_in_place, "in place", kind="contract"),
    },
)


# --- 08.first_nonfinite_module -------------------------------------------------------------
# The learner writes first_nonfinite_module(model, x): run model(x) once and return the
# qualified name (as in model.named_modules()) of the first module, in execution order,
# whose output holds a NaN or an inf; None if every output is finite.


class _Log(nn.Module):
    """``log(x)``: NaN for negative inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class _Exp(nn.Module):
    """``exp(x)``: inf once x exceeds about 88 (float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class _Block(nn.Module):
    """A pre-norm residual MLP block, ``x + mlp(norm(x))``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.mlp = nn.Sequential(nn.Linear(features, 2 * features), nn.GELU(), nn.Linear(2 * features, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    """Embedding layer, a few blocks, a read-out: containers nested three deep."""

    def __init__(self, features: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, features)
        self.blocks = nn.ModuleList(_Block(features) for _ in range(depth))
        self.head = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _DefinedOutOfOrder(nn.Module):
    """``late`` is defined first but runs second: named_modules() order is not execution order."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(4, 3)
        self.early = _Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x))


class _OverflowingModel(nn.Module):
    """Every submodule's output is finite; the model's own forward then overflows float32 (1e30 * 1e30)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(x)) * 1e30 * 1e30  # the model itself makes the inf: its name is ""


class _DividedNet(_Net):
    """The nested model of the other cases, whose own forward ends by dividing by 0 (inf and NaN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / 0.0


class _LogBlock(nn.Module):
    """A container whose own forward makes the NaN: ``log(inner(x) - 100)``, after ``inner`` returned finite values."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.inner(x) - 100.0)


def _nonfinite_cases() -> list[Case]:
    with torch.random.fork_rng():  # seeded module initialisation, without touching the caller's RNG
        torch.manual_seed(0)
        return _build_nonfinite_cases()


def _build_nonfinite_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(888)
    x = torch.randn(5, 4, generator=gen)  # (N, 4)
    sequential = nn.Sequential(nn.Linear(4, 8), _Log(), nn.Linear(8, 2))
    nested = _Net()
    with torch.no_grad():  # one layer deep inside block 1 overflows float32 to inf
        signs = torch.randint(0, 2, nested.blocks[1].mlp[0].weight.shape, generator=gen) * 2.0 - 1.0
        nested.blocks[1].mlp[0].weight.copy_(signs * 1e38)
    overflow = nn.Sequential(nn.Linear(4, 4), _Exp(), nn.Softmax(dim=-1))
    with torch.no_grad():
        overflow[0].weight.mul_(100.0)
    healthy = _Net()
    positive = x.abs() + 0.5  # log of these is finite; a negative one makes `early` produce NaN
    positive[2, 1] = -1.0
    return [
        Case("nn.Sequential(Linear, Log, Linear) on inputs (5, 4)", (sequential, x)),
        Case("a nested model (embed, blocks.0-2, head) whose blocks.1 overflows to inf", (nested, x)),
        Case("nn.Sequential(Linear, Exp, Softmax): exp overflows to inf, softmax then gives NaN", (overflow, x)),
        Case("a model whose submodules run in a different order than they are defined",
             (_DefinedOutOfOrder(), positive)),
        Case("a healthy model (every output finite)", (_Net(), x)),
        Case("a model whose own forward overflows to inf after every submodule returned finite values",
             (_OverflowingModel(), x)),
        Case("nn.Sequential(Linear, a block whose own forward takes a log of negative values, Linear)",
             (nn.Sequential(nn.Linear(4, 8), _LogBlock(), nn.Linear(8, 2)), x)),
        Case("a nested model (embed, blocks.0-2, head) whose own forward divides the head's output by 0",
             (_DividedNet(), x)),
    ]


_SEQUENTIAL, _NESTED, _OVERFLOW, _ORDER, _HEALTHY, _ITSELF, _CONTAINER, _ITSELF_NESTED = range(8)


def _first_nonfinite_reference(model, x):
    """The judge's answer: the library's NaN hunter (which prints the model itself as "(model)"; its name is "")."""
    with find_nonfinite(model) as tracker:
        model(x)
    event = tracker.first
    if event is None:
        return None
    return "" if event.name == "(model)" else event.name


def _first_nonfinite_written_out(model, x):
    """The task's reference: forward hooks, written out (the library's find_nonfinite is forbidden)."""
    bad, handles = [], []
    for name, module in model.named_modules():
        def hook(module, args, output, name=name):
            if not bad and not torch.isfinite(output).all():
                bad.append(name)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return bad[0] if bad else None


def _nonfinite_delegates(model, x):
    return _first_nonfinite_reference(model, x)


def _bad_modules(model: nn.Module, x: torch.Tensor) -> dict[str, list[str]]:
    """What the classic mistakes would name, worked out by the judge on its own copy of the case."""
    found: dict[str, list[str]] = {"output": [], "nan_output": [], "input": []}
    handles = []

    def make(name):
        def pre_hook(module, args):
            if any(isinstance(a, torch.Tensor) and not torch.isfinite(a).all() for a in args):
                found["input"].append(name)

        def hook(module, args, output):
            if not torch.isfinite(output).all():
                found["output"].append(name)
            if torch.isnan(output).any():
                found["nan_output"].append(name)

        return pre_hook, hook

    for name, module in model.named_modules():
        pre_hook, hook = make(name)
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _forward_predictions(case: Case) -> dict[str, object]:
    """What each classic mistake would return on this case (the keys name the causes _diagnose_nonfinite says)."""
    model, x = case.args
    names = [name for name, _ in model.named_modules()]
    found = _bad_modules(model, x)
    inputs = [name for name in found["input"] if name != ""]
    leaves = {name for name, module in model.named_modules() if next(module.children(), None) is None}
    return {
        "leaves": next((name for name in found["output"] if name in leaves), None),
        "skip_model": next((name for name in found["output"] if name != ""), None),
        "last": found["output"][-1] if found["output"] else None,
        "isnan": found["nan_output"][0] if found["nan_output"] else None,
        "definition": next((name for name in names if name in found["output"] and name != ""), None),
        "input": inputs[0] if inputs else None,
        "nothing": None,
    }


def _diagnose_nonfinite(got: object, case: Case, expected: str | None, others=()) -> str:
    """Why ``got`` is wrong on this case: the first classic mistake that names it here and fits every other answer.

    ``others`` holds ``(case, answer)`` for the other cases: a cause the learner's other answers rule out
    is not said (issue 20), since two mistakes can name the same module on one case.
    """
    model, x = case.args
    names = [name for name, _ in model.named_modules()]
    predicted = _forward_predictions(case)

    def fits(cause: str) -> bool:
        return predicted[cause] == got and all(_forward_predictions(c)[cause] == a for c, a in others)

    if expected is None:
        return f"every output of this model is finite, yet you named {got!r}. Return None when nothing is non-finite."
    if got == "(model)" and expected == "":
        return ("the model itself is the culprit, but its name in model.named_modules() is \"\" (find_nonfinite "
                "prints it as '(model)'): return \"\".")
    if fits("leaves"):
        where = "the model itself (name \"\")" if expected == "" else f"{expected!r}, a module with submodules,"
        return (
            f"you named {got!r}, but {where} made the bad value in its own forward, after its submodules returned "
            "finite outputs. You watched only the leaf modules (those without children): a container's or the "
            "model's own code can make a NaN/inf too, so watch every module that model.named_modules() lists."
        )
    if expected == "" and fits("skip_model"):
        return (
            f"{'you found nothing' if got is None else f'you named {got!r}'}, but the model itself (its name in "
            "model.named_modules() is \"\") made the inf in its own forward, after every submodule returned finite "
            "values. The model is a module too: watch it as well, and return \"\" when it is the first to report."
        )
    if got is None:
        story = (" The parameters here are all finite: it is the activations that go bad, so it is each module's "
                 "OUTPUT that must be checked." if fits("nothing") else "")
        who = 'the model itself (name "")' if expected == "" else f"module {expected!r}"
        return f"you found nothing, but {who} outputs NaN/inf.{story}"
    if got not in names and got != "(model)":
        return f"{got!r} is not a module name: return a name from model.named_modules(), e.g. {expected!r}."
    container = got in ("", "(model)") or expected.startswith(got + ".")
    who = "the model itself" if got in ("", "(model)") else repr(got)
    if fits("definition"):
        return (
            f"you named {got!r}, the first bad module in definition order (model.named_modules()"
            + (", which lists a container before its children" if container else "")
            + f"), but {expected!r} RAN first and made the bad value. Execution order is the order the hooks fire."
        )
    if container and fits("last"):
        return (
            f"you named {who}, a container around the culprit {expected!r}. Forward hooks run when a module "
            "FINISHES, innermost first, so a container reports after its children: the first module to report is "
            "the one that produced the bad value."
        )
    if fits("isnan"):
        return (
            f"you named {got!r}, the first module with a NaN, but {expected!r} ran earlier and produced an inf. "
            "inf is just as broken (the NaN came from it): a test for NaN alone misses it."
        )
    if fits("input"):
        return (
            f"you named {got!r}, whose INPUT was already bad: the culprit is the module before it, {expected!r}. "
            "It is a module's output that shows whether it made the bad value."
        )
    if container:
        return f"you named {who}, a container around the culprit {expected!r}: name the innermost module."
    return f"you named {got!r}; the first module whose output holds NaN/inf is {expected!r}."


def _hooks_after(outcome: Outcome) -> dict | None:
    """The hooks left on the model after the call (``module_hooks``), from the model itself or its saved record."""
    after = outcome.args_after[0] if outcome.args_after else None
    if isinstance(after, nn.Module):
        return module_hooks(after)
    hooks = after.get("hooks") if isinstance(after, dict) else None
    if isinstance(hooks, dict) and all(isinstance(k, str) and isinstance(v, (list, tuple)) and len(v) == 4
                                       and all(type(n) is int for n in v) for k, v in hooks.items()):
        return {k: list(v) for k, v in hooks.items()}
    return None


_HOOK_KINDS = ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook")


def _check_hooks_removed(checklist: Checklist, cases, outcomes, registered: str) -> None:
    """One check: after every call the model holds the hooks it held before (none), so they cannot pile up."""
    with checklist.check("removes its hooks: none are left on the model after the call"):
        for case, outcome in zip(cases, outcomes):
            if outcome.not_implemented:
                raise Fail(NOT_IMPLEMENTED)
            before, after = module_hooks(case.args[0]), _hooks_after(outcome)
            if after is None:
                raise Fail(f"{case.name}: the grader could not read which hooks were left on the model.")
            left = {name: [a - b for a, b in zip(counts, before.get(name, [0, 0, 0, 0]))]
                    for name, counts in after.items()}
            left = {name: counts for name, counts in left.items() if any(counts)}
            if left:
                name, counts = next(iter(left.items()))
                kind = _HOOK_KINDS[next(i for i, n in enumerate(counts) if n)]
                where = repr(name) if name else "the model itself"
                raise Fail(
                    f"{case.name}: after your function returned, {sum(map(sum, left.values()))} hook(s) were still "
                    f"registered on the model (e.g. a {kind} on {where}). Every call would add "
                    f"another set that keeps firing on every later forward pass: keep the handle each {registered} "
                    "returns and remove it when you are done, also when model(x) raises."
                )


def _judge_nonfinite(cases, outcomes):
    checklist = Checklist()
    expected = [_first_nonfinite_reference(*case.args) for case in cases]

    def answer(index: int) -> object:
        outcome = outcomes[index]
        if outcome.not_implemented:
            raise Fail(NOT_IMPLEMENTED)
        if outcome.error is not None:
            raise Fail(f"{cases[index].name}: your function raised {outcome.error}")
        return outcome.returned

    with checklist.check("returns a module name (str) or None"):
        for index, case in enumerate(cases):
            got = answer(index)
            if got is not None and not isinstance(got, str):
                raise Fail(
                    f"{case.name}: you returned a {type(got).__name__}; return the module's name (a str) or None."
                )
    for title, indices in (
        ("names the culprit in a plain nn.Sequential", (_SEQUENTIAL,)),
        ("nested model: the innermost module that made the inf, not a container", (_NESTED,)),
        ("an inf counts, not only a NaN", (_OVERFLOW,)),
        ("execution order, not definition order", (_ORDER,)),
        ("a healthy model gives None", (_HEALTHY,)),
        ("the model itself is a module too: its name is \"\"", (_ITSELF, _ITSELF_NESTED)),
        ("a container's own forward can make the bad value, not only the leaf modules", (_CONTAINER,)),
    ):
        with checklist.check(title):
            for index in indices:
                got = answer(index)
                if got != expected[index]:
                    others = _other_answers(cases, outcomes, index)
                    raise Fail(f"{cases[index].name}: "
                               f"{_diagnose_nonfinite(got, cases[index], expected[index], others)}")
    _check_hooks_removed(checklist, cases, outcomes, "register_forward_hook")
    return checklist.results


def _other_answers(cases, outcomes, index):
    """``(case, answer)`` for every other case that returned a module name or None: what a diagnosis compares with."""
    return [(cases[i], outcomes[i].returned) for i in range(len(cases)) if i != index
            and outcomes[i].error is None and not outcomes[i].not_implemented
            and (outcomes[i].returned is None or isinstance(outcomes[i].returned, str))]


def _record_with_hooks(model, x, *, test, use_pre_hook=False):
    """Helper for the catalogue: names, in hook order, of modules whose output (or input) fails ``test``."""
    bad, handles = [], []
    for name, module in model.named_modules():
        if use_pre_hook:
            def pre_hook(module, args, name=name):
                if any(isinstance(a, torch.Tensor) and test(a) for a in args):
                    bad.append(name)

            handles.append(module.register_forward_pre_hook(pre_hook))
        else:
            def hook(module, args, output, name=name):
                if test(output):
                    bad.append(name)

            handles.append(module.register_forward_hook(hook))
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return bad


def _nonfinite(t: torch.Tensor) -> bool:
    return not bool(torch.isfinite(t).all())


def _nonfinite_last_reported(model, x):
    bad = _record_with_hooks(model, x, test=_nonfinite)
    return bad[-1] if bad else None


def _nonfinite_isnan_only(model, x):
    bad = _record_with_hooks(model, x, test=lambda t: bool(torch.isnan(t).any()))
    return bad[0] if bad else None


def _nonfinite_first_bad_input(model, x):
    bad = _record_with_hooks(model, x, test=_nonfinite, use_pre_hook=True)
    bad = [name for name in bad if name != ""]
    return bad[0] if bad else None


def _nonfinite_definition_order(model, x):
    bad = set(_record_with_hooks(model, x, test=_nonfinite))
    return next((name for name, _ in model.named_modules() if name in bad and name != ""), None)


def _nonfinite_leaves_only(model, x):
    leaves = {name for name, module in model.named_modules() if next(module.children(), None) is None}
    bad = [name for name in _record_with_hooks(model, x, test=_nonfinite) if name in leaves]
    return bad[0] if bad else None


def _nonfinite_skips_the_model(model, x):
    bad = [name for name in _record_with_hooks(model, x, test=_nonfinite) if name != ""]
    return bad[0] if bad else None


def _nonfinite_keeps_its_hooks(model, x):
    bad = []
    for name, module in model.named_modules():  # never removed: every call adds one more hook per module
        module.register_forward_hook(
            lambda module, args, output, name=name: bad.append(name) if _nonfinite(output) else None
        )
    model(x)
    return bad[0] if bad else None


def _nonfinite_checks_parameters(model, x):
    model(x)
    for name, module in model.named_modules():
        if any(not torch.isfinite(p).all() for p in module.parameters(recurse=False)):
            return name
    return None


FIRST_NONFINITE_MODULE = Task(
    id="08.first_nonfinite_module",
    title="Find the first module that outputs NaN/inf",
    function_name="first_nonfinite_module",
    make_cases=_nonfinite_cases,
    judge=_judge_nonfinite,
    reference=_first_nonfinite_written_out,
    wrong={
        "returns the last module to report (a container)": Wrong(_nonfinite_last_reported, "reports after its children"),
        "tests isnan only": Wrong(_nonfinite_isnan_only, "a test for NaN alone misses it"),
        "reports the first bad input": Wrong(_nonfinite_first_bad_input, "INPUT was already bad"),
        "definition order instead of execution order": Wrong(_nonfinite_definition_order, "the first bad module in definition order"),
        "checks the parameters, not the outputs": Wrong(_nonfinite_checks_parameters, "it is the activations that go bad"),
        "hooks on the leaf modules only": Wrong(_nonfinite_leaves_only, "You watched only the leaf modules"),
        "skips the model itself (name \"\")": Wrong(_nonfinite_skips_the_model, "The model is a module too"),
        "never removes its hooks": Wrong(_nonfinite_keeps_its_hooks, "were still registered", kind="contract"),
        "calls attn_course.find_nonfinite": Wrong(
            _nonfinite_delegates, "you called attn_course.find_nonfinite", kind="algorithm"
        ),
    },
    forbidden=("attn_course.diagnostics.find_nonfinite",),
)



# --- 08.first_nonfinite_gradient (stretch) ---------------------------------------------------
# The learner writes first_nonfinite_gradient(model, x): run model(x).sum().backward() once and
# return the qualified name of the first module, in the order the backward pass reaches them,
# whose gradient with respect to its input (what it passes back) holds a NaN or an inf; None if
# every such gradient is finite. The forward pass is finite in every case: these are the bugs a
# forward hook cannot see (lesson 08, 4.1: a finite loss with a NaN gradient).


class _ClampedNorm(nn.Module):
    """RMS normalisation with the clamp AFTER the square root: finite forward, NaN backward on a zero row.

    ``sqrt`` has an infinite slope at 0; the clamp passes back a zero gradient there, and
    ``0 * inf`` is NaN. (Clamping the mean square before the root, or adding eps inside it, is right.)
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-6)


class _Sqrt(nn.Module):
    """``sqrt(x)`` for x >= 0: the gradient at exactly 0 is inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class _Clamp(nn.Module):
    """``x.clamp(-1, 1)``: passes back a zero gradient where it clamped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1.0, 1.0)


class _Acos(nn.Module):
    """``acos(x)``: finite on [-1, 1], but its slope is infinite at exactly -1 and 1 (a clamped cosine)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.acos(x)


class _NormBlock(nn.Module):
    """A pre-norm residual MLP block, ``x + mlp(norm(x))``, with the faulty norm."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.norm = _ClampedNorm()
        self.mlp = nn.Sequential(nn.Linear(features, 2 * features), nn.GELU(), nn.Linear(2 * features, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _NormNet(nn.Module):
    """Embedding without bias (a zero input row stays zero), three blocks, a read-out."""

    def __init__(self, features: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, features, bias=False)
        self.blocks = nn.ModuleList(_NormBlock(features) for _ in range(depth))
        self.head = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _BackwardOutOfOrder(nn.Module):
    """Defined ``inner``, ``head``, ``culprit``, ``outer`` but run ``outer -> inner -> culprit -> head``.

    ``culprit`` (the faulty norm, on a zero row) passes back NaN; ``inner``, which runs before it,
    then passes the damage on -- and is defined first.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 2)
        self.culprit = _ClampedNorm()
        self.outer = nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.culprit(self.inner(self.outer(x))))


class _BackwardOutOfOrderDeep(nn.Module):
    """Defined ``second``, ``head``, ``culprit``, ``first``, ``entry`` but run ``entry -> first -> second -> culprit -> head``.

    ``culprit`` passes back NaN, and ``second`` then ``first`` pass it on: the last module to report
    (``first``) is not the first bad one in definition order (``second``), which tells those two bugs apart.
    """

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 2)
        self.culprit = _ClampedNorm()
        self.first = nn.Linear(8, 8, bias=False)
        self.entry = nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.culprit(self.second(self.first(self.entry(x)))))


def _gradient_cases() -> list[Case]:
    with torch.random.fork_rng():  # seeded module initialisation, without touching the caller's RNG
        torch.manual_seed(8)
        return _build_gradient_cases()


def _build_gradient_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(880)
    x = 3 * torch.randn(6, 4, generator=gen)  # (N, 4): large enough that some cosines get clamped
    x[2] = 0.0  # a zero row: the faulty norm's mean square is exactly 0 there
    plain = nn.Sequential(nn.Linear(4, 8, bias=False), _ClampedNorm(), nn.Linear(8, 2))
    clamped_acos = nn.Sequential(nn.Linear(4, 8), _Clamp(), _Acos(), nn.Linear(8, 2))
    relu_sqrt = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), _Sqrt(), nn.Linear(8, 2))
    return [
        Case("nn.Sequential(Linear, a norm that clamps after the square root, Linear), one input row all zeros",
             (plain, x)),
        Case("a nested model (embed, blocks.0-2 with that norm, head), one input row all zeros", (_NormNet(), x)),
        Case("nn.Sequential(Linear, clamp(-1, 1), acos, Linear): acos has an infinite slope at +-1", (clamped_acos, x)),
        Case("nn.Sequential(Linear, ReLU, sqrt, Linear): sqrt(0) = 0, but its slope there is infinite", (relu_sqrt, x)),
        Case("a model whose modules run in another order than they are defined, one input row all zeros",
             (_BackwardOutOfOrder(), x)),
        Case("a healthy model (every gradient finite)", (_Net(), x)),
        Case("a deeper model run in another order than defined: two modules pass the NaN on, one input row all zeros",
             (_BackwardOutOfOrderDeep(), x)),
    ]


_G_PLAIN, _G_NESTED, _G_ACOS, _G_SQRT, _G_ORDER, _G_HEALTHY, _G_ORDER_DEEP = range(7)


def _first_nonfinite_gradient_reference(model, x):
    """The judge's answer: the library's NaN hunter, watching the backward pass."""
    with find_nonfinite(model, backward=True) as tracker:
        model(x).sum().backward()
    event = tracker.first_backward
    return None if event is None else event.name


def _first_nonfinite_gradient_written_out(model, x):
    """The task's reference: full backward hooks, written out (find_nonfinite is forbidden)."""
    bad = _gradient_hooks(model, x, test=_nonfinite)
    return bad[0] if bad else None


def _gradient_delegates(model, x):
    return _first_nonfinite_gradient_reference(model, x)


def _backward_reports(model: nn.Module, x: torch.Tensor) -> dict[str, list[str]]:
    """What the classic mistakes would name, worked out by the judge on its own copy of the case.

    ``input``: modules whose grad_input is non-finite, in the order backward reports them;
    ``nan_input``: the same with NaN only; ``output``: modules whose grad_output is non-finite;
    ``parameters``: modules with a non-finite parameter gradient, in definition order.
    """
    found: dict[str, list[str]] = {"input": [], "nan_input": [], "output": [], "parameters": []}
    handles = []

    def bad(grads, test) -> bool:
        return any(isinstance(g, torch.Tensor) and test(g) for g in grads)

    for name, module in model.named_modules():
        def hook(module, grad_input, grad_output, name=name or "(model)"):
            if bad(grad_input, lambda g: not torch.isfinite(g).all()):
                found["input"].append(name)
            if bad(grad_input, lambda g: torch.isnan(g).any()):
                found["nan_input"].append(name)
            if bad(grad_output, lambda g: not torch.isfinite(g).all()):
                found["output"].append(name)

        handles.append(module.register_full_backward_hook(hook))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    for name, module in model.named_modules():
        if any(p.grad is not None and not torch.isfinite(p.grad).all() for p in module.parameters(recurse=False)):
            found["parameters"].append(name)
    return found


def _cause_predictions(case: Case) -> dict[str, object]:
    """What each classic mistake would return on this case (the keys name the causes _diagnose_gradient says)."""
    model, x = case.args
    model = copy.deepcopy(model)
    names = [name for name, _ in model.named_modules()]
    found = _backward_reports(model, x)
    return {
        "last": found["input"][-1] if found["input"] else None,
        "isnan": found["nan_input"][0] if found["nan_input"] else None,
        "grad_output": found["output"][0] if found["output"] else None,
        "definition": next((name for name in names if name in found["input"]), None),
        "parameters": found["parameters"][0] if found["parameters"] else None,
        "forward": None,  # the forward pass is finite on every case
    }


def _ruled_out(cause: str, others) -> bool:
    """Whether the learner's answers on the other cases contradict ``cause`` (issue 20: say only what fits)."""
    return any(_cause_predictions(case)[cause] != got for case, got in others)


def _diagnose_gradient(got: object, case: Case, expected: str | None, others=()) -> str:
    model, x = case.args
    model = copy.deepcopy(model)  # the judge's own copy: the case stays as it was built
    names = [name for name, _ in model.named_modules()]
    found = _backward_reports(model, x)
    if got is None:
        hint = f"you found nothing, but module {expected!r} passes back a non-finite gradient."
        if not _ruled_out("forward", others):
            hint += (" The forward pass is finite here: the bad values appear in the backward pass, in what each "
                     "module passes back (the gradient with respect to its inputs, grad_input of a full backward hook).")
        elif found["input"] and not found["nan_input"] and not _ruled_out("isnan", others):
            hint += " The gradient here is inf, not NaN: a test for NaN alone misses it."
        return hint
    if expected is None:
        return f"every gradient of this model is finite, yet you named {got!r}. Return None when nothing is non-finite."
    if got not in names and got != "(model)":
        return f"{got!r} is not a module name: return a name from model.named_modules(), e.g. {expected!r}."
    container = got in ("", "(model)") or expected.startswith(got + ".")
    if container and found["input"] and got == found["input"][-1] and not _ruled_out("last", others):
        who = "the model itself" if got in ("", "(model)") else repr(got)
        return (
            f"you named {who}, a container around the culprit {expected!r}. A container's backward hook fires after "
            "its children's (it sees the gradient with respect to the container's input, which is computed last): "
            "the first module to report is the one that made the bad value."
        )
    # Several mistakes can name the same module on one case: say the first one the other answers do not rule out.
    causes = []
    if found["input"] and got == found["input"][-1] and not _ruled_out("last", others):
        causes.append(
            "you kept the LAST module to report; a NaN spreads backwards to every module before the culprit, so "
            "keep the first one whose hook reports"
        )
    if found["nan_input"] and got == found["nan_input"][0] and not _ruled_out("isnan", others):
        causes.append(
            f"{got!r} is the first module to pass back a NaN, but {expected!r} passed back an inf before it, which "
            "is just as broken (the NaN came from it): a test for NaN alone misses it"
        )
    if found["output"] and got == found["output"][0] and not _ruled_out("grad_output", others):
        causes.append(
            f"the gradient ARRIVING at {got!r} from later layers (grad_output) was already bad: check grad_input, "
            "what each module passes back"
        )
    definition_first = next((name for name in names if name in found["input"]), None)
    if got == definition_first and not _ruled_out("definition", others):
        causes.append(
            "backward runs from the loss towards the input: the first module is the first whose hook fires, not "
            "the first in definition order (model.named_modules())"
        )
    if got in found["parameters"] and not _ruled_out("parameters", others):
        causes.append(
            f"{got!r}'s parameters got non-finite gradients, but a NaN spreads to every parameter before the culprit: "
            "it is the gradients flowing between modules that show where the bad value was made"
        )
    lead = f"you named {got!r}; the first module to pass back a NaN/inf gradient is {expected!r}."
    if not causes:
        return lead + (" Name the innermost module, not a container." if container else "")
    return lead + " " + causes[0][0].upper() + causes[0][1:] + "."


def _judge_gradient(cases, outcomes):
    checklist = Checklist()
    expected = [_first_nonfinite_gradient_reference(copy.deepcopy(case.args[0]), case.args[1]) for case in cases]

    def answer(index: int) -> object:
        outcome = outcomes[index]
        if outcome.not_implemented:
            raise Fail(NOT_IMPLEMENTED)
        if outcome.error is not None:
            raise Fail(f"{cases[index].name}: your function raised {outcome.error}")
        return outcome.returned

    with checklist.check("returns a module name (str) or None"):
        for index, case in enumerate(cases):
            got = answer(index)
            if got is not None and not isinstance(got, str):
                raise Fail(
                    f"{case.name}: you returned a {type(got).__name__}; return the module's name (a str) or None."
                )
    for title, indices in (
        ("names the module that passes back a NaN in a plain nn.Sequential", (_G_PLAIN,)),
        ("nested model: the innermost module, not a container", (_G_NESTED,)),
        ("an inf gradient counts, not only a NaN: acos of a clamped cosine", (_G_ACOS,)),
        ("an inf gradient counts, not only a NaN: a square root after a ReLU", (_G_SQRT,)),
        ("backward order, not definition order", (_G_ORDER, _G_ORDER_DEEP)),
        ("a healthy model gives None", (_G_HEALTHY,)),
    ):
        with checklist.check(title):
            for index in indices:
                got = answer(index)
                if got != expected[index]:
                    others = _other_answers(cases, outcomes, index)
                    raise Fail(f"{cases[index].name}: "
                               f"{_diagnose_gradient(got, cases[index], expected[index], others)}")
    _check_hooks_removed(checklist, cases, outcomes, "register_full_backward_hook")
    return checklist.results


def _gradient_hooks(model, x, *, test, use_output=False):
    """Helper for the catalogue: names, in the order backward reports them, whose grad_input (or grad_output) fails ``test``."""
    bad, handles = [], []
    for name, module in model.named_modules():
        def hook(module, grad_input, grad_output, name=name):
            grads = grad_output if use_output else grad_input
            if any(isinstance(g, torch.Tensor) and test(g) for g in grads):
                bad.append(name)

        handles.append(module.register_full_backward_hook(hook))
    try:
        with warnings.catch_warnings():  # the first layer's hook fires although its input needs no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            model(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return bad


def _gradient_last_reported(model, x):
    bad = _gradient_hooks(model, x, test=_nonfinite)
    return bad[-1] if bad else None


def _gradient_isnan_only(model, x):
    bad = _gradient_hooks(model, x, test=lambda g: bool(torch.isnan(g).any()))
    return bad[0] if bad else None


def _gradient_checks_grad_output(model, x):
    bad = _gradient_hooks(model, x, test=_nonfinite, use_output=True)
    return bad[0] if bad else None


def _gradient_definition_order(model, x):
    bad = set(_gradient_hooks(model, x, test=_nonfinite))
    return next((name for name, _ in model.named_modules() if name in bad), None)


def _gradient_checks_parameters(model, x):
    model(x).sum().backward()
    for name, module in model.named_modules():
        if any(p.grad is not None and not torch.isfinite(p.grad).all() for p in module.parameters(recurse=False)):
            return name
    return None


def _gradient_keeps_its_hooks(model, x):
    bad = []

    def hook(module, grad_input, grad_output, names={m: n for n, m in model.named_modules()}):
        if any(isinstance(g, torch.Tensor) and _nonfinite(g) for g in grad_input):
            bad.append(names[module])

    for module in model.modules():  # never removed: every call adds one more hook per module
        module.register_full_backward_hook(hook)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        model(x).sum().backward()
    return bad[0] if bad else None


def _gradient_forward_only(model, x):
    bad = _record_with_hooks(model, x, test=_nonfinite)  # forward hooks: every output here is finite
    return bad[0] if bad else None


FIRST_NONFINITE_GRADIENT = Task(
    id="08.first_nonfinite_gradient",
    title="Find the first module whose gradient is NaN/inf",
    function_name="first_nonfinite_gradient",
    make_cases=_gradient_cases,
    judge=_judge_gradient,
    reference=_first_nonfinite_gradient_written_out,
    wrong={
        "watches the forward pass only": Wrong(_gradient_forward_only, "The forward pass is finite here"),
        "returns the last module to report": Wrong(_gradient_last_reported, "LAST module"),
        "tests isnan only": Wrong(_gradient_isnan_only, "a test for NaN alone misses it"),
        "checks grad_output instead of grad_input": Wrong(_gradient_checks_grad_output, "ARRIVING"),
        "definition order instead of backward order": Wrong(_gradient_definition_order, "not the first in definition order"),
        "checks the parameters' gradients": Wrong(_gradient_checks_parameters, "parameters got non-finite gradients"),
        "never removes its hooks": Wrong(_gradient_keeps_its_hooks, "were still registered", kind="contract"),
        "calls attn_course.find_nonfinite": Wrong(
            _gradient_delegates, "you called attn_course.find_nonfinite", kind="algorithm"
        ),
    },
    stretch=True,
    forbidden=("attn_course.diagnostics.find_nonfinite",),
)
