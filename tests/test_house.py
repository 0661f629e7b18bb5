"""How the package is put together: measuring tools apart from the benchmark, no private cross-imports,
every module naming its lesson, and the measuring tools themselves."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_course as ac
from attn_course import measure

PACKAGE = Path(ac.__file__).resolve().parent
# The package's own tooling and plumbing: no lesson teaches them.
TOOLING = {"__init__.py", "_checks.py", "claims.py", "cli.py", "course.py", "notebooks.py"}  # claims: every lesson
LIBRARY = sorted(p for p in [*PACKAGE.glob("*.py"), *PACKAGE.glob("data/*.py"), *PACKAGE.glob("distributed/*.py")]
                 if p.name not in TOOLING)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_docstring_names_the_lesson_that_teaches_it(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert re.search(r"\blessons? \d\d\b", docstring), f"{path.name}: say which lesson teaches it"


def test_no_module_imports_another_modules_private_names():
    """kv_cache used to import grouped's private validator; shared helpers belong in _checks (or are public)."""
    offenders = []
    for path in [*PACKAGE.glob("*.py"), *PACKAGE.glob("data/*.py"), *PACKAGE.glob("distributed/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and not (node.module or "").endswith("_checks"):
                offenders += [f"{path.name}: {alias.name} from {node.module}" for alias in node.names if alias.name.startswith("_")]
    assert sorted(set(offenders)) == []


def test_library_modules_do_not_load_the_benchmark_or_the_grader():
    """Measuring tools live in attn_course.measure, so the KV cache no longer pulls in the benchmark harness."""
    code = (
        "import sys, attn_course, attn_course.kv_cache, attn_course.diagnostics, attn_course.models\n"
        "print(sorted(m for m in sys.modules if m.startswith(('attn_course.bench', 'attn_course.grading', "
        "'attn_course.cli'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_moved_names_are_still_importable_from_their_old_homes():
    from attn_course import bench, grouped, kv_cache, models, vit
    from attn_course.diagnostics import token_influence

    assert bench.time_call is measure.time_call and bench.synchronize is measure.synchronize
    assert bench.largest_tensor_bytes is measure.largest_tensor_bytes
    assert bench.saved_tensor_bytes is measure.saved_tensor_bytes
    assert grouped.kv_cache_bytes is kv_cache.kv_cache_bytes is ac.kv_cache_bytes
    assert grouped.compare_kv_cache_memory is kv_cache.compare_kv_cache_memory
    assert models.token_influence is vit.token_influence is token_influence is ac.token_influence
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        grouped.nothing  # noqa: B018


# ---------------------------------------------------------------- the measuring tools


def test_time_call_runs_warmup_plus_repeats_and_returns_a_median():
    calls = []
    seconds = measure.time_call(lambda: calls.append(1), device=torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and 0 <= seconds < 1.0  # an append takes microseconds; 1 s holds under any load


def test_largest_and_saved_tensor_bytes_count_storages():
    x = torch.randn(64, 64, requires_grad=True)
    assert measure.largest_tensor_bytes(lambda: x @ x.T) == 64 * 64 * 4
    assert measure.largest_tensor_bytes(lambda: x.expand(10, 64, 64)) == x.untyped_storage().nbytes()  # views are free
    # x @ x.T saves x and its transpose, one storage: counted once.
    assert measure.saved_tensor_bytes(lambda: x @ x.T) == 64 * 64 * 4
    with torch.no_grad():
        assert measure.saved_tensor_bytes(lambda: x @ x.T) == 0


def test_peak_memory_bytes_sees_a_fresh_allocation():
    size = 64 * 2**20  # 64 MiB, written so that every page is resident
    measured = measure.peak_memory_bytes(lambda: torch.ones(size // 4))
    assert measured["error"] is None and measured["method"].startswith("peak RSS")
    assert measured["bytes"] >= 0.9 * size, measured
    nothing = measure.peak_memory_bytes(lambda: None)
    assert nothing["bytes"] < size / 8, nothing
    assert measure.peak_memory_bytes(lambda: None, device="meta")["bytes"] is None
