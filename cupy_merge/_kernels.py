"""Kernel source, NVRTC compilation and launches.

The CUDA source ships inside the package (``cupy_merge/cuda_src``, the
repository's top-level ``cuda_src/``). It is compiled at run time with NVRTC
through :class:`cupy.RawModule`, one module per (source, dtype pair) and
device holding every instantiation of ``_catalogue``, and each kernel function
is looked up once per device. A launch goes straight to ``cuLaunchKernel`` with
the arguments packed once into an int64 buffer: every kernel parameter is a
pointer or an integer (32-bit ones read the low half of their slot).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import logging
import os
import pathlib
import re
import threading
import time
from typing import NamedTuple

import cupy
import numpy

from . import _catalogue as cat
from ._plan import LaunchPlan

_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)
_log = logging.getLogger("cupy_merge")

#: NVRTC could not be loaded: what to install, in one line.
NVRTC_HINT = (
    "NVRTC (libnvrtc) could not be loaded: install the CUDA runtime compiler wheel of your CUDA major, "
    "pip install 'cupy-merge[cu12]' (nvidia-cuda-nvrtc-cu12) or 'cupy-merge[cu13]' (nvidia-cuda-nvrtc)"
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
    """A kernel file's text with its local ``#include "..."`` files inlined.

    Inlining keeps the whole program in one string, so CuPy's on-disk kernel
    cache (keyed by source text) can never pair a new header with an old binary.
    """
    return with_includes(
        (importlib.resources.files("cupy_merge.cuda_src") / name).read_text(encoding="utf-8")
    )


def with_includes(source: str) -> str:
    """``source`` with each ``#include "file"`` of the shipped ``cuda_src/`` replaced by the file's text."""
    folder = importlib.resources.files("cupy_merge.cuda_src")
    return _INCLUDE.sub(lambda match: (folder / match.group(1)).read_text(encoding="utf-8"), source)


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; ``RuntimeError`` with what to install when it cannot be loaded."""
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        return int(major), int(minor)
    except Exception as error:  # noqa: BLE001 - CuPy raises several kinds when the library is missing
        raise RuntimeError(f"{NVRTC_HINT} ({type(error).__name__})") from None


_modules: dict[tuple[cat.Module, int], cupy.RawModule] = {}


def _module(module: cat.Module, device: int) -> cupy.RawModule:
    """One module per (source, input dtype, output dtype) and device, compiled on first use.

    Called with ``_functions_lock`` held. CuPy keeps the binary in its on-disk
    cache, so another process loads it without compiling.
    """
    key = (module, device)
    compiled = _modules.get(key)
    if compiled is None:
        nvrtc_version()
        started = time.perf_counter()
        compiled = cupy.RawModule(
            code=kernel_source(module.source),
            options=cat.COMPILE_OPTIONS,
            name_expressions=cat.module_instances(module),
            backend="nvrtc",
        )
        compiled.get_function(cat.module_instances(module)[0])  # compiles (or loads) now, not at first launch
        _log.info(
            "compiled %s for %s -> %s on device %d in %.2f s",
            module.source, module.in_dtype, module.out_dtype, device, time.perf_counter() - started,
        )  # fmt: skip
        _modules[key] = compiled
    return compiled


class Function(NamedTuple):
    pointer: int  # CUfunction
    context: int  # the CUcontext it was loaded in: current for the device when launched
    keep_alive: object


_functions: dict[tuple[str, int], Function] = {}
_functions_lock = threading.Lock()


def get_function(module: cat.Module, kernel: str, device: int) -> Function:
    """The compiled kernel for ``device``; compiles its module on first use there."""
    key = (kernel, device)
    function = _functions.get(key)
    if function is None:
        with _functions_lock, cupy.cuda.Device(device):
            function = _functions.get(key)
            if function is None:
                try:
                    # RawKernel.kernel is the cupy.cuda.Function loaded on the current device.
                    loaded = _module(module, device).get_function(kernel).kernel
                except cupy.cuda.compiler.CompileException as error:
                    raise KernelCompileError(module.source, str(error)) from error
                function = Function(loaded.ptr, cupy.cuda.driver.ctxGetCurrent(), loaded)
                _functions[key] = function
    return function


def compile_modules(device: int, modules: list[cat.Module] | None = None) -> int:
    """Compile ``modules`` (default: all) for ``device`` now; returns how many kernels they hold."""
    count = 0
    for module in modules if modules is not None else cat.all_modules():
        for kernel in cat.module_instances(module):
            get_function(module, kernel, device)
            count += 1
    return count


# Byte offsets of the int64 kernel arguments in their buffer (no kernel has more than 64).
_ARGUMENT_OFFSETS = 8 * numpy.arange(64, dtype=numpy.uint64)


class PreparedLaunch(NamedTuple):
    """A plan bound to a device: function, grid, block and the packed argument block."""

    function: int
    context: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    device: int
    params: int  # address of the void*[] cuLaunchKernel reads
    values: numpy.ndarray  # the int64 arguments params points into
    keep_alive: tuple


def prepare(plan: LaunchPlan, device: int) -> PreparedLaunch:
    """Look up (compile) ``plan``'s kernel on ``device`` and pack its arguments once."""
    function = get_function(plan.module, plan.kernel, device)
    values = numpy.array(plan.args, dtype=numpy.int64)
    params, pointers = _parameter_table(values)
    return PreparedLaunch(
        function.pointer, function.context, plan.grid, plan.block, plan.shared_bytes, device, params, values,
        (pointers, function),
    )  # fmt: skip


