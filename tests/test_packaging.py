"""The project's set-up files agree with each other and with the README."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import attn_course

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name, where they differ


def _requirement_names(requirements: list[str]) -> dict[str, str]:
    """{name: version spec} from PEP 508 strings like 'torch>=2.2'."""
    out = {}
    for req in requirements:
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", req)
        out[match.group(1).lower()] = match.group(2).strip()
    return out


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _requirement_names(project["dependencies"] + project["optional-dependencies"]["dev"])
    wanted = {CONDA_NAMES.get(name, name): spec for name, spec in wanted.items()}
    conda = {}
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        match = re.match(r"^\s*-\s+([A-Za-z0-9_.\-]+)([<>=!].*)?$", line)
        if match and match.group(1) not in ("python", "pip") and not match.group(1).startswith("-"):
            conda[match.group(1).lower()] = (match.group(2) or "").strip()
    assert conda == wanted, "environment.yml and pyproject.toml list different dependencies or versions"


def test_fixed_top_level_layout():
    for name in ("notebooks", "attn_course", "exercises", "solutions", "tests", "environment.yml", "README.md"):
        assert (ROOT / name).exists(), f"missing top-level {name}"


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_one():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", quick, flags=re.S)
    lines = [line for block in commands for line in block.strip().splitlines() if line.strip()]
    assert lines == ["make lab", "make test"], lines
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_makefile_pins_cpu_torch_in_the_same_pip_command():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH   ?= torch==2.13.0" in makefile
    assert re.search(r'pip install -qq "\$\(TORCH\)" -e \'\.\[dev\]\'', makefile)


def test_public_names_are_exported():
    for name in attn_course.__all__:
        assert hasattr(attn_course, name), name


def test_console_command_runs():
    out = subprocess.run(
        [sys.executable, "-m", "attn_course.cli", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("torch ") and "device: cpu" in out or "device: cuda" in out or "device: mps" in out


def test_built_wheel_contains_every_subpackage(tmp_path):
    """Colab installs from git: a wheel that forgot a subpackage breaks every exercise there."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )
    import zipfile

    (wheel,) = tmp_path.glob("attn_course-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "attn_course").rglob("__init__.py")}
    for package in packages:
        assert f"{package}/__init__.py" in names, f"the wheel lacks {package}"
    assert "attn_course/grading/tasks/lesson03.py" in names
