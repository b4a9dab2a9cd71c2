"""The command line: conventions first (help, version, bad flags), then what each action does. No GPU needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cupy_merge import __main__ as cli
from cupy_merge import __version__


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cupy_merge", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_version_and_help_answer_without_compiling():
    assert _run("--version").stdout.strip() == f"cupy-merge {__version__}"
    result = _run("--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m cupy_merge")


def test_an_unknown_flag_exits_with_status_2():
    result = _run("--bogus")
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr


def test_a_malformed_architecture_exits_with_status_2():
    result = _run("--arch", "hopper")
    assert result.returncode == 2 and "--arch: expected an architecture" in result.stderr


def test_info_prints_the_environment_and_compiles_nothing(monkeypatch, capsys):
    from cupy_merge import _kernels

    monkeypatch.setattr(_kernels, "compile_offline", lambda *args, **kwargs: pytest.fail("compiled"))
    monkeypatch.setattr(_kernels, "compile_modules", lambda *args, **kwargs: pytest.fail("compiled"))
    assert cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith(f"cupy-merge {__version__}, cupy ")
        and "NVRTC" in out
        and "CUPY_MERGE_CACHE_DIR" in out
    )


def test_arch_compiles_every_module_for_that_architecture(monkeypatch, capsys):
    from cupy_merge import _catalogue, _kernels

    calls = []
    monkeypatch.setattr(
        _kernels, "compile_offline", lambda arch, modules: calls.append((arch, modules)) or {"k": "k"}
    )
    assert cli.main(["--arch", "sm_89"]) == 0
    assert calls == [("89", _catalogue.all_modules())]
    assert "for sm_89 ready" in capsys.readouterr().out


def test_without_cupy_the_import_error_says_which_extra_to_install():
    code = "import sys; sys.modules['cupy'] = None; import cupy_merge"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: cupy_merge needs CuPy: pip install 'cupy-merge[cu12]' (CUDA 12) or 'cupy-merge[cu13]' (CUDA 13)"
    )


def test_the_benchmark_names_its_own_command_in_its_usage():
    result = subprocess.run(
        [sys.executable, "-m", "cupy_merge.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m cupy_merge.bench")
