"""Kernel cases for compute-sanitizer: seconds under memcheck or racecheck, where the GPU suite takes minutes.

Every N-way kernel shape (packed and strided: split rows of one token, many states of few rows
combined as a tree, no split, odd head sizes, ragged rows with an empty one), group-scaled FP8 over split rows and the
in-place two-way merge, the gradients, batch-invariant plans (up to 64 splits a row) and NVFP4 outputs, each checked
against the float64 reference. Exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 .ci/sanitize_cases.py
"""

import sys

import cupy
import ml_dtypes
import numpy

import cupy_merge as cm
from cupy_merge import _tuning, reference

rng = numpy.random.default_rng(6)
failures = []


def check(label, got, want, tolerance):
    got = cupy.asnumpy(cupy.asarray(got).astype(cupy.float32)).astype(numpy.float64)
    finite = numpy.isfinite(want)
    error = numpy.linalg.norm((got - want)[finite]) / max(numpy.linalg.norm(want[finite]), 1e-30)
    ok = error < tolerance and numpy.array_equal(numpy.isnan(got), numpy.isnan(want))
    print(f"{'ok ' if ok else 'BAD'} {label}: relative error {error:.1e}")
    if not ok:
        failures.append(label)


def random_states(*shape_v, lse_shape):
    v = rng.standard_normal(shape_v).astype(numpy.float32)
    s = (rng.standard_normal(lse_shape) * 3).astype(numpy.float32)
    return v, s


def dense_and_ragged(kind):
    for states, tokens, heads, head_size in (
        (16, 1, 32, 128),
        (256, 2, 8, 128),
        (5, 300, 4, 64),
        (3, 17, 3, 40),
    ):
        v, s = random_states(states, tokens, heads, head_size, lse_shape=(states, heads, tokens))
        s[1, 0, 0] = -numpy.inf  # an empty state
        out = cupy.full((tokens, heads, head_size), numpy.nan, dtype=cupy.float32)
        out_lse = cupy.full((heads, tokens), numpy.nan, dtype=cupy.float32)
        cm.merge_states(cupy.asarray(v), cupy.asarray(s), out=out, out_lse=out_lse)
        want_v, want_s = reference.merge_states(v, s)
        check(f"{kind} S={states} T={tokens} H={heads} D={head_size}", out, want_v, 1e-5)
        check(f"{kind} S={states} T={tokens} LSE", out_lse, want_s, 1e-5)
    counts = rng.integers(0, 40, size=33)
    counts[3] = 0  # a token with no rows
    indptr = numpy.concatenate([[0], numpy.cumsum(counts)]).astype(numpy.int32)
    v, s = random_states(int(indptr[-1]), 8, 128, lse_shape=(8, int(indptr[-1])))
    got, _ = cm.merge_states_varlen(cupy.asarray(v), cupy.asarray(s), cupy.asarray(indptr))
    check(f"{kind} ragged", got, reference.merge_states_varlen(v, s, indptr)[0], 1e-5)


for packed in (True, False):
    with _tuning.use(_tuning.DEFAULT.replace(packed_kernels=packed)):
        dense_and_ragged("packed" if packed else "strided")

# FP8 with group scales over split rows: the group barriers follow the split combine.
v, s = random_states(16, 2, 32, 128, lse_shape=(16, 32, 2))
out = cupy.empty((2, 32, 128), dtype=cupy.uint8)
scales = cupy.full((2, 32), numpy.nan, dtype=cupy.float32)
cm.merge_states(cupy.asarray(v).astype(cupy.float16), cupy.asarray(s), out=out, out_dtype="float8_e4m3fn",
                output_block_scale=scales, quant_group_size=128)  # fmt: skip
dequantised = out.get().view(ml_dtypes.float8_e4m3fn).astype(numpy.float64) * numpy.repeat(
    scales.get(), 128, 1
).reshape(2, 32, 128)
check(
    "FP8 group scales, split rows", dequantised, reference.merge_states(v.astype(numpy.float16), s)[0], 5e-2
)

