"""FP8 outputs without a GPU: the reference's rounding, the argument rules and the launch plans."""

from __future__ import annotations

import numpy as np
import pytest
from views import arguments, bound_args, family, plan_checked, template, view

from cupy_merge import _catalogue as cat
from cupy_merge import _options, _plan, reference
from cupy_merge._operands import ManyStateOperands, ManyStateOptions, TwoStateOptions
from cupy_merge._ops import MERGE_ATTN_STATES, MERGE_STATES

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


def test_ue8m0_rounds_a_scale_just_above_a_power_of_two_up_as_the_kernel_does():
    """The kernel rounds on the float32 bits (cuda_src/fp8.cuh); a float32 log2 of a scale one to
    three ulps above 2**k is k itself, which rounded it down onto 2**k and clipped its largest value."""
    for k in range(-30, 10):
        exact = np.float32(448.0 * 2.0**k)
        for amax, want in ((exact, 2.0**k), (np.nextafter(exact, np.float32(np.inf)), 2.0 ** (k + 1))):
            values, scales = reference.quantize_fp8_groups(np.array([[[amax, -0.5 * amax, 0.0, 0.0]]]), 4,
                                                           ue8m0=True)  # fmt: skip
            assert scales.item() == want, (k, amax)
            assert np.abs(values.astype(np.float64)).max() <= 448.0
            assert values.astype(np.float64).ravel()[0] == reference.quantize_fp8(np.float64(amax) / want, 1.0)


@pytest.mark.parametrize("builder", [_options.two_state_options, _options.many_state_options])
@pytest.mark.parametrize("name", ["scale_ue8m0", "quant_scale_ue8m0"])
def test_the_option_builders_fast_path_takes_only_the_defaults(builder, name):
    """The builders return their default options at once for the default arguments (a host-cost
    fast path); a ue8m0 flag without block scales, or of another type, still gets its error."""
    if name not in builder.__code__.co_varnames:
        pytest.skip(f"{builder.__name__} has no {name}")
    with pytest.raises(ValueError, match=r"^scale_ue8m0: given without output_block_scale"):
        builder(**{name: True})
    with pytest.raises(TypeError, match=rf"^{name}: expected True or False"):
        builder(**{name: 0}, output_block_scale=object(), quant_group_size=128)


@pytest.mark.parametrize(
    "group, block_scale, ue8m0, error, words",
    [
        (128, None, False, ValueError, "^quant_group_size: given without output_block_scale"),
        (None, None, True, ValueError, "^scale_ue8m0: given without output_block_scale"),
        (0, object(), False, ValueError, "^quant_group_size: expected 1 to 1024"),
        (2048, object(), False, ValueError, "^quant_group_size: expected 1 to 1024"),
        (128.0, object(), False, TypeError, "^quant_group_size: expected an int"),
        (128, object(), 1, TypeError, "^scale_ue8m0: expected True or False"),
    ],
)
def test_bad_group_options_raise_naming_them(group, block_scale, ue8m0, error, words):
    with pytest.raises(error, match=words):
        _options.quant_group(group, block_scale, ue8m0)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn)])
def test_fp8_is_an_output_dtype(dtype):
    assert _options.optional_value_dtype(dtype) == FP8
    with pytest.raises(TypeError, match="^out_dtype: expected float32, float16, bfloat16, float8_e4m3fn or float4_e2m1fn_x2"):
        _options.optional_value_dtype("int8")


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
    # merge_attn_states' argument names -> its operand record.
    names = MERGE_ATTN_STATES.names
    return type(names)(**{field: views[name] for field, name in zip(names._fields, names) if name in views})


def _planned(arrays, group=None, ue8m0=0, operation=MERGE_ATTN_STATES):
    """The plan of an eager call with these views, after every shape and address rule."""
    options = TwoStateOptions(group_size=group, scale_ue8m0=ue8m0)
    return plan_checked(operation, options, arrays)


def _launch(planned):
    assert len(planned.plan) == 1, planned.plan
    return planned.plan[0]


def _template(launch):
    return family(launch), template(launch), arguments(launch)


def test_a_per_tensor_fp8_merge_plans_the_packed_kernel_with_the_scale_pointer():
    arrays = _two_way()
    launch = _launch(_planned(arrays))
    kernels, template_args, _ = _template(launch)
    assert kernels is cat.TWO_PACKED and template_args["TOut"] == "cupy_merge::fp8_e4m3_t"
    assert template_args["VEC"] == "8" and template_args["GROUPED"] == "false"
    assert launch.slots("output_scale") == [kernels.position("output_scale")]
    assert not launch.slots("output_block_scale")
    bound = bound_args(launch, arrays)
    assert bound["output_scale"] == 7 << 32 and bound["output_block_scale"] == 0


def test_uint8_bytes_are_an_fp8_output_when_a_scale_is_given():
    _, template_args, _ = _template(_launch(_planned(_two_way(out_dtype="uint8"))))
    assert template_args["TOut"] == "cupy_merge::fp8_e4m3_t"
    with pytest.raises(TypeError, match="^output: expected dtype .*got uint8"):
        _planned(_two_way(out_dtype="uint8", out_scale=False))


def test_a_strided_fp8_merge_takes_the_general_kernel_and_its_scale():
    strided = view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32, strides=(HEADS * 256, 256, 1))
    arrays = _two_way(prefix_output=strided)
    launch = _launch(_planned(arrays))
    assert family(launch) is cat.TWO_STRIDED and bound_args(launch, arrays)["output_scale"] == 7 << 32
    assert launch.slots("output_scale") == [cat.TWO_STRIDED.position("output_scale")]


