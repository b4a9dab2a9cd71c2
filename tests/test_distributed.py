"""Merging across ranks in real multi-process groups: gloo on the CPU (runs in CI), NCCL on two GPUs."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
from conftest import GPU_COUNT

import cupy_merge.distributed as cmd


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(target, world: int, args_of_rank) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(*args_of_rank(rank), queue)) for rank in range(world)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=240) for _ in range(world))
    for process in processes:
        process.join(timeout=60)
    failures = [message for rank in sorted(results) for message in results[rank]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_on_the_cpu_merge_to_attention_over_the_whole_kv(world):
    pytest.importorskip("torch")
    from distributed_worker import run_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_rank, world, lambda rank: (rank, world, init, "gloo", ["float32"]))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
def test_nccl_two_gpus_torch_every_dtype_both_strategies():
    pytest.importorskip("torch")
    from distributed_worker import run_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_rank, 2, lambda rank: (rank, 2, init, "nccl", ["float32", "float16", "bfloat16"]))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nccl_two_gpus_cupy_communicator(dtype):
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not getattr(nccl, "available", True):
        pytest.skip("this CuPy was built without NCCL")
    from distributed_worker import run_cupy_rank

    try:
        uid = nccl.get_unique_id()
    except Exception as error:  # noqa: BLE001 - a CuPy without a loadable NCCL library
        pytest.skip(f"CuPy cannot use NCCL here: {error}")
    _run_ranks(run_cupy_rank, 2, lambda rank: (rank, 2, uid, dtype))


@pytest.mark.parametrize(
    "world, head_size, itemsize, expected",
    [
        (2, 128, 2, "allgather"),
        (4, 128, 2, "allgather"),
        (8, 128, 2, "allreduce"),
        (64, 128, 2, "allreduce"),
        (2, 128, 4, "allgather"),
        (4, 128, 4, "allreduce"),
    ],
)
def test_auto_picks_the_strategy_that_moves_fewer_bytes(world, head_size, itemsize, expected):
    assert cmd.choose_strategy(world, head_size, itemsize) == expected


def test_bad_arguments_raise_before_any_collective():
    torch = pytest.importorskip("torch")
    v, s = torch.zeros(3, 2, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="^op: expected"):
        cmd.merge_across_ranks(v, s, op="ring")
    with pytest.raises(ValueError, match="^lse_base: expected"):
        cmd.merge_across_ranks(v, s, lse_base=10)
    with pytest.raises(RuntimeError, match="^group: expected an initialised"):
        cmd.merge_across_ranks(v, s)
    with pytest.raises(TypeError, match="^v: expected a torch tensor or a CuPy array"):
        cmd.merge_across_ranks(v.numpy(), s.numpy())
