"""A cross-rank merge from its checked call to its results: the four strategies, as a client of the core.

:func:`resolve` checks a call with the merges' own rules (``_arrays`` describes
every array, ``_checks.check_rank`` and ``check_rank_addresses`` apply the
rules), picks the strategy, and returns a :class:`RankCall`; :func:`run` runs
it inside the call's stream scope. Kernels are planned by ``_plan`` and the
local merge of the exchanging strategies is the core N-way merge.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

from .. import _addresses, _arrays, _checks, _dispatch, _launch, _options, _tuning
from .._arrays import HOST, ArrayView
from .._checks import RANK_NAMES
from .._operands import RankOperands, StateShape
from ..merge_many import merge_states
from . import _agreement, _steps
from ._collectives import CupyNccl, TorchGroup
from ._cost import FULL_HEAD_STRATEGIES, SHARDED_STRATEGIES, choose_strategy

#: The strategies that add the values over ranks in their own dtype (the communicator must sum it),
#: and the exchanging strategy of each layout (by ``shard_heads``), which moves them as bytes.
SUMMING = ("allreduce", "allgather_reducescatter")
EXCHANGING = {False: "allgather", True: "alltoall"}


class RankCall(NamedTuple):
    """A checked cross-rank merge: its communicator, array kind, arrays, strategy and stream."""

    comm: Any
    adapter: _arrays.Adapter
    arrays: RankOperands  # the caller's arrays
    views: dict[str, ArrayView]  # of the arrays given
    op: str
    shards: int  # head groups of the result's exchange or sum: the world size if heads are sharded, else 1
    heads: int  # heads of the result
    lse_base_2: int
    stream: int | None  # raw pointer; None: the current stream of the arrays' kind
    state: StateShape  # of this rank's state (all its heads)

    def scope(self) -> Any:
        """The context every step runs in: the call's stream made current for its array kind."""
        return self.adapter.scope(self.stream, self.state.device)

    @property
    def on_gpu(self) -> bool:
        return self.state.device != HOST


def resolve(
    v: Any, s: Any, group: Any, op: Any, shard_heads: Any, out: Any, out_lse: Any, lse_base: Any, sinks: Any, stream: Any,
    check_ranks: Any = None, *, bound: bool = False,
) -> RankCall:  # fmt: skip
    """Every check of ``merge_across_ranks`` (``bound``: of ``cupy_merge.bind`` of it), before any
    of its collectives; ``"auto"`` resolved. Where ``check_ranks`` asks (``_agreement.wanted``), the
    ranks' calls are then compared, and a rank refusing its arguments tells its peers (where ``v``
    or ``s`` and ``group`` say how to reach them)."""
    peers = _Peers.of(v, s, group)
    try:
        call = _checked(peers, v, s, group, op, shard_heads, out, out_lse, lse_base, sinks, stream, bound)
        checking = _agreement.wanted(check_ranks, call.adapter, v) and call.comm.world_size > 1
    except Exception:
        if peers is not None and peers.comm.world_size > 1 and _agreement.wanted(
            check_ranks if check_ranks is None or isinstance(check_ranks, bool) else None, peers.adapter, peers.array
        ):
            with contextlib.suppress(Exception):  # this rank's own error says more than a failed gather
                _agreement.agree(peers.comm, peers.adapter, peers.device, _agreement.refused(), None,
                                 check_ranks is not None)  # fmt: skip
        raise
    if checking:
        sharded = call.shards > 1  # shard_heads, at more than one rank
        mine = _agreement.header(call.state, call.lse_base_2, sharded, call.op, sinks, call.adapter)
        _agreement.agree(call.comm, call.adapter, call.state.device, mine, call.stream, check_ranks is not None)
    return call


class _Peers(NamedTuple):
    """How a rank whose arguments are refused reaches its peers: the communicator ``group`` gives
    for the kind of ``v`` (or of ``s``, where ``v`` is of none), and the device to gather on."""

    comm: Any
    adapter: _arrays.Adapter
    array: Any  # v, or s
    device: int

    @classmethod
    def of(cls, v: Any, s: Any, group: Any) -> _Peers | None:
        for array in (v, s):
            try:
                adapter = _kind(array)
                comm = TorchGroup(group) if adapter is _arrays.TORCH else CupyNccl(group, None)
            except (TypeError, ValueError, RuntimeError, ImportError):  # the checks raise it again, saying why
                continue
            device = _device_of(array)
            if device is not None:
                return cls(comm, adapter, array, device)
        return None


