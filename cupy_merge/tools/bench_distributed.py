"""``torchrun --nproc-per-node=N -m cupy_merge.bench --distributed``: both cross-rank strategies, timed.

For each case every rank holds a bfloat16 partial state of the same queries; the
merged result is timed with CUDA events (median of 30 after 5 warm-ups, ranks
aligned by a barrier before each). "bus GB/s" divides the bytes each rank sends
by the strategy's cost model (``cost_bytes``) by the time, as nccl-tests does.
"""

from __future__ import annotations

import os
import statistics

CASES = [(1, 32, 128), (64, 32, 128), (1024, 32, 128), (8192, 32, 128), (32768, 32, 128)]


def cost_bytes(
    strategy: str, world: int, tokens: int, heads: int, head_size: int, itemsize: int = 2
) -> float:
    """Bytes each rank sends (ring algorithms) for one merge of ``tokens x heads`` rows."""
    rows = tokens * heads
    if strategy == "allgather":
        return (world - 1) * rows * (head_size * itemsize + 4)
    return 2 * (world - 1) / world * rows * (4 * (head_size + 1) + 4)  # SUM buffer + the MAX of the LSEs


def main() -> int:
    import torch
    import torch.distributed as dist

    from ..distributed import choose_strategy, merge_across_ranks

    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rows = []
    for tokens, heads, head_size in CASES:
        v = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(heads, tokens, device="cuda") * 3
        row = {
            "tokens": tokens,
            "heads": heads,
            "head_size": head_size,
            "auto": choose_strategy(world, head_size, 2),
        }
        for strategy in ("allreduce", "allgather"):
            times = []
            for repeat in range(35):
                dist.barrier()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                merge_across_ranks(v, s, op=strategy)
                stop.record()
                stop.synchronize()
                if repeat >= 5:
                    times.append(start.elapsed_time(stop) * 1e3)
            microseconds = statistics.median(times)
            row[f"{strategy}_us"] = microseconds
            row[f"{strategy}_busgbps"] = (
                cost_bytes(strategy, world, tokens, heads, head_size) / microseconds / 1e3
            )
        rows.append(row)
    if rank == 0:
        print(
            f"world size {world}, bfloat16; times are medians of 30 (CUDA events), bus GB/s from the cost model"
        )
        print(
            f"{'tokens':>6} {'heads':>5} {'dim':>4} {'allreduce us':>12} {'bus GB/s':>8} {'allgather us':>12} {'bus GB/s':>8} {'auto':>9}"
        )
        for r in rows:
            print(
                f"{r['tokens']:>6} {r['heads']:>5} {r['head_size']:>4} {r['allreduce_us']:>12.1f} "
                f"{r['allreduce_busgbps']:>8.1f} {r['allgather_us']:>12.1f} {r['allgather_busgbps']:>8.1f} {r['auto']:>9}"
            )
    dist.destroy_process_group()
    return 0
