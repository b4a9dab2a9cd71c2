"""Two-way merges: every rule and launch choice, on ArrayViews (no GPU needed)."""

from __future__ import annotations

import math

import pytest
from bad_inputs import BAD_CASES, VALID, Spec, specs_for
from views import from_specs, view

from cupy_merge import _catalogue as cat
from cupy_merge import _dispatch, _plan
from cupy_merge.merge import _MERGE_STATE, _MERGE_STATE_IN_PLACE

ORDER = ["out", "out_lse", "v_a", "s_a", "v_b", "s_b"]
OPTIONS = _plan.TwoStateOptions()


def _planned(views: dict, options=OPTIONS, operation=_MERGE_STATE):
    arrays = [views.get(name) for name in ORDER + ["mask", "output_scale", "output_block_scale"]]
    return _dispatch.plan_call(operation, options, arrays)


def _plan_of(views: dict, options=OPTIONS):
    return _planned(views, options).plan


def _states(tokens, heads, head_size, dtype="float16"):
    values, lse = Spec((tokens, heads, head_size), dtype), Spec((heads, tokens), "float32")
    return from_specs({name: values if name.startswith(("out", "v")) and name != "out_lse" else lse
                       for name in ORDER}, ORDER)  # fmt: skip


def _template(plan):
    family = cat.TWO_PACKED if "packed" in plan.kernel else cat.TWO_STRIDED
    values = plan.kernel[plan.kernel.index("<") + 1 : -1].split(", ")
    return family, dict(zip(family.template, values))


def _args(plan):
    family, _ = _template(plan)
    return dict(zip(family.params, plan.args))


def test_a_contiguous_call_plans_the_packed_kernel_with_16_byte_packs():
    plan = _plan_of(_states(5, 3, 16))
    family, template = _template(plan)
    assert family is cat.TWO_PACKED
    assert template["VEC"] == "8" and template["LSE_IN_PLACE"] == "false"
    args = _args(plan)
    assert (
        args["total_packs"] == 5 * 3 * 2 and args["packs_per_token"] == 3 * 2 and args["packs_per_row"] == 2
    )
    assert plan.grid[0] * plan.block[0] >= args["total_packs"]


@pytest.mark.parametrize("tokens, streaming", [(1024, "true"), (8192, "false")])
def test_packed_loads_stream_below_64_mb_of_traffic(tokens, streaming):
    # 3 arrays x tokens x 32 heads x 128 x 2 bytes: 25 MB at 1024 tokens, 201 MB at 8192.
    assert _template(_plan_of(_states(tokens, 32, 128)))[1]["STREAMING"] == streaming


def test_without_packed_kernels_every_call_plans_the_strided_one(monkeypatch):
    monkeypatch.setattr(_plan, "PACKED_KERNELS", False)
    family, template = _template(_plan_of(_states(5, 3, 16)))
    assert family is cat.TWO_STRIDED and template["Index"] == "int"


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.id)
def test_every_bad_input_raises_naming_the_argument(case):
    with pytest.raises(case.error) as raised:
        _plan_of(from_specs(specs_for(case), ORDER))
    message = str(raised.value)
    assert message.startswith((f"{case.argument}: expected", f"{case.argument}: overlaps")), message


def test_token_major_lse_error_suggests_the_transpose():
    specs = dict(VALID, s_a=Spec(VALID["s_a"].shape[::-1], "float32"))
    with pytest.raises(ValueError, match="transposed view"):
        _plan_of(from_specs(specs, ORDER))


def test_in_place_output_identical_to_an_input_is_allowed():
    views = from_specs(VALID, ORDER)
    views["out"], views["out_lse"] = views["v_b"], views["s_a"]
    plan = _plan_of(views)
    assert plan is not None and _template(plan)[1]["LSE_IN_PLACE"] == "true"


def test_interleaved_but_not_identical_output_is_rejected():
    views = from_specs(VALID, ORDER)
    views["out"] = views["v_a"]._replace(strides=(views["v_a"].strides[0], 1, 1))
    with pytest.raises(ValueError, match="^out: "):
        _plan_of(views)


def test_in_place_into_a_broadcast_input_is_rejected():
    views = from_specs(VALID, ORDER)
    broadcast = views["v_a"]._replace(strides=(0, *views["v_a"].strides[1:]))
    views["v_a"] = views["out"] = broadcast
    with pytest.raises(ValueError, match="^out: expected an output whose elements do not share memory"):
        _plan_of(views)


def test_an_in_place_lse_whose_row_spans_two_warps_takes_the_strided_kernel():
    views = _states(4, 2, 512)  # 64 packs a row
    views["out_lse"] = views["s_b"]
    assert _template(_plan_of(views))[0] is cat.TWO_STRIDED
    views = _states(4, 2, 256)  # 32 packs: one warp a row
    views["out_lse"] = views["s_b"]
    assert _template(_plan_of(views))[1]["LSE_IN_PLACE"] == "true"


@pytest.mark.parametrize("tokens, heads", [(0, 4), (4, 0), (0, 0)])
def test_zero_tokens_or_heads_is_a_no_op(tokens, heads):
    assert _plan_of(_states(tokens, heads, 16)) is None


def test_head_size_zero_still_writes_the_lse_with_the_strided_kernel():
    plan = _plan_of(_states(5, 3, 0))
    assert _template(plan)[0] is cat.TWO_STRIDED


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
    values = view((3, 2, head_size), dtype, 4096 + misalign)
    assert _plan.choose_vector_width([values], head_size, cat.VECTOR_WIDTHS[itemsize]) == expected


