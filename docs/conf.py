"""Sphinx configuration of the course's web book.

``docs/build_site.py`` (``make site``) copies this file into the source folder it lays out and runs
Sphinx in its own process, with the repository on ``sys.path``.
"""

from attn_course.course import BRANCH, REPO_URL

project = "attn-course"
author = "the attn-course authors"
copyright = "the attn-course authors; code MIT, lessons CC BY 4.0"

# The library's docstrings are Google style ("Args:", "Attributes:"): napoleon reads them.
# githubpages writes .nojekyll, so GitHub Pages serves the underscore folders (_static, _images) as they are.
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "sphinx.ext.githubpages"]
napoleon_use_ivar = True  # a dataclass's "Attributes:" as fields of its own entry, not as duplicates
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# The notebooks are shown with the outputs stored in the repository; nothing is executed.
nb_execution_mode = "off"
# No widget manager from a CDN: the copies the site renders carry no widget state (build_site.py).
nb_ipywidgets_js = {}
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

# Served from the site itself (copied there from the npm package by build_site.py).
mathjax_path = "mathjax/tex-mml-chtml.js"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

html_theme = "furo"
html_title = "attn-course"
html_static_path = ["_static"]  # site.css and MathJax, copied in by build_site.py
html_css_files = ["site.css"]
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {
    "source_repository": REPO_URL,
    "source_branch": BRANCH,
    "top_of_page_buttons": [],
}
