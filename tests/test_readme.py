"""The README's promises that need no GPU: its code blocks are Python, its quick start is what CI runs."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_python_block_of_the_readme_parses():
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert len(blocks) >= 4
    for block in blocks:
        ast.parse(block)


def test_the_quick_start_test_command_is_the_one_ci_runs():
    assert "python -m pytest -q tests" in README
    ci = ROOT / ".ci" / "run"  # not in the sdist
    assert not ci.exists() or "python -m pytest -q tests" in ci.read_text(encoding="utf-8")
