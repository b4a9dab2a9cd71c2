"""A user's script type-checks: torch in, torch out; LSE bases and strategies are literals (mypy, no GPU)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent / "typing" / "user_script.py"
WRONG = "import cupy_merge as cm\nimport torch\nv = torch.zeros(1, 1, 8)\ns = torch.zeros(1, 1)\n" \
        "cm.merge_state(v, s, v, s, lse_base=10)\n"  # fmt: skip


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory):
    """One mypy run (they take half a minute each) over the user's script and a wrong call."""
    pytest.importorskip("mypy")
    pytest.importorskip("torch")
    wrong = tmp_path_factory.mktemp("typing") / "wrong.py"
    wrong.write_text(WRONG)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports", "--follow-imports=silent",
         "--no-error-summary", str(SCRIPT), str(wrong)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    return result.stdout + result.stderr, wrong.name


def test_a_user_script_type_checks_with_the_results_typed_as_its_inputs(mypy_report):
    report, _ = mypy_report
    assert SCRIPT.name not in report, report


def test_a_wrong_lse_base_is_a_type_error(mypy_report):
    report, wrong = mypy_report
    assert wrong in report and "lse_base" in report, report
