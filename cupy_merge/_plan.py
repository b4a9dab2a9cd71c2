"""Launch configuration, and the two-way merge's checks and plan: pure functions of :class:`ArrayView`.

Nothing here touches a GPU, so every rule (shapes, dtypes, strides, devices,
aliasing) and every launch choice is testable on a machine without one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from . import _checks as check
from ._arrays import ArrayView
from ._checks import VALUE_CTYPES

#: Elements per vector pack the kernels are instantiated for, by the smaller element
#: size of input and output: 16-byte packs where shapes and alignment allow.
VECTOR_WIDTHS = {4: (4, 2, 1), 2: (8, 4, 2, 1)}

#: Measured on the H200 (docs/PERF.md): 64-thread blocks beat 128-1024 thread ones.
THREADS_PER_BLOCK = 64
#: Tokens each thread of the two-way kernel owns (its template parameter ROWS):
#: 2 measured 8-12 points of copy speed above 1 and 4 from tens of MB; below
#: SMALL_TRAFFIC_BYTES one row a thread (twice the threads, each done sooner)
#: measured 0.03-0.45 us faster (docs/PERF.md, sweep 10).
ROWS_PER_THREAD = 2
SMALL_ROWS_PER_THREAD = 1
SMALL_TRAFFIC_BYTES = 32_000_000
ROWS_INSTANTIATED = (1, 2, 4)
#: Rows per thread when the first packs are staged through shared memory with
#: cp.async (16-byte packs only; see the kernel), and whether to do so. Staging 4
#: rows measured 0-3 points of copy speed better from about 200 MB of traffic and
#: up to 11 points worse below it, where the direct loads stay (docs/PERF.md).
ASYNC_LOADS = True
ASYNC_MIN_TRAFFIC_BYTES = 200_000_000
ASYNC_ROWS_PER_THREAD = 4
ASYNC_ROWS_INSTANTIATED = (2, 4, 8)
#: Offset types instantiated; ``index_type`` picks one per call. The staged
#: two-way kernels (200 MB and up) measured 1-2 points faster with 64-bit offsets
#: and exist only in that width (docs/PERF.md).
INDEX_TYPES = ("int", "long long")
STAGED_INDEX = "long long"
INDEX_32 = True
INDEX_32_LIMIT = 2**30
#: Work items beyond this many blocks are looped over inside the kernel.
MAX_GRID_X = 2**31 - 1

TWO_STATES_SOURCE = "merge_two_states.cu"
MANY_STATES_SOURCE = "merge_many_states.cu"


class StateShape(NamedTuple):
    num_tokens: int
    num_heads: int
    head_size: int
    dtype: str
    device: int


class LaunchPlan(NamedTuple):
    """One kernel launch; ``module`` is (source file, input dtype, output dtype)."""

    module: tuple[str, str, str]
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[int, ...]
    shared_bytes: int = 0


class TwoStateNames(NamedTuple):
    """Argument names as the public function spells them, for error messages."""

    out: str
    out_lse: str
    v_a: str
    s_a: str
    v_b: str
    s_b: str
    mask: str = "mask"


class TwoStateOptions(NamedTuple):
    """Per-call conventions: LSE base flag (0 = e, 1 = 2) and the first token copied from b."""

    lse_base_2: int = 0
    merge_tokens: int | None = None


DEFAULT_OPTIONS = TwoStateOptions()


def vector_widths(in_dtype: str, out_dtype: str) -> tuple[int, ...]:
    return VECTOR_WIDTHS[4 if in_dtype == out_dtype == "float32" else 2]


def module_kernel_names(source: str, in_dtype: str, out_dtype: str) -> list[str]:
    """Every kernel instantiation compiled together in one module."""
    widths = vector_widths(in_dtype, out_dtype)
    if source == TWO_STATES_SOURCE:
        full_pack = 16 // ITEMSIZES[in_dtype]
        direct = [
            two_state_kernel_name(in_dtype, out_dtype, vec, rows, False, index)
            for vec in widths
            for rows in ROWS_INSTANTIATED
            for index in INDEX_TYPES
        ]
        staged = [
            two_state_kernel_name(in_dtype, out_dtype, full_pack, rows, True, STAGED_INDEX)
            for rows in ASYNC_ROWS_INSTANTIATED
        ]
        return direct + (staged if full_pack in widths else [])
    return [
        many_state_kernel_name(in_dtype, out_dtype, vec, split, index)
        for vec in widths
        for split in (False, True)
        for index in INDEX_TYPES
    ]


def all_modules() -> list[tuple[str, str, str]]:
    return [
        (source, a, b)
        for source in (TWO_STATES_SOURCE, MANY_STATES_SOURCE)
        for a in VALUE_CTYPES
        for b in VALUE_CTYPES
    ]


ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def two_state_kernel_name(
    in_dtype: str, out_dtype: str, vec: int, rows: int, staged: bool = False, index: str = "long long"
) -> str:
    ctypes = f"{VALUE_CTYPES[in_dtype]}, {VALUE_CTYPES[out_dtype]}"
    return f"cupy_merge::merge_two_states<{ctypes}, {vec}, {rows}, {str(staged).lower()}, {index}>"


def many_state_kernel_name(
    in_dtype: str, out_dtype: str, vec: int, split: bool = False, index: str = "long long"
) -> str:
    ctypes = f"{VALUE_CTYPES[in_dtype]}, {VALUE_CTYPES[out_dtype]}"
    return f"cupy_merge::merge_many_states<{ctypes}, {vec}, {str(split).lower()}, {index}>"


def kernel_template_arguments(kernel: str) -> list[str]:
    """``"ns::f<A, B, 8>"`` -> ``["A", "B", "8"]``: a planned kernel's template arguments."""
    return kernel[kernel.index("<") + 1 : -1].split(", ")


