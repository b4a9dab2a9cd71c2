"""Validation and launch configuration: pure functions of :class:`ArrayView`.

Nothing here touches a GPU, so every rule (shapes, dtypes, strides, devices,
aliasing) and every launch choice is testable on a machine without one. Each
error names the argument it is about and says what was expected.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ._arrays import ArrayView

#: Value dtype name -> C++ type the kernels are instantiated with.
VALUE_CTYPES = {
    "float32": "float",
    "float16": "cupy_merge::half_t",
    "bfloat16": "cupy_merge::bfloat16_t",
}

#: Elements per vector pack the kernels are instantiated for, by element size:
#: 16-byte packs where shapes and alignment allow, narrower ones otherwise.
VECTOR_WIDTHS = {4: (4, 2, 1), 2: (8, 4, 2, 1)}

#: Measured on the H200 (docs/PERF.md): 64-thread blocks reach 86-88 % of copy speed where
#: 256 reach 81-82 % and 1024 about 61 %.
THREADS_PER_BLOCK = 64
MAX_GRID_Y = 65535


class StateShape(NamedTuple):
    num_tokens: int
    num_heads: int
    head_size: int
    dtype: str
    device: int


class LaunchPlan(NamedTuple):
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[int, ...]


class TwoStateNames(NamedTuple):
    """Argument names as the public function spells them, for error messages."""

    out: str
    out_lse: str
    v_a: str
    s_a: str
    v_b: str
    s_b: str


def two_state_kernel_names() -> list[str]:
    """Every instantiation of the two-way merge kernel, as NVRTC name expressions."""
    return [
        two_state_kernel_name(dtype, vec)
        for dtype, ctype in VALUE_CTYPES.items()
        for vec in VECTOR_WIDTHS[4 if ctype == "float" else 2]
    ]


def two_state_kernel_name(dtype: str, vec: int) -> str:
    return f"cupy_merge::merge_two_states<{VALUE_CTYPES[dtype]}, {vec}>"


def check_two_states(
    v_a: ArrayView, s_a: ArrayView, v_b: ArrayView, s_b: ArrayView, names: TwoStateNames
) -> StateShape:
    """Check the two input states against each other and return their common shape."""
    _expect_ndim(v_a, 3, names.v_a, "[num_tokens, num_heads, head_size]")
    _expect_ndim(v_b, 3, names.v_b, "[num_tokens, num_heads, head_size]")
    _expect_ndim(s_a, 2, names.s_a, "[num_heads, num_tokens]")
    _expect_ndim(s_b, 2, names.s_b, "[num_heads, num_tokens]")
    _expect_value_dtype(v_a, names.v_a)
    _expect_same_dtype(v_b, v_a, names.v_b, names.v_a)
    _expect_float32(s_a, names.s_a)
    _expect_float32(s_b, names.s_b)
    _expect_shape(v_b, v_a.shape, names.v_b, f"the shape of {names.v_a}")
    num_tokens, num_heads, head_size = v_a.shape
    lse_shape = (num_heads, num_tokens)
    _expect_lse_shape(s_a, lse_shape, names.s_a, names.v_a)
    _expect_lse_shape(s_b, lse_shape, names.s_b, names.v_a)
    _expect_unit_last_stride(v_a, names.v_a)
    _expect_unit_last_stride(v_b, names.v_b)
    for view, name in ((v_b, names.v_b), (s_a, names.s_a), (s_b, names.s_b)):
        _expect_device(view, v_a.device, name, names.v_a)
    return StateShape(num_tokens, num_heads, head_size, v_a.dtype, v_a.device)


@functools.lru_cache(maxsize=4096)
def plan_two_way(
    out: ArrayView,
    out_lse: ArrayView | None,
    v_a: ArrayView,
    s_a: ArrayView,
    v_b: ArrayView,
    s_b: ArrayView,
    names: TwoStateNames,
) -> LaunchPlan | None:
    """Check everything and plan the launch, remembered per set of views.

    Serving loops call the merge on the same buffers step after step; the plan
    is a pure function of the views, so a repeat costs one dictionary lookup.
    Failures are never cached (``lru_cache`` does not store exceptions).
    """
    state = check_two_states(v_a, s_a, v_b, s_b, names)
    return plan_merge_two(state, out, out_lse, v_a, s_a, v_b, s_b, names)


def plan_merge_two(
    state: StateShape,
    out: ArrayView,
    out_lse: ArrayView | None,
    v_a: ArrayView,
    s_a: ArrayView,
    v_b: ArrayView,
    s_b: ArrayView,
    names: TwoStateNames,
) -> LaunchPlan | None:
    """Check the outputs and choose the launch; ``None`` when there is nothing to write."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    _expect_ndim(out, 3, names.out, "[num_tokens, num_heads, head_size]")
    _expect_same_dtype(out, v_a, names.out, names.v_a)
    _expect_shape(out, v_a.shape, names.out, f"the shape of {names.v_a}")
    _expect_unit_last_stride(out, names.out)
    _expect_device(out, state.device, names.out, names.v_a)
    outputs = [(out, names.out)]
    if out_lse is not None:
        _expect_ndim(out_lse, 2, names.out_lse, "[num_heads, num_tokens]")
        _expect_float32(out_lse, names.out_lse)
        _expect_lse_shape(out_lse, (num_heads, num_tokens), names.out_lse, names.v_a)
        _expect_device(out_lse, state.device, names.out_lse, names.v_a)
        outputs.append((out_lse, names.out_lse))
    inputs = [(v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)]
    _expect_no_partial_overlap(outputs, inputs)

    if num_tokens == 0 or num_heads == 0:
        return None
    vec = choose_vector_width([out, v_a, v_b], head_size)
    threads_x, rows_per_block = choose_block(head_size // vec, num_tokens)
    grid = (-(-num_tokens // rows_per_block), min(num_heads, MAX_GRID_Y), 1)
    lse_out = out_lse if out_lse is not None else ArrayView(0, (0, 0), (0, 0), "float32", 4, 0)
    args = (
        out.ptr, lse_out.ptr, v_a.ptr, s_a.ptr, v_b.ptr, s_b.ptr,
        num_tokens, num_heads, head_size,
        *out.strides[:2], *v_a.strides[:2], *v_b.strides[:2],
        *lse_out.strides, *s_a.strides, *s_b.strides,
    )  # fmt: skip
    return LaunchPlan(two_state_kernel_name(state.dtype, vec), grid, (threads_x, rows_per_block, 1), args)


def choose_vector_width(values: list[ArrayView], head_size: int) -> int:
    """The widest pack (elements) that divides the row and keeps every access aligned."""
    itemsize = values[0].itemsize
    for vec in VECTOR_WIDTHS[itemsize]:
        if head_size % vec:
            continue
        pack_bytes = vec * itemsize
        if all(_pack_aligned(view, vec, pack_bytes) for view in values):
            return vec
    return 1


def _pack_aligned(view: ArrayView, vec: int, pack_bytes: int) -> bool:
    if view.ptr % pack_bytes:
        return False
    # Strides of dims of extent 1 are never used, so they need not be aligned.
    return all(stride % vec == 0 for extent, stride in zip(view.shape[:2], view.strides[:2]) if extent > 1)


def choose_block(packs_per_row: int, num_tokens: int) -> tuple[int, int]:
    """Threads across a row (one pack each) and rows (tokens) per block."""
    threads_x = max(1, min(packs_per_row, THREADS_PER_BLOCK))
    rows_per_block = max(1, min(THREADS_PER_BLOCK // threads_x, num_tokens))
    return threads_x, rows_per_block


def _expect_ndim(view: ArrayView, ndim: int, name: str, layout: str) -> None:
    if len(view.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array {layout}, got shape {view.shape}")


def _expect_value_dtype(view: ArrayView, name: str) -> None:
    if view.dtype not in VALUE_CTYPES:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {view.dtype}")


def _expect_same_dtype(view: ArrayView, like: ArrayView, name: str, like_name: str) -> None:
    if view.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype} (the dtype of {like_name}), got {view.dtype}")


def _expect_float32(view: ArrayView, name: str) -> None:
    if view.dtype != "float32":
        raise TypeError(f"{name}: expected a float32 log-sum-exp, got dtype {view.dtype}")


def _expect_shape(view: ArrayView, shape: tuple[int, ...], name: str, source: str) -> None:
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({source}), got {tuple(view.shape)}")


def _expect_lse_shape(view: ArrayView, shape: tuple[int, int], name: str, values_name: str) -> None:
    if tuple(view.shape) == tuple(shape):
        return
    hint = ""
    if tuple(view.shape) == shape[::-1]:
        hint = "; a token-major [num_tokens, num_heads] buffer is passed as its transpose (lse.T), no copy"
    raise ValueError(
        f"{name}: expected shape (num_heads, num_tokens) = {shape} from {values_name}, "
        f"got {tuple(view.shape)}{hint}"
    )


def _expect_unit_last_stride(view: ArrayView, name: str) -> None:
    # Empty arrays report arbitrary strides (CuPy: all zero); they are never read.
    if view.shape[-1] > 1 and view.strides[-1] != 1 and 0 not in view.shape:
        raise ValueError(
            f"{name}: expected the last dimension (head_size) to be contiguous (stride 1), "
            f"got strides {view.strides} in elements"
        )


def _expect_device(view: ArrayView, device: int, name: str, like_name: str) -> None:
    if view.device != device:
        raise ValueError(
            f"{name}: expected an array on device {device} (where {like_name} is), got device {view.device}"
        )


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


def _expect_no_partial_overlap(
    outputs: list[tuple[ArrayView, str]], inputs: list[tuple[ArrayView, str]]
) -> None:
    """An output may be exactly an input (in place) but must not partly overlap anything."""
    for index, (out, out_name) in enumerate(outputs):
        for other, other_name in inputs + outputs[index + 1 :]:
            in_place = out == other and (other, other_name) in inputs
            if not in_place and _overlaps(out, other):
                raise ValueError(
                    f"{out_name}: overlaps {other_name} in memory without being the very same "
                    f"array; write in place only into an identical array (same pointer, shape "
                    f"and strides), or into separate memory"
                )


def _overlaps(a: ArrayView, b: ArrayView) -> bool:
    extent_a, extent_b = _byte_extent(a), _byte_extent(b)
    if extent_a is None or extent_b is None:
        return False
    return extent_a[0] < extent_b[1] and extent_b[0] < extent_a[1]
