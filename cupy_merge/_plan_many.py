"""Checks and launch plans of the N-way and ragged (varlen) merges: pure functions of :class:`ArrayView`."""

from __future__ import annotations

import functools
from typing import NamedTuple

from . import _checks as check
from ._arrays import ArrayView
from ._plan import (
    MANY_STATES_SOURCE,
    MAX_GRID_X,
    NO_ARRAY,
    LaunchPlan,
    StateShape,
    TwoStateNames,
    TwoStateOptions,
    check_outputs,
    choose_block,
    choose_vector_width,
    index_type,
    many_state_kernel_name,
    plan_merge_two,
    vector_widths,
)


class ManyStateNames(NamedTuple):
    out: str = "out"
    out_lse: str = "out_lse"
    v: str = "v"
    s: str = "s"
    indptr: str = "indptr"


NAMES = ManyStateNames()

#: States each thread loads per memory round trip (the kernel's MERGE_CHUNK).
CHUNK = 4
#: Row threads (rows x threads per row) beyond which splitting a row's states
#: over more threads stopped paying on the H200 (docs/PERF.md).
BUSY_THREADS = 128 * 1024
#: Block size cap: keeps any register count (<= 255 a thread) launchable.
MAX_BLOCK_THREADS = 256
#: Fixed number of state splits per row, for measurements; None chooses by shape.
STATE_SPLITS: int | None = None
MAX_SPLITS = 16


def check_many_states(v: ArrayView, s: ArrayView, names: ManyStateNames = NAMES) -> tuple[StateShape, int]:
    """Dense states: ``v`` [states, tokens, heads, head_size], ``s`` [states, heads, tokens]."""
    check.expect_ndim(v, 4, names.v, "[num_states, num_tokens, num_heads, head_size]")
    check.expect_ndim(s, 3, names.s, "[num_states, num_heads, num_tokens]")
    check.expect_value_dtype(v, names.v)
    check.expect_float32(s, names.s)
    num_states, num_tokens, num_heads, head_size = v.shape
    check.expect_lse_shape(s, (num_states, num_heads, num_tokens), names.s, names.v)
    check.expect_unit_last_stride(v, names.v)
    check.expect_device(s, v.device, names.s, names.v)
    return StateShape(num_tokens, num_heads, head_size, v.dtype, v.device), num_states


def check_varlen_states(
    v: ArrayView, s: ArrayView, indptr: ArrayView, names: ManyStateNames = NAMES
) -> tuple[StateShape, int]:
    """Ragged states: ``v`` [total_states, heads, head_size], ``s`` [heads, total_states], ``indptr`` [tokens + 1]."""
    check.expect_ndim(v, 3, names.v, "[total_states, num_heads, head_size]")
    check.expect_ndim(s, 2, names.s, "[num_heads, total_states]")
    check.expect_ndim(indptr, 1, names.indptr, "[num_tokens + 1]")
    check.expect_value_dtype(v, names.v)
    check.expect_float32(s, names.s)
    if indptr.dtype not in check.INDEX_DTYPES:
        raise TypeError(f"{names.indptr}: expected an int32 or int64 array, got dtype {indptr.dtype}")
    if indptr.shape[0] < 1:
        raise ValueError(f"{names.indptr}: expected num_tokens + 1 >= 1 entries (the first is 0), got none")
    total_states, num_heads, head_size = v.shape
    if tuple(s.shape) != (num_heads, total_states):
        raise ValueError(
            f"{names.s}: expected shape (num_heads, total_states) = {(num_heads, total_states)} from "
            f"{names.v}, got {tuple(s.shape)}"
        )
    check.expect_unit_last_stride(v, names.v)
    check.expect_device(s, v.device, names.s, names.v)
    check.expect_device(indptr, v.device, names.indptr, names.v)
    return StateShape(indptr.shape[0] - 1, num_heads, head_size, v.dtype, v.device), total_states


def check_indptr_values(values, total_states: int, name: str = "indptr") -> None:
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


