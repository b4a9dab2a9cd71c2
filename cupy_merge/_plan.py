"""Launch choices: which kernel, vector width, block, grid and arguments. Pure and GPU-free.

Every function here takes arrays that already passed ``_checks``. Two kernel
families serve each merge (``_catalogue``): *packed* kernels for the common
layouts (each value array's heads back to back in rows that start on a
16-byte pack, every offset within 32 bits), one thread a pack, few registers;
and *strided* kernels for everything else (any strides, narrow packs, 64-bit
offsets).
"""

from __future__ import annotations

from typing import NamedTuple

from . import _catalogue as cat
from ._arrays import ArrayView
from ._checks import StateShape

#: Offsets are 32-bit when every array's elements lie within this many of its start.
INDEX_32_LIMIT = cat.INDEX_32_LIMIT
#: Work items beyond this many blocks are looped over inside the strided kernels.
MAX_GRID_X = 2**31 - 1
#: Set False to plan every merge on the strided kernels (the tests run both families).
PACKED_KERNELS = True

# Strided kernels. Measured on the H200 (docs/PERF.md): 64-thread blocks beat 128-1024;
# two rows a thread 8-12 points of copy speed above one, and one below 32 MB of traffic
# 0.03-0.45 us faster (sweep 10).
STRIDED_THREADS = 64
STRIDED_SMALL_TRAFFIC = 32_000_000

# Packed kernels (docs/PERF.md, session 4 sweeps 1 and 2): 128-thread blocks measured
# 0-3 points of copy speed above 256 and 512; loads with the .cs hint below 64 MB of
# traffic (up to 3 points faster there), plain loads from 64 MB (5-10 points faster).
# The N-way kernel's loads always carry the hint: plain loads measured 0-9 points
# slower at every size but one (docs/PERF.md, session 6, run 5).
PACKED_TWO_THREADS = 128
PACKED_MANY_THREADS = 128
PACKED_STREAMING_BELOW = 64_000_000

# N-way splits: when rows alone give fewer than BUSY_THREADS threads, a row's states are
# split over up to MAX_SPLITS thread groups of one block (docs/PERF.md).
BUSY_THREADS = 128 * 1024
MAX_SPLITS = 16
MAX_BLOCK_THREADS = 256
#: The packed N-way kernel's fewest threads across rows in a block.
MIN_ROW_THREADS = 32
#: CUDA's limit on a block's threads.
CUDA_BLOCK_LIMIT = 1024


class LaunchPlan(NamedTuple):
    """One kernel launch; ``out_slot``/``out_lse_slot`` are where its output pointers sit in ``args``."""

    module: cat.Module
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[int, ...]
    shared_bytes: int
    out_slot: int
    out_lse_slot: int


class TwoStateOptions(NamedTuple):
    """Normalised options of a two-way merge (``_checks``): LSE base flag, first token copied
    from b, output dtype, FP8 group size (None: no group scales) and UE8M0 flag."""

    lse_base_2: int = 0
    merge_tokens: int | None = None
    out_dtype: str | None = None
    group_size: int | None = None
    scale_ue8m0: int = 0


class ManyStateOptions(NamedTuple):
    lse_base_2: int = 0
    out_dtype: str | None = None
    check_indptr: bool = False
    group_size: int | None = None
    scale_ue8m0: int = 0


class OutputScales(NamedTuple):
    """An FP8 output's scales: the per-tensor one (read) or the per-group ones (written); or neither."""

    per_tensor: ArrayView | None = None
    per_group: ArrayView | None = None


NO_SCALES = OutputScales()


#: Stands in for an optional array that was not given (a null pointer, strides 0).
NO_ARRAY = ArrayView(0, (0, 0), (0, 0), "float32", 4, 0)


class FastDivisor(NamedTuple):
    """``n // divisor == (umulhi(n, multiplier) + n) >> shift`` for 0 <= n < 2**31 (as the kernels compute)."""

    divisor: int
    multiplier: int
    shift: int


def fast_divisor(divisor: int) -> FastDivisor:
    if not 1 <= divisor < 2**31:
        raise ValueError(f"divisor out of range: {divisor}")
    shift = (divisor - 1).bit_length()  # ceil(log2(divisor))
    multiplier = (2**32 * (2**shift - divisor)) // divisor + 1 if divisor > 1 else 0
    return FastDivisor(divisor, multiplier, shift)


