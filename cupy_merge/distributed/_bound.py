"""A cross-rank merge bound to its arrays: buffers, kernel launches and the local merge prepared once.

Eager ``merge_across_ranks`` spends most of a small call on the host: checks,
four allocations, packing two kernel launches' arguments and planning the local
merge on buffers it has just allocated. A decode loop merges the same arrays
step after step, so :class:`BoundAcrossRanks` does all of that once; a launch is
then one or two kernels and the collectives.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .. import _arrays
from . import _steps


class BoundAcrossRanks:
    """``merge_across_ranks`` bound to its arrays: ``bound(stream=None)`` runs it again.

    Made by ``cupy_merge.bind(merge_across_ranks, v, s, group, ...)``. Holds its
    buffers and the outputs it allocated (the same arrays are returned by every
    launch) for as long as it lives. The arrays are merged as they were when bound
    (shapes and strides are not read again); a torch tensor whose data pointer has
    changed since is refused with ``RuntimeError`` before anything runs. Every
    rank must launch its bound merge alike, in the same order as its other
    collectives. CPU tensors (gloo) are merged by ``merge_across_ranks`` itself at
    each launch, into the same outputs.

    Parameters
    ----------
    call : CrossRankCall
        The checked merge, from ``cupy_merge.distributed.resolve``.
    rerun : callable
        The merge as called, taking ``out=`` and ``out_lse=``: what a launch runs on CPU tensors.
    v : DeviceArray
        The values as given (``call.v`` is a contiguous copy when their last dimension was strided).

    Examples
    --------
    Under ``torchrun``, every rank alike (a one-rank gloo group here):

    >>> import torch, torch.distributed as dist, cupy_merge as cm
    >>> from cupy_merge.distributed import merge_across_ranks
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29518", rank=0, world_size=1)
    >>> v, s = torch.ones(4, 2, 8), torch.zeros(2, 4)
    >>> merge = cm.bind(merge_across_ranks, v, s, shard_heads=True)
    >>> out, lse = merge()
    >>> merge()[0] is out, bool(torch.equal(out, v))
    (True, True)
    >>> dist.destroy_process_group()
    """

    __slots__ = ("_result", "_run", "_streams", "_torch_pointers")

    def __init__(self, call: Any, rerun: Any, v: Any):
        xp = call.xp
        num_tokens, num_heads, head_size = call.v.shape
        heads = num_heads // call.shards
        out = (
            call.out if call.out is not None else xp.empty_values((num_tokens, heads, head_size), like=call.v)
        )
        out_lse = call.out_lse if call.out_lse is not None else xp.empty_lse((heads, num_tokens), like=call.v)
        self._result = (out, out_lse)
        self._streams = xp
        torch = _arrays.torch_module()
        self._torch_pointers = tuple(
            (array, array.data_ptr(), name)
            for array, name in ((v, "v"), (call.s, "s"), (out, "out"), (out_lse, "out_lse"))
            if torch is not None and isinstance(array, torch.Tensor)
        )
        # Each step function's closure holds the buffers it launches on.
        if not xp.on_gpu(v):
            self._run = lambda: rerun(out=out, out_lse=out_lse)
            return
        steps = (
            _exchange_steps(call, out, out_lse)
            if call.op in ("allgather", "alltoall")
            else _sum_steps(call, out, out_lse)
        )
        if call.v is v:
            self._run = steps
        else:  # the kernels read the contiguous copy: refresh it at each launch

            def refresh_then_run() -> None:
                xp.assign(call.v, v)
                steps()

            self._run = refresh_then_run

    def __call__(self, stream: Any = None) -> tuple[Any, Any]:
        """Run the merge again: collectives and kernels on ``stream`` (default: the current one).

        Parameters
        ----------
        stream : Stream
            A CuPy or torch stream (or raw pointer) of the arrays' kind; None for the current one.

        Returns
        -------
        tuple
            The merged values and LSE: the same arrays at every launch.

        Examples
        --------
        >>> import torch, torch.distributed as dist, cupy_merge as cm
        >>> from cupy_merge.distributed import merge_across_ranks
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29519", rank=0, world_size=1)
        >>> merge = cm.bind(merge_across_ranks, torch.ones(2, 4, 8), torch.zeros(4, 2))
        >>> tuple(merge()[0].shape)
        (2, 4, 8)
        >>> dist.destroy_process_group()
        """
        for tensor, pointer, name in self._torch_pointers:
            if tensor.data_ptr() != pointer:
                raise RuntimeError(
                    f"{name}: no longer points at the memory this merge was bound to (its storage was "
                    f"replaced, resized or freed); bind the merge again"
                )
        with self._streams.stream_context(stream) if stream is not None else contextlib.nullcontext():
            self._run()
        return self._result


def _exchange_steps(call: Any, out: Any, out_lse: Any):
    """Pack, all-gather or all-to-all, and the local merge bound on the received chunks."""
    from .. import bind
    from ..merge_many import merge_states
    from . import exchange

    comm, xp, v = call.comm, call.xp, call.v
    packed, layout = _steps.pack_buffer(xp, v, call.shards)
    received = xp.empty_bytes((comm.world_size, layout.chunk_bytes), like=v)
    pack = _steps.prepare_pack(xp, v, call.s, packed, layout)
    values, lse = _steps.chunk_views(xp, received, layout, v.dtype)
    local = bind(merge_states, values, lse, out=out, out_lse=out_lse, lse_base=2 if call.lse_base_2 else "e")

    def run() -> None:
        _steps.launch(xp, pack)
        exchange(comm, received, packed)
        local()

    return run


def _sum_steps(call: Any, out: Any, out_lse: Any):
    """All-gather the LSEs, the scaling kernel, and the all-reduce or reduce-scatter."""
    from . import scale_buffer, sum_over_ranks

    comm, xp, v, s = call.comm, call.xp, call.v, call.s
    num_tokens, num_heads, _ = v.shape
    gathered = xp.empty_lse((comm.world_size, num_heads, num_tokens), like=v)
    lse = s if xp.is_contiguous(s) else xp.empty_lse(tuple(s.shape), like=v)
    scaled = scale_buffer(xp, v, call.shards, out)
    scale = _steps.prepare_scale(xp, v, gathered, comm.rank, scaled, out_lse, call.lse_base_2)

    def run() -> None:
        if lse is not s:
            xp.assign(lse, s)
        comm.all_gather(gathered, lse)
        _steps.launch(xp, scale)
        merged = sum_over_ranks(comm, xp, scaled, out)
        if merged is not out:
            xp.assign(out, merged)

    return run


def bind(
    v: Any,
    s: Any,
    group: Any = None,
    *,
    op: str = "auto",
    shard_heads: bool = False,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
) -> BoundAcrossRanks:
    """``merge_across_ranks``'s arguments, checked and prepared once (what ``cupy_merge.bind`` calls)."""
    import functools

    from . import merge_across_ranks, resolve

    call = resolve(v, s, group, op, shard_heads, out, out_lse, lse_base, None)
    rerun = functools.partial(
        merge_across_ranks, v, s, group, op=op, shard_heads=shard_heads, lse_base=lse_base
    )
    return BoundAcrossRanks(call, rerun, v)
