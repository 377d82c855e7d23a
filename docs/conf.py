"""Sphinx configuration: Markdown pages (MyST), API pages from the Google-style docstrings (autodoc + napoleon).

``make docs`` builds docs/_build/html; ``make test`` builds it with warnings as errors (tests/test_docs.py), so a
broken link, a missing heading anchor or a docstring autodoc cannot read fails it.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "lightning_opkit"
author = "the lightning_opkit developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# [text](page.md#a-heading) links are checked against the headings, down to ####
myst_heading_anchors = 4
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
html_theme = "furo"
html_title = "lightning_opkit"
html_static_path: list[str] = []
