"""Every argument rule, in one place; each error names the argument and what was expected.

Options (LSE base, output dtype, the prefill cut, flags) are normalised here
before anything else happens, so a bad option never reaches a cache key or a
launch. Array rules are pure functions of :class:`ArrayView`, so they run (and
are tested) without a GPU. ``check_two_states`` and ``check_many_states`` apply
every rule of one call, inputs first, then outputs.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

from ._arrays import ArrayView
from ._catalogue import FP8, INDEX_32_LIMIT, MAX_QUANT_GROUP, OUTPUT_CTYPES, VALUE_CTYPES

INDEX_DTYPES = ("int32", "int64")


# -- options ------------------------------------------------------------------------------------

_LSE_BASES = {"e": 0, 2: 1, "2": 1}


def lse_base_flag(lse_base: Any) -> int:
    """``"e"`` (natural log, vLLM) -> 0; ``2`` (FlashInfer) -> 1; anything else raises."""
    if type(lse_base) is not bool:
        try:
            flag = _LSE_BASES.get(lse_base)
        except TypeError:  # unhashable, e.g. an array
            flag = None
        if flag is not None:
            return flag
        if isinstance(lse_base, float) and lse_base == math.e:
            return 0
    raise ValueError(f'lse_base: expected "e" (natural log, as vLLM) or 2 (as FlashInfer), got {lse_base!r}')


def value_dtype_name(dtype: Any, name: str = "out_dtype", allowed: dict = VALUE_CTYPES) -> str:
    """The name of a dtype given as a string, NumPy/CuPy/ml_dtypes dtype or torch dtype."""
    text = str(dtype).removeprefix("torch.")
    if text not in allowed:
        try:
            import numpy

            text = numpy.dtype(dtype).name
        except TypeError:
            pass
    if text not in allowed:
        raise TypeError(f"{name}: expected {_dtype_list(allowed)}, got {dtype!r}")
    return text


def _dtype_list(allowed: dict) -> str:
    names = list(allowed)
    return ", ".join(names[:-1]) + " or " + names[-1]


def optional_value_dtype(dtype: Any) -> str | None:
    """An output dtype: a value dtype or FP8 (``"float8_e4m3fn"``), or None."""
    return None if dtype is None else value_dtype_name(dtype, allowed=OUTPUT_CTYPES)


def quant_group(group_size: Any, block_scale: Any, scale_ue8m0: Any) -> tuple[int | None, int]:
    """``(group_size, ue8m0 flag)`` of an FP8 output with group scales, ``(None, 0)`` without."""
    ue8m0 = flag(scale_ue8m0, "scale_ue8m0")
    if block_scale is None:
        if group_size is not None:
            raise ValueError("quant_group_size: given without output_block_scale, where the group scales go")
        if ue8m0:
            raise ValueError("scale_ue8m0: given without output_block_scale (it rounds the group scales)")
        return None, 0
    if group_size is None:
        raise ValueError(
            "quant_group_size: expected the number of elements a group scale covers (e.g. 128), got None"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"quant_group_size: expected an int, got {type(group_size).__name__}")
    if not 1 <= group_size <= MAX_QUANT_GROUP:
        raise ValueError(f"quant_group_size: expected 1 to {MAX_QUANT_GROUP}, got {group_size}")
    return group_size, int(ue8m0)


def token_count(value: Any, name: str = "prefill_tokens_with_context") -> int | None:
    """``None`` or a non-negative Python or NumPy integer, as a Python int.

    Arrays and tensors are refused: their value would be read on the host (a
    synchronisation) and could change after the call was planned.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or type(value).__module__ == "numpy"):
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name}: expected >= 0, got {count}")
    return count


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


# -- single arrays ------------------------------------------------------------------------------


def expect_ndim(view: ArrayView, ndim: int, name: str, layout: str) -> None:
    if len(view.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array {layout}, got shape {view.shape}")


def expect_value_dtype(view: ArrayView, name: str) -> None:
    if view.dtype not in VALUE_CTYPES:
        hint = "; FP8 is an output dtype only" if view.dtype == FP8 else ""
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {view.dtype}{hint}")


def expect_output_dtype(view: ArrayView, name: str) -> None:
    if view.dtype not in OUTPUT_CTYPES:
        raise TypeError(
            f"{name}: expected dtype float32, float16 or bfloat16, or float8_e4m3fn with a scale "
            f"(CuPy: uint8 holding its bytes), got {view.dtype}"
        )


def expect_same_dtype(view: ArrayView, like: ArrayView, name: str, like_name: str) -> None:
    if view.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype} (the dtype of {like_name}), got {view.dtype}")


