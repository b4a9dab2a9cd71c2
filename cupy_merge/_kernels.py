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

import functools
import importlib.resources
import re
import threading
from typing import NamedTuple

import cupy
import numpy

from . import _catalogue as cat
from ._plan import LaunchPlan

_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; ``log`` holds NVRTC's own message."""

    def __init__(self, source_name: str, log: str):
        super().__init__(f"NVRTC failed to compile {source_name}:\n{log}")
        self.log = log


def kernel_source(name: str) -> str:
    """A kernel file's text with its local ``#include "..."`` files inlined.

    Inlining keeps the whole program in one string, so CuPy's on-disk kernel
    cache (keyed by source text) can never pair a new header with an old binary.
    """
    folder = importlib.resources.files("cupy_merge.cuda_src")

    def inline(match: re.Match) -> str:
        return (folder / match.group(1)).read_text(encoding="utf-8")

    return _INCLUDE.sub(inline, (folder / name).read_text(encoding="utf-8"))


@functools.cache
def _module(module: cat.Module, device: int) -> cupy.RawModule:
    """One module per (source, input dtype, output dtype) and device: compiled on first use only."""
    return cupy.RawModule(
        code=kernel_source(module.source),
        options=cat.COMPILE_OPTIONS,
        name_expressions=cat.module_instances(module),
        backend="nvrtc",
    )


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
    arguments = (
        prepared.function,
        *prepared.grid,
        *prepared.block,
        prepared.shared_bytes,
        stream,
        prepared.params,
        0,
    )
    if _current_context() == prepared.context:
        _driver_launch(*arguments)
        return
    # cudaSetDevice makes the device's primary context current even when the runtime
    # already reports that device (a fresh thread reports device 0 and has no context),
    # which `with cupy.cuda.Device(...)` skips. The caller's device is restored after.
    runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(prepared.device)
    try:
        _driver_launch(*arguments)
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


def compile_offline(arch: str, modules: list[cat.Module] | None = None) -> dict[str, str]:
    """Compile ``modules`` (default: all) for ``sm_<arch>`` with NVRTC alone; no GPU is needed.

    Uses the same source, grouping and options as the run-time path. Returns each
    name expression's mangled name; raises :class:`KernelCompileError` with NVRTC's log.
    """
    from cupy.cuda import nvrtc

    lowered = {}
    for module in modules if modules is not None else cat.all_modules():
        kernels = cat.module_instances(module)
        program = nvrtc.createProgram(kernel_source(module.source), module.source, [], [])
        try:
            for kernel in kernels:
                nvrtc.addNameExpression(program, kernel)
            try:
                nvrtc.compileProgram(program, [*cat.COMPILE_OPTIONS, f"--gpu-architecture=sm_{arch}"])
            except nvrtc.NVRTCError as error:
                raise KernelCompileError(module.source, nvrtc.getProgramLog(program)) from error
            if not nvrtc.getCUBIN(program):
                raise KernelCompileError(module.source, "NVRTC produced an empty binary")
            for kernel in kernels:
                lowered[kernel] = nvrtc.getLoweredName(program, kernel)
        finally:
            nvrtc.destroyProgram(program)
    return lowered
