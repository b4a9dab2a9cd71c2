"""Split-KV attention: attend to a long KV sequence in chunks, merge the partial states on the GPU,
and check against attention over the whole sequence at once."""

import math
import sys

import cupy
import numpy as np

if not cupy.cuda.is_available():  # no driver or no device
    print("skipped: needs an NVIDIA GPU")
    sys.exit(0)

import cupy_merge as cm
from cupy_merge import reference


def attention_with_lse(q, k, v):
    """Softmax attention on the GPU in float32, with its natural-log log-sum-exp.

    q [tokens, heads, d]; k, v [kv_len, heads, d] -> out [tokens, heads, d], lse [heads, tokens].
    """
    scores = cupy.einsum("thd,khd->htk", q, k) / math.sqrt(q.shape[-1])
    s_max = scores.max(axis=-1, keepdims=True)
    p = cupy.exp(scores - s_max)
    total = p.sum(axis=-1, keepdims=True)
    # einsum may return a layout with a strided head_size axis; the merge wants it contiguous.
    out = cupy.ascontiguousarray(cupy.einsum("htk,khd->thd", p / total, v))
    return out, (s_max + cupy.log(total))[..., 0]


tokens, heads, head_size, kv_len, chunk = 16, 8, 64, 10_000, 2_048
q = cupy.random.standard_normal((tokens, heads, head_size), dtype=cupy.float32)
k = cupy.random.standard_normal((kv_len, heads, head_size), dtype=cupy.float32)
v = cupy.random.standard_normal((kv_len, heads, head_size), dtype=cupy.float32)

out, lse = attention_with_lse(q, k[:chunk], v[:chunk])
for start in range(chunk, kv_len, chunk):
    part_out, part_lse = attention_with_lse(q, k[start : start + chunk], v[start : start + chunk])
    cm.merge_state(out, lse, part_out, part_lse, out=out, out_lse=lse)  # running merge, in place

want_out, want_lse = reference.attention(q.get(), k.get(), v.get())
error = np.linalg.norm(out.get() - want_out) / np.linalg.norm(want_out)
lse_error = np.abs(lse.get() - want_lse).max()
print(f"{-(-kv_len // chunk)} chunks merged; relative error {error:.1e}, max LSE error {lse_error:.1e}")
assert error < 1e-5 and lse_error < 1e-4
