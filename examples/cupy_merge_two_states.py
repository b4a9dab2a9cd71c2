"""Merge two attention states held in CuPy arrays, functionally and in place, and check both."""

import sys

import cupy
import numpy as np

if not cupy.cuda.is_available():  # no driver or no device
    print("skipped: needs an NVIDIA GPU")
    sys.exit(0)

import cupy_merge as cm
from cupy_merge import reference

tokens, heads, head_size = 1024, 32, 128
v_a = cupy.random.standard_normal((tokens, heads, head_size), dtype=cupy.float32).astype(cupy.float16)
v_b = cupy.random.standard_normal((tokens, heads, head_size), dtype=cupy.float32).astype(cupy.float16)
s_a = cupy.random.standard_normal((heads, tokens), dtype=cupy.float32) * 4  # natural-log LSE
s_b = cupy.random.standard_normal((heads, tokens), dtype=cupy.float32) * 4
want_v, want_s = reference.merge_state(v_a.get(), s_a.get(), v_b.get(), s_b.get())

v, s = cm.merge_state(v_a, s_a, v_b, s_b)  # new arrays
cm.merge_state(v_a, s_a, v_b, s_b, out=v_a, out_lse=s_a)  # in place, into the first state

error = np.linalg.norm(v.get() - want_v) / np.linalg.norm(want_v)
print(f"merged {v.shape} {v.dtype}; relative error against float64: {error:.1e}")
print(
    "in-place result equals the functional one:", bool(cupy.array_equal(v_a, v) and cupy.array_equal(s_a, s))
)
