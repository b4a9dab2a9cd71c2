"""Context-parallel decode: the KV cache is sharded over GPUs, each attends to its shard,
and the partial states are merged across ranks; checked against attention on one GPU.

First every rank receives the merge of all heads; then, as before a tensor-parallel output
projection, only its own heads (``shard_heads=True``): each rank holds the rows of W_o for its
heads, and one all-reduce sums the projected parts.

    torchrun --nproc-per-node=2 examples/context_parallel_decode.py
"""

import math
import os
import sys

import torch
import torch.distributed as dist

from cupy_merge.distributed import merge_across_ranks

if "RANK" not in os.environ:
    sys.exit("run it under torchrun on two GPUs: torchrun --nproc-per-node=2 examples/context_parallel_decode.py")


def attention_with_lse(q, k, v):
    """q [tokens, heads, d], k/v [kv_len, heads, d] -> out [tokens, heads, d] (q's dtype), lse [heads, tokens]."""
    scores = torch.einsum("thd,khd->htk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("htk,khd->thd", torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype).contiguous(), lse.contiguous()


rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
world = dist.get_world_size()

tokens, heads, head_size, kv_len = 8, 32, 128, 1_000_000  # a million-token KV cache, sharded
generator = torch.Generator(device="cuda").manual_seed(0)  # every rank builds the same q, k, v
q = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
k_all = torch.randn(kv_len, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
v_all = torch.randn(kv_len, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
shard = slice(rank * kv_len // world, (rank + 1) * kv_len // world)
part_out, part_lse = attention_with_lse(q, k_all[shard], v_all[shard])
# The single-GPU answer: attention over the whole cache at once.
want_out, want_lse = attention_with_lse(q, k_all, v_all)
for op in ("allreduce", "allgather"):
    out, lse = merge_across_ranks(part_out, part_lse, op=op)
    error = ((out.float() - want_out.float()).norm() / want_out.float().norm()).item()
    lse_error = (lse - want_lse).abs().max().item()
    if rank == 0:
        print(
            f"{op}: {world} ranks x {kv_len // world} keys each; relative error {error:.1e}, max LSE error {lse_error:.1e}"
        )
    assert error < 2e-2 and lse_error < 1e-3

# Heads sharded over the ranks, feeding a row-parallel output projection.
hidden = 4096
w_o = torch.randn(heads * head_size, hidden, device="cuda", dtype=torch.bfloat16, generator=generator) / 64
my_heads = slice(rank * heads // world, (rank + 1) * heads // world)
w_o_rows = w_o.view(heads, head_size, hidden)[my_heads].reshape(-1, hidden)  # this rank's rows of W_o
out, _ = merge_across_ranks(part_out, part_lse, shard_heads=True)  # [tokens, heads / world, head_size]
projected = out.reshape(tokens, -1) @ w_o_rows
dist.all_reduce(projected)  # the sum over head groups
want_projected = want_out.reshape(tokens, -1) @ w_o  # one GPU, all heads
error = ((projected.float() - want_projected.float()).norm() / want_projected.float().norm()).item()
if rank == 0:
    print(f"heads sharded: {heads // world} heads per rank, projected; relative error {error:.1e}")
assert error < 3e-2
dist.destroy_process_group()
