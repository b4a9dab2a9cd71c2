"""Split-KV decoding in JAX: attention over KV splits in jnp, merged by cupy_merge.jax under jax.jit.

One decode step for a batch of sequences (one query token each): every split of the KV
cache yields a partial output and its log-sum-exp, and ``cupy_merge.jax.merge_states``
merges the splits, inside the same jitted function. The result is checked against
attention over the whole sequence in float64 (NumPy), and the step is timed against the
same step merged in plain jnp.

    python examples/jax_split_kv_decode.py

Prints ``ok`` when both steps match the reference; on a machine without a CUDA JAX it
says why and exits 0.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import numpy as np

BATCH, HEADS, HEAD_SIZE, KV_LEN, SPLITS = 4, 32, 128, 4096, 16
CALLS, WARMUP = 200, 20


def cuda_jax():
    """JAX, or None (with the reason printed) where it cannot run the merge."""
    try:
        import jax
        from jax.experimental import buffer_callback  # noqa: F401 - JAX 0.6.1 or newer
    except ImportError as error:
        print(f"skipped: needs JAX 0.6.1 or newer with its CUDA plugin ({error})")
        return None
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if not devices:
        print("skipped: this JAX has no CUDA device (install jax[cuda12] or jax[cuda13] on a GPU machine)")
        return None
    return jax


def main() -> int:
    jax = cuda_jax()
    if jax is None:
        return 0
    import jax.numpy as jnp

    import cupy_merge.jax as cmj
    from cupy_merge import reference

    def split_attention(q, k, v):
        """Attention of q [B, H, D] over each of SPLITS splits of k, v [B, L, H, D]:
        outputs [splits, B, H, D] (float32) and LSEs [splits, H, B], cupy-merge's N-way layout."""
        batch, kv_len, heads, head_size = k.shape
        k = k.reshape(batch, SPLITS, kv_len // SPLITS, heads, head_size)
        v = v.reshape(batch, SPLITS, kv_len // SPLITS, heads, head_size)
        scores = jnp.einsum("bhd,bpkhd->pbhk", q, k, preferred_element_type=jnp.float32) / math.sqrt(
            head_size
        )
        top = scores.max(axis=-1, keepdims=True)
        p = jnp.exp(scores - top)
        total = p.sum(axis=-1, keepdims=True)
        out = jnp.einsum(
            "pbhk,bpkhd->pbhd", (p / total).astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        lse = (top + jnp.log(total))[..., 0]  # [splits, B, H]
        return out, jnp.transpose(lse, (0, 2, 1))

    def merged_by_cupy_merge(q, k, v):
        return cmj.merge_states(*split_attention(q, k, v), out_dtype=jnp.bfloat16)

    def merged_by_jnp(q, k, v):
        out, lse = split_attention(q, k, v)
        merged_lse = jax.nn.logsumexp(lse, axis=0)  # [H, B]
        weights = jnp.exp(lse - merged_lse)  # [splits, H, B]
        merged = jnp.einsum("phb,pbhd->bhd", weights, out)
        return merged.astype(jnp.bfloat16), merged_lse

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (BATCH, HEADS, HEAD_SIZE), jnp.bfloat16)
    k = jax.random.normal(keys[1], (BATCH, KV_LEN, HEADS, HEAD_SIZE), jnp.bfloat16)
    v = jax.random.normal(keys[2], (BATCH, KV_LEN, HEADS, HEAD_SIZE), jnp.bfloat16)

    # Attention over the whole sequence, per sequence, in float64.
    host = [np.asarray(x.astype(jnp.float32)).astype(np.float64) for x in (q, k, v)]
    want = [reference.attention(host[0][b : b + 1], host[1][b], host[2][b]) for b in range(BATCH)]
    want_out = np.concatenate([out for out, _ in want])  # [B, H, D]
    want_lse = np.concatenate([lse for _, lse in want], axis=1)  # [H, B]

    ok = True
    for name, step in (("cupy_merge.jax", jax.jit(merged_by_cupy_merge)), ("jnp", jax.jit(merged_by_jnp))):
        out, lse = step(q, k, v)
        got = np.asarray(out.astype(jnp.float32)).astype(np.float64)
        error = np.linalg.norm(got - want_out) / np.linalg.norm(want_out)
        lse_error = float(np.abs(np.asarray(lse, np.float64) - want_lse).max())
        for _ in range(WARMUP):
            jax.block_until_ready(step(q, k, v))
        times = []
        for _ in range(CALLS):
            started = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            times.append(time.perf_counter() - started)
        print(f"{name:>15} merge: {statistics.median(times) * 1e6:8.1f} us per decode step (median of {CALLS}); "
              f"relative error {error:.1e}, max LSE error {lse_error:.1e}")  # fmt: skip
        ok &= error < 1e-2 and lse_error < 1e-3
    print(f"{BATCH} sequences x {KV_LEN} keys, {HEADS} heads of {HEAD_SIZE}, {SPLITS} splits, bfloat16")
    if not ok:
        print("FAILED: a merged step disagrees with attention over the whole sequence")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
