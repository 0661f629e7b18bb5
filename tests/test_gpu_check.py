"""`make gpu-check` without a GPU: it starts, skips every GPU step with a message, rehearses the rest within budget.

The GPU run itself happens on a lent GPU machine (tests/gpu_check.py says how); here we check the
no-CUDA path, the report, and the cell runner that stands in for nbconvert on a bare machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu_check.py"
GPU_STEPS = ("pytest --device cuda", "lesson 04 on cuda", "lesson 12 on cuda", "bench mha", "bench attention", "bench peers")


def _env(**extra: str) -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_without_cuda_every_gpu_step_is_skipped_and_the_rest_fits_the_budget(tmp_path):
    report = tmp_path / "report.md"
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--report", str(report)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    assert "no CUDA device here" in done.stdout and "GPU steps are skipped" in done.stdout
    figures = json.loads(report.with_suffix(".json").read_text())
    steps = {s["step"]: s for s in figures["steps"]}
    assert figures["cuda"] is False and list(steps) == ["environment", "collect CUDA test ids", *GPU_STEPS]
    assert steps["environment"]["status"] == "passed" and "cuda available False" in steps["environment"]["output_tail"]
    assert steps["collect CUDA test ids"]["status"] == "passed"
    assert int(steps["collect CUDA test ids"]["detail"].split()[0]) > 10  # the CUDA cases of the suite
    for name in ("pytest --device cuda", "bench mha", "bench attention", "bench peers"):
        assert steps[name]["status"] == "skipped" and "no CUDA" in steps[name]["detail"], name
    for name in ("lesson 04 on cuda", "lesson 12 on cuda"):  # rehearsed: cells compile, setup runs on the CPU
        assert steps[name]["status"] in ("skipped", "failed"), name
        if steps[name]["status"] == "failed":  # a lesson whose setup breaks (an import) is caught here, on a CPU
            assert "its setup fails at code cell" in steps[name]["output_tail"], name
        else:
            assert "code cells compile; its setup" in steps[name]["output_tail"], name
    failed = [s for s in figures["steps"] if s["status"] in ("failed", "timed out")]
    assert done.returncode == (1 if failed else 0), done.stdout + done.stderr
    assert figures["total_s"] <= figures["budget_s"] and took < figures["budget_s"]
    text = report.read_text()
    assert "| step | status | seconds | limit | detail |" in text and "CUDA: no -- every GPU step skipped" in text


def _notebook(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    path.write_text(json.dumps({
        "cells": [{"cell_type": "code", "source": source, "metadata": {"tags": tags}, "outputs": [],
                   "execution_count": None} for source, tags in cells],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }))
    return path


def test_the_cell_runner_runs_cells_in_one_namespace_and_honours_the_tags(tmp_path):
    notebook = _notebook(tmp_path / "nb.ipynb", [
        ("%matplotlib inline\nx = 2", []),
        ("raise ValueError('meant to')", ["raises-exception"]),
        ("raise SystemError('never run')", ["skip-execution"]),
        ("print('x is', x * 21)", []),
    ])
    done = subprocess.run([sys.executable, str(SCRIPT), "run-notebook", str(notebook)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x is 42" in done.stdout and "(raised, as its tag says)" in done.stdout and "every cell ran" in done.stdout


def test_the_cell_runner_stops_at_the_first_error(tmp_path):
    notebook = _notebook(tmp_path / "nb.ipynb", [("y = 1", []), ("1 / 0", []), ("print('after')", [])])
    done = subprocess.run([sys.executable, str(SCRIPT), "run-notebook", str(notebook)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ZeroDivisionError" in done.stdout and "FAILED at code cell 1" in done.stdout
    assert "after" not in done.stdout.replace("FAILED", "")


def test_makefile_gpu_check_uses_the_plain_interpreter_and_never_builds_the_venv():
    makefile = (ROOT / "Makefile").read_text()
    rule = makefile.split("\ngpu-check:", 1)[1].split("\n\n", 1)[0]
    assert "tests/gpu_check.py" in rule and "$(PYTHON)" in rule and "$(STAMP)" not in makefile.split("\ngpu-check:", 1)[1].split("\n", 1)[0]
