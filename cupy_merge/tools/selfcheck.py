"""The self-check behind ``python -m cupy_merge``: environment, compilation, checked merges on real sizes."""

from __future__ import annotations

import pathlib
import time

import cupy
import numpy

from .. import _arrays, _catalogue, _kernels, _launch, merge_state, merge_states, reference
from . import environment
from .timing import median_ms

# (tokens, heads, head_size, dtype): decode, chunked prefill, long prefill.
SELF_CHECK_CASES = [
    (16, 32, 128, "bfloat16"),
    (613, 16, 96, "float16"),
    (4096, 32, 128, "bfloat16"),
    (8192, 32, 128, "float32"),
]
MANY_STATES_CASES = [(16, 64, 32, 128, "bfloat16"), (4, 4096, 32, 128, "float16")]


#: What the self-check compiles, in words (``_catalogue.same_dtype_modules``).
SAME_DTYPE_MERGES = "the two-way and N-way merges with the same input and output dtype"


def compile_ahead(arch: str, modules: list[_catalogue.Module] | None = None) -> str:
    """Compile ``modules`` (default: all) for ``sm_<arch>`` with NVRTC alone, into the disk cache
    a GPU of that architecture loads without NVRTC; a line saying how many, where and how long.

    Raises :class:`~cupy_merge._kernels.CacheFolderError` naming the cache folder when it
    cannot be written (before compiling) or did not keep every module (after).
    """
    modules = _catalogue.every_module() if modules is None else modules
    count, folder, seconds = _compile_and_keep(arch, modules)
    return f"{count} kernel instantiations ({len(modules)} modules) for sm_{arch} kept in {folder} in {seconds:.2f} s"


def _compile_and_keep(arch: str, modules: list[_catalogue.Module]) -> tuple[int, pathlib.Path, float]:
    """Compile ``modules`` for ``sm_<arch>`` into a cache folder checked first and counted after:
    how many instantiations, the folder, the seconds taken."""
    started = time.perf_counter()
    folder = _kernels.writable_cache_folder()
    target = _kernels.Target(arch)
    count = _kernels.compile_ahead(target, modules)
    kept = sum(_kernels.cached(module, target) is not None for module in modules)
    if kept < len(modules):
        raise _kernels.CacheFolderError(
            f"{kept} of {len(modules)} kernel modules compiled for sm_{arch} were kept in {folder} "
            "(CUPY_MERGE_CACHE_DIR): the others could not be written there or were removed since "
            "(see any warning above)"
        )
    return count, folder, time.perf_counter() - started


def _share(count: int, modules: list[_catalogue.Module]) -> str:
    """``count`` instantiations of ``modules`` (the self-check's) as a share of every module's."""
    every = _catalogue.every_module()
    total = sum(len(_catalogue.module_instances(module)) for module in every)
    return f"{count} of {total} kernel instantiations ({len(modules)} of {len(every)} modules: {SAME_DTYPE_MERGES})"


def _random_state(tokens, heads, head_size, rng):
    v = rng.standard_normal((tokens, heads, head_size), dtype=numpy.float32)
    s = rng.standard_normal((heads, tokens), dtype=numpy.float32) * 4
    return v, s


def _check_case(tokens, heads, head_size, dtype, rng) -> str:
    cupy_dtype = _cupy_dtype(dtype)
    if cupy_dtype is None:
        return f"{tokens:>6} x {heads:>3} x {head_size:>4} {dtype:<9} skipped: this CuPy has no {dtype} (pip install ml_dtypes)"
    host_a, lse_a = _random_state(tokens, heads, head_size, rng)
    host_b, lse_b = _random_state(tokens, heads, head_size, rng)
    v_a, v_b = cupy.asarray(host_a).astype(cupy_dtype), cupy.asarray(host_b).astype(cupy_dtype)
    s_a, s_b = cupy.asarray(lse_a), cupy.asarray(lse_b)
    out, out_lse = cupy.full_like(v_a, numpy.nan), cupy.full_like(s_a, numpy.nan)
    merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    ref_v, ref_s = reference.merge_state(
        v_a.astype(cupy.float32).get(), lse_a, v_b.astype(cupy.float32).get(), lse_b
    )
    got = out.astype(cupy.float32).get()
    error = numpy.linalg.norm(got - ref_v) / numpy.linalg.norm(ref_v)
    lse_error = numpy.max(numpy.abs(out_lse.get() - ref_s))
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    ok = bool(numpy.isfinite(got).all()) and error <= tolerance and lse_error <= 1e-5
    ms = median_ms(lambda: merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse))
    moved = 3 * v_a.nbytes + 3 * s_a.nbytes
    return (
        f"{tokens:>6} x {heads:>3} x {head_size:>4} {dtype:<9} rel.err {error:.1e}  "
        f"{ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s  {'ok' if ok else 'FAILED'}"
    )


