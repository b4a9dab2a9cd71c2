"""``python -m cupy_merge --arch SM`` and the self-check without a GPU: they keep what they compile,
say so truthfully, fail naming the cache folder when it cannot be kept, and show progress in a log.

No GPU needed: a fake compiler stands in for NVRTC where only the bookkeeping is tested.
"""

from __future__ import annotations

import re

import pytest

from cupy_merge import __main__ as cli
from cupy_merge import _catalogue as cat
from cupy_merge import _kernels

#: Small modules: the cross-rank steps and two merges of float32.
MODULES = [
    cat.Module(cat.RANKS_SOURCE, "float32", "float32"),
    cat.Module(cat.TWO_STATES_SOURCE, "float32", "float32"),
    cat.Module(cat.MANY_STATES_SOURCE, "float32", "float32"),
]


def _compile_and_keep(module, target, *, cache=True):
    """NVRTC's stand-in: a binary named for every kernel of the module, kept as compile_module keeps it."""
    compiled = _kernels.Compiled(b"cubin", {k: f"_Z{i}" for i, k in enumerate(cat.module_instances(module))}, False)
    if cache:
        _kernels._store(_kernels._cache_file(module, target), compiled, (12, 9))
    return compiled


def _compile_and_drop(module, target, *, cache=True):
    """A compiler whose binaries are lost (a cache another process empties, a full disk)."""
    return _compile_and_keep(module, target, cache=False)


@pytest.fixture
def arch_run(monkeypatch, tmp_path):
    """``--arch 90`` over MODULES, compiled in this process by the given stand-in; the cache in tmp_path."""
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cat, "every_module", lambda *args: list(MODULES))
    monkeypatch.setattr(_kernels.os, "cpu_count", lambda: 1)  # one process: the stand-in is the compiler

    def run(compiler, *argv):
        monkeypatch.setattr(_kernels, "compile_module", compiler)
        return cli.main(["--arch", "90", *argv])

    return run


def test_arch_counts_and_times_what_it_kept_and_names_the_folder(arch_run, tmp_path, capsys):
    assert arch_run(_compile_and_keep) == 0
    out = capsys.readouterr().out
    instances = sum(len(cat.module_instances(m)) for m in MODULES)
    assert re.fullmatch(
        rf"{instances} kernel instantiations \(3 modules\) for sm_90 kept in {re.escape(str(tmp_path / 'cache'))} "
        r"in \d+\.\d\d s\n",
        out,
    )
    assert all(_kernels.cached(module, _kernels.Target("90")) for module in MODULES)


def test_arch_fails_when_its_binaries_were_not_kept(arch_run, tmp_path, capsys):
    assert arch_run(_compile_and_drop) == 1
    captured = capsys.readouterr()
    assert "ready" not in captured.out
    assert f"0 of 3 kernel modules compiled for sm_90 were kept in {tmp_path / 'cache'}" in captured.err


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_arch_refuses_a_cache_folder_it_cannot_write_before_compiling(arch_run, tmp_path, capsys, monkeypatch, where):
    regular_file = tmp_path / "not_a_folder"
    regular_file.write_text("")
    folder = regular_file if where == "a file" else regular_file / "cache"
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(folder))
    monkeypatch.setattr(_kernels, "compile_ahead", lambda *args, **kwargs: pytest.fail("compiled"))
    assert arch_run(_compile_and_keep) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"python -m cupy_merge: the kernel cache folder {folder} (CUPY_MERGE_CACHE_DIR) cannot be written: ")
    assert ("File exists" if where == "a file" else "Not a directory") in line


def test_arch_reports_progress_in_a_log_every_few_seconds_and_at_the_end(arch_run, monkeypatch, capsys):
    assert arch_run(_compile_and_keep) == 0
    lines = capsys.readouterr().err.splitlines()  # not a terminal: whole lines, no carriage returns
    assert lines[0] == "compiling 3 kernel modules for sm_90 (0 in the cache already): 0 done, 0 s"
    assert re.fullmatch(r"compiling 3 kernel modules for sm_90 \(0 in the cache already\): 3 done, \d+ s", lines[-1])
    assert len(lines) == 2  # fast compiles: nothing in between

    monkeypatch.setattr(_kernels, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(_kernels.cache_folder()) + "-again")
    assert arch_run(_compile_and_keep) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r", \d+ s$", "", line).rsplit(": ", 1)[1] for line in lines] == [f"{n} done" for n in range(4)]


def test_the_self_check_without_a_gpu_says_what_it_compiled(monkeypatch, tmp_path, capsys):
    import cupy

    from cupy_merge.tools import selfcheck

    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_kernels.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(_kernels, "compile_module", _compile_and_keep)
    assert selfcheck.run() == 0
    out = capsys.readouterr().out
    assert "every kernel" not in out
    modules = cat.same_dtype_modules()
    every = cat.every_module()
    assert (
        f"{sum(len(cat.module_instances(m)) for m in modules)} of "
        f"{sum(len(cat.module_instances(m)) for m in every)} kernel instantiations ({len(modules)} of "
        f"{len(every)} modules: the two-way and N-way merges with the same input and output dtype) "
        f"for sm_90 kept in {tmp_path} ("
    ) in out
    assert "python -m cupy_merge --arch 90 compiles all of them" in out
    # One short line each for the compile options and the architectures, not every -D and every sm_.
    assert "-DMERGE_CHUNK" not in out and "sm_50, sm_52" not in out
    (options,) = [line for line in out.splitlines() if line.startswith("compile options: ")]
    assert len(options) <= 110
