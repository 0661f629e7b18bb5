"""Graded tasks for lesson 10 (Conformer): the relative shift, the padding-aware convolution module,
and (stretch) one step of a streaming, causal convolution module."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...conformer import ConvolutionModule
from ...masks import padding_mask
from ..core import Case, Fail, Task, Wrong
from ..judging import (
    Checklist,
    expect_close,
    expect_dtype,
    expect_inputs_unchanged,
    expect_largest_below,
    expect_shape,
)
from ._common import answered, first_match, returned, seeded_randn

__all__ = ["REL_SHIFT", "CONV_MODULE", "STREAMING_CONV"]


# --- 10.rel_shift ----------------------------------------------------------------------------
# rel_shift(scores): (..., L, 2L-1) -> (..., L, L) with out[..., i, j] = scores[..., i, L-1-i+j]
# (column c of the input holds offset L-1-c; the output is indexed by key j, offset i - j).

_REL_SHIFT_FORBIDDEN = ("attn_course.positional.rel_shift",)
# The task is the Transformer-XL shift itself: re-cut the memory of `scores` (pad, reshape, slice, or
# any other views), not an index tensor or a loop over positions, which the lesson's direct
# indexing already is. An index tensor shows as one of these ops (probe measure "ops"):
_REL_SHIFT_INDEX_OPS = frozenset({
    "aten.gather", "aten.index", "aten.index_select", "aten.take", "aten.take_along_dim", "aten.index_put",
    "aten.index_put_", "aten._index_put_impl_", "aten.scatter", "aten.scatter_", "aten.masked_select",
    "aten.embedding",
})
# and a loop over rows, columns or diagonals as ops that grow with L. Measured on the two long cases
# (L = 48 and 32): the pad trick runs 5 aten ops, a zero column with torch.cat 6, as_strided 1, unfold
# and diagonal 5; a loop over the rows with torch.stack runs 2L + 1 (97 and 65). A limit of 20 leaves
# room for a longer way of writing the trick and is below L on both cases.
_REL_SHIFT_MAX_OPS = 20
# A shift keeps its intermediates about the size of `scores`: the Transformer-XL trick pads one
# column ((..., L, 2L): measured 4,608 and 4,096 elements on the two long cases, 1.01x the input),
# a gather or a loop makes only the (..., L, L) output. A one-hot selection tensor (L, L, 2L-1) is
# L / batch times the input: measured 218,880 and 64,512 elements (48x and 16x), so a limit of 4x
# separates them with room on both sides.
_REL_SHIFT_LARGEST_FACTOR = 4


def _column_codes(shape: tuple[int, ...]) -> torch.Tensor:
    """scores[..., i, c] = 10000 * (batch index) + 100 * i + c: every entry says where it came from."""
    *batch, L, width = shape
    n = 1
    for size in batch:
        n *= size
    b = torch.arange(n, dtype=torch.float64).reshape(*batch, 1, 1) if batch else torch.zeros(1, 1, dtype=torch.float64)
    i = torch.arange(L, dtype=torch.float64)[:, None]  # (L, 1)
    c = torch.arange(width, dtype=torch.float64)[None, :]  # (1, 2L-1)
    return (10000 * b + 100 * i + c).expand(*shape).clone()  # (..., L, 2L-1)


_REL_SHIFT_SHAPES = [(4, 7), (3, 2, 3), (2, 3, 5, 9), (1, 48, 95), (2, 32, 63), (1, 1, 1)]


def _rel_shift_cases() -> list[Case]:
    return [Case(f"rel_shift(scores of shape {shape})", (_column_codes(shape),)) for shape in _REL_SHIFT_SHAPES]


def _rel_shift_reference(scores):
    """The Transformer-XL shift, written out (the task forbids calling the library's)."""
    *batch, L, width = scores.shape
    padded = F.pad(scores, (1, 0)).reshape(*batch, 2 * L, L)  # (..., 2L, L): a zero column in front, rows re-cut
    return padded[..., 1:, :].reshape(*batch, L, 2 * L - 1)[..., :L]  # (..., L, L)


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
    return _rel_shift_reference(scores.flip(-1))  # offset j - i instead of i - j: out[i, j] = scores[i, L-1+i-j]


def _shift_by_row(scores):
    """Shifted by i instead of L - 1 - i: out[i, j] = scores[i, i + j], a strided view (no index)."""
    scores = scores.contiguous()
    *batch_strides, row, _ = scores.stride()
    return scores.as_strided((*scores.shape[:-1], scores.shape[-2]), (*batch_strides, row + 1, 1))  # (..., L, L)


def _shift_last_columns(scores):
    return scores[..., scores.shape[-2] - 1 :]  # the offsets <= 0 for every row


def _shift_pad_right(scores):
    *batch, L, width = scores.shape
    padded = F.pad(scores, (0, 1)).reshape(*batch, 2 * L, L)  # zero column at the end
    return padded[..., 1:, :].reshape(*batch, L, 2 * L - 1)[..., :L]


def _shift_wrong_rows_kept(scores):
    *batch, L, width = scores.shape
    padded = F.pad(scores, (1, 0)).reshape(*batch, 2 * L, L)  # (..., 2L, L)
    return padded[..., :-1, :].reshape(*batch, L, 2 * L - 1)[..., :L]  # drops the last row instead of the first


def _shift_selection_tensor(scores):
    """Right values, wrong algorithm: a one-hot (L, L, 2L-1) tensor picks each (i, j)'s column."""
    L, width = scores.shape[-2:]
    column = (L - 1) - torch.arange(L)[:, None] + torch.arange(L)[None, :]  # (L, L)
    select = F.one_hot(column, width).to(scores.dtype)  # (L, L, 2L-1)
    return torch.einsum("...ic,ijc->...ij", scores, select)  # (..., L, L)


def _shift_float32(scores):
    """Right values in the wrong dtype: the shift written into torch.zeros' default float32."""
    out = torch.zeros(*scores.shape[:-1], scores.shape[-2])  # float32, whatever the input
    return out.copy_(_rel_shift_reference(scores))


def _shift_gather(scores):
    """Right values, not the task's algorithm: gather with an (L, L) index of columns."""
    return _pick(scores, lambda i, j, L: L - 1 - i + j)


def _shift_advanced_index(scores):
    """Right values, not the task's algorithm: index every row with its own columns (aten.index)."""
    L = scores.shape[-2]
    column = (L - 1) - torch.arange(L)[:, None] + torch.arange(L)[None, :]  # (L, L): column of offset i - j
    return scores[..., torch.arange(L)[:, None], column]  # (..., L, L)


def _shift_row_loop(scores):
    """Right values, not the task's algorithm: a Python loop slicing one row at a time."""
    L = scores.shape[-2]
    return torch.stack([scores[..., i, L - 1 - i : 2 * L - 1 - i] for i in range(L)], dim=-2)  # (..., L, L)


def _shift_zero_column_cat(scores):
    """Correct: Transformer-XL's own spelling, the zero column joined with torch.cat and the rows re-cut with view."""
    *batch, L, width = scores.shape
    padded = torch.cat((scores.new_zeros(*batch, L, 1), scores), dim=-1).view(*batch, 2 * L, L)  # (..., 2L, L)
    return padded[..., 1:, :].reshape(*batch, L, width)[..., :L]  # (..., L, L)


def _shift_strided_view(scores):
    """Correct: out[i, j] sits at flat position L - 1 + i (2L - 2) + j of a row-major scores, so one strided view."""
    scores = scores.contiguous()
    *batch_strides, row, _ = scores.stride()
    L = scores.shape[-2]
    return scores.as_strided((*scores.shape[:-1], L), (*batch_strides, row - 1, 1),
                             storage_offset=scores.storage_offset() + L - 1)  # (..., L, L)


def _shift_calls_the_library(scores):
    from attn_course.positional import rel_shift

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
             "the zero column goes in front, not at the end: with it at the end the rows slide the wrong way after the "
             "reshape."),
            (lambda: _shift_wrong_rows_kept(scores),
             "off by one row: after padding and viewing the scores as (2L, L), it is the FIRST row that goes, not the "
             "last."),
        ],
        atol=0,
        rtol=0,
    )
    if found:
        return found
    return "out[..., i, j] must be scores[..., i, L - 1 - i + j]."


