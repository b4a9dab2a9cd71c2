"""``python -m cupy_merge.bench``: the merge against the same-bytes copy, torch, and host overhead.

For each case (bfloat16 unless named) it measures, in one run:

* ``merge_us``: this library's kernel, CUDA events, median, L2 flushed before each repetition;
* ``copy_us``: a device-to-device copy moving the same number of bytes (read + write), the ceiling;
* ``torch_us``: the same formula in eager torch, when torch is installed;
* ``graph_us``: the merge replayed from a CUDA graph (torch), which removes host cost;
* host overhead per call, without synchronisation, for CuPy arrays and torch tensors.

Usage: ``python -m cupy_merge.bench [--quick] [--out results.csv|.json] [--plot plot.png]``
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time

import cupy

from . import merge_attn_states
from ._timing import median_ms

DEFAULT_CASES = [
    (1, 32, 128), (16, 32, 128), (64, 32, 128), (256, 32, 128), (613, 16, 96),
    (1024, 32, 128), (4096, 32, 128), (8192, 32, 128), (16384, 32, 128), (32768, 32, 128),
    (4096, 128, 128), (8192, 128, 128), (4096, 32, 64), (4096, 32, 256), (8192, 16, 512),
]  # fmt: skip
EXTRA_DTYPE_CASES = [(4096, 32, 128, "float16"), (4096, 32, 128, "float32")]
QUICK_CASES = [(1, 32, 128), (64, 32, 128), (1024, 32, 128), (8192, 32, 128), (8192, 128, 128)]


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


def _host_us_per_call(call, repeat=2000) -> float:
    for _ in range(50):
        call()
    cupy.cuda.runtime.deviceSynchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    elapsed = time.perf_counter() - start
    cupy.cuda.runtime.deviceSynchronize()
    return elapsed / repeat * 1e6


def _torch_eager(torch, out, v_a, s_a, v_b, s_b):
    lse = torch.logaddexp(s_a, s_b)
    w_a = torch.exp(s_a - lse).T.unsqueeze(-1)
    w_b = torch.exp(s_b - lse).T.unsqueeze(-1)
    out.copy_(w_a * v_a.float() + w_b * v_b.float())


def _graph_us(torch, call) -> float:
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return median_ms(graph.replay) * 1e3


def run_case(tokens, heads, head_size, dtype, torch) -> dict:
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
        row["graph_us"] = _graph_us(torch, merge)
        row["host_torch_us"] = _host_us_per_call(merge) if tokens <= 64 else float("nan")
    if tokens <= 64:
        arrays = [cupy.from_dlpack(x) for x in (out, v_a, s_a, v_b, s_b, out_lse)] if torch else None
        row["host_cupy_us"] = _host_us_per_call(lambda: merge_attn_states(*arrays) if arrays else merge())
    return row


COLUMNS = [
    ("tokens", "{:>6}"), ("heads", "{:>5}"), ("head_size", "{:>4}"), ("dtype", "{:<8}"), ("mbytes", "{:>8.1f}"),
    ("merge_us", "{:>9.1f}"), ("copy_us", "{:>9.1f}"), ("pct_of_copy", "{:>6.1f}"), ("merge_gbps", "{:>6.0f}"),
    ("torch_us", "{:>9.1f}"), ("graph_us", "{:>9.1f}"), ("host_cupy_us", "{:>7.1f}"), ("host_torch_us", "{:>7.1f}"),
]  # fmt: skip


def format_table(rows: list[dict]) -> str:
    header = " ".join(
        f"{name:>{len(fmt.format(0) if 'f' in fmt else fmt.format('x'))}}" for name, fmt in COLUMNS
    )
    lines = [header]
    for row in rows:
        cells = []
        for name, fmt in COLUMNS:
            value = row.get(name)
            width = len(fmt.format(0) if "f" in fmt else fmt.format("x"))
            cells.append(fmt.format(value) if value is not None else f"{'-':>{width}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _write(rows: list[dict], path: str) -> None:
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        return
    names = [name for name, _ in COLUMNS]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--out", help="write the rows to FILE.csv or FILE.json")
    parser.add_argument("--plot", help="write a PNG of GB/s and %% of copy speed against size")
    args = parser.parse_args(argv)
    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    torch = _torch()
    cases = [(*c, "bfloat16") for c in (QUICK_CASES if args.quick else DEFAULT_CASES)]
    if not args.quick:
        cases += EXTRA_DTYPE_CASES
    if torch is None:
        cases = [c for c in cases if c[3] != "bfloat16"] or [(*c[:3], "float16") for c in cases]
    rows = []
    for index, case in enumerate(cases, 1):
        print(f"\r[{index}/{len(cases)}] {case}", end="", file=sys.stderr, flush=True)
        rows.append(run_case(*case, torch))
    print(file=sys.stderr)
    print(format_table(rows))
    if args.out:
        _write(rows, args.out)
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
