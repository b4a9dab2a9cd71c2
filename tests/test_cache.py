"""The on-disk kernel cache: an entry that cannot be used is a miss, compiled again and replaced.

No GPU needed: entries are written by hand into a temporary folder, and the one real compile is
NVRTC's for sm_90, as ``python -m cupy_merge --arch 90`` compiles.
"""

from __future__ import annotations

import hashlib
import json
import os

import cupy
import pytest

from cupy_merge import _catalogue as cat
from cupy_merge import _kernels, _launch, _version

SM_90 = _kernels.Target("90")
MODULE = cat.Module(cat.TWO_STATES_SOURCE, "float32", "float32")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _write_entry(entry, binary: bytes = b"a cubin") -> None:
    """``entry`` (any JSON value) as the names file of MODULE's entry, beside ``binary``."""
    names_file = _kernels._cache_file(MODULE, SM_90)
    names_file.parent.mkdir(parents=True, exist_ok=True)
    names_file.with_suffix(".bin").write_bytes(binary)
    names_file.write_text(json.dumps(entry))


def _whole_entry(binary: bytes = b"a cubin") -> dict:
    names = {kernel: f"lowered_{i}" for i, kernel in enumerate(cat.module_instances(MODULE))}
    return {"names": names, "sha256": hashlib.sha256(binary).hexdigest()}


def _lacking_a_kernel() -> dict:
    entry = _whole_entry()
    entry["names"].pop(next(iter(entry["names"])))
    return entry


def _with_a_name_not_text() -> dict:
    entry = _whole_entry()
    entry["names"][next(iter(entry["names"]))] = 7
    return entry


UNUSABLE = {
    "a list": [],
    "null": None,
    "a string": "names",
    "a dict without names": {"sha256": _whole_entry()["sha256"]},
    "a dict without a digest": {"names": _whole_entry()["names"]},
    "names that are a list": {**_whole_entry(), "names": list(_whole_entry()["names"])},
    "a digest that is a number": {**_whole_entry(), "sha256": 12},
    "the digest right but a kernel missing": _lacking_a_kernel(),
    "the digest right but a name not text": _with_a_name_not_text(),
    "another binary's digest": _whole_entry(b"another cubin"),
}


def test_a_whole_entry_written_by_hand_is_read(cache):
    _write_entry(_whole_entry())
    assert _kernels.cached(MODULE, SM_90) == _kernels.Compiled(b"a cubin", _whole_entry()["names"], False)


@pytest.mark.parametrize("entry", UNUSABLE.values(), ids=UNUSABLE.keys())
def test_an_entry_that_cannot_be_used_is_a_logged_miss(cache, entry, caplog):
    _write_entry(entry)
    with caplog.at_level("WARNING", logger="cupy_merge"):
        assert _kernels.cached(MODULE, SM_90) is None
    (record,) = caplog.records
    assert str(_kernels._cache_file(MODULE, SM_90)) in record.getMessage()
    assert "compiling merge_two_states.cu again" in record.getMessage()


def test_names_that_are_not_json_are_a_logged_miss(cache, caplog):
    _write_entry(None)
    _kernels._cache_file(MODULE, SM_90).write_bytes(b"\xff{not json")
    with caplog.at_level("WARNING", logger="cupy_merge"):
        assert _kernels.cached(MODULE, SM_90) is None
    assert len(caplog.records) == 1


def test_an_entry_without_its_binary_is_a_logged_miss(cache, caplog):
    _write_entry(_whole_entry())
    _kernels._cache_file(MODULE, SM_90).with_suffix(".bin").unlink()
    with caplog.at_level("WARNING", logger="cupy_merge"):
        assert _kernels.cached(MODULE, SM_90) is None
    assert len(caplog.records) == 1


def test_no_entry_at_all_is_a_quiet_miss(cache, caplog):
    with caplog.at_level("DEBUG", logger="cupy_merge"):
        assert _kernels.cached(MODULE, SM_90) is None
    assert not caplog.records


def test_a_foreign_entry_is_compiled_again_and_replaced(cache, caplog):
    _write_entry([])
    with caplog.at_level("INFO", logger="cupy_merge"):
        compiled = _kernels.compile_module(MODULE, SM_90)
    assert any("compiled merge_two_states.cu" in record.getMessage() for record in caplog.records)
    assert set(compiled.names) == set(cat.module_instances(MODULE)) and compiled.binary
    assert _kernels.cached(MODULE, SM_90) == compiled  # the entry replaced, whole
    assert json.loads(_kernels._cache_file(MODULE, SM_90).read_text())["names"] == compiled.names


def test_the_key_holds_the_library_version_and_the_entry_format(cache, monkeypatch):
    _write_entry(_whole_entry())
    assert _kernels.cached(MODULE, SM_90) is not None
    monkeypatch.setattr(_version, "__version__", _version.__version__ + "+another")
    assert _kernels.cached(MODULE, SM_90) is None  # another version's entry is never read
    monkeypatch.undo()
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(cache))
    assert _kernels.cached(MODULE, SM_90) is not None
    monkeypatch.setattr(_kernels, "CACHE_FORMAT", _kernels.CACHE_FORMAT + 1)
    assert _kernels.cached(MODULE, SM_90) is None


