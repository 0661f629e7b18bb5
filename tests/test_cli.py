"""The attn-course command and the README's start command, run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

    assert main(["runtimes", str(timed)]) == 0
    runtimes = course.load_runtimes(root / "notebooks" / "runtimes.json")
    assert list(runtimes.seconds) == ["notebooks/01_scaled_dot_product_attention.ipynb"]
    assert 0 < runtimes.seconds["notebooks/01_scaled_dot_product_attention.ipynb"] < 60
    cells = nbformat.read(root / "notebooks" / "00_welcome.ipynb", as_version=4).cells
    assert course.course_map_markdown(runtimes) in [c.source for c in cells]