def fast_divide(n: int, divisor: FastDivisor) -> int:
    """What the kernels' ``fast_divide`` computes, in 32-bit unsigned arithmetic."""
    high = (n * divisor.multiplier) >> 32
    return ((high + n) & 0xFFFFFFFF) >> divisor.shift


# -- shared choices -----------------------------------------------------------------------------


def index_type(views: list[ArrayView | None], rows: int, num_states: int = 0) -> str:
    """The strided kernels' integer type for element offsets: 32-bit when every offset fits.

    32-bit offsets take fewer registers and instructions (the N-way kernel gained
    up to 12 points of copy speed, docs/PERF.md). ``rows`` (tokens x heads) and
    ``num_states`` are bounded too: the kernels count them in the same type.
    """
    if rows >= INDEX_32_LIMIT or num_states >= INDEX_32_LIMIT:
        return "long long"
    for view in views:
        if (
            view is not None
            and view.shape
            and min(view.shape) > 0
            and sum((n - 1) * abs(stride) for n, stride in zip(view.shape, view.strides)) >= INDEX_32_LIMIT
        ):
            return "long long"
    return "int"


def choose_vector_width(values: list[ArrayView], head_size: int, widths: tuple[int, ...]) -> int:
    """The widest pack (elements) that divides the row and keeps every access aligned."""
    for vec in widths:
        if head_size % vec == 0 and all(_pack_aligned(view, vec) for view in values):
            return vec
    return 1


def _pack_aligned(view: ArrayView, vec: int) -> bool:
    pack_bytes = min(vec * view.itemsize, 16)
    if view.ptr % pack_bytes:
        return False
    # Strides of dims of extent 1 are never used, so they need not be aligned.
    return all(stride % vec == 0 for extent, stride in zip(view.shape[:-1], view.strides[:-1]) if extent > 1)


def heads_packed(view: ArrayView, head_size: int) -> bool:
    """Whether a value array ``[..., heads, head_size]`` holds each token's heads back to back."""
    return view.shape[-2] <= 1 or view.strides[-2] == head_size


def _packed_kernel_fits(vec: int, widths: tuple[int, ...], index: str, head_size: int, values: list) -> bool:
    """Whether a packed kernel takes these value arrays: full 16-byte packs, 32-bit offsets,
    heads back to back in every one of them (and a row to merge at all)."""
    return (
        PACKED_KERNELS
        and head_size > 0
        and vec == widths[0]
        and index == "int"
        and all(heads_packed(view, head_size) for view in values)
    )


