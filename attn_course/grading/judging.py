"""Small helpers for writing judges: a checklist, and expectations that fail with teaching messages.

A judge reads top to bottom::

    def judge(cases, outcomes):
        checklist = Checklist()
        with checklist.check("shape and dtype"):
            mask = returned_tensor(outcomes[0])
            expect_shape(mask, (4, 4), what="causal_mask(4)")
        ...
        return checklist.results

For tasks that declare probes (``Task.measure``), ``expect_largest_below`` and
``expect_flops_at_most`` turn ``outcome.probe`` into a verdict whose message names the
constraint ("your function built a 512 x 384 tensor: linear attention never forms (L, S)").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .core import Case, CheckResult, Fail, Outcome

__all__ = [
    "Checklist",
    "returned_tensor",
    "expect_shape",
    "expect_dtype",
    "expect_close",
    "expect_finite",
    "expect_inputs_unchanged",
    "expect_largest_below",
    "expect_flops_at_most",
    "expect_widest_below",
    "worst_index",
]

NOT_IMPLEMENTED = "not implemented yet: replace the `raise NotImplementedError` line with your code"


class Checklist:
    """Collects one ``CheckResult`` per ``with checklist.check(name):`` block."""

    def __init__(self) -> None:
        self.results: list[CheckResult] = []

    @contextmanager
    def check(self, name: str, *, points: float = 1.0) -> Iterator[None]:
        try:
            yield
        except Fail as failure:
            self.results.append(CheckResult(name, False, str(failure), points))
        except Exception as exc:  # a learner's odd return value must not crash the grader
            self.results.append(CheckResult(name, False, f"could not check your result ({type(exc).__name__}: {exc})", points))
        else:
            self.results.append(CheckResult(name, True, "", points))


def returned_tensor(outcome: Outcome, *, what: str = "your function", index: int | None = None) -> torch.Tensor:
    """The tensor the learner returned (or element ``index`` of a returned tuple); Fail otherwise."""
    if outcome.not_implemented:
        raise Fail(NOT_IMPLEMENTED)
    if outcome.error is not None:
        raise Fail(f"{what} raised {outcome.error}")
    value = outcome.returned
    if index is not None:
        if not isinstance(value, (tuple, list)) or len(value) <= index:
            raise Fail(f"{what} should return a tuple with at least {index + 1} items, got {type(value).__name__}")
        value = value[index]
    if not isinstance(value, torch.Tensor):
        raise Fail(f"{what} should return a torch.Tensor, got {type(value).__name__}")
    return value


def expect_shape(t: torch.Tensor, shape: Sequence[int], *, what: str, hint: str = "") -> None:
    if tuple(t.shape) != tuple(shape):
        raise Fail(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}." + (f" {hint}" if hint else ""))


def expect_dtype(t: torch.Tensor, dtype: torch.dtype, *, what: str, hint: str = "") -> None:
    if t.dtype != dtype:
        raise Fail(f"{what} has dtype {t.dtype}, expected {dtype}." + (f" {hint}" if hint else ""))


def expect_finite(t: torch.Tensor, *, what: str, hint: str = "") -> None:
    if t.is_floating_point() and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise Fail(f"{what} contains {bad} NaN/inf values." + (f" {hint}" if hint else ""))


def expect_close(
    got: torch.Tensor, expected: torch.Tensor, *, what: str, atol: float = 1e-6, rtol: float = 1e-5, hint="",
    float32_hint: bool = True,
) -> None:
    """Fail saying how far ``got`` is from ``expected`` and how far is allowed.

    The message gives the largest absolute and relative errors, the tolerance
    (``|got - expected| <= atol + rtol * |expected|``), the entry that breaks it by the most with its
    row (the index without its last axis, the same row the values are printed from), and, when a
    float64 answer is off by about float32's rounding, what can cause it: float32 computation when every
    returned value is a float32 number, else a float32 step or an added ``eps`` (``float32_hint=False``
    for a judge that tells the causes apart itself).
    """
    expect_shape(got, expected.shape, what=what)
    got64, exp64 = got.detach().to(torch.float64), expected.detach().to(torch.float64)
    if torch.allclose(got64, exp64, atol=atol, rtol=rtol, equal_nan=False):
        return
    if callable(hint):  # a diagnosis tries several variants: compute it only for a wrong answer
        hint = hint() or ""
    error = _errors(got64, exp64)
    worst = worst_index(got64, exp64, atol=atol, rtol=rtol)
    relative = error / exp64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    finite = torch.isfinite(error)
    max_abs = float(error[finite].max()) if finite.any() else float("inf")
    max_rel = float(relative[finite].max()) if finite.any() else float("inf")
    where = f"at index {worst}" if worst else "the value"
    if len(worst) >= 2:
        row = worst[:-1]
        where += f" (row {row}: yours {_row_text(got64[row])}, expected {_row_text(exp64[row])})"
    unmatched = int((~finite).sum())  # NaN or inf where the expected value is finite (or the other way round)
    if unmatched and not finite.any():
        size = "Every entry is non-finite where a finite value is expected, or the other way round"
    elif unmatched:
        size = (f"{unmatched:,} entries are NaN or infinite where the expected value is finite (or the other way "
                f"round); among the rest the largest error is {max_abs:.3g} absolute, {max_rel:.3g} relative")
    else:
        size = f"Largest error {max_abs:.3g} absolute, {max_rel:.3g} relative"
    message = (
        f"{what} is wrong: {where} you return {got64[worst].item():.10g}, expected {exp64[worst].item():.10g}. "
        f"{size}; allowed: |yours - expected| <= {atol:g} + {rtol:g} * |expected|."
    )
    float64 = expected.dtype == torch.float64 and got.dtype == torch.float64
    if float32_hint and float64 and finite.all() and 0 < max_rel < 1e-4:
        scale = exp64.abs().max().clamp_min(1e-300)
        if float(error.max() / scale) < 2e-6:  # a few float32 ulps of the largest value, not a wrong formula
            if torch.equal(got64, got64.to(torch.float32).to(torch.float64)):  # every value a float32 number
                message += (" An error this size is float32 rounding (about 1e-7 relative): every value you return is "
                            "a float32 number, but the inputs are float64, so keep every step in float64 (no "
                            ".float(), no torch.tensor(..., dtype=torch.float32), no float32 constants from "
                            "torch.zeros without dtype=).")
            else:  # as small as float32 rounding, but not float32 numbers: a float32 step, or an eps
                message += (" An error this small (about float32's rounding, 1e-7 relative) comes from a small "
                            "difference in the computation, such as a step done in float32 or a small constant (an "
                            "eps) added or left out: the inputs are float64, so keep every step in float64 and use "
                            "exactly the constants the task gives.")
    raise Fail(message + (f" {hint}" if hint else ""))


def _errors(got64: torch.Tensor, exp64: torch.Tensor) -> torch.Tensor:
    """``|got - expected|``, 0 where both are NaN, inf where only one is."""
    error = (got64 - exp64).abs()
    same_nan = torch.isnan(got64) & torch.isnan(exp64)
    return torch.where(same_nan, torch.zeros_like(error), error.nan_to_num(nan=float("inf"), posinf=float("inf")))


def worst_index(got: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float) -> tuple[int, ...]:
    """The index of the entry that breaks ``|got - expected| <= atol + rtol * |expected|`` by the most.

    ``expect_close`` names this entry; a judge that adds a hint about the entry's row uses it too,
    so the index and the row in one message always agree.
    """
    got64, exp64 = got.detach().to(torch.float64), expected.detach().to(torch.float64)
    excess = _errors(got64, exp64) - (atol + rtol * exp64.abs().nan_to_num(nan=0.0, posinf=0.0))
    return tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape)) if excess.dim() else ()


def _row_text(row: torch.Tensor, limit: int = 6) -> str:
    """A short text of one row's values (the first ``limit`` of them)."""
    values = [f"{v:.8g}" for v in row.flatten()[:limit].tolist()]
    return "[" + ", ".join(values) + (", ..." if row.numel() > limit else "") + "]"


