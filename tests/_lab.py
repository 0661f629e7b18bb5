"""Start JupyterLab the way the README does (`make lab`), on 127.0.0.1 with a token, for tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LabServer:
    port: int
    token: str

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url(path), timeout=5) as response:
            return json.load(response)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_jupyter_env(tmp: Path) -> dict[str, str]:
    """Environment that keeps Jupyter, IPython, matplotlib and anything else out of the home directory.

    HOME itself points into ``tmp``, so even a tool that ignores the variables below writes there.

    JupyterLab's user settings turn autosave off (a browser test runs lessons and must never
    write their outputs back into the repository) and skip the news pop-up.
    """
    settings = tmp / "lab-settings"
    for plugin, values in (
        ("@jupyterlab/docmanager-extension/plugin", {"autosave": False}),
        ("@jupyterlab/apputils-extension/notification", {"fetchNews": "false"}),
        # Render every cell: windowing leaves off-screen cells (and their widgets) out of the DOM.
        ("@jupyterlab/notebook-extension/tracker", {"windowingMode": "none"}),
    ):
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ)
    (tmp / "home").mkdir(exist_ok=True)
    env.update(
        HOME=str(tmp / "home"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        IPYTHONDIR=str(tmp / "ipython"),
        MPLCONFIGDIR=str(tmp / "matplotlib"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    return env


@contextmanager
def running_lab(tmp: Path, *, timeout: float = 90.0) -> Iterator[LabServer]:
    """Run `make lab` with a fixed port and token; yield once the server answers; stop it after."""
    server = LabServer(port=free_port(), token="attn-course-test")
    args = f"--no-browser --ip=127.0.0.1 --port={server.port} --IdentityProvider.token={server.token}"
    log = open(tmp / "lab.log", "wb")
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT, env=private_jupyter_env(tmp), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"make lab exited early:\n{(tmp / 'lab.log').read_text()}")
            try:
                server.get_json("api/status")
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer on 127.0.0.1 within {timeout:g} s") from None
                time.sleep(0.5)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
