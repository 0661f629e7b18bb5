"""The attn-course command and the README's start command, run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from _lab import running_lab

ROOT = Path(__file__).resolve().parents[1]


def test_bench_mha_prints_measured_ratio(tmp_path):
    out_json = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "attn_course.cli", "bench", "mha", "--batch", "2", "--length", "32",
         "--d-model", "32", "--heads", "4", "--json", str(out_json)],
        capture_output=True, text=True, check=True, timeout=300,
    )
    assert "GFLOP/s" in result.stdout and "ratio ours/torch" in result.stdout
    figures = json.loads(out_json.read_text())
    assert figures["matmul_gflops"] > 0
    assert figures["mha"]["ours_ms"] > 0 and figures["mha"]["torch_ms"] > 0
    assert abs(figures["mha"]["ratio"] - figures["mha"]["ours_ms"] / figures["mha"]["torch_ms"]) < 1e-9


@pytest.mark.slow
def test_start_command_serves_the_course_on_loopback(tmp_path):
    """`make lab` (the README's start command) brings up JupyterLab serving the notebooks."""
    if not (ROOT / ".venv" / ".installed").exists():
        if os.environ.get("CI"):
            pytest.fail("CI runs `make test`, which must have created .venv/.installed")
        pytest.skip("the README's set-up has not run here (.venv missing); `make test` creates it")
    with running_lab(tmp_path) as lab:
        names = {item["name"] for item in lab.get_json("api/contents/notebooks")["content"]}
        assert "00_welcome.ipynb" in names, names
        with urllib.request.urlopen(lab.url("lab"), timeout=5) as response:
            assert response.status == 200 and b"JupyterLab" in response.read()


def test_runtimes_command_times_a_notebook_and_rewrites_the_course_map(tmp_path, monkeypatch):
    import shutil

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    import attn_course.course as course
    from attn_course.cli import main

    root = tmp_path / "checkout"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(course.project_root() / "notebooks" / "00_welcome.ipynb", root / "notebooks")
    timed = root / "notebooks" / "01_scaled_dot_product_attention.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("print(6 * 7)")]), timed)
    monkeypatch.setattr(course, "project_root", lambda: root)

    start = time.perf_counter()
    assert main(["runtimes", str(timed)]) == 0
    wall = time.perf_counter() - start
    runtimes = course.load_runtimes(root / "notebooks" / "runtimes.json")
    assert list(runtimes.seconds) == ["notebooks/01_scaled_dot_product_attention.ipynb"]
    # The recorded time is that of the run inside the command: positive and within the command's own
    # wall time (rounded to 0.1 s), on any machine under any load.
    assert 0 < runtimes.seconds["notebooks/01_scaled_dot_product_attention.ipynb"] <= wall + 0.05
    cells = nbformat.read(root / "notebooks" / "00_welcome.ipynb", as_version=4).cells
    assert course.course_map_markdown(runtimes) in [c.source for c in cells]


# ---------------------------------------------------------------- arguments: own options, one-line errors


def _usage_error(capsys, argv: list[str]) -> str:
    """Run the command in-process; it must exit 2 with exactly one line on stderr. Returns that line."""
    from attn_course.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, (argv, captured)
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "mha", "--lengths", "64"], r"^attn-course bench mha: error: unrecognized arguments: --lengths 64"),
        (["bench", "attention", "--d-model", "32"], r"^attn-course bench attention: error: unrecognized arguments"),
        (["bench", "attention", "--lengths", "64", "0"], r"argument --lengths: expected a positive integer, got 0"),
        (["bench", "attention", "--heads", "two"], r"argument --heads: expected a positive integer, got 'two'"),
        (["bench", "mha", "--heads", "3", "--d-model", "32"], r"^attn-course bench mha: error: --heads 3 must divide --d-model 32"),
        (["bench", "all"], r"^attn-course bench: error: argument TARGET: invalid choice: 'all'"),
        (["bench", "mha", "--device", "nowhere"], r"^attn-course bench mha: error: --device nowhere"),
        (["info", "--device", "quantum"], r"^attn-course info: error: --device quantum"),
        (["regenerate", "no/such/notebook.ipynb"], r"^attn-course regenerate: error: no such notebook"),
        (["grade"], r"^attn-course grade: error: the following arguments are required: submissions"),
        (["frobnicate"], r"^attn-course: error: argument COMMAND: invalid choice: 'frobnicate'"),
    ],
    ids=["mha-foreign-flag", "attention-foreign-flag", "zero-length", "not-a-number", "heads-do-not-divide",
         "no-bench-all", "bad-device", "info-bad-device", "missing-notebook", "grade-nothing", "unknown-command"],
)
def test_argument_errors_exit_2_with_one_line(capsys, argv, expected):
    import re

    assert re.search(expected, _usage_error(capsys, argv))


def test_each_bench_target_has_its_own_options():
    from attn_course.cli import build_parser

    parser = build_parser()
    mha = parser.parse_args(["bench", "mha", "--heads", "4", "--d-model", "64"])
    attention = parser.parse_args(["bench", "attention", "--heads", "2", "--lengths", "64", "128"])
    assert (mha.heads, mha.d_model, mha.target) == (4, 64, "mha") and not hasattr(mha, "lengths")
    assert (attention.heads, attention.lengths) == (2, [64, 128]) and not hasattr(attention, "d_model")


def test_only_grade_imports_the_grader():
    code = (
        "import sys\n"
        "from attn_course.cli import main\n"
        "assert main(['info', '--device', 'cpu']) == 0\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('grader loaded' if 'attn_course.grading' in sys.modules else 'grader not loaded')\n"
        "try:\n    main(['grade', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('grader loaded' if 'attn_course.grading' in sys.modules else 'grader not loaded')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("grader")]
    assert lines == ["grader not loaded", "grader loaded"], result.stdout
    assert "--cell-timeout" in result.stdout  # `grade --help` shows the grader's own options


def test_console_script_error_has_no_traceback():
    """The installed entry point, as a user runs it: status 2, one line, no traceback."""
    script = Path(sys.executable).with_name("attn-course")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "attn_course.cli"]
    result = subprocess.run([*command, "bench", "attention", "--rounds", "-1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "attn-course bench attention: error: argument --rounds: expected a positive integer, got -1 "
        "(see attn-course bench attention --help)"
    ]

