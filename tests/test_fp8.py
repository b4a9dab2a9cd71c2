"""FP8 outputs without a GPU: the reference's rounding, the argument rules and the launch plans."""

from __future__ import annotations

import numpy as np
import pytest
from views import view

from cupy_merge import _catalogue as cat
from cupy_merge import _checks, _dispatch, _plan, reference
from cupy_merge.merge import _MERGE_ATTN_STATES
from cupy_merge.merge_many import _MERGE_STATES

ml_dtypes = pytest.importorskip("ml_dtypes")

FP8 = "float8_e4m3fn"


# -- the reference ------------------------------------------------------------------------------


def test_the_reference_rounds_ties_to_even_and_clamps_to_448():
    # 1.0625 lies halfway between 1.0 and 1.125 (mantissa 000 and 001): even wins; 1.1875 goes up to 1.25.
    values = [1.0625, 1.1875, 449.0, 1e9, -np.inf, np.inf, 2.0**-10, 3 * 2.0**-10, -0.0]
    got = reference.quantize_fp8(values, 1.0).astype(np.float64)
    np.testing.assert_array_equal(got, [1.0, 1.25, 448.0, 448.0, -448.0, 448.0, 0.0, 2.0**-8, 0.0])


def test_the_reference_keeps_nan_and_divides_by_the_scale():
    got = reference.quantize_fp8([np.nan, 3.0, -0.75], 0.25).astype(np.float64)
    assert np.isnan(got[0]) and got[1] == 12.0 and got[2] == -3.0


def test_group_scales_are_the_largest_magnitude_over_448_with_a_floor():
    v = np.array([[[1.0, -896.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0]]])  # 1 token, 2 heads of 4
    values, scales = reference.quantize_fp8_groups(v, 4)
    np.testing.assert_allclose(scales, [[2.0, np.float32(1e-10) / np.float32(448)]], rtol=1e-7)
    np.testing.assert_array_equal(values.astype(np.float64)[0, 0], [0.5, -448.0, 0.25, 0.125])
    assert (values.astype(np.float64)[0, 1] == 0).all()


def test_ue8m0_rounds_each_scale_up_to_a_power_of_two():
    rng = np.random.default_rng()
    v = rng.standard_normal((5, 3, 64)) * rng.uniform(0.01, 100)
    _, plain = reference.quantize_fp8_groups(v, 32)
    _, rounded = reference.quantize_fp8_groups(v, 32, ue8m0=True)
    assert (np.frexp(rounded)[0] == 0.5).all()
    assert (rounded >= plain).all() and (rounded < 2 * plain).all()


def test_a_nan_in_a_group_makes_its_scale_nan():
    v = np.ones((1, 1, 8))
    v[0, 0, 3] = np.nan
    values, scales = reference.quantize_fp8_groups(v, 4)
    assert np.isnan(scales[0, 0]) and scales[0, 1] == np.float32(1) / np.float32(448)
    assert np.isnan(values.astype(np.float64)[0, 0, :4]).all()


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group, block_scale, ue8m0, error, words",
    [
        (128, None, False, ValueError, "^quant_group_size: given without output_block_scale"),
        (None, None, True, ValueError, "^scale_ue8m0: given without output_block_scale"),
        (None, object(), False, ValueError, "^quant_group_size: expected the number"),
        (0, object(), False, ValueError, "^quant_group_size: expected 1 to 1024"),
        (2048, object(), False, ValueError, "^quant_group_size: expected 1 to 1024"),
        (128.0, object(), False, TypeError, "^quant_group_size: expected an int"),
        (128, object(), 1, TypeError, "^scale_ue8m0: expected True or False"),
    ],
)
def test_bad_group_options_raise_naming_them(group, block_scale, ue8m0, error, words):
    with pytest.raises(error, match=words):
        _checks.quant_group(group, block_scale, ue8m0)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn)])
def test_fp8_is_an_output_dtype(dtype):
    assert _checks.optional_value_dtype(dtype) == FP8
    with pytest.raises(TypeError, match="^out_dtype: expected float32, float16, bfloat16 or float8_e4m3fn"):
        _checks.optional_value_dtype("int8")


# -- whole calls ----------------------------------------------------------------------------------

TOKENS, HEADS, HEAD_SIZE = 6, 4, 128


