"""The steps around a cross-rank merge's collectives, on the GPU as NVRTC kernels, on the host as torch operations.

* *Pack*: this rank's values and LSE in one byte buffer of equal chunks, one
  per head group (``cuda_src/merge_across_ranks.cu``, ``pack_states``), so one
  all-gather or one all-to-all moves both; the receiver reads the chunks in
  place through strided views (:func:`chunk_views`), with no unpacking.
* *Scale*: with every rank's LSE at hand, this rank's values times their final
  weight (sinks counted once), so that a plain sum over ranks (all-reduce,
  reduce-scatter) is the merge; and the merged LSE (``scale_for_sum``).

Launches are planned by the core's planner (``_plan.plan_rank_step``) and bound
by its launcher. The host versions (torch CPU tensors, as gloo runs them)
follow the same rules and write the same layouts, so the CPU tests in CI check
the strategies' logic.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .. import _catalogue as cat
from .. import _launch, _plan
from .._arrays import HOST, ArrayView
from .._plan import Pointer


class ChunkLayout(NamedTuple):
    """One head group's chunk of a packed buffer: values ``[tokens, heads, head_size]``, then the LSE."""

    num_tokens: int
    heads: int
    head_size: int
    itemsize: int
    chunk_bytes: int
    lse_offset: int


