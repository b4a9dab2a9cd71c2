"""Kernel source and the one compile path (loading and launching: :mod:`cupy_merge._launch`).

The CUDA source ships inside the package (``cupy_merge/cuda_src``, the
repository's top-level ``cuda_src/``). A :class:`~cupy_merge._catalogue.Module`
(one source, one dtype pair, one set of compile options) is compiled by NVRTC
for one architecture by :func:`compile_module`, for the GPU at hand or ahead of
time (``python -m cupy_merge --arch 90``) alike, and kept on disk in
:func:`cache_folder` keyed by what went in (source, options, instantiations,
architecture, the library's version and the entry format): a later process, or a
GPU machine fed by an ``--arch`` run elsewhere, loads the binary without calling
NVRTC at all; an entry that cannot be used is compiled again and replaced.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.resources
import json
import logging
import multiprocessing
import os
import pathlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import cupy

from . import _catalogue as cat
from . import _version

_INCLUDE = re.compile(r'^#include "([^"]+)"\n', re.MULTILINE)
_log = logging.getLogger("cupy_merge")

#: NVRTC could not be loaded: what to install, in one line.
NVRTC_HINT = (
    "NVRTC (libnvrtc) could not be loaded: install the CUDA runtime compiler wheel of your CUDA major, "
    "pip install nvidia-cuda-nvrtc-cu12 (CUDA 12) or 'nvidia-cuda-nvrtc>=13,<14' (CUDA 13)"
)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; ``log`` holds NVRTC's own message.

    Parameters
    ----------
    source_name : str
        The ``.cu`` file that failed (in ``cupy_merge/cuda_src``).
    log : str
        NVRTC's compilation log.

    Examples
    --------
    >>> from cupy_merge import KernelCompileError
    >>> error = KernelCompileError("merge_two_states.cu", "error: expected a ';'")
    >>> error.log
    "error: expected a ';'"
    """

    def __init__(self, source_name: str, log: str):
        super().__init__(f"NVRTC failed to compile {source_name}:\n{log}")
        self.log = log


def kernel_source(name: str) -> str:
    """A kernel file's text with its local ``#include "..."`` files inlined, each once.

    Inlining keeps the whole program in one string, so the cache key (the source
    text) can never pair a new header with an old binary.
    """
    return with_includes(_read(name))


def _read(name: str) -> str:
    return (_source_folder() / name).read_text(encoding="utf-8")


@functools.cache
def _source_folder():
    """The imported package's own kernel source. In a source tree (a checkout or an unpacked sdist,
    installed editable or not), the top-level ``cuda_src/`` beside the package: the package resource
    would be whatever an install put on the path, another copy's sources when the tree is imported
    ahead of it. Otherwise the shipped package resource ``cupy_merge.cuda_src``."""
    beside = pathlib.Path(__file__).resolve().parent.parent / "cuda_src"
    if (beside / cat.TWO_STATES_SOURCE).is_file():
        return beside
    return importlib.resources.files("cupy_merge.cuda_src")