def _check_many(states, tokens, heads, head_size, dtype, rng) -> str:
    cupy_dtype = _cupy_dtype(dtype)
    label = f"{states:>3} states x {tokens:>5} x {heads:>3} x {head_size:>4} {dtype:<9}"
    if cupy_dtype is None:
        return f"{label} skipped: this CuPy has no {dtype} (pip install ml_dtypes)"
    host_v = rng.standard_normal((states, tokens, heads, head_size), dtype=numpy.float32)
    host_s = rng.standard_normal((states, heads, tokens), dtype=numpy.float32) * 4
    v, s = cupy.asarray(host_v).astype(cupy_dtype), cupy.asarray(host_s)
    out, out_lse = (
        cupy.full(v.shape[1:], numpy.nan, dtype=cupy_dtype),
        cupy.full(s.shape[1:], numpy.nan, numpy.float32),
    )
    merge_states(v, s, out=out, out_lse=out_lse)
    ref_v, ref_s = reference.merge_states(v.astype(cupy.float32).get(), host_s)
    got = out.astype(cupy.float32).get()
    error = numpy.linalg.norm(got - ref_v) / numpy.linalg.norm(ref_v)
    lse_error = numpy.max(numpy.abs(out_lse.get() - ref_s))
    ok = (
        bool(numpy.isfinite(got).all())
        and error <= (1e-5 if dtype == "float32" else 1e-2)
        and lse_error <= 1e-4
    )
    ms = median_ms(lambda: merge_states(v, s, out=out, out_lse=out_lse))
    moved = v.nbytes + s.nbytes + out.nbytes + out_lse.nbytes
    return f"{label} rel.err {error:.1e}  {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s  {'ok' if ok else 'FAILED'}"


def _cupy_dtype(name: str):
    """The CuPy dtype for ``name``, or ``None`` where this CuPy cannot hold it (bfloat16 needs ml_dtypes)."""
    try:
        dtype = _arrays.cupy_dtype(name)
        cupy.empty(1, dtype=dtype)
        return dtype
    except (TypeError, ValueError, NotImplementedError):
        return None


def run() -> int:
    """The self-check: environment, compilation, checked merges on the GPU; 0 when all pass.

    It compiles the same-dtype merges' kernels (``python -m cupy_merge --arch`` compiles every
    module); without a GPU, for sm_90 with NVRTC alone (kept on disk, so a second run is fast),
    then says there is nothing to run and succeeds.
    """
    print("\n".join(environment.lines(brief=True)))
    modules = _catalogue.same_dtype_modules()
    if not cupy.cuda.is_available():
        count, folder, seconds = _compile_and_keep("90", modules)
        print(f"{_share(count, modules)} for sm_90 kept in {folder} ({seconds:.2f} s); "
              "python -m cupy_merge --arch 90 compiles all of them")  # fmt: skip
        print("no GPU here: nothing to run; the kernels compile")
        return 0
    started = time.perf_counter()
    device = cupy.cuda.runtime.getDevice()
    count = _launch.compile_modules(device, modules)
    target = _kernels.device_target(device)
    print(f"{_share(count, modules)} loaded on device {device} "
          f"({target.option.split('=')[1]}) in {time.perf_counter() - started:.2f} s")  # fmt: skip
    rng = numpy.random.default_rng()
    results = [_check_case(*case, rng) for case in SELF_CHECK_CASES]
    results += [_check_many(*case, rng) for case in MANY_STATES_CASES]
    print("\n".join(results))
    return 1 if any(line.endswith("FAILED") for line in results) else 0
