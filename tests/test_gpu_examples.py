"""The examples that check themselves, run as scripts: on a GPU each must pass its own checks and say
so; anywhere they must compile, and without a CUDA device say why they do nothing and exit 0."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RING = ROOT / "examples" / "ring_attention_grad.py"
# "<dtype> <variant> <what> error <e> (tolerance <t>) ok|FAILED", one line a check.
CHECK = re.compile(r"^(\w+) +(no-sinks|sinks) +(\w+) +error \S+ \(tolerance \S+\) (ok|FAILED)$")


def _run(script: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *arguments], check=False, capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip


def _torch_has_cuda() -> bool:
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available()


def test_the_ring_attention_example_compiles(tmp_path):
    py_compile.compile(str(RING), cfile=str(tmp_path / "ring_attention_grad.pyc"), doraise=True)


def test_the_ring_attention_example_says_why_it_does_nothing_without_cuda():
    if _torch_has_cuda():
        pytest.skip("torch has a CUDA device here")
    done = _run(RING)
    assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("arguments", "dtypes"),
    [((), {"bfloat16", "float32"}), (("--causal", "--dtype", "bfloat16"), {"bfloat16"})],
    ids=["both-dtypes", "causal-bfloat16"],
)
def test_the_ring_attention_example_checks_its_gradients(arguments, dtypes):
    if not _torch_has_cuda():
        pytest.skip("torch without CUDA")
    done = _run(RING, *arguments)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    checks = [match.groups() for match in map(CHECK.match, lines) if match]
    wanted = [(dtype, variant, what) for dtype in dtypes for variant in ("no-sinks", "sinks")
              for what in ("out", "lse", "dq", "dk", "dv", "dsinks")[: 6 if variant == "sinks" else 5]]  # fmt: skip
    assert sorted(check[:3] for check in checks) == sorted(wanted), done.stdout
    assert all(check[3] == "ok" for check in checks) and "FAILED" not in done.stdout, done.stdout
    assert lines[-1] == "ok", done.stdout


INVARIANT = ROOT / "examples" / "split_kv_batch_invariant.py"


def test_the_batch_invariant_example_says_why_it_does_nothing_without_cuda(tmp_path):
    py_compile.compile(str(INVARIANT), cfile=str(tmp_path / "split_kv_batch_invariant.pyc"), doraise=True)
    import cupy

    if cupy.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = _run(INVARIANT)
    assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


@pytest.mark.gpu
def test_the_batch_invariant_example_gives_the_same_bits_at_batch_sizes_1_7_and_64():
    done = _run(INVARIANT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert sum("the same bits as alone" in line for line in lines) == 3, done.stdout
    assert lines[-1] == "ok", done.stdout