def _checked(
    peers: _Peers | None, v: Any, s: Any, group: Any, op: Any, shard_heads: Any, out: Any, out_lse: Any,
    lse_base: Any, sinks: Any, stream: Any, bound: bool,
) -> RankCall:  # fmt: skip
    """This rank's own checks, in order: the options, the kind of ``v`` and its communicator, the
    arrays, the stream and the strategy."""
    shard_heads = _options.flag(shard_heads, "shard_heads")
    allowed = SHARDED_STRATEGIES if shard_heads else FULL_HEAD_STRATEGIES
    if op != "auto" and op not in allowed:
        raise ValueError(
            f"op: expected 'auto' or one of {', '.join(map(repr, allowed))} with shard_heads={shard_heads}, "
            f"got {op!r}"
        )
    lse_base_2 = _options.lse_base_flag(lse_base)
    adapter = _kind(v)
    if peers is not None and peers.array is v:
        comm = peers.comm
    else:
        comm = TorchGroup(group) if adapter is _arrays.TORCH else CupyNccl(group, None)
    arrays = RankOperands(v, s, out, out_lse, sinks)
    views = {}
    for field, obj in zip(arrays._fields, arrays):
        name = getattr(RANK_NAMES, field)
        if obj is None:
            continue
        if _kind(obj, name) is not adapter:
            raise TypeError(f"{name}: expected an array of the kind of v ({adapter.kind}), got {type(obj).__name__}")
        if field in ("out", "out_lse") and not adapter.writable(obj):
            raise TypeError(f"{name}: a read-only array cannot be written")
        views[field] = adapter.describe(obj, name, host=True) if adapter is _arrays.TORCH else adapter.describe(obj, name)
    specs = RankOperands(*(views[f].spec if f in views else None for f in arrays._fields))
    device = specs.v.device
    stream_ptr = _stream(stream, device)
    state, heads = _checks.check_rank(specs, RANK_NAMES, comm.world_size, shard_heads)
    _addresses.check_rank_addresses(RankOperands(**{f: views.get(f) for f in arrays._fields}), RANK_NAMES)
    if adapter is _arrays.TORCH:
        _refuse_grad(arrays, bound)
    if op == "auto" and _tuning.current().batch_invariant:
        op = EXCHANGING[shard_heads]  # the ranks' states merged in rank order; an NCCL sum's order is NCCL's
    elif op == "auto":
        op = choose_strategy(
            comm.world_size, state.head_size, specs.v.itemsize, shard_heads=shard_heads,
            rows=state.num_tokens * state.num_heads,
        )  # fmt: skip
        if op in SUMMING and not comm.sums(state.dtype):
            op = EXCHANGING[shard_heads]
    elif op in SUMMING and not comm.sums(state.dtype):
        raise TypeError(
            f"v: op={op!r} sums {state.dtype} values, and this CuPy's NCCL has no {state.dtype} "
            f"(cupy.cuda.nccl.NCCL_BFLOAT16: NCCL 2.10 or newer); use op={EXCHANGING[shard_heads]!r}, "
            f"which moves the values as bytes, or op='auto'"
        )
    shards = comm.world_size if shard_heads else 1
    return RankCall(comm, adapter, arrays, views, op, shards, heads, lse_base_2, stream_ptr, state)


def _device_of(v: Any) -> int | None:
    """``v``'s device (:data:`HOST` for a CPU tensor), or None where it has none a collective could use."""
    device = getattr(v, "device", None)
    if getattr(device, "type", None) == "cpu":
        return HOST
    index = getattr(device, "index", None)  # a CUDA torch device
    if index is None:
        index = getattr(device, "id", None)  # a CuPy device
    return index if isinstance(index, int) else None