# In place, the LSE written over an input's.
v, w = (cupy.asarray(rng.standard_normal((64, 8, 128)).astype(numpy.float16)) for _ in range(2))
s_v, s_w = (cupy.asarray((rng.standard_normal((8, 64)) * 3).astype(numpy.float32)) for _ in range(2))
want_v, want_s = reference.merge_state(v.get(), s_v.get(), w.get(), s_w.get())
cm.merge_state_in_place(v, s_v, w, s_w)
check("two-way in place", v, want_v, 1e-3)
check("two-way in place LSE", s_v, want_s, 1e-5)

# Sinks, on the packed and the strided kernels, two-way and N-way.
sinks = cupy.asarray(rng.standard_normal(8).astype(numpy.float32))
for packed in (True, False):
    with _tuning.use(_tuning.DEFAULT.replace(packed_kernels=packed)):
        v, s = random_states(5, 17, 8, 96, lse_shape=(5, 8, 17))
        got, _ = cm.merge_states(cupy.asarray(v), cupy.asarray(s), sinks=sinks)
        check(f"sinks N-way packed={packed}", got, reference.merge_states(v, s, sinks=sinks.get())[0], 1e-5)
        got, _ = cm.merge_state(cupy.asarray(v[0]), cupy.asarray(s[0]), cupy.asarray(v[1]), cupy.asarray(s[1]),
                                sinks=sinks)  # fmt: skip
        want = reference.merge_state(v[0], s[0], v[1], s[1], sinks=sinks.get())[0]
        check(f"sinks two-way packed={packed}", got, want, 1e-5)

# Few rows of many states: narrow blocks whose splits combine as a tree (shuffles, then shared
# memory; a partial last warp; rows whose packs are not a power of two), with sinks.
for states, tokens, heads, head_size in ((1024, 1, 32, 128), (301, 2, 8, 64), (9, 3, 1, 32), (700, 1, 2, 96)):
    v, s = random_states(states, tokens, heads, head_size, lse_shape=(states, heads, tokens))
    head_sinks = cupy.asarray(rng.standard_normal(heads).astype(numpy.float32))
    got, _ = cm.merge_states(cupy.asarray(v), cupy.asarray(s), sinks=head_sinks)
    want = reference.merge_states(v, s, sinks=head_sinks.get())[0]
    check(f"split tree {states}x{tokens}x{heads}x{head_size}", got, want, 1e-5)

# Gradients: dense, two-way and ragged.
v, s = random_states(6, 9, 8, 64, lse_shape=(6, 8, 9))
grad = rng.standard_normal((9, 8, 64)).astype(numpy.float32)
got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad), sinks=sinks)
want = reference.merge_states_backward(v, s, grad, sinks=sinks.get())
check("backward N-way", got[0], want[0], 1e-5)
check("backward N-way sinks", got[2], want[2], 1e-5)
# Past the shares a lane keeps in shared memory, the states split over 1, 2 and 4 groups of
# threads (which add their parts through shared memory, a barrier a row), one block a row; then
# over blocks too (a split launch, a finishing launch).
v, s = random_states(150, 3, 2, 64, lse_shape=(150, 2, 3))
want = reference.merge_states_backward(v, s, grad[:3, :2], sinks=sinks.get()[:2])
for groups in (1, 2, 4):
    with _tuning.use(_tuning.DEFAULT.replace(backward_groups=groups, backward_split_chunks=2**62)):
        got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad[:3, :2]), sinks=sinks[:2])
    check(f"backward 150 states, {groups} groups", got[1], want[1], 1e-5)
    check(f"backward 150 states, {groups} groups (sinks)", got[2], want[2], 1e-5)
