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


def _extras() -> set[str]:
    """The extras pyproject.toml declares (read by hand: tomllib is Python 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^([a-z0-9-]+) = \[", section, re.MULTILINE))


def test_every_extra_the_readme_names_exists():
    named = set()
    for group in re.findall(r'pip install (?:-e )?"\.\[([^\]]+)\]"', README):
        named |= set(group.split(","))
    named |= set(re.findall(r"`\[([a-z0-9-]+)\]`", README))
    assert {"cu12", "cu13", "torch", "jax-cuda12", "test"} <= named
    assert named <= _extras()


def test_the_torch_floor_is_the_registered_ops_floor():
    assert "torch 2.4 or newer" in README
    assert '"torch>=2.4"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_every_relative_link_of_the_readme_exists():
    links = [target for target in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in target]
    assert any(target.startswith("docs/") for target in links)
    for target in links:
        assert (ROOT / target).exists(), target


def test_the_kernel_counts_the_readme_and_docs_give_are_the_catalogues():
    """The numbers of modules and instantiations `python -m cupy_merge` and `--arch` compile."""
    from cupy_merge import _catalogue as cat

    every = cat.every_module()
    same = cat.same_dtype_modules()
    total = f"{sum(len(cat.module_instances(module)) for module in every):,}"
    first = f"{sum(len(cat.module_instances(module)) for module in same)} of the {total} kernel instantiations"
    assert f"{first}, {len(same)} of {len(every)} modules" in README.replace("\n", " ")
    for page in ("cli.rst", "install.rst"):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8").replace("\n", " ")
        counts = re.findall(r"\b(\d,\d{3}) (?:for sm_90|instantiations)", text)
        assert counts and set(counts) == {total}, (page, counts, total)