def chunk_layout(num_tokens: int, heads: int, head_size: int, itemsize: int) -> ChunkLayout:
    """Each part starts on 16 bytes, so every chunk's values and LSE are aligned views."""
    lse_offset = _round_up(num_tokens * heads * head_size * itemsize, 16)
    chunk_bytes = _round_up(lse_offset + num_tokens * heads * 4, 16)
    return ChunkLayout(num_tokens, heads, head_size, itemsize, chunk_bytes, lse_offset)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def chunk_views(adapter: Any, buffer: Any, layout: ChunkLayout, dtype: str) -> tuple[Any, Any]:
    """``buffer`` (bytes ``[chunks, chunk_bytes]``) as values ``[chunks, tokens, heads, head_size]``
    and LSE ``[chunks, heads, tokens]``, the stacked layout the N-way merge takes."""
    chunks = buffer.shape[0]
    tokens, heads, head_size, itemsize = layout.num_tokens, layout.heads, layout.head_size, layout.itemsize
    values = adapter.view(
        buffer, dtype, (chunks, tokens, heads, head_size),
        (layout.chunk_bytes // itemsize, heads * head_size, head_size, 1), 0,
    )  # fmt: skip
    lse = adapter.view(
        buffer, "float32", (chunks, heads, tokens), (layout.chunk_bytes // 4, tokens, 1), layout.lse_offset
    )
    return values, lse


def pack_states(adapter: Any, v: Any, s: Any, views: dict, packed: Any, layout: ChunkLayout, stream: int | None) -> None:
    """``v`` ``[T, H, D]`` and ``s`` ``[H, T]`` (any strides) into ``packed``'s chunks of ``H / chunks`` heads."""
    if views["v"].device != HOST:
        launch(prepare_pack(views, packed, adapter.pointer(packed), layout), stream, adapter)
        return
    num_tokens, num_heads, head_size = v.shape
    shards = packed.shape[0]
    values, lse = chunk_views(adapter, packed, layout, views["v"].dtype)
    values.copy_(v.reshape(num_tokens, shards, num_heads // shards, head_size).transpose(0, 1))
    lse.copy_(s.reshape(shards, num_heads // shards, num_tokens))


def prepare_pack(views: dict, packed: Any, packed_ptr: int, layout: ChunkLayout) -> _launch.PreparedLaunch:
    """The packing kernel's launch for these arrays (``views``: ArrayViews of ``v`` and ``s``)."""
    v, s = views["v"], views["s"]
    num_tokens, num_heads, head_size = v.shape
    args = {
        "packed": Pointer("packed"), "v": Pointer("v"), "lse": Pointer("s"),
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "heads_per_shard": num_heads // packed.shape[0],
        "chunk_bytes": layout.chunk_bytes, "lse_offset": layout.lse_offset,
        "v_stride_token": v.strides[0], "v_stride_head": v.strides[1],
        "lse_stride_head": s.strides[0], "lse_stride_token": s.strides[1],
    }  # fmt: skip
    packed_view = v._replace(ptr=packed_ptr, shape=(packed.shape[0] * layout.chunk_bytes // v.itemsize,),
                             strides=(1,))  # fmt: skip
    return _prepare(cat.RANK_PACK, v, [v, packed_view], args, {"packed": packed_ptr, "v": v.ptr, "s": s.ptr})


def scale_for_sum(
    adapter: Any, v: Any, views: dict, gathered_s: Any, rank: int, scaled: Any, out_lse: Any, lse_base_2: int,
    sinks: Any, stream: int | None,
) -> None:  # fmt: skip
    """This rank's values times their final weights into ``scaled`` ``[shards, T, H / shards, D]``.

    ``gathered_s``: every rank's LSE, ``[world, H, T]`` contiguous float32. The merged
    LSE of head group ``rank`` (all heads when ``shards`` is 1) is written to ``out_lse``.
    """
    if views["v"].device != HOST:
        launch(prepare_scale(adapter, views, gathered_s, rank, scaled, out_lse, lse_base_2), stream, adapter)
    else:
        _scale_on_host(adapter, v, gathered_s, rank, scaled, out_lse, lse_base_2, sinks)


def prepare_scale(
    adapter: Any, views: dict, gathered_s: Any, rank: int, scaled: Any, out_lse: Any, lse_base_2: int
) -> _launch.PreparedLaunch:
    """The scaling kernel's launch for these arrays (``views``: ArrayViews of ``v`` and any ``sinks``)."""
    v, sinks = views["v"], views.get("sinks")
    num_tokens, num_heads, head_size = v.shape
    shards = scaled.shape[0]
    heads = num_heads // shards
    out_lse_view = adapter.describe(out_lse, "out_lse")
    scaled_view = adapter.describe(scaled, "out")
    args = {
        "scaled": Pointer("scaled"), "out_lse": Pointer("out_lse"), "v": Pointer("v"),
        "gathered_lse": Pointer("gathered"), "world": gathered_s.shape[0], "rank": rank,
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size, "heads_per_shard": heads,
        "chunk_elements": num_tokens * heads * head_size, "first_head": rank * heads if shards > 1 else 0,
        "out_heads": out_lse.shape[0], "v_stride_token": v.strides[0], "v_stride_head": v.strides[1],
        "out_lse_stride_head": _stride(out_lse_view, 0), "out_lse_stride_token": _stride(out_lse_view, 1),
        "lse_base_2": lse_base_2,
        "sinks": Pointer("sinks") if sinks is not None else 0, "sinks_stride": _stride(sinks, 0),
    }  # fmt: skip
    addresses = {"scaled": scaled_view.ptr, "out_lse": out_lse_view.ptr, "v": v.ptr,
                 "gathered": adapter.pointer(gathered_s), "sinks": sinks.ptr if sinks is not None else 0}  # fmt: skip
    return _prepare(cat.RANK_SCALE, v, [v, scaled_view], args, addresses)


def _stride(view: ArrayView | None, dim: int) -> int:
    return view.strides[dim] if view is not None and view.shape[dim] > 1 else 0


def _scale_on_host(adapter, v, gathered_s, rank, scaled, out_lse, lse_base_2, sinks) -> None:
    import torch

    shards = scaled.shape[0]
    first_head = rank * (v.shape[1] // shards) if shards > 1 else 0
    to_natural = math.log(2.0) if lse_base_2 else 1.0
    s = torch.where(gathered_s == math.inf, -math.inf, gathered_s) * to_natural  # [W, H, T]
    if sinks is not None:  # the sink: one more state of value 0, counted once
        s = torch.cat([s, sinks.float().reshape(1, -1, 1).expand(1, *s.shape[1:])])
    takes_all = torch.isposinf(s[-1]) if sinks is not None else torch.zeros_like(s[0], dtype=torch.bool)
    any_nan = torch.isnan(s).any(0)
    lse_max = torch.where(torch.isnan(s), -math.inf, s).amax(0)
    empty = lse_max == -math.inf
    weights = torch.where(empty, 0.0, torch.exp(s - torch.where(empty | takes_all, 0.0, lse_max)))
    total = weights.sum(0)
    own = torch.where(total == 0.0, 0.0, weights[rank] / torch.where(total == 0.0, 1.0, total))
    own = torch.where(takes_all, 0.0, own)
    own = torch.where(any_nan, math.nan, own)
    row_weight = own.T[..., None]  # [T, H, 1]
    # A state of weight zero adds exactly 0, even if its values are NaN (an empty shard).
    values = torch.where(row_weight == 0.0, 0.0, row_weight * v.float()).to(v.dtype)
    num_tokens, num_heads, head_size = v.shape
    scaled.copy_(values.reshape(num_tokens, shards, num_heads // shards, head_size).transpose(0, 1))
    merged = torch.where(empty, -math.inf, lse_max + torch.log(total)) / to_natural
    merged = torch.where(takes_all, math.inf, merged)
    merged = torch.where(any_nan, math.nan, merged)
    out_lse.copy_(merged[first_head : first_head + out_lse.shape[0]])


_prepared: dict[tuple, _launch.PreparedLaunch] = {}
_MAX_PREPARED = 1024


def _prepare(
    family: cat.KernelFamily, v: ArrayView, touched: list[ArrayView], args: dict, addresses: dict
) -> _launch.PreparedLaunch:
    """A rank step's launch, planned by the core (16-byte packs where every array it touches
    keeps them aligned) and bound to ``addresses``.

    Prepared launches are kept by their arguments and addresses: a serving loop's buffers
    come back from the caching allocator at the same addresses, so a step's launches are
    found again instead of packed anew.
    """
    key = (family.name, v.dtype, v.device, tuple(sorted(args.items())), tuple(sorted(addresses.items())))
    prepared = _prepared.get(key)
    if prepared is None:
        specs = [view.spec for view in touched]
        launch_plan = _plan.plan_rank_step(family, v.dtype, v.shape[0] * v.shape[1], v.shape[2], specs, args)
        prepared = _launch.prepare(launch_plan, v.device, addresses)
        if len(_prepared) >= _MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def launch(prepared: _launch.PreparedLaunch, stream: int | None, adapter: Any) -> None:
    """A prepared rank kernel on ``stream`` (None: the current stream of the arrays' kind)."""
    _launch.launch(prepared, adapter.current_stream(prepared.device) if stream is None else stream)


def merge_on_host(v: Any, s: Any, lse_base_2: int, sinks: Any = None) -> tuple[Any, Any]:
    """The N-way merge in torch operations, where the kernels do not run (gloo's CPU tensors).

    ``v`` ``[states, T, H, D]``, ``s`` ``[states, H, T]``; the kernels' rules for empty, NaN and sink rows.
    """
    import torch

    to_natural = math.log(2.0) if lse_base_2 else 1.0
    s = torch.where(s == math.inf, -math.inf, s) * to_natural
    if sinks is not None:  # a state of value 0 and LSE sink
        s = torch.cat([s, sinks.float().reshape(1, -1, 1).expand(1, *s.shape[1:])])
        v = torch.cat([v, torch.zeros_like(v[:1])])
    any_nan = torch.isnan(s).any(0)
    takes_all = torch.isposinf(s).any(0)  # only a sink can be +inf here
    lse_max = torch.where(torch.isnan(s), -math.inf, s).amax(0)
    empty = lse_max == -math.inf
    base = torch.where(empty | takes_all, 0.0, lse_max)
    weight = torch.where(empty, 0.0, torch.exp(s - base))  # [states, H, T]
    weight = torch.where(takes_all, torch.isposinf(s).to(weight.dtype), weight)
    total = weight.sum(0)
    row_weight = weight.transpose(-2, -1)[..., None]  # [states, T, H, 1]
    weighted = torch.where(row_weight == 0.0, 0.0, row_weight * v.float()).sum(0)
    row_total = total.T[..., None]
    values = torch.where(row_total == 0.0, 0.0, weighted / row_total)
    values = torch.where(any_nan.T[..., None], math.nan, values)
    merged_lse = torch.where(empty, -math.inf, lse_max + torch.log(total)) / to_natural
    merged_lse = torch.where(takes_all, math.inf, merged_lse)
    merged_lse = torch.where(any_nan, math.nan, merged_lse)
    return values.to(v.dtype), merged_lse

