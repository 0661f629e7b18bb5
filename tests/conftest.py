"""Shared fixtures. Tests that take ``device`` run on CPU, and on CUDA / MPS where present.

``pytest --device cuda`` runs only the CUDA cases (and fails if CUDA is missing).
"""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        action="append",
        default=None,
        help="run device tests only on this device (cpu, cuda, mps); repeatable. Default: every available one.",
    )


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return mps is not None and mps.is_available()
    return True


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption("--device")
    kinds = chosen or ["cpu", "cuda", "mps"]
    params = []
    for kind in kinds:
        marks = []
        if not _available(kind):
            if chosen:
                raise pytest.UsageError(f"--device {kind} was asked for but is not available")
            marks.append(pytest.mark.skip(reason=f"{kind} not available on this machine"))
        params.append(pytest.param(torch.device(kind), id=kind, marks=marks))
    metafunc.parametrize("device", params)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: inputs are made on CPU then moved, so every device sees the same numbers."""
    return torch.Generator().manual_seed(1234)


def pytest_report_header(config: pytest.Config) -> str:
    """Say which CPU kernels PyTorch uses: `make test` checks stored outputs with other kernels than `make regenerate`."""
    import os

    chosen = os.environ.get("ATEN_CPU_CAPABILITY", "this CPU's best")
    return f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY: {chosen})"
