"""``python -m cupy_merge.bench``: the merge against the same-bytes copy, torch, and host overhead.

For each case (bfloat16 unless named) it measures, in one run:

* ``merge_us``: this library's kernel, CUDA events, median, L2 flushed before each repetition;
* ``copy_us``: a device-to-device copy moving the same number of bytes (read + write), the ceiling;
* ``torch_us``: the same formula in eager torch, when torch is installed;
* ``compiled_us``: that formula through ``torch.compile`` (skip with ``--no-compile``);
* ``graph_us``: the merge replayed from a CUDA graph (torch), which removes host cost;
* host overhead per call, without synchronisation, for CuPy arrays and torch tensors
  (batches of 256 calls, fewer than the launch queue holds, so the GPU never throttles
  the host; the median batch): ``host_*_us`` calls ``merge_attn_states`` each time,
  ``bound_*_us`` relaunches a merge bound once with ``cupy_merge.bind``;

then, for N-way and ragged merges, ``merge_states`` against the same-bytes copy,
chained two-way merges and eager torch; and for FP8 outputs (bfloat16 in), the
fused merge with a per-tensor scale and with group scales (128 elements)
against its own bytes' copy and against the unfused way, a merge to bfloat16
then a separate one-pass quantisation (``unfused_us``; the per-tensor pass, the
cheapest any separate quantisation can be) or eager torch's (``torch_unfused_us``).

Usage: ``python -m cupy_merge.bench [--quick] [--no-compile] [--out results.csv|.json] [--plot plot.png]``
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from typing import Any

import cupy
import numpy

from .. import bind, merge_attn_states, merge_state, merge_states, merge_states_varlen
from .._arrays import cupy_dtype
from .timing import median_ms

DEFAULT_CASES = [
    (1, 32, 128), (16, 32, 128), (64, 32, 128), (256, 32, 128), (613, 16, 96),
    (1024, 32, 128), (4096, 32, 128), (8192, 32, 128), (16384, 32, 128), (32768, 32, 128),
    (4096, 128, 128), (8192, 128, 128), (4096, 32, 64), (4096, 32, 256), (8192, 16, 512),
]  # fmt: skip
EXTRA_DTYPE_CASES = [(4096, 32, 128, "float16"), (4096, 32, 128, "float32")]
QUICK_CASES = [(1, 32, 128), (64, 32, 128), (1024, 32, 128), (8192, 32, 128), (8192, 128, 128)]
#: (num_states, tokens, heads, head_size), bfloat16; ragged cases have 0..2*mean states per token.
MANY_CASES = [
    (16, 64, 32, 128),
    (64, 64, 32, 128),
    (4, 4096, 32, 128),
    (8, 8192, 32, 128),
    (16, 1024, 32, 128),
    (64, 256, 32, 128),
    (256, 16, 32, 128),
]
QUICK_MANY_CASES = [(16, 64, 32, 128), (4, 4096, 32, 128)]
RAGGED_CASES = [(8, 1024, 32, 128), (16, 4096, 32, 128)]  # (mean states per token, tokens, heads, head_size)
#: (tokens, heads, head_size), bfloat16 in, FP8 out; 128 heads as vLLM's measurement of its fused op.
FP8_CASES = [
    (1, 128, 128),
    (64, 32, 128),
    (1024, 128, 128),
    (4096, 32, 128),
    (8192, 32, 128),
    (16384, 32, 128),
]
QUICK_FP8_CASES = [(1, 128, 128), (1024, 128, 128), (8192, 32, 128)]


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _states(tokens, heads, head_size, dtype, torch):
    """Random inputs and outputs as torch tensors when torch is there (any dtype), else CuPy."""
    if torch is not None:
        tdtype = getattr(torch, dtype)
        v = [torch.randn(tokens, heads, head_size, device="cuda", dtype=tdtype) for _ in range(3)]
        s = [torch.randn(heads, tokens, device="cuda") * 4 for _ in range(3)]
    else:
        v = [
            cupy.random.standard_normal((tokens, heads, head_size), dtype=cupy.float32).astype(dtype)
            for _ in range(3)
        ]
        s = [cupy.random.standard_normal((heads, tokens), dtype=cupy.float32) * 4 for _ in range(3)]
    return v, s


def _traffic_bytes(tokens, heads, head_size, itemsize) -> int:
    values = tokens * heads * head_size * itemsize
    lse = tokens * heads * 4
    return 3 * values + 3 * lse  # read two states, write one


def _host_us_per_call(call, batch=256, batches=40) -> float:
    """Median host time per call over batches short enough never to fill the launch queue."""
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


def _torch_eager(torch, out, v_a, s_a, v_b, s_b):
    lse = torch.logaddexp(s_a, s_b)
    w_a = torch.exp(s_a - lse).T.unsqueeze(-1)
    w_b = torch.exp(s_b - lse).T.unsqueeze(-1)
    out.copy_(w_a * v_a.float() + w_b * v_b.float())


_compiled: dict[str, Any] = {}


def _torch_compiled_us(torch, out, v_a, s_a, v_b, s_b) -> float:
    """The eager formula through torch.compile (one compilation, dynamic shapes); NaN if it fails."""
    try:
        if "merge" not in _compiled:
            _compiled["merge"] = torch.compile(lambda *a: _torch_eager(torch, *a), dynamic=True)
        compiled = _compiled["merge"]
        return median_ms(lambda: compiled(out, v_a, s_a, v_b, s_b)) * 1e3
    except Exception as error:  # noqa: BLE001 - any compiler failure only blanks this column
        print(f"\ntorch.compile failed: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        _compiled["merge"] = None
        return float("nan")


def _graph_us(torch, call) -> float:
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return median_ms(graph.replay) * 1e3


def run_case(tokens, heads, head_size, dtype, torch, compile_torch=True) -> dict:
    (v_a, v_b, out), (s_a, s_b, out_lse) = _states(tokens, heads, head_size, dtype, torch)
    itemsize = v_a.element_size() if torch is not None else v_a.itemsize
    traffic = _traffic_bytes(tokens, heads, head_size, itemsize)

    def merge():
        merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)

    copy_src = cupy.empty(traffic // 2, dtype=cupy.uint8)
    copy_dst = cupy.empty_like(copy_src)
    # torch's default stream and CuPy's null stream are both the legacy default stream, so the
    # events, the merge (on torch's stream) and the copy (on CuPy's) share one queue.
    row = {"tokens": tokens, "heads": heads, "head_size": head_size, "dtype": dtype, "mbytes": traffic / 1e6}
    row["merge_us"] = median_ms(merge) * 1e3
    row["copy_us"] = median_ms(lambda: copy_dst.__setitem__(Ellipsis, copy_src)) * 1e3
    row["merge_gbps"] = traffic / row["merge_us"] / 1e3
    row["pct_of_copy"] = 100 * row["copy_us"] / row["merge_us"]
    if torch is not None:
        row["torch_us"] = median_ms(lambda: _torch_eager(torch, out, v_a, s_a, v_b, s_b)) * 1e3
        if compile_torch and _compiled.get("merge", True) is not None:
            row["compiled_us"] = _torch_compiled_us(torch, out, v_a, s_a, v_b, s_b)
        row["graph_us"] = _graph_us(torch, merge)
        if tokens <= 64:
            row["host_torch_us"] = _host_us_per_call(merge)
            row["bound_torch_us"] = _host_us_per_call(
                bind(merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
            )
            row["alloc_torch_us"] = _host_us_per_call(lambda: merge_state(v_a, s_a, v_b, s_b))
            # The yardsticks: one elementwise op of torch's on the same tensors, into out and allocating.
            row["add_torch_us"] = _host_us_per_call(lambda: torch.add(v_a, v_b, out=out))
            row["add_alloc_torch_us"] = _host_us_per_call(lambda: torch.add(v_a, v_b))
    if tokens <= 64:
        arrays = [cupy.from_dlpack(x) for x in (out, v_a, s_a, v_b, s_b, out_lse)] if torch else None
        row["host_cupy_us"] = _host_us_per_call(lambda: merge_attn_states(*arrays) if arrays else merge())
        bound = (
            bind(merge_attn_states, *arrays)
            if arrays
            else bind(merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
        )
        row["bound_cupy_us"] = _host_us_per_call(bound)
        c_out, c_a, c_b = (cupy.empty((tokens, heads, head_size), cupy.float16) for _ in range(3))
        row["add_cupy_us"] = _host_us_per_call(lambda: cupy.add(c_a, c_b, out=c_out))
    return row


COLUMNS = [
    ("tokens", "{:>6}"), ("heads", "{:>5}"), ("head_size", "{:>4}"), ("dtype", "{:<8}"), ("mbytes", "{:>8.1f}"),
    ("merge_us", "{:>9.1f}"), ("copy_us", "{:>9.1f}"), ("pct_of_copy", "{:>6.1f}"), ("merge_gbps", "{:>6.0f}"),
    ("torch_us", "{:>9.1f}"), ("compiled_us", "{:>11.1f}"), ("graph_us", "{:>9.1f}"), ("host_cupy_us", "{:>7.1f}"), ("host_torch_us", "{:>7.1f}"),
    ("bound_cupy_us", "{:>7.1f}"), ("bound_torch_us", "{:>7.1f}"), ("add_cupy_us", "{:>7.1f}"),
    ("add_torch_us", "{:>7.1f}"), ("alloc_torch_us", "{:>7.1f}"), ("add_alloc_torch_us", "{:>7.1f}"),
]  # fmt: skip


def _torch_eager_many(torch, v, s):
    """The N-way formula in eager torch: ``v`` [N, T, H, D], ``s`` [N, H, T]."""
    lse_max = s.amax(0)
    weights = torch.exp(s - lse_max)
    total = weights.sum(0)
    out = torch.einsum("nht,nthd->thd", weights / total, v.float())
    return out.to(v.dtype), lse_max + torch.log(total)


def _random(shape, torch, dtype="bfloat16", scale=1.0):
    if torch is not None:
        return torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) * scale
    return (
        cupy.random.standard_normal(shape, dtype=cupy.float32).astype(
            "float16" if dtype == "bfloat16" else dtype
        )
        * scale
    )


def run_many_case(states, tokens, heads, head_size, torch, ragged=False) -> dict:
    """One N-way (or ragged, ``states`` then being the mean per token) merge against the copy ceiling."""
    row = {
        "kind": "ragged" if ragged else "dense",
        "states": states,
        "tokens": tokens,
        "heads": heads,
        "head_size": head_size,
    }
    if ragged:
        counts = numpy.random.default_rng(0).integers(0, 2 * states + 1, size=tokens)
        indptr_host = numpy.concatenate([[0], numpy.cumsum(counts)])
        total = int(indptr_host[-1])
        v, s = _random((total, heads, head_size), torch), _random((heads, total), torch, "float32", 4.0)
        indptr = (
            torch.as_tensor(indptr_host, device="cuda") if torch is not None else cupy.asarray(indptr_host)
        )
        stored_states = total
    else:
        v, s = (
            _random((states, tokens, heads, head_size), torch),
            _random((states, heads, tokens), torch, "float32", 4.0),
        )
        stored_states = states * tokens
    out, out_lse = _random((tokens, heads, head_size), torch), _random((heads, tokens), torch, "float32")
    itemsize = 2
    traffic = (stored_states * heads * (head_size * itemsize + 4)) + tokens * heads * (
        head_size * itemsize + 4
    )
    row["mbytes"] = traffic / 1e6
    if ragged:
        row["merge_us"] = (
            median_ms(lambda: merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, check_indptr=False))
            * 1e3
        )
    else:
        row["merge_us"] = median_ms(lambda: merge_states(v, s, out=out, out_lse=out_lse)) * 1e3

        def chained():
            merge_attn_states(out, v[0], s[0], v[1], s[1], out_lse)
            for i in range(2, states):
                merge_attn_states(out, out, out_lse, v[i], s[i], out_lse)

        row["chained_us"] = median_ms(chained) * 1e3
        if torch is not None:
            row["torch_us"] = median_ms(lambda: _torch_eager_many(torch, v, s)) * 1e3
    copy_src = cupy.empty(traffic // 2, dtype=cupy.uint8)
    copy_dst = cupy.empty_like(copy_src)
    row["copy_us"] = median_ms(lambda: copy_dst.__setitem__(Ellipsis, copy_src)) * 1e3
    row["merge_gbps"] = traffic / row["merge_us"] / 1e3
    row["pct_of_copy"] = 100 * row["copy_us"] / row["merge_us"]
    return row


MANY_COLUMNS = [
    ("kind", "{:<6}"), ("states", "{:>6}"), ("tokens", "{:>6}"), ("heads", "{:>5}"), ("head_size", "{:>4}"),
    ("mbytes", "{:>8.1f}"), ("merge_us", "{:>9.1f}"), ("copy_us", "{:>9.1f}"), ("pct_of_copy", "{:>6.1f}"),
    ("merge_gbps", "{:>6.0f}"), ("chained_us", "{:>10.1f}"), ("torch_us", "{:>9.1f}"),
]  # fmt: skip


_QUANTISE = r"""
#include "fp8.cuh"
using namespace cupy_merge;
extern "C" __global__ void quantise(const bfloat16_t* in, fp8_e4m3_t* out, const float* scale, long long packs) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= packs) return;
  const Pack<bfloat16_t, 8> x = load_pack(reinterpret_cast<const Pack<bfloat16_t, 8>*>(in) + i);
  float values[8];
  for (int k = 0; k < 8; ++k) values[k] = to_float(x.v[k]);
  store_pack(reinterpret_cast<Pack<fp8_e4m3_t, 8>*>(out) + i, output_pack<fp8_e4m3_t>(values, 1.0f / *scale));
}
"""


def _quantiser():
    """A one-pass bfloat16 -> FP8 quantisation (16-byte loads, one thread per 8 elements)."""
    from .._kernels import with_includes

    return cupy.RawModule(code=with_includes(_QUANTISE), options=("-std=c++17",)).get_function("quantise")


def run_fp8_case(tokens, heads, head_size, torch, quantise) -> dict:
    """A merge of two bfloat16 states into FP8: fused (per-tensor, per-group) against unfused."""
    shape = (tokens, heads, head_size)
    v_a, v_b = (
        cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy_dtype("bfloat16"))
        for _ in range(2)
    )
    s_a, s_b = (cupy.random.standard_normal((heads, tokens), dtype=cupy.float32) * 4 for _ in range(2))
    out_lse = cupy.empty((heads, tokens), cupy.float32)
    out8 = cupy.empty(shape, cupy.uint8)
    out16 = cupy.empty_like(v_a)
    scale = cupy.array([0.02], cupy.float32)
    group_scales = cupy.empty((tokens, heads * head_size // 128), cupy.float32)
    elements = tokens * heads * head_size
    traffic = elements * (2 + 2 + 1) + tokens * heads * 12
    row = {"tokens": tokens, "heads": heads, "head_size": head_size, "mbytes": traffic / 1e6}
    row["fused_us"] = (
        median_ms(lambda: merge_attn_states(out8, v_a, s_a, v_b, s_b, out_lse, None, scale)) * 1e3
    )
    row["fused_group_us"] = median_ms(
        lambda: merge_attn_states(out8, v_a, s_a, v_b, s_b, out_lse, output_block_scale=group_scales,
                                  quant_group_size=128)
    ) * 1e3  # fmt: skip
    packs = elements // 8
    grid = (-(-packs // 256),)

    def unfused():
        merge_attn_states(out16, v_a, s_a, v_b, s_b, out_lse)
        quantise(grid, (256,), (out16, out8, scale, numpy.int64(packs)))

    row["bf16_us"] = median_ms(lambda: merge_attn_states(out16, v_a, s_a, v_b, s_b, out_lse)) * 1e3
    row["unfused_us"] = median_ms(unfused) * 1e3
    if torch is not None and hasattr(torch, "float8_e4m3fn"):
        t16, t_a, t_b = (torch.from_dlpack(x) for x in (out16, v_a, v_b))
        t_sa, t_sb, t_lse, t_scale = (torch.from_dlpack(x) for x in (s_a, s_b, out_lse, scale))

        def torch_unfused():
            merge_attn_states(t16, t_a, t_sa, t_b, t_sb, t_lse)
            (t16.float() / t_scale).clamp_(-448, 448).to(torch.float8_e4m3fn)

        row["torch_unfused_us"] = median_ms(torch_unfused) * 1e3
    copy_src = cupy.empty(traffic // 2, dtype=cupy.uint8)
    copy_dst = cupy.empty_like(copy_src)
    row["copy_us"] = median_ms(lambda: copy_dst.__setitem__(Ellipsis, copy_src)) * 1e3
    row["pct_of_copy"] = 100 * row["copy_us"] / row["fused_us"]
    row["group_pct_of_copy"] = 100 * row["copy_us"] / row["fused_group_us"]
    row["unfused_over_fused"] = row["unfused_us"] / row["fused_us"]
    return row


FP8_COLUMNS = [
    ("tokens", "{:>6}"), ("heads", "{:>5}"), ("head_size", "{:>4}"), ("mbytes", "{:>8.1f}"),
    ("fused_us", "{:>9.1f}"), ("fused_group_us", "{:>9.1f}"), ("copy_us", "{:>9.1f}"), ("pct_of_copy", "{:>6.1f}"),
    ("group_pct_of_copy", "{:>6.1f}"), ("bf16_us", "{:>9.1f}"), ("unfused_us", "{:>9.1f}"),
    ("unfused_over_fused", "{:>5.2f}"), ("torch_unfused_us", "{:>9.1f}"),
]  # fmt: skip


def format_table(rows: list[dict], columns=None) -> str:
    """Right-aligned columns, each as wide as its name or its widest cell."""
    columns = columns or COLUMNS
    table = [[name for name, _ in columns]]
    for row in rows:
        table.append([fmt.format(row[name]) if row.get(name) is not None else "-" for name, fmt in columns])
    widths = [max(len(line[i].strip()) for line in table) for i in range(len(columns))]
    return "\n".join(
        " ".join(f"{cell.strip():>{width}}" for cell, width in zip(line, widths)) for line in table
    )


def _write(rows: list[dict], path: str) -> None:
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        return
    names = list(dict.fromkeys(name for name, _ in COLUMNS + MANY_COLUMNS + FP8_COLUMNS))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    mb = [r["mbytes"] for r in rows]
    left.scatter(mb, [r["merge_gbps"] for r in rows], label="merge")
    left.scatter(mb, [r["mbytes"] * 1e3 / r["copy_us"] for r in rows], marker="x", label="same-bytes copy")
    left.set(xscale="log", xlabel="traffic (MB)", ylabel="GB/s", title="achieved bandwidth")
    left.legend()
    right.scatter(mb, [r["pct_of_copy"] for r in rows])
    right.axhline(100, color="grey", lw=0.5)
    right.set(xscale="log", xlabel="traffic (MB)", ylabel="% of copy speed", title="merge vs copy ceiling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_merge.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="time the cross-rank strategies (run under torchrun, one rank per GPU)",
    )
    parser.add_argument("--out", help="write the rows to FILE.csv or FILE.json")
    parser.add_argument("--plot", help="write a PNG of GB/s and %% of copy speed against size")
    args = parser.parse_args(argv)
    if args.distributed:
        from . import bench_distributed

        return bench_distributed.main()
    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    torch = _torch()
    cases: list[tuple[int, int, int, str]] = [
        (*c, "bfloat16") for c in (QUICK_CASES if args.quick else DEFAULT_CASES)
    ]
    if not args.quick:
        cases += EXTRA_DTYPE_CASES
    if torch is None:
        cases = [c for c in cases if c[3] != "bfloat16"] or [(*c[:3], "float16") for c in cases]
    many: list[tuple[int, int, int, int, bool]] = [
        (*c, False) for c in (QUICK_MANY_CASES if args.quick else MANY_CASES)
    ]
    many += [(*c, True) for c in RAGGED_CASES[: 1 if args.quick else None]]
    fp8_cases = QUICK_FP8_CASES if args.quick else FP8_CASES
    total = len(cases) + len(many) + len(fp8_cases)
    rows, many_rows, fp8_rows = [], [], []
    for index, case in enumerate(cases, 1):
        _progress(index, total, case)
        tokens, heads, head_size, dtype = case
        rows.append(run_case(tokens, heads, head_size, dtype, torch, compile_torch=not args.no_compile))
    for index, many_case in enumerate(many, len(cases) + 1):
        _progress(index, total, many_case)
        states, tokens, heads, head_size, ragged = many_case
        many_rows.append(run_many_case(states, tokens, heads, head_size, torch, ragged=ragged))
        _release_memory(torch)
    quantise = _quantiser()
    for index, fp8_case in enumerate(fp8_cases, len(cases) + len(many) + 1):
        _progress(index, total, fp8_case)
        fp8_rows.append(run_fp8_case(*fp8_case, torch, quantise))
        _release_memory(torch)
    print(file=sys.stderr)
    print(format_table(rows))
    print()
    print(format_table(many_rows, MANY_COLUMNS))
    print()
    print(format_table(fp8_rows, FP8_COLUMNS))
    if args.out:
        _write(rows + many_rows + fp8_rows, args.out)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _release_memory(torch) -> None:
    """Return the case's buffers to the device so the next, larger case fits beside the L2 flush."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _progress(index: int, total: int, case) -> None:
    width = 30
    done = width * (index - 1) // total
    bar = "#" * done + "." * (width - done)
    print(f"\r[{bar}] {index}/{total} {case}   ", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
