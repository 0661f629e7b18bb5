"""The course's own bookkeeping: where it lives, the lesson list, the first cells of every notebook.

Everything a notebook's header depends on is defined here once; ``tests/test_notebooks.py``
checks every notebook in ``notebooks/``, ``solutions/`` and ``exercises/`` agrees with it.
"""

from __future__ import annotations

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
    "project_root",
]

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
