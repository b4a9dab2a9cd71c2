"""The array rules; each error names the argument and what was expected.

Options (LSE base, output dtype, the prefill cut, flags) are normalised before
anything else happens (``_options``), so a bad option never reaches a cache key
or a launch. Array rules come in two kinds:

* *shape rules* (dimensions, dtypes, shapes, strides, devices, alignment
  classes): pure functions of :class:`ArraySpec`, so they run at trace time
  on fake tensors and JAX abstract values, and are tested without a GPU;
* *address rules* (outputs that overlap inputs or each other): functions of
  :class:`ArrayView`, run where addresses exist (eager calls, ``bind``), in
  ``_addresses``.

``check_two`` / ``check_many`` apply every shape rule of one call, inputs
first, then outputs; the address rules live in ``_addresses``. The cross-rank
merge uses the same rules (``check_rank``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ._arrays import HOST, ArraySpec
from ._catalogue import (
    FP8,
    INDEX_32_LIMIT,
    MAX_STATES_PER_TOKEN,
    NVFP4,
    NVFP4_BLOCK,
    OUTPUT_CTYPES,
    VALUE_CTYPES,
    VALUES_PER_ELEMENT,
)
from ._operands import (
    BackwardOperands,
    BackwardOptions,
    ManyStateOperands,
    ManyStateOptions,
    RankOperands,
    TwoStateOperands,
    TwoStateOptions,
)

INDEX_DTYPES = ("int32", "int64")
#: The layouts the errors name.
VALUES_LAYOUT = "[num_tokens, num_heads, head_size]"
LSE_LAYOUT = "[num_heads, num_tokens]"


# -- single arrays ------------------------------------------------------------------------------


def expect_ndim(spec: ArraySpec, ndim: int, name: str, layout: str) -> None:
    if len(spec.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array {layout}, got shape {spec.shape}")


def expect_value_dtype(spec: ArraySpec, name: str) -> None:
    if spec.dtype not in VALUE_CTYPES:
        hint = "; FP8 is an output dtype only" if spec.dtype == FP8 else ""
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {spec.dtype}{hint}")


def expect_output_dtype(spec: ArraySpec, name: str) -> None:
    if spec.dtype not in OUTPUT_CTYPES:
        raise TypeError(
            f"{name}: expected dtype float32, float16 or bfloat16, float8_e4m3fn with a scale, or "
            f"float4_e2m1fn_x2 (NVFP4) with its block scales (CuPy: uint8 holding their bytes), got {spec.dtype}"
        )


def expect_same_dtype(spec: ArraySpec, like: ArraySpec, name: str, like_name: str) -> None:
    if spec.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype} (the dtype of {like_name}), got {spec.dtype}")


def expect_float32(spec: ArraySpec, name: str, what: str = "a float32 log-sum-exp") -> None:
    if spec.dtype != "float32":
        raise TypeError(f"{name}: expected {what}, got dtype {spec.dtype}")


def expect_shape(spec: ArraySpec, shape: tuple[int, ...], name: str, source: str) -> None:
    if tuple(spec.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({source}), got {tuple(spec.shape)}")


def expect_lse_shape(spec: ArraySpec, shape: tuple[int, ...], name: str, values_name: str) -> None:
    """``shape`` ends in (num_heads, num_tokens); a token-major buffer gets a hint."""
    if tuple(spec.shape) == tuple(shape):
        return
    hint = ""
    swapped = (*shape[:-2], shape[-1], shape[-2])
    if tuple(spec.shape) == swapped:
        hint = "; a token-major [..., num_tokens, num_heads] buffer is passed as a transposed view, no copy"
    layout = "(num_states, num_heads, num_tokens)" if len(shape) == 3 else "(num_heads, num_tokens)"
    raise ValueError(
        f"{name}: expected shape {layout} = {tuple(shape)} from {values_name}, got {tuple(spec.shape)}{hint}"
    )


def expect_unit_last_stride(spec: ArraySpec, name: str) -> None:
    # Empty arrays report arbitrary strides (CuPy: all zero); they are never read.
    if spec.shape[-1] > 1 and spec.strides[-1] != 1 and 0 not in spec.shape:
        raise ValueError(
            f"{name}: expected the last dimension (head_size) to be contiguous (stride 1), "
            f"got strides {spec.strides} in elements"
        )


def expect_device(spec: ArraySpec, device: int, name: str, like_name: str) -> None:
    if spec.device != device:
        where = "the host" if device == HOST else f"device {device}"
        got = "the host" if spec.device == HOST else f"device {spec.device}"
        raise ValueError(f"{name}: expected an array on {where} (where {like_name} is), got one on {got}")


def expect_aligned(spec: ArraySpec, name: str) -> None:
    """A misaligned address would stop the kernel with a sticky CUDA error, ending the process's context."""
    if spec.align < spec.itemsize:
        raise ValueError(
            f"{name}: expected an address aligned to its {spec.itemsize}-byte elements, got one aligned "
            f"to {spec.align} (a view cut at an odd byte offset); copy it into a fresh array"
        )


