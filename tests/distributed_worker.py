"""One rank of the multi-process merge tests: shard a KV cache, merge across ranks, check.

Run in spawned processes by test_distributed.py; results travel back through a queue
as (rank, list of failure messages).
"""

from __future__ import annotations

import itertools
import traceback

import numpy as np

from cupy_merge import reference

TOKENS, HEADS, HEAD_SIZE, KV_LEN = 6, 8, 64, 300


def shard_edges(world: int) -> np.ndarray:
    """Uneven shards; with 4 or more ranks, rank 1's shard is empty (it passes -inf)."""
    edges = np.linspace(0, KV_LEN, world + 1).astype(int)
    if world >= 4:
        edges[2] = edges[1]
    return edges


MODES = [(False, "allgather"), (False, "allreduce"), (False, "auto"),
         (True, "alltoall"), (True, "allgather_reducescatter"), (True, "auto")]  # fmt: skip


def _shard_states(rank: int, world: int, seed: int):
    """This rank's state, every rank's states (float64) and attention over the whole KV.

    Token 0 of head 1 has no keys on any rank (its LSE is -inf everywhere), and
    with 4 or more ranks rank 1's whole shard is empty."""
    rng = np.random.default_rng(seed)  # the same queries and KV on every rank
    q, k, v = (rng.standard_normal((n, HEADS, HEAD_SIZE)) for n in (TOKENS, KV_LEN, KV_LEN))
    edges = shard_edges(world)
    states = [list(reference.attention(q, k[a:b], v[a:b])) for a, b in itertools.pairwise(edges)]
    for state in states:
        state[0][0, 1] = 0.0
        state[1][1, 0] = -np.inf
    want_v, _ = reference.merge_states(np.stack([x[0] for x in states]), np.stack([x[1] for x in states]))
    return states[rank], states, want_v


def _expected(states, dtype_of, shard_heads, rank, world):
    """The float64 merge of the very (rounded) inputs, and the heads this rank receives."""
    rounded = np.stack([dtype_of(x[0]) for x in states])
    exact_v, exact_s = reference.merge_states(rounded, np.stack([x[1].astype(np.float32) for x in states]))
    heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world) if shard_heads else slice(None)
    return exact_v[:, heads], exact_s[heads], heads


def _compare(got_v, got_s, exact_v, exact_s, tolerance, label, failures):
    error = np.linalg.norm(got_v - exact_v) / np.linalg.norm(exact_v)
    finite = np.isfinite(exact_s)
    lse_ok = (
        np.array_equal(np.isneginf(got_s), np.isneginf(exact_s))
        and np.max(np.abs(got_s[finite] - exact_s[finite])) <= 1e-4
    )
    if not (error <= tolerance and lse_ok and np.isfinite(got_v).all()):
        failures.append(f"{label}: rel.err {error:.2e}, lse ok {lse_ok}")


