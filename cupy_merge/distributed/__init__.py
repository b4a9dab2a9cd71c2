"""Merging attention states across ranks (context-parallel decode): one call, on real collectives.

Every rank holds the attention state of the same queries over its own shard of
the KV cache, ``v`` ``[num_tokens, num_heads, head_size]`` and ``s``
``[num_heads, num_tokens]``, and receives the merge over all shards. Two
strategies, both exact up to float32 rounding:

* ``"allreduce"``: one small all-reduce (MAX of the LSEs), then one all-reduce
  (SUM) of a float32 buffer ``[tokens, heads, head_size + 1]`` holding each
  rank's rows scaled by ``exp(s - max)`` and those weights. Per rank it moves
  about ``2 (W - 1) / W * 4 (head_size + 1)`` bytes per row, whatever the world
  size ``W``.
* ``"allgather"``: one all-gather of the states in their own dtype, then the
  local one-pass N-way merge. Per rank it receives ``(W - 1) (head_size *
  itemsize + 4)`` bytes per row: cheaper for few ranks, linear in ``W``.

``"auto"`` picks the one that moves fewer bytes (docs/PERF.md has the cost model
and the measurements on two H200s).

Communicators: a ``torch.distributed`` process group (NCCL for CUDA tensors,
gloo for CPU tensors) when ``v`` is a torch tensor; a
``cupy.cuda.nccl.NcclCommunicator`` when ``v`` is a CuPy array. Collectives run
where the backend runs them: torch's NCCL streams ordered after torch's current
stream, or the CuPy ``stream`` given (default: the current one).
"""

from __future__ import annotations

import math
from typing import Any

from .. import _checks
from .._arrays import DeviceArray, Stream

__all__ = ["STRATEGIES", "choose_strategy", "merge_across_ranks"]

STRATEGIES = ("auto", "allreduce", "allgather")


def merge_across_ranks(
    v: DeviceArray,
    s: DeviceArray,
    group: Any = None,
    *,
    op: str = "auto",
    out: DeviceArray | None = None,
    out_lse: DeviceArray | None = None,
    lse_base: str | int = "e",
    stream: Stream = None,
) -> tuple[DeviceArray, DeviceArray]:
    """Merge this rank's partial attention state with every other rank's; all ranks get the result.

    Parameters
    ----------
    v : DeviceArray
        This rank's partial output, ``[num_tokens, num_heads, head_size]``, float32,
        float16 or bfloat16: a torch tensor (CUDA, or CPU with gloo) or a CuPy array,
        the same shape on every rank.
    s : DeviceArray
        Its log-sum-exp, float32 ``[num_heads, num_tokens]``; a rank with an empty
        shard passes ``-inf`` (or ``+inf``) and contributes nothing.
    group : object, optional
        For torch tensors a process group (None: the default group); for CuPy
        arrays a ``cupy.cuda.nccl.NcclCommunicator``.
    op : {"auto", "allreduce", "allgather"}
        The strategy (see the module's description); ``"auto"`` picks the one
        that moves fewer bytes.
    out : DeviceArray, optional
        Where to write the merged values, ``[num_tokens, num_heads, head_size]``
        of ``v``'s dtype; allocated if omitted.
    out_lse : DeviceArray, optional
        Where to write the merged LSE, float32 ``[num_heads, num_tokens]``;
        allocated if omitted.
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
    >>> dist.destroy_process_group()
    """
    if op not in STRATEGIES:
        raise ValueError(f"op: expected one of {', '.join(map(repr, STRATEGIES))}, got {op!r}")
    lse_base_2 = _checks.lse_base_flag(lse_base)
    comm, xp = _communicator(v, group, stream)
    _num_tokens, _num_heads, head_size = _checks.check_rank_state(
        tuple(v.shape), xp.dtype_name(v), tuple(s.shape), xp.dtype_name(s), xp.device_of(v), xp.device_of(s)
    )
    for given, like, name in ((out, v, "out"), (out_lse, s, "out_lse")):
        if given is not None:
            _checks.check_rank_output(
                name, (tuple(given.shape), xp.dtype_name(given), xp.device_of(given)),
                (tuple(like.shape), xp.dtype_name(like), xp.device_of(like)),
            )  # fmt: skip
    if op == "auto":
        op = choose_strategy(comm.world_size, head_size, xp.itemsize(v))
    to_natural = math.log(2.0) if lse_base_2 else 1.0
    with xp.on_stream():
        if op == "allreduce":
            merged_v, merged_s = _merge_by_allreduce(comm, xp, v, s, to_natural)
        else:
            merged_v, merged_s = _merge_by_allgather(comm, xp, v, s, lse_base, to_natural)
        return _deliver(xp, merged_v, merged_s, out, out_lse)


