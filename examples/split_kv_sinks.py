"""Split-KV decode of a model with attention sinks (gpt-oss style): the KV in splits, one N-way merge
that counts each head's sink exactly once, checked against attention with the sink over the whole
sequence (float64 on the host).

A sink adds exp(z_h) to head h's softmax denominator. Applying it in every split counts it once per
split; applying it in none drops it: it enters once, where the splits' states meet.
"""

import itertools
import math
import sys

import cupy
import numpy as np

if not cupy.cuda.is_available():  # no driver or no device
    print("skipped: needs an NVIDIA GPU")
    sys.exit(0)

import cupy_merge as cm


def attention_with_lse(q, k, v):
    """Softmax attention on the GPU in float32, with its log-sum-exp (natural log); no sink."""
    scores = cupy.einsum("thd,khd->htk", q, k) / math.sqrt(q.shape[-1])
    s_max = scores.max(axis=-1, keepdims=True)
    p = cupy.exp(scores - s_max)
    total = p.sum(axis=-1, keepdims=True)
    return cupy.ascontiguousarray(cupy.einsum("htk,khd->thd", p / total, v)), (s_max + cupy.log(total))[..., 0]


def attention_with_sinks_on_host(q, k, v, sinks):
    """The whole sequence at once, the sink in the denominator, in float64."""
    scores = np.einsum("thd,khd->htk", q, k) / math.sqrt(q.shape[-1])
    logits = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (*scores.shape[:2], 1))], axis=-1)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("htk,khd->thd", weights[..., :-1], v)


tokens, heads, head_size, kv_len, splits = 4, 8, 64, 12_000, 16
q, k, v = (cupy.random.standard_normal((n, heads, head_size), dtype=cupy.float32) for n in (tokens, kv_len, kv_len))
sinks = cupy.random.standard_normal(heads, dtype=cupy.float32) * 3  # learned per-head sink logits

edges = np.linspace(0, kv_len, splits + 1).astype(int)
parts = [attention_with_lse(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
split_v = cupy.stack([part[0] for part in parts])  # [splits, tokens, heads, head_size]
split_s = cupy.stack([part[1] for part in parts])  # [splits, heads, tokens]
out, lse = cm.merge_states(split_v, split_s, sinks=sinks)

want = attention_with_sinks_on_host(q.get(), k.get(), v.get(), sinks.get().astype(np.float64))
error = np.linalg.norm(out.get() - want) / np.linalg.norm(want)
counted_twice, _ = cm.merge_states(split_v, split_s, sinks=sinks + math.log(2.0))  # what counting it twice does
wrong = np.linalg.norm(counted_twice.get() - want) / np.linalg.norm(want)
print(f"{splits} splits merged with sinks: relative error {error:.1e} (a sink counted twice: {wrong:.1e})")
assert error < 1e-5 < wrong
print("ok")
