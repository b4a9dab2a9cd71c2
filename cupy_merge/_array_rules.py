"""The rules of single arrays: each a pure function of an :class:`ArraySpec` (or of host values),
raising with the argument's name and what was expected. :mod:`cupy_merge._checks` applies them to
whole calls, :mod:`cupy_merge._quantised` to quantised outputs."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._arrays import HOST, ArraySpec
from ._catalogue import (
    FP8,
    MAX_STATES_PER_TOKEN,
    OUTPUT_CTYPES,
    VALUE_CTYPES,
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
    """Attention sinks: float32 ``[num_heads]`` logits, any stride the kernels' 32-bit one holds."""
    expect_ndim(spec, 1, name, "[num_heads]")
    expect_float32(spec, name, "float32 sink logits")
    expect_shape(spec, (num_heads,), name, f"num_heads of {like_name}")
    expect_device(spec, device, name, like_name)
    expect_aligned(spec, name)
    stride = spec.strides[0]
    if num_heads > 1 and not -(2**31) <= stride < 2**31:
        raise ValueError(
            f"{name}: expected a stride within 32 bits (the kernels read the sinks by an int), got {stride} "
            f"elements; pass a contiguous copy ({num_heads} floats)"
        )


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


