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
    from cupy_merge import _kernels, _launch
    from cupy_merge.tools import environment

    for name in ("compile_module", "compile_ahead"):
        monkeypatch.setattr(_kernels, name, lambda *args, **kwargs: pytest.fail("compiled"))
    monkeypatch.setattr(_launch, "compile_modules", lambda *args, **kwargs: pytest.fail("compiled"))
    assert cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith(f"cupy-merge {__version__}, Python ")
        and "NVRTC" in out
        and "CUPY_MERGE_CACHE_DIR" in out
    )
    assert out.splitlines() == environment.lines()


def test_arch_compiles_every_module_for_that_architecture(monkeypatch, capsys, tmp_path):
    from cupy_merge import _catalogue, _kernels

    calls = []
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_kernels, "supported_architectures", lambda: (75, 80, 89, 90))
    monkeypatch.setattr(
        _kernels, "compile_ahead", lambda target, modules, **kwargs: calls.append((target, modules)) or 1234
    )
    monkeypatch.setattr(_kernels, "cached", lambda module, target: (module, target))  # every module kept
    assert cli.main(["--arch", "sm_89"]) == 0
    assert calls == [(_kernels.Target("89"), _catalogue.every_module())]  # with sinks and without
    assert f"1234 kernel instantiations (99 modules) for sm_89 kept in {tmp_path}" in capsys.readouterr().out


def test_an_architecture_this_nvrtc_does_not_know_is_a_usage_error_listing_those_it_does(monkeypatch, capsys):
    from cupy_merge import _kernels

    monkeypatch.setattr(_kernels, "supported_architectures", lambda: (75, 80, 90))
    monkeypatch.setattr(_kernels, "compile_ahead", lambda *args, **kwargs: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["--arch", "89"])
    assert exited.value.code == 2
    assert "--arch: this NVRTC compiles for sm_75, sm_80, sm_90; got sm_89" in capsys.readouterr().err


def test_a_missing_nvrtc_is_said_in_one_line_with_status_1(monkeypatch, capsys):
    from cupy_merge import _kernels

    def missing():
        raise _kernels.NvrtcMissing(_kernels.NVRTC_HINT)

    monkeypatch.setattr(_kernels, "supported_architectures", missing)
    assert cli.main(["--arch", "90"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("python -m cupy_merge: NVRTC (libnvrtc) could not be loaded") and err.count("\n") == 1
    )


def test_without_cupy_the_import_error_says_which_extra_to_install():
    code = "import sys; sys.modules['cupy'] = None; import cupy_merge"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: cupy_merge needs CuPy: pip install 'cupy-cuda12x>=14' nvidia-cuda-nvrtc-cu12 (CUDA 12) or "
        "'cupy-cuda13x>=14' 'nvidia-cuda-nvrtc>=13,<14' (CUDA 13); from a checkout, pip install -e '.[cu12]' or '.[cu13]'"
    )


def test_without_cupy_the_command_line_still_answers_info():
    # python -m cupy_merge imports the package with sys.argv[0] == "-m": the command line's path.
    code = (
        "import runpy, sys; sys.modules['cupy'] = None; sys.argv = ['-m', '--info']; "
        "runpy.run_module('cupy_merge', run_name='__main__', alter_sys=True)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"cupy-merge {__version__}, Python ")
    assert "CuPy is not installed: pip install 'cupy-cuda12x>=14' nvidia-cuda-nvrtc-cu12 (CUDA 12)" in result.stdout


def test_the_benchmark_names_its_own_command_in_its_usage():
    result = subprocess.run(
        [sys.executable, "-m", "cupy_merge.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m cupy_merge.bench")