def _refuse_grad(arrays: RankOperands, bound: bool) -> None:
    """The core's rule for merges that record no autograd graph: an input that requires grad is
    refused in grad mode (the collectives are not differentiable, so its gradient would be lost)."""
    if not _dispatch.grad_enabled():
        return
    for field in ("out", "out_lse"):  # written: refused as the core merges refuse them
        if getattr(getattr(arrays, field), "requires_grad", False):
            raise RuntimeError(
                f"{getattr(RANK_NAMES, field)}: requires grad, and merge_across_ranks writes into it; a merge into "
                f"given tensors is not differentiable: pass a tensor that does not require grad, leave it out, "
                f"or merge under torch.no_grad()"
            )
    for field in ("v", "s", "sinks"):
        if getattr(getattr(arrays, field), "requires_grad", False):
            name = getattr(RANK_NAMES, field)
            if bound:
                raise RuntimeError(
                    f"bind(merge_across_ranks): {name} requires grad, and a bound merge records no autograd graph; "
                    f"bind under torch.no_grad() or pass {name}.detach()"
                )
            raise RuntimeError(
                f"merge_across_ranks: {name} requires grad, and a merge across ranks records no autograd graph "
                f"(its collectives are not differentiable); call it under torch.no_grad() or pass {name}.detach()"
            )


def _kind(obj: Any, name: str = "v") -> _arrays.Adapter:
    adapter = None
    try:
        adapter = _arrays.adapter_for(obj, name)
    except TypeError:
        pass
    if adapter is not _arrays.TORCH and adapter is not _arrays.CUPY:
        raise TypeError(
            f"{name}: expected a torch tensor or a CuPy array, got {type(obj).__module__}.{type(obj).__name__}"
        )
    return adapter


def _stream(stream: Any, device: int) -> int | None:
    """The raw stream a call runs on (None: the current one), checked to be of the arrays' device."""
    if stream is None:
        return None
    pointer = _arrays.stream_pointer(stream)
    if device == HOST:
        raise TypeError("stream: CPU tensors (gloo) run on no CUDA stream; leave it out")
    if pointer > 2 and not _launch.stream_on_device(pointer, device):
        raise ValueError(f"stream: expected a stream of device {device}, where the arrays are; got another device's")
    return pointer


def run(call: RankCall) -> tuple[Any, Any]:
    """The merge: nothing when there are no rows (every rank alike), else the call's strategy."""
    if call.state.num_tokens == 0 or call.state.num_heads == 0:
        return _results(call, None, None)
    if call.op in ("allgather", "alltoall"):
        return by_exchange(call)
    return by_sum(call)


def _results(call: RankCall, merged_v: Any, merged_s: Any) -> tuple[Any, Any]:
    """The results in the caller's outputs where given (copied there when not already), else as made."""
    out, out_lse = call.arrays.out, call.arrays.out_lse
    if out is None:
        out = merged_v if merged_v is not None else _values(call, (call.state.num_tokens, call.heads, call.state.head_size))
    elif merged_v is not None and merged_v is not out:
        call.adapter.copy(out, merged_v)
    if out_lse is None:
        out_lse = merged_s if merged_s is not None else _lse(call, (call.heads, call.state.num_tokens))
    elif merged_s is not None and merged_s is not out_lse:
        call.adapter.copy(out_lse, merged_s)
    return out, out_lse


def _values(call: RankCall, shape: tuple[int, ...]) -> Any:
    return call.adapter.empty(shape, call.state.dtype, call.state.device, None)


def _lse(call: RankCall, shape: tuple[int, ...]) -> Any:
    return call.adapter.empty(shape, "float32", call.state.device, None)


