"""The benchmark's measurements on the GPU: one function a family (:data:`RUNNERS`), and the host cost.

:func:`run_case` times one case of the merge table (its family's runner, then, with
``--invariant``, the merge again batch-invariantly, then the same-bytes copy) and returns the
finished row; :func:`run_host_case` gives a row of the host-cost table. A :class:`Context` carries
what they share: torch (None without it), FlashInfer (``--flashinfer``), the options and the FP8
rows' separate quantisation (:func:`quantiser`). Inputs are torch tensors when torch is there,
else CuPy arrays; times come from cupy_merge/tools/timing.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
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
from ..invariance import batch_invariant
from .bench_cases import FP8_GROUP, Case, flashinfer_supports, ragged_indptr, traffic_bytes
from .bench_flashinfer import FlashInferMerges
from .bench_report import finish_row
from .timing import copy_us, host_us_per_call, median_ms

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


_QUANTISE_NVFP4 = r"""
#include "fp4.cuh"
using namespace cupy_merge;
// One thread a block of 16 values: two 16-byte loads, 8 bytes of codes and a scale byte written
// (the swizzled layout; its padding left as it is). The merge's recipe, without its NaN rule.
extern "C" __global__ void quantise_nvfp4(const bfloat16_t* in, unsigned char* out, unsigned char* scales,
                                          const float* global_scale, long long blocks, int blocks_per_row,
                                          int col_tiles) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= blocks) return;
  const Pack<bfloat16_t, 8>* from = reinterpret_cast<const Pack<bfloat16_t, 8>*>(in) + 2 * i;
  const Pack<bfloat16_t, 8> low = load_pack(from), high = load_pack(from + 1);
  float values[16];
  float amax = 0.0f;
  for (int k = 0; k < 8; ++k) {
    values[k] = to_float(low.v[k]);
    values[8 + k] = to_float(high.v[k]);
    amax = fmaxf(amax, fmaxf(fabsf(values[k]), fabsf(values[8 + k])));
  }
  const float per_tensor = __fdiv_rn(1.0f, *global_scale);
  const float scale = fminf(fmaxf(__fdiv_rn(__fdiv_rn(amax, kE2m1Max), per_tensor), kNvfp4ScaleFloor), kFp8Max);
  const unsigned char bits = from_float<fp8_e4m3_t>(scale).bits;
  const float reciprocal = __fdiv_rn(__fdiv_rn(1.0f, per_tensor), e4m3_value(bits));
  Pack<unsigned char, 8> codes;
  for (int k = 0; k < 8; ++k) {
    codes.v[k] = static_cast<unsigned char>(e2m1_code(values[2 * k], reciprocal) |
                                            (e2m1_code(values[2 * k + 1], reciprocal) << 4));
  }
  store_pack(reinterpret_cast<Pack<unsigned char, 8>*>(out) + i, codes);
  const int row = static_cast<int>(i / blocks_per_row), block = static_cast<int>(i % blocks_per_row);
  scales[((row >> 7) * col_tiles + (block >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (block & 3)] = bits;
}
"""


def quantiser():
    """A one-pass bfloat16 -> FP8 quantisation (16-byte loads, one thread per 8 elements)."""
    from .._kernels import with_includes

    return cupy.RawModule(code=with_includes(_QUANTISE), options=("-std=c++17",)).get_function("quantise")


@functools.cache
def nvfp4_quantiser():
    """A one-pass bfloat16 -> NVFP4 quantisation, swizzled scales (one thread per 16 elements)."""
    from .._kernels import with_includes

    module = cupy.RawModule(code=with_includes(_QUANTISE_NVFP4), options=("-std=c++17",))
    return module.get_function("quantise_nvfp4")


def _torch_fp8(torch, v_a, s_a, v_b, s_b, scale, group: bool):
    """The merge and its FP8 quantisation in eager torch: per-tensor ``scale`` or per-group amax scales."""
    merged = _torch_merge_float(torch, v_a, s_a, v_b, s_b)
    if not group:
        return (merged / scale).clamp_(-448, 448).to(torch.float8_e4m3fn)
    groups = merged.reshape(merged.shape[0], -1, FP8_GROUP)
    scales = groups.abs().amax(-1, keepdim=True).clamp_min_(1e-12) / 448
    return (groups / scales).to(torch.float8_e4m3fn), scales


def _quantised_case_arrays(case: Case) -> tuple:
    """A quantised-output case's two bfloat16 states, its LSE output and a bfloat16 output (the
    unfused way's merge): ``(v_a, s_a, v_b, s_b, out_lse, out16)``."""
    shape = (case.tokens, case.heads, case.head_size)
    v_a, v_b = (
        cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy_dtype("bfloat16")) for _ in range(2)
    )
    s_a, s_b = (cupy.random.standard_normal((case.heads, case.tokens), dtype=cupy.float32) * 4 for _ in range(2))
    return v_a, s_a, v_b, s_b, cupy.empty((case.heads, case.tokens), cupy.float32), cupy.empty_like(v_a)


def _fp8(ctx: Context, case: Case) -> dict:
    """Two bfloat16 states merged into FP8 (CuPy arrays): fused, unfused, and torch's way."""
    tokens, heads, head_size = case.tokens, case.heads, case.head_size
    shape = (tokens, heads, head_size)
    v_a, s_a, v_b, s_b, out_lse, out16 = _quantised_case_arrays(case)
    out8 = cupy.empty(shape, cupy.uint8)
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


def _nvfp4(ctx: Context, case: Case) -> dict:
    """Two bfloat16 states merged into NVFP4 (CuPy arrays, swizzled scales): fused, and a merge to
    bfloat16 followed by a separate one-pass NVFP4 quantisation."""
    tokens, heads, head_size = case.tokens, case.heads, case.head_size
    v_a, s_a, v_b, s_b, out_lse, out16 = _quantised_case_arrays(case)
    out4 = cupy.empty((tokens, heads, head_size // 2), cupy.uint8)
    blocks = heads * head_size // 16
    col_tiles = -(-blocks // 4)
    scales = cupy.zeros((-(-tokens // 128) * 128, col_tiles * 4), cupy.uint8)
    global_scale = cupy.array([448 * 6 / 5.0], cupy.float32)
    row = {"merge_us": _us(lambda: merge_attn_states(
        out4, v_a, s_a, v_b, s_b, out_lse, output_scale=global_scale, output_block_scale=scales
    ))}  # fmt: skip
    quantise, count = nvfp4_quantiser(), tokens * blocks
    arguments = (out16, out4, scales, global_scale, numpy.int64(count), numpy.int32(blocks), numpy.int32(col_tiles))

    def unfused():
        merge_attn_states(out16, v_a, s_a, v_b, s_b, out_lse)
        quantise((-(-count // 256),), (256,), arguments)

    row["unfused_us"] = _us(unfused)
    return row


#: Each family's measurement.
RUNNERS: dict[str, Callable[[Context, Case], dict]] = {
    "two-way": _two_way,
    "n-way": _n_way,
    "ragged": _ragged,
    "fp8": _fp8,
    "fp8-group": _fp8,
    "nvfp4": _nvfp4,
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