@functools.lru_cache(maxsize=4096)
def plan_many(
    out: ArrayView,
    out_lse: ArrayView | None,
    v: ArrayView,
    s: ArrayView,
    indptr: ArrayView | None,
    lse_base_2: int,
    names: ManyStateNames = NAMES,
) -> LaunchPlan | None:
    """Check everything and plan one launch of the N-way kernel (dense when ``indptr`` is None)."""
    if indptr is None:
        state, num_states = check_many_states(v, s, names)
        v_strides, s_strides = v.strides[:3], s.strides  # (state, token, head), (state, head, token)
        inputs = [(v, names.v), (s, names.s)]
    else:
        state, num_states = check_varlen_states(v, s, indptr, names)
        v_strides = (v.strides[0], 0, v.strides[1])
        s_strides = (s.strides[1], s.strides[0], 0)
        inputs = [(v, names.v), (s, names.s), (indptr, names.indptr)]
    check_outputs(out, out_lse, state, names.out, names.out_lse, names.v)
    outputs = [(out, names.out)] + ([] if out_lse is None else [(out_lse, names.out_lse)])
    # Inputs are read many times over a row, so an output may not alias them at all.
    for output, output_name in outputs:
        for view, name in inputs + outputs:
            if view is not output and check.overlaps(output, view):
                raise ValueError(
                    f"{output_name}: expected memory separate from {name}; the N-way merge reads its "
                    f"inputs many times and cannot write over them"
                )

    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    if num_tokens == 0 or num_heads == 0:
        return None
    vec = choose_vector_width([out, v], head_size, vector_widths(state.dtype, out.dtype))
    if indptr is None and num_states == 2:
        # Two states are the two-way kernel's job: it keeps twice the loads in flight.
        return _plan_as_two_way(out, out_lse, v, s, state, lse_base_2)
    threads_x, rows_y = choose_block(head_size // vec, num_tokens)
    splits = choose_state_splits(num_states, num_tokens * num_heads * threads_x, threads_x)
    rows_y = max(1, min(rows_y, MAX_BLOCK_THREADS // (threads_x * splits)))
    grid = (min(-(-num_tokens // rows_y) * num_heads, MAX_GRID_X), 1, 1)
    shared_bytes = (splits - 1) * threads_x * rows_y * (vec + 3) * 4  # sizeof(Partial<VEC>) per slot
    lse_out = out_lse if out_lse is not None else NO_ARRAY
    index = indptr if indptr is not None else NO_ARRAY._replace(dtype="int64", itemsize=8)
    args = (
        out.ptr, lse_out.ptr, v.ptr, s.ptr, index.ptr, index.itemsize, index.strides[0],
        num_states, num_tokens, num_heads, head_size,
        *out.strides[:2], *v_strides, *lse_out.strides, *s_strides, lse_base_2,
    )  # fmt: skip
    index_kind = index_type([out, out_lse, v, s, indptr], num_tokens * num_heads)
    kernel = many_state_kernel_name(state.dtype, out.dtype, vec, splits > 1, index_kind)
    block = (threads_x, rows_y, splits)
    return LaunchPlan((MANY_STATES_SOURCE, state.dtype, out.dtype), kernel, grid, block, args, shared_bytes)


def choose_state_splits(num_states: int, row_threads: int, threads_x: int) -> int:
    """How many thread groups share one row's states (the block's z extent).

    One group suffices when rows alone give ``BUSY_THREADS`` threads; otherwise
    the states of a row are split, up to one chunk per group, ``MAX_SPLITS``
    groups and ``MAX_BLOCK_THREADS`` threads a block (measured in docs/PERF.md).
    """
    cap = max(1, MAX_BLOCK_THREADS // threads_x)
    if STATE_SPLITS is not None:
        return max(1, min(STATE_SPLITS, cap))
    wanted = -(-BUSY_THREADS // max(row_threads, 1))
    useful = -(-num_states // CHUNK)
    return max(1, min(wanted, useful, MAX_SPLITS, cap))


def _plan_as_two_way(out, out_lse, v, s, state, lse_base_2) -> LaunchPlan | None:
    """States 0 and 1 as the two separate inputs of the two-way merge (views, no copy)."""

    def state_view(view: ArrayView, index: int) -> ArrayView:
        return view._replace(
            ptr=view.ptr + index * view.strides[0] * view.itemsize,
            shape=view.shape[1:],
            strides=view.strides[1:],
        )

    names = TwoStateNames("out", "out_lse", "v[0]", "s[0]", "v[1]", "s[1]")
    states = (state_view(v, 0), state_view(s, 0), state_view(v, 1), state_view(s, 1))
    return plan_merge_two(state, out, out_lse, *states, names, None, TwoStateOptions(lse_base_2))