def _two_way(
    out_dtype=FP8, out_scale=True, group_scale=None, head_size=HEAD_SIZE, in_dtype="bfloat16", **changes
):
    views = {
        "output": view((TOKENS, HEADS, head_size), out_dtype, ptr=1 << 32),
        "output_lse": view((HEADS, TOKENS), "float32", ptr=2 << 32),
        "prefix_output": view((TOKENS, HEADS, head_size), in_dtype, ptr=3 << 32),
        "prefix_lse": view((HEADS, TOKENS), "float32", ptr=4 << 32),
        "suffix_output": view((TOKENS, HEADS, head_size), in_dtype, ptr=5 << 32),
        "suffix_lse": view((HEADS, TOKENS), "float32", ptr=6 << 32),
        "mask": None,
        "output_scale": view((1,), "float32", ptr=7 << 32) if out_scale else None,
        "output_block_scale": group_scale,
    }
    views.update(changes)
    return list(views.values())


def _planned(arrays, group=None, ue8m0=0, operation=_MERGE_ATTN_STATES):
    options = _plan.TwoStateOptions(0, None, None, group, ue8m0)
    return _dispatch.plan_call(operation, options, arrays)


def _template(plan):
    family = next(f for f in cat.FAMILIES if plan.kernel.startswith(f"cupy_merge::{f.name}<"))
    values = plan.kernel[plan.kernel.index("<") + 1 : -1].split(", ")
    return family, dict(zip(family.template, values)), dict(zip(family.params, plan.args))


def test_a_per_tensor_fp8_merge_plans_the_packed_kernel_with_the_scale_pointer():
    family, template, args = _template(_planned(_two_way()).plan)
    assert family is cat.TWO_PACKED and template["TOut"] == "cupy_merge::fp8_e4m3_t"
    assert template["VEC"] == "8" and template["GROUPED"] == "false"
    assert args["out_scale"] == 7 << 32 and args["out_group_scale"] == 0


def test_uint8_bytes_are_an_fp8_output_when_a_scale_is_given():
    _, template, _ = _template(_planned(_two_way(out_dtype="uint8")).plan)
    assert template["TOut"] == "cupy_merge::fp8_e4m3_t"
    with pytest.raises(TypeError, match="^output: expected dtype .*got uint8"):
        _planned(_two_way(out_dtype="uint8", out_scale=False))


def test_a_strided_fp8_merge_takes_the_general_kernel_and_its_scale():
    strided = view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32, strides=(HEADS * 256, 256, 1))
    family, _, args = _template(_planned(_two_way(prefix_output=strided)).plan)
    assert family is cat.TWO_STRIDED and args["out_scale"] == 7 << 32


