"""python -m cupy_merge.bench: every merge of the library against a copy of the same bytes, in one table.

Each row is one case (cupy_merge/tools/bench_cases.py lists them): two-way, N-way and ragged
merges, FP8 outputs (per-tensor and group scales), the same with attention sinks, and the
gradients. All times are CUDA-event medians in microseconds, after warm-up, with the L2 flushed
before each repetition (cupy_merge/tools/timing.py), measured in one run:

  merge_us         this library, native layout (the gradients as autograd calls them: allocating,
                   given the merge's results out and out_lse)
  copy_us          a device-to-device copy moving the same bytes (read + write): the ceiling
  pct_of_copy      100 * copy_us / merge_us;  gbps: bytes moved / merge_us;  mbytes: the bytes
  torch_us         the same formula in eager torch, where there is one (FP8: and its quantisation)
  compiled_us      that formula through torch.compile (two-way; --no-compile skips it)
  graph_us         the merge replayed from a torch CUDA graph (two-way): no host cost
  chained_us       an N-way merge as chained two-way merges (up to 64 states)
  unfused_us       FP8: a merge to bfloat16, then a separate one-pass per-tensor quantisation
  baseline_us      sinks rows: the same merge without sinks, timed alternately with it; gradient
                   rows: the gradients without the merge's results (S recomputed from the LSEs)
  overhead_pct     100 * (merge_us - baseline_us) / baseline_us, the sinks' cost (gradients: below 0,
                   what the merge's results save)
  flashinfer_us    with --flashinfer: FlashInfer's kernel on its own layout (token-major, base-2 LSE)
  cm_fi_layout_us  this library on FlashInfer's layout (strided views, lse_base=2)
  fi_over_cm       flashinfer_us / the better of merge_us and cm_fi_layout_us: above 1, ours is faster
  maxdiff          the largest |FlashInfer - ours| of the merged values, checked once a case

A second table gives host time per call (no synchronisation; batches of 256 calls, fewer than
the launch queue holds; the median batch) at decode sizes: merge_attn_states on CuPy arrays
and torch tensors (host_*), a merge bound once with cupy_merge.bind (bound_*), merge_state
allocating (alloc_torch_us), and the yardsticks cupy.add / torch.add, into out= and allocating.

--flashinfer alone times the installed flashinfer package's merge_state, merge_states and
variable_length_merge_states (as a user calls them: allocating their results). --flashinfer DIR
instead builds FlashInfer's header-only merge kernels from a source tree (DIR/include) with nvcc,
through a small C shim this package writes out (cupy_merge/tools/bench_flashinfer.py), into a
temporary library loaded with ctypes; it needs torch and nvcc. No FlashInfer code is part of this
package. Without --flashinfer the FlashInfer columns are '-'.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cupy
import numpy

from .. import (
    bind,
    merge_attn_states,
    merge_state,
    merge_state_backward,
    merge_states,
    merge_states_backward,
    merge_states_varlen,
    merge_states_varlen_backward,
)
from .._arrays import cupy_dtype
from .._version import __version__
from ..invariance import batch_invariant
from .bench_cases import (
    FAMILIES,
    FP8_GROUP,
    HOST,
    Case,
    all_cases,
    flashinfer_supports,
    host_cases,
    ragged_indptr,
    traffic_bytes,
)
from .bench_cases import select as select_cases
from .bench_flashinfer import (
    CASCADE_HEADER,
    HOW_TO_GET,
    FlashInferMerges,
    from_package,
    from_source_tree,
    is_source_tree,
)
from .timing import copy_us, host_us_per_call, median_ms

# ---------------------------------------------------------------------------------------------
# Rows and tables (pure)


def _time(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:.0f}"


def _mbytes(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}"


#: The merge table: (column, formatter); every row has these keys or lacks them ('-').
COLUMNS: list[tuple[str, Callable[[Any], str]]] = [
    ("family", str), ("case", str), ("mbytes", _mbytes),
    ("merge_us", _time), ("copy_us", _time), ("pct_of_copy", "{:.1f}".format), ("gbps", "{:.0f}".format),
    ("torch_us", _time), ("compiled_us", _time), ("graph_us", _time), ("chained_us", _time),
    ("unfused_us", _time), ("baseline_us", _time), ("overhead_pct", "{:+.1f}".format),
    ("flashinfer_us", _time), ("cm_fi_layout_us", _time), ("fi_over_cm", "{:.2f}".format),
    ("maxdiff", "{:.1e}".format), ("invariant_us", _time), ("invariant_cost_pct", "{:+.1f}".format),
]  # fmt: skip
#: The host-cost table (microseconds of host time per call).
HOST_COLUMNS: list[tuple[str, Callable[[Any], str]]] = [
    ("case", str), ("host_cupy_us", _time), ("host_torch_us", _time), ("bound_cupy_us", _time),
    ("bound_torch_us", _time), ("alloc_torch_us", _time), ("add_cupy_us", _time), ("add_torch_us", _time),
    ("add_alloc_torch_us", _time),
]  # fmt: skip
_TEXT_COLUMNS = {"family", "case"}


def overhead_pct(with_us: float, without_us: float) -> float:
    """The added time in percent: ``100 * (with_us - without_us) / without_us``."""
    return 100 * (with_us - without_us) / without_us


def finish_row(row: dict) -> dict:
    """Add the derived columns (pct_of_copy, gbps, overhead_pct, fi_over_cm) to a row of times."""
    merge_us = row.get("merge_us")
    if merge_us:
        if row.get("copy_us"):
            row["pct_of_copy"] = 100 * row["copy_us"] / merge_us
        row["gbps"] = row["mbytes"] * 1e6 / merge_us / 1e3
        if row.get("baseline_us"):
            row["overhead_pct"] = overhead_pct(merge_us, row["baseline_us"])
        if row.get("flashinfer_us"):
            ours = min(t for t in (merge_us, row.get("cm_fi_layout_us")) if t)
            row["fi_over_cm"] = row["flashinfer_us"] / ours
        if row.get("invariant_us"):
            row["invariant_cost_pct"] = overhead_pct(row["invariant_us"], merge_us)
    return row


def _cell(value: Any, fmt: Callable[[Any], str]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt(value)


def format_table(rows: list[dict], columns: list[tuple[str, Callable[[Any], str]]] | None = None) -> str:
    """A header line and one line per row; text columns left-aligned, numbers right; '-' where missing."""
    columns = COLUMNS if columns is None else columns
    table = [[name for name, _ in columns]]
    table += [[_cell(row.get(name), fmt) for name, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join(
        " ".join(
            f"{cell:<{width}}" if name in _TEXT_COLUMNS else f"{cell:>{width}}"
            for cell, width, (name, _) in zip(line, widths, columns)
        ).rstrip()
        for line in table
    )


def cuda_version_string(version: int) -> str:
    """CUDA's integer version (12080) as ``12.8``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def environment_line(env: dict) -> str:
    """One line: date, GPU, driver, CUDA runtime and the versions of cupy, torch and cupy-merge."""
    return (
        f"{env.get('date', '?')} | {env.get('gpu', '?')} | driver {env.get('driver', '?')} | "
        f"CUDA runtime {env.get('cuda_runtime', '?')} | cupy {env.get('cupy', '?')} | "
        f"torch {env.get('torch', 'not installed')} | cupy-merge {env.get('cupy_merge', '?')}"
        + (f" | {env['flashinfer']}" if env.get("flashinfer") else "")
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` prints this module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m cupy_merge.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a few cases of each family only")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument(
        "--only",
        metavar="FAMILIES",
        type=_families,
        help=f"comma-separated families to run, of: {', '.join(FAMILIES + (HOST,))}",
    )
    parser.add_argument(
        "--flashinfer",
        metavar="DIR",
        nargs="?",
        const="",
        help="time FlashInfer beside: the installed flashinfer package, or with DIR a FlashInfer source "
        "tree whose include/ is built with nvcc (needs torch)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="time the cross-rank strategies instead (run under torchrun, one rank per GPU)",
    )
    parser.add_argument(
        "--invariant",
        action="store_true",
        help="time each merge in batch-invariant mode too (cupy_merge.batch_invariant): its cost in %%",
    )
    parser.add_argument("--out", metavar="FILE", help="write the rows to FILE.csv or FILE.json")
    parser.add_argument(
        "--plot", metavar="FILE", help="write a PNG of %% of copy (and FI/cm) against traffic"
    )
    return parser


def _families(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES + (HOST,)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown families {unknown or [text]}; expected some of {', '.join(FAMILIES + (HOST,))}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a bad option exits with status 2."""
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Inputs and timers


@dataclass
class Context:
    """What every case's measurement needs: torch (None without it), FlashInfer, options."""

    torch: Any = None
    flashinfer: FlashInferMerges | None = None
    compile_torch: bool = True
    quantise: Any = None
    invariant: bool = False


LOG2_E = 1 / math.log(2)
#: A FlashInfer / cupy-merge difference above this (bfloat16 steps are 1/64 at 2..4) is reported.
MAXDIFF_WARNING = 0.125


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _randn(ctx: Context, shape, dtype: str = "bfloat16", scale: float = 1.0):
    """Random normal values: a torch tensor when torch is there, else a CuPy array."""
    if ctx.torch is not None:
        return (
            ctx.torch.randn(shape, device="cuda", dtype=ctx.torch.float32)
            .mul_(scale)
            .to(getattr(ctx.torch, dtype))
        )
    return (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).astype(cupy_dtype(dtype))


def _empty(ctx: Context, shape, dtype: str = "bfloat16"):
    if ctx.torch is not None:
        return ctx.torch.empty(shape, device="cuda", dtype=getattr(ctx.torch, dtype))
    return cupy.empty(shape, dtype=cupy_dtype(dtype))


def _device_indptr(ctx: Context, case: Case):
    host = ragged_indptr(case.states, case.tokens)
    return ctx.torch.as_tensor(host, device="cuda") if ctx.torch is not None else cupy.asarray(host)


def _us(run: Callable[[], object]) -> float:
    """Median microseconds of ``run()`` (CUDA events, L2 flushed)."""
    return median_ms(run) * 1e3


def _paired_us(a: Callable[[], object], b: Callable[[], object], rounds: int = 3) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` timed alternately, ``rounds`` times each: drift hits both alike."""
    times_a, times_b = [], []
    for _ in range(rounds):
        times_a.append(_us(a))
        times_b.append(_us(b))
    return statistics.median(times_a), statistics.median(times_b)


# ---------------------------------------------------------------------------------------------
# FlashInfer beside (optional)


def _flashinfer_columns(torch, fi_run, cm_call, cm_out) -> dict:
    """FlashInfer and ours on its layout: checked against each other once, then timed."""
    fi_out = fi_run()
    cm_call()
    torch.cuda.synchronize()
    maxdiff = (cm_out.float() - fi_out.float()).abs().max().item()
    return {"flashinfer_us": _us(fi_run), "cm_fi_layout_us": _us(cm_call), "maxdiff": maxdiff}


def _with_flashinfer(
    ctx: Context, case: Case, row: dict, columns: Callable[[FlashInferMerges], dict]
) -> None:
    """Fill the FlashInfer columns of ``row`` where FlashInfer takes the case; a failure only blanks them."""
    if ctx.flashinfer is None or not flashinfer_supports(case):
        return
    try:
        row.update(columns(ctx.flashinfer))
    except Exception as error:  # noqa: BLE001 - FlashInfer's failure only blanks its columns
        print(f"\nFlashInfer, {case.label}: {type(error).__name__}: {error}", file=sys.stderr)
    if row.get("maxdiff", 0) > MAXDIFF_WARNING or math.isnan(row.get("maxdiff", 0)):
        print(
            f"\nFlashInfer and cupy-merge disagree on {case.label}: max |diff| {row['maxdiff']}",
            file=sys.stderr,
        )


def _fi_two_way(fi: FlashInferMerges, torch, v_a, s_a, v_b, s_b) -> dict:
    heads, tokens = s_a.shape
    sa, sb = ((s * LOG2_E).T.contiguous() for s in (s_a, s_b))  # [tokens, heads], base 2
    cm_out, cm_lse = torch.empty_like(v_a), torch.empty(heads, tokens, device="cuda")
    return _flashinfer_columns(
        torch,
        fi.two_way(v_a, sa, v_b, sb),
        lambda: merge_state(v_a, sa.T, v_b, sb.T, out=cm_out, out_lse=cm_lse, lse_base=2),
        cm_out,
    )


def _fi_n_way(fi: FlashInferMerges, torch, v, s) -> dict:
    tokens, heads, head_size = v.shape[1:]
    v_fi = v.transpose(0, 1).contiguous()  # [tokens, states, heads, head_size]
    s_fi = (s * LOG2_E).permute(2, 0, 1).contiguous()  # [tokens, states, heads], base 2
    cm_out = torch.empty(tokens, heads, head_size, device="cuda", dtype=v.dtype)
    cm_lse = torch.empty(heads, tokens, device="cuda")
    return _flashinfer_columns(
        torch,
        fi.n_way(v_fi, s_fi),
        lambda: merge_states(
            v_fi.transpose(0, 1), s_fi.permute(1, 2, 0), out=cm_out, out_lse=cm_lse, lse_base=2
        ),
        cm_out,
    )


def _fi_ragged(fi: FlashInferMerges, torch, v, s, indptr, tokens: int) -> dict:
    heads, head_size = v.shape[1:]
    s_fi = (s * LOG2_E).T.contiguous()  # [rows, heads], base 2
    cm_out = torch.empty(tokens, heads, head_size, device="cuda", dtype=v.dtype)
    cm_lse = torch.empty(heads, tokens, device="cuda")
    return _flashinfer_columns(
        torch,
        fi.ragged(v, s_fi, indptr, tokens),
        lambda: merge_states_varlen(
            v, s_fi.T, indptr, out=cm_out, out_lse=cm_lse, lse_base=2, check_indptr=False
        ),
        cm_out,
    )


# ---------------------------------------------------------------------------------------------
# The families' measurements: each returns the row's times (merge_us and its extras)


def _torch_merge_float(torch, v_a, s_a, v_b, s_b):
    """The two-way formula in eager torch, float32 ``[tokens, heads, head_size]``."""
    lse = torch.logaddexp(s_a, s_b)
    w_a = torch.exp(s_a - lse).T.unsqueeze(-1)
    w_b = torch.exp(s_b - lse).T.unsqueeze(-1)
    return w_a * v_a.float() + w_b * v_b.float()


def _torch_eager(torch, out, v_a, s_a, v_b, s_b):
    out.copy_(_torch_merge_float(torch, v_a, s_a, v_b, s_b))


def _torch_eager_many(torch, v, s):
    """The N-way formula in eager torch: ``v`` [N, T, H, D], ``s`` [N, H, T]."""
    lse_max = s.amax(0)
    weights = torch.exp(s - lse_max)
    total = weights.sum(0)
    out = torch.einsum("nht,nthd->thd", weights / total, v.float())
    return out.to(v.dtype), lse_max + torch.log(total)


_compiled: dict[str, Any] = {}


def _torch_compiled_us(torch, out, v_a, s_a, v_b, s_b) -> float:
    """The eager formula through torch.compile (one compilation, dynamic shapes); NaN if it fails."""
    try:
        if "merge" not in _compiled:
            _compiled["merge"] = torch.compile(lambda *a: _torch_eager(torch, *a), dynamic=True)
        compiled = _compiled["merge"]
        return _us(lambda: compiled(out, v_a, s_a, v_b, s_b))
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
    return _us(graph.replay)


def _two_way_inputs(ctx: Context, case: Case):
    shape, lse_shape = (case.tokens, case.heads, case.head_size), (case.heads, case.tokens)
    v_a, v_b = (_randn(ctx, shape, case.dtype) for _ in range(2))
    s_a, s_b = (_randn(ctx, lse_shape, "float32", 4.0) for _ in range(2))
    return v_a, s_a, v_b, s_b


def _two_way(ctx: Context, case: Case) -> dict:
    v_a, s_a, v_b, s_b = _two_way_inputs(ctx, case)
    out, out_lse = _empty(ctx, v_a.shape, case.dtype), _empty(ctx, s_a.shape, "float32")

    def merge():
        merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)

    row = {"merge_us": _us(merge)}
    torch = ctx.torch
    if torch is not None:
        row["torch_us"] = _us(lambda: _torch_eager(torch, out, v_a, s_a, v_b, s_b))
        if ctx.compile_torch and _compiled.get("merge", True) is not None:
            row["compiled_us"] = _torch_compiled_us(torch, out, v_a, s_a, v_b, s_b)
        row["graph_us"] = _graph_us(torch, merge)
    _with_flashinfer(ctx, case, row, lambda fi: _fi_two_way(fi, ctx.torch, v_a, s_a, v_b, s_b))
    return row


def _two_way_sinks(ctx: Context, case: Case) -> dict:
    v_a, s_a, v_b, s_b = _two_way_inputs(ctx, case)
    out, out_lse = _empty(ctx, v_a.shape, case.dtype), _empty(ctx, s_a.shape, "float32")
    sinks = _randn(ctx, (case.heads,), "float32")
    with_sinks, without = _paired_us(
        lambda: merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, sinks=sinks),
        lambda: merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
    )
    return {"merge_us": with_sinks, "baseline_us": without}


def _two_way_backward(ctx: Context, case: Case) -> dict:
    v_a, s_a, v_b, s_b = _two_way_inputs(ctx, case)
    grad_v, grad_s = _randn(ctx, v_a.shape, case.dtype), _randn(ctx, s_a.shape, "float32")
    out, out_lse = merge_state(v_a, s_a, v_b, s_b)
    given, recomputed = _paired_us(
        lambda: merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s, out=out, out_lse=out_lse),
        lambda: merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s),
    )
    return {"merge_us": given, "baseline_us": recomputed}


def _n_way_inputs(ctx: Context, case: Case):
    v = _randn(ctx, (case.states, case.tokens, case.heads, case.head_size), case.dtype)
    s = _randn(ctx, (case.states, case.heads, case.tokens), "float32", 4.0)
    return v, s


def _n_way(ctx: Context, case: Case) -> dict:
    v, s = _n_way_inputs(ctx, case)
    out, out_lse = _empty(ctx, v.shape[1:], case.dtype), _empty(ctx, s.shape[1:], "float32")
    row = {"merge_us": _us(lambda: merge_states(v, s, out=out, out_lse=out_lse))}
    if case.states <= 64:

        def chained():
            merge_attn_states(out, v[0], s[0], v[1], s[1], out_lse)
            for i in range(2, case.states):
                merge_attn_states(out, out, out_lse, v[i], s[i], out_lse)

        row["chained_us"] = _us(chained)
    if ctx.torch is not None:
        row["torch_us"] = _us(lambda: _torch_eager_many(ctx.torch, v, s))
    _with_flashinfer(ctx, case, row, lambda fi: _fi_n_way(fi, ctx.torch, v, s))
    return row


def _n_way_sinks(ctx: Context, case: Case) -> dict:
    v, s = _n_way_inputs(ctx, case)
    out, out_lse = _empty(ctx, v.shape[1:], case.dtype), _empty(ctx, s.shape[1:], "float32")
    sinks = _randn(ctx, (case.heads,), "float32")
    with_sinks, without = _paired_us(
        lambda: merge_states(v, s, out=out, out_lse=out_lse, sinks=sinks),
        lambda: merge_states(v, s, out=out, out_lse=out_lse),
    )
    return {"merge_us": with_sinks, "baseline_us": without}


def _n_way_backward(ctx: Context, case: Case) -> dict:
    v, s = _n_way_inputs(ctx, case)
    grad_v, grad_s = _randn(ctx, v.shape[1:], case.dtype), _randn(ctx, s.shape[1:], "float32")
    out, out_lse = merge_states(v, s)
    given, recomputed = _paired_us(
        lambda: merge_states_backward(v, s, grad_v, grad_s, out=out, out_lse=out_lse),
        lambda: merge_states_backward(v, s, grad_v, grad_s),
    )
    return {"merge_us": given, "baseline_us": recomputed}


def _ragged_inputs(ctx: Context, case: Case):
    v = _randn(ctx, (case.rows, case.heads, case.head_size), case.dtype)
    s = _randn(ctx, (case.heads, case.rows), "float32", 4.0)
    return v, s, _device_indptr(ctx, case)


def _ragged(ctx: Context, case: Case) -> dict:
    v, s, indptr = _ragged_inputs(ctx, case)
    out = _empty(ctx, (case.tokens, case.heads, case.head_size), case.dtype)
    out_lse = _empty(ctx, (case.heads, case.tokens), "float32")
    row = {
        "merge_us": _us(
            lambda: merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, check_indptr=False)
        )
    }
    _with_flashinfer(ctx, case, row, lambda fi: _fi_ragged(fi, ctx.torch, v, s, indptr, case.tokens))
    return row


def _ragged_sinks(ctx: Context, case: Case) -> dict:
    v, s, indptr = _ragged_inputs(ctx, case)
    out = _empty(ctx, (case.tokens, case.heads, case.head_size), case.dtype)
    out_lse = _empty(ctx, (case.heads, case.tokens), "float32")
    sinks = _randn(ctx, (case.heads,), "float32")
    with_sinks, without = _paired_us(
        lambda: merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, check_indptr=False, sinks=sinks),
        lambda: merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, check_indptr=False),
    )
    return {"merge_us": with_sinks, "baseline_us": without}


def _ragged_backward(ctx: Context, case: Case) -> dict:
    v, s, indptr = _ragged_inputs(ctx, case)
    grad_v = _randn(ctx, (case.tokens, case.heads, case.head_size), case.dtype)
    grad_s = _randn(ctx, (case.heads, case.tokens), "float32")
    out, out_lse = merge_states_varlen(v, s, indptr, check_indptr=False)
    given, recomputed = _paired_us(
        lambda: merge_states_varlen_backward(v, s, indptr, grad_v, grad_s, out=out, out_lse=out_lse),
        lambda: merge_states_varlen_backward(v, s, indptr, grad_v, grad_s),
    )
    return {"merge_us": given, "baseline_us": recomputed}


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


def _torch_fp8(torch, v_a, s_a, v_b, s_b, scale, group: bool):
    """The merge and its FP8 quantisation in eager torch: per-tensor ``scale`` or per-group amax scales."""
    merged = _torch_merge_float(torch, v_a, s_a, v_b, s_b)
    if not group:
        return (merged / scale).clamp_(-448, 448).to(torch.float8_e4m3fn)
    groups = merged.reshape(merged.shape[0], -1, FP8_GROUP)
    scales = groups.abs().amax(-1, keepdim=True).clamp_min_(1e-12) / 448
    return (groups / scales).to(torch.float8_e4m3fn), scales


def _fp8(ctx: Context, case: Case) -> dict:
    """Two bfloat16 states merged into FP8 (CuPy arrays): fused, unfused, and torch's way."""
    tokens, heads, head_size = case.tokens, case.heads, case.head_size
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
    group = case.family == "fp8-group"
    if group:
        group_scales = cupy.empty((tokens, heads * head_size // FP8_GROUP), cupy.float32)
        row = {"merge_us": _us(lambda: merge_attn_states(
            out8, v_a, s_a, v_b, s_b, out_lse, output_block_scale=group_scales, quant_group_size=FP8_GROUP
        ))}  # fmt: skip
    else:
        row = {"merge_us": _us(lambda: merge_attn_states(out8, v_a, s_a, v_b, s_b, out_lse, None, scale))}
    packs = tokens * heads * head_size // 8
    grid = (-(-packs // 256),)

    def unfused():
        merge_attn_states(out16, v_a, s_a, v_b, s_b, out_lse)
        ctx.quantise(grid, (256,), (out16, out8, scale, numpy.int64(packs)))

    row["unfused_us"] = _us(unfused)
    torch = ctx.torch
    if torch is not None and hasattr(torch, "float8_e4m3fn"):
        t_a, t_b, t_sa, t_sb, t_scale = (torch.from_dlpack(x) for x in (v_a, v_b, s_a, s_b, scale))
        row["torch_us"] = _us(lambda: _torch_fp8(torch, t_a, t_sa, t_b, t_sb, t_scale, group))
    return row


#: Each family's measurement.
RUNNERS: dict[str, Callable[[Context, Case], dict]] = {
    "two-way": _two_way,
    "n-way": _n_way,
    "ragged": _ragged,
    "fp8": _fp8,
    "fp8-group": _fp8,
    "two-way+sinks": _two_way_sinks,
    "n-way+sinks": _n_way_sinks,
    "ragged+sinks": _ragged_sinks,
    "two-way-bwd": _two_way_backward,
    "n-way-bwd": _n_way_backward,
    "ragged-bwd": _ragged_backward,
}


def run_case(ctx: Context, case: Case) -> dict:
    """One row: the family's times, then the same-bytes copy, then the derived columns.

    A failure is reported on stderr and leaves the row's times '-'.
    """
    traffic = traffic_bytes(case)
    row: dict[str, Any] = {"family": case.family, "case": case.label, "mbytes": traffic / 1e6}
    try:
        row.update(RUNNERS[case.family](ctx, case))
        if ctx.invariant:  # the merge alone again, planned batch-invariantly
            plain = dataclasses.replace(ctx, flashinfer=None, compile_torch=False)
            with batch_invariant():
                row["invariant_us"] = RUNNERS[case.family](plain, case)["merge_us"]
        row["copy_us"] = copy_us(traffic)
    except Exception as error:  # noqa: BLE001 - one case's failure is reported, the others still run
        print(f"\n{case.family} {case.label} failed: {type(error).__name__}: {error}", file=sys.stderr)
    cupy.cuda.runtime.deviceSynchronize()
    return finish_row(row)


# ---------------------------------------------------------------------------------------------
# Host cost per call


def run_host_case(ctx: Context, case: Case) -> dict:
    """Host microseconds per call of a two-way merge: CuPy and torch, eager, bound, allocating; yardsticks."""
    v_a, s_a, v_b, s_b = _two_way_inputs(ctx, case)
    out, out_lse = _empty(ctx, v_a.shape, case.dtype), _empty(ctx, s_a.shape, "float32")
    arguments = (out, v_a, s_a, v_b, s_b, out_lse)
    row: dict[str, Any] = {"case": case.label}
    torch = ctx.torch
    if torch is not None:
        row["host_torch_us"] = host_us_per_call(lambda: merge_attn_states(*arguments))
        row["bound_torch_us"] = host_us_per_call(bind(merge_attn_states, *arguments))
        row["alloc_torch_us"] = host_us_per_call(lambda: merge_state(v_a, s_a, v_b, s_b))
        # The yardsticks: one elementwise op of torch's on the same tensors, into out and allocating.
        row["add_torch_us"] = host_us_per_call(lambda: torch.add(v_a, v_b, out=out))
        row["add_alloc_torch_us"] = host_us_per_call(lambda: torch.add(v_a, v_b))
        arguments = tuple(cupy.from_dlpack(x) for x in arguments)
    row["host_cupy_us"] = host_us_per_call(lambda: merge_attn_states(*arguments))
    row["bound_cupy_us"] = host_us_per_call(bind(merge_attn_states, *arguments))
    c_out, c_a, c_b = (cupy.empty(v_a.shape, cupy.float16) for _ in range(3))
    row["add_cupy_us"] = host_us_per_call(lambda: cupy.add(c_a, c_b, out=c_out))
    return row


# ---------------------------------------------------------------------------------------------
# Environment, output files, plot


def _nvidia_driver() -> str | None:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]
        done = subprocess.run(query, check=False, capture_output=True, text=True, timeout=10)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Date, GPU, driver, CUDA runtime and versions, for the line above the table and the plot's title."""
    runtime = cupy.cuda.runtime
    device = cupy.cuda.Device()
    props = runtime.getDeviceProperties(device.id)
    driver_cuda = cuda_version_string(runtime.driverGetVersion())
    driver = _nvidia_driver()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "gpu": f"{props['name'].decode()} (sm_{device.compute_capability})",
        "driver": f"{driver} (CUDA {driver_cuda})" if driver else f"CUDA {driver_cuda}",
        "cuda_runtime": cuda_version_string(runtime.runtimeGetVersion()),
        "cupy": cupy.__version__,
        "torch": torch_version,
        "cupy_merge": __version__,
    }


def write_results(rows: list[dict], host_rows: list[dict], env: dict, path: str) -> None:
    """JSON: ``{"environment", "rows", "host"}``; CSV: one table, its ``table`` column ``merge`` or ``host``."""
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"environment": env, "rows": rows, "host": host_rows}, f, indent=1)
        return
    names = ["table"] + list(dict.fromkeys(name for name, _ in COLUMNS + HOST_COLUMNS))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([{"table": "merge", **row} for row in rows])
        writer.writerows([{"table": "host", **row} for row in host_rows])


_MARKERS = "os^vD<>ph*Xd"


def plot(rows: list[dict], env: dict, path: str) -> bool:
    """% of copy against traffic (log x), a marker per family; FI/cm beside where measured. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'cupy-merge[bench]'): no plot", file=sys.stderr)
        return False
    with_fi = [r for r in rows if r.get("fi_over_cm")]
    fig, axes = plt.subplots(1, 2 if with_fi else 1, figsize=(13 if with_fi else 8, 5), squeeze=False)
    left = axes[0][0]
    for index, family in enumerate(FAMILIES):
        points = [
            (r["mbytes"], r["pct_of_copy"]) for r in rows if r["family"] == family and r.get("pct_of_copy")
        ]
        if points:
            left.scatter(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=family, alpha=0.8)
    left.axhline(100, color="grey", lw=0.5)
    left.set(xscale="log", xlabel="traffic (MB)", ylabel="% of same-bytes copy speed", title="merge vs copy")
    left.legend(fontsize="small", ncol=2)
    if with_fi:
        right = axes[0][1]
        for index, family in enumerate(FAMILIES):
            points = [(r["mbytes"], r["fi_over_cm"]) for r in with_fi if r["family"] == family]
            if points:
                right.scatter(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=family)
        right.axhline(1, color="grey", lw=0.5)
        right.set(xscale="log", xlabel="traffic (MB)", ylabel="FlashInfer time / cupy-merge time",
                  title="FlashInfer / cupy-merge (above 1: cupy-merge faster)")  # fmt: skip
        right.legend(fontsize="small")
    fig.suptitle(f"cupy-merge {env.get('cupy_merge')} on {env.get('gpu')}, {env.get('date')}; "
                 f"cupy {env.get('cupy')}, torch {env.get('torch')}", fontsize="medium")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# The command


def main(argv=None) -> int:
    """Run the benchmark (or, with --distributed, the cross-rank one); the exit status."""
    args = parse_args(argv)
    if args.distributed:
        from . import bench_distributed

        return bench_distributed.main()
    flashinfer = None
    if args.flashinfer == "":  # --flashinfer alone: the installed package, found before any GPU work
        flashinfer = from_package()
        if flashinfer is None:
            print(HOW_TO_GET, file=sys.stderr)
            return 2
    elif args.flashinfer is not None and not is_source_tree(args.flashinfer):
        print(f"--flashinfer: {args.flashinfer} is not a FlashInfer source tree (no {CASCADE_HEADER})\n"
              f"{HOW_TO_GET}", file=sys.stderr)  # fmt: skip
        return 2
    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    torch = _torch()
    ctx = Context(torch=torch, compile_torch=not args.no_compile, flashinfer=flashinfer, invariant=args.invariant)
    if args.flashinfer:
        ctx.flashinfer = from_source_tree(args.flashinfer, str(cupy.cuda.Device().compute_capability), torch)
    cases = select_cases(all_cases(args.quick), args.only)
    hosts = host_cases(args.quick) if args.only is None or HOST in args.only else []
    if any(case.kind == "fp8" for case in cases):
        ctx.quantise = _quantiser()
    env = environment()
    if ctx.flashinfer is not None:
        env["flashinfer"] = ctx.flashinfer.source
    total = len(cases) + len(hosts)
    rows: list[dict] = []
    host_rows: list[dict] = []
    try:
        for index, case in enumerate(cases, 1):
            _progress(index, total, case)
            rows.append(run_case(ctx, case))
            _release_memory(torch)
        for index, case in enumerate(hosts, len(cases) + 1):
            _progress(index, total, case)
            host_rows.append(run_host_case(ctx, case))
    except BaseException as error:  # a broken device or ^C: the rows measured so far are still shown
        print(f"\nstopped after {len(rows) + len(host_rows)} of {total} cases: {error!r}", file=sys.stderr)
        _report(rows, host_rows, env, args)
        raise
    print(file=sys.stderr)
    _report(rows, host_rows, env, args)
    return 0


def _report(rows: list[dict], host_rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """The environment line, the two tables, and the files asked for."""
    print(environment_line(env))
    if rows:
        print(format_table(rows))
    if host_rows:
        print("\nhost cost per call (us, no synchronisation)")
        print(format_table(host_rows, HOST_COLUMNS))
    if args.out:
        write_results(rows, host_rows, env, args.out)
    if args.plot and rows:
        plot(rows, env, args.plot)


def _release_memory(torch) -> None:
    """Return the case's buffers to the device so the next, larger case fits beside the L2 flush."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _progress(index: int, total: int, case: Case) -> None:
    width = 30
    done = width * (index - 1) // total
    bar = "#" * done + "." * (width - done)
    print(f"\r[{bar}] {index}/{total} {case.family} {case.label}   ", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