def run_rank(rank: int, world: int, init_method: str, backend: str, dtypes: list[str], queue) -> None:
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge as cm
        import cupy_merge.distributed as cmd

        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        (part_v, part_s), states, want_v = _shard_states(rank, world, 1234)
        for dtype in dtypes:
            torch_dtype = getattr(torch, dtype)
            tv = torch.tensor(part_v, dtype=torch_dtype, device=device)
            ts = torch.tensor(part_s, dtype=torch.float32, device=device)
            token_major = ts.T.contiguous().T  # an [H, T] view of a [T, H] buffer
            tolerance = 1e-5 if dtype == "float32" else 1e-2
            for shard_heads, op in MODES:
                exact_v, exact_s, heads = _expected(
                    states,
                    lambda x, torch_dtype=torch_dtype: torch.tensor(x, dtype=torch_dtype).double().numpy(),
                    shard_heads,
                    rank,
                    world,
                )
                for lse in (ts, token_major):
                    got_v, got_s = cmd.merge_across_ranks(tv, lse, op=op, shard_heads=shard_heads)
                    _compare(got_v.double().cpu().numpy(), got_s.double().cpu().numpy(), exact_v, exact_s,
                             tolerance, f"{backend} {dtype} {op} shard={shard_heads}", failures)  # fmt: skip
                if np.linalg.norm(got_v.double().cpu().numpy() - want_v[:, heads]) > 0.05 * np.linalg.norm(
                    want_v
                ):
                    failures.append(f"{backend} {dtype} {op}: far from attention over the whole KV")
                # Bound once, launched twice: the same outputs, the merge of the arrays' new contents.
                bound = cm.bind(cmd.merge_across_ranks, tv, ts, op=op, shard_heads=shard_heads)
                bound_v, bound_s = bound()
                if bound()[0] is not bound_v:
                    failures.append(f"{backend} {dtype} {op}: a bound merge returned new arrays")
                _compare(bound_v.double().cpu().numpy(), bound_s.double().cpu().numpy(), exact_v, exact_s,
                         tolerance, f"{backend} {dtype} {op} shard={shard_heads} bound", failures)  # fmt: skip
                # The caller's buffers (strided, or contiguous: summed in place), and base-2 LSEs.
                for width in (2 * HEAD_SIZE, HEAD_SIZE):
                    out = torch.empty(TOKENS, exact_v.shape[1], width, dtype=torch_dtype, device=device)
                    out = out[..., :HEAD_SIZE]
                    out_lse = torch.empty(exact_s.shape, device=device)
                    cmd.merge_across_ranks(tv, ts / np.log(2), op=op, shard_heads=shard_heads, out=out,
                                           out_lse=out_lse, lse_base=2)  # fmt: skip
                    _compare(out.double().cpu().numpy(), out_lse.double().cpu().numpy() * np.log(2), exact_v,
                             exact_s, tolerance, f"{backend} {dtype} {op} shard={shard_heads} out {width}",
                             failures)  # fmt: skip
        if backend == "nccl":  # gloo checks by default; on GPUs check_ranks asks for it
            _expect_mismatch(lambda **kw: cmd.merge_across_ranks(tv, ts, check_ranks=True, **kw), rank, world,
                             "nccl check_ranks", failures)  # fmt: skip
            got_v, got_s = cmd.merge_across_ranks(tv, ts, check_ranks=True)
            exact_v, exact_s, _ = _expected(
                states, lambda x: torch.tensor(x, dtype=tv.dtype).double().numpy(), False, rank, world
            )
            _compare(got_v.double().cpu().numpy(), got_s.double().cpu().numpy(), exact_v, exact_s, 1e-2,
                     "nccl checked, called alike", failures)  # fmt: skip
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - every failure goes back to the test as text
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def _expect_mismatch(merge, rank: int, world: int, label: str, failures: list) -> None:
    """``merge(lse_base=...)`` with base 2 on the last rank only, checked: every rank raises."""
    try:
        merge(lse_base=2 if rank == world - 1 else "e")
        failures.append(f"{label}: ranks called differently, no error on rank {rank}")
    except ValueError as raised:
        if "lse_base is 'e' on rank" not in str(raised):
            failures.append(f"{label}, rank {rank}: {raised}")


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def run_cupy_rank(rank: int, world: int, uid, dtype: str, queue) -> None:
    """The same checks through CuPy arrays and cupy.cuda.nccl, on a CuPy stream of its own."""
    failures = []
    try:
        import cupy
        from cupy.cuda import nccl

        import cupy_merge.distributed as cmd

        cupy.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, uid, rank)
        (part_v, part_s), states, _ = _shard_states(rank, world, 99)
        value_type = _numpy_dtype(dtype)
        cv, cs = cupy.asarray(part_v.astype(value_type)), cupy.asarray(part_s.astype(np.float32))
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(cupy.cuda.get_current_stream().record())  # the inputs' copies, on the null stream
        for shard_heads, op in MODES:
            exact_v, exact_s, _ = _expected(
                states, lambda x: x.astype(value_type).astype(np.float64), shard_heads, rank, world
            )
            got_v, got_s = cmd.merge_across_ranks(cv, cs, comm, op=op, shard_heads=shard_heads, stream=stream)
            stream.synchronize()
            _compare(cupy.asnumpy(got_v).astype(np.float64), cupy.asnumpy(got_s).astype(np.float64), exact_v,
                     exact_s, 1e-5 if dtype == "float32" else 1e-2, f"cupy nccl {dtype} {op} shard={shard_heads}",
                     failures)  # fmt: skip
            checked = cmd.merge_across_ranks(cv, cs, comm, op=op, shard_heads=shard_heads, check_ranks=True)
            _compare(cupy.asnumpy(checked[0]).astype(np.float64), cupy.asnumpy(checked[1]).astype(np.float64),
                     exact_v, exact_s, 1e-5 if dtype == "float32" else 1e-2, f"cupy nccl {dtype} {op} checked",
                     failures)  # fmt: skip
        _expect_mismatch(lambda **kw: cmd.merge_across_ranks(cv, cs, comm, check_ranks=True, **kw), rank, world,
                         "cupy nccl check_ranks", failures)  # fmt: skip
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def run_bad_inputs_rank(rank: int, world: int, init_method: str, queue) -> None:
    """Heads that do not divide among the ranks, and outputs of the wrong shape, raise on every rank."""
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge.distributed as cmd

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        v, s = torch.zeros(3, 5, 8), torch.zeros(5, 3)
        cases = [
            ({"shard_heads": True}, ValueError, "v: expected num_heads divisible by the 2 ranks"),
            ({"shard_heads": True, "out": torch.zeros(3, 5, 8)}, ValueError, "v: expected num_heads"),
            ({"out": torch.zeros(3, 4, 8)}, ValueError, "out: expected float32 of shape (3, 5, 8)"),
            ({"out_lse": torch.zeros(3, 5)}, ValueError, "out_lse: expected float32 of shape (5, 3)"),
        ]
        for kwargs, error, words in cases:
            try:
                cmd.merge_across_ranks(v, s, **kwargs)
                failures.append(f"{kwargs}: no error")
            except error as raised:
                if not str(raised).startswith(words):
                    failures.append(f"{kwargs}: {raised}")
        v4 = torch.zeros(3, 4, 8)
        try:
            cmd.merge_across_ranks(v4, torch.zeros(4, 3), shard_heads=True, out=torch.zeros(3, 4, 8))
            failures.append("a head-sharded out of all heads: no error")
        except ValueError as raised:
            if not str(raised).startswith("out: expected float32 of shape (3, 2, 8)"):
                failures.append(str(raised))
        first_rank_only = dist.new_group([0])  # every rank makes it; the others get a sentinel
        more = [
            # The pack and scale kernels read a row's elements one after another.
            ((torch.zeros(3, 4, 16)[..., ::2], torch.zeros(4, 3)), {}, ValueError,
             "v: expected the last dimension (head_size) to be contiguous"),
            ((v4, torch.zeros(4, 3), 3), {}, TypeError, "group: expected None (the default group) or a torch"),
        ]  # fmt: skip
        if rank:
            more.append(((v4, torch.zeros(4, 3), first_rank_only), {}, ValueError,
                         f"group: this process (rank {rank} of the default group) is not a member"))  # fmt: skip
        for args, kwargs, error, words in more:
            try:
                cmd.merge_across_ranks(*args, **kwargs)
                failures.append(f"{words}: no error")
            except error as raised:
                if not str(raised).startswith(words):
                    failures.append(f"{words}: {raised}")
        dist.barrier()  # every rank is still in step: no collective was left half done
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def run_mismatch_rank(rank: int, world: int, init_method: str, queue) -> None:
    """Ranks called differently raise the same ValueError on every rank (the check is on by default
    for CPU tensors), before any of the merge's collectives: the group stays in step."""
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge as cm
        import cupy_merge.distributed as cmd

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        rng = np.random.default_rng(7)  # the same data on every rank
        v, s = torch.from_numpy(rng.standard_normal((3, 4, 8))), torch.from_numpy(rng.standard_normal((4, 3)))
        v, s = v.float(), s.float()
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        other = rank == world - 1
        cases = [  # (this rank's arguments, words every rank's error has)
            (((v.half() if other else v.bfloat16()), s), {},
             ["v's dtype is bfloat16 on rank 0, float16 on rank 1"]),
            ((v.reshape(4, 3, 8) if other else v.reshape(3, 4, 8)[:, :3], s[:3] if not other else s.reshape(3, 4)),
             {}, ["v's shape is [3, 3, 8] on rank 0", "[4, 3, 8] on rank 1"]),
            ((v, s), {"lse_base": 2 if other else "e"}, ["lse_base is 'e' on rank 0, 2 on rank 1"]),
            ((v, s), {"sinks": sinks if other else None}, ["sinks is none on rank 0, given (checksum"]),
            ((v, s), {"sinks": sinks + (1.0 if other else 0.0)}, ["sinks is given (checksum"]),
            ((v, s), {"op": "allreduce" if other else "allgather"}, ["op is 'allgather' on rank 0, 'allreduce' on rank 1"]),
            ((v, s), {"shard_heads": other}, ["shard_heads is False on rank 0, True on rank 1", "op is"]),
            ((v[:0] if other else v, s[:, :0] if other else s), {}, ["v's shape is [3, 4, 8] on rank 0, [0, 4, 8]"]),
        ]  # fmt: skip
        for number, (args, kwargs, words) in enumerate(cases):
            try:
                cmd.merge_across_ranks(*args, **kwargs)
                failures.append(f"case {number}: no error on rank {rank}")
            except ValueError as raised:
                text = str(raised)
                if not (text.startswith("merge_across_ranks: the ranks were not called alike: ")
                        and all(w in text for w in words)):  # fmt: skip
                    failures.append(f"case {number}, rank {rank}: {text}")
        # A rank refusing its own arguments tells its peers, which raise instead of waiting: its arrays,
        # its options, the check's own switch, or a v of no array kind (the peers are reached through s).
        refusals = [
            ({"out": torch.empty(3, 4, 9)}, ValueError, "out: expected float32 of shape (3, 4, 8)"),
            ({"op": "ring"}, ValueError, "op: expected 'auto' or one of"),
            ({"lse_base": 10}, ValueError, "lse_base: expected"),
            ({"shard_heads": 1}, TypeError, "shard_heads: expected True or False"),
            ({"check_ranks": 1}, TypeError, "check_ranks: expected True or False"),
            ({"v": v.numpy()}, TypeError, "v: expected a torch tensor or a CuPy array"),
        ]
        for mine, error, words in refusals:
            arguments = {"v": v, "s": s, **(mine if other else {})}
            try:
                cmd.merge_across_ranks(**arguments)
                failures.append(f"refused {mine}: no error on rank {rank}")
            except (ValueError, TypeError) as raised:
                want = (error, words) if other else (ValueError, "merge_across_ranks: rank 1 refused its")
                if not (isinstance(raised, want[0]) and str(raised).startswith(want[1])):
                    failures.append(f"refused {mine}, rank {rank}: {type(raised).__name__}: {raised}")
        # Bound, the ranks are compared once, when every rank binds.
        try:
            cm.bind(cmd.merge_across_ranks, v, s, lse_base=2 if other else "e")
            failures.append(f"bind: no error on rank {rank}")
        except ValueError as raised:
            if "lse_base is 'e' on rank 0, 2 on rank 1" not in str(raised):
                failures.append(f"bind, rank {rank}: {raised}")
        # Bound, the check runs once, at bind, not at each launch (CPU launches rerun the merge).
        from cupy_merge.distributed import _agreement

        gathers, gather = [], _agreement._gather
        _agreement._gather = lambda *args: (gathers.append(1), gather(*args))[1]
        bound = cm.bind(cmd.merge_across_ranks, v, s)
        for _ in range(3):
            bound()
        _agreement._gather = gather
        if len(gathers) != 1:
            failures.append(f"bound: {len(gathers)} checks in a bind and 3 launches, expected 1")
        # -0.0 and 0.0 sinks, or NaNs of other payloads, are the same merge: no mismatch.
        signed = torch.tensor([0.5, -1.0, -0.0 if other else 0.0, float("nan")])
        if other:
            signed.view(torch.int32)[3] = 0x7FC00123  # a NaN with another payload
        cmd.merge_across_ranks(v, s, sinks=signed)
        # The group is still in step: a merge called alike is right afterwards, checked or not.
        for check in (None, True, False):
            out, lse = cmd.merge_across_ranks(v, s, check_ranks=check)
            want_v, want_s = reference.merge_states(np.stack([v.numpy()] * world), np.stack([s.numpy()] * world))
            _compare(out.numpy(), lse.numpy(), want_v, want_s, 1e-5, f"after the mismatches, check {check}", failures)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def run_graph_rank(rank: int, world: int, init_method: str, queue) -> None:
    """Every strategy captured by torch.cuda.graph with NCCL, replayed on new data."""
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge.distributed as cmd

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
        import cupy_merge as cm

        (part_v, part_s), _, _ = _shard_states(rank, world, 7)
        tv = torch.tensor(part_v, dtype=torch.bfloat16, device="cuda")
        ts = torch.tensor(part_s, dtype=torch.float32, device="cuda")
        (new_v, new_s), new_states, _ = _shard_states(rank, world, 8)
        for shard_heads, op in MODES:
            tv.copy_(torch.tensor(part_v, dtype=torch.bfloat16))
            ts.copy_(torch.tensor(part_s))
            cmd.merge_across_ranks(tv, ts, op=op, shard_heads=shard_heads)  # compiles, and warms NCCL up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got_v, got_s = cmd.merge_across_ranks(tv, ts, op=op, shard_heads=shard_heads)
            tv.copy_(torch.tensor(new_v, dtype=torch.bfloat16))
            ts.copy_(torch.tensor(new_s))
            graph.replay()
            torch.cuda.synchronize()
            exact_v, exact_s, _ = _expected(
                new_states,
                lambda x: torch.tensor(x, dtype=torch.bfloat16).double().numpy(),
                shard_heads,
                rank,
                world,
            )
            _compare(got_v.double().cpu().numpy(), got_s.double().cpu().numpy(), exact_v, exact_s, 1e-2,
                     f"graph {op} shard={shard_heads}", failures)  # fmt: skip
            # A bound merge, captured: its buffers were allocated outside the capture.
            bound = cm.bind(cmd.merge_across_ranks, tv, ts, op=op, shard_heads=shard_heads)
            bound()
            torch.cuda.synchronize()
            bound_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bound_graph):
                bound_v, bound_s = bound()
            tv.copy_(torch.tensor(part_v, dtype=torch.bfloat16))
            ts.copy_(torch.tensor(part_s))
            bound_graph.replay()
            torch.cuda.synchronize()
            first_v, first_s = _expected_bfloat16(7, shard_heads, rank, world)
            _compare(bound_v.double().cpu().numpy(), bound_s.double().cpu().numpy(), first_v, first_s, 1e-2,
                     f"bound graph {op} shard={shard_heads}", failures)  # fmt: skip
        # The ranks' check reads the gathered calls on the host: on by the environment it is left
        # out of a capture; asked for with check_ranks=True it is refused by name.
        import os

        os.environ["CUPY_MERGE_CHECK_RANKS"] = "1"
        cmd.merge_across_ranks(tv, ts)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            env_v, env_s = cmd.merge_across_ranks(tv, ts)
        graph.replay()
        torch.cuda.synchronize()
        first_v, first_s = _expected_bfloat16(7, False, rank, world)
        _compare(env_v.double().cpu().numpy(), env_s.double().cpu().numpy(), first_v, first_s, 1e-2,
                 "graph, the check on by the environment", failures)  # fmt: skip
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                cmd.merge_across_ranks(tv, ts, check_ranks=True)
            failures.append("check_ranks=True under capture: no error")
        except ValueError as raised:
            if not str(raised).startswith("check_ranks: the ranks' calls cannot be compared while a CUDA graph"):
                failures.append(f"check_ranks=True under capture: {raised}")
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    _report_and_exit(queue, rank, failures)


