"""Merging across ranks in real multi-process groups: gloo on the CPU (runs in CI), NCCL on two GPUs."""

from __future__ import annotations

import math
import multiprocessing
import queue as queue_module
import socket

import pytest
from conftest import GPU_COUNT

import cupy_merge.distributed as cmd


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(target, world: int, args_of_rank, timeout: float = 180) -> None:
    """``target`` in ``world`` spawned processes; a rank that never reports fails the test and every
    rank is stopped (a rank left waiting in a collective would hold its GPU)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=target, args=(*args_of_rank(rank), queue), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results = {}
    try:
        for _ in range(world):
            rank, messages = queue.get(timeout=timeout)
            results[rank] = messages
    except queue_module.Empty:
        pass
    finally:
        for process in processes:
            process.join(timeout=30 if len(results) == world else 0)
            if process.is_alive():
                process.kill()
    missing = sorted(set(range(world)) - set(results))
    failures = [message for rank in sorted(results) for message in results[rank]]
    failures += [f"rank {rank} did not report within {timeout} s (hung in a collective?)" for rank in missing]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.exhaustive)])  # 8: 28 s on 2 cores
def test_gloo_ranks_on_the_cpu_merge_to_attention_over_the_whole_kv(world):
    pytest.importorskip("torch")
    from distributed_worker import run_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_rank, world, lambda rank: (rank, world, init, "gloo", ["float32", "bfloat16", "float16"]))


@pytest.mark.parametrize("backend", ["cpu:gloo", None])
def test_cpu_tensors_merge_in_a_group_of_several_backends(backend):
    """init_process_group() without a backend (torchrun's usual call) or "cpu:gloo": gloo serves CPU
    tensors there too, and gathers into a list (the group's backend is not the string "gloo")."""
    pytest.importorskip("torch")
    from distributed_worker import run_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_rank, 2, lambda rank: (rank, 2, init, backend, ["float32"]))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.exhaustive)])  # 4: 14 s on 2 cores
def test_gloo_ranks_count_the_sinks_once_over_all_ranks(world):
    pytest.importorskip("torch")
    from distributed_worker import run_sinks_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_sinks_rank, world, lambda rank: (rank, world, init))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
def test_nccl_two_gpus_torch_every_dtype_and_strategy():
    pytest.importorskip("torch")
    from distributed_worker import run_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_rank, 2, lambda rank: (rank, 2, init, "nccl", ["float32", "float16", "bfloat16"]))


