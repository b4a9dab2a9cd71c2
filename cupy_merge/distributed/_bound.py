"""A cross-rank merge bound to its arrays: buffers, kernel launches and the local merge prepared once.

Eager ``merge_across_ranks`` spends most of a small call on the host: checks,
four allocations, packing two kernel launches' arguments and planning the local
merge on buffers it has just allocated. A decode loop merges the same arrays
step after step, so :class:`BoundAcrossRanks` does all of that once; a launch is
then one or two kernels and the collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .. import _arrays
from .._checks import RANK_NAMES
from ..bound import PointerGuard
from ..bound import bind as bind_merge
from ..merge_many import merge_states
from . import _steps, _strategies


class BoundAcrossRanks:
    """``merge_across_ranks`` bound to its arrays: ``bound(stream=None)`` runs it again.

    Made by ``cupy_merge.bind(merge_across_ranks, v, s, group, ...)``. Holds its
    buffers and the outputs it allocated (the same arrays are returned by every
    launch) for as long as it lives. The arrays are merged as they were when bound
    (shapes and strides are not read again); a torch tensor whose data pointer has
    changed since is refused with ``RuntimeError`` before anything runs. Every
    rank must launch its bound merge alike, in the same order as its other
    collectives. CPU tensors (gloo) are merged by ``merge_across_ranks`` itself at
    each launch, into the same outputs. Like the core's bound merges it records no
    autograd graph: binding inputs that require grad in grad mode raises ``RuntimeError``
    (bind under ``torch.no_grad()``), and no launch makes its outputs require grad.

    Parameters
    ----------
    call : RankCall
        The checked merge, from ``cupy_merge.distributed._strategies.resolve``.
    rerun : callable
        The merge as called, taking ``out=`` and ``out_lse=``: what a launch runs on CPU tensors.

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

    __slots__ = ("_adapter", "_device", "_guard", "_result", "_run")
    _run: Callable[[int | None], None]

    def __init__(self, call: _strategies.RankCall, rerun: Any):
        state = call.state
        out = call.arrays.out
        if out is None:
            out = _strategies._values(call, (state.num_tokens, call.heads, state.head_size))
        out_lse = _strategies.merged_lse_buffer(call)
        call = call._replace(arrays=call.arrays._replace(out=out, out_lse=out_lse))
        for field in ("out", "out_lse"):
            call.views[field] = call.adapter.describe(getattr(call.arrays, field), field, **_host(call))
        self._result = (out, out_lse)
        self._adapter = call.adapter
        self._device = state.device
        self._guard = PointerGuard(tuple(call.arrays), tuple(RANK_NAMES))
        steps: Callable[[], None]
        if not call.on_gpu:
            steps = functools.partial(rerun, out=out, out_lse=out_lse)
        elif state.num_tokens == 0 or state.num_heads == 0:
            steps = _nothing
        elif call.op in ("allgather", "alltoall"):
            steps = _exchange_steps(call)
        else:
            steps = _sum_steps(call)
        self._run = functools.partial(_in_scope, call, steps)

    def __call__(self, stream: Any = None) -> tuple[Any, Any]:
        """Run the merge again: collectives and kernels on ``stream`` (default: the current one).

        Parameters
        ----------
        stream : Stream
            A CuPy or torch stream (or raw pointer) of the arrays' device; None for the current one.

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
        self._guard.check()
        self._run(_strategies._stream(stream, self._device))
        if self._adapter is _arrays.TORCH:
            _arrays.TORCH.mark_written(self._result)  # each launch writes them again
        return self._result


def _nothing() -> None:
    pass


def _host(call: _strategies.RankCall) -> dict:
    return {"host": True} if call.adapter is _arrays.TORCH else {}


def _in_scope(call: _strategies.RankCall, steps: Any, stream: int | None) -> None:
    with call._replace(stream=stream).scope():
        steps()


def _exchange_steps(call: _strategies.RankCall):
    """Pack, all-gather or all-to-all, and the local merge bound on the received chunks."""
    packed, layout = _strategies.pack_buffer(call)
    received = _strategies.received_buffer(call, layout)
    pack = _steps.prepare_pack(call.views, packed, call.adapter.pointer(packed), layout)
    values, lse = _steps.chunk_views(call.adapter, received, layout, call.state.dtype)
    local = bind_merge(
        merge_states, values, lse, out=call.arrays.out, out_lse=call.arrays.out_lse,
        lse_base=2 if call.lse_base_2 else "e", sinks=_strategies.own_sinks(call),
    )  # fmt: skip
    adapter = call.adapter

    def run() -> None:
        _steps.launch(pack, None, adapter)
        _strategies.exchange(call.comm, received, packed)
        local()

    return run


def _sum_steps(call: _strategies.RankCall):
    """All-gather the LSEs, the scaling kernel, and the all-reduce or reduce-scatter."""
    gathered = _strategies.gathered_buffer(call)
    lse, copy = _strategies.contiguous_lse(call)
    scaled = _strategies.scale_buffer(call)
    scale = _steps.prepare_scale(call.adapter, call.views, gathered, call.comm.rank, scaled, call.arrays.out_lse,
                                 call.lse_base_2)  # fmt: skip
    adapter, s, out = call.adapter, call.arrays.s, call.arrays.out

    def run() -> None:
        if copy:
            adapter.copy(lse, s)
        call.comm.all_gather(gathered, lse)
        _steps.launch(scale, None, adapter)
        merged = _strategies.sum_over_ranks(call, scaled)
        if merged is not out:
            adapter.copy(out, merged)

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
    sinks: Any = None,
    check_ranks: Any = None,
) -> BoundAcrossRanks:
    """``merge_across_ranks``'s arguments, checked and prepared once (what ``cupy_merge.bind`` calls);
    with ``check_ranks`` the ranks' calls are compared here, once, when every rank binds (not at
    each launch, CPU tensors' included)."""
    call = _strategies.resolve(
        v, s, group, op, shard_heads, out, out_lse, lse_base, sinks, None, check_ranks, bound=True
    )

    def rerun(out: Any, out_lse: Any) -> None:
        import torch

        # A launch records no autograd graph on the CPU either, as the GPU's kernels do not.
        with torch.no_grad():
            _strategies.run(
                _strategies.resolve(v, s, group, op, shard_heads, out, out_lse, lse_base, sinks, None, False)
            )

    return BoundAcrossRanks(call, rerun)
