"""The course's own bookkeeping: where it lives, the lesson list, the first cells of every notebook.

Everything a notebook's header depends on is defined here once; ``tests/test_notebooks.py``
checks every notebook in ``notebooks/``, ``solutions/`` and ``exercises/`` agrees with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "REPO_SLUG",
    "REPO_URL",
    "INSTALL_SOURCE",
    "LESSONS",
    "Lesson",
    "colab_url",
    "colab_badge",
    "setup_cell_source",
    "sync_headers",
    "project_root",
    "Runtimes",
    "RUNTIMES_FILE",
    "LESSON_BUDGET_S",
    "SOLUTION_BUDGET_S",
    "load_runtimes",
    "save_runtimes",
    "measured_runtimes",
    "course_map_markdown",
    "COURSE_MAP_HEADING",
]

# The repository's address, in this one place: the Colab badges and the setup cell of every
# notebook, and the web book's "Open in Colab" links, are made from it. A fork changes REPO_SLUG
# (and BRANCH if it publishes another), then runs `python -m attn_course.course` to rewrite the
# badges and setup cells; tests/test_notebooks.py fails until every notebook agrees.
REPO_SLUG = "attn-course/attn-course"
REPO_URL = f"https://github.com/{REPO_SLUG}"
BRANCH = "main"
# What the Colab setup cell installs: the package straight from the repository.
INSTALL_SOURCE = f"attn-course @ git+{REPO_URL}.git@{BRANCH}"


@dataclass(frozen=True)
class Lesson:
    number: str
    slug: str
    title: str

    @property
    def filename(self) -> str:
        return f"{self.number}_{self.slug}.ipynb"


LESSONS = (
    Lesson("00", "welcome", "Welcome & setup"),
    Lesson("01", "scaled_dot_product_attention", "Scaled dot-product attention"),
    Lesson("02", "multi_head_attention", "Multi-head attention"),
    Lesson("03", "masking", "Masking"),
    Lesson("04", "cost_of_attention", "The cost of attention"),
    Lesson("05", "sparse_attention", "Sparse attention"),
    Lesson("06", "linear_attention", "Linear attention"),
    Lesson("07", "chunked_attention", "Chunked & memory-efficient attention"),
    Lesson("08", "training_and_debugging", "Training & debugging"),
    Lesson("09", "vision_transformer", "Vision Transformer"),
    Lesson("10", "conformer", "Conformer"),
    Lesson("11", "dynamic_heads_and_beyond", "Dynamic heads and beyond"),
    Lesson("12", "attention_across_devices", "Attention across devices"),
)


def project_root() -> Path:
    """The repository root (the folder holding ``notebooks/``), for tooling run from a checkout."""
    return Path(__file__).resolve().parents[1]


def colab_url(folder: str, filename: str) -> str:
    """The Colab address that opens ``folder/filename`` from the repository."""
    return f"https://colab.research.google.com/github/{REPO_SLUG}/blob/{BRANCH}/{folder}/{filename}"


def colab_badge(folder: str, filename: str) -> str:
    """Markdown for the "Open in Colab" badge of one notebook."""
    badge = "https://colab.research.google.com/assets/colab-badge.svg"
    return f"[![Open In Colab]({badge})]({colab_url(folder, filename)})"


def setup_cell_source() -> str:
    """The first code cell of every notebook: installs the course in Colab, a no-op elsewhere."""
    return (
        "# Setup: in Colab, install the course and enable its widgets; elsewhere this does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f'    get_ipython().run_line_magic("pip", "install -q \\"{INSTALL_SOURCE}\\"")\n'
        "    from google.colab import output\n"
        "\n"
        "    output.enable_custom_widget_manager()"
    )


_BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\(https://colab\.research\.google\.com/github/[^)]*\)")


def sync_headers(root: Path | None = None) -> list[Path]:
    """Rewrite the Colab badge and the setup cell of every notebook from this module; return those changed.

    Only the badge in the first cell and the whole second cell are touched (and the
    ``repository-code`` line of ``CITATION.cff``), so a fork that edits ``REPO_SLUG`` or ``BRANCH``
    gets every notebook in ``notebooks/``, ``solutions/`` and ``exercises/`` pointing at itself
    without re-running anything.
    """
    import nbformat

    root = Path(root) if root is not None else project_root()
    changed = []
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((root / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            title, setup = nb.cells[0], nb.cells[1]
            if title.cell_type != "markdown" or not _BADGE.search(title.source) or setup.cell_type != "code":
                raise ValueError(f"{path}: expected a title cell with a Colab badge, then the setup cell")
            badge = colab_badge(folder, path.name)
            new_title = _BADGE.sub(lambda _: badge, title.source, count=1)
            if new_title == title.source and setup.source == setup_cell_source():
                continue
            title.source, setup.source = new_title, setup_cell_source()
            path.write_text(nbformat.writes(nb) + "\n")
            changed.append(path)
    citation = root / "CITATION.cff"  # GitHub's "Cite this repository" names the code's address too
    if citation.exists():
        text = citation.read_text()
        new_text = re.sub(r'^repository-code: ".*"$', f'repository-code: "https://github.com/{REPO_SLUG}"', text, flags=re.M)
        if new_text != text:
            citation.write_text(new_text)
            changed.append(citation)
    return changed


# ---------------------------------------------------------------------------------------------
# Measured runtimes and the course map of 00_welcome
# ---------------------------------------------------------------------------------------------

RUNTIMES_FILE = "notebooks/runtimes.json"  # relative to the repository root
LESSON_BUDGET_S = 60.0  # every lesson, top to bottom, on a 2-core CPU
SOLUTION_BUDGET_S = 30.0  # every solution notebook
COURSE_MAP_HEADING = "## 5. Course map"


@dataclass(frozen=True)
class Runtimes:
    """Wall-clock seconds of one top-to-bottom run per notebook, and where they were measured.

    ``seconds`` maps ``"notebooks/NN_slug.ipynb"`` / ``"solutions/NN_slug.ipynb"`` to seconds.
    Written by ``attn-course runtimes``; never typed in by hand.
    """

    machine: str
    threads: int
    date: str
    seconds: dict[str, float]


def load_runtimes(path: Path | None = None) -> Runtimes:
    """Read the runtimes file (default: the checkout's ``notebooks/runtimes.json``)."""
    path = Path(path) if path is not None else project_root() / RUNTIMES_FILE
    data = json.loads(path.read_text())
    return Runtimes(machine=data["machine"], threads=data["threads"], date=data["date"], seconds=data["seconds"])


def save_runtimes(runtimes: Runtimes, path: Path | None = None) -> Path:
    """Write ``runtimes`` as JSON (sorted keys, one entry per line) and return the path."""
    path = Path(path) if path is not None else project_root() / RUNTIMES_FILE
    data = {"machine": runtimes.machine, "threads": runtimes.threads, "date": runtimes.date, "seconds": runtimes.seconds}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def measured_runtimes(seconds: dict[str, float]) -> Runtimes:
    """``seconds`` (measured just now) with a description of this machine, its thread count and today's date."""
    import datetime
    import os
    import platform

    import torch

    gpu = f"with a {torch.cuda.get_device_name()} GPU" if torch.cuda.is_available() else "without a GPU"
    machine = f"a {os.cpu_count()}-core {platform.machine()} CPU {gpu}"
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    return Runtimes(machine=machine, threads=threads, date=datetime.date.today().isoformat(), seconds=seconds)


def course_map_markdown(runtimes: Runtimes) -> str:
    """The course-map cell of ``00_welcome``: every lesson and exercise in order, with measured runtimes."""

    def runtime(key: str) -> str:
        return f"{runtimes.seconds[key]:.0f} s" if key in runtimes.seconds else "not measured"

    lines = [
        COURSE_MAP_HEADING,
        "",
        "Every lesson in order, with its exercise notebook. A runtime is the wall-clock time of one run",
        "top to bottom, kernel start included, measured by `attn-course runtimes` (`make runtimes`) on",
        f"{runtimes.machine}, {runtimes.threads} PyTorch threads, on {runtimes.date}. \"Solved in\" is",
        "the time of the finished exercise notebook in `solutions/` (an untouched exercise stops at its",
        "first stub).",
        "",
        "| # | lesson | runtime | exercises | solved in |",
        "|---|---|---|---|---|",
    ]
    for lesson in LESSONS:
        lesson_link = f"[{lesson.title}]({lesson.filename})"
        if lesson.number == "00":
            exercise_link, solved = "–", "–"
        else:
            exercise_link = f"[{lesson.number} exercises](../exercises/{lesson.filename})"
            solved = runtime(f"solutions/{lesson.filename}")
        lines.append(
            f"| {lesson.number} | {lesson_link} | {runtime(f'notebooks/{lesson.filename}')} | {exercise_link} | {solved} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for changed_path in sync_headers():
        print(f"rewrote {changed_path.relative_to(project_root())}")
