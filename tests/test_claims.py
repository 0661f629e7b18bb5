"""``claim`` prints what holds; what does not hold gets a ✗ mark for a learner and fails when strict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attn_course.claims import STRICT_ENV, ClaimError, claim, shows_error, strict_claims


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)


def test_strictness_follows_the_environment(monkeypatch):
    for value, expected in [("1", True), ("yes", True), ("0", False), ("", False), (" 0 ", False)]:
        monkeypatch.setenv(STRICT_ENV, value)
        assert strict_claims() is expected, value
    monkeypatch.delenv(STRICT_ENV)
    assert strict_claims() is False


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_a_claim_that_holds_is_printed_in_both_modes(request, mode, capsys):
    request.getfixturevalue(mode)
    claim("chunked keeps less than 1/8 of dense's memory", 10 < 100 / 8)
    assert capsys.readouterr().out == "✓ chunked keeps less than 1/8 of dense's memory\n"


def test_strict_a_claim_that_fails_names_itself_and_the_measurement(strict, capsys):
    with pytest.raises(ClaimError, match=r"claims: 'A is faster than B'.*measured: A 3 ms, B 2 ms"):
        claim("A is faster than B", 3 < 2, measured="A 3 ms, B 2 ms")
    assert capsys.readouterr().out == "", "a failed strict claim prints nothing before failing"
    assert issubclass(ClaimError, AssertionError), "a failing strict claim stops the notebook like an assert"


def test_lenient_a_claim_that_fails_prints_a_mark_and_goes_on(lenient, capsys):
    claim("A is faster than B", 3 < 2, measured="A 3 ms, B 2 ms")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✗ A is faster than B — not on this machine: A 3 ms, B 2 ms"
    assert len(out) == 2 and "processor" in out[1] and "goes on" in out[1], out
    claim("A is faster than B", False)
    assert capsys.readouterr().out.splitlines()[0] == "✗ A is faster than B — not on this machine"


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_a_claim_takes_a_one_element_tensor_and_refuses_an_empty_statement(request, mode, capsys):
    request.getfixturevalue(mode)
    claim("the weights sum to one", torch.tensor(True))
    assert capsys.readouterr().out.startswith("✓")
    if mode == "strict":
        with pytest.raises(ClaimError):
            claim("the weights sum to one", torch.tensor(False))
    else:
        claim("the weights sum to one", torch.tensor(False))
        assert capsys.readouterr().out.startswith("✗ the weights sum to one")
    with pytest.raises(TypeError, match="non-empty str"):
        claim("  ", True)


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_shows_error_prints_the_expected_error_and_carries_on(request, mode, capsys):
    request.getfixturevalue(mode)
    with shows_error(ValueError, TypeError):
        raise ValueError("mask of shape (3,) does not broadcast\nsecond line")
    assert capsys.readouterr().out == "ValueError: mask of shape (3,) does not broadcast\n"


def test_strict_shows_error_fails_when_nothing_or_something_else_is_raised(strict):
    with pytest.raises(ClaimError, match="raises RuntimeError, but it ran without an error"):
        with shows_error(RuntimeError):
            pass
    with pytest.raises(KeyError):
        with shows_error(ValueError):
            raise KeyError("other")
    with pytest.raises(TypeError, match="needs the exception types"):
        with shows_error():
            pass


def test_lenient_shows_error_marks_a_line_that_stopped_raising_and_goes_on(lenient, capsys):
    with shows_error(RuntimeError):
        pass
    assert capsys.readouterr().out.splitlines()[0] == (
        "✗ this line raises RuntimeError — not on this machine: it ran without an error"
    )
    with shows_error(ValueError, TypeError):
        raise KeyError("other")
    assert capsys.readouterr().out.splitlines()[0] == (
        "✗ this line raises ValueError or TypeError — not on this machine: it raised KeyError: 'other'"
    )
    with pytest.raises(KeyboardInterrupt):  # only errors are marked: an interrupt still stops the cell
        with shows_error(ValueError):
            raise KeyboardInterrupt
    with pytest.raises(TypeError, match="needs the exception types"):  # a lesson's own bug is not hidden
        with shows_error():
            pass


def _notebook(path, cells):
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                   "source": textwrap.dedent(src)} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


@pytest.mark.slow
def test_run_all_goes_past_a_failing_claim_but_regeneration_stops_on_it(tmp_path):
    """The learner's "Run all" (a kernel without the switch) reaches the last cell; ``regenerate``
    (which sets the switch for its kernel) fails on the same notebook."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    import nbformat

    from attn_course.notebooks import regenerate

    path = tmp_path / "lesson.ipynb"
    _notebook(path, [
        "import attn_course as ac\nac.claim('1 is more than 2', 1 > 2, measured='1 vs 2')",
        "with ac.shows_error(ValueError):\n    pass",
        "print('last cell ran')",
    ])
    env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}
    saved = os.environ.pop(STRICT_ENV, None)
    try:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    finally:
        if saved is not None:
            os.environ[STRICT_ENV] = saved
    text = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert text[0].startswith("✗ 1 is more than 2 — not on this machine: 1 vs 2"), text
    assert text[1].startswith("✗ this line raises ValueError"), text
    assert text[2] == "last cell ran\n", text
    with pytest.raises(CellExecutionError, match="ClaimError"):
        regenerate([path])
    # and a plain interpreter with the switch set, as the Makefile and .ci/run set it
    code = "import attn_course as ac; ac.claim('1 is more than 2', 1 > 2)"
    run = subprocess.run([sys.executable, "-c", code], env={**env, STRICT_ENV: "1"}, capture_output=True, text=True)
    assert run.returncode != 0 and "ClaimError" in run.stderr, run
