"""Graded tasks for lesson 06 (linear attention): the reassociated form with padding, causal via prefix sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...linear import linear_attention, linear_attention_quadratic
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, returned, seeded_randn
from ._variants import distinct_match

__all__ = ["LINEAR_ATTENTION", "CAUSAL_LINEAR_ATTENTION"]

EPS = 1e-6


def _phi(x):
    return F.elu(x) + 1  # (..., N, D), the feature map of both tasks


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
        Case("the second sequence is all padding: mask (2, 1, 1, 6), q, k, v (2, 1, 6, 4), float64",
             (randn(2, 1, 6, 4), randn(2, 1, 6, 4), randn(2, 1, 6, 4), all_padding)),
        Case("no mask, float32: q, k, v (1, 2, 8, 8)",
             (randn(1, 2, 8, 8, dtype=torch.float32), randn(1, 2, 8, 8, dtype=torch.float32),
              randn(1, 2, 8, 8, dtype=torch.float32), None)),
    ]


_NO_MASK, _PADDED, _ALL_PADDING, _LINEAR_FLOAT32 = range(4)


def _values_masked_only(q, k, v, mask):
    """Padding removed from the numerator (zero values) but still counted in z."""
    if mask is None:
        return linear_attention(q, k, v)
    phi_q, phi_k = _phi(q), _phi(k)  # (..., L, M), (..., S, M)
    v = v * mask.transpose(-2, -1)  # (..., S, Dv), padded values zeroed
    numerator = phi_q @ (phi_k.transpose(-2, -1) @ v)  # (..., L, Dv)
    return numerator / (phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1) + EPS)  # (..., L, Dv)


def _numerator_only(q, k, v, mask):
    phi_q, phi_k = _phi(q), _phi(k)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M)
    return phi_q @ (phi_k.transpose(-2, -1) @ v)  # (..., L, Dv)


def _eps_outside(q, k, v, mask, *, is_causal=False):
    return linear_attention(q, k, v, mask, is_causal=is_causal, eps=0.0) + EPS


def _diagnose_linear(got, q, k, v, mask) -> str | None:
    return distinct_match(
        got,
        linear_attention(q, k, v, mask),
        [
            (lambda: linear_attention(q, k, v, mask, eps=0.0),
             "you left out eps. Add eps = 1e-6 to the denominator, num / (den + eps): it keeps rows whose "
             "denominator is 0 finite, and the checker expects exactly that formula."),
            (lambda: linear_attention(q, k, v),
             "your output ignores the padding mask: padded keys must add nothing to phi(K)^T V or to z. Zero their "
             "features, e.g. phi_k * mask.transpose(-2, -1)."),
            (lambda: _values_masked_only(q, k, v, mask),
             "you removed the padded keys from the numerator only: they still count in the normaliser "
             "z = sum_j phi(k_j). Zero their features (not just their values)."),
            (lambda: _numerator_only(q, k, v, mask),
             "the output is not normalised: divide phi(Q) (phi(K)^T V) by phi(Q) z + eps, with z = sum_j phi(k_j)."),
            (lambda: linear_attention(q, k, v, mask, feature_map="relu"),
             "you used relu as the feature map; this task uses elu(x) + 1, which is positive everywhere."),
            (lambda: _eps_outside(q, k, v, mask),
             "eps belongs in the denominator: num / (den + eps), not num / den + eps."),
            (lambda: torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v,
             "that is softmax attention. Linear attention replaces exp(q.k) by phi(q).phi(k) with phi(x) = elu(x) + 1."),
        ],
    )


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
                    f"{case.name}: the all-padding sequence gives NaN. Its z is 0, so the denominator is 0: add "
                    "eps = 1e-6 to it, num / (den + eps), and those rows become 0."
                )
            expect_close(got, expected, what=case.name, atol=atol, rtol=atol, hint=_diagnose_linear(got, *case.args) or "")
    with checklist.check("leaves q, k, v and the mask unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _linear_reference(q, k, v, mask):
    return linear_attention(q, k, v, mask, feature_map="elu", eps=EPS)


def _linear_no_eps(q, k, v, mask):
    return linear_attention(q, k, v, mask, eps=0.0)


def _linear_ignores_mask(q, k, v, mask):
    return linear_attention(q, k, v)


def _linear_relu(q, k, v, mask):
    return linear_attention(q, k, v, mask, feature_map="relu")


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
        "no eps": Wrong(_linear_no_eps, "add eps"),
        "ignores the padding mask": Wrong(_linear_ignores_mask, "ignores the padding mask"),
        "padding zeroed in the values only": Wrong(_values_masked_only, "numerator only"),
        "not normalised": Wrong(_numerator_only, "not normalised"),
        "relu feature map": Wrong(_linear_relu, "elu(x) + 1"),
        "eps added to the output": Wrong(_eps_outside, "belongs in the denominator"),
        "softmax attention": Wrong(_linear_softmax, "is softmax attention"),
    },
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
    q_zero = randn(1, 12, 5)
    q_zero[:, 4, :] = -800.0  # phi(q_4) = exp(-800) = 0 in float64: a zero denominator
    return [
        Case("q, k (2, 2, 9, 4), v (2, 2, 9, 3), float64", (q, k, v)),
        Case("the same q, with keys and values changed at positions 6, 7, 8 only", (q.clone(), k_future, v_future)),
        Case("q, k, v (1, 12, 5) without a head axis; q[:, 4] = -800, so phi(q_4) = 0, float64",
             (q_zero, randn(1, 12, 5), randn(1, 12, 5))),
        Case("a single position: q, k, v (2, 1, 4), float64", (randn(2, 1, 4), randn(2, 1, 4), randn(2, 1, 4))),
        Case("float32: q, k, v (1, 2, 16, 8)",
             (randn(1, 2, 16, 8, dtype=torch.float32), randn(1, 2, 16, 8, dtype=torch.float32),
              randn(1, 2, 16, 8, dtype=torch.float32))),
    ]


_CAUSAL, _FUTURE_CHANGED, _ZERO_FEATURES, _SINGLE, _CAUSAL_FLOAT32 = range(5)


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
             "position t used keys after t: your output equals non-causal linear attention. Use prefix sums "
             "(cumsum over the positions) instead of sums over the whole sequence."),
            (lambda: _prefix_sums(q, k, v, exclusive=True),
             "position t must include its own key and value: S_t = sum over j <= t (an inclusive cumsum), "
             "not j < t."),
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
            expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=_diagnose_causal(got, *case.args) or "")
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
                f"{case.name}: NaN in your output. phi(q_4) is 0, so both numerator and denominator are 0 there: add "
                "eps = 1e-6 to the denominator, num / (den + eps)."
            )
        expect_close(got, expected, what=case.name, atol=1e-9, rtol=1e-7, hint=_diagnose_causal(got, *case.args) or "")
    with checklist.check("float32 inputs"):
        case = cases[_CAUSAL_FLOAT32]
        got = returned(outcomes[_CAUSAL_FLOAT32], what=case.name)
        expected = linear_attention(*(x.double() for x in case.args), is_causal=True)
        expect_shape(got, expected.shape, what=case.name)
        expect_close(got, expected, what=case.name, atol=1e-5, rtol=1e-4)
    with checklist.check("leaves q, k and v unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


def _causal_reference(q, k, v):
    return linear_attention(q, k, v, feature_map="elu", is_causal=True, eps=EPS)


def _causal_non_causal(q, k, v):
    return linear_attention(q, k, v)


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
        "sums over the whole sequence (not causal)": Wrong(_causal_non_causal, "leaks from the future"),
        "exclusive prefix sums (j < t)": Wrong(_causal_exclusive, "include its own key"),
        "suffix sums (j >= t)": Wrong(_causal_reversed, "summed from the end"),
        "no eps": Wrong(_causal_no_eps, "add eps"),
        "not normalised": Wrong(_causal_unnormalised, "not normalised"),
        "relu feature map": Wrong(_causal_relu, "elu(x) + 1"),
        "features computed in place": Wrong(_causal_loop_in_place, "in place", kind="contract"),
    },
)