def _nccl_unique_id():
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not getattr(nccl, "available", True):
        pytest.skip("this CuPy was built without NCCL")
    try:
        return nccl.get_unique_id()
    except Exception as error:  # noqa: BLE001 - a CuPy without a loadable NCCL library
        pytest.skip(f"CuPy cannot use NCCL here: {error}")


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nccl_two_gpus_cupy_communicator(dtype):
    from distributed_worker import run_cupy_rank

    uid = _nccl_unique_id()
    _run_ranks(run_cupy_rank, 2, lambda rank: (rank, 2, uid, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
def test_every_strategy_is_captured_by_a_torch_cuda_graph_and_replays_new_data():
    pytest.importorskip("torch")
    from distributed_worker import run_graph_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_graph_rank, 2, lambda rank: (rank, 2, init))


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two CUDA devices")
def test_every_strategy_is_captured_on_a_cupy_stream_and_replays_new_data():
    from distributed_worker import run_cupy_graph_rank

    uid = _nccl_unique_id()
    _run_ranks(run_cupy_graph_rank, 2, lambda rank: (rank, 2, uid))


@pytest.mark.parametrize(
    "world, rows, shard_heads, expected",
    [
        (2, 32, False, "allgather"),  # decode: one collective beats two
        (2, 4096 * 32, False, "allgather"),  # two ranks: the same bytes, fewer collectives
        (8, 32, False, "allgather"),
        (8, 4096 * 32, False, "allreduce"),  # many ranks, many rows: the gather's bytes grow with W
        (64, 1024 * 32, False, "allreduce"),
        (2, 32, True, "alltoall"),
        (64, 4096 * 32, True, "alltoall"),  # fewer bytes and one collective, at every size
    ],
)
def test_auto_picks_the_strategy_the_cost_model_finds_fastest(world, rows, shard_heads, expected):
    assert cmd.choose_strategy(world, 128, 2, shard_heads=shard_heads, rows=rows) == expected


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
    with pytest.raises(ValueError, match="^op: expected 'auto' or one of 'alltoall'"):
        cmd.merge_across_ranks(v, s, op="allgather", shard_heads=True)
    with pytest.raises(ValueError, match="^op: expected 'auto' or one of 'allgather'"):
        cmd.merge_across_ranks(v, s, op="alltoall")
    with pytest.raises(TypeError, match="^shard_heads: expected True or False"):
        cmd.merge_across_ranks(v, s, shard_heads=1)
    for world in (0, -1, 2.0):
        with pytest.raises(ValueError, match="^world_size: expected an int of at least 1"):
            cmd.choose_strategy(world, 128, 2)


def test_the_cost_model_counts_each_strategys_bytes_as_documented():
    """Bytes a rank sends per row (ring algorithms), for W ranks and rows of b bytes: allgather
    (W - 1)(b + 4); allreduce 4(W - 1) then 2b(W - 1)/W; alltoall (b + 4)(W - 1)/W;
    allgather_reducescatter 4(W - 1) then b(W - 1)/W."""
    assert cmd.strategy_costs(4, 256) == {
        "allgather": (780.0,), "allreduce": (12.0, 384.0), "alltoall": (195.0,),
        "allgather_reducescatter": (12.0, 192.0),
    }  # fmt: skip
    assert cmd.choose_strategy(1, 128, 2, rows=32) in ("allgather", "allreduce")


def test_bad_shapes_raise_before_any_collective_in_a_group():
    pytest.importorskip("torch")
    from distributed_worker import run_bad_inputs_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_bad_inputs_rank, 2, lambda rank: (rank, 2, init))


def test_ranks_called_differently_raise_the_same_error_on_every_rank():
    pytest.importorskip("torch")
    from distributed_worker import run_mismatch_rank

    init = f"tcp://127.0.0.1:{_free_port()}"
    _run_ranks(run_mismatch_rank, 2, lambda rank: (rank, 2, init), timeout=120)


def test_the_ranks_check_names_each_difference_and_the_ranks_on_each_side():
    import numpy as np

    from cupy_merge.distributed import _agreement

    def row(dtype="float16", shape=(3, 4, 8), base=0, shard=0, op="allgather", sinks=0):
        return [_agreement.CHECKED, _agreement.DTYPES.index(dtype), *shape, base, shard, _agreement.OPS.index(op), sinks]

    alike = np.array([row(), row(), row()])
    assert _agreement.mismatch(alike, 0) == ""
    rows = np.array([row(), row(dtype="bfloat16", base=1), row(shape=(3, 4, 16), sinks=0x1234 + 1)])
    message = _agreement.mismatch(rows, 2)
    assert message.startswith("merge_across_ranks: the ranks were not called alike: ")
    for words in ("v's dtype is float16 on ranks 0, 2, bfloat16 on rank 1",
                  "v's shape is [3, 4, 8] on ranks 0, 1, [3, 4, 16] on rank 2",
                  "lse_base is 'e' on ranks 0, 2, 2 on rank 1",
                  "sinks is none on ranks 0, 1, given (checksum 00001234) on rank 2"):  # fmt: skip
        assert words in message
    assert "shard_heads" not in message and "op is" not in message
    refusing = np.array([row(), _agreement.refused(), _agreement.refused()])
    assert _agreement.mismatch(refusing, 1) == ""  # a refusing rank raises its own error
    assert _agreement.mismatch(refusing, 0).startswith("merge_across_ranks: ranks 1, 2 refused their arguments")


