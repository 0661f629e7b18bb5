"""Graded tasks for lesson 06 (linear attention): the reassociated form with padding, causal via prefix sums.

Both tasks are about an algorithm, so their graders watch it run (``measure``): on two long
cases (hundreds of positions) the largest intermediate must stay below ``L * S`` elements
(linear attention never forms the query-key matrix), and the work must grow linearly (a loop that
scores every query against every key is quadratic however small its pieces). Non-causal: within a
factor of the linear form's count. Causal: eight times the positions may cost at most 12x the
work, measured on pairs of cases of ``L`` and ``8L`` positions, so that any correct linear-time
form passes whatever its constant (the chunkwise form with chunks of ``c`` does ``O(L c)``,
several times the prefix sums' count at these small head sizes), while the quadratic ones (64x)
do not, nor those that only hide their ``L^2`` term behind a small constant (each chunk summing
its prefix again from position 0: 22-30x with chunks of 16 or 64). Calling the
course's linear attention gives zero (``forbidden``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...linear import linear_attention, linear_attention_quadratic
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    _measured,
    expect_close,
    expect_dtype,
    expect_flops_at_most,
    expect_inputs_unchanged,
    expect_largest_below,
    expect_shape,
)
from ._common import answered, returned, same, seeded_randn
from ._variants import distinct_match, largest_dims

__all__ = ["LINEAR_ATTENTION", "CAUSAL_LINEAR_ATTENTION", "CHUNKWISE_CAUSAL_LINEAR_ATTENTION"]

EPS = 1e-6
# The work allowed, in multiples of the linear form's count (_linear_flops, _chunkwise_flops). Measured on
# the long cases: the references and accepted forms 0.93-0.99x, wrong-valued linear forms up to 1.32x,
# every quadratic form (matrix at once, query by query, sums from scratch) 33-50x.
FLOP_FACTOR = 4
# 06.causal_linear_attention's work check: the work at 8L over the work at L must lie in this band. A span of
# 8x, not 2x: a quadratic form with a small constant, a*L + b*L^2 with a >> b*L at these L, grows barely more
# than 2x per doubling, but 8x the positions shows its L^2 term. Measured (1024 over 128 and 896 over 112
# positions): prefix sums by cumsum, einsum or matmul and the recurrent loop 7.99-8.00; the chunkwise form with
# carried state, chunks of 1 to 128 positions, 8.0-9.2 (a last, partial chunk at L; at most 9.7 for any chunk
# size up to L, a chunk of ~L/1.4), although its work is up to 26x the prefix sums'. Quadratic: masked matrix,
# rows of it, sums from scratch 61-64; each chunk's prefix summed again from position 0 (sum, or cumsum then
# slice) 47-57 with chunks of 4, 29-30 / 22-25 with chunks of 16 / 64, 12-18 with 128; a chunk longer than L
# (200: 12.0-13.2) is the quadratic form too. Below the band the work did not grow with L at all.
GROWTH_SPAN = 8
GROWTH_BAND = (4.0, 12.0)
# What a learner could use instead of writing linear attention: the course's implementations.
FORBIDDEN = (
    "attn_course.linear.linear_attention",
    "attn_course.linear.linear_attention_quadratic",
    "attn_course.linear.linear_attention_step",
)


def _phi(x):
    return F.elu(x) + 1  # (..., N, D), the feature map of both tasks


def _heads(q: torch.Tensor) -> int:
    """The number of (batch, head) slices: every axis before (L, D)."""
    return q[..., 0, 0].numel()


def _linear_form(q, k, v, mask=None, *, eps=EPS, feature_map=_phi, zero_values_only=False, normalise=True):
    """Non-causal linear attention by reassociation, optionally with one classic mistake (no library call)."""
    phi_q, phi_k = feature_map(q), feature_map(k)  # (..., L, M), (..., S, M)
    if mask is not None:
        if zero_values_only:
            v = v * mask.transpose(-2, -1)  # (..., S, Dv): padded values zeroed, their features kept
        else:
            phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M)
    kv = phi_k.transpose(-2, -1) @ v  # (..., M, Dv)
    numerator = phi_q @ kv  # (..., L, Dv)
    if not normalise:
        return numerator
    z = phi_k.sum(dim=-2, keepdim=True)  # (..., 1, M)
    return numerator / (phi_q @ z.transpose(-2, -1) + eps)  # (..., L, Dv)


# --- 06.linear_attention -------------------------------------------------------------------
# The learner writes linear_attention(q, k, v, mask) with the elu(x) + 1 feature map, by
# reassociation: out = phi(Q) (phi(K)^T V) / (phi(Q) z + eps), z = sum_j phi(k_j), eps = 1e-6
# in the denominator. mask is None or a key-padding mask (B, 1, 1, S), True = real token.


def _linear_cases() -> list[Case]:
    randn = seeded_randn(606)

    lengths = torch.tensor([9, 5])
    padding = (torch.arange(9)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    all_padding = torch.tensor([True, False])[:, None, None, None] & torch.ones(1, 1, 1, 6, dtype=torch.bool)
    return [
        Case("no mask: q (2, 2, 7, 4), k (2, 2, 9, 4), v (2, 2, 9, 3), float64",
             (randn(2, 2, 7, 4), randn(2, 2, 9, 4), randn(2, 2, 9, 3), None)),
        Case("padding mask (2, 1, 1, 9), lengths 9 and 5: q (2, 2, 7, 4), k (2, 2, 9, 4), v (2, 2, 9, 3), float64",
             (randn(2, 2, 7, 4), randn(2, 2, 9, 4), randn(2, 2, 9, 3), padding)),
        Case("the second sequence is all padding: mask (2, 1, 1, 6), q (2, 2, 5, 4), k, v (2, 2, 6, 4), float64",
             (randn(2, 2, 5, 4), randn(2, 2, 6, 4), randn(2, 2, 6, 4), all_padding)),
        Case("no mask, float32: q, k, v (2, 2, 8, 8)",
             (randn(2, 2, 8, 8, dtype=torch.float32), randn(2, 2, 8, 8, dtype=torch.float32),
              randn(2, 2, 8, 8, dtype=torch.float32), None)),
        # Long enough that the (L, S) matrix dwarfs every linear intermediate: with M = Dv = 4 an
        # honest form holds at most (B, H, S, M, Dv), under 1/5 of L * S.
        Case("long, no mask: q (1, 2, 256, 4), k (1, 2, 192, 4), v (1, 2, 192, 4), float64",
             (randn(1, 2, 256, 4), randn(1, 2, 192, 4), randn(1, 2, 192, 4), None)),
        Case("long, padding mask (1, 1, 1, 288), length 200: q (1, 2, 160, 4), k, v (1, 2, 288, 4), float64",
             (randn(1, 2, 160, 4), randn(1, 2, 288, 4), randn(1, 2, 288, 4),
              (torch.arange(288) < 200)[None, None, None, :])),
    ]


_NO_MASK, _PADDED, _ALL_PADDING, _LINEAR_FLOAT32, _LONG, _LONG_PADDED = range(6)


def _values_masked_only(q, k, v, mask):
    """Padding removed from the numerator (zero values) but still counted in z."""
    return _linear_form(q, k, v, mask, zero_values_only=True)


def _numerator_only(q, k, v, mask):
    return _linear_form(q, k, v, mask, normalise=False)


def _eps_outside(q, k, v, mask, *, is_causal=False):
    return linear_attention(q, k, v, mask, is_causal=is_causal, eps=0.0) + EPS


def _linear_flops(q, k, v) -> int:
    """The linear form's work, counted like the probe: phi, phi(K)^T V and z, then phi(Q) applied to them."""
    L, S, D, Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    M = D  # elu(x) + 1 keeps the feature size
    per_head = 2 * (L + S) * D + 2 * S * M * Dv + 2 * S * M + 2 * L * M * Dv + 2 * L * M + 2 * L * Dv
    return _heads(q) * per_head