def expect_float32(view: ArrayView, name: str) -> None:
    if view.dtype != "float32":
        raise TypeError(f"{name}: expected a float32 log-sum-exp, got dtype {view.dtype}")


def expect_shape(view: ArrayView, shape: tuple[int, ...], name: str, source: str) -> None:
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({source}), got {tuple(view.shape)}")


def expect_lse_shape(view: ArrayView, shape: tuple[int, ...], name: str, values_name: str) -> None:
    """``shape`` ends in (num_heads, num_tokens); a token-major buffer gets a hint."""
    if tuple(view.shape) == tuple(shape):
        return
    hint = ""
    swapped = (*shape[:-2], shape[-1], shape[-2])
    if tuple(view.shape) == swapped:
        hint = "; a token-major [..., num_tokens, num_heads] buffer is passed as a transposed view, no copy"
    layout = "(num_states, num_heads, num_tokens)" if len(shape) == 3 else "(num_heads, num_tokens)"
    raise ValueError(
        f"{name}: expected shape {layout} = {tuple(shape)} from {values_name}, got {tuple(view.shape)}{hint}"
    )


def expect_unit_last_stride(view: ArrayView, name: str) -> None:
    # Empty arrays report arbitrary strides (CuPy: all zero); they are never read.
    if view.shape[-1] > 1 and view.strides[-1] != 1 and 0 not in view.shape:
        raise ValueError(
            f"{name}: expected the last dimension (head_size) to be contiguous (stride 1), "
            f"got strides {view.strides} in elements"
        )


def expect_device(view: ArrayView, device: int, name: str, like_name: str) -> None:
    if view.device != device:
        raise ValueError(
            f"{name}: expected an array on device {device} (where {like_name} is), got device {view.device}"
        )


def expect_aligned(view: ArrayView, name: str) -> None:
    """A misaligned address would stop the kernel with a sticky CUDA error, ending the process's context."""
    if view.ptr % view.itemsize:
        raise ValueError(
            f"{name}: expected an address aligned to its {view.itemsize}-byte elements, got "
            f"{view.ptr:#x} (a view cut at an odd byte offset); copy it into a fresh array"
        )


def expect_no_self_overlap(view: ArrayView, name: str) -> None:
    """An output whose elements share memory (a broadcast or overlapping view) would be raced on.

    Sufficient rule: sorted by stride, each dimension of extent > 1 steps past the
    whole span of the ones before it.
    """
    if 0 in view.shape:
        return
    span = 1
    for extent, stride in sorted(
        ((extent, abs(stride)) for extent, stride in zip(view.shape, view.strides) if extent > 1),
        key=lambda pair: pair[1],
    ):
        if stride < span:
            raise ValueError(
                f"{name}: expected an output whose elements do not share memory, got shape {view.shape} "
                f"with strides {view.strides} (a broadcast or overlapping view); write into a fresh array"
            )
        span = stride * extent


def expect_token_mask(view: ArrayView, num_tokens: int, device: int, name: str, like_name: str) -> None:
    expect_ndim(view, 1, name, "[num_tokens]")
    if view.dtype != "bool":
        raise TypeError(f"{name}: expected a bool array (True = merge this token), got dtype {view.dtype}")
    expect_shape(view, (num_tokens,), name, f"num_tokens of {like_name}")
    expect_device(view, device, name, like_name)


def expect_index_array(view: ArrayView, name: str) -> None:
    expect_ndim(view, 1, name, "[num_tokens + 1]")
    if view.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 array, got dtype {view.dtype}")
    if view.shape[0] < 1:
        raise ValueError(f"{name}: expected num_tokens + 1 >= 1 entries (the first is 0), got none")


def indptr_values(values: Any, total_states: int, name: str = "indptr") -> None:
    """Host-side check of a ragged layout: starts at 0, never decreases, ends within the states."""
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


# -- memory shared between arrays ---------------------------------------------------------------


def _byte_extent(view: ArrayView) -> tuple[int, int] | None:
    """[first, last) byte touched by ``view``; ``None`` for an empty array or a fresh output (null)."""
    if 0 in view.shape or view.ptr == 0:
        return None
    low = high = 0
    for extent, stride in zip(view.shape, view.strides):
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return view.ptr + low * view.itemsize, view.ptr + (high + 1) * view.itemsize


