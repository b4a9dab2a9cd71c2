"""N-way and ragged checks, plans and conventions, on ArrayViews: no GPU needed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from views import view as _make_view

from cupy_merge import _catalogue as cat
from cupy_merge import _checks, _dispatch
from cupy_merge import _plan as _plan_module
from cupy_merge.merge_many import _MERGE_STATES, _MERGE_STATES_VARLEN

STATES, TOKENS, HEADS, HEAD_SIZE = 6, 5, 3, 64


def _view(shape, dtype="float16", ptr=1 << 32, strides=None, device=0):
    return _make_view(shape, dtype, ptr, strides, device)


def _dense(**changes):
    views = {
        "out": _view((TOKENS, HEADS, HEAD_SIZE), ptr=1 << 32),
        "out_lse": _view((HEADS, TOKENS), "float32", ptr=2 << 32),
        "v": _view((STATES, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        "s": _view((STATES, HEADS, TOKENS), "float32", ptr=4 << 32),
        "indptr": None,
    }
    views.update(changes)
    return views


def _plan(views, options=None):
    options = options or _plan_module.ManyStateOptions()
    operation = _MERGE_STATES if views["indptr"] is None else _MERGE_STATES_VARLEN
    arrays = [views[name] for name in ("out", "out_lse", "v", "s", "indptr")]
    arrays += [views.get("output_scale"), views.get("output_block_scale")]
    return _dispatch.plan_call(operation, options, arrays).plan


def _template(plan):
    family = next(f for f in cat.FAMILIES if plan.kernel.startswith(f"cupy_merge::{f.name}<"))
    return family, dict(zip(family.template, plan.kernel[plan.kernel.index("<") + 1 : -1].split(", ")))


def _args(plan):
    return dict(zip(_template(plan)[0].params, plan.args))


def test_a_dense_call_plans_the_packed_kernel():
    plan = _plan(_dense())
    family, template = _template(plan)
    # A few rows: their states are split over thread groups (the "true" instantiation).
    assert family is cat.MANY_PACKED and template["VEC"] == "8" and template["SPLIT"] == "true"
    assert _args(plan)["num_states"] == STATES


def test_without_packed_kernels_a_dense_call_plans_the_strided_kernel(monkeypatch):
    monkeypatch.setattr(_plan_module, "PACKED_KERNELS", False)
    plan = _plan(_dense())
    assert (
        plan.kernel == "cupy_merge::merge_many_states<cupy_merge::half_t, cupy_merge::half_t, 8, true, int>"
    )
    assert _args(plan)["num_states"] == STATES


def test_a_state_stride_that_breaks_alignment_narrows_the_vector():
    v = _view(
        (STATES, TOKENS, HEADS, HEAD_SIZE),
        strides=(TOKENS * HEADS * HEAD_SIZE + 2, HEADS * HEAD_SIZE, HEAD_SIZE, 1),
        ptr=3 << 32,
    )
    family, template = _template(_plan(_dense(v=v)))
    assert family is cat.MANY_STRIDED and template["VEC"] == "2"


def test_a_float32_input_into_a_bfloat16_output_still_moves_16_bytes():
    v = _view((STATES, TOKENS, HEADS, HEAD_SIZE), "float32", ptr=3 << 32)
    out = _view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=1 << 32)
    plan = _plan(_dense(v=v, out=out))
    assert plan.kernel.startswith("cupy_merge::merge_many_states_packed<float, cupy_merge::bfloat16_t, 8,")
    assert plan.module == ("merge_many_states.cu", "float32", "bfloat16")


BAD_DENSE = [
    ("v", _view((TOKENS, HEADS, HEAD_SIZE)), ValueError, "4-D"),
    ("s", _view((HEADS, TOKENS), "float32"), ValueError, "3-D"),
    ("v", _view((STATES, TOKENS, HEADS, HEAD_SIZE), "float64"), TypeError, "float32, float16 or bfloat16"),
    ("s", _view((STATES, HEADS, TOKENS), "float16"), TypeError, "float32 log-sum-exp"),
    ("s", _view((STATES + 1, HEADS, TOKENS), "float32"), ValueError, "num_states, num_heads, num_tokens"),
    ("s", _view((STATES, TOKENS, HEADS), "float32"), ValueError, "transposed view"),
    ("v", _view((STATES, TOKENS, HEADS, HEAD_SIZE), strides=(999, 99, 9, 2)), ValueError, "contiguous"),
    ("s", _view((STATES, HEADS, TOKENS), "float32", device=1), ValueError, "device 0"),
    ("out", _view((TOKENS, HEADS, HEAD_SIZE + 1)), ValueError, "shape"),
    ("out", _view((TOKENS, HEADS, HEAD_SIZE), "int8"), TypeError, "float32, float16 or bfloat16"),
    ("out_lse", _view((TOKENS, HEADS), "float32", ptr=2 << 32), ValueError, "transposed view"),
    ("out", _view((TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32), ValueError, "separate from v"),
    ("out_lse", _view((HEADS, TOKENS), "float32", ptr=4 << 32), ValueError, "separate from s"),
]


@pytest.mark.parametrize("argument, view, error, words", BAD_DENSE, ids=[f"{c[0]}-{c[3]}" for c in BAD_DENSE])
def test_bad_dense_inputs_raise_naming_the_argument(argument, view, error, words):
    with pytest.raises(error, match=f"^{argument}: .*{words}"):
        _plan(_dense(**{argument: view}))


def _ragged(**changes):
    views = {
        "out": _view((TOKENS, HEADS, HEAD_SIZE), ptr=1 << 32),
        "out_lse": _view((HEADS, TOKENS), "float32", ptr=2 << 32),
        "v": _view((20, HEADS, HEAD_SIZE), ptr=3 << 32),
        "s": _view((HEADS, 20), "float32", ptr=4 << 32),
        "indptr": _view((TOKENS + 1,), "int32", ptr=5 << 32),
    }
    views.update(changes)
    return views


def test_a_ragged_call_uses_zero_token_strides(monkeypatch):
    args = _args(_plan(_ragged()))
    assert args["indptr"] == 5 << 32 and args["indptr_bytes"] == 4
    assert args["num_states"] == 20  # rows in all, the bound every offset is checked against
    assert (args["v_stride_state"], args["v_stride_token"]) == (HEADS * HEAD_SIZE // 8, 0)  # in packs
    monkeypatch.setattr(_plan_module, "PACKED_KERNELS", False)
    args = _args(_plan(_ragged()))
    assert (args["v_stride_state"], args["v_stride_token"], args["v_stride_head"]) == (
        HEADS * HEAD_SIZE,
        0,
        HEAD_SIZE,
    )


BAD_RAGGED = [
    ("indptr", _view((TOKENS + 1,), "float32", ptr=5 << 32), TypeError, "int32 or int64"),
    ("indptr", _view((TOKENS + 1, 1), "int64", ptr=5 << 32), ValueError, "1-D"),
    ("indptr", _view((0,), "int64", ptr=5 << 32), ValueError, "num_tokens \\+ 1"),
    ("indptr", _view((TOKENS + 1,), "int64", ptr=5 << 32, device=1), ValueError, "device 0"),
    ("s", _view((HEADS, 19), "float32", ptr=4 << 32), ValueError, "num_heads, total_states"),
    ("v", _view((STATES, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32), ValueError, "3-D"),
    ("out", _view((TOKENS + 1, HEADS, HEAD_SIZE)), ValueError, "shape"),
]


@pytest.mark.parametrize(
    "argument, view, error, words", BAD_RAGGED, ids=[f"{c[0]}-{c[3]}" for c in BAD_RAGGED]
)
def test_bad_ragged_inputs_raise_naming_the_argument(argument, view, error, words):
    with pytest.raises(error, match=f"^{argument}: .*{words}"):
        _plan(_ragged(**{argument: view}))


@pytest.mark.parametrize(
    "values, words",
    [
        ([1, 2, 3], "first entry to be 0"),
        ([0, 3, 2], r"indptr\[1\] = 3 > indptr\[2\] = 2"),
        ([0, 5, 21], "at most"),
    ],
)
def test_indptr_values_are_checked_on_the_host(values, words):
    with pytest.raises(ValueError, match=f"^indptr: expected .*{words}"):
        _checks.indptr_values(np.array(values), 20)
    _checks.indptr_values(np.array([0, 0, 20]), 20)


@pytest.mark.parametrize("base, flag", [("e", 0), (np.e, 0), (2, 1), ("2", 1)])
def test_lse_base_accepts_e_and_2(base, flag):
    assert _checks.lse_base_flag(base) == flag


@pytest.mark.parametrize("base", [10, "ln", True, None, 2.5, np.array(2), [2]])
def test_any_other_lse_base_is_rejected(base):
    with pytest.raises(ValueError, match="^lse_base: expected"):
        _checks.lse_base_flag(base)


@pytest.mark.parametrize(
    "dtype, name",
    [("bfloat16", "bfloat16"), (np.float16, "float16"), ("float32", "float32"), (np.dtype("f4"), "float32")],
)
def test_output_dtypes_are_named_from_any_spelling(dtype, name):
    assert _checks.value_dtype_name(dtype) == name


@pytest.mark.parametrize("dtype", ["float64", np.int8, "nonsense"])
def test_other_output_dtypes_are_rejected(dtype):
    with pytest.raises(TypeError, match="^out_dtype: expected"):
        _checks.value_dtype_name(dtype)


def test_two_dense_states_go_to_the_two_way_kernel_as_views():
    views = _dense(
        v=_view((2, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((2, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    args = _args(_plan(views))
    assert _template(_plan(views))[0] is cat.TWO_PACKED
    assert args["v_a"] == 3 << 32 and args["v_b"] == (3 << 32) + TOKENS * HEADS * HEAD_SIZE * 2
    assert args["lse_a"] == 4 << 32 and args["lse_b"] == (4 << 32) + HEADS * TOKENS * 4


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("states, tokens, expected", [(64, 4096, 1), (64, 64, 4), (256, 16, 16), (3, 16, 1)])
def test_few_rows_split_their_states_over_more_threads(monkeypatch, packed, states, tokens, expected):
    monkeypatch.setattr(_plan_module, "PACKED_KERNELS", packed)
    views = _dense(
        v=_view((states, tokens, 32, 128), ptr=3 << 32),
        s=_view((states, 32, tokens), "float32", ptr=4 << 32),
        out=_view((tokens, 32, 128), ptr=1 << 32),
        out_lse=_view((32, tokens), "float32", ptr=2 << 32),
    )
    plan = _plan(views)
    family, template = _template(plan)
    assert family is (cat.MANY_PACKED if packed else cat.MANY_STRIDED)
    assert template["SPLIT"] == ("true" if expected > 1 else "false")
    if packed:
        threads_x, splits, _ = plan.block
        assert plan.shared_bytes == (splits - 1) * threads_x * (8 + 3) * 4
    else:
        threads_x, rows_y, splits = plan.block
        assert plan.shared_bytes == (splits - 1) * threads_x * rows_y * (8 + 3) * 4
    assert splits == expected and math.prod(plan.block) <= 1024


@pytest.mark.parametrize("states", [2, 6])  # two dense states are planned as the two-way kernel
def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in(states):
    views = _dense(
        v=_view((states, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((states, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    plan = _plan(views)
    assert plan.args[plan.out_slot] == views["out"].ptr
    assert plan.args[plan.out_lse_slot] == views["out_lse"].ptr


def test_head_size_zero_plans_the_strided_kernel():
    views = _dense(
        v=_view((STATES, TOKENS, HEADS, 0), ptr=3 << 32), out=_view((TOKENS, HEADS, 0), ptr=1 << 32)
    )
    assert _template(_plan(views))[0] is cat.MANY_STRIDED


def test_two_billion_stride_0_states_take_64_bit_offsets():
    views = _dense(
        v=_view((2**31, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32, strides=(0, HEADS * HEAD_SIZE, HEAD_SIZE, 1)),
        s=_view((2**31, HEADS, TOKENS), "float32", ptr=4 << 32, strides=(0, TOKENS, 1)),
    )
    family, template = _template(_plan(views))
    assert family is cat.MANY_STRIDED and template["Index"] == "long long"
