"""One rank of the multi-process merge tests: shard a KV cache, merge across ranks, check.

Run in spawned processes by test_distributed.py; results travel back through a queue
as (rank, list of failure messages).
"""

from __future__ import annotations

import itertools
import traceback

import numpy as np

TOKENS, HEADS, HEAD_SIZE, KV_LEN = 6, 4, 64, 300


def shard_edges(world: int) -> np.ndarray:
    """Uneven shards; with 4 or more ranks, rank 1's shard is empty (it passes -inf)."""
    edges = np.linspace(0, KV_LEN, world + 1).astype(int)
    if world >= 4:
        edges[2] = edges[1]
    return edges


def run_rank(rank: int, world: int, init_method: str, backend: str, dtypes: list[str], queue) -> None:
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge.distributed as cmd
        from cupy_merge import reference

        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        rng = np.random.default_rng(1234)  # the same queries and KV on every rank
        q, k, v = (rng.standard_normal((n, HEADS, HEAD_SIZE)) for n in (TOKENS, KV_LEN, KV_LEN))
        edges = shard_edges(world)
        want_v, _ = reference.attention(q, k, v)
        for dtype in dtypes:
            part_v, part_s = reference.attention(
                q, k[edges[rank] : edges[rank + 1]], v[edges[rank] : edges[rank + 1]]
            )
            tv = torch.tensor(part_v, dtype=getattr(torch, dtype), device=device)
            ts = torch.tensor(part_s, dtype=torch.float32, device=device)
            # The answer for these very (rounded) inputs: the float64 merge of every rank's state.
            states = [reference.attention(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
            rounded_v = np.stack(
                [torch.tensor(x[0], dtype=getattr(torch, dtype)).double().numpy() for x in states]
            )
            exact_v, exact_s = reference.merge_states(
                rounded_v, np.stack([x[1].astype(np.float32) for x in states])
            )
            tolerance = 1e-5 if dtype == "float32" else 1e-2
            for op in ("allreduce", "allgather", "auto"):
                got_v, got_s = cmd.merge_across_ranks(tv, ts, op=op)
                got_v = got_v.double().cpu().numpy()
                got_s = got_s.double().cpu().numpy()
                error = np.linalg.norm(got_v - exact_v) / np.linalg.norm(exact_v)
                lse_error = np.max(np.abs(got_s - exact_s))
                attention_error = np.linalg.norm(got_v - want_v) / np.linalg.norm(want_v)
                if not (error <= tolerance and lse_error <= 1e-4 and attention_error <= max(tolerance, 1e-5)):
                    failures.append(
                        f"{backend} {dtype} {op}: rel.err {error:.2e}, lse err {lse_error:.2e}, vs attention {attention_error:.2e}"
                    )
            # Writing into the caller's buffers, and base-2 LSEs.
            out, out_lse = torch.empty_like(tv), torch.empty_like(ts)
            cmd.merge_across_ranks(tv, ts / np.log(2), op="allreduce", out=out, out_lse=out_lse, lse_base=2)
            if np.max(np.abs(out_lse.double().cpu().numpy() * np.log(2) - exact_s)) > 1e-4:
                failures.append(f"{backend} {dtype}: base-2 LSE wrong")
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - every failure goes back to the test as text
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def run_cupy_rank(rank: int, world: int, uid, dtype: str, queue) -> None:
    """The same check through CuPy arrays and cupy.cuda.nccl."""
    failures = []
    try:
        import cupy
        from cupy.cuda import nccl

        import cupy_merge.distributed as cmd
        from cupy_merge import reference

        cupy.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, uid, rank)
        rng = np.random.default_rng(99)
        q, k, v = (rng.standard_normal((n, HEADS, HEAD_SIZE)) for n in (TOKENS, KV_LEN, KV_LEN))
        edges = shard_edges(world)
        states = [reference.attention(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
        exact_v, exact_s = reference.merge_states(
            np.stack([x[0] for x in states]), np.stack([x[1] for x in states])
        )
        part_v, part_s = states[rank]
        cv, cs = cupy.asarray(part_v.astype(dtype)), cupy.asarray(part_s.astype(np.float32))
        for op in ("allreduce", "allgather"):
            got_v, got_s = cmd.merge_across_ranks(cv, cs, comm, op=op)
            error = np.linalg.norm(cupy.asnumpy(got_v).astype(np.float64) - exact_v) / np.linalg.norm(exact_v)
            if (
                error > (1e-5 if dtype == "float32" else 1e-2)
                or np.max(np.abs(cupy.asnumpy(got_s) - exact_s)) > 1e-4
            ):
                failures.append(f"cupy nccl {dtype} {op}: rel.err {error:.2e}")
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))
