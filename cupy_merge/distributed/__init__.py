"""Merging attention states across ranks (decode context parallelism): one call, on real collectives.

Every rank holds the attention state of the same queries over its own shard of
the KV cache, ``v`` ``[num_tokens, num_heads, head_size]`` and ``s``
``[num_heads, num_tokens]``, and receives the merge over all shards: of every
head, or (``shard_heads=True``) of its own ``num_heads / world`` heads, the
layout a tensor-parallel output projection reads next. Strategies (``W`` ranks,
``b`` bytes in a row of values, per rank and row):

all heads

* ``"allgather"``: one all-gather of values and LSE packed in one buffer, then
  the local N-way merge kernel: ``(W - 1) (b + 4)`` bytes received, one collective.
* ``"allreduce"``: an all-gather of the LSEs, a kernel scaling this rank's values
  by their final weights, one all-reduce (sum) of them in their own dtype, whose
  result is the merge: ``4 (W - 1) + 2 b (W - 1) / W`` bytes, two collectives.

heads sharded over the ranks

* ``"alltoall"``: one all-to-all of values and LSE packed in one buffer (each
  rank's chunk for each head group), then the local N-way merge kernel on the
  received chunks in place: ``(b + 4) (W - 1) / W`` bytes, one collective.
* ``"allgather_reducescatter"``: an all-gather of the LSEs, the scaling kernel,
  a reduce-scatter (sum) over head groups (vLLM's ``cp_lse_ag_out_rs``):
  ``4 (W - 1) + b (W - 1) / W`` bytes, two collectives.

``"auto"`` picks by a cost model of collectives and bytes (:func:`choose_strategy`;
docs/PERF.md has it beside measurements). The summing strategies add values in
their own dtype (as vLLM does): for 16-bit values each rank's term is rounded
once more than in the exchanging ones. Every rank must pass the same shapes and
dtypes (not checked: that would take a collective; NCCL hangs or fails otherwise).

Communicators: a ``torch.distributed`` process group (NCCL for CUDA tensors,
gloo for CPU tensors) when ``v`` is a torch tensor; a
``cupy.cuda.nccl.NcclCommunicator`` when ``v`` is a CuPy array. Collectives and
kernels run on torch's current stream (NCCL's own streams ordered after it), or
on the CuPy ``stream`` given (default: the current one); every buffer is
allocated in the call, so ``torch.cuda.graph`` captures any strategy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _checks
from .._arrays import DeviceArray, Stream
from . import _steps
from ._bound import BoundAcrossRanks

__all__ = ["STRATEGIES", "BoundAcrossRanks", "choose_strategy", "merge_across_ranks"]

#: Strategies for results of all heads, and for head-sharded results.
FULL_HEAD_STRATEGIES = ("allgather", "allreduce")
SHARDED_STRATEGIES = ("alltoall", "allgather_reducescatter")
STRATEGIES = ("auto", *FULL_HEAD_STRATEGIES, *SHARDED_STRATEGIES)

#: The cost model's time per collective and bytes per microsecond a rank sends: bare eager NCCL
#: collectives on two H200s over NVLink took 22-40 us each at a few kB and moved 200-225 GB/s per
#: rank at 17-34 MB (docs/PERF.md, session 5). Under CUDA graphs a collective costs 10-15 us.
COLLECTIVE_US = 35.0
BYTES_PER_US = 200e3


def merge_across_ranks(
    v: DeviceArray,
    s: DeviceArray,
    group: Any = None,
    *,
    op: str = "auto",
    shard_heads: bool = False,
    out: DeviceArray | None = None,
    out_lse: DeviceArray | None = None,
    lse_base: str | int = "e",
    stream: Stream = None,
) -> tuple[DeviceArray, DeviceArray]:
    """Merge this rank's partial attention state with every other rank's.

    Parameters
    ----------
    v : DeviceArray
        This rank's partial output, ``[num_tokens, num_heads, head_size]``, float32,
        float16 or bfloat16, any strides: a torch tensor (CUDA, or CPU with gloo)
        or a CuPy array, the same shape on every rank.
    s : DeviceArray
        Its log-sum-exp, float32 ``[num_heads, num_tokens]``, any strides (a
        token-major buffer as ``lse.T``); a rank with an empty shard passes
        ``-inf`` (or ``+inf``) and contributes nothing.
    group : object, optional
        For torch tensors a process group (None: the default group); for CuPy
        arrays a ``cupy.cuda.nccl.NcclCommunicator``.
    op : {"auto", "allgather", "allreduce", "alltoall", "allgather_reducescatter"}
        The strategy (see the module's description): the first two for all
        heads, the last two with ``shard_heads=True``; ``"auto"`` picks by the cost model.
    shard_heads : bool
        Return only this rank's heads, ``rank * num_heads / W`` up to the next
        rank's: values ``[num_tokens, num_heads / W, head_size]``, LSE
        ``[num_heads / W, num_tokens]``. ``num_heads`` must divide by ``W``.
    out : DeviceArray, optional
        Where to write the merged values (the result's shape, ``v``'s dtype,
        any strides); allocated if omitted.
    out_lse : DeviceArray, optional
        Where to write the merged LSE, float32; allocated if omitted.
    lse_base : {"e", 2}
        Base of every LSE in and out.
    stream : Stream
        CuPy only: the stream the collectives and kernels run on.

    Returns
    -------
    v : DeviceArray
        The merge over all ranks' states, in ``v``'s array kind.
    s : DeviceArray
        Its log-sum-exp.

    Raises
    ------
    ValueError
        An unknown strategy or one of the other layout, heads that do not
        divide among the ranks, or outputs of the wrong shape; before any collective.

    Examples
    --------
    One process stands for a whole group here; under ``torchrun`` every rank calls it alike.

    >>> import torch, torch.distributed as dist
    >>> from cupy_merge.distributed import merge_across_ranks
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    >>> v, s = torch.ones(4, 2, 8), torch.zeros(2, 4)
    >>> out, lse = merge_across_ranks(v, s)
    >>> bool(torch.equal(out, v)), bool(torch.equal(lse, s))
    (True, True)
    >>> out, lse = merge_across_ranks(v, s, shard_heads=True)  # one rank holds every head
    >>> tuple(out.shape)
    (4, 2, 8)
    >>> dist.destroy_process_group()
    """
    call = resolve(v, s, group, op, shard_heads, out, out_lse, lse_base, stream)
    with call.xp.on_stream():
        if call.op in ("allgather", "alltoall"):
            return _merge_by_exchange(call)
        return _merge_by_sum(call)


class CrossRankCall(NamedTuple):
    """A checked cross-rank merge: its communicator, array helpers, arrays and strategy."""

    comm: Any
    xp: Any
    v: Any
    s: Any
    op: str
    shards: int  # head groups of the result's exchange or sum: the world size if heads are sharded, else 1
    out: Any
    out_lse: Any
    lse_base_2: int


def resolve(v, s, group, op, shard_heads, out, out_lse, lse_base, stream) -> CrossRankCall:
    """Every check of :func:`merge_across_ranks`, before any collective; ``"auto"`` resolved."""
    shard_heads = _checks.flag(shard_heads, "shard_heads")
    allowed = SHARDED_STRATEGIES if shard_heads else FULL_HEAD_STRATEGIES
    if op != "auto" and op not in allowed:
        raise ValueError(
            f"op: expected 'auto' or one of {', '.join(map(repr, allowed))} with shard_heads={shard_heads}, "
            f"got {op!r}"
        )
    lse_base_2 = _checks.lse_base_flag(lse_base)
    comm, xp = _communicator(v, group, stream)
    num_tokens, num_heads, head_size = _checks.check_rank_state(
        tuple(v.shape), xp.dtype_name(v), tuple(s.shape), xp.dtype_name(s), xp.device_of(v), xp.device_of(s)
    )
    world = comm.world_size
    if shard_heads and num_heads % world:
        raise ValueError(
            f"v: expected num_heads divisible by the {world} ranks to shard heads over them, got {num_heads}"
        )
    heads = num_heads // world if shard_heads else num_heads
    results = (((num_tokens, heads, head_size), xp.dtype_name(v)), ((heads, num_tokens), "float32"))
    for given, (shape, dtype), name in zip((out, out_lse), results, ("out", "out_lse")):
        if given is not None:
            _checks.check_rank_output(
                name,
                (tuple(given.shape), xp.dtype_name(given), xp.device_of(given)),
                (shape, dtype, xp.device_of(v)),
            )
    if num_tokens * num_heads and head_size > 1 and xp.strides(v)[-1] != 1:
        v = xp.contiguous(v)  # the kernels read a row's elements back to back
    if op == "auto":
        op = choose_strategy(
            world, head_size, xp.itemsize(v), shard_heads=shard_heads, rows=num_tokens * num_heads
        )
    return CrossRankCall(comm, xp, v, s, op, world if shard_heads else 1, out, out_lse, lse_base_2)


def choose_strategy(
    world_size: int, head_size: int, itemsize: int, *, shard_heads: bool = False, rows: int = 1
) -> str:
    """The strategy the cost model finds fastest: what ``op="auto"`` runs.

    Each collective of a strategy costs the longer of ``COLLECTIVE_US`` (its
    fixed cost, which a large transfer hides) and the bytes a rank sends over
    ``BYTES_PER_US``; a strategy costs the sum over its collectives (see the
    module's description for the bytes).

    Parameters
    ----------
    world_size : int
        Ranks in the group.
    head_size : int
        Elements in a row of values.
    itemsize : int
        Bytes per value element (2 for float16 and bfloat16, 4 for float32).
    shard_heads : bool
        Choose among the head-sharded strategies.
    rows : int
        Tokens times heads of the merge.

    Returns
    -------
    str
        One of :data:`STRATEGIES` other than ``"auto"``; ties go to the one with fewer collectives.

    Examples
    --------
    >>> from cupy_merge.distributed import choose_strategy
    >>> choose_strategy(2, 128, 2, rows=32), choose_strategy(8, 128, 2, rows=4096 * 32)
    ('allgather', 'allreduce')
    >>> choose_strategy(8, 128, 2, shard_heads=True, rows=32)
    'alltoall'
    """
    costs = {
        name: (
            sum(max(COLLECTIVE_US, rows * row_bytes / BYTES_PER_US) for row_bytes in collectives),
            len(collectives),
        )
        for name, collectives in strategy_costs(world_size, head_size * itemsize).items()
        if (name in SHARDED_STRATEGIES) == shard_heads
    }
    return min(costs, key=costs.__getitem__)


def strategy_costs(world_size: int, row_bytes: int) -> dict[str, tuple[float, ...]]:
    """Each strategy's collectives, as the bytes a rank sends per row in each (ring algorithms)."""
    w = world_size
    lse_gather = 4.0 * (w - 1)
    return {
        "allgather": ((w - 1) * (row_bytes + 4.0),),
        "allreduce": (lse_gather, 2.0 * row_bytes * (w - 1) / w),
        "alltoall": ((row_bytes + 4.0) * (w - 1) / w,),
        "allgather_reducescatter": (lse_gather, row_bytes * (w - 1) / w),
    }


def _merge_by_exchange(call: CrossRankCall):
    """All-gather (one chunk) or all-to-all (a chunk per rank) of packed states, then the local merge."""
    comm, xp, v = call.comm, call.xp, call.v
    packed, layout = _steps.pack_buffer(xp, v, call.shards)
    _steps.pack_states(xp, v, call.s, packed, layout)
    received = xp.empty_bytes((comm.world_size, layout.chunk_bytes), like=v)
    exchange(comm, received, packed)
    values, lse = _steps.chunk_views(xp, received, layout, v.dtype)
    if xp.on_gpu(v):
        from ..merge_many import merge_states

        return merge_states(
            values, lse, out=call.out, out_lse=call.out_lse, lse_base=2 if call.lse_base_2 else "e"
        )
    merged = _steps.merge_on_host(xp, values, lse, call.lse_base_2)
    return _deliver(xp, *merged, call.out, call.out_lse)


def exchange(comm: Any, received: Any, packed: Any) -> None:
    """One chunk from every rank (all-gather), or each rank's chunk for this one (all-to-all)."""
    if packed.shape[0] == 1:
        comm.all_gather(received, packed.reshape(-1))
    else:
        comm.all_to_all(received, packed)


def _merge_by_sum(call: CrossRankCall):
    """All-gather the LSEs; scale this rank's values by their weights; sum them over ranks."""
    comm, xp, v, shards, out = call.comm, call.xp, call.v, call.shards, call.out
    num_tokens, num_heads, _ = v.shape
    heads = num_heads // shards
    gathered = xp.empty_lse((comm.world_size, num_heads, num_tokens), like=v)
    comm.all_gather(gathered, xp.contiguous(call.s))
    merged_lse = call.out_lse if call.out_lse is not None else xp.empty_lse((heads, num_tokens), like=v)
    scaled = scale_buffer(xp, v, shards, out)
    _steps.scale_for_sum(xp, v, gathered, comm.rank, scaled, merged_lse, call.lse_base_2)
    merged = sum_over_ranks(comm, xp, scaled, out)
    return _deliver(xp, merged, merged_lse, out, None)


def scale_buffer(xp: Any, v: Any, shards: int, out: Any) -> Any:
    """Where the scaled values go, ``[shards, T, H / shards, D]``: the caller's contiguous ``out``
    itself for an all-reduce (summed in place, nothing copied after), else a new buffer."""
    num_tokens, num_heads, head_size = v.shape
    if shards == 1 and out is not None and xp.is_contiguous(out):
        return out.reshape((1, *out.shape))
    return xp.empty_values((shards, num_tokens, num_heads // shards, head_size), like=v)


def sum_over_ranks(comm: Any, xp: Any, scaled: Any, out: Any) -> Any:
    """The sum of every rank's ``scaled`` ``[shards, T, heads, D]``: all of it (all-reduce, in place)
    for one shard, this rank's chunk (reduce-scatter, into ``out`` when it is contiguous) for many."""
    if scaled.shape[0] == 1:
        comm.all_reduce(scaled)
        return out if out is not None and xp.pointer(scaled) == xp.pointer(out) else scaled[0]
    merged = (
        out if out is not None and xp.is_contiguous(out) else xp.empty_values(scaled.shape[1:], like=scaled)
    )
    comm.reduce_scatter(merged, scaled)
    return merged


def _deliver(xp, merged_v, merged_s, out, out_lse):
    """The results, copied into the caller's outputs where given (and not already there)."""
    if out is not None and merged_v is not out:
        xp.assign(out, merged_v)
        merged_v = out
    if out_lse is not None and merged_s is not out_lse:
        xp.assign(out_lse, merged_s)
        merged_s = out_lse
    return merged_v, merged_s


def _communicator(v, group, stream):
    from . import _collectives

    if _collectives.is_torch_tensor(v):
        return _collectives.TorchGroup(group), _collectives.TorchOps()
    import cupy

    if isinstance(v, cupy.ndarray):
        return _collectives.CupyNccl(group, stream), _collectives.CupyOps(stream)
    raise TypeError(
        f"v: expected a torch tensor or a CuPy array, got {type(v).__module__}.{type(v).__name__}"
    )