def test_the_key_holds_nvrtcs_version_and_a_machine_without_nvrtc_reads_any(cache, monkeypatch):
    """An entry of another NVRTC is compiled again by this one (an upgrade's code generation is
    used, and environments of two CUDA versions sharing a folder keep one entry each); a serving
    machine with no NVRTC, whose cache was filled ahead with --arch, reads any NVRTC's, the newest
    NVRTC first, the next where one cannot be used."""
    _write_entry(_whole_entry())
    assert _kernels.cached(MODULE, SM_90) is not None
    major, minor = _kernels.nvrtc_version()
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: (major, minor + 1))
    assert _kernels.cached(MODULE, SM_90) is None
    _write_entry(_whole_entry(b"the newer NVRTC's cubin"), b"the newer NVRTC's cubin")
    assert _kernels.cached(MODULE, SM_90).binary == b"the newer NVRTC's cubin"

    def missing():
        raise _kernels.NvrtcMissing("no NVRTC here")

    newer = next(path for path in cache.glob(f"*-nvrtc{major}_{minor + 1}.json"))
    os.utime(newer, (newer.stat().st_atime, newer.stat().st_mtime - 1000))  # written first
    (cache / f"{newer.name.split('-')[0]}-nvrtcX.json").write_text("{}")  # no entry of any NVRTC's
    monkeypatch.setattr(_kernels, "nvrtc_version", missing)
    assert _kernels.cached(MODULE, SM_90).binary == b"the newer NVRTC's cubin"  # the newest NVRTC first
    newer.with_suffix(".bin").write_bytes(b"damaged")  # its digest no longer matches: the next is read
    assert _kernels.cached(MODULE, SM_90).binary == b"a cubin"
    for path in cache.glob("*"):
        path.unlink()
    assert _kernels.cached(MODULE, SM_90) is None


def test_without_nvrtc_another_modules_newer_entry_is_not_read(cache, monkeypatch):
    other = cat.Module(cat.TWO_STATES_SOURCE, "float16", "float16")
    _write_entry(_whole_entry())
    names = {kernel: f"lowered_{i}" for i, kernel in enumerate(cat.module_instances(other))}
    other_file = _kernels._cache_file(other, SM_90)
    other_file.with_suffix(".bin").write_bytes(b"another module's cubin")
    other_file.write_text(json.dumps({"names": names, "sha256": hashlib.sha256(b"another module's cubin").hexdigest()}))

    def missing():
        raise _kernels.NvrtcMissing("no NVRTC here")

    monkeypatch.setattr(_kernels, "nvrtc_version", missing)
    assert _kernels.cached(MODULE, SM_90).binary == b"a cubin"


class _Refused(cupy.cuda.driver.CUDADriverError):
    """The driver's refusal of a binary (CUDADriverError's own constructor asks libcuda for the name)."""

    def __init__(self) -> None:
        Exception.__init__(self, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")


def test_a_binary_the_driver_refuses_is_passed_over_for_the_next_entry(cache, monkeypatch):
    """Without NVRTC, the newest NVRTC's cubin may be one this driver cannot load (a newer toolkit's):
    the loader takes the next entry rather than compile (it cannot) and fail; with every entry
    refused it says what to install; with NVRTC it compiles and replaces this NVRTC's entry."""
    major, _ = _kernels.nvrtc_version()
    _write_entry(_whole_entry(b"the older NVRTC's cubin"), b"the older NVRTC's cubin")
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: (major + 1, 0))
    _write_entry(_whole_entry(b"the newer NVRTC's cubin"), b"the newer NVRTC's cubin")
    refused = {b"the newer NVRTC's cubin"}

    def load(compiled):
        if compiled.binary in refused:
            raise _Refused
        return compiled.binary

    def missing():
        raise _kernels.NvrtcMissing("no NVRTC here: install the cu12 extra")

    monkeypatch.setattr(_launch, "_load_binary", load)
    monkeypatch.setattr(_kernels, "device_target", lambda device: SM_90)
    monkeypatch.setattr(_kernels, "nvrtc_version", missing)
    assert _launch._load(MODULE, 0) == (b"the older NVRTC's cubin", _whole_entry()["names"])

    refused.add(b"the older NVRTC's cubin")
    with pytest.raises(_kernels.NvrtcMissing, match="install"):
        _launch._load(MODULE, 0)

    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: (major + 1, 0))
    compiled = _kernels.compile_module(MODULE, SM_90, cache=False)  # what an NVRTC makes of it

    def compile_module(module, target, *, cache=True):  # reads the cache where asked, as the real one
        return (cache and _kernels.cached(module, target)) or compiled

    monkeypatch.setattr(_kernels, "compile_module", compile_module)
    assert _launch._load(MODULE, 0) == (compiled.binary, compiled.names)
    assert _kernels.cached(MODULE, SM_90) == compiled  # this NVRTC's refused entry replaced
    refused.clear()
    assert _launch._load(MODULE, 0) == (compiled.binary, compiled.names)  # and loaded from the cache
