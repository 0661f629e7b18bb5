"""The attn-course command and the README's start command, run for real."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_start_command_serves_the_course_on_loopback(tmp_path):
    """`make lab` (the README's start command) brings up JupyterLab serving the notebooks."""
    if not (ROOT / ".venv" / ".installed").exists():
        if os.environ.get("CI"):
            pytest.fail("CI runs `make test`, which must have created .venv/.installed")
        pytest.skip("the README's set-up has not run here (.venv missing); `make test` creates it")
    port, token = _free_port(), "attn-course-test"
    env = dict(os.environ)
    env.update(
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/contents/notebooks?token={token}"
        deadline, listing = time.time() + 60, None
        while time.time() < deadline and listing is None:
            if proc.poll() is not None:
                pytest.fail(f"make lab exited early:\n{proc.stdout.read().decode()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    listing = json.load(response)
            except OSError:
                time.sleep(0.5)
        assert listing is not None, "JupyterLab did not answer on 127.0.0.1 within 60 s"
        names = {item["name"] for item in listing["content"]}
        assert "00_welcome.ipynb" in names, names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5) as response:
            assert response.status == 200 and b"JupyterLab" in response.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
