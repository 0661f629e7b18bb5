"""Graded tasks for lesson 10 (Conformer): the relative shift, the padding-aware convolution module."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...conformer import ConvolutionModule
from ...masks import padding_mask
from ...positional import rel_shift
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_inputs_unchanged, expect_shape
from ._common import answered, first_match, returned

__all__ = ["REL_SHIFT", "CONV_MODULE"]


# --- 10.rel_shift ----------------------------------------------------------------------------
# rel_shift(scores): (..., L, 2L-1) -> (..., L, L) with out[..., i, j] = scores[..., i, L-1-i+j]
# (column c of the input holds offset L-1-c; the output is indexed by key j, offset i - j).


def _column_codes(shape: tuple[int, ...]) -> torch.Tensor:
    """scores[..., i, c] = 1000 * (batch index) + 100 * i + c: every entry says where it came from."""
    *batch, L, width = shape
    n = 1
    for size in batch:
        n *= size
    b = torch.arange(n, dtype=torch.float64).reshape(*batch, 1, 1) if batch else torch.zeros(1, 1, dtype=torch.float64)
    i = torch.arange(L, dtype=torch.float64)[:, None]  # (L, 1)
    c = torch.arange(width, dtype=torch.float64)[None, :]  # (1, 2L-1)
    return (1000 * b + 100 * i + c).expand(*shape).clone()  # (..., L, 2L-1)


def _rel_shift_cases() -> list[Case]:
    shapes = [(4, 7), (2, 3, 5, 9), (1, 1, 1)]
    return [Case(f"rel_shift(scores of shape {shape})", (_column_codes(shape),)) for shape in shapes]


def _pick(scores: torch.Tensor, column) -> torch.Tensor:
    """out[..., i, j] = scores[..., i, column(i, j, L)] (a gather; used to build the wrong variants)."""
    L = scores.shape[-2]
    i = torch.arange(L)[:, None]  # (L, 1)
    j = torch.arange(L)[None, :]  # (1, L)
    index = column(i, j, L).expand(*scores.shape[:-1], L)  # (..., L, L)
    return scores.gather(-1, index)  # (..., L, L)


def _shift_first_columns(scores):
    return scores[..., : scores.shape[-2]]  # no shift at all


def _shift_sign_flipped(scores):
    return _pick(scores, lambda i, j, L: L - 1 + i - j)  # offset j - i instead of i - j


def _shift_by_row(scores):
    return _pick(scores, lambda i, j, L: i + j)  # shifted by i instead of L - 1 - i


def _shift_last_columns(scores):
    return scores[..., scores.shape[-2] - 1 :]  # the offsets <= 0 for every row


def _shift_pad_right(scores):
    *batch, L, width = scores.shape
    padded = F.pad(scores, (0, 1)).reshape(*batch, 2 * L, L)  # zero column at the end
    return padded[..., 1:, :].reshape(*batch, L, 2 * L - 1)[..., :L]


def _rel_shift_reference(scores):
    return rel_shift(scores)


def _diagnose_shift(got, scores) -> str:
    found = first_match(
        got,
        [
            (lambda: _shift_first_columns(scores),
             "you kept the first L columns of every row without shifting: row i must be shifted left by L - 1 - i, "
             "so that out[i, j] = scores[i, L - 1 - i + j] (offset i - j)."),
            (lambda: _shift_sign_flipped(scores),
             "your out[i, j] holds offset j - i; it must hold offset i - j (input column L - 1 - i + j): "
             "the sign is flipped, so the model would see the future where it should see the past."),
            (lambda: _shift_by_row(scores),
             "you shifted row i left by i; shift it by L - 1 - i (the last row is not shifted, the first the most)."),
            (lambda: _shift_last_columns(scores),
             "you kept the last L columns of every row (offsets 0 down to -(L-1)) for every query: the shift must "
             "depend on the row, out[i, j] = scores[i, L - 1 - i + j]."),
            (lambda: _shift_pad_right(scores),
             "the zero column goes in front (F.pad(scores, (1, 0))), not at the end: with it at the end the rows "
             "slide the wrong way after the reshape."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return "out[..., i, j] must be scores[..., i, L - 1 - i + j]."


def _judge_rel_shift(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (..., L, L)"):
        for case, _, got in answered(cases, outcomes):
            (scores,) = case.args
            L = scores.shape[-2]
            expect_shape(got, (*scores.shape[:-1], L), what=case.name, hint="One score per (query, key) pair.")
    for title, indices in (("out[i, j] holds the score of offset i - j", (0,)),
                           ("any batch shape, and L = 1", (1, 2))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                (scores,) = case.args
                got = returned(outcome, what=case.name)
                expected = rel_shift(scores)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_shift(got, scores)}")
    with checklist.check("leaves scores unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


REL_SHIFT = Task(
    id="10.rel_shift",
    title="The relative shift: scores by offset -> scores by key",
    function_name="rel_shift",
    make_cases=_rel_shift_cases,
    judge=_judge_rel_shift,
    reference=_rel_shift_reference,
    wrong={
        "no shift (first L columns)": Wrong(_shift_first_columns, "without shifting"),
        "offset j - i (sign flipped)": Wrong(_shift_sign_flipped, "sign is flipped"),
        "row i shifted by i": Wrong(_shift_by_row, "shift it by L - 1 - i"),
        "last L columns for every row": Wrong(_shift_last_columns, "depend on the row"),
        "zero column padded at the end": Wrong(_shift_pad_right, "goes in front"),
    },
)


# --- 10.conv_module --------------------------------------------------------------------------
# conv_module(x (B, T, E), keep (B, T) bool, weights dict) -> (B, T, E): the Conformer's
# convolution module in evaluation mode, padded frames zeroed before the depthwise conv.
# Only the real frames (keep True) are graded.

_WEIGHT_NAMES = (
    "norm.weight", "norm.bias", "pointwise1.weight", "pointwise1.bias", "depthwise.weight", "depthwise.bias",
    "batch_norm.weight", "batch_norm.bias", "batch_norm.running_mean", "batch_norm.running_var",
    "pointwise2.weight", "pointwise2.bias",
)


def _conv_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1010)
    cases = []
    for B, T, E, K, lengths in [(2, 9, 6, 5, [9, 6]), (3, 12, 8, 7, [12, 5, 9]), (1, 7, 4, 3, [7])]:
        x = torch.randn(B, T, E, generator=gen, dtype=torch.float64)
        keep = padding_mask(torch.tensor(lengths), T)  # (B, T)
        x = torch.where(keep[:, :, None], x, 50.0 * torch.randn(B, T, E, generator=gen, dtype=torch.float64))
        with torch.random.fork_rng(devices=[]):  # the module's init must not move the learner's random state
            state = ConvolutionModule(E, kernel_size=K, dropout=0.0, dtype=torch.float64).state_dict()
        weights = {}
        for name in _WEIGHT_NAMES:
            value = torch.randn(state[name].shape, generator=gen, dtype=torch.float64) * 0.5
            if name == "batch_norm.running_var":
                value = value.abs() + 0.5
            weights[name] = value
        cases.append(Case(f"x (B={B}, T={T}, E={E}), kernel {K}, lengths {lengths}", (x, keep, weights)))
    return cases


def _conv_variant(x, keep, w, *, zero_padding=True, glu="ok", activation=F.silu, norm=True, bn_first=True):
    """The convolution module with one classic mistake switched on."""
    eps = 1e-5
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"], eps) if norm else x  # (B, T, E)
    y = F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"])  # (B, 2E, T)
    a, b = y.chunk(2, dim=1)  # (B, E, T) each
    y = a * torch.sigmoid(b) if glu == "ok" else b * torch.sigmoid(a)  # (B, E, T)
    if zero_padding:
        y = y.masked_fill(~keep[:, None, :], 0.0)  # (B, E, T)
    K = w["depthwise.weight"].shape[-1]
    y = F.conv1d(y, w["depthwise.weight"], w["depthwise.bias"], padding=K // 2, groups=y.shape[1])  # (B, E, T)

    def batch_norm(t):
        return F.batch_norm(t, w["batch_norm.running_mean"], w["batch_norm.running_var"], w["batch_norm.weight"],
                            w["batch_norm.bias"], training=False, eps=eps)

    y = activation(batch_norm(y)) if bn_first else batch_norm(activation(y))  # (B, E, T)
    y = F.conv1d(y, w["pointwise2.weight"], w["pointwise2.bias"])  # (B, E, T)
    return y.transpose(1, 2)  # (B, T, E)


def _conv_expected(x, keep, weights):
    E = x.shape[-1]
    K = weights["depthwise.weight"].shape[-1]
    module = ConvolutionModule(E, kernel_size=K, dropout=0.0, dtype=x.dtype)
    module.load_state_dict({**weights, "batch_norm.num_batches_tracked": torch.tensor(0)})
    with torch.no_grad():
        return module.eval()(x, keep)  # (B, T, E)


def _conv_reference(x, keep, weights):
    return _conv_variant(x, keep, weights)


def _conv_no_zeroing(x, keep, w):
    return _conv_variant(x, keep, w, zero_padding=False)


def _conv_glu_swapped(x, keep, w):
    return _conv_variant(x, keep, w, glu="swapped")


def _conv_relu(x, keep, w):
    return _conv_variant(x, keep, w, activation=F.relu)


def _conv_no_layernorm(x, keep, w):
    return _conv_variant(x, keep, w, norm=False)


def _conv_swish_before_bn(x, keep, w):
    return _conv_variant(x, keep, w, bn_first=False)


def _diagnose_conv(got, x, keep, w) -> str | None:
    def variant(**changes):
        return lambda: _conv_variant(x, keep, w, **changes)[keep]

    return first_match(
        got,
        [
            (variant(zero_padding=False),
             "padding leaks into real frames: the depthwise convolution near the end of a clip reads the padded "
             "frames. Zero them (masked_fill with ~keep) right before the depthwise convolution."),
            (variant(glu="swapped"),
             "your GLU gates the wrong half: GLU(a, b) = a * sigmoid(b) with a the FIRST E channels (F.glu(y, dim=1))."),
            (variant(activation=F.relu),
             "you used ReLU; the Conformer uses Swish (SiLU): x * sigmoid(x), F.silu."),
            (variant(norm=False), "you skipped the module's LayerNorm: every Conformer module starts with one."),
            (variant(bn_first=False), "the order is depthwise conv -> BatchNorm -> Swish; you applied Swish first."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _judge_conv(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (B, T, E) in the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            x = case.args[0]
            expect_shape(got, x.shape, what=case.name, hint="Pad the depthwise convolution by kernel_size // 2.")
            expect_dtype(got, x.dtype, what=case.name)
    for title, indices in (("real frames match the Conformer's convolution module", (0, 1)),
                           ("a clip without padding", (2,))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                x, keep, weights = case.args
                got = returned(outcome, what=case.name, hints=(
                    ("groups", "the depthwise convolution has one filter per channel: F.conv1d(..., groups=E)."),
                ))
                expected = _conv_expected(x, keep, weights)
                expect_shape(got, expected.shape, what=case.name)
                expect_close(got[keep], expected[keep], what=f"{case.name} (real frames)", atol=1e-9, rtol=1e-7,
                             hint=_diagnose_conv(got[keep], x, keep, weights) or "")
    with checklist.check("leaves x, keep and the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            expect_inputs_unchanged(case, outcome, what=case.name)
    return checklist.results


CONV_MODULE = Task(
    id="10.conv_module",
    title="The Conformer's convolution module, padding-aware",
    function_name="conv_module",
    make_cases=_conv_cases,
    judge=_judge_conv,
    reference=_conv_reference,
    wrong={
        "padding not zeroed before the depthwise conv": Wrong(_conv_no_zeroing, "leaks into real frames"),
        "GLU gates the wrong half": Wrong(_conv_glu_swapped, "wrong half"),
        "ReLU instead of Swish": Wrong(_conv_relu, "Swish"),
        "no LayerNorm": Wrong(_conv_no_layernorm, "LayerNorm"),
        "Swish before BatchNorm": Wrong(_conv_swish_before_bn, "depthwise conv -> BatchNorm -> Swish"),
    },
)
