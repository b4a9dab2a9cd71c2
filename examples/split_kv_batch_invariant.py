"""Split-KV decoding whose output is the same bits at batch sizes 1, 7 and 64.

Deterministic serving fixes the KV split size, so that a sequence's splits (and the partial
attention states an attention kernel computes over them) depend on the sequence alone. The
merge that combines them must then not depend on the batch either: in batch-invariant mode
(``cm.batch_invariant()``) a row's states are combined in an order that follows the row alone.

Here 64 sequences of different lengths are split into pieces of 256 keys; each piece's partial
state (``V_i``, ``s_i``) is computed once, as the attention kernel would, and the pieces are
merged by ``cm.merge_states_varlen`` (a ragged batch: a sequence has as many pieces as its length
asks for) in batches of 1, 7 and 64 sequences, sequence 0 at a different place in each. Its
merged output and LSE must be the same bits in all three, and match float64 attention over its
whole KV sequence. Run: ``python examples/split_kv_batch_invariant.py``; prints "ok" last.
"""

from __future__ import annotations

import sys

import numpy as np

SPLIT = 256  # keys a piece: fixed, as batch-invariant serving fixes it
HEADS, HEAD_SIZE = 8, 128


def attention_pieces(rng: np.random.Generator, length: int):
    """One sequence's query, keys and values, and its partial states: (V_i [pieces, H, D], s_i [pieces, H])."""
    q = rng.standard_normal((HEADS, HEAD_SIZE))
    k = rng.standard_normal((length, HEADS, HEAD_SIZE))
    v = rng.standard_normal((length, HEADS, HEAD_SIZE))
    scores = np.einsum("hd,lhd->hl", q, k) / np.sqrt(HEAD_SIZE)  # [H, L]
    values, lses = [], []
    for start in range(0, length, SPLIT):
        piece = scores[:, start : start + SPLIT]
        top = piece.max(axis=1, keepdims=True)
        weights = np.exp(piece - top)
        total = weights.sum(axis=1, keepdims=True)
        values.append(np.einsum("hl,lhd->hd", weights / total, v[start : start + SPLIT]))
        lses.append((top + np.log(total))[:, 0])
    top = scores.max(axis=1, keepdims=True)
    exact = np.einsum("hl,lhd->hd", np.exp(scores - top), v) / np.exp(scores - top).sum(axis=1, keepdims=True)
    return np.stack(values), np.stack(lses), exact, (top + np.log(np.exp(scores - top).sum(axis=1, keepdims=True)))[:, 0]


def main() -> int:
    import cupy

    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to run")
        return 0
    import cupy_merge as cm

    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 9000, size=64)
    sequences = [attention_pieces(rng, int(length)) for length in lengths]

    def merge(order):
        """Sequence ``order[i]`` as batch row i: (its merged values [T, H, D], LSE [H, T])."""
        values = np.concatenate([sequences[i][0] for i in order]).astype(np.float16)
        lses = np.concatenate([sequences[i][1] for i in order]).T.astype(np.float32)  # [H, rows]
        indptr = np.concatenate([[0], np.cumsum([len(sequences[i][0]) for i in order])]).astype(np.int32)
        out, out_lse = cm.merge_states_varlen(cupy.asarray(values), cupy.asarray(lses), cupy.asarray(indptr))
        return cupy.asnumpy(out), cupy.asnumpy(out_lse)

    batches = {1: [0], 7: [3, 5, 0, 9, 1, 2, 4], 64: list(range(63, -1, -1))}
    failures = 0
    with cm.batch_invariant():
        results = {size: merge(order) for size, order in batches.items()}
    alone_out, alone_lse = results[1][0][0], results[1][1][:, 0]
    for size, order in batches.items():
        row = order.index(0)
        out, lse = results[size][0][row], results[size][1][:, row]
        same = np.array_equal(out.view(np.uint16), alone_out.view(np.uint16)) and np.array_equal(
            lse.view(np.uint32), alone_lse.view(np.uint32)
        )
        failures += not same
        print(f"batch {size:2}: sequence 0 as row {row:2}: {'the same bits' if same else 'DIFFERENT bits'} as alone")
    _, _, exact, exact_lse = sequences[0]
    error = np.linalg.norm(alone_out.astype(np.float64) - exact) / np.linalg.norm(exact)
    lse_error = np.abs(alone_lse - exact_lse).max()
    print(f"against float64 attention: values {error:.1e} (float16: < 2e-3), LSE {lse_error:.1e} (< 1e-4)")
    failures += not (error < 2e-3 and lse_error < 1e-4)
    print("ok" if failures == 0 else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
