"""Decode context parallelism with a tensor-parallel output projection after it.

Every rank attends over its shard of the KV cache for all heads, then
``merge_across_ranks(..., shard_heads=True)`` hands each rank the merged
attention of its own heads: the input of a row-parallel output projection
(each rank holds the rows of W_o for its heads; one all-reduce sums the parts).
Checked against attention and projection on one GPU. (Every strategy is also
captured by ``torch.cuda.graph`` in the tests; a process group whose NCCL work
was captured may wait on it when destroyed, so graph users keep the group.)

    torchrun --nproc-per-node=2 examples/head_sharded_decode.py
"""

import math
import os

import torch
import torch.distributed as dist

from cupy_merge.distributed import merge_across_ranks


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

tokens, heads, head_size, kv_len, hidden = 4, 32, 128, 32_768, 4096
generator = torch.Generator(device="cuda").manual_seed(0)  # every rank builds the same q, k, v, W_o
q = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
k_all = torch.randn(kv_len, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
v_all = torch.randn(kv_len, heads, head_size, device="cuda", dtype=torch.bfloat16, generator=generator)
w_o = torch.randn(heads * head_size, hidden, device="cuda", dtype=torch.bfloat16, generator=generator) / 64
shard = slice(rank * kv_len // world, (rank + 1) * kv_len // world)
my_heads = slice(rank * heads // world, (rank + 1) * heads // world)
w_o_rows = w_o.view(heads, head_size, hidden)[my_heads].reshape(-1, hidden)  # this rank's rows of W_o


def decode_step():
    part_out, part_lse = attention_with_lse(q, k_all[shard], v_all[shard])
    out, _ = merge_across_ranks(part_out, part_lse, shard_heads=True)  # [tokens, heads / world, head_size]
    projected = out.reshape(tokens, -1) @ w_o_rows
    dist.all_reduce(projected)  # the row-parallel projection's sum over head groups
    return projected


want = attention_with_lse(q, k_all, v_all)[0].reshape(tokens, -1) @ w_o  # one GPU, all heads
got = decode_step()
error = ((got.float() - want.float()).norm() / want.float().norm()).item()
if rank == 0:
    print(f"{world} ranks, {heads // world} heads per rank after the merge: relative error {error:.1e}")
assert error < 3e-2
dist.destroy_process_group()