for split_chunks in (1, 2):
    with _tuning.use(_tuning.DEFAULT.replace(backward_split_chunks=split_chunks)):
        got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad[:3, :2]), sinks=sinks[:2])
    check(f"backward 150 states split over blocks ({split_chunks})", got[0], want[0], 1e-5)
    check(f"backward 150 states split over blocks ({split_chunks}, LSE)", got[1], want[1], 1e-5)
    check(f"backward 150 states split over blocks ({split_chunks}, sinks)", got[2], want[2], 1e-5)
v, s = random_states(6, 9, 8, 64, lse_shape=(6, 8, 9))
got = cm.merge_state_backward(*(cupy.asarray(x) for x in (v[0], s[0], v[1], s[1], grad)))
check("backward two-way", got[2], reference.merge_state_backward(v[0], s[0], v[1], s[1], grad)[2], 1e-5)
indptr = numpy.array([0, 3, 3, 10, 20], dtype=numpy.int32)
rows, rows_s = random_states(22, 8, 64, lse_shape=(8, 22))
grad = rng.standard_normal((4, 8, 64)).astype(numpy.float32)
got = cm.merge_states_varlen_backward(cupy.asarray(rows), cupy.asarray(rows_s), cupy.asarray(indptr), cupy.asarray(grad))
check("backward ragged", got[0], reference.merge_states_varlen_backward(rows, rows_s, indptr, grad)[0], 1e-5)
# Rows before indptr[0], and a last token past the rows (rows 12..21): the kernel zeroes what no
# token owns.
got = cm.merge_states_varlen_backward(cupy.asarray(rows), cupy.asarray(rows_s), cupy.asarray(numpy.array([2, 5, 12, 30], dtype=numpy.int32)),
                                      cupy.asarray(grad[:3]))  # fmt: skip
owned = reference.merge_states_varlen_backward(rows[2:12], rows_s[:, 2:12], [0, 3, 10], grad[:2])
want_v, want_s = numpy.zeros_like(rows), numpy.zeros_like(rows_s)
want_v[2:12], want_s[:, 2:12] = owned[0], owned[1]
check("backward ragged, rows no token owns", got[0], want_v, 1e-5)
check("backward ragged, rows no token owns (LSE)", got[1], want_s, 1e-5)
# Rows enough for two packs a lane (8192 and more): dense and ragged.
v, s = random_states(6, 1024, 8, 64, lse_shape=(6, 8, 1024))
grad = rng.standard_normal((1024, 8, 64)).astype(numpy.float32)
got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad))
check("backward N-way, two packs a lane", got[1], reference.merge_states_backward(v, s, grad)[1], 1e-5)
indptr = numpy.concatenate([[0], numpy.cumsum(rng.integers(0, 9, 1024))]).astype(numpy.int64)
rows, rows_s = random_states(int(indptr[-1]), 8, 64, lse_shape=(8, int(indptr[-1])))
got = cm.merge_states_varlen_backward(cupy.asarray(rows), cupy.asarray(rows_s), cupy.asarray(indptr), cupy.asarray(grad))
want = reference.merge_states_varlen_backward(rows, rows_s, indptr, grad)
check("backward ragged, two packs a lane", got[1], want[1], 1e-5)
# bfloat16 (pairs widened from their 32-bit word), rows of 16 states staged two packs a lane, and
# ragged rows: the reference takes the values as rounded to bfloat16.
for label, ragged in (("N-way", False), ("ragged", True)):
    if ragged:
        offsets = numpy.concatenate([[0], numpy.cumsum(rng.integers(0, 17, 1024))]).astype(numpy.int32)
        rows, rows_s = random_states(int(offsets[-1]), 8, 128, lse_shape=(8, int(offsets[-1])))
    else:
        rows, rows_s = random_states(16, 1024, 8, 128, lse_shape=(16, 8, 1024))
    grad = rng.standard_normal((1024, 8, 128)).astype(numpy.float32)
    on_gpu = [cupy.asarray(x).astype(ml_dtypes.bfloat16) for x in (rows, grad)]  # rounded on the GPU, as the tests do
    wide = [x.astype(ml_dtypes.bfloat16).astype(numpy.float64) for x in (rows, grad)]
    if ragged:
        got = cm.merge_states_varlen_backward(on_gpu[0], cupy.asarray(rows_s), cupy.asarray(offsets), on_gpu[1])
        want = reference.merge_states_varlen_backward(wide[0], rows_s, offsets, wide[1])
    else:
        got = cm.merge_states_backward(on_gpu[0], cupy.asarray(rows_s), on_gpu[1])
        want = reference.merge_states_backward(wide[0], rows_s, wide[1])
    check(f"backward {label} bfloat16, staged", got[0], want[0], 1e-2)
    check(f"backward {label} bfloat16, staged (LSE)", got[1], want[1], 1e-2)