@pytest.mark.parametrize(
    "in_dtype, head_size, group, vec, packs_per_group",
    [("bfloat16", 128, 128, 8, 16), ("float32", 128, 128, 4, 32), ("bfloat16", 96, 96, 8, 12),
     ("bfloat16", 64, 4, 4, 1), ("float16", 48, 6, 2, 3), ("bfloat16", 1024, 1024, 8, 128)],
)  # fmt: skip
def test_group_scales_plan_whole_groups_per_block(in_dtype, head_size, group, vec, packs_per_group):
    groups = HEADS * head_size // group
    scales = view((TOKENS, groups), "float32", ptr=8 << 32, strides=(1, TOKENS))
    arrays = _two_way(in_dtype=in_dtype, out_scale=False, group_scale=scales, head_size=head_size)
    plan = _planned(arrays, group, 1).plan
    family, template, args = _template(plan)
    assert family is cat.TWO_PACKED and template["GROUPED"] == "true" and int(template["VEC"]) == vec
    assert args["packs_per_group"] == packs_per_group and plan.block[0] % packs_per_group == 0
    assert plan.shared_bytes == 4 * (plan.block[0] // packs_per_group)
    assert (
        args["group_stride_token"] == 1 and args["group_stride_group"] == TOKENS and args["scale_ue8m0"] == 1
    )
    assert (
        _plan.fast_divide(plan.block[0] - 1, _plan.fast_divisor(packs_per_group))
        == (plan.block[0] - 1) // packs_per_group
    )


def test_n_way_group_scales_keep_whole_groups_per_block_when_states_are_split():
    v = view((64, 2, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32)
    s = view((64, HEADS, 2), "float32", ptr=4 << 32)
    out = view((2, HEADS, HEAD_SIZE), FP8, ptr=1 << 32)
    scales = view((2, HEADS * HEAD_SIZE // 32), "float32", ptr=8 << 32)
    options = _plan.ManyStateOptions(0, None, False, 32, 0)
    plan = _dispatch.plan_call(_MERGE_STATES, options, [out, None, v, s, None, None, scales]).plan
    family, template, args = _template(plan)
    assert family is cat.MANY_PACKED and template["SPLIT"] == "true" and template["GROUPED"] == "true"
    assert plan.block[0] % args["packs_per_group"] == 0 and plan.block[0] * plan.block[1] <= 1024
    partials = (plan.block[1] - 1) * plan.block[0] * (int(template["VEC"]) + 3) * 4
    assert plan.shared_bytes == partials + 4 * (plan.block[0] // args["packs_per_group"])


def _group_scales(groups=HEADS, **kwargs):
    return view((TOKENS, groups), "float32", ptr=8 << 32, **kwargs)


@pytest.mark.parametrize(
    "changes, group, error, words",
    [
        ({"output_block_scale": _group_scales(), "output_scale": view((1,), "float32", ptr=7 << 32)}, 128,
         ValueError, "^output_scale: give output_scale .* not both"),
        ({"output": view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=1 << 32)}, None,
         TypeError, "^output_scale: a scale is for an FP8"),
        ({"output_scale": None}, None, TypeError, "^output: an FP8 output needs its scale"),
        ({"output_scale": view((2,), "float32", ptr=7 << 32)}, None, TypeError, "^output_scale: expected a float32 array of one"),
        ({"output_scale": view((1,), "float16", ptr=7 << 32)}, None, TypeError, "^output_scale: expected a float32"),
        ({"output_scale": view((1,), "float32", ptr=7 << 32, device=1)}, None, ValueError, "^output_scale: expected an array on device 0"),
        ({"output_scale": view((1,), "float32", ptr=(7 << 32) + 2)}, None, ValueError, "^output_scale: expected an address aligned"),
        ({"output_scale": view((1,), "float32", ptr=(2 << 32) + 8)}, None, ValueError, "^output_scale: overlaps output_lse"),
        ({"output_scale": None, "output_block_scale": _group_scales()}, 96, ValueError, "^quant_group_size: expected a divisor of head_size 128"),
        ({"output_scale": None, "output_block_scale": _group_scales(groups=8)}, 128, ValueError, "^output_block_scale: expected shape \\(6, 4\\)"),
        ({"output_scale": None, "output_block_scale": view((TOKENS, HEADS), "float16", ptr=8 << 32)}, 128, TypeError, "^output_block_scale: expected float32"),
        ({"output_scale": None, "output_block_scale": view((TOKENS, HEADS), "float32", ptr=8 << 32, strides=(0, 1))}, 128, ValueError, "^output_block_scale: expected an output whose elements do not share"),
        ({"output_scale": None, "output_block_scale": view((TOKENS, HEADS), "float32", ptr=2 << 32)}, 128, ValueError, "^output_block_scale: overlaps output_lse"),
        ({"output_scale": None, "output_block_scale": _group_scales(),
          "prefix_output": view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32, strides=(HEADS * 256, 256, 1))}, 128,
         ValueError, "^output_block_scale: group scales need every value array's heads back to back"),
        ({"prefix_output": view((TOKENS, HEADS, HEAD_SIZE), FP8, ptr=3 << 32)}, None, TypeError, "^prefix_output: .*FP8 is an output dtype only"),
        ({"output_scale": None, "output_block_scale": view((TOKENS, HEADS), "float32", ptr=8 << 32, strides=(2**28, 1))},
         128, ValueError, "^output_block_scale: group scales need arrays that span fewer than 2\\*\\*30 elements; output_block_scale"),
        ({"output_scale": None, "output_block_scale": _group_scales(),
          "prefix_lse": view((HEADS, TOKENS), "float32", ptr=4 << 32, strides=(2**29, 1))}, 128,
         ValueError, "^output_block_scale: group scales need arrays that span .*; prefix_lse"),
    ],
)  # fmt: skip
def test_bad_fp8_calls_raise_naming_the_argument(changes, group, error, words):
    with pytest.raises(error, match=words):
        _planned(_two_way(**changes), group)


def test_group_scales_with_the_lse_in_place_take_blocks_of_whole_rows():
    head_size, group = 96, 48  # 12 packs a row, 6 a group: 21 groups (126 threads) would cut rows
    scales = view((TOKENS, HEADS * head_size // group), "float32", ptr=8 << 32)
    arrays = _two_way(out_scale=False, group_scale=scales, head_size=head_size)
    arrays[1] = arrays[3]  # output_lse is prefix_lse
    plan = _planned(arrays, group).plan
    _, template, args = _template(plan)
    assert template["LSE_IN_PLACE"] == "true" and template["GROUPED"] == "true"
    assert plan.block[0] % args["packs_per_row"] == 0 and plan.block[0] % args["packs_per_group"] == 0