def _expect_memory_recut(outcome, L: int, *, what: str) -> None:
    """Fail when the call used an index op, or ran as many aten ops as a loop over L positions (measure "ops")."""
    probe = outcome.probe if isinstance(outcome.probe, dict) else {}
    names, count = probe.get("op_names"), probe.get("op_count")
    if not isinstance(names, list) or isinstance(count, bool) or not isinstance(count, int):
        reason = probe.get("probe_error")
        raise Fail(f"{what}: the grader could not see which PyTorch ops your function ran"
                   + (f" ({reason})" if isinstance(reason, str) else "")
                   + ". Run it again without changing the profiler or dispatch modes.")
    used = sorted(str(name) for name in names if name in _REL_SHIFT_INDEX_OPS)
    if used:
        raise Fail(
            f"{what}: your function picks entries with an index tensor ({', '.join(used)}). That is the slow, direct "
            "way lesson 10 checks the shift with; this task is the Transformer-XL shift, which moves no entry "
            "by index: a zero column in front, then the same numbers re-cut into rows of another length (work out "
            "which on L = 3, each entry labelled by its column)."
        )
    if count > _REL_SHIFT_MAX_OPS:
        raise Fail(
            f"{what}: your function ran {count} PyTorch ops on L = {L} rows (this check allows {_REL_SHIFT_MAX_OPS}): "
            "a loop over positions (rows, columns or diagonals) grows with L. The Transformer-XL shift does every "
            "row at once with a few ops: a zero column in front, then reshapes and slices."
        )


