"""Argument checks shared by every merge: each raises naming the argument and what was expected.

Pure functions of :class:`ArrayView`, so they run (and are tested) without a GPU.
"""

from __future__ import annotations

from ._arrays import ArrayView

#: Value dtype name -> C++ type the kernels are instantiated with.
VALUE_CTYPES = {
    "float32": "float",
    "float16": "cupy_merge::half_t",
    "bfloat16": "cupy_merge::bfloat16_t",
}

INDEX_DTYPES = ("int32", "int64")


def expect_ndim(view: ArrayView, ndim: int, name: str, layout: str) -> None:
    if len(view.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array {layout}, got shape {view.shape}")


def expect_value_dtype(view: ArrayView, name: str) -> None:
    if view.dtype not in VALUE_CTYPES:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {view.dtype}")


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


def expect_token_mask(view: ArrayView, num_tokens: int, device: int, name: str, like_name: str) -> None:
    expect_ndim(view, 1, name, "[num_tokens]")
    if view.dtype != "bool":
        raise TypeError(f"{name}: expected a bool array (True = merge this token), got dtype {view.dtype}")
    expect_shape(view, (num_tokens,), name, f"num_tokens of {like_name}")
    expect_device(view, device, name, like_name)


def _byte_extent(view: ArrayView) -> tuple[int, int] | None:
    """[first, last) byte touched by ``view``, or ``None`` for an empty array."""
    if 0 in view.shape:
        return None
    low = high = 0
    for extent, stride in zip(view.shape, view.strides):
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return view.ptr + low * view.itemsize, view.ptr + (high + 1) * view.itemsize


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


def overlaps(a: ArrayView, b: ArrayView) -> bool:
    extent_a, extent_b = _byte_extent(a), _byte_extent(b)
    if extent_a is None or extent_b is None:
        return False
    return extent_a[0] < extent_b[1] and extent_b[0] < extent_a[1]
