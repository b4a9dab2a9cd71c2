"""Sphinx configuration: the API reference, built from the numpydoc docstrings."""

import cupy_merge

project = "cupy-merge"
release = version = cupy_merge.__version__
extensions = ["sphinx.ext.autodoc", "numpydoc"]
autodoc_typehints = "none"  # the numpydoc sections give each type in words
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
exclude_patterns = ["_build", "ARCHITECTURE.md"]
html_theme = "alabaster"
