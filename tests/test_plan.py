"""Validation and launch choices, on ArrayViews: no GPU needed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bad_inputs import BAD_CASES, VALID, Spec, specs_for

from cupy_merge import _plan
from cupy_merge._arrays import ArrayView

NAMES = _plan.TwoStateNames("out", "out_lse", "v_a", "s_a", "v_b", "s_b")
ORDER = ["out", "out_lse", "v_a", "s_a", "v_b", "s_b"]


def _contiguous_strides(shape):
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _views(specs: dict) -> dict:
    """ArrayViews at well separated, 256-byte aligned fake addresses."""
    views = {}
    for index, name in enumerate(ORDER):
        spec = specs[name]
        itemsize = np.dtype(spec.dtype).itemsize
        storage_shape = spec.shape[:-1] + (spec.shape[-1] * spec.last_stride,)
        strides = _contiguous_strides(storage_shape)[:-1] + (spec.last_stride,)
        views[name] = ArrayView((index + 1) << 32, spec.shape, strides, spec.dtype, itemsize, spec.device)
    for name in ORDER:
        spec = specs[name]
        if spec.overlaps:
            other = views[spec.overlaps]
            views[name] = other._replace(ptr=other.ptr - other.strides[0] * other.itemsize)
    return views


def _plan_from_views(views: dict):
    state = _plan.check_two_states(views["v_a"], views["s_a"], views["v_b"], views["s_b"], NAMES)
    return _plan.plan_merge_two(
        state, views["out"], views["out_lse"], views["v_a"], views["s_a"], views["v_b"], views["s_b"], NAMES
    )


def test_a_valid_call_plans_a_launch():
    plan = _plan_from_views(_views(VALID))
    assert plan is not None and plan.kernel.startswith(
        "cupy_merge::merge_two_states<cupy_merge::half_t, cupy_merge::half_t, 8,"
    )
    staged, index = _plan.kernel_template_arguments(plan.kernel)[4:]
    assert staged == "false" and plan.shared_bytes == 0  # small: direct loads
    assert index == "int"  # every offset fits in 32 bits


@pytest.mark.parametrize("tokens, staged", [(4096, False), (32768, True)])
def test_large_merges_stage_their_first_packs_through_shared_memory(tokens, staged):
    values = Spec((tokens, 32, 128), "float16")
    lse = Spec((32, tokens), "float32")
    specs = {"out": values, "out_lse": lse, "v_a": values, "s_a": lse, "v_b": values, "s_b": lse}
    plan = _plan_from_views(_views(specs))
    arguments = _plan.kernel_template_arguments(plan.kernel)
    rows = int(arguments[3])
    assert arguments[4:] == (["true", "long long"] if staged else ["false", "int"])
    # Staged: 2 states x rows x threads x 16 bytes of shared memory.
    assert plan.shared_bytes == (2 * rows * plan.block[0] * plan.block[1] * 16 if staged else 0)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.id)
def test_every_bad_input_raises_naming_the_argument(case):
    with pytest.raises(case.error) as raised:
        _plan_from_views(_views(specs_for(case)))
    assert str(raised.value).startswith(f"{case.argument}: expected") or str(raised.value).startswith(
        f"{case.argument}: overlaps"
    ), str(raised.value)


def test_token_major_lse_error_suggests_the_transpose():
    specs = dict(VALID, s_a=Spec(VALID["s_a"].shape[::-1], "float32"))
    with pytest.raises(ValueError, match="transposed view"):
        _plan_from_views(_views(specs))


def test_in_place_output_identical_to_an_input_is_allowed():
    views = _views(VALID)
    views["out"] = views["v_b"]
    views["out_lse"] = views["s_a"]
    assert _plan_from_views(views) is not None


def test_interleaved_but_not_identical_output_is_rejected():
    views = _views(VALID)
    views["out"] = views["v_a"]._replace(strides=(views["v_a"].strides[0], 1, 1))
    with pytest.raises(ValueError, match="out: overlaps v_a"):
        _plan_from_views(views)


@pytest.mark.parametrize("tokens, heads", [(0, 4), (4, 0), (0, 0)])
def test_zero_tokens_or_heads_is_a_no_op(tokens, heads):
    values, lse = Spec((tokens, heads, 16), "float16"), Spec((heads, tokens), "float32")
    specs = {"out": values, "out_lse": lse, "v_a": values, "s_a": lse, "v_b": values, "s_b": lse}
    assert _plan_from_views(_views(specs)) is None


@pytest.mark.parametrize(
    "head_size, itemsize, misalign, expected",
    [
        (128, 2, 0, 8),
        (128, 4, 0, 4),
        (100, 2, 0, 4),
        (7, 2, 0, 1),
        (72, 2, 0, 8),
        (64, 2, 4, 2),
        (6, 4, 0, 2),
    ],
)
def test_vector_width_is_the_widest_that_divides_and_aligns(head_size, itemsize, misalign, expected):
    dtype = "float16" if itemsize == 2 else "float32"
    view = ArrayView(4096 + misalign, (3, 2, head_size), (2 * head_size, head_size, 1), dtype, itemsize, 0)
    assert _plan.choose_vector_width([view], head_size) == expected


def test_token_stride_that_breaks_alignment_narrows_the_vector():
    aligned = ArrayView(4096, (3, 2, 64), (130, 64, 1), "float16", 2, 0)  # 130 = 2 * 64 + 2 padding
    assert _plan.choose_vector_width([aligned], 64) == 2


def test_kernel_arguments_use_64_bit_strides_for_huge_tensors():
    tokens, heads, head_size = 2**20, 64, 64  # 2^32 elements
    values = ArrayView(
        1 << 40, (tokens, heads, head_size), (heads * head_size, head_size, 1), "bfloat16", 2, 0
    )
    lse = ArrayView(1 << 41, (heads, tokens), (tokens, 1), "float32", 4, 0)
    views = {
        "out": values._replace(ptr=1 << 42),
        "out_lse": lse._replace(ptr=1 << 43),
        "v_a": values,
        "s_a": lse,
        "v_b": values._replace(ptr=1 << 44),
        "s_b": lse._replace(ptr=1 << 45),
    }
    plan = _plan_from_views(views)
    arguments = _plan.kernel_template_arguments(plan.kernel)
    assert arguments[5] == "long long"  # offsets past 2^31 need 64-bit arithmetic
    rows_per_thread = int(arguments[3])
    token_blocks = -(-tokens // (plan.block[1] * rows_per_thread))
    assert plan.grid == (token_blocks * heads, 1, 1)  # one block per work item, below 2^31
    assert math.prod(plan.grid) < 2**31


@pytest.mark.parametrize("head_size", [1, 7, 64, 128, 576, 4096])
@pytest.mark.parametrize("tokens", [1, 3, 4096])
def test_block_covers_every_row_within_hardware_limits(head_size, tokens):
    threads_x, rows = _plan.choose_block(head_size, tokens)
    assert 1 <= threads_x * rows <= 1024
    assert rows <= tokens


def _view(shape, strides, dtype="bfloat16"):
    return ArrayView(1 << 32, shape, strides, dtype, 2, 0)


def test_offsets_are_32_bit_only_while_every_array_fits():
    small = _view((4096, 32, 128), (4096, 128, 1))
    assert _plan.index_type([small, None], 4096 * 32) == "int"
    # 2^30 elements reachable through a stride (a strided view of a large buffer), negative or not.
    far = _view((2, 32, 128), (2**30, 128, 1))
    assert _plan.index_type([small, far], 2 * 32) == "long long"
    assert _plan.index_type([small, far._replace(strides=(-(2**30), 128, 1))], 2 * 32) == "long long"
    # head_size 0: no array spans tokens x heads, which the kernels still loop over.
    assert _plan.index_type([_view((2**26, 32, 0), (0, 0, 1))], 2**26 * 32) == "long long"
    # An empty array has no offsets at all.
    assert _plan.index_type([_view((0, 32, 128), (2**31, 128, 1))], 0) == "int"


def test_the_32_bit_switch_turns_every_plan_64_bit(monkeypatch):
    monkeypatch.setattr(_plan, "INDEX_32", False)
    plan = _plan_from_views(_views(VALID))
    assert _plan.kernel_template_arguments(plan.kernel)[5] == "long long"


def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in():
    plan = _plan_from_views(_views(VALID))
    views = _views(VALID)
    assert plan.args[_plan.OUT_ARGUMENT] == views["out"].ptr
    assert plan.args[_plan.OUT_LSE_ARGUMENT] == views["out_lse"].ptr


@pytest.mark.parametrize("tokens, rows", [(64, 1), (1024, 1), (2048, 2), (4096, 2)])
def test_small_merges_give_each_thread_one_row(tokens, rows):
    values = Spec((tokens, 32, 128), "float16")  # 3 x 2 x 4096 x tokens bytes of values
    lse = Spec((32, tokens), "float32")
    specs = {"out": values, "out_lse": lse, "v_a": values, "s_a": lse, "v_b": values, "s_b": lse}
    plan = _plan_from_views(_views(specs))
    assert int(_plan.kernel_template_arguments(plan.kernel)[3]) == rows
