"""``torchrun --nproc-per-node=N -m cupy_merge.bench --distributed``: the cross-rank strategies against bare collectives.

Every rank holds a bfloat16 partial state of the same queries (32 heads of 128).
For each strategy of :func:`cupy_merge.distributed.merge_across_ranks`, and for
the bare NCCL collectives that move the same bytes (what no implementation of
the strategy can beat), it prints microseconds per call, the slowest rank's:

* *eager*: wall clock over 50 calls (after 5 warm-ups and a barrier), host time included;
* *bound*: the same, launching a merge bound once with ``cupy_merge.bind`` (buffers,
  kernel launches and the local merge prepared once);
* *graph*: the eager call captured once in a CUDA graph and replayed 50 times.

Bare collectives: ``a2a`` one all-to-all of the packed values and LSE
(``alltoall``'s bytes); ``ag_rs`` an all-gather of the LSEs then a
reduce-scatter of the values (``allgather_reducescatter``'s); ``ag`` one
all-gather of the packed states (``allgather``'s); ``ag_ar`` an all-gather of
the LSEs then an all-reduce of the values (``allreduce``'s). The ratio columns
divide each strategy's time by its bare collectives' (eager and graph).
"""

from __future__ import annotations

import os
import time
from typing import Any

CASES = [(1, 32, 128), (16, 32, 128), (256, 32, 128), (1024, 32, 128), (4096, 32, 128)]
REPEATS = 50
#: Each strategy and the bare collectives that move its bytes.
STRATEGIES = {
    "alltoall": ("a2a", True),
    "allgather_reducescatter": ("ag_rs", True),
    "allgather": ("ag", False),
    "allreduce": ("ag_ar", False),
}


def _per_call_us(torch: Any, dist: Any, call) -> float:
    """Wall-clock microseconds per call, the slowest rank's."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):
        call()
    torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / REPEATS * 1e6], device="cuda")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _replay(torch: Any, call):
    """``call`` captured once in a CUDA graph: its replay."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _bare_collectives(torch: Any, dist: Any, world: int, tokens: int, heads: int, head_size: int) -> dict:
    """The collectives of each strategy on buffers of its sizes, and nothing else."""
    from ..distributed._steps import chunk_layout

    rows = tokens * heads
    full = chunk_layout(tokens, heads, head_size, 2).chunk_bytes
    shard = chunk_layout(tokens, heads // world, head_size, 2).chunk_bytes

    def buffer(n, dtype=torch.uint8):
        return torch.empty(n, dtype=dtype, device="cuda")

    send_a2a, recv_a2a = buffer(world * shard), buffer(world * shard)
    send_ag, recv_ag = buffer(full), buffer(world * full)
    lse, lse_all = buffer(rows, torch.float32), buffer(world * rows, torch.float32)
    values = buffer(rows * head_size, torch.bfloat16)
    values_shard = buffer(rows * head_size // world, torch.bfloat16)
    return {
        "a2a": lambda: dist.all_to_all_single(recv_a2a, send_a2a),
        "ag_rs": lambda: (
            dist.all_gather_into_tensor(lse_all, lse),
            dist.reduce_scatter_tensor(values_shard, values),
        ),
        "ag": lambda: dist.all_gather_into_tensor(recv_ag, send_ag),
        "ag_ar": lambda: (dist.all_gather_into_tensor(lse_all, lse), dist.all_reduce(values)),
    }


def main() -> int:
    import torch
    import torch.distributed as dist

    from .. import bind
    from ..distributed import choose_strategy, merge_across_ranks

    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rows = []
    for tokens, heads, head_size in CASES:
        v = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(heads, tokens, device="cuda") * 3
        bare = _bare_collectives(torch, dist, world, tokens, heads, head_size)
        row: dict[str, Any] = {"tokens": tokens, "heads": heads, "head_size": head_size}
        for name, call in bare.items():
            row[f"{name}_us"] = _per_call_us(torch, dist, call)
            row[f"{name}_graph_us"] = _per_call_us(torch, dist, _replay(torch, call))
        for strategy, (collectives, sharded) in STRATEGIES.items():

            def merge(strategy=strategy, sharded=sharded, v=v, s=s):
                return merge_across_ranks(v, s, op=strategy, shard_heads=sharded)

            row[f"{strategy}_us"] = _per_call_us(torch, dist, merge)
            bound = bind(merge_across_ranks, v, s, op=strategy, shard_heads=sharded)
            row[f"{strategy}_bound_us"] = _per_call_us(torch, dist, bound)
            row[f"{strategy}_graph_us"] = _per_call_us(torch, dist, _replay(torch, merge))
            row[f"{strategy}_ratio"] = row[f"{strategy}_us"] / row[f"{collectives}_us"]
            row[f"{strategy}_bound_ratio"] = row[f"{strategy}_bound_us"] / row[f"{collectives}_us"]
            row[f"{strategy}_graph_ratio"] = row[f"{strategy}_graph_us"] / row[f"{collectives}_graph_us"]
        row["auto_full"] = choose_strategy(world, head_size, 2, rows=tokens * heads)
        row["auto_sharded"] = choose_strategy(world, head_size, 2, shard_heads=True, rows=tokens * heads)
        rows.append(row)
    if rank == 0:
        _print(world, rows)
    dist.destroy_process_group()
    return 0


def _print(world: int, rows: list[dict]) -> None:
    print(
        f"world size {world}, bfloat16, us per call (slowest rank); ratio = strategy / its bare collectives"
    )
    header = (
        f"{'tokens':>6} {'strategy':>24} {'eager':>8} {'bound':>8} {'bare':>8} {'ratio':>6} {'bound':>6} "
        f"{'graph':>8} {'bare':>8} {'ratio':>6}"
    )
    print(header)
    for row in rows:
        for strategy, (collectives, _) in STRATEGIES.items():
            print(
                f"{row['tokens']:>6} {strategy:>24} {row[f'{strategy}_us']:>8.1f} {row[f'{strategy}_bound_us']:>8.1f} "
                f"{row[f'{collectives}_us']:>8.1f} {row[f'{strategy}_ratio']:>6.2f} {row[f'{strategy}_bound_ratio']:>6.2f} "
                f"{row[f'{strategy}_graph_us']:>8.1f} "
                f"{row[f'{collectives}_graph_us']:>8.1f} {row[f'{strategy}_graph_ratio']:>6.2f}"
            )
        print(f"{'':>6} auto: all heads {row['auto_full']}, sharded {row['auto_sharded']}")
