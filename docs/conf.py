"""Sphinx configuration: the user guide and the API reference, built from the numpydoc docstrings."""

import cupy_merge

project = "cupy-merge"
release = version = cupy_merge.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.mathjax", "numpydoc"]
autodoc_typehints = "none"  # the numpydoc sections give each type in words
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
exclude_patterns = ["_build", "ARCHITECTURE.md"]
# Furo: a maintained theme whose content column widens with the window and scrolls wide tables
# on their own instead of overflowing the page.
html_theme = "furo"
html_title = f"cupy-merge {version}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]

# Every cross-reference must resolve: CI builds with -W, so a dangling one fails it.
nitpicky = True
