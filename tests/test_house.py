"""How the package is put together: measuring tools apart from the benchmark and the models, no
compatibility shims, no private cross-imports, every module naming its lesson, and the measuring tools."""

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


# Modules that define models and layers. None of them may import measuring or diagnostic code: what
# times or probes a model lives in attn_course.measure / attn_course.diagnostics, beside the other tools.
MODEL_MODULES = ("attention", "multihead", "grouped", "kv_cache", "vit", "models", "conformer", "dynamic",
                 "positional", "sparse", "linear", "chunked", "masks")
MEASURING_MODULES = ("attn_course.measure", "attn_course.diagnostics", "attn_course.bench", "attn_course.stats",
                     "attn_course.grading", "attn_course.cli", "attn_course.widgets", "attn_course.viz")


@pytest.mark.parametrize("name", MODEL_MODULES)
def test_model_modules_import_no_measuring_or_diagnostic_code(name):
    """Each model module, imported on its own in a fresh interpreter, loads none of the measuring modules.

    The package's __init__ re-exports everything, so the check stubs the package first: only the
    module itself and what it really imports get loaded.
    """
    code = (
        "import importlib.util, sys, types\n"
        f"package = types.ModuleType('attn_course'); package.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['attn_course'] = package\n"
        f"importlib.import_module('attn_course.{name}')\n"
        f"print(sorted(m for m in sys.modules if m.startswith({MEASURING_MODULES!r})))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"attn_course.{name} loads {loaded}"


def test_the_compatibility_shims_are_gone():
    """No moved-name __getattr__, no re-exports of measuring or diagnostic tools from the model or bench modules."""
    from attn_course import _checks, bench, grouped, kv_cache, models, vit

    assert not hasattr(grouped, "__getattr__")
    for name in ("kv_cache_bytes", "compare_kv_cache_memory"):
        assert not hasattr(grouped, name) and getattr(kv_cache, name) is getattr(ac, name)
    assert not hasattr(kv_cache, "measure_decoding_speed") and measure.measure_decoding_speed is ac.measure_decoding_speed
    for module in (models, vit):
        assert not hasattr(module, "token_influence") and "token_influence" not in module.__all__
    for name in ("time_call", "synchronize", "largest_tensor_bytes", "saved_tensor_bytes"):
        assert name not in bench.__all__, name
    assert not hasattr(_checks, "weights_keyword") and not hasattr(_checks, "WEIGHTS_ALIASES")
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "FutureWarning" not in source and "return_weights" not in source and "return_attention" not in source


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
