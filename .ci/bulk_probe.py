"""Probe: the gradient given the merge's results with its states' values moved by bulk copies
(cuda_src/merge_backward_bulk.cu: slabs of one state's heads, every block the same share of them)
against the library's kernel given the results and a same-bytes copy, bfloat16, 32 heads of 128.

Each variant's results are checked against the library's (outputs NaN-filled first: every element
written), then timed (CUDA events, median, L2 flushed). Cells are % of the copy's speed, the bytes
counted as the benchmark counts them (without ``out``).

Usage (on the GPU machine): python3 .ci/bulk_probe.py
"""

import sys

import cupy
import numpy

import cupy_merge as cm
from cupy_merge import _kernels
from cupy_merge._arrays import cupy_dtype
from cupy_merge.backward import merge_states_backward, merge_states_varlen_backward
from cupy_merge.tools.timing import copy_us, median_ms

HEADS, HEAD_SIZE, VEC = 32, 128, 8
SOURCE = _kernels.with_includes(_kernels._read("merge_backward_bulk.cu"))
BF16 = cupy_dtype("bfloat16")


def kernel(packs: int, ragged: bool, ring: int, ahead: int):
    name = f"cupy_merge::merge_states_backward_bulk<cupy_merge::bfloat16_t, cupy_merge::bfloat16_t, {VEC}, {packs}, {str(ragged).lower()}, long long>"
    module = cupy.RawModule(
        code=SOURCE,
        options=("-std=c++17", f"-DBULK_RING={ring}", f"-DBULK_LOOKAHEAD={ahead}"),
        name_expressions=[name],
    )
    return module.get_function(name)


def resident(function) -> int:
    """Blocks of 128 threads a multiprocessor keeps of `function` (registers, shared memory; sm_90)."""
    attributes = function.attributes
    warp_registers = -(-attributes["num_regs"] * 32 // 256) * 256
    by_registers = 65536 // (4 * warp_registers)
    by_shared = (228 * 1024) // (attributes["shared_size_bytes"] + 1024)
    return min(by_registers, by_shared, 32)


def run_bulk(function, packs, blocks, v, s, indptr, grad, grad_s, out, out_lse, gv, gs):
    ragged = indptr is not None
    tokens = grad.shape[0]
    group = 128 * packs // (HEAD_SIZE // VEC)
    groups = -(-HEADS // group)
    rows = v.shape[0] if ragged else v.shape[0] * v.shape[1]
    states = v.shape[0] if ragged else v.shape[0]
    slabs = rows * groups
    i64 = numpy.int64
    if ragged:  # v [rows, H, D], s [H, rows]
        strides = (0, HEADS * HEAD_SIZE, 0, HEADS * HEAD_SIZE, rows, 0, 1, rows, 0, 1)
    else:  # v [S, T, H, D], s [S, H, T]
        strides = (HEADS * HEAD_SIZE, tokens * HEADS * HEAD_SIZE, HEADS * HEAD_SIZE, tokens * HEADS * HEAD_SIZE,
                   tokens, 1, HEADS * tokens, tokens, 1, HEADS * tokens)  # fmt: skip
    args = (
        gv, gs, v, s, grad, grad_s, out, out_lse,
        indptr if ragged else cupy.zeros(2, dtype=cupy.int32), i64(4), i64(1),
        i64(slabs), i64(states), i64(tokens), i64(HEADS), i64(HEAD_SIZE), i64(group),
        *map(i64, strides),
        i64(HEADS * HEAD_SIZE), i64(HEAD_SIZE), i64(tokens), i64(1),
        i64(HEADS * HEAD_SIZE), i64(HEAD_SIZE), i64(tokens), i64(1), i64(0),
    )  # fmt: skip
    function((min(blocks, slabs),), (128,), args)


def case_inputs(rng, states, tokens):
    indptr = None
    if states < 0:
        counts = rng.integers(0, -2 * states + 1, size=tokens)
        indptr = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(counts)]).astype(numpy.int32))
        shape, lse_shape = (int(counts.sum()),), (HEADS, int(counts.sum()))
    else:
        shape, lse_shape = (states, tokens), (states, HEADS, tokens)
    v = cupy.asarray(rng.standard_normal((*shape, HEADS, HEAD_SIZE), dtype=numpy.float32)).astype(BF16)
    s = cupy.asarray(rng.standard_normal(lse_shape, dtype=numpy.float32) * 4)
    grad = cupy.asarray(rng.standard_normal((tokens, HEADS, HEAD_SIZE), dtype=numpy.float32)).astype(BF16)
    grad_s = cupy.asarray(rng.standard_normal((HEADS, tokens), dtype=numpy.float32))
    return v, s, indptr, grad, grad_s


def main() -> None:
    rng = numpy.random.default_rng(0)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    variants = [(1, 8, 4), (2, 4, 4), (2, 8, 4), (4, 4, 4), (4, 4, 2)]  # (packs a thread, ring, lookahead)
    kernels = {}
    cases = [(16, 1024), (64, 64), (8, 4096), (4, 4096), (16, 64), (256, 8), (1024, 1), (48, 512),
             (-100, 64), (-8, 512), (-8, 4096), (-500, 8)]  # fmt: skip
    header = ["case", "MB", "library"] + [f"p{p}r{r}a{a}" for p, r, a in variants] + ["worst err"]
    print(" | ".join(header))
    for states, tokens in cases:
        v, s, indptr, grad, grad_s = case_inputs(rng, states, tokens)
        ragged = indptr is not None
        if ragged:
            out, out_lse = cm.merge_states_varlen(v, s, indptr)
            library = lambda: merge_states_varlen_backward(v, s, indptr, grad, grad_s, out=out, out_lse=out_lse)
        else:
            out, out_lse = cm.merge_states(v, s)
            library = lambda: merge_states_backward(v, s, grad, grad_s, out=out, out_lse=out_lse)
        want = [cupy.asnumpy(x.astype(cupy.float32)) for x in library()[:2]]
        nbytes = 2 * v.nbytes + 2 * s.nbytes + grad.nbytes + grad_s.nbytes
        copy = copy_us(nbytes)
        cells = [100 * copy / (median_ms(library) * 1e3)]
        worst = 0.0
        gv, gs = cupy.empty_like(v), cupy.empty_like(s)
        for packs, ring, ahead in variants:
            key = (packs, ragged, ring, ahead)
            if key not in kernels:
                kernels[key] = kernel(packs, ragged, ring, ahead)
                print(f"# packs={packs} ragged={ragged} ring={ring} ahead={ahead}: {resident(kernels[key])} blocks an SM",
                      file=sys.stderr)
            per_sm = resident(kernels[key])
            gv.fill(float("nan"))
            gs.fill(float("nan"))
            go = lambda: run_bulk(kernels[key], packs, per_sm * sms, v, s, indptr, grad, grad_s, out, out_lse, gv, gs)
            go()
            for got, w in zip((gv, gs), want):
                g = cupy.asnumpy(got.astype(cupy.float32))
                if numpy.isnan(g).sum() != numpy.isnan(w).sum():
                    worst = float("inf")
                    continue
                scale = max(float(numpy.linalg.norm(w)), 1e-30)
                worst = max(worst, float(numpy.linalg.norm(g - w)) / scale)
            cells.append(100 * copy / (median_ms(go) * 1e3))
        label = f"ragged T={tokens} mean {-states}" if ragged else f"S={states} T={tokens}"
        print(" | ".join([label, f"{nbytes / 1e6:.0f}", *(f"{c:.1f}" for c in cells), f"{worst:.1e}"]), flush=True)
        print(".", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
