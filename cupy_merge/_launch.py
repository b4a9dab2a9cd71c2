"""Loading compiled kernels on a device, and launching them.

A module compiled by :mod:`cupy_merge._kernels` is loaded with the driver (through CuPy) once
per device, and each kernel is looked up once per device. A launch goes straight to
``cuLaunchKernel`` with the arguments packed once into an int64 buffer (every kernel parameter
is a pointer or an integer; 32-bit ones read the low half of their slot), or to
``cuLaunchKernelEx`` with programmatic stream serialisation on sm_90 and newer
(``Tuning.programmatic_launch``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import threading
from collections.abc import Iterator
from typing import NamedTuple

import cupy
import numpy

from . import _catalogue as cat
from . import _kernels
from ._plan import KernelLaunch

_log = logging.getLogger("cupy_merge")


# -- loading ------------------------------------------------------------------------------------


class Function(NamedTuple):
    pointer: int  # CUfunction
    context: int  # the CUcontext it was loaded in: current for the device when launched
    keep_alive: object
    max_threads: int = 1024  # a block's, as its registers allow


_loaded: dict[tuple[cat.Module, int], tuple[object, dict[str, str]]] = {}
_functions: dict[tuple[str, cat.Module, int], Function] = {}
_functions_lock = threading.Lock()


def _load(module: cat.Module, device: int) -> tuple[object, dict[str, str]]:
    """``module`` loaded on ``device`` (current): from the disk cache, else compiled now.

    An entry the driver refuses (a cubin of a newer toolkit than this driver) is passed over for
    the next; with none left the module is compiled and its entry replaced.
    """
    target = _kernels.device_target(device)
    for compiled in _kernels.cached_entries(module, target):
        try:
            return _load_binary(compiled), compiled.names
        except cupy.cuda.driver.CUDADriverError as error:
            _log.info("could not load a cached %s (%s); trying the next entry", module.source, error)
    compiled = _kernels.compile_module(module, target, cache=False)
    _kernels._store(_kernels._cache_file(module, target), compiled, _kernels.nvrtc_version())
    return _load_binary(compiled), compiled.names


def _load_binary(compiled: _kernels.Compiled) -> object:
    loaded = cupy.cuda.function.Module()
    loaded.load(compiled.binary)
    return loaded


def get_function(module: cat.Module, kernel: str, device: int) -> Function:
    """The compiled kernel for ``device``; loads (or compiles) its module on first use there.

    A first use inside a CUDA-graph capture loads the module in the capture's relaxed mode
    (loading a module is not a capturable operation in the stricter modes)."""
    key = (kernel, module, device)
    function = _functions.get(key)
    if function is None:
        with _functions_lock, cupy.cuda.Device(device), _relaxed_capture():
            function = _functions.get(key)
            if function is None:
                loaded = _loaded.get((module, device))
                if loaded is None:
                    loaded = _loaded.setdefault((module, device), _load(module, device))
                binary, names = loaded
                found = binary.get_function(names[kernel])  # type: ignore[attr-defined]
                driver = cupy.cuda.driver
                max_threads = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, found.ptr)
                function = Function(found.ptr, driver.ctxGetCurrent(), found, max_threads)
                _functions[key] = function
    return function


def compile_modules(device: int, modules: list[cat.Module]) -> int:
    """Compile (in parallel) and load ``modules`` for ``device`` now; returns how many kernels they hold."""
    count = _kernels.compile_ahead(_kernels.device_target(device), modules)
    for module in modules:
        for kernel in cat.module_instances(module):
            get_function(module, kernel, device)
    return count


@contextlib.contextmanager
def _relaxed_capture() -> Iterator[None]:
    """This thread in relaxed stream-capture mode for the block (cuThreadExchangeStreamCaptureMode)."""
    exchange = _driver_function("cuThreadExchangeStreamCaptureMode")
    if exchange is None:
        yield
        return
    mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
    exchange(ctypes.byref(mode))
    try:
        yield
    finally:
        exchange(ctypes.byref(mode))


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_function(name: str):
    driver = _driver()
    return None if driver is None else getattr(driver, name, None)


# -- launching ----------------------------------------------------------------------------------

# Byte offsets of the int64 kernel arguments in their buffer (no kernel has more than 64).
_ARGUMENT_OFFSETS = 8 * numpy.arange(64, dtype=numpy.uint64)


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
        ("num_attributes", ctypes.c_uint),
    ]  # fmt: skip


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class PreparedLaunch(NamedTuple):
    """A launch bound to a device and to addresses: function, grid, block and the packed arguments."""

    function: int
    context: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    device: int
    params: int  # address of the void*[] the driver reads
    values: numpy.ndarray  # the int64 arguments params points into
    config: _LaunchConfig | None  # cuLaunchKernelEx's, for a programmatic launch; else None
    keep_alive: tuple


def prepare(launch: KernelLaunch, device: int, addresses: dict[str, int], programmatic: bool = False) -> PreparedLaunch:
    """Look up (compile) ``launch``'s kernel on ``device`` and pack its arguments with ``addresses``
    (operand field -> device address; an output still to be allocated may be missing: patched later)."""
    function = get_function(launch.module, launch.kernel, device)
    if math.prod(launch.block) > function.max_threads:  # a planner bug, named before a launch fails
        raise RuntimeError(
            f"cupy_merge: {launch.kernel} takes at most {function.max_threads} threads a block on device "
            f"{device}, the plan asked for {launch.block}; please report this"
        )
    values = numpy.array(launch.args, dtype=numpy.int64)
    for slot, field, offset in launch.pointers:
        address = addresses.get(field, 0)
        values[slot] = address + offset if address else 0
    params, pointers = _parameter_table(values)
    config = None
    if programmatic and _launch_kernel_ex() is not None and _supports_programmatic(device):
        config = _launch_config(launch)
    return PreparedLaunch(
        function.pointer, function.context, launch.grid, launch.block, launch.shared_bytes, device, params,
        values, config, (pointers, function),
    )  # fmt: skip


@functools.cache
def _supports_programmatic(device: int) -> bool:
    return cupy.cuda.runtime.getDeviceProperties(device)["major"] >= 9


@functools.cache
def _launch_kernel_ex():
    """cuLaunchKernelEx (CUDA 12+ drivers), or None."""
    function = _driver_function("cuLaunchKernelEx")
    if function is not None:
        function.argtypes = [ctypes.c_void_p] * 4
        function.restype = ctypes.c_int
    return function


def _launch_config(launch: KernelLaunch) -> _LaunchConfig:
    attribute = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(
        (ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(*launch.block), launch.shared_bytes,
        None, ctypes.pointer(attribute), 1,
    )  # fmt: skip
    config._attribute = attribute  # kept alive with the config
    return config


def _parameter_table(values: numpy.ndarray) -> tuple[int, numpy.ndarray]:
    """The void*[] the driver reads (entry i points at argument i) and its address."""
    pointers = values.__array_interface__["data"][0] + _ARGUMENT_OFFSETS[: len(values)]
    return pointers.__array_interface__["data"][0], pointers


def with_pointers(prepared: PreparedLaunch, patches: list[tuple[int, int]]) -> PreparedLaunch:
    """A copy of ``prepared`` with the arguments at the given slots replaced (its own buffer)."""
    values = prepared.values.copy()
    for slot, pointer in patches:
        values[slot] = pointer
    params, pointers = _parameter_table(values)
    return prepared._replace(params=params, values=values, keep_alive=(pointers, prepared.keep_alive[1]))


def stream_context(stream: int) -> int:
    """The CUDA context a stream belongs to."""
    return int(cupy.cuda.driver.streamGetCtx(stream))


def capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph."""
    return cupy.cuda.runtime.streamIsCapturing(stream) != 0