def overlaps(a: ArrayView, b: ArrayView) -> bool:
    extent_a, extent_b = _byte_extent(a), _byte_extent(b)
    if extent_a is None or extent_b is None:
        return False
    return extent_a[0] < extent_b[1] and extent_b[0] < extent_a[1]


def expect_no_partial_overlap(
    outputs: list[tuple[ArrayView, str]], inputs: list[tuple[ArrayView, str]]
) -> None:
    """An output may be exactly an input (in place) but must not partly overlap anything."""
    for index, (out, out_name) in enumerate(outputs):
        for other, other_name in inputs + outputs[index + 1 :]:
            in_place = out == other and (other, other_name) in inputs
            if not in_place and overlaps(out, other):
                raise ValueError(
                    f"{out_name}: overlaps {other_name} in memory without being the very same "
                    f"array; write in place only into an identical array (same pointer, shape "
                    f"and strides), or into separate memory"
                )


def expect_separate(outputs: list[tuple[ArrayView, str]], inputs: list[tuple[ArrayView, str]]) -> None:
    """The N-way merge reads its inputs many times: outputs may not alias them at all."""
    for output, output_name in outputs:
        for view, name in inputs + outputs:
            if view is not output and overlaps(output, view):
                raise ValueError(
                    f"{output_name}: expected memory separate from {name}; the N-way merge reads its "
                    f"inputs many times and cannot write over them"
                )


# -- whole calls --------------------------------------------------------------------------------


class StateShape(NamedTuple):
    num_tokens: int
    num_heads: int
    head_size: int
    dtype: str
    device: int


class TwoStateNames(NamedTuple):
    """Argument names as the public function spells them, in the order of its ``arrays``."""

    out: str
    out_lse: str
    v_a: str
    s_a: str
    v_b: str
    s_b: str
    mask: str = "mask"
    out_scale: str = "output_scale"
    group_scale: str = "output_block_scale"


class ManyStateNames(NamedTuple):
    out: str = "out"
    out_lse: str = "out_lse"
    v: str = "v"
    s: str = "s"
    indptr: str = "indptr"
    out_scale: str = "output_scale"
    group_scale: str = "output_block_scale"


def check_two_inputs(
    v_a: ArrayView, s_a: ArrayView, v_b: ArrayView, s_b: ArrayView, names: TwoStateNames
) -> StateShape:
    """The two input states against each other; their common shape."""
    expect_ndim(v_a, 3, names.v_a, "[num_tokens, num_heads, head_size]")
    expect_ndim(v_b, 3, names.v_b, "[num_tokens, num_heads, head_size]")
    expect_ndim(s_a, 2, names.s_a, "[num_heads, num_tokens]")
    expect_ndim(s_b, 2, names.s_b, "[num_heads, num_tokens]")
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
    for view, name in ((v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)):
        expect_device(view, v_a.device, name, names.v_a)
        expect_aligned(view, name)
    return StateShape(num_tokens, num_heads, head_size, v_a.dtype, v_a.device)


def check_outputs(
    out: ArrayView, out_lse: ArrayView | None, state: StateShape, out_name: str, out_lse_name: str, like: str
) -> None:
    """``out`` [tokens, heads, head_size] of any value dtype; ``out_lse`` float32 [heads, tokens]."""
    shape = (state.num_tokens, state.num_heads, state.head_size)
    expect_ndim(out, 3, out_name, "[num_tokens, num_heads, head_size]")
    expect_output_dtype(out, out_name)
    expect_shape(out, shape, out_name, f"[num_tokens, num_heads, head_size] of {like}")
    expect_unit_last_stride(out, out_name)
    expect_device(out, state.device, out_name, like)
    expect_aligned(out, out_name)
    expect_no_self_overlap(out, out_name)
    if out_lse is not None:
        expect_ndim(out_lse, 2, out_lse_name, "[num_heads, num_tokens]")
        expect_float32(out_lse, out_lse_name)
        expect_lse_shape(out_lse, (state.num_heads, state.num_tokens), out_lse_name, like)
        expect_device(out_lse, state.device, out_lse_name, like)
        expect_aligned(out_lse, out_lse_name)
        expect_no_self_overlap(out_lse, out_lse_name)


