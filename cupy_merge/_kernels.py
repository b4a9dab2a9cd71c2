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
from typing import NamedTuple

import cupy
import numpy

from ._plan import LaunchPlan, all_modules, module_kernel_names

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
def _module(module: tuple[str, str, str], device: int) -> cupy.RawModule:
    """One module per (source, input dtype, output dtype) and device: compiled on first use only."""
    return cupy.RawModule(
        code=kernel_source(module[0]),
        options=COMPILE_OPTIONS,
        name_expressions=module_kernel_names(*module),
        backend="nvrtc",
    )


_functions: dict[tuple[str, int], object] = {}
_functions_lock = threading.Lock()


def get_function(module: tuple[str, str, str], kernel: str, device: int):
    """The compiled kernel for ``device``; compiles its module on first use there."""
    key = (kernel, device)
    function = _functions.get(key)
    if function is None:
        with _functions_lock, cupy.cuda.Device(device):
            function = _functions.get(key)
            if function is None:
                try:
                    # RawKernel.kernel is the cupy.cuda.Function loaded on the current device.
                    function = _module(module, device).get_function(kernel).kernel
                except cupy.cuda.compiler.CompileException as error:
                    raise KernelCompileError(module[0], str(error)) from error
                _functions[key] = function
    return function


def compile_modules(device: int, modules: list[tuple[str, str, str]] | None = None) -> int:
    """Compile ``modules`` (default: all) for ``device`` now; returns how many kernels they hold."""
    count = 0
    for module in modules if modules is not None else all_modules():
        for kernel in module_kernel_names(*module):
            get_function(module, kernel, device)
            count += 1
    return count


class PreparedLaunch(NamedTuple):
    """A plan bound to a device: function pointer and its packed argument block."""

    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: int  # address of the void*[] cuLaunchKernel reads
    shared_bytes: int
    device: int
    buffers: tuple  # keeps the argument memory alive


# Byte offsets of the int64 kernel arguments in their buffer (no kernel has more than 64).
_ARGUMENT_OFFSETS = 8 * numpy.arange(64, dtype=numpy.uint64)


_prepared: dict[tuple[LaunchPlan, int], PreparedLaunch] = {}


def prepare(plan: LaunchPlan, device: int) -> PreparedLaunch:
    """Pack ``plan``'s arguments once; every kernel parameter is a pointer or a 64-bit integer."""
    key = (plan, device)
    prepared = _prepared.get(key)
    if prepared is None:
        function = get_function(plan.module, plan.kernel, device)
        values = numpy.array(plan.args, dtype=numpy.int64)
        pointers = values.__array_interface__["data"][0] + _ARGUMENT_OFFSETS[: len(values)]
        prepared = PreparedLaunch(
            function.ptr,
            plan.grid,
            plan.block,
            pointers.__array_interface__["data"][0],
            plan.shared_bytes,
            device,
            (values, pointers, function),
        )
        if len(_prepared) > 8192:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def with_pointers(prepared: PreparedLaunch, patches: list[tuple[int, int]]) -> PreparedLaunch:
    """``prepared`` with the arguments at the given indices replaced by new pointers."""
    values = prepared.buffers[0].copy()
    for index, pointer in patches:
        values[index] = pointer
    pointers = values.__array_interface__["data"][0] + _ARGUMENT_OFFSETS[: len(values)]
    params = pointers.__array_interface__["data"][0]
    return prepared._replace(params=params, buffers=(values, pointers, prepared.buffers[2]))


def launch_prepared(prepared: PreparedLaunch, stream: int) -> None:
    """cuLaunchKernel copies the arguments before returning; nothing here is mutated."""
    grid, block, shared = prepared.grid, prepared.block, prepared.shared_bytes
    if cupy.cuda.runtime.getDevice() == prepared.device:
        _driver_launch(prepared.function, *grid, *block, shared, stream, prepared.params, 0)
    else:
        with cupy.cuda.Device(prepared.device):
            _driver_launch(prepared.function, *grid, *block, shared, stream, prepared.params, 0)


_driver_launch = cupy.cuda.driver.launchKernel


def compile_offline(arch: str, modules: list[tuple[str, str, str]] | None = None) -> dict[str, str]:
    """Compile ``modules`` (default: all) for ``sm_<arch>`` with NVRTC alone; no GPU is needed.

    Uses the same source, grouping and options as the run-time path. Returns each
    name expression's mangled name; raises :class:`KernelCompileError` with NVRTC's log.
    """
    from cupy.cuda import nvrtc

    lowered = {}
    for module in modules if modules is not None else all_modules():
        source_name, kernels = module[0], module_kernel_names(*module)
        program = nvrtc.createProgram(kernel_source(source_name), source_name, [], [])
        try:
            for kernel in kernels:
                nvrtc.addNameExpression(program, kernel)
            try:
                nvrtc.compileProgram(program, [*COMPILE_OPTIONS, f"--gpu-architecture=sm_{arch}"])
            except nvrtc.NVRTCError as error:
                raise KernelCompileError(source_name, nvrtc.getProgramLog(program)) from error
            if not nvrtc.getCUBIN(program):
                raise KernelCompileError(source_name, "NVRTC produced an empty binary")
            for kernel in kernels:
                lowered[kernel] = nvrtc.getLoweredName(program, kernel)
        finally:
            nvrtc.destroyProgram(program)
    return lowered