# Few long ragged tokens split over blocks: leading rows, an empty token, one past the rows.
indptr = numpy.array([3, 3, 400, 403, 1300, 2000], dtype=numpy.int32)
rows, rows_s = random_states(1304, 2, 64, lse_shape=(2, 1304))
grad = rng.standard_normal((5, 2, 64)).astype(numpy.float32)
got = cm.merge_states_varlen_backward(cupy.asarray(rows), cupy.asarray(rows_s), cupy.asarray(indptr), cupy.asarray(grad),
                                      sinks=sinks[:2])  # fmt: skip
owned = reference.merge_states_varlen_backward(rows[3:1300], rows_s[:, 3:1300], indptr[:5] - 3, grad[:4],
                                               sinks=sinks.get()[:2])  # fmt: skip
want_v, want_s = numpy.zeros_like(rows), numpy.zeros_like(rows_s)
want_v[3:1300], want_s[:, 3:1300] = owned[0], owned[1]
check("backward ragged split over blocks", got[0], want_v, 1e-5)
check("backward ragged split over blocks (LSE)", got[1], want_s, 1e-5)
check("backward ragged split over blocks (sinks)", got[2], owned[2], 1e-5)
# Given the merge's results: dense rows in one block and split over many (one and two packs a
# lane, lanes looping over packs), ragged rows with leading and trailing rows no token owns.
for states, tokens, heads, head_size in ((150, 3, 2, 64), (9, 300, 8, 64), (5, 4, 2, 1024)):
    v, s = random_states(states, tokens, heads, head_size, lse_shape=(states, heads, tokens))
    grad = rng.standard_normal((tokens, heads, head_size)).astype(numpy.float32)
    want = reference.merge_states_backward(v, s, grad, sinks=sinks.get()[:heads])
    out, out_lse = cm.merge_states(cupy.asarray(v), cupy.asarray(s), sinks=sinks[:heads])
    for busy_threads, two_pack_rows in ((1, 0), (2**30, 0), (2**30, 2**62)):
        with _tuning.use(_tuning.DEFAULT.replace(backward_busy_threads=busy_threads, backward_from_output_states=2,
                                                 backward_from_output_two_pack_rows=two_pack_rows)):  # fmt: skip
            got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad), sinks=sinks[:heads],
                                           out=out, out_lse=out_lse)  # fmt: skip
        for index, what in enumerate(("", " (LSE)", " (sinks)")):
            check(f"backward given results {states}x{tokens}x{heads}x{head_size}, {busy_threads} {two_pack_rows}{what}",
                  got[index], want[index], 1e-5)  # fmt: skip
indptr = numpy.array([3, 3, 400, 403, 1300, 2000], dtype=numpy.int32)
rows, rows_s = random_states(1304, 2, 64, lse_shape=(2, 1304))
grad = rng.standard_normal((5, 2, 64)).astype(numpy.float32)
offsets = cupy.asarray(indptr)
out, out_lse = cm.merge_states_varlen(cupy.asarray(rows), cupy.asarray(rows_s), offsets, sinks=sinks[:2],
                                      check_indptr=False)  # fmt: skip
