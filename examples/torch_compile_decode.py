"""A split-KV decode step under torch.compile(fullgraph=True, mode="reduce-overhead").

Attention over each split of the KV cache with plain matmuls gives each split's output and
log-sum-exp; cm.merge_states merges them. Compiled, the whole step (matmuls, softmax pieces and
the merge, registered as torch.ops.cupy_merge.merge_states) is one graph that CUDA-graph trees
capture and replay. Checked against attention over the whole sequence, with new data at every
step, and timed against the same step in eager mode with the merge bound once (cm.bind).
"""

import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    print("torch_compile_decode: needs a CUDA device and a CUDA build of torch; nothing to run here")
    sys.exit(0)

import cupy_merge as cm  # after the check: merging needs CuPy and a GPU

heads, head_size, splits, split_len = 32, 128, 8, 512  # one query token over 4096 cached keys
dtype = torch.bfloat16
scale = head_size**-0.5

# The KV cache, split-major: [splits, heads, split_len, head_size]. Marked static, CUDA graphs read it
# in place at every replay (a plain graph input would be copied in first).
keys = torch.randn(splits, heads, split_len, head_size, device="cuda", dtype=dtype)
values = torch.randn(splits, heads, split_len, head_size, device="cuda", dtype=dtype)
torch._dynamo.mark_static_address(keys)
torch._dynamo.mark_static_address(values)


def decode_step(q):
    """q [1, heads, head_size] -> the attention output [1, heads, head_size] and its LSE [heads, 1]."""
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(-1, -2)).float() * scale  # [splits, heads, 1, len]
    lse = torch.logsumexp(scores, dim=-1)  # each split's LSE, [splits, heads, 1]
    partial = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(dtype), values)  # [splits, heads, 1, d]
    # [splits, tokens, heads, head_size] as a view (no copy); the merge allocates its outputs inside
    # the graph, which CUDA-graph trees need (a graph that writes into its inputs is not captured).
    return cm.merge_states(partial.transpose(1, 2), lse)


compiled_step = torch.compile(decode_step, fullgraph=True, mode="reduce-overhead")


def whole_sequence(q):
    """Attention over all the keys at once, in float32: what the merged splits must equal."""
    k = keys.transpose(0, 1).reshape(heads, splits * split_len, head_size).float()
    v = values.transpose(0, 1).reshape(heads, splits * split_len, head_size).float()
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(-1, -2)) * scale  # [heads, 1, keys]
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [heads, 1, head_size]
    return out.transpose(0, 1), torch.logsumexp(scores, dim=-1)


# The same step in eager mode: every array preallocated, the merge checked and planned once.
scores_buffer = torch.empty(splits, heads, 1, split_len, device="cuda", dtype=dtype)
lse_buffer = torch.empty(splits, heads, 1, device="cuda")
partial_buffer = torch.empty(splits, heads, 1, head_size, device="cuda", dtype=dtype)
bound_merge = cm.bind(cm.merge_states, partial_buffer.transpose(1, 2), lse_buffer)


def eager_step(q):
    torch.matmul(q.transpose(0, 1), keys.transpose(-1, -2), out=scores_buffer)
    scores = scores_buffer.float() * scale
    torch.logsumexp(scores, dim=-1, out=lse_buffer)
    torch.matmul(torch.exp(scores - lse_buffer.unsqueeze(-1)).to(dtype), values, out=partial_buffer)
    return bound_merge()


def compiled_call(q):
    torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's outputs may be overwritten
    return compiled_step(q)


for step in range(5):  # warm-up, capture, then replays: new query and new cache contents every step
    q = torch.randn(1, heads, head_size, device="cuda", dtype=dtype)
    keys.copy_(torch.randn_like(keys))
    values.copy_(torch.randn_like(values))
    want, want_lse = whole_sequence(q)
    for name, run in (("compiled", compiled_call), ("eager", eager_step)):
        out, lse = run(q)
        error = float((out.float() - want).norm() / want.norm())
        lse_error = float((lse - want_lse).abs().max())
        assert out.shape == (1, heads, head_size) and out.dtype == dtype, (out.shape, out.dtype)
        assert error < 2e-2 and lse_error < 5e-2, f"step {step}, {name}: error {error:.1e}, LSE {lse_error:.1e}"
print(f"merged {splits} splits of {split_len} keys; bfloat16 output within {error:.1e} of whole-sequence attention")


def per_call(run, q, calls=200, rounds=10):
    """Median microseconds a step over rounds of back-to-back steps (synchronised around each round)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run(q)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


q = torch.randn(1, heads, head_size, device="cuda", dtype=dtype)
compiled_us, eager_us = per_call(compiled_call, q), per_call(eager_step, q)
print(f"per step: compiled with CUDA graphs {compiled_us:.1f} us, eager with cm.bind {eager_us:.1f} us "
      f"({eager_us / compiled_us:.2f}x)")  # fmt: skip
print("ok")
