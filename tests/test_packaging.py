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
    extras = project["optional-dependencies"]
    wanted = _requirement_names(project["dependencies"] + extras["lab"] + extras["dev"])
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
    assert re.search(r'pip install -qq "\$\(TORCH\)" -e \'\.\[dev,lab\]\'', makefile)


def test_public_names_are_exported():
    for name in attn_course.__all__:
        assert hasattr(attn_course, name), name


def test_console_command_runs():
    out = subprocess.run(
        [sys.executable, "-m", "attn_course.cli", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("torch ") and ("device: cpu" in out or "device: cuda" in out or "device: mps" in out), out


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


# ---------------------------------------------------------------- runtime dependencies: what the library imports

IMPORT_TO_DIST = {"sklearn": "scikit-learn", "IPython": "ipython"}
# Tooling modules for maintainers (exercise generation, regeneration, runtimes): their imports are dev extras.
TOOLING_ONLY = {"nbformat", "nbclient"}
JUPYTER_SERVER_PACKAGES = ("jupyterlab", "jupyter_server", "notebook", "jupyterlab_server", "jupyter_lsp", "notebook_shim")


def _third_party_imports() -> set[str]:
    import ast

    names = set()
    for path in (ROOT / "attn_course").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("attn_course", "__future__")}


def test_runtime_dependencies_are_what_the_library_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = set(_requirement_names(project["dependencies"]))
    imported = {IMPORT_TO_DIST.get(name, name).lower() for name in _third_party_imports() - TOOLING_ONLY}
    assert imported == runtime, f"imported but not required: {imported - runtime}; required, never imported: {runtime - imported}"
    assert "jupyterlab" not in runtime and _requirement_names(project["optional-dependencies"]["lab"]) == {"jupyterlab": ">=4.0"}
    assert TOOLING_ONLY <= set(_requirement_names(project["optional-dependencies"]["dev"])) | {"nbclient"}  # via nbconvert


def _lesson_imports() -> set[str]:
    """Every module a code cell of a lesson, exercise or solution imports (IPython magics transformed first)."""
    import ast

    import nbformat
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    modules = set()
    for folder in ("notebooks", "exercises", "solutions"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            for cell in nbformat.read(path, as_version=4).cells:
                if cell.cell_type != "code":
                    continue
                for node in ast.walk(ast.parse(transform(cell.source))):
                    if isinstance(node, ast.Import):
                        modules |= {alias.name for alias in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        modules.add(node.module)
    return modules - {"google.colab"}  # the setup cell imports it only inside Colab


def test_every_lesson_import_works_without_jupyterlab():
    """Colab's setup cell installs the runtime requirements only: nothing a notebook imports may need JupyterLab.

    A fresh interpreter whose import system refuses JupyterLab and the Jupyter server packages imports
    attn_course and every module any notebook imports.
    """
    modules = sorted(_lesson_imports())
    assert {"attn_course", "torch", "matplotlib.pyplot"} <= set(modules), modules  # the cells were really read
    code = f"""
import importlib, importlib.abc, sys

BLOCKED = {JUPYTER_SERVER_PACKAGES!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is not installed (JupyterLab is an extra)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import attn_course, attn_course.widgets, attn_course.viz, attn_course.training, attn_course.data
for module in {modules!r}:
    importlib.import_module(module)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
print("imported", len({modules!r}), "modules; jupyter server packages loaded:", loaded)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("jupyter server packages loaded: []"), result.stdout


# ---------------------------------------------------------------- reuse: licences and citation


def test_licence_files_agree_with_pyproject_and_readme():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "MIT"}
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License\n") and "Permission is hereby granted, free of charge" in licence
    readme = (ROOT / "README.md").read_text()
    reuse = readme.split("## Licence, reuse and citation", 1)[1].split("\n## ", 1)[0]
    assert "[MIT licence](LICENSE)" in reuse and "CC BY 4.0" in reuse
    assert "https://creativecommons.org/licenses/by/4.0/" in reuse and "CITATION.cff" in reuse


def test_citation_file_names_this_release():
    import attn_course.course as course

    text = (ROOT / "CITATION.cff").read_text()
    fields = dict(re.findall(r"^([a-z-]+): *\"?([^\"\n]*)\"?$", text, flags=re.M))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert fields["cff-version"] == "1.2.0" and fields["type"] == "software"
    assert fields["version"] == project["version"] == attn_course.__version__
    assert fields["repository-code"] == course.REPO_URL
    assert re.search(r"^license:\n  - MIT\b.*\n  - CC-BY-4.0\b", text, flags=re.M)
    assert re.search(r"^authors:\n  - name: ", text, flags=re.M) and fields["title"].startswith("attn-course")
