"""The rules of quantised outputs: FP8 (a per-tensor scale, or group scales) and NVFP4 (e2m1
values two a byte, e4m3 block scales of 16 values, a global scale); each error names its
argument. :mod:`cupy_merge._checks` runs them after a merge's other output rules."""

from __future__ import annotations

import math
from typing import Any

from ._array_rules import (
    expect_aligned,
    expect_device,
    expect_float32,
    expect_ndim,
    expect_no_self_overlap,
    expect_shape,
    named_operands,
)
from ._arrays import ArraySpec
from ._catalogue import (
    FP8,
    INDEX_32_LIMIT,
    NVFP4,
    NVFP4_BLOCK,
    VALUES_PER_ELEMENT,
)
from ._operands import (
    ManyStateOperands,
    ManyStateOptions,
    StateShape,
    TwoStateOperands,
    TwoStateOptions,
)

# -- FP8 and NVFP4 outputs ----------------------------------------------------------------------------------


#: The dtypes NVFP4 block scales may have: float8_e4m3fn, or its bytes as uint8.
_SCALE_BYTES = ("float8_e4m3fn", "uint8")


def quantised_bytes(out: ArraySpec | None, output_scale: Any, block_scale: ArraySpec | None) -> ArraySpec | None:
    """What a uint8 output holds (CuPy has no FP8 or FP4 dtype; vLLM gives NVFP4 as uint8): with
    block scales of one byte, NVFP4 (``float4_e2m1fn_x2``); with another scale, FP8."""
    if out is None or out.dtype != "uint8":
        return out
    if block_scale is not None and block_scale.dtype in _SCALE_BYTES:
        return out._replace(dtype=NVFP4)
    if output_scale is not None or block_scale is not None:
        return out._replace(dtype=FP8)
    return out