def _diagnose_linear(got, q, k, v, mask) -> str | None:
    return distinct_match(
        got,
        linear_attention(q, k, v, mask),
        [
            (lambda: linear_attention(q, k, v, mask, eps=0.0),
             "you left out eps. Add eps = 1e-6 to the denominator, num / (den + eps): it keeps rows whose "
             "denominator is 0 finite, and the checker expects exactly that formula."),
            (lambda: linear_attention(q, k, v),
             "your output ignores the padding mask: padded keys must add nothing to phi(K)^T V or to z."),
            (lambda: _values_masked_only(q, k, v, mask),
             "you removed the padded keys from the numerator only: they still count in the normaliser "
             "z = sum_j phi(k_j): a padded key must be gone from both."),
            (lambda: _numerator_only(q, k, v, mask),
             "the output is not normalised: divide phi(Q) (phi(K)^T V) by phi(Q) z + eps, with z = sum_j phi(k_j)."),
            (lambda: linear_attention(q, k, v, mask, feature_map="relu"),
             "you used relu as the feature map; this task uses elu(x) + 1, which is positive everywhere."),
            (lambda: _eps_outside(q, k, v, mask),
             "eps belongs in the denominator: num / (den + eps), not num / den + eps."),
            (lambda: torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v,
             "that is softmax attention. Linear attention replaces exp(q.k) by phi(q).phi(k), with the feature map "
             "phi of this task."),
        ],
    )


def _small_tensors_story(outcome, quadratic: int, rule: str, story: str) -> str:
    """The work check's hint: ``story`` (quadratic work in small pieces) only when no quadratic tensor was built."""
    largest = outcome.probe.get("largest_numel") if isinstance(outcome.probe, dict) else None
    small = isinstance(largest, int) and not isinstance(largest, bool) and largest < quadratic
    return f"{rule} {story[0].upper()}{story[1:]}" if small else rule