def choose_block(packs_per_row: int, num_tokens: int) -> tuple[int, int]:
    """Strided kernels: threads across a row (one pack each) and rows (tokens) per block."""
    threads_x = max(1, min(packs_per_row, STRIDED_THREADS))
    rows_per_block = max(1, min(STRIDED_THREADS // threads_x, num_tokens))
    return threads_x, rows_per_block


def _packed_geometry(state: StateShape, vec: int) -> dict[str, int]:
    """The packed kernels' numbering of output packs over (token, head, pack)."""
    packs_per_row = state.head_size // vec
    packs_per_token = state.num_heads * packs_per_row
    token = fast_divisor(packs_per_token)
    head = fast_divisor(packs_per_row)
    return {
        "total_packs": state.num_tokens * packs_per_token,
        "packs_per_token": packs_per_token,
        "token_multiplier": token.multiplier,
        "token_shift": token.shift,
        "packs_per_row": packs_per_row,
        "head_multiplier": head.multiplier,
        "head_shift": head.shift,
    }


def _group_geometry(scales: OutputScales, group_size: int | None, vec: int) -> dict[str, int]:
    """The packed kernels' group-scale arguments: a group is ``group_size // vec`` consecutive packs."""
    per_tensor = scales.per_tensor.ptr if scales.per_tensor is not None else 0
    if scales.per_group is None or group_size is None:
        return {"out_scale": per_tensor, "out_group_scale": 0, "group_stride_token": 0, "group_stride_group": 0,
                "packs_per_group": 1, "group_multiplier": 0, "group_shift": 0}  # fmt: skip
    group = fast_divisor(group_size // vec)
    return {
        "out_scale": 0,
        "out_group_scale": scales.per_group.ptr,
        "group_stride_token": _used(scales.per_group, 0),
        "group_stride_group": _used(scales.per_group, 1),
        "packs_per_group": group.divisor,
        "group_multiplier": group.multiplier,
        "group_shift": group.shift,
    }


def _group_block(threads: int, packs_per_group: int, limit: int = CUDA_BLOCK_LIMIT) -> int:
    """A block of whole groups near ``threads`` threads (at most ``limit``): a group's packs share a block."""
    return packs_per_group * max(1, min(threads, limit) // packs_per_group)


def _in_packs(stride: int, extent: int, vec: int) -> int:
    return stride // vec if extent > 1 else 0


def _used(view: ArrayView, dim: int) -> int:
    """The stride of ``dim``, or 0 where it is never used (extent 1): the packed kernels
    take strides as 32-bit ints, and an unused one may be any size."""
    return view.strides[dim] if view.shape[dim] > 1 else 0


def _lse_strides(name: str, view: ArrayView) -> dict[str, int]:
    return {f"{name}_stride_head": _used(view, 0), f"{name}_stride_token": _used(view, 1)}


def _plan(
    family: cat.KernelFamily, module: cat.Module, template: dict, grid, block, shared, args
) -> LaunchPlan:
    return LaunchPlan(
        module,
        family.instance(**template),
        grid,
        block,
        family.arguments(**args),
        shared,
        family.position("out"),
        family.position("out_lse"),
    )


# -- two states ---------------------------------------------------------------------------------


def plan_two_states(
    state: StateShape,
    out: ArrayView,
    out_lse: ArrayView | None,
    v_a: ArrayView,
    s_a: ArrayView,
    v_b: ArrayView,
    s_b: ArrayView,
    mask: ArrayView | None,
    options: TwoStateOptions,
    scales: OutputScales = NO_SCALES,
) -> LaunchPlan | None:
    """The launch of a checked two-way merge; ``None`` when there is nothing to write.

    Group-scaled FP8 outputs always take the packed kernel (``_checks`` made sure
    the layout allows it), at the widest pack that divides a group.
    """
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    if num_tokens == 0 or num_heads == 0:
        return None
    group_size = options.group_size if scales.per_group is not None else None
    grouped = group_size is not None
    module = cat.Module(cat.TWO_STATES_SOURCE, state.dtype, out.dtype)
    widths = cat.vector_widths(state.dtype, out.dtype)
    vec = choose_vector_width([out, v_a, v_b], group_size or head_size, widths)
    lse_out = out_lse if out_lse is not None else NO_ARRAY
    mask_view = mask if mask is not None else NO_ARRAY
    merge_tokens = num_tokens if options.merge_tokens is None else min(options.merge_tokens, num_tokens)
    lse_in_place = out_lse is not None and out_lse in (s_a, s_b)
    common = {
        "out": out.ptr, "out_lse": lse_out.ptr, "v_a": v_a.ptr, "lse_a": s_a.ptr, "v_b": v_b.ptr,
        "lse_b": s_b.ptr, "mask": mask_view.ptr, "merge_tokens": merge_tokens,
        **_lse_strides("out_lse", lse_out), **_lse_strides("lse_a", s_a), **_lse_strides("lse_b", s_b),
        "mask_stride": _used(mask_view, 0), "lse_base_2": options.lse_base_2,
    }  # fmt: skip
    views = [out, out_lse, v_a, s_a, v_b, s_b, mask]
    index = index_type(views, num_tokens * num_heads)
    traffic = num_tokens * num_heads * head_size * (2 * v_a.itemsize + out.itemsize)
    packs_per_row = head_size // vec
    packed = _packed_kernel_fits(vec, widths, index, head_size, [out, v_a, v_b]) and (
        not lse_in_place or 32 % packs_per_row == 0
    )
    if packed or grouped:
        geometry = _packed_geometry(state, vec)
        group = _group_geometry(scales, options.group_size, vec)
        # Whole groups a block; with the LSE written in place, whole rows (the group barriers
        # then order a row's reads of the old LSE before its write, as __syncwarp does otherwise).
        unit = packs_per_row if grouped and lse_in_place else group["packs_per_group"]
        threads = _group_block(PACKED_TWO_THREADS, unit)
        grid = (-(-geometry["total_packs"] // threads), 1, 1)
        strides = {
            "out_stride_token": _in_packs(out.strides[0], num_tokens, vec),
            "a_stride_token": _in_packs(v_a.strides[0], num_tokens, vec),
            "b_stride_token": _in_packs(v_b.strides[0], num_tokens, vec),
        }
        template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "GROUPED": grouped,
                    "STREAMING": traffic < PACKED_STREAMING_BELOW, "LSE_IN_PLACE": lse_in_place}  # fmt: skip
        shared = 4 * (threads // group["packs_per_group"]) if grouped else 0
        args = {**common, **geometry, **strides, **group, "scale_ue8m0": options.scale_ue8m0}
        return _plan(cat.TWO_PACKED, module, template, grid, (threads, 1, 1), shared, args)

    threads_x, rows_y = choose_block(packs_per_row, num_tokens)
    rows = 1 if traffic < STRIDED_SMALL_TRAFFIC or rows_y * 2 > num_tokens else 2
    grid = (min(-(-num_tokens // (rows_y * rows)) * num_heads, MAX_GRID_X), 1, 1)
    args = {
        **common,
        "out_scale": scales.per_tensor.ptr if scales.per_tensor is not None else 0,
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "out_stride_token": out.strides[0], "out_stride_head": out.strides[1],
        "a_stride_token": v_a.strides[0], "a_stride_head": v_a.strides[1],
        "b_stride_token": v_b.strides[0], "b_stride_head": v_b.strides[1],
        "out_lse_is_input": int(lse_in_place),
    }  # fmt: skip
    template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "ROWS": rows, "Index": index}
    return _plan(cat.TWO_STRIDED, module, template, grid, (threads_x, rows_y, 1), 0, args)


# -- many states --------------------------------------------------------------------------------


def plan_many_states(
    state: StateShape,
    num_states: int,
    out: ArrayView,
    out_lse: ArrayView | None,
    v: ArrayView,
    s: ArrayView,
    indptr: ArrayView | None,
    options: ManyStateOptions,
    scales: OutputScales = NO_SCALES,
) -> LaunchPlan | None:
    """The launch of a checked N-way (``indptr`` None) or ragged merge (group-scaled FP8: as two-way)."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    if num_tokens == 0 or num_heads == 0:
        return None
    if indptr is None and num_states == 2:
        # Two states are the two-way kernel's job: it keeps twice the loads in flight per row.
        v_a, v_b = _state_view(v, 0), _state_view(v, 1)
        s_a, s_b = _state_view(s, 0), _state_view(s, 1)
        two = TwoStateOptions(options.lse_base_2, None, None, options.group_size, options.scale_ue8m0)
        return plan_two_states(state, out, out_lse, v_a, s_a, v_b, s_b, None, two, scales)
    group_size = options.group_size if scales.per_group is not None else None
    grouped = group_size is not None
    module = cat.Module(cat.MANY_STATES_SOURCE, state.dtype, out.dtype)
    widths = cat.vector_widths(state.dtype, out.dtype)
    vec = choose_vector_width([out, v], group_size or head_size, widths)
    if indptr is None:
        v_state, v_token, v_head = v.strides[:3]  # (state, token, head)
        s_state, s_head, s_token = (_used(s, dim) for dim in range(3))  # (state, head, token)
        extents = (num_states, num_tokens)
    else:
        v_state, v_token, v_head = v.strides[0], 0, v.strides[1]
        s_state, s_head, s_token = _used(s, 1), _used(s, 0), 0
        extents = (num_states, 1)
    lse_out = out_lse if out_lse is not None else NO_ARRAY
    index_view = indptr if indptr is not None else NO_ARRAY._replace(dtype="int64", itemsize=8)
    common = {
        "out": out.ptr, "out_lse": lse_out.ptr, "v": v.ptr, "lse": s.ptr,
        "indptr": index_view.ptr, "indptr_bytes": index_view.itemsize, "indptr_stride": index_view.strides[0],
        "num_states": num_states,
        **_lse_strides("out_lse", lse_out),
        "lse_stride_state": s_state, "lse_stride_head": s_head, "lse_stride_token": s_token,
        "lse_base_2": options.lse_base_2,
    }  # fmt: skip
    index = index_type([out, out_lse, v, s, indptr], num_tokens * num_heads, num_states)
    packs_per_row = head_size // vec
    if grouped or _packed_kernel_fits(vec, widths, index, head_size, [out, v]):
        geometry = _packed_geometry(state, vec)
        group = _group_geometry(scales, options.group_size, vec)
        splits = choose_state_splits(num_states, geometry["total_packs"], cat.MERGE_CHUNK)
        threads_x = _group_block(
            max(MIN_ROW_THREADS, PACKED_MANY_THREADS // splits), group["packs_per_group"]
        )
        splits = max(1, min(splits, CUDA_BLOCK_LIMIT // threads_x))
        grid = (-(-geometry["total_packs"] // threads_x), 1, 1)
        strides = {
            "out_stride_token": _in_packs(out.strides[0], num_tokens, vec),
            "v_stride_state": _in_packs(v_state, extents[0], vec),
            "v_stride_token": _in_packs(v_token, extents[1], vec),
        }
        template = {
            "TIn": state.dtype,
            "TOut": out.dtype,
            "VEC": vec,
            "SPLIT": splits > 1,
            "RAGGED": indptr is not None,
            "GROUPED": grouped,
        }
        shared = (splits - 1) * threads_x * _partial_bytes(vec)
        if grouped:
            shared += 4 * (threads_x // group["packs_per_group"])
        block_shape = {"block_packs": threads_x, "block_splits": splits}
        args = {**common, **geometry, **strides, **group, **block_shape, "scale_ue8m0": options.scale_ue8m0}
        return _plan(cat.MANY_PACKED, module, template, grid, (threads_x, splits, 1), shared, args)

    threads_x, rows_y = choose_block(packs_per_row, num_tokens)
    splits = choose_state_splits(num_states, num_tokens * num_heads * threads_x, cat.MERGE_CHUNK)
    splits = max(1, min(splits, MAX_BLOCK_THREADS // threads_x))
    rows_y = max(1, min(rows_y, MAX_BLOCK_THREADS // (threads_x * splits)))
    grid = (min(-(-num_tokens // rows_y) * num_heads, MAX_GRID_X), 1, 1)
    args = {
        **common,
        "out_scale": scales.per_tensor.ptr if scales.per_tensor is not None else 0,
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "out_stride_token": out.strides[0], "out_stride_head": out.strides[1],
        "v_stride_state": v_state, "v_stride_token": v_token, "v_stride_head": v_head,
    }  # fmt: skip
    template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "SPLIT": splits > 1, "Index": index}
    shared = (splits - 1) * threads_x * rows_y * _partial_bytes(vec)
    return _plan(cat.MANY_STRIDED, module, template, grid, (threads_x, rows_y, splits), shared, args)


def _partial_bytes(vec: int) -> int:
    """sizeof(Partial<VEC>) in the kernels: VEC + 2 floats and a bool, padded to 4 bytes."""
    return (vec + 3) * 4


def choose_state_splits(num_states: int, row_threads: int, chunk: int) -> int:
    """How many thread groups share one row's states.

    One group suffices when rows alone give ``BUSY_THREADS`` threads; otherwise
    the states of a row are split, up to one chunk per group and ``MAX_SPLITS``
    groups (measured in docs/PERF.md).
    """
    wanted = -(-BUSY_THREADS // max(row_threads, 1))
    useful = -(-num_states // chunk)
    return max(1, min(wanted, useful, MAX_SPLITS))


def _state_view(view: ArrayView, index: int) -> ArrayView:
    """State ``index`` of a stacked array, as a view of one fewer dimension (no copy)."""
    return view._replace(
        ptr=view.ptr + index * view.strides[0] * view.itemsize, shape=view.shape[1:], strides=view.strides[1:]
    )
