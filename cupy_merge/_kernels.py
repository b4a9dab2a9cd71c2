"""Kernel source, NVRTC compilation and launches.

The CUDA source ships inside the package (``cupy_merge/cuda_src``, the
repository's top-level ``cuda_src/``). It is compiled at run time with NVRTC
through :class:`cupy.RawModule`, one module per device holding every dtype and
vector-width instantiation, and each kernel function is looked up once per
device. Launches go straight to ``cuLaunchKernel`` with the arguments packed
into one int64 buffer: every kernel parameter is a pointer or a 64-bit integer.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import threading

import cupy
import numpy

from ._plan import LaunchPlan, two_state_kernel_names

#: Source file -> every kernel instantiation it is compiled for.
KERNEL_SOURCES = {"merge_two_states.cu": two_state_kernel_names}

COMPILE_OPTIONS = ("-std=c++17",)

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
def _module(source_name: str, device: int) -> cupy.RawModule:
    return cupy.RawModule(
        code=kernel_source(source_name),
        options=COMPILE_OPTIONS,
        name_expressions=KERNEL_SOURCES[source_name](),
        backend="nvrtc",
    )


_SOURCE_OF_KERNEL = {kernel: source for source, kernels in KERNEL_SOURCES.items() for kernel in kernels()}
_functions: dict[tuple[str, int], object] = {}
_functions_lock = threading.Lock()


def get_function(kernel: str, device: int):
    """The compiled kernel for ``device``; compiles the module on first use there."""
    key = (kernel, device)
    function = _functions.get(key)
    if function is None:
        with _functions_lock, cupy.cuda.Device(device):
            function = _functions.get(key)
            if function is None:
                source_name = _SOURCE_OF_KERNEL[kernel]
                try:
                    # RawKernel.kernel is the cupy.cuda.Function loaded on the current device.
                    function = _module(source_name, device).get_function(kernel).kernel
                except cupy.cuda.compiler.CompileException as error:
                    raise KernelCompileError(source_name, str(error)) from error
                _functions[key] = function
    return function


def compile_all(device: int) -> int:
    """Compile every kernel for ``device`` now; returns how many instantiations there are."""
    for kernel in _SOURCE_OF_KERNEL:
        get_function(kernel, device)
    return len(_SOURCE_OF_KERNEL)


class _ArgumentBuffer(threading.local):
    """Per-thread storage for kernel arguments and the pointer array cuLaunchKernel reads."""

    def __init__(self, capacity: int = 64):
        self.values = numpy.zeros(capacity, dtype=numpy.int64)
        base = self.values.__array_interface__["data"][0]
        self.pointers = base + 8 * numpy.arange(capacity, dtype=numpy.uint64)
        self.pointers_address = self.pointers.__array_interface__["data"][0]


_arguments = _ArgumentBuffer()


def launch(plan: LaunchPlan, device: int, stream: int) -> None:
    """Launch ``plan`` on ``stream`` of ``device``."""
    function = get_function(plan.kernel, device)
    buffer = _arguments
    buffer.values[: len(plan.args)] = plan.args
    # cuLaunchKernel copies the arguments before returning, so the buffer can be reused at once.
    grid, block = plan.grid, plan.block
    if cupy.cuda.runtime.getDevice() == device:
        _launch(function.ptr, grid, block, stream, buffer.pointers_address)
    else:
        with cupy.cuda.Device(device):
            _launch(function.ptr, grid, block, stream, buffer.pointers_address)


def _launch(function_ptr: int, grid, block, stream: int, params: int) -> None:
    cupy.cuda.driver.launchKernel(
        function_ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, stream, params, 0
    )


def compile_offline(arch: str) -> dict[str, str]:
    """Compile every kernel for ``sm_<arch>`` with NVRTC alone; no GPU is needed.

    Uses the same source and options as the run-time path. Returns each name
    expression's mangled name; raises :class:`KernelCompileError` with NVRTC's log.
    """
    from cupy.cuda import nvrtc

    lowered = {}
    for source_name, kernels in KERNEL_SOURCES.items():
        program = nvrtc.createProgram(kernel_source(source_name), source_name, [], [])
        try:
            for kernel in kernels():
                nvrtc.addNameExpression(program, kernel)
            try:
                nvrtc.compileProgram(program, [*COMPILE_OPTIONS, f"--gpu-architecture=sm_{arch}"])
            except nvrtc.NVRTCError as error:
                raise KernelCompileError(source_name, nvrtc.getProgramLog(program)) from error
            if not nvrtc.getCUBIN(program):
                raise KernelCompileError(source_name, "NVRTC produced an empty binary")
            for kernel in kernels():
                lowered[kernel] = nvrtc.getLoweredName(program, kernel)
        finally:
            nvrtc.destroyProgram(program)
    return lowered