def test_the_ranks_check_header_holds_the_call_and_the_sinks_values():
    torch = pytest.importorskip("torch")
    import zlib
    from types import SimpleNamespace

    from cupy_merge import _arrays
    from cupy_merge.distributed import _agreement

    state = SimpleNamespace(dtype="bfloat16", num_tokens=3, num_heads=4, head_size=8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    header = _agreement.header(state, 1, True, "alltoall", sinks, _arrays.TORCH)
    assert header == [_agreement.CHECKED, 2, 3, 4, 8, 1, 1, 2, 1 + zlib.crc32(sinks.numpy().tobytes())]
    assert _agreement.header(state, 1, True, "alltoall", None, _arrays.TORCH)[8] == 0  # none: never a checksum
    signed = torch.tensor([0.5, -1.0, 2.0, -0.0])
    assert _agreement.header(state, 1, True, "alltoall", signed, _arrays.TORCH) == header  # -0.0 is 0.0


def test_the_ranks_check_under_capture_is_refused_when_asked_for_and_left_out_when_on_by_default(monkeypatch):
    """The host cannot read a captured collective's result: check_ranks=True raises, naming itself;
    the environment's default skips the check (no gather) so that the capture goes on."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from cupy_merge import _launch
    from cupy_merge.distributed import _agreement

    gathers = []
    comm = SimpleNamespace(world_size=2, rank=0, all_gather=lambda *args: gathers.append(args))
    adapter = SimpleNamespace(current_stream=lambda device: 7)  # a stream of its own, being captured
    monkeypatch.setattr(_launch, "capturing", lambda stream: stream == 7)
    mine = _agreement.refused()
    with pytest.raises(ValueError, match="^check_ranks: the ranks' calls cannot be compared while a CUDA graph"):
        _agreement.agree(comm, adapter, 0, mine, None, asked=True)
    _agreement.agree(comm, adapter, 0, mine, None, asked=False)
    _agreement.agree(comm, adapter, 0, mine, 9, asked=False)  # the given stream is not captured, the current is
    assert gathers == []


def test_the_ranks_check_is_on_for_cpu_tensors_and_where_the_environment_asks(monkeypatch):
    torch = pytest.importorskip("torch")
    from cupy_merge import _arrays
    from cupy_merge.distributed import _agreement

    monkeypatch.delenv("CUPY_MERGE_CHECK_RANKS", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    on_host, elsewhere = torch.zeros(1), torch.zeros(1, device="meta")  # "meta" stands in for a GPU here
    assert _agreement.wanted(None, _arrays.TORCH, on_host)
    assert not _agreement.wanted(None, _arrays.TORCH, elsewhere)
    assert not _agreement.wanted(False, _arrays.TORCH, on_host) and _agreement.wanted(True, _arrays.TORCH, elsewhere)
    assert not _agreement.wanted(None, _arrays.CUPY, None)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
    assert _agreement.wanted(None, _arrays.TORCH, elsewhere) and not _agreement.wanted(None, _arrays.CUPY, None)
    for off in ("0", "false", "no", ""):  # "1" turns it on, as the library's other switches
        monkeypatch.setenv("CUPY_MERGE_CHECK_RANKS", off)
        assert not _agreement.wanted(None, _arrays.CUPY, None)
    monkeypatch.setenv("CUPY_MERGE_CHECK_RANKS", "1")
    assert _agreement.wanted(None, _arrays.CUPY, None)
    assert not _agreement.wanted(False, _arrays.CUPY, None)
    with pytest.raises(TypeError, match="^check_ranks: expected True or False"):
        _agreement.wanted("yes", _arrays.TORCH, on_host)


class _StubNccl:
    """Stands in for a ``cupy.cuda.nccl.NcclCommunicator``: records every collective it is asked for."""

    def __init__(self, world: int, events: list):
        self._world, self.events = world, events

    def size(self) -> int:
        return self._world

    def rank_id(self) -> int:
        return 0

    def __getattr__(self, name):
        if name in ("allGather", "allReduce", "reduceScatter", "send", "recv"):
            return lambda *args: self.events.append(name)
        raise AttributeError(name)


@pytest.fixture
def cupy_without_a_gpu(monkeypatch):
    """CuPy arrays at fake addresses, allocations and rank kernels recorded instead of made: a
    CuPy cross-rank merge runs up to its collectives on a machine with no GPU."""
    cupy = pytest.importorskip("cupy")
    memory = pytest.importorskip("cupy.cuda.memory")
    from cupy_merge import _arrays
    from cupy_merge.distributed import _collectives, _steps

    events: list[str] = []
    addresses = iter(range(1 << 40, 1 << 41, 1 << 24))

    def fake(shape, dtype, *_args, **_kwargs):
        dtype = _arrays.cupy_dtype(dtype)
        size = max(1, math.prod(shape)) * dtype.itemsize
        block = memory.UnownedMemory(next(addresses), size, owner=None, device_id=0)
        return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(block, 0))

    def allocate(*args, **kwargs):
        events.append("allocation")
        return fake(*args, **kwargs)

    monkeypatch.setattr(_arrays.CUPY, "empty", allocate)
    monkeypatch.setattr(_collectives.CupyNccl, "_stream_ptr", lambda self: 0)
    nccl = pytest.importorskip("cupy.cuda.nccl")
    for number, name in enumerate(("NCCL_UINT8", "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_SUM")):
        if not hasattr(nccl, name):  # a CuPy whose NCCL library is not loaded lacks its constants
            monkeypatch.setattr(nccl, name, number, raising=False)
    for name in ("scale_for_sum", "pack_states", "launch"):
        monkeypatch.setattr(_steps, name, lambda *args, _name=name, **kwargs: events.append(_name))
    return fake, events


@pytest.mark.parametrize("shard_heads, op", [(False, "allreduce"), (True, "allgather_reducescatter")])
def test_bfloat16_sums_without_nccl_bfloat16_are_refused_before_any_launch_or_collective(
    cupy_without_a_gpu, monkeypatch, shard_heads, op
):
    """The summing strategies add the values in their own dtype: a NCCL without bfloat16 must be
    found out with the other arguments, not in the collective after the LSE gather and the scaling
    kernel (which writes a contiguous ``out`` in place)."""
    import cupy.cuda.nccl

    import cupy_merge as cm

    monkeypatch.delattr(cupy.cuda.nccl, "NCCL_BFLOAT16", raising=False)  # the probe: a NCCL before 2.10
    fake, events = cupy_without_a_gpu
    v, s, out = fake((3, 4, 8), "bfloat16"), fake((4, 3), "float32"), fake((3, 4, 8), "bfloat16")
    comm = _StubNccl(2, events)
    message = rf"^v: op='{op}' sums bfloat16 values, and this CuPy's NCCL has no bfloat16"
    with pytest.raises(TypeError) as eager:
        cmd.merge_across_ranks(v, s, comm, op=op, shard_heads=shard_heads, out=None if shard_heads else out)
    assert events == []  # no buffer, no kernel, no collective before the refusal
    with pytest.raises(TypeError) as bound:
        cm.bind(cmd.merge_across_ranks, v, s, comm, op=op, shard_heads=shard_heads)
    assert events == []
    eager.match(message)
    bound.match(message)


def test_auto_exchanges_bfloat16_where_nccl_cannot_sum_it(cupy_without_a_gpu, monkeypatch):
    import cupy.cuda.nccl

    from cupy_merge.distributed import _strategies

    fake, events = cupy_without_a_gpu
    v, s = fake((4096, 32, 128), "bfloat16"), fake((32, 4096), "float32")
    comm = _StubNccl(8, events)
    assert cmd.choose_strategy(8, 128, 2, rows=4096 * 32) == "allreduce"
    monkeypatch.setattr(cupy.cuda.nccl, "NCCL_BFLOAT16", 9, raising=False)
    assert _strategies.resolve(v, s, comm, "auto", False, None, None, "e", None, None).op == "allreduce"
    monkeypatch.delattr(cupy.cuda.nccl, "NCCL_BFLOAT16")
    assert _strategies.resolve(v, s, comm, "auto", False, None, None, "e", None, None).op == "allgather"
    assert events == []
