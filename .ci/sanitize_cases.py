"""Kernel cases for compute-sanitizer: seconds under memcheck or racecheck, where the GPU suite takes minutes.

Every N-way kernel shape (packed and strided: split rows of one token, many states of few rows,
no split, odd head sizes, ragged rows with an empty one), group-scaled FP8 over split rows and the
in-place two-way merge, each checked against the float64 reference. Exit status 1 on a wrong result.

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

cupy.cuda.Device().synchronize()
print(f"{len(failures)} wrong: {failures}" if failures else "all correct")
sys.exit(1 if failures else 0)
