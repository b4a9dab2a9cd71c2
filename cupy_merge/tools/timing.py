"""GPU timing with CUDA events (median of repetitions after warm-up, L2 flushed between them), and
host time per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import cupy

# Larger than the L2 of any current GPU (H200: 60 MB), so each timed run starts cold.
_FLUSH_BYTES = 256 * 1024 * 1024


def median_ms(
    run: Callable[[], object], *, warmup: int = 5, repeat: int = 30, flush_l2: bool = True
) -> float:
    """Median milliseconds of ``run()`` on CuPy's current stream."""
    stream = cupy.cuda.get_current_stream()
    flush = cupy.empty(_FLUSH_BYTES, dtype=cupy.uint8) if flush_l2 else None
    for _ in range(warmup):
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush.fill(1)
        start.record(stream)
        run()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def copy_us(traffic: int) -> float:
    """Median microseconds of a device-to-device copy of ``traffic / 2`` bytes (``traffic`` bytes
    read and written): the ceiling a memory-bound kernel moving ``traffic`` bytes is measured against."""
    src = cupy.empty(max(traffic // 2, 1), dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    return median_ms(lambda: dst.__setitem__(Ellipsis, src)) * 1e3


def host_us_per_call(call: Callable[[], object], *, batch: int = 256, batches: int = 40) -> float:
    """Median host microseconds per call, over batches of ``batch`` back-to-back calls (fewer than
    the launch queue holds, so the GPU never throttles the host), the device idle before each."""
    for _ in range(batch):
        call()
    times = []
    for _ in range(batches):
        cupy.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        for _ in range(batch):
            call()
        times.append((time.perf_counter() - start) / batch * 1e6)
    cupy.cuda.runtime.deviceSynchronize()
    return statistics.median(times)
