"""Launch choices: which kernel, vector width, block, grid and arguments. Pure, GPU-free, address-free.

Every function here takes the :class:`ArraySpec` of arrays that already passed
``_checks``, and a :class:`~cupy_merge._tuning.Tuning`. A plan is a tuple of
:class:`KernelLaunch` (usually one) whose pointer parameters are *slots* naming
an operand (and a byte offset into it): addresses are bound when the launch is
prepared (``_launch.prepare``), so the same plan serves every call with arrays of
the same specialisation, a ``torch.compile`` fake tensor or a JAX trace.

Two kernel families serve each merge (``_catalogue``): *packed* kernels for the
common layouts (each value array's heads back to back in rows that start on a
16-byte pack, every offset within 32 bits), one thread a pack, few registers;
and *strided* kernels for everything else (any strides, narrow packs, 64-bit
offsets). The gradients' choices are ``_plan_backward``'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _catalogue as cat
from ._arrays import ArraySpec
from ._operands import ManyStateOperands, ManyStateOptions, StateShape, TwoStateOperands, TwoStateOptions
from ._tuning import Tuning

#: Offsets are 32-bit when every array's elements lie within this many of its start.
INDEX_32_LIMIT = cat.INDEX_32_LIMIT
#: Work items beyond this many blocks are looped over inside the strided kernels.
MAX_GRID_X = 2**31 - 1
#: CUDA's limit on a grid's second dimension.
MAX_GRID_Y = 65535
#: CUDA's limit on a block's threads.
CUDA_BLOCK_LIMIT = 1024


class Pointer(NamedTuple):
    """A pointer parameter's value: the address of operand ``field`` plus ``offset`` bytes."""

    field: str
    offset: int = 0


class KernelLaunch(NamedTuple):
    """One kernel launch without addresses: ``args`` in parameter order with 0 for every pointer,
    ``pointers`` the slots to fill, as (parameter index, operand field, byte offset)."""

    module: cat.Module
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[int, ...]
    pointers: tuple[tuple[int, str, int], ...]

    def slots(self, field: str) -> list[int]:
        """The parameters that take operand ``field``'s address."""
        return [slot for slot, name, _ in self.pointers if name == field]


#: A merge's launches, in order (none when there is nothing to write).
Plan = tuple[KernelLaunch, ...]


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


def index_type(specs: list[ArraySpec | None], rows: int, num_states: int = 0) -> str:
    """The strided kernels' integer type for element offsets: 32-bit when every offset fits.

    32-bit offsets take fewer registers and instructions (the N-way kernel gained
    up to 12 points of copy speed, benchmarks/PERF.md). ``rows`` (tokens x heads) and
    ``num_states`` are bounded too: the kernels count them in the same type.
    """
    if rows >= INDEX_32_LIMIT or num_states >= INDEX_32_LIMIT:
        return "long long"
    for spec in specs:
        if (
            spec is not None
            and spec.shape
            and min(spec.shape) > 0
            and sum((n - 1) * abs(stride) for n, stride in zip(spec.shape, spec.strides)) >= INDEX_32_LIMIT
        ):
            return "long long"
    return "int"


def choose_vector_width(
    values: list[ArraySpec], head_size: int, widths: tuple[int, ...], every_stride: bool = False
) -> int:
    """The widest pack (elements) that divides the row and keeps every access aligned.

    Strides of dims of extent 1 are never used, so they need not be aligned, unless
    ``every_stride`` (batch-invariant gradients, whose sums follow the width: one token of a
    batch's layout must take the width the batch takes)."""
    for vec in widths:
        if head_size % vec == 0 and all(_pack_aligned(spec, vec, every_stride) for spec in values):
            return vec
    return 1


def _pack_aligned(spec: ArraySpec, vec: int, every_stride: bool = False) -> bool:
    elements = _elements(spec, vec)
    if elements == 0 or spec.align < min(elements * spec.itemsize, 16):
        return False
    dims = zip(spec.shape[:-1], spec.strides[:-1])
    return all(stride % elements == 0 for extent, stride in dims if extent > 1 or every_stride)


