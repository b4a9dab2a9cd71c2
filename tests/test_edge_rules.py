"""Rules at the edges a fuzzing review of the checks and planners found (CPU only, on specs): each
call is refused by its argument's name before anything is planned, where it used to reach the
planner with an unnamed error or plan a launch the kernels read wrongly."""

from __future__ import annotations

import pytest

from cupy_merge import _dispatch, _ops, _options, _tuning
from cupy_merge._arrays import ArraySpec, contiguous_strides
from cupy_merge._operands import BackwardOperands, ManyStateOperands, TwoStateOperands

ITEMSIZE = {"float16": 2, "float32": 4, "float8_e4m3fn": 1, "float4_e2m1fn_x2": 1, "int32": 4}
T, H, D = 4, 2, 64


def spec(shape, dtype="float16", strides=None):
    return ArraySpec(tuple(shape), contiguous_strides(tuple(shape)) if strides is None else strides, dtype,
                     ITEMSIZE[dtype], 0)  # fmt: skip


def _no_values(operation, kind):
    """One token, one head, head_size 0, with FP8 group scales or an NVFP4 output."""
    if kind == "fp8 groups":
        out, scale, block = spec((1, 1, 0), "float8_e4m3fn"), None, spec((1, 0), "float32")
        options = operation.options(output_block_scale=block, quant_group_size=16)
    else:
        out, scale, block = spec((1, 1, 0), "float4_e2m1fn_x2"), spec((1,), "float32"), spec((1, 0), "float8_e4m3fn")
        options = operation.options(output_block_scale=block, is_sf_swizzled_layout=False)
    if operation.ragged:
        operands = ManyStateOperands(out, None, spec((3, 1, 0)), spec((1, 3), "float32"), spec((2,), "int32"),
                                     None, scale, block)  # fmt: skip
    elif operation.many:
        operands = ManyStateOperands(out, None, spec((3, 1, 1, 0)), spec((3, 1, 1), "float32"), None, None, scale, block)
    else:
        v, s = spec((1, 1, 0)), spec((1, 1), "float32")
        operands = TwoStateOperands(out, spec((1, 1), "float32"), v, s, v, s, None, None, scale, block)
    return options, operands


@pytest.mark.parametrize("kind", ["fp8 groups", "nvfp4"])
@pytest.mark.parametrize("operation", [_ops.MERGE_STATE, _ops.MERGE_ATTN_STATES, _ops.MERGE_STATES,
                                       _ops.MERGE_STATES_VARLEN], ids=lambda operation: operation.name)  # fmt: skip
def test_quantised_outputs_of_no_values_are_refused_by_name(operation, kind):
    """head_size 0 passed every rule (0 is a multiple of every group) and the planner then failed
    with "divisor out of range: 0", naming nothing; the torch fakes accepted the call."""
    options, operands = _no_values(operation, kind)
    words = r"^quant_group_size: group scales need a head_size of 1" if kind == "fp8 groups" else (
        rf"^{operation.names.out}: an NVFP4 output needs a head_size that is a positive multiple of 16")
    with pytest.raises(ValueError, match=words):
        _dispatch.check_specs(operation, options, operands)
    with pytest.raises(ValueError, match=words):
        _dispatch.plan_specs(operation, options, _tuning.DEFAULT, operands)


SINKS = spec((H,), "float32", strides=(2**31,))  # a column of a [2, 2**31] float32 tensor


def _with_far_sinks(operation):
    v, s = spec((T, H, D)), spec((H, T), "float32")
    if operation is _ops.MERGE_STATE_BACKWARD:
        return BackwardOperands(None, None, v, s, v, None, v, s, sinks=SINKS)
    if operation is _ops.MERGE_STATES_BACKWARD:
        return BackwardOperands(None, None, spec((5, T, H, D)), spec((5, H, T), "float32"), v, sinks=SINKS)
    if operation is _ops.MERGE_STATES_VARLEN_BACKWARD:
        return BackwardOperands(None, None, spec((9, H, D)), spec((H, 9), "float32"), v, indptr=spec((T + 1,), "int32"),
                                sinks=SINKS)  # fmt: skip
    if operation is _ops.MERGE_STATES:
        return ManyStateOperands(None, None, spec((5, T, H, D)), spec((5, H, T), "float32"), sinks=SINKS)
    if operation is _ops.MERGE_STATES_VARLEN:
        return ManyStateOperands(None, None, spec((9, H, D)), spec((H, 9), "float32"), spec((T + 1,), "int32"),
                                 sinks=SINKS)  # fmt: skip
    given = operation is not _ops.MERGE_STATE
    return TwoStateOperands(v if given else None, s if given else None, v, s, v, s, sinks=SINKS)


@pytest.mark.parametrize("operation", list(_ops.OPERATIONS.values()), ids=lambda operation: operation.name)
def test_sinks_a_stride_past_32_bits_apart_are_refused_by_name(operation):
    """The kernels read the sinks by an int stride: 2**31 became -2**31, a read 8 GiB before the array."""
    with pytest.raises(ValueError, match=r"^sinks: expected a stride within 32 bits"):
        _dispatch.plan_specs(operation, operation.options(), _tuning.DEFAULT, _with_far_sinks(operation))


@pytest.mark.parametrize("out_dtype", [",", "f4,(1", "(-1,)f4", "f4,["])
def test_an_out_dtype_numpy_cannot_parse_is_refused_by_name(out_dtype):
    """NumPy reads a string as a dtype spec: these raised its SyntaxError or an unnamed ValueError."""
    for builder in (_options.two_state_options, _options.many_state_options):
        with pytest.raises(TypeError, match=r"^out_dtype: expected"):
            builder(out_dtype=out_dtype)


def test_a_numpy_integer_group_size_is_taken_as_the_token_counts_are():
    import numpy as np

    for builder in (_options.two_state_options, _options.many_state_options):
        assert builder(output_block_scale=object(), quant_group_size=np.int64(32)).group_size == 32
        with pytest.raises(TypeError, match=r"^quant_group_size: expected an int, got float32"):
            builder(output_block_scale=object(), quant_group_size=np.float32(32))


@pytest.mark.parametrize("stride, refused", [(2**31 - 1, False), (-(2**31), False), (-(2**31) - 1, True), (2**31, True)])
def test_sinks_strides_at_the_32_bit_edges(stride, refused):
    v, s = spec((T, H, D)), spec((H, T), "float32")
    operands = TwoStateOperands(None, None, v, s, v, s, sinks=spec((H,), "float32", strides=(stride,)))
    if refused:
        with pytest.raises(ValueError, match="^sinks: expected a stride within 32 bits"):
            _dispatch.check_specs(_ops.MERGE_STATE, _ops.MERGE_STATE.options(), operands)
    else:
        _dispatch.check_specs(_ops.MERGE_STATE, _ops.MERGE_STATE.options(), operands)


def test_one_heads_sinks_take_any_stride():
    """The kernels never read a one-head array's stride (the planner passes 0)."""
    v, s = spec((T, 1, D)), spec((1, T), "float32")
    operands = TwoStateOperands(None, None, v, s, v, s, sinks=spec((1,), "float32", strides=(2**40,)))
    _dispatch.check_specs(_ops.MERGE_STATE, _ops.MERGE_STATE.options(), operands)


def test_an_array_group_size_is_refused():
    import numpy as np

    with pytest.raises(TypeError, match="^quant_group_size: expected an int, got ndarray"):
        _options.two_state_options(output_block_scale=object(), quant_group_size=np.array([32]))