def with_includes(source: str, seen: set[str] | None = None) -> str:
    """``source`` with each ``#include "file"`` of the shipped ``cuda_src/`` replaced by the file's
    text (nested includes too, each file once; their ``#pragma once`` dropped)."""
    seen = set() if seen is None else seen

    def inline(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return with_includes(_read(name).replace("#pragma once\n", ""), seen)

    return _INCLUDE.sub(inline, source)


class NvrtcMissing(RuntimeError):
    """NVRTC cannot be loaded; the message says which wheel to install."""


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; :class:`NvrtcMissing` with what to install when it cannot be loaded."""
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        return int(major), int(minor)
    except Exception as error:  # noqa: BLE001 - CuPy raises several kinds when the library is missing
        raise NvrtcMissing(f"{NVRTC_HINT} ({type(error).__name__})") from None


def supported_architectures() -> tuple[int, ...]:
    """The architectures this NVRTC compiles for, e.g. ``(75, 80, 86, 89, 90, ...)``."""
    nvrtc_version()
    return tuple(int(arch) for arch in cupy.cuda.nvrtc.getSupportedArchs())


# -- compiling ----------------------------------------------------------------------------------


class Target(NamedTuple):
    """What NVRTC produces: a cubin for ``sm_<arch>``, or PTX for ``compute_<arch>`` (a GPU newer
    than this NVRTC knows: the driver compiles the PTX when it loads it)."""

    arch: str
    ptx: bool = False

    @property
    def option(self) -> str:
        return f"--gpu-architecture={'compute' if self.ptx else 'sm'}_{self.arch}"


class Compiled(NamedTuple):
    binary: bytes
    names: dict[str, str]  # name expression -> lowered (mangled) name
    ptx: bool


def cache_folder() -> pathlib.Path:
    """Where compiled modules are kept: ``$CUPY_MERGE_CACHE_DIR``, else ``cupy_merge/`` in CuPy's
    kernel cache folder (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    folder = os.environ.get("CUPY_MERGE_CACHE_DIR")
    if folder:
        return pathlib.Path(folder)
    cupy_folder = os.environ.get("CUPY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cupy", "kernel_cache"
    )
    return pathlib.Path(cupy_folder) / "cupy_merge"


#: The layout of a cache entry. It is part of the key, with the library's version, so an entry
#: another version wrote (another layout, or kernels from other sources) is never read.
CACHE_FORMAT = 2


def _family(module: cat.Module, target: Target) -> str:
    """A digest of everything a module's binary depends on but the compiler's version."""
    key = [CACHE_FORMAT, _version.__version__, kernel_source(module.source), list(module.options),
           cat.module_instances(module), target.option]  # fmt: skip
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


def _cache_file(module: cat.Module, target: Target) -> pathlib.Path:
    """The entry of ``module`` compiled by this process's NVRTC (an upgrade compiles again, and two
    environments of other CUDA versions sharing a folder keep an entry each)."""
    major, minor = nvrtc_version()
    return cache_folder() / f"{_family(module, target)}-nvrtc{major}_{minor}.json"


def _entries_to_read(module: cat.Module, target: Target) -> list[pathlib.Path]:
    """This NVRTC's entry; where NVRTC is missing (a machine serving binaries compiled ahead with
    ``--arch``), every NVRTC's, the newest NVRTC first (then the newest written)."""
    try:
        names_file = _cache_file(module, target)
    except NvrtcMissing:
        family = _family(module, target)
        found = []
        for path in cache_folder().glob(f"{family}-nvrtc*.json"):
            version = re.fullmatch(rf"{family}-nvrtc(\d+)_(\d+)\.json", path.name)
            if version:
                found.append(((int(version[1]), int(version[2])), _modified(path), path))
        return [path for *_, path in sorted(found, reverse=True)]
    return [names_file] if names_file.exists() else []


def _modified(path: pathlib.Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since it was listed
        return 0.0


def cached(module: cat.Module, target: Target) -> Compiled | None:
    """The module compiled for ``target`` earlier, by this process or another; None if never.

    An entry that cannot be used (damaged, half written, or of another shape) is a miss too,
    logged on the ``cupy_merge`` logger (without NVRTC the next entry is tried): the caller
    compiles the module again and replaces it.
    """
    return next(cached_entries(module, target), None)


def cached_entries(module: cat.Module, target: Target) -> Iterator[Compiled]:
    """Every usable entry of ``module`` for ``target``, in the order :func:`cached` prefers them (one
    with NVRTC; without it, each NVRTC's): a loader the driver refuses one of tries the next."""
    for names_file in _entries_to_read(module, target):
        try:
            yield _read_entry(names_file, cat.module_instances(module), target.ptx)
        except (OSError, ValueError, _UnusableEntry) as error:
            _log.warning("the kernel cache entry %s cannot be used (%s): compiling %s again", names_file,
                         error, module.source)  # fmt: skip


class _UnusableEntry(Exception):
    """A cache entry of another shape than :func:`_store` writes; the message says what is wrong."""


def _read_entry(names_file: pathlib.Path, kernels: list[str], ptx: bool) -> Compiled:
    """The entry in ``names_file`` and its binary; ``_UnusableEntry`` (or the error of reading or
    decoding it) saying why it cannot be used."""
    entry = json.loads(names_file.read_text(encoding="utf-8"))
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise _UnusableEntry("not an entry: expected an object with a sha256 digest")
    names = entry.get("names")
    if not isinstance(names, dict) or not all(isinstance(name, str) for name in names.values()):
        raise _UnusableEntry("no lowered names: expected an object of kernel -> name")
    if set(names) != set(kernels):
        raise _UnusableEntry(f"names {len(names)} kernels, the module has {len(kernels)}")
    binary = names_file.with_suffix(".bin").read_bytes()
    if hashlib.sha256(binary).hexdigest() != entry["sha256"]:
        raise _UnusableEntry("the binary does not match its digest")  # a process that died half way
    return Compiled(binary, names, ptx)


def compile_module(module: cat.Module, target: Target, *, cache: bool = True) -> Compiled:
    """``module`` compiled by NVRTC for ``target``: the one compile path, run-time and ahead of time.

    With ``cache``, a binary kept on disk is used and a new one is kept. Raises
    :class:`KernelCompileError` with NVRTC's log, or ``RuntimeError`` naming the
    extra to install when NVRTC is missing.
    """
    if cache:
        found = cached(module, target)
        if found is not None:
            _log.debug("loaded %s (%s -> %s) for %s from the cache", module.source, module.in_dtype,
                       module.out_dtype, target.option)  # fmt: skip
            return found
    from cupy.cuda import nvrtc

    version = nvrtc_version()
    kernels = cat.module_instances(module)
    started = time.perf_counter()
    program = nvrtc.createProgram(kernel_source(module.source), module.source, [], [])
    try:
        for kernel in kernels:
            nvrtc.addNameExpression(program, kernel)
        try:
            nvrtc.compileProgram(program, [*module.options, target.option])
        except nvrtc.NVRTCError as error:
            raise KernelCompileError(module.source, nvrtc.getProgramLog(program)) from error
        binary = _as_bytes(nvrtc.getPTX(program)) if target.ptx else nvrtc.getCUBIN(program)
        if not binary:
            raise KernelCompileError(module.source, "NVRTC produced an empty binary")
        names = {kernel: nvrtc.getLoweredName(program, kernel) for kernel in kernels}
    finally:
        nvrtc.destroyProgram(program)
    _log.info("compiled %s%s for %s -> %s for %s in %.2f s (NVRTC %d.%d)", module.source,
              " with sinks" if module.sinks else "", module.in_dtype, module.out_dtype, target.option,
              time.perf_counter() - started, *version)  # fmt: skip
    compiled = Compiled(binary, names, target.ptx)
    if cache:
        _store(_cache_file(module, target), compiled, version)
    return compiled


def _as_bytes(text: str | bytes) -> bytes:
    """NVRTC's PTX: str from CuPy 13's getPTX, bytes from CuPy 14's."""
    return text if isinstance(text, bytes) else text.encode()


def _store(names_file: pathlib.Path, compiled: Compiled, version: tuple[int, int]) -> None:
    """The binary, then its names and digest (atomically): a reader sees a whole entry or none.
    A cache that cannot be written is skipped with a warning."""
    entry = {"names": compiled.names, "sha256": hashlib.sha256(compiled.binary).hexdigest(), "nvrtc": version}
    try:
        names_file.parent.mkdir(parents=True, exist_ok=True)
        for path, data in ((names_file.with_suffix(".bin"), compiled.binary),
                           (names_file, json.dumps(entry).encode())):  # fmt: skip
            partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_bytes(data)
            partial.replace(path)
    except OSError as error:
        _log.warning("could not write the kernel cache %s: %s", names_file.parent, error)


def _compile_into_cache(module: cat.Module, target: Target) -> int:
    """A worker process's job: compile one module into the disk cache; how many kernels it holds."""
    return len(compile_module(module, target).names)


#: How often ahead-of-time compiling reports progress where standard error is not a terminal (a log).
PROGRESS_SECONDS = 10.0


def compile_ahead(target: Target, modules: list[cat.Module], *, progress: bool = True) -> int:
    """Compile every module of ``modules`` for ``target`` into the disk cache, in parallel where
    cores allow (NVRTC holds the interpreter's lock, so worker processes); returns how many
    kernel instantiations they hold.

    ``progress``: how many modules are done, on standard error: one line rewritten on a
    terminal; elsewhere (a log) a line at the start, every :data:`PROGRESS_SECONDS` and at the end.
    """
    pending = [module for module in modules if cached(module, target) is None]
    done = len(modules) - len(pending)
    label = f"compiling {len(modules)} kernel modules for {target.option.split('=')[1]} ({done} in the cache already)"
    terminal = sys.stderr.isatty()
    started = reported = time.perf_counter()

    def report(first: bool = False) -> None:
        nonlocal reported
        now = time.perf_counter()
        last = done == len(modules)
        if progress and (first or last or terminal or now - reported >= PROGRESS_SECONDS):
            reported = now
            line = f"{label}: {done} done, {now - started:.0f} s"
            print("\r" + line if terminal else line, end="" if terminal and not last else "\n",
                  file=sys.stderr, flush=True)  # fmt: skip

    report(first=True)
    workers = min(len(pending), os.cpu_count() or 1)
    if workers > 1:
        nvrtc_version()  # a missing NVRTC is said once, here, not by every worker
        context = multiprocessing.get_context("spawn")  # a forked CUDA context would be unusable
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            for future in concurrent.futures.as_completed(
                [pool.submit(_compile_into_cache, module, target) for module in pending]
            ):
                future.result()
                done += 1
                report()
    else:
        for module in pending:
            compile_module(module, target)
            done += 1
            report()
    return sum(len(cat.module_instances(module)) for module in modules)


class CacheFolderError(RuntimeError):
    """The kernel cache folder cannot be used, or did not keep what was compiled into it; the
    message names the folder and why."""


def writable_cache_folder() -> pathlib.Path:
    """:func:`cache_folder`, created if need be and written to once (a probe file, then removed);
    :class:`CacheFolderError` naming it and the reason when it cannot be."""
    folder = cache_folder()
    probe = folder / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CacheFolderError(
            f"the kernel cache folder {folder} (CUPY_MERGE_CACHE_DIR) cannot be written: {error}"
        ) from None
    return folder


# -- the target of a device ------------------------------------------------------------------


@functools.cache
def device_target(device: int) -> Target:
    """What to compile for ``device``: its own cubin, or PTX for the newest architecture NVRTC
    knows when the GPU is newer than this NVRTC."""
    props = cupy.cuda.runtime.getDeviceProperties(device)
    major, minor = props["major"], props["minor"]
    arch = 10 * major + minor
    try:
        known = supported_architectures()
    except RuntimeError:  # no NVRTC: only cached binaries can be loaded, and those are cubins
        return Target(str(arch))
    if arch in known:
        return Target(str(arch))
    older = [a for a in known if a <= arch]
    return Target(str(max(older) if older else min(known)), ptx=True)