def _elements(spec: ArraySpec, vec: int) -> int:
    """The elements of ``spec`` that hold a pack of ``vec`` values (NVFP4: two values an element)."""
    return vec // cat.VALUES_PER_ELEMENT.get(spec.dtype, 1)


def heads_packed(spec: ArraySpec, head_size: int) -> bool:
    """Whether a value array ``[..., heads, head_size]`` holds each token's heads back to back."""
    return spec.shape[-2] <= 1 or spec.strides[-2] == head_size


def _packed_kernel_fits(
    vec: int, widths: tuple[int, ...], index: str, head_size: int, values: list, tuning: Tuning
) -> bool:
    """Whether a packed kernel takes these value arrays: full 16-byte packs, 32-bit offsets,
    heads back to back in every one of them (and a row to merge at all)."""
    return (
        tuning.packed_kernels
        and head_size > 0
        and vec == widths[0]
        and index == "int"
        and all(heads_packed(spec, head_size) for spec in values)
    )


def choose_block(packs_per_row: int, num_tokens: int, tuning: Tuning) -> tuple[int, int]:
    """Strided kernels: threads across a row (one pack each) and rows (tokens) per block."""
    threads_x = max(1, min(packs_per_row, tuning.strided_threads))
    rows_per_block = max(1, min(tuning.strided_threads // threads_x, num_tokens))
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


def _group_geometry(
    block_scale: ArraySpec | None, group_size: int | None, vec: int, num_tokens: int, swizzled: bool = False
) -> dict[str, Any]:
    """The packed kernels' group-scale arguments: a group is ``group_size // vec`` consecutive packs;
    ``swizzled``: NVFP4 scales in 128 x 4 tiles (padded rows and columns zeroed by the kernel)."""
    if block_scale is None or group_size is None:
        return {"output_block_scale": 0, "block_scale_stride_token": 0, "block_scale_stride_group": 0,
                "packs_per_group": 1, "group_multiplier": 0, "group_shift": 0, "block_scale_col_tiles": 0,
                "block_scale_rows": 0, "block_scale_padded_rows": 0}  # fmt: skip
    group = fast_divisor(group_size // vec)
    return {
        "output_block_scale": Pointer("output_block_scale"),
        "block_scale_stride_token": 0 if swizzled else _used(block_scale, 0),
        "block_scale_stride_group": 0 if swizzled else _used(block_scale, 1),
        "packs_per_group": group.divisor,
        "group_multiplier": group.multiplier,
        "group_shift": group.shift,
        "block_scale_col_tiles": block_scale.shape[1] // 4 if swizzled else 0,
        "block_scale_rows": num_tokens,
        "block_scale_padded_rows": block_scale.shape[0] if swizzled else num_tokens,
    }


def _group_size(specs: TwoStateOperands | ManyStateOperands, options: Any) -> int | None:
    """Values a block scale covers: NVFP4's 16, an FP8 output's group size, or None (no block scales)."""
    if specs.output_block_scale is None:
        return None
    return cat.NVFP4_BLOCK if specs.out.dtype == cat.NVFP4 else options.group_size


def _swizzled(specs: TwoStateOperands | ManyStateOperands, options: Any) -> bool:
    return specs.out.dtype == cat.NVFP4 and options.swizzled_scales


def _group_block(threads: int, packs_per_group: int, limit: int = CUDA_BLOCK_LIMIT) -> int:
    """A block of whole groups near ``threads`` threads (at most ``limit``): a group's packs share a block."""
    return packs_per_group * max(1, min(threads, limit) // packs_per_group)


def _in_packs(stride: int, extent: int, vec: int) -> int:
    return stride // vec if extent > 1 else 0


def _used(spec: ArraySpec | None, dim: int) -> int:
    """The stride of ``dim``, or 0 where it is never used (extent 1, or no array): the packed
    kernels take strides as 32-bit ints, and an unused one may be any size."""
    return spec.strides[dim] if spec is not None and spec.shape[dim] > 1 else 0


def _lse_strides(name: str, spec: ArraySpec | None) -> dict[str, int]:
    return {f"{name}_stride_head": _used(spec, 0), f"{name}_stride_token": _used(spec, 1)}


def _sinks(specs: TwoStateOperands | ManyStateOperands) -> dict[str, Any]:
    sinks = specs.sinks
    return {"sinks": Pointer("sinks") if sinks is not None else 0, "sinks_stride": _used(sinks, 0)}


def _pointer(specs: NamedTuple, field: str) -> Pointer | int:
    """Operand ``field``'s address, or a null pointer when it is not given."""
    return Pointer(field) if getattr(specs, field) is not None else 0


#: CUDA's limits on a block's x, y and z and its threads, and on a grid's y and z.
BLOCK_DIMS, BLOCK_THREADS, GRID_YZ = (1024, 1024, 64), 1024, 65535


def _launch(
    family: cat.KernelFamily, module: cat.Module, template: dict, grid, block, shared: int, args: dict
) -> KernelLaunch:
    if (
        any(not 1 <= size <= most for size, most in zip(block, BLOCK_DIMS))
        or block[0] * block[1] * block[2] > BLOCK_THREADS
        or not 1 <= grid[0] < 2**31
        or any(not 1 <= size <= GRID_YZ for size in grid[1:])
    ):  # a planner's mistake: refused here, never a launch that fails with an invalid argument
        raise RuntimeError(f"cupy_merge planned a {family.name} launch past CUDA's limits: grid {grid}, block {block}")
    slots = tuple(
        (slot, value.field, value.offset)
        for slot, value in enumerate(args[name] for name in family.params)
        if isinstance(value, Pointer)
    )
    values = {name: 0 if isinstance(value, Pointer) else value for name, value in args.items()}
    return KernelLaunch(
        module, family.instance(**template), grid, block, shared, family.arguments(**values), slots
    )


# -- two states ---------------------------------------------------------------------------------

#: Where a two-way merge's pointers come from: each operand's own address.
TWO_STATE_POINTERS = TwoStateOperands(*(Pointer(field) for field in TwoStateOperands._fields))


def plan_two_states(
    state: StateShape,
    specs: TwoStateOperands,
    options: TwoStateOptions,
    tuning: Tuning,
    lse_in_place: bool,
    where: TwoStateOperands = TWO_STATE_POINTERS,
) -> Plan:
    """The launches of a checked two-way merge; none when there is nothing to write.

    ``lse_in_place``: ``out_lse`` is ``s_a`` or ``s_b`` itself (an address fact the
    caller found). ``where``: each operand's pointer (an N-way merge of two states
    passes its states' slices). Group-scaled FP8 outputs always take the packed
    kernel (``_checks`` made sure the layout allows it), at the widest pack that
    divides a group.
    """
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    if num_tokens == 0 or num_heads == 0:
        return ()
    out, out_lse, v_a, s_a, v_b, s_b, mask = specs[:7]
    group_size = _group_size(specs, options)
    grouped = group_size is not None
    module = cat.Module(cat.TWO_STATES_SOURCE, state.dtype, out.dtype, specs.sinks is not None, tuning.compile_options)
    widths = cat.vector_widths(state.dtype, out.dtype)
    vec = choose_vector_width([out, v_a, v_b], group_size or head_size, widths)
    merge_tokens = num_tokens if options.merge_tokens is None else min(options.merge_tokens, num_tokens)
    common = {
        "out": where.out, "out_lse": where.out_lse if out_lse is not None else 0,
        "v_a": where.v_a, "lse_a": where.s_a, "v_b": where.v_b, "lse_b": where.s_b,
        "mask": _pointer(specs, "mask"), "merge_tokens": merge_tokens,
        **_lse_strides("out_lse", out_lse), **_lse_strides("lse_a", s_a), **_lse_strides("lse_b", s_b),
        "mask_stride": _used(mask, 0), "lse_base_2": options.lse_base_2, **_sinks(specs),
    }  # fmt: skip
    index = index_type([out, out_lse, v_a, s_a, v_b, s_b, mask], num_tokens * num_heads)
    traffic = num_tokens * num_heads * head_size * (2 * v_a.itemsize + out.itemsize * _elements(out, 2) / 2)
    packs_per_row = head_size // vec
    packed = _packed_kernel_fits(vec, widths, index, head_size, [out, v_a, v_b], tuning) and (
        not lse_in_place or 32 % packs_per_row == 0
    )
    if packed or grouped:
        geometry = _packed_geometry(state, vec)
        group = _group_geometry(specs.output_block_scale, group_size, vec, num_tokens, _swizzled(specs, options))
        # Whole groups a block; with the LSE written in place, whole rows (the group barriers
        # then order a row's reads of the old LSE before its write, as __syncwarp does otherwise).
        # A row too long for one block has its LSE written by a second launch instead.
        lse_after = grouped and lse_in_place and packs_per_row > CUDA_BLOCK_LIMIT
        unit = packs_per_row if grouped and lse_in_place and not lse_after else group["packs_per_group"]
        threads = _group_block(tuning.packed_two_threads, unit)
        grid = (-(-geometry["total_packs"] // threads), 1, 1)
        strides = {
            "out_stride_token": _in_packs(out.strides[0], num_tokens, _elements(out, vec)),
            "a_stride_token": _in_packs(v_a.strides[0], num_tokens, vec),
            "b_stride_token": _in_packs(v_b.strides[0], num_tokens, vec),
        }
        template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "GROUPED": grouped,
                    "STREAMING": traffic < tuning.packed_streaming_below,
                    "LSE_IN_PLACE": lse_in_place and not grouped, "SINKS": specs.sinks is not None}  # fmt: skip
        shared = 4 * (threads // group["packs_per_group"]) if grouped else 0
        args = {**common, **geometry, **strides, **group, "scale_ue8m0": options.scale_ue8m0,
                "output_scale": _pointer(specs, "output_scale")}  # fmt: skip
        if lse_after:
            args["out_lse"] = 0
        merge = _launch(cat.TWO_PACKED, module, template, grid, (threads, 1, 1), shared, args)
        if not lse_after:
            return (merge,)
        return merge, _lse_only(state, specs, options, tuning, common, module)

    _, rows_y = choose_block(packs_per_row, num_tokens, tuning)
    rows = 1 if traffic < tuning.strided_small_traffic or rows_y * 2 > num_tokens else 2
    return (_strided_two(state, specs, tuning, common, module, vec, index, rows, lse_in_place),)


def _strided_two(state, specs, tuning, common, module, vec, index, rows, lse_in_place, head_size=None):
    head_size = state.head_size if head_size is None else head_size
    out = specs.out
    threads_x, rows_y = choose_block(head_size // vec, state.num_tokens, tuning)
    grid = (min(-(-state.num_tokens // (rows_y * rows)) * state.num_heads, MAX_GRID_X), 1, 1)
    args = {
        **common,
        "output_scale": _pointer(specs, "output_scale"),
        "num_tokens": state.num_tokens, "num_heads": state.num_heads, "head_size": head_size,
        "out_stride_token": out.strides[0], "out_stride_head": out.strides[1],
        "a_stride_token": specs.v_a.strides[0], "a_stride_head": specs.v_a.strides[1],
        "b_stride_token": specs.v_b.strides[0], "b_stride_head": specs.v_b.strides[1],
        "out_lse_is_input": int(lse_in_place),
    }  # fmt: skip
    template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "ROWS": rows, "Index": index,
                "SINKS": specs.sinks is not None}  # fmt: skip
    return _launch(cat.TWO_STRIDED, module, template, grid, (threads_x, rows_y, 1), 0, args)


def _lse_only(state, specs, options, tuning, common, module) -> KernelLaunch:
    """The merged LSE alone, written in place after the values' launch read the old one: the
    strided kernel with no packs to merge (each thread reads and then writes its own rows)."""
    index = index_type([specs.out_lse, specs.s_a, specs.s_b, specs.mask], state.num_tokens * state.num_heads)
    common = {**common, "out": 0}
    return _strided_two(state, specs, tuning, common, module, 1, index, 1, True, head_size=0)


# -- many states --------------------------------------------------------------------------------


def plan_many_states(
    state: StateShape,
    num_states: int,
    specs: ManyStateOperands,
    options: ManyStateOptions,
    tuning: Tuning,
) -> Plan:
    """The launches of a checked N-way (``indptr`` None) or ragged merge (group-scaled FP8: as two-way)."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    if num_tokens == 0 or num_heads == 0:
        return ()
    out, out_lse, v, s, indptr = specs[:5]
    if indptr is None and num_states == 2:
        # Two states are the two-way kernel's job: it keeps twice the loads in flight per row.
        two = TwoStateOperands(
            out, out_lse, _state_spec(v, 0), _state_spec(s, 0), _state_spec(v, 1), _state_spec(s, 1),
            None, specs.sinks, specs.output_scale, specs.output_block_scale,
        )  # fmt: skip
        where = TWO_STATE_POINTERS._replace(
            v_a=Pointer("v"), s_a=Pointer("s"),
            v_b=Pointer("v", _state_offset(v, 1)), s_b=Pointer("s", _state_offset(s, 1)),
        )  # fmt: skip
        options_two = TwoStateOptions(
            lse_base_2=options.lse_base_2, group_size=options.group_size, scale_ue8m0=options.scale_ue8m0,
            swizzled_scales=options.swizzled_scales,
        )
        return plan_two_states(state, two, options_two, tuning, False, where)
    group_size = _group_size(specs, options)
    grouped = group_size is not None
    module = cat.Module(cat.MANY_STATES_SOURCE, state.dtype, out.dtype, specs.sinks is not None, tuning.compile_options)
    widths = cat.many_widths(state.dtype, out.dtype)
    vec = choose_vector_width([out, v], group_size or head_size, widths)
    if indptr is None:
        v_state, v_token, v_head = v.strides[:3]  # (state, token, head)
        s_state, s_head, s_token = (_used(s, dim) for dim in range(3))  # (state, head, token)
        extents = (num_states, num_tokens)
    else:
        v_state, v_token, v_head = v.strides[0], 0, v.strides[1]
        s_state, s_head, s_token = _used(s, 1), _used(s, 0), 0
        extents = (num_states, 1)
    common = {
        "out": Pointer("out"), "out_lse": _pointer(specs, "out_lse"), "v": Pointer("v"), "lse": Pointer("s"),
        "indptr": _pointer(specs, "indptr"), "indptr_bytes": indptr.itemsize if indptr is not None else 8,
        "indptr_stride": indptr.strides[0] if indptr is not None else 0,
        "num_states": num_states,
        **_lse_strides("out_lse", out_lse),
        "lse_stride_state": s_state, "lse_stride_head": s_head, "lse_stride_token": s_token,
        "lse_base_2": options.lse_base_2, "output_scale": _pointer(specs, "output_scale"), **_sinks(specs),
    }  # fmt: skip
    index = index_type([out, out_lse, v, s, indptr], num_tokens * num_heads, num_states)
    packs_per_row = head_size // vec
    chunk = tuning.merge_chunk
    if grouped or _packed_kernel_fits(vec, widths, index, head_size, [out, v], tuning):
        geometry = _packed_geometry(state, vec)
        group = _group_geometry(specs.output_block_scale, group_size, vec, num_tokens, _swizzled(specs, options))
        row_states = num_states if indptr is None else -(-num_states // num_tokens)  # ragged: the mean
        if tuning.batch_invariant:  # the splits the row's count asks for, the packs a block fewer if need be
            splits = invariant_splits(num_states, indptr is not None, group_size or 1, tuning)
            limit = tuning.packed_block_limit // splits
            packs = max(tuning.min_pack_threads, tuning.packed_many_threads // splits)  # whole sectors a load
            threads_x = _group_block(packs, group["packs_per_group"], limit)
        else:
            threads_x, splits = choose_packed_block(geometry["total_packs"], row_states, group["packs_per_group"], tuning,
                                                    ragged=indptr is not None)  # fmt: skip
        grid = (-(-geometry["total_packs"] // threads_x), 1, 1)
        strides = {
            "out_stride_token": _in_packs(out.strides[0], num_tokens, _elements(out, vec)),
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
            "SINKS": specs.sinks is not None,
        }
        shared = (splits - 1) * threads_x * _partial_bytes(vec)
        if grouped:
            shared += 4 * (threads_x // group["packs_per_group"])
        block_shape = {"block_packs": threads_x, "block_splits": splits}
        args = {**common, **geometry, **strides, **group, **block_shape, "scale_ue8m0": options.scale_ue8m0}
        return (_launch(cat.MANY_PACKED, module, template, grid, (threads_x, splits, 1), shared, args),)

    threads_x, rows_y = choose_block(packs_per_row, num_tokens, tuning)
    if tuning.batch_invariant:  # the splits every row needs, the threads across a row fewer if need be
        splits = invariant_splits(num_states, indptr is not None, 1, tuning)
        threads_x = max(1, min(threads_x, tuning.max_block_threads // splits))
    else:
        splits = choose_state_splits(num_states, num_tokens * num_heads * threads_x, chunk, tuning)
        splits = max(1, min(splits, tuning.max_block_threads // threads_x))
    rows_y = max(1, min(rows_y, tuning.max_block_threads // (threads_x * splits)))
    grid = (min(-(-num_tokens // rows_y) * num_heads, MAX_GRID_X), 1, 1)
    args = {
        **common,
        "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "out_stride_token": out.strides[0], "out_stride_head": out.strides[1],
        "v_stride_state": v_state, "v_stride_token": v_token, "v_stride_head": v_head,
    }  # fmt: skip
    template = {"TIn": state.dtype, "TOut": out.dtype, "VEC": vec, "SPLIT": splits > 1, "Index": index,
                "SINKS": specs.sinks is not None}  # fmt: skip
    shared = (splits - 1) * threads_x * rows_y * _partial_bytes(vec)
    return (_launch(cat.MANY_STRIDED, module, template, grid, (threads_x, rows_y, splits), shared, args),)


def _partial_bytes(vec: int) -> int:
    """sizeof(Partial<VEC>) in the kernels: VEC + 2 floats and a bool, padded to 4 bytes."""
    return (vec + 3) * 4


def choose_packed_block(
    total_packs: int, row_states: int, packs_per_group: int, tuning: Tuning, ragged: bool = False
) -> tuple[int, int]:
    """The packed N-way kernel's block: (packs, splits of each pack's states).

    Enough splits that the grid holds ``busy_threads`` threads (at most one
    chunk of states a split, ``packed_max_splits``); ``packed_many_threads``
    threads a block, at least ``min_row_threads`` packs wide. With few rows the
    block narrows (down to ``min_pack_threads`` packs) while there would be
    fewer than ``min_blocks`` blocks and it holds more than
    ``packed_many_threads`` threads: a decode step's rows of hundreds of states
    spread over the multiprocessors, and one of 16 states keeps its one block of
    128 threads (faster: session 10's sweep). The splits then fill at most
    ``packed_block_limit`` threads. A block holds whole FP8 groups. ``ragged``
    rows (``row_states`` their mean) of many states take at least
    ``ragged_min_splits``.
    """
    splits = choose_state_splits(
        row_states, total_packs, tuning.merge_chunk, tuning, tuning.packed_max_splits
    )
    if ragged and row_states >= tuning.ragged_split_states:
        splits = max(splits, min(tuning.ragged_min_splits, -(-row_states // tuning.merge_chunk)))
    packs = max(tuning.min_row_threads, tuning.packed_many_threads // splits)
    while (
        packs > tuning.min_pack_threads
        and -(-total_packs // packs) < tuning.min_blocks
        and packs * splits > tuning.packed_many_threads
    ):
        packs //= 2
    limit = tuning.packed_block_limit
    packs = _group_block(packs, packs_per_group, limit)
    return packs, max(1, min(splits, limit // packs))


def choose_state_splits(
    num_states: int, row_threads: int, chunk: int, tuning: Tuning, max_splits: int | None = None
) -> int:
    """How many thread groups share one row's states.

    One group suffices when rows alone give ``busy_threads`` threads; otherwise
    the states of a row are split, up to one chunk per group and ``max_splits``
    groups (default ``tuning.max_splits``; measured in benchmarks/PERF.md).
    """
    wanted = -(-tuning.busy_threads // max(row_threads, 1))
    useful = -(-num_states // chunk)
    return max(1, min(wanted, useful, tuning.max_splits if max_splits is None else max_splits))


def invariant_splits(row_states: int, ragged: bool, group_size: int, tuning: Tuning) -> int:
    """A batch-invariant N-way block's splits, from what every row of the batch shares: a dense
    row of ``row_states`` states one a ``tuning.invariant_split_states`` states, at most
    ``tuning.invariant_max_splits`` and as many as a block of ``tuning.min_pack_threads`` packs,
    or of a whole FP8 group of ``group_size`` elements, holds at one element a pack (the narrowest
    width alignment may force: the splits must not follow the arrays' alignment); a ragged row
    one (a block's splits cannot follow each row's own count without idling most of its threads:
    sweep of session 25)."""
    if ragged:
        return 1
    widest = max(group_size, tuning.min_pack_threads)  # packs a block holds at least
    most = min(tuning.invariant_max_splits, BLOCK_DIMS[2], max(1, tuning.packed_block_limit // widest))
    return max(1, min(most, -(-row_states // tuning.invariant_split_states)))


def _state_offset(spec: ArraySpec, index: int) -> int:
    return index * spec.strides[0] * spec.itemsize


def _state_spec(spec: ArraySpec, index: int) -> ArraySpec:
    """State ``index`` of a stacked array, as a spec of one fewer dimension (no copy)."""
    offset = _state_offset(spec, index)
    align = spec.align if offset == 0 else min(spec.align, offset & -offset)
    return spec._replace(shape=spec.shape[1:], strides=spec.strides[1:], align=align)


# -- the cross-rank merge's steps -------------------------------------------------------------------

#: Threads of a block of the rank kernels, over as many rows as a row's packs leave room for.
RANK_ROW_THREADS = 128


def plan_rank_step(
    family: cat.KernelFamily, dtype: str, rows: int, head_size: int, written: list[ArraySpec], args: dict
) -> KernelLaunch:
    """One of the cross-rank steps (pack, scale) over ``rows`` rows of values: 16-byte packs where
    every row of the values and of the buffers written stays aligned (the merges' rule), else
    elements. ``args`` name pointers as :class:`Pointer`."""
    widths = (16 // cat.ITEMSIZES[dtype], 1)
    vec = choose_vector_width(written, head_size, widths)
    threads_x = max(1, min(head_size // vec, RANK_ROW_THREADS))
    rows_y = max(1, RANK_ROW_THREADS // threads_x)
    grid = (min(-(-rows // rows_y), MAX_GRID_X), 1, 1)
    module = cat.Module(cat.RANKS_SOURCE, dtype, dtype)
    return _launch(family, module, {"T": dtype, "VEC": vec}, grid, (threads_x, rows_y, 1), 0, args)
