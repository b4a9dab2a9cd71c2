"""Attention with a learned sink over a whole KV sequence in float64, and that sequence split into pieces.

A sink ``z_h`` adds ``exp(z_h)`` to head ``h``'s softmax denominator:
``V = sum_l exp(x_l - S) v_l`` with ``S = log(exp(z_h) + sum_l exp(x_l))``. Merging
the pieces' states with the sinks must give exactly this.
"""

from __future__ import annotations

import itertools

import numpy as np

from cupy_merge import reference


def attention_with_sinks(q, k, v, sinks) -> tuple[np.ndarray, np.ndarray]:
    """``q`` [T, H, D], ``k``/``v`` [L, H, D], ``sinks`` [H] -> out [T, H, D], lse [H, T] (natural log)."""
    scores = np.einsum("thd,lhd->htl", q, k) / np.sqrt(q.shape[-1])
    sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[:, None, None], (*scores.shape[:2], 1))
    logits = np.concatenate([scores, sink], axis=-1)
    top = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - top)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("htl,lhd->thd", weights[..., :-1] / total, v)
    return out, (top + np.log(total))[..., 0]


def split_states(rng, tokens, heads, head_size, kv_len, pieces, empty=()):
    """Queries, keys and values, and the pieces' attention states (``empty``: pieces with no keys)."""
    q = rng.standard_normal((tokens, heads, head_size))
    k = rng.standard_normal((kv_len, heads, head_size))
    v = rng.standard_normal((kv_len, heads, head_size))
    edges = np.linspace(0, kv_len, pieces + 1).astype(int)
    for piece in empty:  # its keys go to the piece before it (or after it, for the first)
        if piece == 0:
            edges[1] = edges[0]
        else:
            edges[piece] = edges[piece + 1]
    states = [reference.attention(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
    return (q, k, v), np.stack([x[0] for x in states]), np.stack([x[1] for x in states])