#: Search steps the exact self-overlap test may take before it refuses an output as undecidable.
_OVERLAP_SEARCH_BUDGET = 20_000


class _Undecided(Exception):
    pass


def shares_elements(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two different indices of an array reach the same element: whether some nonzero
    ``x`` with ``|x_d| < shape_d`` has ``sum(strides_d * x_d) == 0`` (exact; raises ``_Undecided``
    past the search budget, which only contrived strides reach)."""
    terms = sorted(((abs(s), n - 1) for n, s in zip(shape, strides) if n > 1), reverse=True)
    if not terms:
        return False
    if terms[-1][0] == 0:
        return True
    reach = [0] * (len(terms) + 1)  # how far the dimensions from k on can move an offset
    for k in range(len(terms) - 1, -1, -1):
        reach[k] = reach[k + 1] + terms[k][0] * terms[k][1]
    steps = 0

    def solvable(k: int, target: int, nonzero: bool) -> bool:
        nonlocal steps
        steps += 1
        if steps > _OVERLAP_SEARCH_BUDGET:
            raise _Undecided
        if k == len(terms):
            return nonzero and target == 0
        stride, bound = terms[k]
        low = max(-bound, -((reach[k + 1] - target) // stride))  # ceil((target - reach) / stride)
        high = min(bound, (target + reach[k + 1]) // stride)
        if not nonzero:
            low = max(low, 0)  # x and -x solve alike: take the first nonzero coefficient positive
        return any(solvable(k + 1, target - stride * x, nonzero or x != 0) for x in range(low, high + 1))

    return solvable(0, 0, False)


def expect_no_self_overlap(spec: ArraySpec, name: str) -> None:
    """An output whose elements share memory (a broadcast or overlapping view) would be raced on."""
    if 0 in spec.shape:
        return
    try:
        shared = shares_elements(spec.shape, spec.strides)
    except _Undecided:
        raise ValueError(
            f"{name}: expected an output whose elements provably do not share memory; shape {spec.shape} "
            f"with strides {spec.strides} is too irregular to tell; write into a fresh array"
        ) from None
    if shared:
        raise ValueError(
            f"{name}: expected an output whose elements do not share memory, got shape {spec.shape} "
            f"with strides {spec.strides} (a broadcast or overlapping view); write into a fresh array"
        )


def expect_token_mask(spec: ArraySpec, num_tokens: int, device: int, name: str, like_name: str) -> None:
    expect_ndim(spec, 1, name, "[num_tokens]")
    if spec.dtype != "bool":
        raise TypeError(f"{name}: expected a bool array (True = merge this token), got dtype {spec.dtype}")
    expect_shape(spec, (num_tokens,), name, f"num_tokens of {like_name}")
    expect_device(spec, device, name, like_name)


def expect_sinks(spec: ArraySpec, num_heads: int, device: int, name: str, like_name: str) -> None:
    """Attention sinks: float32 ``[num_heads]`` logits, any stride."""
    expect_ndim(spec, 1, name, "[num_heads]")
    expect_float32(spec, name, "float32 sink logits")
    expect_shape(spec, (num_heads,), name, f"num_heads of {like_name}")
    expect_device(spec, device, name, like_name)
    expect_aligned(spec, name)


def expect_index_array(spec: ArraySpec, name: str) -> None:
    expect_ndim(spec, 1, name, "[num_tokens + 1]")
    if spec.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 array, got dtype {spec.dtype}")
    if spec.shape[0] < 1:
        raise ValueError(f"{name}: expected num_tokens + 1 >= 1 entries (the first is 0), got none")


def expect_state_count(num_states: int, name: str) -> None:
    if num_states > MAX_STATES_PER_TOKEN:
        raise ValueError(
            f"{name}: expected at most {MAX_STATES_PER_TOKEN} states a token (float32 sums of more drift "
            f"out of the inputs' range), got {num_states}; merge them in groups first"
        )


def indptr_values(values: Any, total_states: int, name: str = "indptr") -> None:
    """Host-side check of a ragged layout: starts at 0, never decreases, ends within the states,
    no token with more states than a merge takes."""
    import numpy

    values = numpy.asarray(values)
    if values[0] != 0:
        raise ValueError(f"{name}: expected the first entry to be 0, got {int(values[0])}")
    steps = numpy.diff(values)
    if (steps < 0).any():
        token = int(numpy.argmax(steps < 0))
        raise ValueError(
            f"{name}: expected non-decreasing offsets, got indptr[{token}] = {int(values[token])} > "
            f"indptr[{token + 1}] = {int(values[token + 1])}"
        )
    if values[-1] > total_states:
        raise ValueError(
            f"{name}: expected the last entry to be at most total_states = {total_states}, got {int(values[-1])}"
        )
    if steps.size and steps.max() > MAX_STATES_PER_TOKEN:
        token = int(numpy.argmax(steps))
        raise ValueError(
            f"{name}: expected at most {MAX_STATES_PER_TOKEN} states a token, got {int(steps[token])} "
            f"for token {token}"
        )


def named_operands(operands: NamedTuple, names: NamedTuple, fields: tuple[str, ...]) -> list[tuple[Any, str]]:
    """The (operand, its argument name) pairs of ``fields`` given."""
    return [(getattr(operands, f), getattr(names, f)) for f in fields if getattr(operands, f) is not None]


# -- whole calls --------------------------------------------------------------------------------


class StateShape(NamedTuple):
    num_tokens: int
    num_heads: int
    head_size: int
    dtype: str
    device: int


def check_outputs(
    out: ArraySpec, out_lse: ArraySpec | None, state: StateShape, out_name: str, out_lse_name: str, like: str
) -> None:
    """``out`` [tokens, heads, head_size] of any value dtype; ``out_lse`` float32 [heads, tokens]."""
    shape, layout = (state.num_tokens, state.num_heads, state.head_size), f"{VALUES_LAYOUT} of {like}"
    expect_ndim(out, 3, out_name, VALUES_LAYOUT)
    expect_output_dtype(out, out_name)
    if out.dtype == NVFP4:
        if state.head_size % NVFP4_BLOCK:
            raise ValueError(
                f"{out_name}: an NVFP4 output needs a head_size that is a multiple of {NVFP4_BLOCK} (a block "
                f"scale per {NVFP4_BLOCK} values), got head_size {state.head_size}"
            )
        shape = (state.num_tokens, state.num_heads, state.head_size // 2)
        layout = f"[num_tokens, num_heads, head_size // 2] of {like}: two values a byte"
    expect_shape(out, shape, out_name, layout)
    expect_unit_last_stride(out, out_name)
    expect_device(out, state.device, out_name, like)
    expect_aligned(out, out_name)
    expect_no_self_overlap(out, out_name)
    if out_lse is not None:
        expect_ndim(out_lse, 2, out_lse_name, LSE_LAYOUT)
        expect_float32(out_lse, out_lse_name)
        expect_lse_shape(out_lse, (state.num_heads, state.num_tokens), out_lse_name, like)
        expect_device(out_lse, state.device, out_lse_name, like)
        expect_aligned(out_lse, out_lse_name)
        expect_no_self_overlap(out_lse, out_lse_name)


def check_two_inputs(specs: TwoStateOperands, names: TwoStateOperands) -> StateShape:
    """The two input states against each other; their common shape."""
    v_a, s_a, v_b, s_b = specs.v_a, specs.s_a, specs.v_b, specs.s_b
    expect_ndim(v_a, 3, names.v_a, VALUES_LAYOUT)
    expect_ndim(v_b, 3, names.v_b, VALUES_LAYOUT)
    expect_ndim(s_a, 2, names.s_a, LSE_LAYOUT)
    expect_ndim(s_b, 2, names.s_b, LSE_LAYOUT)
    expect_value_dtype(v_a, names.v_a)
    expect_same_dtype(v_b, v_a, names.v_b, names.v_a)
    expect_float32(s_a, names.s_a)
    expect_float32(s_b, names.s_b)
    expect_shape(v_b, v_a.shape, names.v_b, f"the shape of {names.v_a}")
    num_tokens, num_heads, head_size = v_a.shape
    lse_shape = (num_heads, num_tokens)
    expect_lse_shape(s_a, lse_shape, names.s_a, names.v_a)
    expect_lse_shape(s_b, lse_shape, names.s_b, names.v_a)
    expect_unit_last_stride(v_a, names.v_a)
    expect_unit_last_stride(v_b, names.v_b)
    for spec, name in ((v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)):
        expect_device(spec, v_a.device, name, names.v_a)
        expect_aligned(spec, name)
    return StateShape(num_tokens, num_heads, head_size, v_a.dtype, v_a.device)


def check_two(specs: TwoStateOperands, names: TwoStateOperands, options: TwoStateOptions) -> StateShape:
    """Every shape rule of a two-way call (outputs to be allocated given as fresh specs)."""
    state = check_two_inputs(specs, names)
    check_outputs(specs.out, specs.out_lse, state, names.out, names.out_lse, names.v_a)
    if specs.mask is not None:
        expect_token_mask(specs.mask, state.num_tokens, state.device, names.mask, names.v_a)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, names.v_a)
    check_quantisation(specs, names, options, state, ("v_a", "v_b"))
    return state


def check_many_inputs(specs: ManyStateOperands, names: ManyStateOperands) -> tuple[StateShape, int]:
    """Dense (``indptr`` None): ``v`` [states, tokens, heads, head_size], ``s`` [states, heads, tokens].
    Ragged: ``v`` [total_states, heads, head_size], ``s`` [heads, total_states], ``indptr`` [tokens + 1].
    Returns the state shape and the number of states (dense) or rows (ragged)."""
    v, s, indptr = specs.v, specs.s, specs.indptr
    if indptr is None:
        expect_ndim(v, 4, names.v, "[num_states, num_tokens, num_heads, head_size]")
        expect_ndim(s, 3, names.s, "[num_states, num_heads, num_tokens]")
    else:
        expect_ndim(v, 3, names.v, "[total_states, num_heads, head_size]")
        expect_ndim(s, 2, names.s, "[num_heads, total_states]")
        expect_index_array(indptr, names.indptr)
    expect_value_dtype(v, names.v)
    expect_float32(s, names.s)
    if indptr is None:
        num_states, num_tokens, num_heads, head_size = v.shape
        expect_lse_shape(s, (num_states, num_heads, num_tokens), names.s, names.v)
        expect_state_count(num_states, names.v)
    else:
        num_states, num_heads, head_size = v.shape
        num_tokens = indptr.shape[0] - 1
        if tuple(s.shape) != (num_heads, num_states):
            raise ValueError(
                f"{names.s}: expected shape (num_heads, total_states) = {(num_heads, num_states)} from "
                f"{names.v}, got {tuple(s.shape)}"
            )
    expect_unit_last_stride(v, names.v)
    for spec, name in ((v, names.v), (s, names.s), (indptr, names.indptr)):
        if spec is not None:
            expect_device(spec, v.device, name, names.v)
            expect_aligned(spec, name)
    return StateShape(num_tokens, num_heads, head_size, v.dtype, v.device), num_states


def check_many(
    specs: ManyStateOperands, names: ManyStateOperands, options: ManyStateOptions
) -> tuple[StateShape, int]:
    """Every shape rule of an N-way call (outputs to be allocated given as fresh specs)."""
    state, num_states = check_many_inputs(specs, names)
    check_outputs(specs.out, specs.out_lse, state, names.out, names.out_lse, names.v)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, names.v)
    check_quantisation(specs, names, options, state, ("v",))
    return state, num_states


# -- gradients ------------------------------------------------------------------------------------


def check_backward(
    specs: BackwardOperands, names: BackwardOperands, options: BackwardOptions
) -> tuple[StateShape, int]:
    """Every shape rule of a merge's gradient: the states as the forward merge takes them, and the
    gradients of its results (a two-way merge's when ``v_b`` is given). Returns the state shape
    and the number of states (or rows)."""
    del options  # every option is valid here
    if specs.v_b is not None:
        state = check_two_inputs(
            TwoStateOperands(None, None, specs.v, specs.s, specs.v_b, specs.s_b),
            TwoStateOperands(None, None, names.v, names.s, names.v_b, names.s_b),
        )
        num_states = 2
    else:
        state, num_states = check_many_inputs(
            ManyStateOperands(None, None, specs.v, specs.s, specs.indptr),
            ManyStateOperands(None, None, names.v, names.s, names.indptr),
        )
    like = names.v
    _expect_token_values(specs.grad_out, names.grad_out, state, like)
    expect_value_dtype(specs.grad_out, names.grad_out)
    if specs.grad_lse is not None:
        _expect_token_lse(specs.grad_lse, names.grad_lse, state, like)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, like)
    _check_merge_results(specs, names, state)
    return state, num_states


def _expect_token_values(spec: ArraySpec, name: str, state: StateShape, like: str) -> None:
    """A gradient's array of one row of values a token: ``[num_tokens, num_heads, head_size]``."""
    expect_ndim(spec, 3, name, VALUES_LAYOUT)
    expect_shape(spec, (state.num_tokens, state.num_heads, state.head_size), name,
                 f"{VALUES_LAYOUT} of the merge of {like}")  # fmt: skip
    expect_unit_last_stride(spec, name)
    expect_device(spec, state.device, name, like)
    expect_aligned(spec, name)


def _expect_token_lse(spec: ArraySpec, name: str, state: StateShape, like: str) -> None:
    """A gradient's array of one LSE a token: float32 ``[num_heads, num_tokens]``."""
    expect_ndim(spec, 2, name, LSE_LAYOUT)
    expect_float32(spec, name)
    expect_lse_shape(spec, (state.num_heads, state.num_tokens), name, like)
    expect_device(spec, state.device, name, like)
    expect_aligned(spec, name)


def _check_merge_results(specs: BackwardOperands, names: BackwardOperands, state: StateShape) -> None:
    """The merge's results, given to a gradient: both or neither, as the merge returned them (the
    values in ``grad_out``'s dtype and shape, the LSE float32 ``[num_heads, num_tokens]``)."""
    merged, merged_lse = specs.merged, specs.merged_lse
    if merged is None and merged_lse is None:
        return
    if merged is None or merged_lse is None:
        given, missing = (names.merged, names.merged_lse) if merged is not None else (names.merged_lse, names.merged)
        raise ValueError(f"{missing}: expected it with {given} (the merge's results, both or neither), got None")
    _expect_token_values(merged, names.merged, state, names.v)
    if merged.dtype != specs.grad_out.dtype:
        raise TypeError(
            f"{names.merged}: expected the dtype of {names.grad_out} ({specs.grad_out.dtype}), the merge's output "
            f"dtype, got {merged.dtype}"
        )
    _expect_token_lse(merged_lse, names.merged_lse, state, names.v)


# -- FP8 outputs ----------------------------------------------------------------------------------


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


# -- the cross-rank merge -----------------------------------------------------------------------


#: The cross-rank merge's argument names.
RANK_NAMES = RankOperands("v", "s", "out", "out_lse", "sinks")


def check_rank(
    specs: RankOperands, names: RankOperands, world: int, shard_heads: bool
) -> tuple[StateShape, int]:
    """Every shape rule of a cross-rank merge (``specs`` holds ArraySpecs, CPU tensors on
    :data:`HOST`): one rank's state as a two-way merge's input, its outputs as a merge's outputs
    of the result's heads. Returns the state shape and the heads of the result."""
    v, s = specs.v, specs.s
    expect_ndim(v, 3, names.v, VALUES_LAYOUT)
    expect_ndim(s, 2, names.s, LSE_LAYOUT)
    expect_value_dtype(v, names.v)
    expect_float32(s, names.s)
    num_tokens, num_heads, head_size = v.shape
    expect_lse_shape(s, (num_heads, num_tokens), names.s, names.v)
    for spec, name in ((v, names.v), (s, names.s)):
        expect_device(spec, v.device, name, names.v)
        expect_aligned(spec, name)
    if shard_heads and num_heads % world:
        raise ValueError(
            f"{names.v}: expected num_heads divisible by the {world} ranks to shard heads over them, got {num_heads}"
        )
    heads = num_heads // world if shard_heads else num_heads
    result = StateShape(num_tokens, heads, head_size, v.dtype, v.device)
    check_outputs_of_result(specs.out, specs.out_lse, result, names)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, num_heads, v.device, names.sinks, names.v)
    state = StateShape(num_tokens, num_heads, head_size, v.dtype, v.device)
    return state, heads


def check_outputs_of_result(out, out_lse, result: StateShape, names: RankOperands) -> None:
    """A cross-rank merge's outputs: the result's shape and dtype, then a merge output's rules."""
    for spec, name, shape, dtype in (
        (out, names.out, (result.num_tokens, result.num_heads, result.head_size), result.dtype),
        (out_lse, names.out_lse, (result.num_heads, result.num_tokens), "float32"),
    ):
        if spec is None:
            continue
        if tuple(spec.shape) != shape or spec.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} of shape {shape}, got {spec.dtype} of shape {tuple(spec.shape)}")
        if spec is out:
            expect_unit_last_stride(spec, name)
        expect_device(spec, result.device, name, names.v)
        expect_aligned(spec, name)
        expect_no_self_overlap(spec, name)
