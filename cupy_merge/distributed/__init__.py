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
benchmarks/PERF.md has it beside measurements); in batch-invariant mode
(:func:`cupy_merge.set_batch_invariant`) it picks the exchanging strategy of the layout, whose
local merge takes the ranks' states in rank order: every rank gets the same bits, the same
as a merge of the gathered states on one GPU. The summing strategies' results follow
NCCL's order of summation, which no mode fixes. Attention sinks (``sinks=``) are
counted once over all ranks, by every strategy. The summing strategies add values in
their own dtype (as vLLM does): for 16-bit values each rank's term is rounded
once more than in the exchanging ones. Every rank must pass the same shapes, dtypes
and options (``lse_base``, ``op``, ``shard_heads``, the sinks, the batch-invariant mode), and a
rank with no tokens the same token count as its peers (LSE ``-inf``). ``check_ranks`` checks
that with one more small collective, and raises the same error on every rank where they
differ; it is on for CPU tensors and off on GPUs unless asked for (it waits for the GPU).
Unchecked, such calls make the collectives fail, wait until the group's timeout, or (where
the bytes happen to agree) return wrong values.

Communicators: a ``torch.distributed`` process group (NCCL for CUDA tensors,
gloo for CPU tensors) when ``v`` is a torch tensor; a
``cupy.cuda.nccl.NcclCommunicator`` when ``v`` is a CuPy array. Collectives and
kernels run on the ``stream`` given (made current for the call), else on the
current stream of the arrays' kind (NCCL's own streams ordered after it);
every buffer is allocated in the call, so ``torch.cuda.graph`` captures any
strategy. The arrays follow the merges' rules (``cupy_merge._checks``): values
with a contiguous last dimension, outputs that share no memory with the inputs
or within themselves.
"""

from __future__ import annotations

from typing import Any

from .. import _arrays
from .._arrays import Stream
from ..bound import BINDER
from ..types import Array, LseBase, Strategy
from . import _bound, _strategies
from ._bound import BoundAcrossRanks
from ._cost import (
    BYTES_PER_US,
    COLLECTIVE_US,
    FULL_HEAD_STRATEGIES,
    SHARDED_STRATEGIES,
    STRATEGIES,
    choose_strategy,
    strategy_costs,
)

__all__ = ["STRATEGIES", "BoundAcrossRanks", "choose_strategy", "merge_across_ranks", "strategy_costs"]
__all__ += ["BYTES_PER_US", "COLLECTIVE_US", "FULL_HEAD_STRATEGIES", "SHARDED_STRATEGIES"]


def merge_across_ranks(
    v: Array,
    s: Array,
    group: Any = None,
    *,
    op: Strategy = "auto",
    shard_heads: bool = False,
    out: Array | None = None,
    out_lse: Array | None = None,
    lse_base: LseBase = "e",
    sinks: Array | None = None,
    stream: Stream = None,
    check_ranks: bool | None = None,
) -> tuple[Array, Array]:
    """Merge this rank's partial attention state with every other rank's.

    Parameters
    ----------
    v : DeviceArray
        This rank's partial output, ``[num_tokens, num_heads, head_size]``, float32,
        float16 or bfloat16, any token and head strides: a torch tensor (CUDA, or
        CPU with gloo) or a CuPy array, the same shape on every rank.
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
        Where to write the merged values (the result's shape, ``v``'s dtype, any
        token and head strides); allocated if omitted.
    out_lse : DeviceArray, optional
        Where to write the merged LSE, float32, any strides; allocated if omitted.
    lse_base : {"e", 2}
        Base of every LSE in and out.
    sinks : DeviceArray, optional
        Attention sinks, float32 ``[num_heads]`` (all heads, on every rank alike):
        each head's logit counted once in the merge over all ranks.
    stream : Stream
        The stream the collectives and kernels run on (of the arrays' device);
        default: the current one (torch's or CuPy's).
    check_ranks : bool, optional
        Compare every rank's call (dtype, shape, ``lse_base``, ``shard_heads``, the
        strategy, the sinks' values) with one more small all-gather before the
        merge's collectives, and raise the same ``ValueError`` on every rank where
        they differ; a rank refusing its own arrays then tells its peers, which
        raise instead of waiting. It waits for the GPU (the host reads the result),
        so ``True`` raises ``ValueError`` while a CUDA graph is captured. Default:
        on for CPU tensors (gloo), and where the environment sets
        ``CUPY_MERGE_CHECK_RANKS=1`` or, for torch groups,
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (left out while a graph is captured);
        off otherwise. Whether to check must be the same on every rank (the same
        argument and environment): a rank checking while a peer does not runs one
        more collective than the peer.

    Returns
    -------
    v : DeviceArray
        The merge over all ranks' states, in ``v``'s array kind.
    s : DeviceArray
        Its log-sum-exp.

    Raises
    ------
    RuntimeError
        A torch input (``v``, ``s`` or ``sinks``) requires grad in grad mode: the
        collectives are not differentiable, so the merge records no autograd graph
        and would lose the gradient; refused before any collective, naming the
        argument. Under ``torch.no_grad()`` (or with detached inputs) it runs.
    TypeError
        An argument of the wrong kind or dtype, or a summing ``op`` for bfloat16
        values on a CuPy NCCL without bfloat16 (``cupy.cuda.nccl.NCCL_BFLOAT16``;
        ``"auto"`` then exchanges them instead); before any allocation, kernel or collective.
    ValueError
        An unknown strategy or one of the other layout, heads that do not
        divide among the ranks, outputs of the wrong shape or sharing memory,
        a stream of another device; before any collective (with ``check_ranks``, a
        rank refusing its arrays tells its peers with the check's gather first). With
        ``check_ranks``: ranks called differently, or a peer that refused its
        arguments, on every rank alike, before any of the merge's own collectives.

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
    call = _strategies.resolve(v, s, group, op, shard_heads, out, out_lse, lse_base, sinks, stream, check_ranks)
    with call.scope():
        result = _strategies.run(call)
    written = tuple(array for array in (out, out_lse) if array is not None)
    if written and call.adapter is _arrays.TORCH:
        _arrays.TORCH.mark_written(written)  # autograd's version counters, as the core merges keep them
    return result


setattr(merge_across_ranks, BINDER, _bound.bind)
