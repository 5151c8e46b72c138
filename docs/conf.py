"""Sphinx configuration of the documentation site (``make docs``; how it is laid out: docs/README.md).

The source folder is the repository itself, so that the notebooks and ``benchmarks/README.md`` are
rendered where they live, never copied: ``include_patterns`` picks the pages, and the large folders
(the virtual environments among them) are excluded before Sphinx walks into them.
Notebooks are rendered from their saved outputs and never executed; a widget's output shows its
static picture (the PNG every shardviz widget saves beside its view), and no page loads anything
from the network.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

ROOT = Path(__file__).resolve().parent.parent

project = "shardviz"
# Read, not imported: importing shardviz loads torch, which a build with nothing to reread needs not.
release = version = runpy.run_path(str(ROOT / "shardviz" / "_version.py"))["__version__"]
root_doc = "docs/index"

extensions = ["myst_nb", "sphinx.ext.autodoc"]

include_patterns = ["docs/**.md", "notebooks/[0-9][0-9]_*.ipynb", "benchmarks/README.md"]
# Folders Sphinx would otherwise walk (the virtual environments alone hold ~100,000 files). A fixed
# list: a setting that changes between builds (a folder appearing) makes Sphinx reread every page.
exclude_patterns = [
    ".*",
    "build",
    "dist",
    "node_modules",
    "shardviz",
    "tests",
    "binder",
    "test-artifacts",
    "*.egg-info",
    "**/.ipynb_checkpoints",
    "benchmarks/results",
]

# Markdown: GitHub-style heading anchors (``page.md#sv-use`` works on GitHub and here alike).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Notebooks: saved outputs only; a widget's view needs a kernel, its saved PNG does not.
nb_execution_mode = "off"
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_ipywidgets_js: dict[str, dict[str, str]] = {}  # never the widget manager from a CDN
nb_merge_streams = True

# The API reference: autodoc reads the docstrings of the installed package.
autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
toc_object_entries = False  # the reference's headings are its table of contents

# Every cross-reference into shardviz must resolve; names of other projects (torch, numpy, the
# standard library) have no inventory offline and are left as text.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!shardviz\.).*")]

html_theme = "furo"
html_title = f"shardviz {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None
html_extra_path = ["_root/index.html"]  # the site's root opens docs/index.html

logger = logging.getLogger("shardviz.docs")


def _public_names() -> set[str]:
    import shardviz  # autodoc has imported it by now

    return {f"shardviz.{name}" for name in shardviz.__all__}


def _require_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A public name with no docstring is a warning, so an error in the -W build."""
    if name in _public_names() and not any(line.strip() for line in lines):
        logger.warning("%s (%s) has no docstring: the API reference would show a bare signature", name, what)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _require_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