def pack_buffer(call: RankCall) -> tuple[Any, _steps.ChunkLayout]:
    """A byte buffer for this rank's state as ``shards`` chunks, ``[shards, chunk_bytes]``, and its layout."""
    state = call.state
    itemsize = call.views["v"].itemsize
    layout = _steps.chunk_layout(state.num_tokens, state.num_heads // call.shards, state.head_size, itemsize)
    return call.adapter.empty((call.shards, layout.chunk_bytes), "uint8", state.device, None), layout


def received_buffer(call: RankCall, layout: _steps.ChunkLayout) -> Any:
    return call.adapter.empty((call.comm.world_size, layout.chunk_bytes), "uint8", call.state.device, None)


def own_sinks(call: RankCall) -> Any:
    """The sinks of the heads this rank's local merge produces: all of them, or its head group."""
    sinks = call.arrays.sinks
    if sinks is None or call.shards == 1:
        return sinks
    first = call.comm.rank * call.heads
    return sinks[first : first + call.heads]


def exchange(comm: Any, received: Any, packed: Any) -> None:
    """One chunk from every rank (all-gather), or each rank's chunk for this one (all-to-all)."""
    if packed.shape[0] == 1:
        comm.all_gather(received, packed.reshape(-1))
    else:
        comm.all_to_all(received, packed)


def by_exchange(call: RankCall) -> tuple[Any, Any]:
    """All-gather (one chunk) or all-to-all (a chunk per rank) of packed states, then the local merge."""
    packed, layout = pack_buffer(call)
    _steps.pack_states(call.adapter, call.arrays.v, call.arrays.s, call.views, packed, layout, None)
    received = received_buffer(call, layout)
    exchange(call.comm, received, packed)
    values, lse = _steps.chunk_views(call.adapter, received, layout, call.state.dtype)
    if call.on_gpu:
        return merge_states(
            values, lse, out=call.arrays.out, out_lse=call.arrays.out_lse,
            lse_base=2 if call.lse_base_2 else "e", sinks=own_sinks(call),
        )  # fmt: skip
    return _results(call, *_steps.merge_on_host(values, lse, call.lse_base_2, own_sinks(call)))


def gathered_buffer(call: RankCall) -> Any:
    state = call.state
    return _lse(call, (call.comm.world_size, state.num_heads, state.num_tokens))


def contiguous_lse(call: RankCall) -> tuple[Any, bool]:
    """The LSE a gather sends: ``s`` itself when contiguous, else a buffer to copy it into (True)."""
    s, view = call.arrays.s, call.views["s"]
    if view.strides == _arrays.contiguous_strides(view.shape):
        return s, False
    return _lse(call, tuple(view.shape)), True


def scale_buffer(call: RankCall) -> Any:
    """Where the scaled values go, ``[shards, T, H / shards, D]``: the caller's contiguous ``out``
    itself for an all-reduce (summed in place, nothing copied after), else a new buffer."""
    state, out = call.state, call.arrays.out
    view = call.views.get("out")
    if call.shards == 1 and view is not None and view.strides == _arrays.contiguous_strides(view.shape):
        return out.reshape((1, *out.shape))
    return _values(call, (call.shards, state.num_tokens, state.num_heads // call.shards, state.head_size))


def merged_lse_buffer(call: RankCall) -> Any:
    return call.arrays.out_lse if call.arrays.out_lse is not None else _lse(call, (call.heads, call.state.num_tokens))


def sum_over_ranks(call: RankCall, scaled: Any) -> Any:
    """The sum of every rank's ``scaled`` ``[shards, T, heads, D]``: all of it (all-reduce, in place)
    for one shard, this rank's chunk (reduce-scatter, into ``out`` when it is contiguous) for many."""
    out, view = call.arrays.out, call.views.get("out")
    if scaled.shape[0] == 1:
        call.comm.all_reduce(scaled)
        return out if out is not None and call.adapter.pointer(scaled) == view.ptr else scaled[0]  # type: ignore[union-attr]
    contiguous = view is not None and view.strides == _arrays.contiguous_strides(view.shape)
    merged = out if contiguous else _values(call, tuple(scaled.shape[1:]))
    call.comm.reduce_scatter(merged, scaled)
    return merged


def by_sum(call: RankCall) -> tuple[Any, Any]:
    """All-gather the LSEs; scale this rank's values by their weights; sum them over ranks."""
    gathered = gathered_buffer(call)
    lse, copy = contiguous_lse(call)
    if copy:
        call.adapter.copy(lse, call.arrays.s)
    call.comm.all_gather(gathered, lse)
    merged_lse = merged_lse_buffer(call)
    scaled = scale_buffer(call)
    _steps.scale_for_sum(
        call.adapter, call.arrays.v, call.views, gathered, call.comm.rank, scaled, merged_lse,
        call.lse_base_2, call.arrays.sinks, None,
    )  # fmt: skip
    return _results(call, sum_over_ranks(call, scaled), merged_lse)