def test_a_token_stride_that_breaks_alignment_narrows_the_vector_and_takes_the_strided_kernel():
    views = _states(3, 2, 64)
    views["v_a"] = views["v_a"]._replace(strides=(130, 64, 1))  # 130 = 2 * 64 + 2 padding
    assert _plan.choose_vector_width([views["v_a"]], 64, (8, 4, 2, 1)) == 2
    family, template = _template(_plan_of(views))
    assert family is cat.TWO_STRIDED and template["VEC"] == "2"


def test_heads_not_back_to_back_take_the_strided_kernel():
    views = _states(3, 4, 64)
    views["v_b"] = views["v_b"]._replace(strides=(4 * 72, 72, 1))  # heads padded to 72
    assert _template(_plan_of(views))[0] is cat.TWO_STRIDED


def test_huge_tensors_take_the_strided_kernel_with_64_bit_offsets():
    tokens, heads, head_size = 2**20, 64, 64  # 2^32 elements
    values = view((tokens, heads, head_size), "bfloat16", 1 << 40)
    lse = view((heads, tokens), "float32", 1 << 41)
    views = {"out": values._replace(ptr=1 << 42), "out_lse": lse._replace(ptr=1 << 43), "v_a": values, "s_a": lse,
             "v_b": values._replace(ptr=1 << 44), "s_b": lse._replace(ptr=1 << 45)}  # fmt: skip
    plan = _plan_of(views)
    family, template = _template(plan)
    assert family is cat.TWO_STRIDED and template["Index"] == "long long"
    token_blocks = -(-tokens // (plan.block[1] * int(template["ROWS"])))
    assert plan.grid == (token_blocks * heads, 1, 1) and math.prod(plan.grid) < 2**31


@pytest.mark.parametrize("head_size", [1, 7, 64, 128, 576, 4096])
@pytest.mark.parametrize("tokens", [1, 3, 4096])
def test_strided_block_covers_every_row_within_hardware_limits(head_size, tokens):
    threads_x, rows = _plan.choose_block(head_size, tokens)
    assert 1 <= threads_x * rows <= 1024 and rows <= tokens


def test_offsets_are_32_bit_only_while_every_array_fits():
    small = view((4096, 32, 128), "bfloat16")
    assert _plan.index_type([small, None], 4096 * 32) == "int"
    far = view((2, 32, 128), "bfloat16", strides=(2**30, 128, 1))
    assert _plan.index_type([small, far], 2 * 32) == "long long"
    assert _plan.index_type([small, far._replace(strides=(-(2**30), 128, 1))], 2 * 32) == "long long"
    # head_size 0: no array spans tokens x heads, which the kernels still loop over.
    assert _plan.index_type([view((2**26, 32, 0), strides=(0, 0, 1))], 2**26 * 32) == "long long"
    assert _plan.index_type([view((0, 32, 128), strides=(2**31, 128, 1))], 0) == "int"
    # Stride-0 states: tiny extents, but the kernels count the states in the offset type.
    assert (
        _plan.index_type([view((2**31, 1, 2, 8), strides=(0, 16, 8, 1))], 2, num_states=2**31) == "long long"
    )


def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in():
    views = _states(5, 3, 16)
    for packed in (True, False):
        _plan.PACKED_KERNELS = packed
        try:
            plan = _plan_of(views)
        finally:
            _plan.PACKED_KERNELS = True
        assert plan.args[plan.out_slot] == views["out"].ptr
        assert plan.args[plan.out_lse_slot] == views["out_lse"].ptr


def test_missing_outputs_are_planned_as_fresh_arrays_and_patched_in():
    views = _states(5, 3, 16)
    del views["out"], views["out_lse"]
    planned = _planned(views, _plan.TwoStateOptions(out_dtype="float32"))
    assert [(f.position, f.shape, f.dtype) for f in planned.fresh] == [
        (0, (5, 3, 16), "float32"),
        (1, (3, 5), "float32"),
    ]
    assert [f.slot for f in planned.fresh] == [planned.plan.out_slot, planned.plan.out_lse_slot]
    assert planned.plan.module.out_dtype == "float32"


def test_out_dtype_must_match_a_given_output():
    with pytest.raises(TypeError, match="^out_dtype: expected the dtype of out"):
        _planned(_states(5, 3, 16), _plan.TwoStateOptions(out_dtype="float32"))


@pytest.mark.parametrize("tokens, rows", [(64, 1), (1024, 1), (2048, 2), (4096, 2)])
def test_small_strided_merges_give_each_thread_one_row(monkeypatch, tokens, rows):
    monkeypatch.setattr(_plan, "PACKED_KERNELS", False)
    assert _template(_plan_of(_states(tokens, 32, 128)))[1]["ROWS"] == str(rows)


def test_the_in_place_merge_with_a_mask_reads_and_writes_v_and_s():
    views = _states(5, 3, 16)
    views["out"], views["out_lse"] = views["v_a"], views["s_a"]
    views["mask"] = view((5,), "bool", 9 << 32)
    plan = _planned(views, operation=_MERGE_STATE_IN_PLACE).plan
    args = _args(plan)
    assert args["mask"] == 9 << 32 and args["mask_stride"] == 1
    with pytest.raises(TypeError, match="^mask: expected a bool array"):
        views["mask"] = view((5,), "int8", 9 << 32)
        _planned(views, operation=_MERGE_STATE_IN_PLACE)


@pytest.mark.parametrize("divisor", [1, 2, 3, 6, 7, 16, 96, 100, 4096, 12345, 2**20 + 1, 2**30 - 1])
def test_fast_division_matches_integer_division(divisor):
    import random

    fast = _plan.fast_divisor(divisor)
    numbers = [0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 1, 2**30] + [
        random.randrange(2**31) for _ in range(2000)
    ]
    assert all(_plan.fast_divide(n, fast) == n // divisor for n in numbers)
