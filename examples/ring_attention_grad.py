"""A ring-attention training step on one GPU: gradients through cm.merge_states, checked.

Ring attention (context parallelism) holds the keys and values in chunks, one a rank. Each rank
attends the queries to its chunk, giving an output [tokens, heads, head_size] and a log-sum-exp
[heads, tokens]; merging the chunks' states gives attention over the whole sequence. Here the chunks
sit on one GPU, their attention is plain differentiable torch ops and cm.merge_states merges them
(stacked to [chunks, tokens, heads, head_size] and [chunks, heads, tokens]). A loss on the merged
output and the merged LSE is backpropagated: autograd runs the merge's backward kernel, then the
torch ops, down to q, k and v. The same loss on attention over the whole sequence in float64 gives
the reference; a second variant adds attention sinks (learned per-head logits, counted once where
the chunks meet) and checks their gradient too.

Run:  python examples/ring_attention_grad.py [--dtype bfloat16|float32] [--causal]

Prints one line a check, "<dtype> <variant> <what> error <e> (tolerance <t>) ok|FAILED", with error
max |got - want| / max |want| against the float64 reference, then "ok" if every check passed (exit
status 0) or how many failed (exit status 1). Without a CUDA device it says so and exits 0.
"""

import argparse
import math
import sys

import torch

if not torch.cuda.is_available():
    print("ring_attention_grad: no CUDA device (needs one and a CUDA build of torch); nothing to run here")
    sys.exit(0)

import cupy_merge as cm  # after the check: merging needs CuPy and a GPU

tokens, heads, head_size, keys, chunks = 256, 8, 64, 4096, 4
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def attention(q, k, v, key_position=0, query_position=None, sinks=None):
    """Softmax attention of q [T, H, D] over k, v [N, H, D] (keys key_position.. of the sequence):
    the output [T, H, D] in v's dtype and the natural-log LSE of the scores [H, T], at least float32.

    query_position: the sequence position of the first query, for a causal mask (None: no mask).
    sinks: per-head logits [H], each one more term of its head's softmax denominator.
    """
    wide = torch.promote_types(q.dtype, torch.float32)  # scores in float32, as flash attention's are
    scores = torch.einsum("thd,khd->htk", q.to(wide), k.to(wide)) * q.shape[-1] ** -0.5
    if query_position is not None:
        query = torch.arange(q.shape[0], device=q.device)[:, None] + query_position
        key = torch.arange(k.shape[0], device=q.device) + key_position
        scores = scores.masked_fill(key > query, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
    out = torch.einsum("htk,khd->thd", torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def ring_attention(q, k, v, query_position=None, sinks=None):
    """Attention of q over k, v cut into chunks (what the ranks of a ring hold), merged by cm.merge_states."""
    size = k.shape[0] // chunks
    starts = range(0, k.shape[0], size)
    outs, lses = zip(*[attention(q, k[i : i + size], v[i : i + size], i, query_position) for i in starts])
    return cm.merge_states(torch.stack(outs), torch.stack(lses), sinks=sinks)


def loss(out, lse, target_out, target_lse):
    """A loss on both results, so that gradients enter the merge through its output and its LSE."""
    return (out.to(target_out.dtype) * target_out).sum() + (lse.to(target_lse.dtype) * target_lse).sum()


def relative_error(got, want):
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def check(dtype, with_sinks, causal):
    """One training step through the merge and its float64 reference: [(what, error)]."""
    q, k, v = (torch.randn(n, heads, head_size, device="cuda", dtype=dtype, requires_grad=True)
               for n in (tokens, keys, keys))  # fmt: skip
    sinks = None
    if with_sinks:  # per-head logits about as heavy as all the keys together, so that they matter
        sinks = (math.log(keys) + torch.randn(heads, device="cuda")).requires_grad_()
    leaves = [q, k, v] if sinks is None else [q, k, v, sinks]
    target_out = torch.randn(tokens, heads, head_size, device="cuda")
    target_lse = torch.randn(heads, tokens, device="cuda")
    # Causal: the queries are the sequence's last tokens (no more than a chunk's keys, so that every
    # query sees some keys of every chunk: a query that sees none would make the chunk's softmax 0/0).
    query_position = keys - tokens if causal else None

    out, lse = ring_attention(q, k, v, query_position, sinks)
    grads = torch.autograd.grad(loss(out, lse, target_out, target_lse), leaves)
    assert out.dtype == dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)

    exact = [leaf.detach().double().requires_grad_() for leaf in leaves]  # the same values, in float64
    exact_sinks = exact[3] if with_sinks else None
    want_out, want_lse = attention(*exact[:3], query_position=query_position, sinks=exact_sinks)
    want_loss = loss(want_out, want_lse, target_out.double(), target_lse.double())
    want_grads = torch.autograd.grad(want_loss, exact)

    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    return [(name, relative_error(got, want))
            for name, got, want in zip(names, [out, lse, *grads], [want_out, want_lse, *want_grads])]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], action="append",
                        help="the dtype of q, k, v and the chunks' outputs (repeatable; default: both)")  # fmt: skip
    parser.add_argument("--causal", action="store_true", help="causal, the queries last in the sequence")
    arguments = parser.parse_args()
    torch.set_float32_matmul_precision("highest")  # no TF32: float32 is checked to 1e-4
    print(f"{tokens} queries, {heads} heads of {head_size}, {keys} keys in {chunks} chunks"
          f"{', causal' if arguments.causal else ''}; error: max |got - want| / max |want|, want in float64")  # fmt: skip
    failed = 0
    for dtype_name in arguments.dtype or ["bfloat16", "float32"]:
        dtype = getattr(torch, dtype_name)
        for with_sinks in (False, True):
            for what, error in check(dtype, with_sinks, arguments.causal):
                good = error <= TOLERANCE[dtype]  # a NaN error fails too
                failed += not good
                print(f"{dtype_name:<8} {'sinks' if with_sinks else 'no-sinks':<8} {what:<6} error {error:.1e} "
                      f"(tolerance {TOLERANCE[dtype]:.0e}) {'ok' if good else 'FAILED'}")  # fmt: skip
    if failed:
        print(f"FAILED: {failed} checks out of tolerance")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
