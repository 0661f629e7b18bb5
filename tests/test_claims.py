"""``claim`` prints what holds and fails, with the figures, on what does not."""

from __future__ import annotations

import pytest
import torch

from attn_course.claims import ClaimError, claim, shows_error


def test_a_claim_that_holds_is_printed(capsys):
    claim("chunked keeps less than 1/8 of dense's memory", 10 < 100 / 8)
    assert capsys.readouterr().out == "✓ chunked keeps less than 1/8 of dense's memory\n"


def test_a_claim_that_fails_names_itself_and_the_measurement(capsys):
    with pytest.raises(ClaimError, match=r"claims: 'A is faster than B'.*measured: A 3 ms, B 2 ms"):
        claim("A is faster than B", 3 < 2, measured="A 3 ms, B 2 ms")
    assert capsys.readouterr().out == "", "a failed claim prints nothing before failing"
    assert issubclass(ClaimError, AssertionError), "a failing claim stops the notebook like an assert"


def test_a_claim_takes_a_one_element_tensor_and_refuses_an_empty_statement():
    claim("the weights sum to one", torch.tensor(True))
    with pytest.raises(ClaimError):
        claim("the weights sum to one", torch.tensor(False))
    with pytest.raises(TypeError, match="non-empty str"):
        claim("  ", True)


def test_shows_error_prints_the_expected_error_and_carries_on(capsys):
    with shows_error(ValueError, TypeError):
        raise ValueError("mask of shape (3,) does not broadcast\nsecond line")
    assert capsys.readouterr().out == "ValueError: mask of shape (3,) does not broadcast\n"


def test_shows_error_fails_when_nothing_or_something_else_is_raised():
    with pytest.raises(ClaimError, match="raises RuntimeError, but it ran without an error"):
        with shows_error(RuntimeError):
            pass
    with pytest.raises(KeyError):
        with shows_error(ValueError):
            raise KeyError("other")
    with pytest.raises(TypeError, match="needs the exception types"):
        with shows_error():
            pass