def _parameter_table(values: numpy.ndarray) -> tuple[int, numpy.ndarray]:
    """The void*[] cuLaunchKernel reads (entry i points at argument i) and its address."""
    pointers = values.__array_interface__["data"][0] + _ARGUMENT_OFFSETS[: len(values)]
    return pointers.__array_interface__["data"][0], pointers


def with_pointers(prepared: PreparedLaunch, patches: list[tuple[int, int]]) -> PreparedLaunch:
    """A copy of ``prepared`` with the arguments at the given slots replaced (its own buffer)."""
    values = prepared.values.copy()
    for slot, pointer in patches:
        values[slot] = pointer
    params, pointers = _parameter_table(values)
    return prepared._replace(params=params, values=values, keep_alive=(pointers, prepared.keep_alive[1]))


_driver_launch = cupy.cuda.driver.launchKernel
_current_context = cupy.cuda.driver.ctxGetCurrent


def launch(prepared: PreparedLaunch, stream: int) -> None:
    """Launch on ``stream``. cuLaunchKernel copies the arguments before it returns.

    The kernel's context must be current on this thread: a thread that never
    used CUDA (a worker of a thread pool) has none, and one may have another
    device's. Checking costs one driver call; making it current happens once per
    thread and device switch.
    """
    if _current_context() == prepared.context:
        _driver_launch(prepared.function, *prepared.grid, *prepared.block, prepared.shared_bytes, stream,
                       prepared.params, 0)  # fmt: skip
        return
    # cudaSetDevice makes the device's primary context current even when the runtime
    # already reports that device (a fresh thread reports device 0 and has no context),
    # which `with cupy.cuda.Device(...)` skips. The caller's device is restored after.
    runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(prepared.device)
    try:
        _driver_launch(prepared.function, *prepared.grid, *prepared.block, prepared.shared_bytes, stream,
                       prepared.params, 0)  # fmt: skip
    finally:
        if previous != prepared.device:
            runtime.setDevice(previous)


_patch_lock = threading.Lock()


def launch_patched(prepared: PreparedLaunch, stream: int, patches: list[tuple[int, int]]) -> None:
    """Launch with the arguments at the given slots replaced, without copying the buffer.

    The shared buffer is patched in place under a lock (another thread may be
    launching the same prepared call with its own outputs)."""
    with _patch_lock:
        values = prepared.values
        for slot, pointer in patches:
            values[slot] = pointer
        launch(prepared, stream)


def cache_folder() -> pathlib.Path:
    """Where NVRTC output compiled without a GPU is kept: ``$CUPY_MERGE_CACHE_DIR``, else
    ``cupy_merge/`` in CuPy's kernel cache folder (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    folder = os.environ.get("CUPY_MERGE_CACHE_DIR")
    if folder:
        return pathlib.Path(folder)
    cupy_folder = os.environ.get("CUPY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cupy", "kernel_cache"
    )
    return pathlib.Path(cupy_folder) / "cupy_merge"


def compile_offline(
    arch: str, modules: list[cat.Module] | None = None, *, cache: bool = True
) -> dict[str, str]:
    """Compile ``modules`` (default: all) for ``sm_<arch>`` with NVRTC alone; no GPU is needed.

    Uses the same source, grouping and options as the run-time path. Returns each
    name expression's mangled name; raises :class:`KernelCompileError` with NVRTC's log.
    With ``cache``, a module's binary and names are kept in :func:`cache_folder`,
    keyed by source, options, architecture and NVRTC version, so a second run loads them.
    """
    from cupy.cuda import nvrtc

    version = nvrtc_version()
    lowered = {}
    for module in modules if modules is not None else cat.all_modules():
        kernels = cat.module_instances(module)
        source = kernel_source(module.source)
        options = [*cat.COMPILE_OPTIONS, f"--gpu-architecture=sm_{arch}"]
        digest = hashlib.sha256(json.dumps([source, options, kernels, version]).encode()).hexdigest()[:32]
        names_file = cache_folder() / f"{digest}.json"
        if cache and names_file.is_file():
            lowered.update(json.loads(names_file.read_text()))
            _log.debug(
                "loaded %s (%s -> %s) for sm_%s from %s",
                module.source,
                module.in_dtype,
                module.out_dtype,
                arch,
                names_file,
            )
            continue
        started = time.perf_counter()
        program = nvrtc.createProgram(source, module.source, [], [])
        try:
            for kernel in kernels:
                nvrtc.addNameExpression(program, kernel)
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError as error:
                raise KernelCompileError(module.source, nvrtc.getProgramLog(program)) from error
            binary = nvrtc.getCUBIN(program)
            if not binary:
                raise KernelCompileError(module.source, "NVRTC produced an empty binary")
            names = {kernel: nvrtc.getLoweredName(program, kernel) for kernel in kernels}
        finally:
            nvrtc.destroyProgram(program)
        _log.info(
            "compiled %s for %s -> %s for sm_%s in %.2f s",
            module.source, module.in_dtype, module.out_dtype, arch, time.perf_counter() - started,
        )  # fmt: skip
        lowered.update(names)
        if cache:
            _store(names_file, binary, names)
    return lowered


def _store(names_file: pathlib.Path, binary: bytes, names: dict[str, str]) -> None:
    """Write the binary and its names beside each other; a cache that cannot be written is skipped."""
    try:
        names_file.parent.mkdir(parents=True, exist_ok=True)
        names_file.with_suffix(".cubin").write_bytes(binary)
        partial = names_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(names))
        partial.replace(names_file)  # atomic: a reader sees the whole file or none
    except OSError as error:
        _log.warning("could not write the NVRTC cache %s: %s", names_file.parent, error)