def choose_strategy(world_size: int, head_size: int, itemsize: int) -> str:
    """The strategy that moves fewer bytes per rank for one row: what ``op="auto"`` runs.

    Parameters
    ----------
    world_size : int
        Ranks in the group.
    head_size : int
        Elements in a row of values.
    itemsize : int
        Bytes per value element (2 for float16 and bfloat16, 4 for float32).

    Returns
    -------
    str
        ``"allgather"`` or ``"allreduce"``; ties go to ``"allgather"`` (one collective).

    Examples
    --------
    >>> from cupy_merge.distributed import choose_strategy
    >>> choose_strategy(2, 128, 2), choose_strategy(16, 128, 2)
    ('allgather', 'allreduce')
    """
    gather = (world_size - 1) * (head_size * itemsize + 4)
    reduce = 2 * (world_size - 1) / world_size * 4 * (head_size + 1) + 2 * (world_size - 1) / world_size * 4
    return "allgather" if gather <= reduce else "allreduce"


def _merge_by_allreduce(comm, xp, v, s, to_natural: float):
    s = xp.empty_to_neg_inf(s) * to_natural
    # A NaN LSE enters the maximum as +inf, so that its row ends NaN on every rank
    # (a MAX reduction may otherwise drop NaN and read the row as empty).
    lse_max = xp.contiguous(xp.where(xp.isnan(s), math.inf, s))
    comm.all_reduce(lse_max, "max")
    # exp(s - max) of a row empty on every rank would be exp(-inf + inf) = NaN: those weigh 0.
    weight = xp.where(lse_max == -math.inf, 0.0, xp.exp(s - lse_max))  # [heads, tokens]
    num_tokens, num_heads, head_size = v.shape
    buffer = xp.empty_float32((num_tokens, num_heads, head_size + 1), like=v)
    row_weight = xp.transpose(weight)[..., None]
    # A state of weight zero contributes nothing, even if its values are NaN.
    buffer[..., :head_size] = xp.where(row_weight == 0.0, 0.0, row_weight * xp.to_float32(v))
    buffer[..., head_size] = xp.transpose(weight)
    comm.all_reduce(buffer, "sum")
    total = xp.transpose(buffer[..., head_size])  # [heads, tokens]
    values = xp.where(buffer[..., head_size:] == 0.0, 0.0, buffer[..., :head_size] / buffer[..., head_size:])
    merged_lse = xp.where(lse_max == -math.inf, -math.inf, lse_max + xp.log(total)) / to_natural
    return xp.cast_like(values, v), merged_lse


def _merge_by_allgather(comm, xp, v, s, lse_base, to_natural: float):
    world = comm.world_size
    gathered_v = xp.empty_like_stacked(v, world)
    gathered_s = xp.empty_like_stacked(s, world)
    comm.all_gather(gathered_v, xp.contiguous(v))
    comm.all_gather(gathered_s, xp.contiguous(s))
    if xp.on_gpu(v):
        from ..merge_many import merge_states

        return merge_states(gathered_v, gathered_s, lse_base=lse_base)
    return _merge_stacked_states(xp, gathered_v, gathered_s, to_natural)


def _merge_stacked_states(xp, v, s, to_natural: float = 1.0):
    """The N-way merge in plain torch operations, for devices the kernels do not run on (gloo's CPU).

    ``v`` ``[states, tokens, heads, head_size]``, ``s`` ``[states, heads, tokens]``; same rules as the kernels.
    """
    s = xp.empty_to_neg_inf(s) * to_natural
    lse_max = xp.amax(xp.where(xp.isnan(s), math.inf, s), 0)
    weight = xp.where(lse_max == -math.inf, 0.0, xp.exp(s - lse_max))  # [states, heads, tokens]
    total = xp.sum(weight, 0)
    row_weight = xp.transpose(weight)[..., None]  # [states, tokens, heads, 1]
    weighted = xp.sum(xp.where(row_weight == 0.0, 0.0, row_weight * xp.to_float32(v)), 0)
    row_total = xp.transpose(total)[..., None]
    values = xp.where(row_total == 0.0, 0.0, weighted / row_total)
    merged_lse = xp.where(lse_max == -math.inf, -math.inf, lse_max + xp.log(total)) / to_natural
    return xp.cast_like(values, v), merged_lse


def _deliver(xp, merged_v, merged_s, out, out_lse):
    if out is not None:
        xp.assign(out, merged_v)
        merged_v = out
    if out_lse is not None:
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