def _expected_bfloat16(seed: int, shard_heads: bool, rank: int, world: int):
    """The float64 merge of seed ``seed``'s states rounded to bfloat16: this rank's values and LSE."""
    import torch

    rounded = _expected(
        _shard_states(rank, world, seed)[1], lambda x: torch.tensor(x, dtype=torch.bfloat16).double().numpy(),
        shard_heads, rank, world,
    )  # fmt: skip
    return rounded[0], rounded[1]


def _report_and_exit(queue, rank: int, failures: list[str]) -> None:
    """Report, then leave at once: tearing down a process group whose NCCL work was captured
    in a CUDA graph can wait forever on that work (it never completes outside a replay)."""
    import os

    queue.put((rank, failures))
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_cupy_graph_rank(rank: int, world: int, uid, queue) -> None:
    """Every strategy captured on a CuPy stream with cupy.cuda.nccl, replayed on new data."""
    failures = []
    try:
        import cupy
        from cupy.cuda import nccl

        import cupy_merge.distributed as cmd

        cupy.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, uid, rank)
        (part_v, part_s), _, _ = _shard_states(rank, world, 7)
        (new_v, new_s), new_states, _ = _shard_states(rank, world, 8)
        cv, cs = cupy.asarray(part_v.astype(np.float16)), cupy.asarray(part_s.astype(np.float32))
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(cupy.cuda.get_current_stream().record())  # the inputs' copies, on the null stream
        for shard_heads, op in MODES:
            cmd.merge_across_ranks(cv, cs, comm, op=op, shard_heads=shard_heads, stream=stream)
            stream.synchronize()
            stream.begin_capture()
            got_v, got_s = cmd.merge_across_ranks(cv, cs, comm, op=op, shard_heads=shard_heads, stream=stream)
            graph = stream.end_capture()
            cv.set(new_v.astype(np.float16))
            cs.set(new_s.astype(np.float32))
            stream.wait_event(cupy.cuda.get_current_stream().record())
            graph.launch(stream)
            stream.synchronize()
            exact_v, exact_s, _ = _expected(
                new_states, lambda x: x.astype(np.float16).astype(np.float64), shard_heads, rank, world
            )
            _compare(cupy.asnumpy(got_v).astype(np.float64), cupy.asnumpy(got_s).astype(np.float64), exact_v,
                     exact_s, 1e-2, f"cupy graph {op} shard={shard_heads}", failures)  # fmt: skip
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))


def run_sinks_rank(rank: int, world: int, init_method: str, queue) -> None:
    """Every strategy with attention sinks: counted once over all ranks (not once per rank)."""
    failures = []
    try:
        import torch
        import torch.distributed as dist

        import cupy_merge.distributed as cmd

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        (part_v, part_s), states, _ = _shard_states(rank, world, 4321)
        sinks = np.random.default_rng(7).standard_normal(HEADS) * 2  # the same on every rank
        exact_v, exact_s = reference.merge_states(
            np.stack([x[0] for x in states]), np.stack([x[1] for x in states]), sinks=sinks
        )
        tv = torch.tensor(part_v, dtype=torch.float32)
        ts = torch.tensor(part_s, dtype=torch.float32)
        tz = torch.tensor(sinks, dtype=torch.float32)
        for shard_heads, op in MODES:
            heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world) if shard_heads else slice(None)
            got_v, got_s = cmd.merge_across_ranks(tv, ts, op=op, shard_heads=shard_heads, sinks=tz)
            _compare(got_v.double().numpy(), got_s.double().numpy(), exact_v[:, heads], exact_s[heads], 1e-5,
                     f"sinks {op} shard={shard_heads}", failures)  # fmt: skip
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    queue.put((rank, failures))