def index_type(views: list[ArrayView | None], rows: int) -> str:
    """The kernels' integer type for element offsets: 32-bit when every offset fits.

    32-bit offsets take fewer registers and instructions (the N-way kernel gained
    up to 12 points of copy speed, docs/PERF.md). The bound, 2**30 rather than
    2**31, leaves room for the sums a grid-stride loop forms past the last item.
    ``rows`` (tokens x heads) is bounded too: with head_size 0 no array spans it.
    """
    if not INDEX_32 or rows >= INDEX_32_LIMIT:
        return "long long"
    for view in views:
        if view is not None and view.shape and min(view.shape) > 0:
            extent = sum((n - 1) * abs(stride) for n, stride in zip(view.shape, view.strides))
            if extent >= INDEX_32_LIMIT:
                return "long long"
    return "int"


def check_two_states(
    v_a: ArrayView, s_a: ArrayView, v_b: ArrayView, s_b: ArrayView, names: TwoStateNames
) -> StateShape:
    """Check the two input states against each other and return their common shape."""
    check.expect_ndim(v_a, 3, names.v_a, "[num_tokens, num_heads, head_size]")
    check.expect_ndim(v_b, 3, names.v_b, "[num_tokens, num_heads, head_size]")
    check.expect_ndim(s_a, 2, names.s_a, "[num_heads, num_tokens]")
    check.expect_ndim(s_b, 2, names.s_b, "[num_heads, num_tokens]")
    check.expect_value_dtype(v_a, names.v_a)
    check.expect_same_dtype(v_b, v_a, names.v_b, names.v_a)
    check.expect_float32(s_a, names.s_a)
    check.expect_float32(s_b, names.s_b)
    check.expect_shape(v_b, v_a.shape, names.v_b, f"the shape of {names.v_a}")
    num_tokens, num_heads, head_size = v_a.shape
    lse_shape = (num_heads, num_tokens)
    check.expect_lse_shape(s_a, lse_shape, names.s_a, names.v_a)
    check.expect_lse_shape(s_b, lse_shape, names.s_b, names.v_a)
    check.expect_unit_last_stride(v_a, names.v_a)
    check.expect_unit_last_stride(v_b, names.v_b)
    for view, name in ((v_b, names.v_b), (s_a, names.s_a), (s_b, names.s_b)):
        check.expect_device(view, v_a.device, name, names.v_a)
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
    mask: ArrayView | None = None,
    options: TwoStateOptions = DEFAULT_OPTIONS,
) -> LaunchPlan | None:
    """Check everything and plan the launch, remembered per set of views.

    Failures are never cached (``lru_cache`` does not store exceptions).
    """
    state = check_two_states(v_a, s_a, v_b, s_b, names)
    return plan_merge_two(state, out, out_lse, v_a, s_a, v_b, s_b, names, mask, options)