def _judge_rel_shift(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (..., L, L) in the input's dtype"):
        for case, _, got in answered(cases, outcomes):
            (scores,) = case.args
            L = scores.shape[-2]
            expect_shape(got, (*scores.shape[:-1], L), what=case.name, hint="One score per (query, key) pair.")
            expect_dtype(got, scores.dtype, what=case.name,
                         hint="The result keeps the scores' dtype: a new tensor made without it is float32.")
    for title, indices in (("out[i, j] holds the score of offset i - j", (0, 1)),
                           ("any batch shape, long rows, and L = 1", (2, 3, 4, 5))):
        with checklist.check(title):
            for index in indices:
                case, outcome = cases[index], outcomes[index]
                (scores,) = case.args
                got = returned(outcome, what=case.name)
                expected = _rel_shift_reference(scores)
                expect_shape(got, expected.shape, what=case.name)
                if not torch.equal(got.double(), expected):
                    raise Fail(f"{case.name}: {_diagnose_shift(got, scores)}")
    with checklist.check("re-cuts the memory of scores: no index tensor, gather or loop over positions"):
        for index in (3, 4):
            case, outcome = cases[index], outcomes[index]
            (scores,) = case.args
            L = scores.shape[-2]
            returned(outcome, what=case.name)  # an error or a stub is reported first
            _expect_memory_recut(outcome, L, what=case.name)
    with checklist.check("keeps its intermediates about the size of scores"):
        for index in (3, 4):
            case, outcome = cases[index], outcomes[index]
            (scores,) = case.args
            L = scores.shape[-2]
            returned(outcome, what=case.name)  # an error or a stub is reported first
            expect_largest_below(
                outcome, _REL_SHIFT_LARGEST_FACTOR * scores.numel(), what=case.name,
                constraint=f"the shift only moves entries of scores ({scores.numel():,} of them); a selection tensor "
                f"of shape (L, L, 2L-1) = ({L}, {L}, {2 * L - 1}) grows like L^3. Pad, reshape and slice instead.",
            )
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
        "(2L, L) view: last row dropped instead of the first": Wrong(_shift_wrong_rows_kept, "Off by one row"),
        "one-hot (L, L, 2L-1) selection tensor": Wrong(_shift_selection_tensor, "grows like L^3", kind="algorithm"),
        "gather with an (L, L) index": Wrong(_shift_gather, "with an index tensor (aten.gather)", kind="algorithm"),
        "rows indexed with their columns": Wrong(_shift_advanced_index, "with an index tensor (aten.index)", kind="algorithm"),
        "a Python loop over the rows": Wrong(_shift_row_loop, "a loop over positions", kind="algorithm"),
        "calls attn_course's rel_shift": Wrong(_shift_calls_the_library, "you called", kind="algorithm"),
        "float32 output for float64 scores": Wrong(_shift_float32, "has dtype torch.float32, expected torch.float64", kind="contract"),
    },
    measure=("largest", "ops"),
    forbidden=_REL_SHIFT_FORBIDDEN,
    accepted={
        "a zero column joined with torch.cat, rows re-cut with view": _shift_zero_column_cat,
        "one strided view (as_strided)": _shift_strided_view,
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
_CONV_FORBIDDEN = ("attn_course.conformer.ConvolutionModule",)


def _random_weights(randn, E: int, K: int, *, causal: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of a ConvolutionModule(E, kernel_size=K), drawn at random (non-trivial BatchNorm statistics)."""
    with torch.random.fork_rng(devices=[]):  # the module's init must not move the learner's random state
        state = ConvolutionModule(E, kernel_size=K, dropout=0.0, causal=causal, dtype=torch.float64).state_dict()
    weights = {}
    for name in _WEIGHT_NAMES:
        value = randn(*state[name].shape, std=0.5)
        weights[name] = value.abs() + 0.5 if name == "batch_norm.running_var" else value
    return weights


def _conv_cases() -> list[Case]:
    randn = seeded_randn(1010)
    cases = []
    for B, T, E, K, lengths in [(2, 9, 6, 5, [9, 6]), (3, 12, 8, 7, [12, 5, 9]), (1, 7, 4, 3, [7])]:
        x = randn(B, T, E)
        keep = padding_mask(torch.tensor(lengths), T)  # (B, T)
        x = torch.where(keep[:, :, None], x, randn(B, T, E, std=50.0))
        cases.append(Case(f"x (B={B}, T={T}, E={E}), kernel {K}, lengths {lengths}", (x, keep, _random_weights(randn, E, K))))
    return cases


def _conv_variant(x, keep, w, *, zero_padding=True, glu="ok", activation=F.silu, norm=True, bn_first=True):
    """The convolution module with one classic mistake switched on (``zero_padding``: True, False or "input")."""
    eps = 1e-5
    if zero_padding == "input":  # zero the padded frames of x instead of those entering the depthwise conv
        x = x.masked_fill(~keep[:, :, None], 0.0)  # (B, T, E)
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"], eps) if norm else x  # (B, T, E)
    y = F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"])  # (B, 2E, T)
    a, b = y.chunk(2, dim=1)  # (B, E, T) each
    y = a * torch.sigmoid(b) if glu == "ok" else b * torch.sigmoid(a)  # (B, E, T)
    if zero_padding is True:
        y = y.masked_fill(~keep[:, None, :], 0.0)  # (B, E, T)
    K = w["depthwise.weight"].shape[-1]
    y = F.conv1d(y, w["depthwise.weight"], w["depthwise.bias"], padding=K // 2, groups=y.shape[1])  # (B, E, T)

    def batch_norm(t):
        return F.batch_norm(t, w["batch_norm.running_mean"], w["batch_norm.running_var"], w["batch_norm.weight"],
                            w["batch_norm.bias"], training=False, eps=eps)

    y = activation(batch_norm(y)) if bn_first else batch_norm(activation(y))  # (B, E, T)
    y = F.conv1d(y, w["pointwise2.weight"], w["pointwise2.bias"])  # (B, E, T)
    return y.transpose(1, 2)  # (B, T, E)


def _conv_expected(x, keep, weights, *, causal=False):
    """The library's module with these weights, in evaluation mode (used by the judges, never by learners)."""
    E = x.shape[-1]
    K = weights["depthwise.weight"].shape[-1]
    module = ConvolutionModule(E, kernel_size=K, dropout=0.0, causal=causal, dtype=x.dtype)
    module.load_state_dict({**weights, "batch_norm.num_batches_tracked": torch.tensor(0)})
    with torch.no_grad():
        return module.eval()(x, keep)  # (B, T, E)


def _conv_reference(x, keep, weights):
    return _conv_variant(x, keep, weights)


def _conv_no_zeroing(x, keep, w):
    return _conv_variant(x, keep, w, zero_padding=False)


def _conv_zeroed_at_the_input(x, keep, w):
    return _conv_variant(x, keep, w, zero_padding="input")


def _conv_glu_swapped(x, keep, w):
    return _conv_variant(x, keep, w, glu="swapped")


def _conv_relu(x, keep, w):
    return _conv_variant(x, keep, w, activation=F.relu)


def _conv_no_layernorm(x, keep, w):
    return _conv_variant(x, keep, w, norm=False)


def _conv_swish_before_bn(x, keep, w):
    return _conv_variant(x, keep, w, bn_first=False)


def _conv_padding_zeroed_in_place(x, keep, w):
    """Right real frames, but it zeroes the caller's padded input frames in place."""
    x.masked_fill_(~keep[:, :, None], 0.0)
    return _conv_variant(x, keep, w)


def _conv_eps_added_in_place(x, keep, w):
    """Right values, but the caller's running variance gets eps added in place."""
    w["batch_norm.running_var"].add_(1e-5)
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"], 1e-5)  # (B, T, E)
    y = F.glu(F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"]), dim=1)  # (B, E, T)
    y = y.masked_fill(~keep[:, None, :], 0.0)
    K = w["depthwise.weight"].shape[-1]
    y = F.conv1d(y, w["depthwise.weight"], w["depthwise.bias"], padding=K // 2, groups=y.shape[1])  # (B, E, T)
    y = (y - w["batch_norm.running_mean"][:, None]) / w["batch_norm.running_var"][:, None].sqrt()
    y = F.silu(y * w["batch_norm.weight"][:, None] + w["batch_norm.bias"][:, None])  # (B, E, T)
    return F.conv1d(y, w["pointwise2.weight"], w["pointwise2.bias"]).transpose(1, 2)  # (B, T, E)


def _conv_calls_the_library(x, keep, w):
    from attn_course.conformer import ConvolutionModule as Module

    module = Module(x.shape[-1], kernel_size=w["depthwise.weight"].shape[-1], dropout=0.0, dtype=x.dtype)
    module.load_state_dict(w, strict=False)
    with torch.no_grad():
        return module.eval()(x, keep)


def _diagnose_conv(got, x, keep, w) -> str | None:
    def variant(**changes):
        return lambda: _conv_variant(x, keep, w, **changes)[keep]

    return first_match(
        got,
        [
            (variant(zero_padding=False),
             "padding leaks into real frames: the depthwise convolution near the end of a clip reads the padded "
             "frames, which must be zero when it reads them."),
            (variant(zero_padding="input"),
             "you zeroed the padded frames of x, at the input: LayerNorm, the pointwise convolution and the GLU "
             "turn a zero frame into a non-zero one (their biases), which the depthwise convolution then reads "
             "next to the real frames. Zero the padded frames right before the depthwise convolution instead."),
            (variant(glu="swapped"),
             "your GLU gates the wrong half: GLU(a, b) = a * sigmoid(b) with a the FIRST E channels and b, the gate, the second."),
            (variant(activation=F.relu),
             "you used ReLU; the Conformer uses Swish (SiLU): x * sigmoid(x), F.silu."),
            (variant(norm=False), "you skipped the module's LayerNorm: every Conformer module starts with one."),
            (variant(bn_first=False), "the order is depthwise conv -> BatchNorm -> Swish; you applied Swish first."),
        ],
        atol=1e-9,
        rtol=1e-7,
    )


def _expect_unchanged(case: Case, outcome, *, what: str) -> None:
    """Tensor arguments and the tensors of a weights dict must come back as they went in."""
    expect_inputs_unchanged(case, outcome, what=what)
    for before, after in zip(case.args, outcome.args_after):
        if isinstance(before, dict) and isinstance(after, dict):
            for name, value in before.items():
                changed = after.get(name)
                if not isinstance(changed, torch.Tensor) or changed.shape != value.shape or not torch.equal(changed, value):
                    raise Fail(f"{what} changed weights[{name!r}] in place (e.g. with `.add_()` or `+=`). Work on a "
                               "new tensor: the weights belong to the caller and are used again.")


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
                # Padded frames are free: take the expected value there, so a failure names (b, t, e).
                real = keep[:, :, None]  # (B, T, 1)
                expect_close(torch.where(real, got, expected), expected, what=f"{case.name} (real frames)", atol=1e-9,
                             rtol=1e-7, hint=lambda: _diagnose_conv(got[keep], x, keep, weights) or "")
    with checklist.check("leaves x, keep and the weights unchanged"):
        for case, outcome, _ in answered(cases, outcomes):
            _expect_unchanged(case, outcome, what=case.name)
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
        "padding zeroed at the input, as WeNet does (GLU biases leak)": Wrong(
            _conv_zeroed_at_the_input, "zeroed the padded frames of x"),
        "GLU gates the wrong half": Wrong(_conv_glu_swapped, "wrong half"),
        "ReLU instead of Swish": Wrong(_conv_relu, "used ReLU; the Conformer uses Swish"),
        "no LayerNorm": Wrong(_conv_no_layernorm, "skipped the module's LayerNorm"),
        "Swish before BatchNorm": Wrong(_conv_swish_before_bn, "depthwise conv -> BatchNorm -> Swish"),
        "padded input frames zeroed in place": Wrong(_conv_padding_zeroed_in_place, "changed its input argument 0 in place", kind="contract"),
        "eps added to the running variance in place": Wrong(_conv_eps_added_in_place, "changed weights", kind="contract"),
        "calls attn_course's ConvolutionModule": Wrong(_conv_calls_the_library, "you called", kind="algorithm"),
    },
    forbidden=_CONV_FORBIDDEN,
)


# --- 10.streaming_conv (stretch) ---------------------------------------------------------------
# conv_module_step(chunk (B, C, E), cache (B, K-1, E), weights) -> (out (B, C, E), new_cache (B, K-1, E)):
# one step of the convolution module with a *causal* depthwise convolution (frame t reads t-K+1..t),
# run chunk by chunk. `cache` holds the last K-1 frames that entered the depthwise convolution (after
# LayerNorm, pointwise conv and GLU), zeros before the stream starts. Each case is one step with the
# right cache, cut from a whole stream, so a wrong step is caught where it happens.


def _glu_frames(x, w):
    """LayerNorm -> pointwise conv -> GLU, frame by frame: (B, T, E) -> (B, T, E)."""
    y = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"], 1e-5)  # (B, T, E)
    y = F.conv1d(y.transpose(1, 2), w["pointwise1.weight"], w["pointwise1.bias"])  # (B, 2E, T)
    return F.glu(y, dim=1).transpose(1, 2)  # (B, T, E)


def _after_depthwise(y, w):
    """BatchNorm (running statistics) -> Swish -> pointwise conv: (B, E, C) -> (B, C, E)."""
    y = F.batch_norm(y, w["batch_norm.running_mean"], w["batch_norm.running_var"], w["batch_norm.weight"],
                     w["batch_norm.bias"], training=False, eps=1e-5)  # (B, E, C)
    return F.conv1d(F.silu(y), w["pointwise2.weight"], w["pointwise2.bias"]).transpose(1, 2)  # (B, C, E)


def _stream_step(chunk, cache, w, *, use_cache=True, centred=False, flip=False, new_cache="last"):
    """One streaming step, with one classic mistake switched on."""
    K = w["depthwise.weight"].shape[-1]
    glu = _glu_frames(chunk, w)  # (B, C, E)
    kernel = w["depthwise.weight"].flip(-1) if flip else w["depthwise.weight"]  # (E, 1, K)
    E = chunk.shape[-1]
    if centred:  # a "same" (centred) convolution inside the chunk: reads frames that have not arrived
        centred_pad = F.pad(glu.transpose(1, 2), ((K - 1) // 2, K // 2))  # (B, E, K-1+C): as padding="same"
        y = F.conv1d(centred_pad, kernel, w["depthwise.bias"], groups=E)
    else:
        before = cache if use_cache else torch.zeros_like(cache)  # (B, K-1, E)
        history = torch.cat((before, glu), dim=1)  # (B, K-1+C, E)
        y = F.conv1d(history.transpose(1, 2), kernel, w["depthwise.bias"], groups=E)  # (B, E, C)
    out = _after_depthwise(y, w)  # (B, C, E)
    history = torch.cat((cache, glu), dim=1)  # (B, K-1+C, E)
    if new_cache == "last":
        kept = history[:, history.shape[1] - (K - 1) :]  # (B, K-1, E)
    elif new_cache == "first":
        kept = history[:, : K - 1]
    elif new_cache == "zeros":  # the last K-1 of [zeros, this chunk]: right unless a chunk is shorter than K-1
        kept = torch.cat((torch.zeros_like(cache), glu), dim=1)[:, history.shape[1] - (K - 1) :]
    elif new_cache == "chunk":
        kept = glu[:, max(glu.shape[1] - (K - 1), 0) :]  # only what this chunk brought
    elif new_cache == "negative_slice":  # history[:, -(K-1):] is the whole history when K - 1 = 0
        kept = history[:, -(K - 1):]
    elif new_cache == "raw":
        kept = torch.cat((cache, chunk), dim=1)[:, history.shape[1] - (K - 1) :]  # frames before the LayerNorm
    else:  # "all": the whole history
        kept = history
    return out, kept


def _stream_reference(chunk, cache, weights):
    return _stream_step(chunk, cache, weights)


_STREAMS = [  # (seed, B, T, E, K, chunk boundaries)
    (2020, 2, 12, 6, 4, [0, 3, 8, 9]),  # the first chunk, a long middle chunk, one frame
    (2021, 3, 10, 4, 5, [0, 5, 7]),  # a chunk shorter than the cache
    (2022, 2, 14, 8, 3, [0, 4, 10]),
    (2023, 2, 7, 4, 1, [0, 3, 7]),  # kernel 1: the cache is empty, (B, 0, E)
]


def _stream_cases() -> list[Case]:
    cases = []
    for seed, B, T, E, K, bounds in _STREAMS:
        randn = seeded_randn(seed)
        weights = _random_weights(randn, E, K, causal=True)
        x = randn(B, T, E)
        glu = torch.cat((torch.zeros(B, K - 1, E, dtype=x.dtype), _glu_frames(x, weights)), dim=1)  # (B, K-1+T, E)
        for start, end in zip(bounds[:-1], bounds[1:]):
            cache = glu[:, start : start + K - 1].clone()  # (B, K-1, E): frames start-K+1 .. start-1, zeros before 0
            where = "the first chunk (zero cache)" if start == 0 else f"frames {start}-{end - 1}"
            cases.append(Case(f"stream (B={B}, E={E}, kernel {K}), {where}, {end - start} frame(s)",
                              (x[:, start:end].clone(), cache, weights)))
    return cases


def _stream_expected(chunk, cache, weights):
    """What the library's causal module gives for these frames, given the frames before them."""
    K = weights["depthwise.weight"].shape[-1]
    # Rebuild a stream whose depthwise inputs before the chunk are `cache`: run the library's causal
    # module's depthwise part on [cache, glu(chunk)], and the library's module for everything frame-wise.
    E = chunk.shape[-1]
    module = ConvolutionModule(E, kernel_size=K, dropout=0.0, causal=True, dtype=chunk.dtype)
    module.load_state_dict({**weights, "batch_norm.num_batches_tracked": torch.tensor(0)})
    module.eval()
    with torch.no_grad():
        glu = F.glu(module.pointwise1(module.norm(chunk).transpose(1, 2)), dim=1)  # (B, E, C)
        history = torch.cat((cache.transpose(1, 2), glu), dim=-1)  # (B, E, K-1+C)
        y = F.conv1d(history, module.depthwise.weight, module.depthwise.bias, groups=E)  # (B, E, C): causal
        out = module.pointwise2(F.silu(module.batch_norm(y))).transpose(1, 2)  # (B, C, E)
    return out, history[..., history.shape[-1] - (K - 1) :].transpose(1, 2)


def _diagnose_stream(got_out, chunk, cache, w) -> str:
    return first_match(
        got_out,
        [
            (lambda: _stream_step(chunk, cache, w, centred=True)[0],
             "your depthwise convolution is centred: frame t reads frames after t, which have not arrived yet. "
             "A causal convolution reads frames t - K + 1 .. t: put the K - 1 cached frames in front of the chunk "
             "and pad nothing."),
            (lambda: _stream_step(chunk, cache, w, use_cache=False)[0],
             "the first frames of the chunk ignore the cache: they must read the K - 1 frames before the chunk, "
             "which `cache` holds (zeros only at the start of a stream)."),
            (lambda: _stream_step(chunk, cache, w, flip=True)[0],
             "you flipped the kernel: F.conv1d is a cross-correlation, tap k of the weight multiplies frame "
             "t - K + 1 + k. Use the weight as it is."),
        ],
        atol=1e-9,
        rtol=1e-7,
    ) or ""


def _cache_hint(got_cache, chunk, cache, w) -> str:
    return first_match(
        got_cache,
        [
            (lambda: _stream_step(chunk, cache, w, new_cache="first")[1],
             "your new cache holds the oldest K - 1 frames; it must hold the newest: the last K - 1 frames of "
             "[cache, this chunk's frames]."),
            (lambda: _stream_step(chunk, cache, w, new_cache="zeros")[1],
             "your new cache forgets the old one: when a chunk is shorter than K - 1, the newest frames of the old "
             "cache must stay in the new one (the last K - 1 of [cache, this chunk's frames], not of [zeros, "
             "this chunk's frames]). Check your step end to end: feed it its own new cache, chunk after chunk."),
            (lambda: _stream_step(chunk, cache, w, new_cache="raw")[1],
             "your new cache holds the chunk's frames as they came in; it must hold them as they enter the "
             "depthwise convolution (after LayerNorm, pointwise conv and GLU), so they are not computed twice."),
        ],
        atol=1e-9,
        rtol=1e-7,
    ) or ""


def _pair(case: Case, outcome) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's ``(out, new_cache)``, or a Fail saying what came back instead."""
    if outcome.error is not None:
        returned(outcome, what=case.name)  # raises with the error (or "not implemented yet")
    got = outcome.returned
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        size = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise Fail(f"{case.name}: return a pair (out, new_cache), got {type(got).__name__}{size}.")
    return returned(outcome, what=f"{case.name}, out", index=0), returned(outcome, what=f"{case.name}, new cache", index=1)


def _answered_streams(cases, outcomes):
    """Every case; a case whose call raised fails the check that reads it (``_pair`` says so)."""
    for case, outcome in zip(cases, outcomes):
        if outcome.error is not None:
            _pair(case, outcome)
    return list(zip(cases, outcomes))


def _judge_stream(cases, outcomes):
    checklist = Checklist()
    with checklist.check("returns (out (B, C, E), new cache (B, K-1, E)) in the input's dtype"):
        for case, outcome in _answered_streams(cases, outcomes):
            chunk, cache, _ = case.args
            out, new_cache = _pair(case, outcome)
            expect_shape(out, chunk.shape, what=f"{case.name}, out", hint="One output frame per input frame.")
            kept, wanted = (new_cache.shape[1] if new_cache.dim() == 3 else None), cache.shape[1]
            if kept is not None and wanted == 0 and kept > 0:
                hint = (f"With kernel size 1 the cache is empty, (B, 0, E), but yours has {kept} frames: "
                        "x[:, -(K - 1):] is x[:, 0:], the whole window, when K - 1 = 0. Slice from the front "
                        "instead: x[:, x.shape[1] - (K - 1):].")
            elif kept is not None and kept > wanted:
                hint = (f"Your cache has {kept} frames: a streaming module keeps only the last K - 1 = {wanted}, "
                        "however long the stream, or its memory grows without end.")
            elif kept is not None and kept < wanted:
                hint = (f"Your cache has {kept} frames, not K - 1 = {wanted}: when a chunk is shorter than K - 1, "
                        "the new cache keeps the newest of the old cached frames too (the last K - 1 of "
                        "[cache, this chunk's frames]).")
            else:
                hint = ""
            expect_shape(new_cache, cache.shape, what=f"{case.name}, new cache", hint=hint)
            expect_dtype(out, chunk.dtype, what=f"{case.name}, out")
            expect_dtype(new_cache, cache.dtype, what=f"{case.name}, new cache")
    wide = [i for i, case in enumerate(cases) if case.args[1].shape[1] > 0]  # kernels 3-5
    single = [i for i, case in enumerate(cases) if case.args[1].shape[1] == 0]  # kernel 1: an empty cache
    for title, parts, indices in (
        ("each chunk's output equals the causal module on the whole stream", (0,), wide),
        ("the new cache holds the last K - 1 frames that entered the depthwise convolution", (1,), wide),
        ("kernel size 1: each frame alone, and an empty (B, 0, E) cache", (0, 1), single),
    ):
        with checklist.check(title):
            for index, part in [(i, p) for i in indices for p in parts]:
                case, outcome = cases[index], outcomes[index]
                chunk, cache, weights = case.args
                what = f"{case.name}, {'out' if part == 0 else 'new cache'}"
                got = _pair(case, outcome)[part]
                expected = _stream_expected(chunk, cache, weights)[part]
                expect_shape(got, expected.shape, what=what)
                hint = (_diagnose_stream if part == 0 else _cache_hint)(got, chunk, cache, weights)
                expect_close(got, expected, what=what, atol=1e-9, rtol=1e-7, hint=hint)
    with checklist.check("leaves chunk, cache and the weights unchanged"):
        for case, outcome in _answered_streams(cases, outcomes):
            _expect_unchanged(case, outcome, what=case.name)
    return checklist.results


def _stream_ignores_cache(chunk, cache, w):
    return _stream_step(chunk, cache, w, use_cache=False)


def _stream_centred(chunk, cache, w):
    return _stream_step(chunk, cache, w, centred=True)


def _stream_flipped_kernel(chunk, cache, w):
    return _stream_step(chunk, cache, w, flip=True)


def _stream_cache_oldest(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="first")


def _stream_cache_from_chunk_only(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="chunk")


def _stream_cache_forgets_old_frames(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="zeros")


def _stream_cache_raw_frames(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="raw")


def _stream_cache_grows(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="all")


def _stream_cache_negative_slice(chunk, cache, w):
    return _stream_step(chunk, cache, w, new_cache="negative_slice")


def _stream_cache_updated_in_place(chunk, cache, w):
    out, kept = _stream_step(chunk, cache, w)
    cache.copy_(kept)  # the caller's cache changes under its feet
    return out, cache


STREAMING_CONV = Task(
    id="10.streaming_conv",
    title="A streaming convolution module: causal, one chunk at a time",
    function_name="conv_module_step",
    make_cases=_stream_cases,
    judge=_judge_stream,
    reference=_stream_reference,
    wrong={
        "cache ignored (zeros before every chunk)": Wrong(_stream_ignores_cache, "ignore the cache"),
        "centred convolution inside the chunk": Wrong(_stream_centred, "have not arrived"),
        "kernel flipped": Wrong(_stream_flipped_kernel, "cross-correlation"),
        "new cache = the oldest K - 1 frames": Wrong(_stream_cache_oldest, "must hold the newest"),
        "new cache from this chunk only": Wrong(_stream_cache_from_chunk_only, "keeps the newest of the old"),
        "new cache = last K - 1 of [zeros, chunk] (old cache forgotten)": Wrong(_stream_cache_forgets_old_frames,
                                                                               "forgets the old one"),
        "cache holds the frames before the LayerNorm": Wrong(_stream_cache_raw_frames, "not computed twice"),
        "cache grows with the stream": Wrong(_stream_cache_grows, "grows without end"),
        "new cache = window[:, -(K - 1):] (the whole window at K = 1)": Wrong(
            _stream_cache_negative_slice, "x[:, -(K - 1):] is x[:, 0:]"),
        "cache updated in place": Wrong(_stream_cache_updated_in_place, "in place", kind="contract"),
    },
    stretch=True,
    forbidden=_CONV_FORBIDDEN,
)