def check_two_states(
    out: ArrayView,
    out_lse: ArrayView | None,
    v_a: ArrayView,
    s_a: ArrayView,
    v_b: ArrayView,
    s_b: ArrayView,
    mask: ArrayView | None,
    state: StateShape,
    names: TwoStateNames,
) -> None:
    """Every rule of a two-way call whose inputs passed :func:`check_two_inputs`."""
    check_outputs(out, out_lse, state, names.out, names.out_lse, names.v_a)
    inputs = [(v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)]
    if mask is not None:
        expect_token_mask(mask, state.num_tokens, state.device, names.mask, names.v_a)
        inputs.append((mask, names.mask))
    outputs = [(out, names.out)] + ([] if out_lse is None else [(out_lse, names.out_lse)])
    expect_no_partial_overlap(outputs, inputs)


def check_many_inputs(
    v: ArrayView, s: ArrayView, indptr: ArrayView | None, names: ManyStateNames
) -> tuple[StateShape, int]:
    """Dense (``indptr`` None): ``v`` [states, tokens, heads, head_size], ``s`` [states, heads, tokens].
    Ragged: ``v`` [total_states, heads, head_size], ``s`` [heads, total_states], ``indptr`` [tokens + 1].
    Returns the state shape and the number of states (dense) or rows (ragged)."""
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
    else:
        num_states, num_heads, head_size = v.shape
        num_tokens = indptr.shape[0] - 1
        if tuple(s.shape) != (num_heads, num_states):
            raise ValueError(
                f"{names.s}: expected shape (num_heads, total_states) = {(num_heads, num_states)} from "
                f"{names.v}, got {tuple(s.shape)}"
            )
    expect_unit_last_stride(v, names.v)
    for view, name in ((v, names.v), (s, names.s), (indptr, names.indptr)):
        if view is not None:
            expect_device(view, v.device, name, names.v)
            expect_aligned(view, name)
    return StateShape(num_tokens, num_heads, head_size, v.dtype, v.device), num_states


def check_many_states(
    out: ArrayView,
    out_lse: ArrayView | None,
    v: ArrayView,
    s: ArrayView,
    indptr: ArrayView | None,
    state: StateShape,
    names: ManyStateNames,
) -> None:
    """Every rule of an N-way call whose inputs passed :func:`check_many_inputs`."""
    check_outputs(out, out_lse, state, names.out, names.out_lse, names.v)
    inputs = [(v, names.v), (s, names.s)] + ([] if indptr is None else [(indptr, names.indptr)])
    outputs = [(out, names.out)] + ([] if out_lse is None else [(out_lse, names.out_lse)])
    expect_separate(outputs, inputs)


# -- FP8 outputs ----------------------------------------------------------------------------------


def fp8_bytes(out: ArrayView | None, scaled: bool) -> ArrayView | None:
    """A uint8 output given with a scale holds FP8 (float8_e4m3fn) bytes: CuPy has no FP8 dtype."""
    if out is not None and scaled and out.dtype == "uint8":
        return out._replace(dtype=FP8)
    return out