def nvfp4_scale_shape(num_tokens: int, blocks: int, swizzled: bool) -> tuple[int, int]:
    """NVFP4 block scales' shape: ``[num_tokens, blocks]``, or swizzled, the rows padded to 128
    and the columns to 4."""
    if not swizzled:
        return num_tokens, blocks
    return -(-num_tokens // 128) * 128, -(-blocks // 4) * 4


def check_quantisation(
    specs: TwoStateOperands | ManyStateOperands,
    names: TwoStateOperands | ManyStateOperands,
    options: TwoStateOptions | ManyStateOptions,
    state: StateShape,
    value_fields: tuple[str, ...],
) -> None:
    """An FP8 output has exactly one kind of scale, an NVFP4 output both; a scale needs either.

    ``output_scale``: float32, one element, read on the device at each launch.
    ``output_block_scale``: float32 ``[num_tokens, num_heads * head_size / group_size]``,
    written; the group kernels need the packed layout (each value array's heads
    back to back, offsets within 32 bits).
    """
    out, out_scale, group_scale = specs.out, specs.output_scale, specs.output_block_scale
    group_size = options.group_size
    if out.dtype == NVFP4:
        _check_nvfp4(specs, names, options, state, value_fields)
        return
    if not options.swizzled_scales:
        raise ValueError(
            f"is_sf_swizzled_layout: False is the layout of NVFP4 block scales; {names.out} is {out.dtype}"
        )
    if out.dtype != FP8:
        for spec, name in ((out_scale, names.output_scale), (group_scale, names.output_block_scale)):
            if spec is not None:
                raise TypeError(
                    f"{name}: a scale is for an FP8 (float8_e4m3fn) output; {names.out} is {out.dtype} (an NVFP4 "
                    f"output, float4_e2m1fn_x2, takes both scales)"
                )
        return
    if out_scale is None and group_scale is None:
        raise TypeError(
            f"{names.out}: an FP8 output needs its scale: {names.output_scale} (float32, one element, per "
            f"tensor) or {names.output_block_scale} with quant_group_size (per group)"
        )
    if out_scale is not None and group_scale is not None:
        raise ValueError(
            f"{names.output_scale}: give {names.output_scale} (per tensor) or {names.output_block_scale} "
            f"(per group), not both"
        )
    if out_scale is not None:
        _expect_one_float32(out_scale, names.output_scale, state, names.out)
        return
    assert group_scale is not None
    name = names.output_block_scale
    if group_size is None:
        raise ValueError(
            "quant_group_size: expected the number of elements a group scale covers (e.g. 128), got None"
        )
    if group_scale.dtype in _SCALE_BYTES:
        raise TypeError(
            f"{name}: one-byte block scales ({group_scale.dtype}) are NVFP4's; FP8 group scales are float32"
        )
    if not state.head_size:
        raise ValueError("quant_group_size: group scales need a head_size of 1 or more, got head_size 0 (no values)")
    if state.head_size % group_size:
        raise ValueError(f"quant_group_size: expected a divisor of head_size {state.head_size}, got {group_size}")
    layout = "[num_tokens, num_heads * head_size / quant_group_size]"
    expect_ndim(group_scale, 2, name, layout)
    expect_float32(group_scale, name, "float32 scales")
    expect_shape(group_scale, (state.num_tokens, state.num_heads * state.head_size // group_size), name, layout)
    _expect_block_scale_arrays(specs, names, state, value_fields)


def _check_nvfp4(specs, names, options, state: StateShape, value_fields: tuple[str, ...]) -> None:
    """An NVFP4 output: its global scale (``output_scale``: float32, one element, on the device,
    read at each launch) and its block scales (``output_block_scale``: one byte each, written,
    swizzled ``[ceil(T / 128) * 128, ceil(G / 4) * 4]`` C-contiguous or row-major ``[T, G]``, G =
    ``num_heads * head_size // 16``); 16 values a block, e4m3 scales."""
    out_scale, block_scale = specs.output_scale, specs.output_block_scale
    if out_scale is None or block_scale is None:
        missing = names.output_scale if out_scale is None else names.output_block_scale
        raise TypeError(
            f"{missing}: an NVFP4 output ({names.out}) needs {names.output_scale} (its global scale: float32, one "
            f"element, on the device) and {names.output_block_scale} (its float8_e4m3fn block scales, written)"
        )
    _expect_one_float32(out_scale, names.output_scale, state, names.out)
    if options.group_size not in (None, NVFP4_BLOCK):
        raise ValueError(f"quant_group_size: NVFP4 has a scale per {NVFP4_BLOCK} values, got {options.group_size}")
    if options.scale_ue8m0:
        raise ValueError("scale_ue8m0: NVFP4 block scales are float8_e4m3fn, not UE8M0")
    name = names.output_block_scale
    if block_scale.dtype not in _SCALE_BYTES:
        raise TypeError(f"{name}: expected NVFP4 block scales of dtype float8_e4m3fn (or uint8), got {block_scale.dtype}")
    blocks = state.num_heads * state.head_size // NVFP4_BLOCK
    swizzled = options.swizzled_scales
    layout = (
        "[ceil(num_tokens / 128) * 128, ceil(num_heads * head_size / 64) * 4], swizzled"
        if swizzled
        else "[num_tokens, num_heads * head_size // 16] (is_sf_swizzled_layout=False)"
    )
    expect_ndim(block_scale, 2, name, layout)
    expect_shape(block_scale, nvfp4_scale_shape(state.num_tokens, blocks, swizzled), name, layout)
    if swizzled and 0 not in block_scale.shape and block_scale.strides != (block_scale.shape[1], 1):
        raise ValueError(
            f"{name}: swizzled block scales are C-contiguous tiles, got strides {block_scale.strides}; pass a "
            f"fresh array, or is_sf_swizzled_layout=False for row-major scales of any strides"
        )
    if swizzled and block_scale.align < 4:  # the padding is zeroed four scales at a time
        raise ValueError(
            f"{name}: expected swizzled block scales at a 4-byte aligned address, got one aligned to "
            f"{block_scale.align}; pass a fresh array"
        )
    for field in value_fields:  # a byte of output is two values: the kernels read at least pairs
        spec, spec_name = getattr(specs, field), getattr(names, field)
        odd = [stride for extent, stride in zip(spec.shape[:-1], spec.strides[:-1]) if extent > 1 and stride % 2]
        if spec.align < 2 * spec.itemsize or odd:
            raise ValueError(
                f"{spec_name}: an NVFP4 output needs its values in pairs (two values a byte): an address aligned "
                f"to {2 * spec.itemsize} bytes and even strides, got one aligned to {spec.align} and strides "
                f"{spec.strides}; copy it into a fresh array"
            )
    _expect_block_scale_arrays(specs, names, state, value_fields)


def _expect_one_float32(spec: ArraySpec, name: str, state: StateShape, like: str) -> None:
    if spec.dtype != "float32" or math.prod(spec.shape) != 1:
        raise TypeError(f"{name}: expected a float32 array of one element, got {spec.dtype} of shape {spec.shape}")
    expect_device(spec, state.device, name, like)
    expect_aligned(spec, name)


def _expect_block_scale_arrays(specs, names, state: StateShape, value_fields: tuple[str, ...]) -> None:
    """Block scales' own rules, and the packed layout their kernels need of every array."""
    out, group_scale, name = specs.out, specs.output_block_scale, names.output_block_scale
    expect_device(group_scale, state.device, name, names.out)
    expect_aligned(group_scale, name)
    expect_no_self_overlap(group_scale, name)
    values = [(out, names.out)] + [(getattr(specs, f), getattr(names, f)) for f in value_fields]
    for spec, spec_name in values:
        if spec.shape[-2] > 1 and spec.strides[-2] != state.head_size // VALUES_PER_ELEMENT.get(spec.dtype, 1):
            raise ValueError(
                f"{name}: group scales need every value array's heads back to back (head stride = head_size); "
                f"{spec_name} has strides {spec.strides}; copy it into a contiguous array"
            )
    # The group kernels count and offset in 32 bits: every array, and every extent (states too).
    for spec, spec_name in named_operands(specs, names, specs._fields):
        if span(spec) >= INDEX_32_LIMIT or max(spec.shape, default=0) >= INDEX_32_LIMIT:
            raise ValueError(
                f"{name}: group scales need arrays that span fewer than 2**30 elements; {spec_name} spans more"
            )


def span(spec: ArraySpec) -> int:
    """How many elements from the lowest to the highest one ``spec`` reaches."""
    return sum((n - 1) * abs(stride) for n, stride in zip(spec.shape, spec.strides) if n > 0)