def stream_on_device(stream: int, device: int) -> bool:
    """Whether ``stream`` belongs to ``device``'s primary context (the one every merge launches in)."""
    with cupy.cuda.Device(device):
        cupy.cuda.runtime.free(0)  # makes the primary context current on a thread that has none
        return stream_context(stream) == int(cupy.cuda.driver.ctxGetCurrent())


_driver_launch = cupy.cuda.driver.launchKernel
_current_context = cupy.cuda.driver.ctxGetCurrent
_config_lock = threading.Lock()


def launch(prepared: PreparedLaunch, stream: int) -> None:
    """Launch on ``stream``. The driver copies the arguments before it returns.

    The kernel's context must be current on this thread: a thread that never
    used CUDA (a worker of a thread pool) has none, and one may have another
    device's. Checking costs one driver call; making it current happens once per
    thread and device switch.
    """
    if prepared.config is None and _current_context() == prepared.context:
        _driver_launch(prepared.function, *prepared.grid, *prepared.block, prepared.shared_bytes, stream,
                       prepared.params, 0)  # fmt: skip
        return
    if _current_context() == prepared.context:
        _launch_now(prepared, stream)
        return
    # cudaSetDevice makes the device's primary context current even when the runtime
    # already reports that device (a fresh thread reports device 0 and has no context),
    # which `with cupy.cuda.Device(...)` skips. The caller's device is restored after.
    runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(prepared.device)
    try:
        _launch_now(prepared, stream)
    finally:
        if previous != prepared.device:
            runtime.setDevice(previous)


def _launch_now(prepared: PreparedLaunch, stream: int) -> None:
    config = prepared.config
    if config is None:
        _driver_launch(prepared.function, *prepared.grid, *prepared.block, prepared.shared_bytes, stream,
                       prepared.params, 0)  # fmt: skip
        return
    with _config_lock:  # the config's stream is set for this launch
        config.stream = stream
        status = _launch_kernel_ex()(ctypes.addressof(config), prepared.function, prepared.params, None)
    if status:
        raise cupy.cuda.driver.CUDADriverError(status)


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