def expect_inputs_unchanged(case: Case, outcome: Outcome, *, what: str = "your function") -> None:
    """Fail if the function modified a tensor argument in place."""
    for index, (before, after) in enumerate(zip(case.args, outcome.args_after)):
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
            if before.shape != after.shape or not torch.equal(before, after):
                raise Fail(
                    f"{what} changed its input argument {index} in place (e.g. with `-=`, `.sub_()` or "
                    "`masked_fill_`). Work on a new tensor instead: callers do not expect their data to change."
                )


def _measured(outcome: Outcome, key: str, what: str) -> int:
    value = outcome.probe.get(key) if isinstance(outcome.probe, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        reason = outcome.probe.get("probe_error") if isinstance(outcome.probe, dict) else None
        raise Fail(
            f"{what}: the grader could not measure your function's {key.replace('_', ' ')}"
            + (f" ({reason})" if isinstance(reason, str) else "")
            + ". Run it again without changing the profiler or dispatch modes."
        )
    return int(value)


def expect_largest_below(outcome: Outcome, limit: int, *, what: str, constraint: str) -> None:
    """Fail when the call created a tensor of ``limit`` elements or more (needs ``measure=("largest",)``).

    ``constraint`` says what the algorithm never builds and why, e.g. "linear attention never
    forms the (L, S) = (512, 384) matrix; keep every intermediate below L * S elements".
    Views and in-place results do not count (see ``probes``).
    """
    numel = _measured(outcome, "largest_numel", what)
    if numel >= limit:
        shape = outcome.probe.get("largest_shape") or "?"
        op = outcome.probe.get("largest_op") or "?"
        raise Fail(
            f"{what}: your function built a {shape} tensor ({numel:,} elements, made by {op}, limit {limit:,}): "
            f"{constraint}"
        )


def expect_flops_at_most(outcome: Outcome, limit: float, *, what: str, intended: float, hint: str) -> None:
    """Fail when the call did more than ``limit`` operations (needs ``measure=("flops",)``).

    ``intended`` is the intended algorithm's count on this case (a formula in the task), so the
    message can say how far off the learner is; ``limit`` is usually a small factor times it.
    """
    flops = _measured(outcome, "flops", what)
    if flops > limit:
        raise Fail(
            f"{what}: your function did about {flops:,} operations; the intended algorithm needs about "
            f"{int(intended):,} (this check allows {limit / max(intended, 1):.3g} times that). {hint}"
        )


def expect_widest_below(outcome: Outcome, limit: int, *, what: str, constraint: str) -> None:
    """Fail when one op combined ``limit`` or more entries at once (needs ``measure=("widest",)``).

    Per computation, not per batch: a softmax over one (batch, head) slice's S keys is as wide as
    the batched one. ``constraint`` says what the algorithm never reduces over, and why.
    """
    width = _measured(outcome, "widest_reduction", what)
    if width >= limit:
        shape = outcome.probe.get("widest_shape") or "?"
        op = outcome.probe.get("widest_op") or "?"
        raise Fail(
            f"{what}: your function combined {width} entries at once ({op} over the last axis or axes of a {shape} "
            f"tensor; the limit is below {limit}): {constraint}"
        )