def check_quantisation(
    out: ArrayView,
    out_scale: ArrayView | None,
    group_scale: ArrayView | None,
    group_size: int | None,
    values: list[tuple[ArrayView, str]],
    others: list[tuple[ArrayView, str]],
    state: StateShape,
    names: TwoStateNames | ManyStateNames,
) -> None:
    """An FP8 output has exactly one kind of scale; a scale needs an FP8 output.

    ``out_scale``: float32, one element, read on the device at each launch.
    ``group_scale``: float32 ``[num_tokens, num_heads * head_size / group_size]``,
    written; the group kernels need the packed layout (each value array's heads
    back to back, offsets within 32 bits). ``others``: the call's other arrays,
    which neither kind of scale may overlap.
    """
    if out.dtype != FP8:
        for view, name in ((out_scale, names.out_scale), (group_scale, names.group_scale)):
            if view is not None:
                raise TypeError(
                    f"{name}: a scale is for an FP8 (float8_e4m3fn) output; {names.out} is {out.dtype}"
                )
        return
    if out_scale is None and group_scale is None:
        raise TypeError(
            f"{names.out}: an FP8 output needs its scale: {names.out_scale} (float32, one element, per tensor) "
            f"or {names.group_scale} with quant_group_size (per group)"
        )
    if out_scale is not None and group_scale is not None:
        raise ValueError(
            f"{names.out_scale}: give {names.out_scale} (per tensor) or {names.group_scale} (per group), not both"
        )
    if out_scale is not None:
        if out_scale.dtype != "float32" or math.prod(out_scale.shape) != 1:
            raise TypeError(
                f"{names.out_scale}: expected a float32 array of one element, got {out_scale.dtype} of shape {out_scale.shape}"
            )
        expect_device(out_scale, state.device, names.out_scale, names.out)
        expect_aligned(out_scale, names.out_scale)
        for other, other_name in others:
            if other is not out_scale and overlaps(
                out_scale, other
            ):  # read by every thread while outputs are written
                raise ValueError(
                    f"{names.out_scale}: overlaps {other_name} in memory; the scale needs its own memory"
                )
        return
    assert group_scale is not None and group_size is not None
    name = names.group_scale
    if state.head_size % group_size:
        raise ValueError(
            f"quant_group_size: expected a divisor of head_size {state.head_size}, got {group_size}"
        )
    groups = state.num_heads * state.head_size // group_size
    expect_ndim(group_scale, 2, name, "[num_tokens, num_heads * head_size / quant_group_size]")
    if group_scale.dtype != "float32":
        raise TypeError(f"{name}: expected float32 scales, got dtype {group_scale.dtype}")
    expect_shape(
        group_scale,
        (state.num_tokens, groups),
        name,
        "[num_tokens, num_heads * head_size / quant_group_size]",
    )
    expect_device(group_scale, state.device, name, names.out)
    expect_aligned(group_scale, name)
    expect_no_self_overlap(group_scale, name)
    for other, other_name in others:
        if overlaps(group_scale, other):
            raise ValueError(
                f"{name}: overlaps {other_name} in memory; the group scales need their own memory"
            )
    for view, view_name in [(out, names.out), *values]:
        if view.shape[-2] > 1 and view.strides[-2] != state.head_size:
            raise ValueError(
                f"{name}: group scales need every value array's heads back to back (head stride = head_size); "
                f"{view_name} has strides {view.strides}; copy it into a contiguous array"
            )
    # The group kernels count and offset in 32 bits: every array, and every extent (states too).
    for view, view_name in [(out, names.out), (group_scale, name), *values, *others]:
        if _span(view) >= INDEX_32_LIMIT or max(view.shape, default=0) >= INDEX_32_LIMIT:
            raise ValueError(
                f"{name}: group scales need arrays that span fewer than 2**30 elements; {view_name} spans more"
            )


def _span(view: ArrayView) -> int:
    """How many elements from the lowest to the highest one ``view`` reaches."""
    return sum((n - 1) * abs(stride) for n, stride in zip(view.shape, view.strides) if n > 0)


# -- the cross-rank merge (torch or CuPy arrays, CPU tensors included: plain facts, not views) -----


def check_rank_state(
    v_shape: tuple, v_dtype: str, s_shape: tuple, s_dtype: str, v_device: Any, s_device: Any
) -> tuple[int, int, int]:
    """One rank's state: ``v`` [tokens, heads, head_size] of a value dtype, ``s`` float32 [heads, tokens]."""
    if len(v_shape) != 3:
        raise ValueError(f"v: expected a 3-D array [num_tokens, num_heads, head_size], got shape {v_shape}")
    if v_dtype not in VALUE_CTYPES:
        raise TypeError(f"v: expected dtype float32, float16 or bfloat16, got {v_dtype}")
    if s_dtype != "float32":
        raise TypeError(f"s: expected a float32 log-sum-exp, got dtype {s_dtype}")
    num_tokens, num_heads, head_size = v_shape
    if s_shape != (num_heads, num_tokens):
        raise ValueError(
            f"s: expected shape (num_heads, num_tokens) = {(num_heads, num_tokens)} from v, got {s_shape}"
        )
    if s_device != v_device:
        raise ValueError(f"s: expected an array on the device of v ({v_device}), got {s_device}")
    return num_tokens, num_heads, head_size


def check_rank_output(name: str, given: tuple, like: tuple) -> None:
    """An output of the cross-rank merge: ``(shape, dtype, device)`` equal to ``like``'s."""
    (shape, dtype, device), (like_shape, like_dtype, like_device) = given, like
    if shape != like_shape or dtype != like_dtype:
        raise ValueError(f"{name}: expected {like_dtype} of shape {like_shape}, got {dtype} of shape {shape}")
    if device != like_device:
        raise ValueError(f"{name}: expected an array on {like_device}, got {device}")