def _judge_linear(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, index, atol in (
        ("equals phi(Q) phi(K)^T V, normalised (no mask; L != S, Dv != D)", _NO_MASK, 1e-9),
        ("padded keys count for nothing", _PADDED, 1e-9),
        ("a sequence of nothing but padding gives zeros, not NaN (eps)", _ALL_PADDING, 1e-9),
        ("float32 inputs", _LINEAR_FLOAT32, 1e-5),
    ):
        with checklist.check(title):
            case = cases[index]
            got = returned(outcomes[index], what=case.name)
            expected = linear_attention(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            if index == _ALL_PADDING and torch.isnan(got).any():
                raise Fail(
                    f"{case.name}: the all-padding sequence gives NaN. Its z is 0, so the denominator is 0: with eps "
                    "in the denominator, num / (den + eps), those rows are 0."
                )
            expect_close(got, expected, what=case.name, atol=atol, rtol=atol, hint=lambda: _diagnose_linear(got, *case.args) or "")
    with checklist.check("long sequences (hundreds of queries and keys) match the library"):
        for index in (_LONG, _LONG_PADDED):
            case = cases[index]
            got = returned(outcomes[index], what=case.name)
            expected = linear_attention(*case.args)
            expect_shape(got, expected.shape, what=case.name)
            hint = lambda: _diagnose_linear(got, *case.args) or ""  # computed only for a wrong answer
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    linear_values_right = all(  # the (L, S) story is told only for the right values
        o.error is None and same(o.returned, linear_attention(*c.args), atol=1e-5, rtol=1e-5)
        for c, o in zip(cases, outcomes)
    )
    with checklist.check("never forms an (L, S) matrix: every intermediate stays below L * S elements"):
        for index in (_LONG, _LONG_PADDED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, k = case.args[:2]
            L, S = q.shape[-2], k.shape[-2]
            rule = ("phi(Q) (phi(K)^T V), with z = sum_j phi(k_j), keeps every intermediate O((L + S) M), far below "
                    "L * S.")
            expect_largest_below(
                outcome, L * S, what=case.name,
                constraint=(f"your values are right, but linear attention never forms the (L, S) = ({L}, {S}) matrix "
                            f"of query-key weights: {rule}") if linear_values_right else f"linear attention: {rule}",
            )
    with checklist.check(f"work grows like L + S, not L * S (within {FLOP_FACTOR}x the reassociated form's)"):
        for index in (_LONG, _LONG_PADDED):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            intended = _linear_flops(*case.args[:3])
            q_len, k_len = case.args[0].shape[-2], case.args[1].shape[-2]
            expect_flops_at_most(
                outcome, FLOP_FACTOR * intended, what=case.name, intended=intended,
                hint=_small_tensors_story(
                    outcome, q_len * k_len,
                    "Reassociate: phi(Q) (phi(K)^T V) costs O((L + S) M Dv).",
                    "your tensors stay below (L, S), but a loop that scores every query against every key still costs "
                    "O(L S)."),
            )
    with checklist.check("leaves q, k, v and the mask unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _linear_reference(q, k, v, mask):
    return _linear_form(q, k, v, mask)


def _linear_outer_products(q, k, v, mask):
    """Correct: phi(K)^T V as a sum of per-key outer products, (B, H, S, M, Dv) at once."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M)
    kv = (phi_k[..., :, :, None] * v[..., :, None, :]).sum(dim=-3)  # (..., M, Dv)
    z = phi_k.sum(dim=-2)  # (..., M)
    return (phi_q @ kv) / ((phi_q * z[..., None, :]).sum(dim=-1, keepdim=True) + EPS)  # (..., L, Dv)


def _linear_no_eps(q, k, v, mask):
    return _linear_form(q, k, v, mask, eps=0.0)


def _linear_ignores_mask(q, k, v, mask):
    return _linear_form(q, k, v)


def _linear_relu(q, k, v, mask):
    return _linear_form(q, k, v, mask, feature_map=F.relu)


def _linear_eps_outside(q, k, v, mask):
    return _linear_form(q, k, v, mask, eps=0.0) + EPS


def _linear_quadratic(q, k, v, mask):
    """Right values the O(L S) way: phi(Q) phi(K)^T, masked, normalised, times V."""
    weights = _phi(q) @ _phi(k).transpose(-2, -1)  # (..., L, S)
    if mask is not None:
        weights = weights * mask  # (..., L, S), padded keys weigh 0
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + EPS)  # (..., L, Dv)


def _linear_query_by_query(q, k, v, mask):
    """Right values, small tensors, quadratic work: each query is scored against every key in turn."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M)
    rows = []
    for i in range(q.shape[-2]):
        w = phi_k @ phi_q[..., i, :, None]  # (..., S, 1), weights of query i
        rows.append((w * v).sum(dim=-2) / (w.sum(dim=-2) + EPS))  # (..., Dv)
    return torch.stack(rows, dim=-2)  # (..., L, Dv)


def _linear_delegates(q, k, v, mask):
    import attn_course as ac

    return ac.linear_attention(q, k, v, mask)


def _linear_softmax(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (..., L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v


LINEAR_ATTENTION = Task(
    id="06.linear_attention",
    title="Linear attention with a padding mask",
    function_name="linear_attention",
    make_cases=_linear_cases,
    judge=_judge_linear,
    reference=_linear_reference,
    wrong={
        "no eps": Wrong(_linear_no_eps, "left out eps"),
        "ignores the padding mask": Wrong(_linear_ignores_mask, "ignores the padding mask"),
        "padding zeroed in the values only": Wrong(_values_masked_only, "numerator only"),
        "not normalised": Wrong(_numerator_only, "not normalised"),
        "relu feature map": Wrong(_linear_relu, "used relu as the feature map"),
        "eps added to the output": Wrong(_linear_eps_outside, "belongs in the denominator"),
        "softmax attention": Wrong(_linear_softmax, "is softmax attention"),
        "the quadratic form phi(Q) phi(K)^T": Wrong(_linear_quadratic, "never forms the (L, S)", kind="algorithm"),
        "one query at a time against every key": Wrong(
            _linear_query_by_query, "tensors stay below (L, S)", kind="algorithm"
        ),
        "calls attn_course.linear_attention": Wrong(
            _linear_delegates, "you called attn_course.linear_attention", kind="algorithm"
        ),
    },
    accepted={"phi(K)^T V as a sum of outer products": _linear_outer_products},
    measure=("largest", "flops"),
    forbidden=FORBIDDEN,
)


# --- 06.causal_linear_attention ------------------------------------------------------------
# The learner writes causal_linear_attention(q, k, v) with elu(x) + 1 and eps = 1e-6 in the
# denominator: out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps), S_t = sum_{j<=t} phi(k_j) v_j^T,
# z_t = sum_{j<=t} phi(k_j), computed with prefix sums (cumsum), self-attention (L = S).


def _causal_cases() -> list[Case]:
    randn = seeded_randn(616)

    q, k, v = randn(2, 2, 9, 4), randn(2, 2, 9, 4), randn(2, 2, 9, 3)
    k_future, v_future = k.clone(), v.clone()
    k_future[..., 6:, :] = randn(2, 2, 3, 4)  # change only positions 6, 7, 8
    v_future[..., 6:, :] = randn(2, 2, 3, 3)
    q_zero = randn(2, 12, 5)
    q_zero[:, 4, :] = -800.0  # phi(q_4) = exp(-800) = 0 in float64: a zero denominator
    return [
        Case("q, k (2, 2, 9, 4), v (2, 2, 9, 3), float64", (q, k, v)),
        Case("the same q, with keys and values changed at positions 6, 7, 8 only", (q.clone(), k_future, v_future)),
        Case("q, k, v (2, 12, 5) without a head axis; q[:, 4] = -800, so phi(q_4) = 0, float64",
             (q_zero, randn(2, 12, 5), randn(2, 12, 5))),
        Case("a single position: q, k, v (2, 2, 1, 4), float64",
             (randn(2, 2, 1, 4), randn(2, 2, 1, 4), randn(2, 2, 1, 4))),
        Case("float32: q, k, v (2, 2, 16, 8)",
             (randn(2, 2, 16, 8, dtype=torch.float32), randn(2, 2, 16, 8, dtype=torch.float32),
              randn(2, 2, 16, 8, dtype=torch.float32))),
        # Long enough that the (L, L) matrix dwarfs the prefix sums: with M = Dv = 4 the cumsum form
        # holds (B, H, L, M, Dv), 1/8 (then 1/14) of L * L. Two slices, not four: a chunkwise form with
        # chunks of 128 holds (B, H, c, c) = 2 * 128 * 128, half of L * L.
        Case("long: q, k, v (1, 2, 256, 4), float64", (randn(1, 2, 256, 4), randn(1, 2, 256, 4), randn(1, 2, 256, 4))),
        Case("long, no head axis: q, k, v (2, 224, 4), float64",
             (randn(2, 224, 4), randn(2, 224, 4), randn(2, 224, 4))),
        # The work check compares each pair, L and GROWTH_SPAN * L positions; one slice each keeps it quick.
        # L >= 112 so that chunks of up to 128 (and a last, partial one) fit in the short case too.
        Case("work, short: q, k, v (1, 1, 128, 4), float64", (randn(1, 1, 128, 4), randn(1, 1, 128, 4), randn(1, 1, 128, 4))),
        Case("work, 8x as long: q, k, v (1, 1, 1024, 4), float64",
             (randn(1, 1, 1024, 4), randn(1, 1, 1024, 4), randn(1, 1, 1024, 4))),
        Case("work, short, no head axis: q, k, v (1, 112, 4), float64",
             (randn(1, 112, 4), randn(1, 112, 4), randn(1, 112, 4))),
        Case("work, 8x as long, no head axis: q, k, v (1, 896, 4), float64",
             (randn(1, 896, 4), randn(1, 896, 4), randn(1, 896, 4))),
    ]


(_CAUSAL, _FUTURE_CHANGED, _ZERO_FEATURES, _SINGLE, _CAUSAL_FLOAT32, _CAUSAL_LONG, _CAUSAL_LONG_2,
 _WORK_SHORT, _WORK_LONG, _WORK_SHORT_2, _WORK_LONG_2) = range(11)
_GROWTH_PAIRS = ((_WORK_SHORT, _WORK_LONG), (_WORK_SHORT_2, _WORK_LONG_2))  # (L, 8L), same batch and heads


def _expect_linear_growth(short, long_, *, what: str, rule: str, story: str) -> None:
    """Fail unless the work on ``long_`` (8L positions) is within GROWTH_BAND times the work on ``short`` (L).

    ``story`` (how quadratic work hides in small tensors) is told only when the work grew quadratically
    and no (8L, 8L) tensor was built, so the hint is true whenever it is given.
    """
    (short_case, short_outcome), (long_case, long_outcome) = short, long_
    n_short, n_long = short_case.args[0].shape[-2], long_case.args[0].shape[-2]
    work_short = _measured(short_outcome, "flops", short_case.name)
    work_long = _measured(long_outcome, "flops", long_case.name)
    growth = work_long / max(work_short, 1)
    low, high = GROWTH_BAND
    measured = (f"{what}: from L = {n_short} ({short_case.name}) to L = {n_long} ({long_case.name}) your function's work "
                f"went from about {work_short:,} to {work_long:,} operations, x{growth:.2f}")
    if growth > high:
        raise Fail(f"{measured}; linear work grows x{n_long / n_short:g} (this check allows x{high:g}), quadratic "
                   f"work x{(n_long / n_short) ** 2:g}. "
                   + _small_tensors_story(long_outcome, n_long ** 2, rule, story))
    if growth < low:
        raise Fail(f"{measured}: the same algorithm on {n_long / n_short:g} times the positions does about "
                   f"{n_long / n_short:g} times the work (this check wants x{low:g} to x{high:g}). Does your function do the same computation whatever L is?")


def _prefix_sums(q, k, v, *, exclusive=False, reverse=False, eps=EPS, normalise=True, feature_map=_phi):
    """Causal linear attention by cumsum, optionally with one classic mistake."""
    phi_q, phi_k = feature_map(q), feature_map(k)  # (..., L, M)
    outer = phi_k[..., :, :, None] * v[..., :, None, :]  # (..., L, M, Dv)
    if reverse:
        kv, z = outer.flip(-3).cumsum(-3).flip(-3), phi_k.flip(-2).cumsum(-2).flip(-2)  # suffix sums
    else:
        kv, z = outer.cumsum(-3), phi_k.cumsum(-2)  # (..., L, M, Dv), (..., L, M)
    if exclusive:
        kv, z = kv - outer, z - phi_k  # sums over j < t
    numerator = (phi_q[..., :, :, None] * kv).sum(-2)  # (..., L, Dv)
    if not normalise:
        return numerator
    return numerator / ((phi_q * z).sum(-1, keepdim=True) + eps)  # (..., L, Dv)


def _diagnose_causal(got, q, k, v) -> str | None:
    return distinct_match(
        got,
        linear_attention(q, k, v, is_causal=True),
        [
            (lambda: _prefix_sums(q, k, v, eps=0.0),
             "you left out eps. Add eps = 1e-6 to the denominator, num / (den + eps): it keeps rows whose "
             "denominator is 0 finite, and the checker expects exactly that formula."),
            (lambda: linear_attention(q, k, v),
             "position t used keys after t: your output equals non-causal linear attention, sums over the whole "
             "sequence where position t may read only the prefix j <= t."),
            (lambda: _prefix_sums(q, k, v, exclusive=True),
             "position t must include its own key and value: S_t sums over j <= t, not j < t."),
            (lambda: _prefix_sums(q, k, v, reverse=True),
             "you summed from the end (j >= t): causal attention reads the past, j <= t."),
            (lambda: _prefix_sums(q, k, v, normalise=False),
             "the output is not normalised: divide by phi(q_t) . z_t + eps, with z_t the prefix sum of phi(k_j)."),
            (lambda: linear_attention(q, k, v, is_causal=True, feature_map="relu"),
             "you used relu as the feature map; this task uses elu(x) + 1."),
            (lambda: _eps_outside(q, k, v, None, is_causal=True),
             "eps belongs in the denominator: num / (den + eps), not num / den + eps."),
        ],
    )


def _judge_causal(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            q, _, v = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    with checklist.check("equals the causally masked quadratic form"):
        for index in (_CAUSAL, _SINGLE):
            case = cases[index]
            got = returned(outcomes[index], what=case.name)
            expected = linear_attention_quadratic(*case.args, is_causal=True)
            expect_shape(got, expected.shape, what=case.name)
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=lambda: _diagnose_causal(got, *case.args) or "")
    with checklist.check("the output at t does not change when inputs after t change"):
        before = returned(outcomes[_CAUSAL], what=cases[_CAUSAL].name)
        after = returned(outcomes[_FUTURE_CHANGED], what=cases[_FUTURE_CHANGED].name)
        q, _, v = cases[_CAUSAL].args
        expect_shape(before, (*q.shape[:-1], v.shape[-1]), what=cases[_CAUSAL].name)
        expect_shape(after, before.shape, what=cases[_FUTURE_CHANGED].name)
        changed = (before[..., :6, :].double() - after[..., :6, :].double()).abs().amax(dim=(0, 1, 3))  # (6,)
        if bool((changed > 1e-9).any()):
            t = int((changed > 1e-9).nonzero()[0])
            raise Fail(
                f"changing keys and values at positions 6-8 changed your output at position {t}: information leaks "
                "from the future. Query t may only read prefix sums over j <= t."
            )
    with checklist.check("a query with zero features gives a zero row, not NaN (eps)"):
        case = cases[_ZERO_FEATURES]
        got = returned(outcomes[_ZERO_FEATURES], what=case.name)
        expected = linear_attention(*case.args, is_causal=True)
        expect_shape(got, expected.shape, what=case.name)
        if torch.isnan(got).any():
            raise Fail(
                f"{case.name}: NaN in your output. phi(q_4) is 0, so both numerator and denominator are 0 there: eps "
                "in the denominator, num / (den + eps), keeps that row finite."
            )
        expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=lambda: _diagnose_causal(got, *case.args) or "")
    with checklist.check("float32 inputs"):
        case = cases[_CAUSAL_FLOAT32]
        got = returned(outcomes[_CAUSAL_FLOAT32], what=case.name)
        expected = linear_attention(*(x.double() for x in case.args), is_causal=True)
        expect_shape(got, expected.shape, what=case.name)
        expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-4)
    with checklist.check("long sequences (112 to 1024 positions) match the quadratic form"):
        for index in (_CAUSAL_LONG, _CAUSAL_LONG_2, *(i for pair in _GROWTH_PAIRS for i in pair)):
            case = cases[index]
            got = returned(outcomes[index], what=case.name)
            expected = linear_attention_quadratic(*case.args, is_causal=True)
            expect_shape(got, expected.shape, what=case.name)
            hint = lambda: _diagnose_causal(got, *case.args) or ""  # computed only for a wrong answer
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("never forms an (L, L) matrix: every intermediate stays below L * L elements"):
        for index in (_CAUSAL_LONG, _CAUSAL_LONG_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            L = case.args[0].shape[-2]
            expect_largest_below(
                outcome, L * L, what=case.name,
                constraint=f"causal linear attention never forms the (L, L) = ({L}, {L}) matrix, not even masked or "
                "filled row by row. Keep prefix sums instead, S_t = sum_(j<=t) phi(k_j) v_j^T and z_t = sum_(j<=t) "
                "phi(k_j) (cumsum over the positions, or a running state): O(L M Dv) numbers, far below L * L.",
            )
    with checklist.check(f"work grows like L, not L * L ({GROWTH_SPAN}x the positions, at most {GROWTH_BAND[1]:g}x the work)"):
        for pair in _GROWTH_PAIRS:
            for index in pair:
                returned(outcomes[index], what=cases[index].name)
            _expect_linear_growth(
                *((cases[index], outcomes[index]) for index in pair), what=f"{GROWTH_SPAN}x the positions",
                rule="Each prefix sum is the previous one plus one position's term: O(L) in all.",
                story="your tensors stay below (L, L), but the work grows like L^2, as it does when each prefix is "
                "summed from scratch at every position (or at every chunk, from position 0 again), or every earlier "
                "key is weighted for every query.",
            )
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _causal_reference(q, k, v):
    return _prefix_sums(q, k, v)


def _causal_recurrent(q, k, v):
    """Correct: the RNN form, a running state (S, z) updated one position at a time."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    state = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype)  # (..., M, Dv)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], dtype=q.dtype)  # (..., M)
    rows = []
    for t in range(q.shape[-2]):
        state = state + phi_k[..., t, :, None] * v[..., t, None, :]  # (..., M, Dv)
        z = z + phi_k[..., t, :]  # (..., M)
        numerator = (phi_q[..., t, :, None] * state).sum(dim=-2)  # (..., Dv)
        rows.append(numerator / ((phi_q[..., t, :] * z).sum(dim=-1, keepdim=True) + EPS))  # (..., Dv)
    return torch.stack(rows, dim=-2)  # (..., L, Dv)


def _causal_non_causal(q, k, v):
    return _linear_form(q, k, v)


def _causal_masked_quadratic(q, k, v):
    """Right values the O(L^2) way: phi(Q) phi(K)^T under a causal mask, normalised, times V."""
    L = q.shape[-2]
    weights = _phi(q) @ _phi(k).transpose(-2, -1)  # (..., L, L)
    weights = weights * torch.ones(L, L, dtype=torch.bool).tril()  # (..., L, L), keys j <= t only
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + EPS)  # (..., L, Dv)


def _causal_rows_into_a_matrix(q, k, v):
    """Right values; a loop, but one that fills an (L, L) weight matrix row by row."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    L = q.shape[-2]
    weights = torch.zeros(*q.shape[:-2], L, L, dtype=q.dtype)  # (..., L, L)
    for t in range(L):
        weights[..., t, : t + 1] = (phi_k[..., : t + 1, :] @ phi_q[..., t, :, None])[..., 0]  # (..., t + 1)
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + EPS)  # (..., L, Dv)


def _causal_sums_from_scratch(q, k, v):
    """Right values, small tensors, quadratic work: S_t and z_t summed again from j = 0 at every t."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    rows = []
    for t in range(q.shape[-2]):
        state = phi_k[..., : t + 1, :].transpose(-2, -1) @ v[..., : t + 1, :]  # (..., M, Dv)
        z = phi_k[..., : t + 1, :].sum(dim=-2)  # (..., M)
        numerator = (phi_q[..., t, :, None] * state).sum(dim=-2)  # (..., Dv)
        rows.append(numerator / ((phi_q[..., t, :] * z).sum(dim=-1, keepdim=True) + EPS))  # (..., Dv)
    return torch.stack(rows, dim=-2)  # (..., L, Dv)


def _causal_chunks_summed_from_the_start(q, k, v, chunk_size=16):
    """Right values, small tensors, quadratic work: each chunk sums every earlier position again from j = 0.

    Chunk [s, e) takes S_e, the sum over j < e, then subtracts the suffix sums inside the chunk to get S_t for
    each t in it: O(e) work per chunk, O(L^2 / c) in all, a small constant that a 2x span barely shows.
    """
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    outer = phi_k[..., :, :, None] * v[..., :, None, :]  # (..., L, M, Dv)
    rows = []
    for start in range(0, q.shape[-2], chunk_size):
        end = min(start + chunk_size, q.shape[-2])
        inside, k_inside = outer[..., start:end, :, :], phi_k[..., start:end, :]  # (..., c, M, Dv), (..., c, M)
        after_t = inside.flip(-3).cumsum(-3).flip(-3) - inside  # (..., c, M, Dv), sums over t < j < end
        state = outer[..., :end, :, :].sum(dim=-3, keepdim=True) - after_t  # (..., c, M, Dv), S_t from j = 0
        z = phi_k[..., :end, :].sum(dim=-2, keepdim=True) - (k_inside.flip(-2).cumsum(-2).flip(-2) - k_inside)  # (..., c, M)
        pq = phi_q[..., start:end, :]  # (..., c, M)
        numerator = (pq[..., :, :, None] * state).sum(dim=-2)  # (..., c, Dv)
        rows.append(numerator / ((pq * z).sum(dim=-1, keepdim=True) + EPS))
    return torch.cat(rows, dim=-2)  # (..., L, Dv)


def _causal_cumsum_from_the_start(q, k, v, chunk_size=64):
    """Right values, small tensors, quadratic work: each chunk runs the cumsum from j = 0 and keeps its own rows."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    rows = []
    for start in range(0, q.shape[-2], chunk_size):
        end = min(start + chunk_size, q.shape[-2])
        state = (phi_k[..., :end, :, None] * v[..., :end, None, :]).cumsum(-3)[..., start:, :, :]  # (..., c, M, Dv)
        z = phi_k[..., :end, :].cumsum(-2)[..., start:, :]  # (..., c, M)
        pq = phi_q[..., start:end, :]  # (..., c, M)
        numerator = (pq[..., :, :, None] * state).sum(dim=-2)  # (..., c, Dv)
        rows.append(numerator / ((pq * z).sum(dim=-1, keepdim=True) + EPS))
    return torch.cat(rows, dim=-2)  # (..., L, Dv)


def _causal_delegates(q, k, v):
    import attn_course as ac

    return ac.linear_attention(q, k, v, is_causal=True)


def _causal_exclusive(q, k, v):
    return _prefix_sums(q, k, v, exclusive=True)


def _causal_reversed(q, k, v):
    return _prefix_sums(q, k, v, reverse=True)


def _causal_no_eps(q, k, v):
    return _prefix_sums(q, k, v, eps=0.0)


def _causal_unnormalised(q, k, v):
    return _prefix_sums(q, k, v, normalise=False)


def _causal_relu(q, k, v):
    return _prefix_sums(q, k, v, feature_map=F.relu)


def _causal_loop_in_place(q, k, v):
    """Correct maths, but builds the features in place: elu_ then add_ on the caller's q and k."""
    phi_q = F.elu_(q).add_(1)
    phi_k = F.elu_(k).add_(1)
    return _prefix_sums(phi_q, phi_k, v, feature_map=lambda x: x)


CAUSAL_LINEAR_ATTENTION = Task(
    id="06.causal_linear_attention",
    title="Causal linear attention with prefix sums",
    function_name="causal_linear_attention",
    make_cases=_causal_cases,
    judge=_judge_causal,
    reference=_causal_reference,
    wrong={
        "sums over the whole sequence (not causal)": Wrong(_causal_non_causal, "equals non-causal linear attention"),
        "exclusive prefix sums (j < t)": Wrong(_causal_exclusive, "include its own key"),
        "suffix sums (j >= t)": Wrong(_causal_reversed, "summed from the end"),
        "no eps": Wrong(_causal_no_eps, "left out eps"),
        "not normalised": Wrong(_causal_unnormalised, "not normalised"),
        "relu feature map": Wrong(_causal_relu, "used relu as the feature map"),
        "features computed in place": Wrong(_causal_loop_in_place, "in place", kind="contract"),
        "causal mask on the quadratic form": Wrong(
            _causal_masked_quadratic, "never forms the (L, L)", kind="algorithm"
        ),
        "loop that fills an (L, L) matrix row by row": Wrong(
            _causal_rows_into_a_matrix, "never forms the (L, L)", kind="algorithm"
        ),
        "prefix sums recomputed from scratch at every position": Wrong(
            _causal_sums_from_scratch, "each prefix is summed from scratch", kind="algorithm"
        ),
        "each chunk of 16 sums its prefix again from position 0": Wrong(
            _causal_chunks_summed_from_the_start, "each prefix is summed from scratch", kind="algorithm"
        ),
        "each chunk of 64 runs the cumsum again from position 0": Wrong(
            _causal_cumsum_from_the_start, "each prefix is summed from scratch", kind="algorithm"
        ),
        "calls attn_course.linear_attention(is_causal=True)": Wrong(
            _causal_delegates, "you called attn_course.linear_attention", kind="algorithm"
        ),
    },
    accepted={"recurrent form: a running state updated one position at a time": _causal_recurrent},
    measure=("largest", "flops"),
    forbidden=FORBIDDEN,
)


# --- 06.chunkwise_causal_linear_attention (stretch) ------------------------------------------
# The learner writes chunkwise_causal_linear_attention(q, k, v, chunk_size): the same numbers as
# 06.causal_linear_attention (elu(x) + 1, eps = 1e-6 in the denominator, self-attention), computed
# chunk by chunk: inside a chunk, the masked (c, c) quadratic form; from the chunks before it, one
# state S = sum_j phi(k_j) v_j^T (M, Dv) and z = sum_j phi(k_j) (M,), updated once per chunk. No
# (L, L) matrix, and no per-position states (c, M, Dv): that is what the prefix-sum form pays.


def _chunkwise_cases() -> list[Case]:
    randn = seeded_randn(626)

    def qkv(*shape, dv=None, dtype=torch.float64):
        value_shape = (*shape[:-1], dv or shape[-1])
        return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(*value_shape, dtype=dtype)

    q_zero, k_zero, v_zero = qkv(2, 12, 5)
    q_zero[:, 4, :] = -800.0  # phi(q_4) = exp(-800) = 0 in float64: a zero denominator
    return [
        Case("q, k (2, 2, 12, 4), v (2, 2, 12, 3), chunk_size=4 (3 chunks), float64", (*qkv(2, 2, 12, 4, dv=3), 4)),
        Case("q, k, v (2, 2, 10, 4), chunk_size=4 (10 = 2 chunks + 2), float64", (*qkv(2, 2, 10, 4), 4)),
        Case("q, k, v (2, 2, 9, 4), chunk_size=1 (one position per chunk), float64", (*qkv(2, 2, 9, 4), 1)),
        Case("q, k, v (2, 7, 4) without a head axis, chunk_size=16 (one chunk longer than the sequence), float64",
             (*qkv(2, 7, 4), 16)),
        Case("q, k, v (2, 12, 5) without a head axis, chunk_size=5; q[:, 4] = -800, so phi(q_4) = 0, float64",
             (q_zero, k_zero, v_zero, 5)),
        Case("float32: q, k, v (2, 2, 16, 8), chunk_size=8", (*qkv(2, 2, 16, 8, dtype=torch.float32), 8)),
        # Long: the (L, L) matrix is at least 4x every honest intermediate (the parallel form's (B, H, n, c, c)).
        Case("long: q, k, v (2, 2, 256, 4), chunk_size=16, float64", (*qkv(2, 2, 256, 4), 16)),
        Case("long: q, k, v (2, 2, 200, 4), chunk_size=8, float64", (*qkv(2, 2, 200, 4), 8)),
        # Wide: M = Dv = 16, so one chunk's per-position states (B, H, c, M, Dv) are 4x every honest
        # intermediate ((B, H, L, M) features, the (B, H, L, Dv) output, the parallel form's states).
        Case("wide: q, k, v (2, 2, 64, 16), chunk_size=16, float64", (*qkv(2, 2, 64, 16), 16)),
        Case("wide: q, k, v (2, 2, 60, 16), chunk_size=16 (60 = 3 chunks + 12), float64", (*qkv(2, 2, 60, 16), 16)),
    ]


(_CW_MULTIPLE, _CW_SHORT_LAST, _CW_ONE, _CW_ONE_CHUNK, _CW_ZERO_FEATURES, _CW_FLOAT32,
 _CW_LONG, _CW_LONG_2, _CW_WIDE, _CW_WIDE_2) = range(10)


def _chunkwise_form(q, k, v, chunk_size, *, intra="inclusive", carry=True, update_first=False, eps=EPS,
                    normalise=True, feature_map=_phi, whole_chunks_only=False):
    """Chunkwise causal linear attention, one chunk at a time, optionally with one classic mistake.

    ``intra``: which keys of its own chunk a query reads: ``"inclusive"`` (j <= t, right),
    ``"strict"`` (j < t) or ``"all"`` (the whole chunk: the future leaks in).
    """
    phi_q, phi_k = feature_map(q), feature_map(k)  # (..., L, M)
    L, M, Dv = q.shape[-2], phi_q.shape[-1], v.shape[-1]
    if whole_chunks_only:  # the classic shortcut: a view into (L // c, c) chunks
        phi_q, phi_k, v = (x.unflatten(-2, (L // chunk_size, chunk_size)).flatten(-3, -2) for x in (phi_q, phi_k, v))
    state = q.new_zeros(*q.shape[:-2], M, Dv)  # (..., M, Dv), S over the chunks before this one
    z = q.new_zeros(*q.shape[:-2], M, 1)  # (..., M, 1)
    diagonal = {"inclusive": 0, "strict": -1}.get(intra)
    outputs = []
    for start in range(0, L, chunk_size):
        pq, pk, pv = (x[..., start:start + chunk_size, :] for x in (phi_q, phi_k, v))  # (..., c, M or Dv)
        if update_first:
            state, z = state + pk.transpose(-2, -1) @ pv, z + pk.sum(dim=-2)[..., None]
        scores = pq @ pk.transpose(-2, -1)  # (..., c, c), phi(q_t) . phi(k_j) inside the chunk
        if diagonal is not None:
            scores = scores.tril(diagonal)  # keys j <= t (or j < t) of this chunk
        numerator = scores @ pv + pq @ state  # (..., c, Dv)
        if not normalise:
            outputs.append(numerator)
        else:
            outputs.append(numerator / (scores.sum(dim=-1, keepdim=True) + pq @ z + eps))  # (..., c, Dv)
        if carry and not update_first:
            state, z = state + pk.transpose(-2, -1) @ pv, z + pk.sum(dim=-2)[..., None]  # (..., M, Dv), (..., M, 1)
        elif not carry:
            state, z = torch.zeros_like(state), torch.zeros_like(z)
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _diagnose_chunkwise(got, q, k, v, chunk_size) -> str | None:
    return distinct_match(
        got,
        linear_attention_quadratic(q, k, v, is_causal=True),
        [
            (lambda: _chunkwise_form(q, k, v, chunk_size, intra="all"),
             "inside a chunk your queries read the whole chunk, later keys included: within the chunk too, query t "
             "may use only keys j <= t."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, intra="strict"),
             "inside a chunk, query t must include its own key: the diagonal of the (c, c) scores counts."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, update_first=True),
             "you added the chunk to the state before reading it, so the chunk counts twice (through the state "
             "and through its own (c, c) scores). Read the state of the chunks before, then update it."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, carry=False),
             "each chunk starts from an empty state: S and z must carry every earlier chunk's keys and values into "
             "the later chunks."),
            (lambda: linear_attention(q, k, v),
             "position t used keys after t: your output equals non-causal linear attention."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, eps=0.0),
             "you left out eps: the denominator is den + eps, with eps = 1e-6."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, normalise=False),
             "the output is not normalised: divide by the chunk's score row sums plus phi(q_t) . z, plus eps."),
            (lambda: _chunkwise_form(q, k, v, chunk_size, feature_map=F.relu),
             "you used relu as the feature map; this task uses elu(x) + 1."),
        ],
    )


_CHUNKWISE_ERROR_HINTS = (
    ("invalid for input of size",
     "a view into (L // chunk_size, chunk_size) chunks needs L to be a multiple of the chunk. Any length must "
     "work: let the last chunk be shorter (or pad it, the padding never counting)."),
    ("unflatten",
     "a view into (L // chunk_size, chunk_size) chunks needs L to be a multiple of the chunk. Any length must "
     "work: let the last chunk be shorter (or pad it, the padding never counting)."),
)


def _chunkwise_flops(q, k, v, chunk_size) -> int:
    """The chunk-by-chunk form's work, counted like the probe: (c, c) scores and mix, state read and update."""
    L, D, Dv = q.shape[-2], q.shape[-1], v.shape[-1]
    M, c = D, min(chunk_size, L)  # elu(x) + 1 keeps the feature size
    per_head = L * (2 * c * M + 2 * c * Dv + 3 * c + 4 * M * Dv + 4 * M + 3 * Dv + 4 * D)
    return _heads(q) * per_head


def _judge_chunkwise(cases, outcomes):
    checklist = Checklist()
    with checklist.check("output has shape (..., L, Dv) and the input's dtype"):
        for case, _, got in answered(cases, outcomes, hints=_CHUNKWISE_ERROR_HINTS):
            q, _, v, _ = case.args
            expect_shape(got, (*q.shape[:-1], v.shape[-1]), what=case.name)
            expect_dtype(got, q.dtype, what=case.name)
    for title, indices in (
        ("equals the causally masked quadratic form, chunks of 4 (L a multiple, then a last shorter chunk)",
         (_CW_MULTIPLE, _CW_SHORT_LAST)),
        ("chunks of one position; one chunk longer than the sequence", (_CW_ONE, _CW_ONE_CHUNK)),
        ("a query with zero features gives a zero row, not NaN (eps)", (_CW_ZERO_FEATURES,)),
        ("float32 inputs", (_CW_FLOAT32,)),
        ("long and wide sequences match the quadratic form", (_CW_LONG, _CW_LONG_2, _CW_WIDE, _CW_WIDE_2)),
    ):
        with checklist.check(title):
            for index in indices:
                case = cases[index]
                got = returned(outcomes[index], what=case.name, hints=_CHUNKWISE_ERROR_HINTS)
                q, k, v, chunk_size = case.args
                expected = linear_attention_quadratic(q.double(), k.double(), v.double(), is_causal=True)
                expect_shape(got, expected.shape, what=case.name)
                if torch.isnan(got).any():
                    raise Fail(
                        f"{case.name}: NaN in your output. Where phi(q_t) is 0 numerator and denominator are both 0: "
                        "eps in the denominator, num / (den + eps), keeps that row finite."
                    )
                atol = 1e-5 if q.dtype == torch.float32 else 1e-9
                hint = _diagnose_chunkwise(got, *case.args) if q.dtype == torch.float64 else ""
                expect_close(got, expected, what=case.name, atol=atol, rtol=1e-7 if atol < 1e-6 else 1e-4,
                             hint=hint or "")
    with checklist.check("never forms an (L, L) matrix: every intermediate stays below L * L elements"):
        for index in (_CW_LONG, _CW_LONG_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            L = case.args[0].shape[-2]
            expect_largest_below(
                outcome, L * L, what=case.name,
                constraint=f"the chunkwise form never forms the (L, L) = ({L}, {L}) matrix: only one (c, c) block of "
                "scores per chunk, inside the chunk; everything before the chunk reaches it through the state "
                "S (M, Dv) and z (M,).",
            )
    with checklist.check("keeps states only at chunk boundaries: no (c, M, Dv) block of per-position states"):
        for index in (_CW_WIDE, _CW_WIDE_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            q, _, v, chunk_size = case.args
            M, Dv = q.shape[-1], v.shape[-1]
            rule = (f"the chunkwise form holds one (c, c) block of scores per chunk and one state S (M, Dv) = "
                    f"({M}, {Dv}) per chunk boundary, never a state per position.")
            dims = largest_dims(outcome)
            per_position = len(dims) >= 3 and dims[-2:] == (M, Dv) and dims[-3] in (chunk_size, q.shape[-2])
            expect_largest_below(
                outcome, _heads(q) * chunk_size * M * Dv, what=case.name,
                constraint=(f"those are per-position prefix sums S_t, an (M, Dv) = ({M}, {Dv}) state for each of "
                            f"{dims[-3] if dims else 0} positions: {rule}") if per_position else rule,
            )
    with checklist.check(f"work grows like L, not L * L (within {FLOP_FACTOR}x the chunkwise form's)"):
        for index in (_CW_LONG, _CW_LONG_2):
            case, outcome = cases[index], outcomes[index]
            returned(outcome, what=case.name)
            intended = _chunkwise_flops(*case.args)
            expect_flops_at_most(
                outcome, FLOP_FACTOR * intended, what=case.name, intended=intended,
                hint=_small_tensors_story(
                    outcome, case.args[0].shape[-2] ** 2,
                    "Each chunk's state is the previous chunk's plus that chunk's keys and values: O(L) in all.",
                    "your tensors stay below (L, L), but summing the state again from the start for every chunk or "
                    "position costs O(L^2)."),
            )
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes, hints=_CHUNKWISE_ERROR_HINTS):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _chunkwise_reference(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size)


def _chunkwise_parallel(q, k, v, chunk_size):
    """Correct: every chunk at once (padded to whole chunks), the states before each chunk by an exclusive cumsum."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    L = q.shape[-2]
    n = -(-L // chunk_size)
    pad = n * chunk_size - L
    pq, pk, pv = (F.pad(x, (0, 0, 0, pad)).unflatten(-2, (n, chunk_size)) for x in (phi_q, phi_k, v))  # (..., n, c, .)
    scores = (pq @ pk.transpose(-2, -1)).tril()  # (..., n, c, c); padded keys have phi = 0 after F.pad
    chunk_kv = pk.transpose(-2, -1) @ pv  # (..., n, M, Dv)
    chunk_z = pk.sum(dim=-2)  # (..., n, M)
    state = chunk_kv.cumsum(dim=-3) - chunk_kv  # (..., n, M, Dv), the chunks before each one
    z = (chunk_z.cumsum(dim=-2) - chunk_z)[..., None]  # (..., n, M, 1)
    out = (scores @ pv + pq @ state) / (scores.sum(dim=-1, keepdim=True) + pq @ z + EPS)  # (..., n, c, Dv)
    return out.flatten(-3, -2)[..., :L, :]  # (..., L, Dv)


def _chunkwise_no_intra_mask(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, intra="all")


def _chunkwise_strict(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, intra="strict")


def _chunkwise_update_first(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, update_first=True)


def _chunkwise_no_carry(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, carry=False)


def _chunkwise_whole_chunks(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, whole_chunks_only=True)


def _chunkwise_no_eps(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, eps=0.0)


def _chunkwise_unnormalised(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, normalise=False)


def _chunkwise_relu(q, k, v, chunk_size):
    return _chunkwise_form(q, k, v, chunk_size, feature_map=F.relu)


def _chunkwise_in_place(q, k, v, chunk_size):
    phi_q, phi_k = F.elu_(q).add_(1), F.elu_(k).add_(1)  # the caller's q and k overwritten
    return _chunkwise_form(phi_q, phi_k, v, chunk_size, feature_map=lambda x: x)


def _chunkwise_prefix_sums(q, k, v, chunk_size):
    """Right values, task 2's form: the (L, M, Dv) prefix sums of every position at once."""
    return _prefix_sums(q, k, v)


def _chunkwise_cumsum_per_chunk(q, k, v, chunk_size):
    """Right values, the library's causal form: per-position prefix sums (c, M, Dv) inside each chunk, carried over."""
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M)
    carry_kv, carry_z, outputs = 0, 0, []
    for start in range(0, q.shape[-2], chunk_size):
        pq, pk, pv = (x[..., start:start + chunk_size, :] for x in (phi_q, phi_k, v))  # (..., c, M or Dv)
        kv = carry_kv + (pk[..., :, :, None] * pv[..., :, None, :]).cumsum(dim=-3)  # (..., c, M, Dv)
        z = carry_z + pk.cumsum(dim=-2)  # (..., c, M)
        numerator = (pq[..., :, :, None] * kv).sum(dim=-2)  # (..., c, Dv)
        outputs.append(numerator / ((pq * z).sum(dim=-1, keepdim=True) + EPS))
        carry_kv, carry_z = kv[..., -1:, :, :], z[..., -1:, :]  # the sums up to the chunk's end
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _chunkwise_quadratic(q, k, v, chunk_size):
    return _causal_masked_quadratic(q, k, v)


def _chunkwise_state_from_scratch(q, k, v, chunk_size):
    """Right values, small tensors, O(L^2) work: each position's state summed again from j = 0."""
    return _causal_sums_from_scratch(q, k, v)


def _chunkwise_recurrent(q, k, v, chunk_size):
    """Correct: the recurrent form, which is the chunkwise form with chunks of one position."""
    return _causal_recurrent(q, k, v)


def _chunkwise_delegates(q, k, v, chunk_size):
    import attn_course as ac

    return ac.linear_attention(q, k, v, is_causal=True, chunk_size=chunk_size)


CHUNKWISE_CAUSAL_LINEAR_ATTENTION = Task(
    id="06.chunkwise_causal_linear_attention",
    title="Chunkwise-parallel causal linear attention",
    function_name="chunkwise_causal_linear_attention",
    make_cases=_chunkwise_cases,
    judge=_judge_chunkwise,
    reference=_chunkwise_reference,
    wrong={
        "no causal mask inside the chunk": Wrong(_chunkwise_no_intra_mask, "read the whole chunk"),
        "strict mask inside the chunk (j < t)": Wrong(_chunkwise_strict, "include its own key"),
        "state updated before it is read": Wrong(_chunkwise_update_first, "counts twice"),
        "state not carried between chunks": Wrong(_chunkwise_no_carry, "empty state"),
        "assumes L is a multiple of chunk_size": Wrong(_chunkwise_whole_chunks, "last chunk be shorter"),
        "no eps": Wrong(_chunkwise_no_eps, "left out eps"),
        "not normalised": Wrong(_chunkwise_unnormalised, "not normalised"),
        "relu feature map": Wrong(_chunkwise_relu, "used relu as the feature map"),
        "features computed in place": Wrong(_chunkwise_in_place, "in place", kind="contract"),
        "task 2's prefix sums over the whole sequence": Wrong(
            _chunkwise_prefix_sums, "per-position prefix sums", kind="algorithm"
        ),
        "per-position prefix sums inside each chunk": Wrong(
            _chunkwise_cumsum_per_chunk, "per-position prefix sums", kind="algorithm"
        ),
        "causal mask on the quadratic form": Wrong(_chunkwise_quadratic, "never forms the (L, L)", kind="algorithm"),
        "each position's state summed from scratch": Wrong(
            _chunkwise_state_from_scratch, "summing the state again from the start", kind="algorithm"
        ),
        "calls attn_course.linear_attention(is_causal=True)": Wrong(
            _chunkwise_delegates, "you called attn_course.linear_attention", kind="algorithm"
        ),
    },
    accepted={
        "every chunk at once, states by an exclusive cumsum over chunks": _chunkwise_parallel,
        # The grader measures memory and work, not parallelism: the recurrent form (chunks of one
        # position) keeps one (M, Dv) state too. Lesson 06 times why chunks are faster.
        "recurrent form, one position at a time": _chunkwise_recurrent,
    },
    measure=("largest", "flops"),
    forbidden=FORBIDDEN,
    stretch=True,
)
