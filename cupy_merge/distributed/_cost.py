"""The cost model that picks a cross-rank strategy: collectives and the bytes each moves."""

from __future__ import annotations

#: Strategies for results of all heads, and for head-sharded results.
FULL_HEAD_STRATEGIES = ("allgather", "allreduce")
SHARDED_STRATEGIES = ("alltoall", "allgather_reducescatter")
STRATEGIES = ("auto", *FULL_HEAD_STRATEGIES, *SHARDED_STRATEGIES)

#: The cost model's time per collective and bytes per microsecond a rank sends: bare eager NCCL
#: collectives on two H200s over NVLink took 22-40 us each at a few kB and moved 200-225 GB/s per
#: rank at 17-34 MB (benchmarks/PERF.md, session 5). Under CUDA graphs a collective costs 10-15 us.
COLLECTIVE_US = 35.0
BYTES_PER_US = 200e3


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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int of at least 1 (ranks in the group), got {world_size!r}")
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
    """Each strategy's collectives, as the bytes a rank sends per row in each (ring algorithms).

    Parameters
    ----------
    world_size : int
        Ranks in the group.
    row_bytes : int
        Bytes in a row of values (``head_size * itemsize``).

    Returns
    -------
    dict
        Strategy name -> the bytes a rank sends per row, one entry per collective.

    Examples
    --------
    >>> from cupy_merge.distributed import strategy_costs
    >>> strategy_costs(2, 256)["allgather"]
    (260.0,)
    """
    w = world_size
    lse_gather = 4.0 * (w - 1)
    return {
        "allgather": ((w - 1) * (row_bytes + 4.0),),
        "allreduce": (lse_gather, 2.0 * row_bytes * (w - 1) / w),
        "alltoall": ((row_bytes + 4.0) * (w - 1) / w,),
        "allgather_reducescatter": (lse_gather, row_bytes * (w - 1) / w),
    }
