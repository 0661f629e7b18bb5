"""Small helpers for writing judges: a checklist, and expectations that fail with teaching messages.

A judge reads top to bottom::

    def judge(cases, outcomes):
        checklist = Checklist()
        with checklist.check("shape and dtype"):
            mask = returned_tensor(outcomes[0])
            expect_shape(mask, (4, 4), what="causal_mask(4)")
        ...
        return checklist.results
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
    got: torch.Tensor, expected: torch.Tensor, *, what: str, atol: float = 1e-6, rtol: float = 1e-5, hint: str = ""
) -> None:
    """Fail naming the worst entry when ``got`` differs from ``expected``."""
    expect_shape(got, expected.shape, what=what)
    got64, exp64 = got.detach().to(torch.float64), expected.detach().to(torch.float64)
    if torch.allclose(got64, exp64, atol=atol, rtol=rtol, equal_nan=False):
        return
    diff = (got64 - exp64).abs().nan_to_num(nan=float("inf"))
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    raise Fail(
        f"{what} is wrong: at index {worst} you return {got64[worst].item():.6g}, expected "
        f"{exp64[worst].item():.6g}." + (f" {hint}" if hint else "")
    )


def expect_inputs_unchanged(case: Case, outcome: Outcome, *, what: str = "your function") -> None:
    """Fail if the function modified a tensor argument in place."""
    for index, (before, after) in enumerate(zip(case.args, outcome.args_after)):
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
            if before.shape != after.shape or not torch.equal(before, after):
                raise Fail(
                    f"{what} changed its input argument {index} in place (e.g. with `-=`, `.sub_()` or "
                    "`masked_fill_`). Work on a new tensor instead: callers do not expect their data to change."
                )