def plan_merge_two(
    state: StateShape,
    out: ArrayView,
    out_lse: ArrayView | None,
    v_a: ArrayView,
    s_a: ArrayView,
    v_b: ArrayView,
    s_b: ArrayView,
    names: TwoStateNames,
    mask: ArrayView | None = None,
    options: TwoStateOptions = DEFAULT_OPTIONS,
) -> LaunchPlan | None:
    """Check the outputs and choose the launch; ``None`` when there is nothing to write."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    check_outputs(out, out_lse, state, names.out, names.out_lse, names.v_a)
    inputs = [(v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)]
    if mask is not None:
        check.expect_token_mask(mask, num_tokens, state.device, names.mask, names.v_a)
        inputs.append((mask, names.mask))
    outputs = [(out, names.out)] + ([] if out_lse is None else [(out_lse, names.out_lse)])
    check.expect_no_partial_overlap(outputs, inputs)

    if num_tokens == 0 or num_heads == 0:
        return None
    vec = choose_vector_width([out, v_a, v_b], head_size, vector_widths(state.dtype, out.dtype))
    threads_x, rows_y = choose_block(head_size // vec, num_tokens)
    traffic = num_tokens * num_heads * head_size * (2 * v_a.itemsize + out.itemsize)
    staged = ASYNC_LOADS and vec * v_a.itemsize == 16 and traffic >= ASYNC_MIN_TRAFFIC_BYTES
    rows = choose_rows_per_thread(num_tokens, rows_y, staged, traffic < SMALL_TRAFFIC_BYTES)
    shared_bytes = 2 * rows * threads_x * rows_y * 16 if staged else 0
    grid = (min(-(-num_tokens // (rows_y * rows)) * num_heads, MAX_GRID_X), 1, 1)
    lse_out = out_lse if out_lse is not None else NO_ARRAY
    mask_view = mask if mask is not None else NO_ARRAY
    merge_tokens = num_tokens if options.merge_tokens is None else min(options.merge_tokens, num_tokens)
    lse_is_input = int(out_lse is not None and out_lse in (s_a, s_b))
    args = (
        out.ptr, lse_out.ptr, v_a.ptr, s_a.ptr, v_b.ptr, s_b.ptr, mask_view.ptr,
        num_tokens, num_heads, head_size, merge_tokens,
        *out.strides[:2], *v_a.strides[:2], *v_b.strides[:2],
        *lse_out.strides, *s_a.strides, *s_b.strides,
        mask_view.strides[0], options.lse_base_2, lse_is_input,
    )  # fmt: skip
    index = (
        STAGED_INDEX
        if staged
        else index_type([out, out_lse, v_a, s_a, v_b, s_b, mask], num_tokens * num_heads)
    )
    kernel = two_state_kernel_name(state.dtype, out.dtype, vec, rows, staged, index)
    block = (threads_x, rows_y, 1)
    return LaunchPlan((TWO_STATES_SOURCE, state.dtype, out.dtype), kernel, grid, block, args, shared_bytes)


#: Where every plan puts the output pointers in its kernel arguments (both kernels
#: take ``out, out_lse`` first), so a repeated allocating call can swap in fresh ones.
OUT_ARGUMENT, OUT_LSE_ARGUMENT = 0, 1

#: Stands in for an optional array that was not given (a null pointer, strides 0).
NO_ARRAY = ArrayView(0, (0, 0), (0, 0), "float32", 4, 0)


def check_outputs(
    out: ArrayView,
    out_lse: ArrayView | None,
    state: StateShape,
    out_name: str,
    out_lse_name: str,
    like_name: str,
) -> None:
    """``out`` [tokens, heads, head_size] of any value dtype; ``out_lse`` float32 [heads, tokens]."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    check.expect_ndim(out, 3, out_name, "[num_tokens, num_heads, head_size]")
    check.expect_value_dtype(out, out_name)
    check.expect_shape(
        out,
        (num_tokens, num_heads, head_size),
        out_name,
        f"[num_tokens, num_heads, head_size] of {like_name}",
    )
    check.expect_unit_last_stride(out, out_name)
    check.expect_device(out, state.device, out_name, like_name)
    if out_lse is not None:
        check.expect_ndim(out_lse, 2, out_lse_name, "[num_heads, num_tokens]")
        check.expect_float32(out_lse, out_lse_name)
        check.expect_lse_shape(out_lse, (num_heads, num_tokens), out_lse_name, like_name)
        check.expect_device(out_lse, state.device, out_lse_name, like_name)


def choose_vector_width(
    values: list[ArrayView], head_size: int, widths: tuple[int, ...] | None = None
) -> int:
    """The widest pack (elements) that divides the row and keeps every access aligned."""
    for vec in widths or VECTOR_WIDTHS[values[0].itemsize]:
        if head_size % vec:
            continue
        if all(_pack_aligned(view, vec) for view in values):
            return vec
    return 1


def _pack_aligned(view: ArrayView, vec: int) -> bool:
    pack_bytes = min(vec * view.itemsize, 16)
    if view.ptr % pack_bytes:
        return False
    # Strides of dims of extent 1 are never used, so they need not be aligned.
    return all(stride % vec == 0 for extent, stride in zip(view.shape[:-1], view.strides[:-1]) if extent > 1)


def choose_block(packs_per_row: int, num_tokens: int) -> tuple[int, int]:
    """Threads across a row (one pack each) and rows (tokens) per block."""
    threads_x = max(1, min(packs_per_row, THREADS_PER_BLOCK))
    rows_per_block = max(1, min(THREADS_PER_BLOCK // threads_x, num_tokens))
    return threads_x, rows_per_block


def choose_rows_per_thread(num_tokens: int, rows_y: int, staged: bool = False, small: bool = False) -> int:
    """Rows a thread owns: the measured best, fewer when there are too few tokens for that many."""
    if staged:
        rows, allowed = ASYNC_ROWS_PER_THREAD, ASYNC_ROWS_INSTANTIATED
    else:
        rows, allowed = (SMALL_ROWS_PER_THREAD if small else ROWS_PER_THREAD), ROWS_INSTANTIATED
    while rows > min(allowed) and rows_y * rows > num_tokens:
        rows //= 2
    return rows
