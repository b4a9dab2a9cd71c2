"""The steps around a cross-rank merge's collectives, on the GPU as NVRTC kernels, elsewhere as torch operations.

* *Pack*: this rank's values and LSE in one byte buffer of equal chunks, one
  per head group (``cuda_src/merge_across_ranks.cu``, ``pack_states``), so one
  all-gather or one all-to-all moves both; the receiver reads the chunks in
  place through strided views (:func:`chunk_views`), with no unpacking.
* *Scale*: with every rank's LSE at hand, this rank's values times their final
  weight, so that a plain sum over ranks (all-reduce, reduce-scatter) is the
  merge; and the merged LSE (``scale_for_sum``).

The host versions (torch CPU tensors, as gloo runs them) follow the same rules
and write the same layouts, so the CPU tests in CI check the strategies' logic.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .. import _arrays, _kernels
from .. import _catalogue as cat
from .._plan import LaunchPlan, choose_vector_width

#: Threads of a block of the rank kernels, over as many rows as a row's packs leave room for.
ROW_THREADS = 128


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


def chunk_views(xp: Any, buffer: Any, layout: ChunkLayout, dtype: Any) -> tuple[Any, Any]:
    """``buffer`` (bytes ``[chunks, chunk_bytes]``) as values ``[chunks, tokens, heads, head_size]``
    and LSE ``[chunks, heads, tokens]``, the stacked layout the N-way merge takes."""
    chunks = buffer.shape[0]
    tokens, heads, head_size, itemsize = layout.num_tokens, layout.heads, layout.head_size, layout.itemsize
    values = xp.strided_view(
        buffer, dtype, (chunks, tokens, heads, head_size),
        (layout.chunk_bytes // itemsize, heads * head_size, head_size, 1), 0,
    )  # fmt: skip
    lse = xp.strided_view(
        buffer, "float32", (chunks, heads, tokens), (layout.chunk_bytes // 4, tokens, 1), layout.lse_offset
    )
    return values, lse


def pack_buffer(xp: Any, v: Any, shards: int) -> tuple[Any, ChunkLayout]:
    """A byte buffer for ``v``'s state as ``shards`` chunks, ``[shards, chunk_bytes]``, and its layout."""
    num_tokens, num_heads, head_size = v.shape
    layout = chunk_layout(num_tokens, num_heads // shards, head_size, xp.itemsize(v))
    return xp.empty_bytes((shards, layout.chunk_bytes), like=v), layout


def pack_states(xp: Any, v: Any, s: Any, packed: Any, layout: ChunkLayout) -> None:
    """``v`` ``[T, H, D]`` and ``s`` ``[H, T]`` (any strides) into ``packed``'s chunks of ``H / chunks`` heads."""
    if xp.on_gpu(v):
        launch(xp, prepare_pack(xp, v, s, packed, layout))
        return
    num_tokens, num_heads, head_size = v.shape
    shards = packed.shape[0]
    values, lse = chunk_views(xp, packed, layout, v.dtype)
    values.copy_(v.reshape(num_tokens, shards, num_heads // shards, head_size).transpose(0, 1))
    lse.copy_(s.reshape(shards, num_heads // shards, num_tokens))


def prepare_pack(xp: Any, v: Any, s: Any, packed: Any, layout: ChunkLayout) -> _kernels.PreparedLaunch | None:
    """The packing kernel's launch for these arrays (None: nothing to pack)."""
    num_tokens, num_heads, head_size = v.shape
    if num_tokens * num_heads == 0:
        return None
    v_strides, s_strides = xp.strides(v), xp.strides(s)
    args = {
        "packed": xp.pointer(packed), "v": xp.pointer(v), "lse": xp.pointer(s),
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "heads_per_shard": num_heads // packed.shape[0],
        "chunk_bytes": layout.chunk_bytes, "lse_offset": layout.lse_offset,
        "v_stride_token": v_strides[0], "v_stride_head": v_strides[1],
        "lse_stride_head": s_strides[0], "lse_stride_token": s_strides[1],
    }  # fmt: skip
    return _prepare(xp, cat.RANK_PACK, num_tokens * num_heads, head_size, args, v)


def scale_for_sum(
    xp: Any, v: Any, gathered_s: Any, rank: int, scaled: Any, out_lse: Any, lse_base_2: int
) -> None:
    """This rank's values times their final weights into ``scaled`` ``[shards, T, H / shards, D]``.

    ``gathered_s``: every rank's LSE, ``[world, H, T]`` contiguous float32. The merged
    LSE of head group ``rank`` (all heads when ``shards`` is 1) is written to ``out_lse``.
    """
    if xp.on_gpu(v):
        launch(xp, prepare_scale(xp, v, gathered_s, rank, scaled, out_lse, lse_base_2))
    else:
        _scale_on_host(xp, v, gathered_s, rank, scaled, out_lse, lse_base_2)


def prepare_scale(
    xp: Any, v: Any, gathered_s: Any, rank: int, scaled: Any, out_lse: Any, lse_base_2: int
) -> _kernels.PreparedLaunch | None:
    """The scaling kernel's launch for these arrays (None: nothing to scale)."""
    num_tokens, num_heads, head_size = v.shape
    if num_tokens * num_heads == 0:
        return None
    shards = scaled.shape[0]
    heads = num_heads // shards
    v_strides, lse_strides = xp.strides(v), xp.strides(out_lse)
    args = {
        "scaled": xp.pointer(scaled), "out_lse": xp.pointer(out_lse), "v": xp.pointer(v),
        "gathered_lse": xp.pointer(gathered_s), "world": gathered_s.shape[0], "rank": rank,
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size, "heads_per_shard": heads,
        "chunk_elements": num_tokens * heads * head_size, "first_head": rank * heads if shards > 1 else 0,
        "out_heads": out_lse.shape[0], "v_stride_token": v_strides[0], "v_stride_head": v_strides[1],
        "out_lse_stride_head": lse_strides[0], "out_lse_stride_token": lse_strides[1],
        "lse_base_2": lse_base_2,
    }  # fmt: skip
    return _prepare(xp, cat.RANK_SCALE, num_tokens * num_heads, head_size, args, v)


def _scale_on_host(xp, v, gathered_s, rank, scaled, out_lse, lse_base_2) -> None:
    torch = xp.t
    shards = scaled.shape[0]
    first_head = rank * (v.shape[1] // shards) if shards > 1 else 0
    to_natural = math.log(2.0) if lse_base_2 else 1.0
    s = torch.where(gathered_s == math.inf, -math.inf, gathered_s) * to_natural  # [W, H, T]
    any_nan = torch.isnan(s).any(0)
    lse_max = torch.where(torch.isnan(s), -math.inf, s).amax(0)
    empty = lse_max == -math.inf
    weights = torch.where(empty, 0.0, torch.exp(s - torch.where(empty, 0.0, lse_max)))
    total = weights.sum(0)
    own = torch.where(total == 0.0, 0.0, weights[rank] / torch.where(total == 0.0, 1.0, total))
    own = torch.where(any_nan, math.nan, own)
    row_weight = own.T[..., None]  # [T, H, 1]
    # A state of weight zero adds exactly 0, even if its values are NaN (an empty shard).
    values = torch.where(row_weight == 0.0, 0.0, row_weight * v.float()).to(v.dtype)
    num_tokens, num_heads, head_size = v.shape
    scaled.copy_(values.reshape(num_tokens, shards, num_heads // shards, head_size).transpose(0, 1))
    merged = torch.where(empty, -math.inf, lse_max + torch.log(total)) / to_natural
    merged = torch.where(any_nan, math.nan, merged)
    out_lse.copy_(merged[first_head : first_head + out_lse.shape[0]])


_prepared: dict[tuple, _kernels.PreparedLaunch] = {}
_MAX_PREPARED = 1024


def _prepare(
    xp: Any, family: cat.KernelFamily, rows: int, head_size: int, args: dict, like: Any
) -> _kernels.PreparedLaunch:
    """Rows of ``like``'s shape on its device: 16-byte packs where every row is aligned (the
    merges' rule, ``choose_vector_width``; the buffers written start on 16 bytes), else elements.

    Prepared launches are kept by their arguments: a serving loop's buffers come
    back from the caching allocator at the same addresses, so a step's launches
    are found again instead of packed anew.
    """
    dtype = xp.dtype_name(like)
    device = xp.device_index(like)
    values = family.arguments(**args)
    key = (family.name, dtype, values, device)  # the arguments hold every pointer, stride and size
    prepared = _prepared.get(key)
    if prepared is None:
        widths = (16 // xp.itemsize(like), 1)
        vec = choose_vector_width([_arrays.describe(like, "v")], head_size, widths)
        threads_x = max(1, min(head_size // vec, ROW_THREADS))
        rows_y = max(1, ROW_THREADS // threads_x)
        grid = (min(-(-rows // rows_y), 2**31 - 1), 1, 1)
        module = cat.Module(cat.RANKS_SOURCE, dtype, dtype)
        plan = LaunchPlan(
            module, family.instance(T=dtype, VEC=vec), grid, (threads_x, rows_y, 1), values, 0, 0, 0
        )
        prepared = _kernels.prepare(plan, device)
        if len(_prepared) >= _MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def launch(xp: Any, prepared: _kernels.PreparedLaunch | None) -> None:
    """A prepared rank kernel on the current stream of ``xp``'s kind (CuPy: its given stream)."""
    if prepared is not None:
        _kernels.launch(prepared, xp.stream_pointer(prepared.device))


def merge_on_host(xp: Any, v: Any, s: Any, lse_base_2: int) -> tuple[Any, Any]:
    """The N-way merge in torch operations, where the kernels do not run (gloo's CPU tensors).

    ``v`` ``[states, T, H, D]``, ``s`` ``[states, H, T]``; the kernels' rules for empty and NaN rows.
    """
    torch = xp.t
    to_natural = math.log(2.0) if lse_base_2 else 1.0
    s = torch.where(s == math.inf, -math.inf, s) * to_natural
    lse_max = torch.where(torch.isnan(s), math.inf, s).amax(0)  # a NaN makes its row NaN
    weight = torch.where(lse_max == -math.inf, 0.0, torch.exp(s - lse_max))  # [states, H, T]
    total = weight.sum(0)
    row_weight = weight.transpose(-2, -1)[..., None]  # [states, T, H, 1]
    weighted = torch.where(row_weight == 0.0, 0.0, row_weight * v.float()).sum(0)
    row_total = total.T[..., None]
    values = torch.where(row_total == 0.0, 0.0, weighted / row_total)
    merged_lse = torch.where(lse_max == -math.inf, -math.inf, lse_max + torch.log(total)) / to_natural
    return values.to(v.dtype), merged_lse