@pytest.mark.parametrize(
    "in_dtype, head_size, group, vec, packs_per_group",
    [("bfloat16", 128, 128, 8, 16), ("float32", 128, 128, 4, 32), ("bfloat16", 96, 96, 8, 12),
     ("bfloat16", 64, 4, 4, 1), ("float16", 48, 6, 2, 3), ("bfloat16", 1024, 1024, 8, 128)],
)  # fmt: skip
def test_group_scales_plan_whole_groups_per_block(in_dtype, head_size, group, vec, packs_per_group):
    groups = HEADS * head_size // group
    scales = view((TOKENS, groups), "float32", ptr=8 << 32, strides=(1, TOKENS))
    arrays = _two_way(in_dtype=in_dtype, out_scale=False, group_scale=scales, head_size=head_size)
    plan = _launch(_planned(arrays, group, 1))
    kernels, template_args, args = _template(plan)
    assert (
        kernels is cat.TWO_PACKED and template_args["GROUPED"] == "true" and int(template_args["VEC"]) == vec
    )
    assert args["packs_per_group"] == packs_per_group and plan.block[0] % packs_per_group == 0
    assert plan.shared_bytes == 4 * (plan.block[0] // packs_per_group)
    assert (
        args["block_scale_stride_token"] == 1
        and args["block_scale_stride_group"] == TOKENS
        and args["scale_ue8m0"] == 1
    )
    assert bound_args(plan, arrays)["output_block_scale"] == 8 << 32
    assert (
        _plan.fast_divide(plan.block[0] - 1, _plan.fast_divisor(packs_per_group))
        == (plan.block[0] - 1) // packs_per_group
    )


def test_n_way_group_scales_keep_whole_groups_per_block_when_states_are_split():
    v = view((64, 2, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32)
    s = view((64, HEADS, 2), "float32", ptr=4 << 32)
    out = view((2, HEADS, HEAD_SIZE), FP8, ptr=1 << 32)
    scales = view((2, HEADS * HEAD_SIZE // 32), "float32", ptr=8 << 32)
    options = ManyStateOptions(group_size=32)
    operands = ManyStateOperands(out, None, v, s, output_block_scale=scales)
    plan = _launch(plan_checked(MERGE_STATES, options, operands))
    kernels, template_args, args = _template(plan)
    assert (
        kernels is cat.MANY_PACKED and template_args["SPLIT"] == "true" and template_args["GROUPED"] == "true"
    )
    assert plan.block[0] % args["packs_per_group"] == 0 and plan.block[0] * plan.block[1] <= 1024
    partials = (plan.block[1] - 1) * plan.block[0] * (int(template_args["VEC"]) + 3) * 4
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
        ({"output_scale": None, "output_block_scale": _group_scales()}, None, ValueError, "^quant_group_size: expected the number"),
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
    apart = _launch(_planned(arrays, group))
    arrays = arrays._replace(out_lse=arrays.s_a)  # output_lse is prefix_lse
    plan = _launch(_planned(arrays, group))
    _, template_args, args = _template(plan)
    # The group kernel's block barriers order every read of a row's old LSE before its write
    # once the block holds whole rows (the in-place flag's warp barrier is for the ungrouped kernel).
    assert template_args["GROUPED"] == "true"
    assert plan.block[0] % args["packs_per_row"] == 0 and plan.block[0] % args["packs_per_group"] == 0
    assert apart.block[0] % args["packs_per_row"] != 0  # not in place: whole groups, not rows
    assert bound_args(plan, arrays)["out_lse"] == bound_args(plan, arrays)["lse_a"] == 4 << 32


def test_group_scales_with_the_lse_in_place_and_rows_past_one_block_write_the_lse_in_a_second_launch():
    head_size, group = 8 * 2048, 128  # 2048 packs a row: more than a block's 1024 threads
    scales = view((TOKENS, HEADS * head_size // group), "float32", ptr=8 << 32)
    arrays = _two_way(out_scale=False, group_scale=scales, head_size=head_size)
    (together,) = _planned(arrays, group).plan  # not in place: one launch writes both
    assert together.slots("out_lse") and together.slots("output_block_scale")
    arrays = arrays._replace(out_lse=arrays.s_b)  # output_lse is suffix_lse
    merge, lse = _planned(arrays, group).plan
    # First the values and group scales, reading the old LSE; the LSE is not written there.
    assert family(merge) is cat.TWO_PACKED and template(merge)["GROUPED"] == "true"
    assert not merge.slots("out_lse") and arguments(merge)["out_lse"] == 0
    assert merge.slots("out") and merge.slots("output_block_scale")
    # Then the strided kernel with no packs to merge writes the LSE over its input.
    args = bound_args(lse, arrays)
    assert family(lse) is cat.TWO_STRIDED and args["head_size"] == 0 and args["out_lse_is_input"] == 1
    assert not lse.slots("out") and not lse.slots("output_block_scale") and args["out"] == 0
    assert args["out_lse"] == args["lse_b"] == 6 << 32 and args["lse_a"] == 4 << 32
    assert (args["num_tokens"], args["num_heads"]) == (TOKENS, HEADS)
    assert lse.block[0] == 1 and lse.module == merge.module  # one module: compiled and loaded once