got = cm.merge_states_varlen_backward(cupy.asarray(rows), cupy.asarray(rows_s), offsets, cupy.asarray(grad),
                                      sinks=sinks[:2], out=out, out_lse=out_lse)  # fmt: skip
owned = reference.merge_states_varlen_backward(rows[3:1300], rows_s[:, 3:1300], indptr[:5] - 3, grad[:4],
                                               sinks=sinks.get()[:2])  # fmt: skip
want_v, want_s = numpy.zeros_like(rows), numpy.zeros_like(rows_s)
want_v[3:1300], want_s[:, 3:1300] = owned[0], owned[1]
for index, (what, want) in enumerate((("", want_v), (" (LSE)", want_s), (" (sinks)", owned[2]))):
    check(f"backward ragged given results{what}", got[index], want, 1e-5)

# FP8 group scales with the LSE written in place over rows longer than a block: two launches.
v_a, v_b = (cupy.asarray(rng.standard_normal((3, 2, 2048)).astype(numpy.float16)) for _ in range(2))
s_a, s_b = (cupy.asarray(rng.standard_normal((2, 3)).astype(numpy.float32)) for _ in range(2))
want_s = reference.merge_state(v_a.get(), s_a.get(), v_b.get(), s_b.get())[1]
out = cupy.empty((3, 2, 2048), dtype=cupy.uint8)
scales = cupy.empty((3, 2 * 2048), dtype=cupy.float32)
cm.merge_attn_states(out, v_a, s_a, v_b, s_b, s_a, output_block_scale=scales, quant_group_size=1)
check("group scales, LSE in place, long rows", s_a, want_s, 1e-5)

# Batch-invariant plans: up to 64 splits a row (blocks of 8 packs, tree levels by shuffles and shared
# memory) on both kernels, FP8 group scales at a 2-byte alignment, the gradients' plans.
invariant = _tuning.DEFAULT.replace(batch_invariant=True)
for packed in (True, False):
    with _tuning.use(invariant.replace(packed_kernels=packed)):
        for states, tokens in ((2048, 1), (300, 3), (17, 40)):
            v, s = random_states(states, tokens, 4, 128, lse_shape=(states, 4, tokens))
            got, got_lse = cm.merge_states(cupy.asarray(v), cupy.asarray(s), sinks=sinks[:4])
            want, want_lse = reference.merge_states(v, s, sinks=sinks.get()[:4])
            check(f"invariant packed={packed} {states}x{tokens}", got, want, 1e-5)
            check(f"invariant packed={packed} {states}x{tokens} (LSE)", got_lse, want_lse, 1e-5)
with _tuning.use(invariant):
    v, s = random_states(600, 3, 4, 128, lse_shape=(600, 4, 3))
    halves = cupy.asarray(numpy.concatenate([numpy.zeros(1, numpy.float16), v.astype(numpy.float16).ravel()]))
    shifted = halves[1:].reshape(v.shape)  # 2-byte aligned values: one element a pack
    out = cupy.empty((3, 4, 128), dtype=cupy.uint8)
    scales = cupy.full((3, 4 * 128 // 64), numpy.nan, dtype=cupy.float32)
    cm.merge_states(shifted, cupy.asarray(s), out=out, out_dtype="float8_e4m3fn", output_block_scale=scales,
                    quant_group_size=64)  # fmt: skip
    dequantised = out.get().view(ml_dtypes.float8_e4m3fn).astype(numpy.float64) * numpy.repeat(
        scales.get(), 64, 1
    ).reshape(3, 4, 128)
    check("invariant FP8 groups, 2-byte aligned", dequantised, reference.merge_states(v.astype(numpy.float16), s)[0],
          5e-2)  # fmt: skip
    grad = rng.standard_normal((3, 4, 128)).astype(numpy.float32)
    out, out_lse = cm.merge_states(cupy.asarray(v), cupy.asarray(s), sinks=sinks[:4])
    got = cm.merge_states_backward(cupy.asarray(v), cupy.asarray(s), cupy.asarray(grad), sinks=sinks[:4], out=out,
                                   out_lse=out_lse)  # fmt: skip
    want = reference.merge_states_backward(v, s, grad, sinks=sinks.get()[:4])
    for index, what in enumerate(("", " (LSE)", " (sinks)")):
        check(f"invariant backward given results{what}", got[index], want[index], 1e-5)


# NVFP4: split rows (group barriers after the split combine), ragged rows with an empty one, the
# swizzled scales' padding over 130 tokens (rows to 256, 3 blocks to 4), pairs-aligned inputs (vec 2).
def nvfp4_check(label, out, scales, want, global_scale, swizzled=True):
    got = reference.dequantize_nvfp4(out.get().reshape(len(want), -1), scales.get(), global_scale,
                                     (len(want), want[0].size), is_sf_swizzled_layout=swizzled)  # fmt: skip
    check(label, got.reshape(want.shape), want, 0.2)


def nvfp4_buffers(tokens, heads, head_size, swizzled=True):
    blocks = heads * head_size // 16
    rows, cols = ((-(-tokens // 128) * 128, -(-blocks // 4) * 4) if swizzled else (tokens, blocks))
    return (cupy.full((tokens, heads, head_size // 2), 0xAB, cupy.uint8), cupy.full((rows, cols), 0xAB, cupy.uint8),
            cupy.array([100.0], cupy.float32))  # fmt: skip


v, s = random_states(64, 2, 32, 128, lse_shape=(64, 32, 2))
out, scales, scale = nvfp4_buffers(2, 32, 128)
cm.merge_states(cupy.asarray(v), cupy.asarray(s), out=out, output_scale=scale, output_block_scale=scales)
nvfp4_check("NVFP4, split rows", out, scales, reference.merge_states(v, s)[0], 100.0)
counts = rng.integers(0, 60, size=130)
counts[5] = 0
indptr = numpy.concatenate([[0], numpy.cumsum(counts)]).astype(numpy.int32)
v, s = random_states(int(indptr[-1]), 3, 16, lse_shape=(3, int(indptr[-1])))
out, scales, scale = nvfp4_buffers(130, 3, 16)
cm.merge_states_varlen(cupy.asarray(v), cupy.asarray(s), cupy.asarray(indptr), out=out, output_scale=scale,
                       output_block_scale=scales)  # fmt: skip
nvfp4_check("NVFP4, ragged, swizzle padding", out, scales, reference.merge_states_varlen(v, s, indptr)[0], 100.0)
padding = reference.nvfp4_swizzled_scales(numpy.ones((130, 3))) == 0  # where the swizzle holds no scale
if not (scales.get()[padding] == 0).all():
    failures.append("NVFP4 swizzle padding not zeroed")
v_a, v_b = (rng.standard_normal((130, 3, 32)).astype(numpy.float16) for _ in range(2))
s_a, s_b = ((rng.standard_normal((3, 130)) * 3).astype(numpy.float32) for _ in range(2))
shifted = [cupy.asarray(numpy.concatenate([numpy.zeros(2, numpy.float16), x.ravel()]))[2:].reshape(x.shape)
           for x in (v_a, v_b)]  # fmt: skip  # 4-byte aligned: two values a pack
out, scales, scale = nvfp4_buffers(130, 3, 32, swizzled=False)
cm.merge_attn_states(out, shifted[0], cupy.asarray(s_a), shifted[1], cupy.asarray(s_b), output_scale=scale,
                     output_block_scale=scales, is_sf_swizzled_layout=False)  # fmt: skip
nvfp4_check("NVFP4, pairs-aligned, row-major", out, scales, reference.merge_state(v_a, s_a, v_b, s_b)[0], 100.0,
            swizzled=False)  # fmt: skip

cupy.cuda.Device().synchronize()
print(f"{len(failures)} wrong: {failures}" if failures else "all correct")
sys.exit(1 if failures else 0)
