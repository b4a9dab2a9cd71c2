"""N-way and ragged checks, plans and conventions, on ArrayViews: no GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_merge import _conventions, _plan_many
from cupy_merge import _plan as _plan_module
from cupy_merge._arrays import ArrayView

STATES, TOKENS, HEADS, HEAD_SIZE = 6, 5, 3, 64


def _view(shape, dtype="float16", ptr=1 << 32, strides=None, device=0):
    itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return ArrayView(ptr, tuple(shape), tuple(strides), dtype, itemsize, device)


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


def _plan(views):
    return _plan_many.plan_many(views["out"], views["out_lse"], views["v"], views["s"], views["indptr"], 0)


def test_a_dense_call_plans_the_widest_vector():
    plan = _plan(_dense())
    # A few rows: their states are split over thread groups (the "true" instantiation).
    assert (
        plan.kernel == "cupy_merge::merge_many_states<cupy_merge::half_t, cupy_merge::half_t, 8, true, int>"
    )
    assert plan.args[7] == STATES  # num_states


def test_a_state_stride_that_breaks_alignment_narrows_the_vector():
    v = _view(
        (STATES, TOKENS, HEADS, HEAD_SIZE),
        strides=(TOKENS * HEADS * HEAD_SIZE + 2, HEADS * HEAD_SIZE, HEAD_SIZE, 1),
        ptr=3 << 32,
    )
    assert ", 2, " in _plan(_dense(v=v)).kernel


def test_a_float32_input_into_a_bfloat16_output_still_moves_16_bytes():
    v = _view((STATES, TOKENS, HEADS, HEAD_SIZE), "float32", ptr=3 << 32)
    out = _view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=1 << 32)
    plan = _plan(_dense(v=v, out=out))
    assert plan.kernel.startswith("cupy_merge::merge_many_states<float, cupy_merge::bfloat16_t, 8,")
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


def test_a_ragged_call_uses_zero_token_strides():
    plan = _plan(_ragged())
    args = plan.args
    assert args[4] == 5 << 32 and args[5] == 4  # indptr pointer, 4-byte entries
    assert args[7] == 20  # rows in all, the bound every offset is checked against
    v_strides = args[13:16]  # (state, token, head)
    assert v_strides == (HEADS * HEAD_SIZE, 0, HEAD_SIZE)


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
        _plan_many.check_indptr_values(np.array(values), 20)
    _plan_many.check_indptr_values(np.array([0, 0, 20]), 20)


@pytest.mark.parametrize("base, flag", [("e", 0), (np.e, 0), (2, 1), ("2", 1)])
def test_lse_base_accepts_e_and_2(base, flag):
    assert _conventions.lse_base_flag(base) == flag


@pytest.mark.parametrize("base", [10, "ln", True, None, 2.5])
def test_any_other_lse_base_is_rejected(base):
    with pytest.raises(ValueError, match="^lse_base: expected"):
        _conventions.lse_base_flag(base)


@pytest.mark.parametrize(
    "dtype, name",
    [("bfloat16", "bfloat16"), (np.float16, "float16"), ("float32", "float32"), (np.dtype("f4"), "float32")],
)
def test_output_dtypes_are_named_from_any_spelling(dtype, name):
    assert _conventions.value_dtype_name(dtype) == name


@pytest.mark.parametrize("dtype", ["float64", np.int8, "nonsense"])
def test_other_output_dtypes_are_rejected(dtype):
    with pytest.raises(TypeError, match="^out_dtype: expected"):
        _conventions.value_dtype_name(dtype)


def test_two_dense_states_go_to_the_two_way_kernel_as_views():
    views = _dense(
        v=_view((2, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((2, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    plan = _plan(views)
    assert plan.kernel.startswith("cupy_merge::merge_two_states<")
    args = plan.args  # out, out_lse, v_a, s_a, v_b, s_b, ...
    assert args[2] == 3 << 32 and args[4] == (3 << 32) + TOKENS * HEADS * HEAD_SIZE * 2
    assert args[3] == 4 << 32 and args[5] == (4 << 32) + HEADS * TOKENS * 4


@pytest.mark.parametrize("states, tokens, expected", [(64, 4096, 1), (64, 64, 4), (256, 16, 16), (3, 16, 1)])
def test_few_rows_split_their_states_over_more_threads(states, tokens, expected):
    v = _view((states, tokens, 32, 128), ptr=3 << 32)
    s = _view((states, 32, tokens), "float32", ptr=4 << 32)
    out = _view((tokens, 32, 128), ptr=1 << 32)
    out_lse = _view((32, tokens), "float32", ptr=2 << 32)
    plan = _plan_many.plan_many(out, out_lse, v, s, None, 0)
    threads_x, rows_y, splits = plan.block
    assert splits == expected
    assert _plan_module.kernel_template_arguments(plan.kernel)[3] == ("true" if splits > 1 else "false")
    assert threads_x * rows_y * splits <= _plan_many.MAX_BLOCK_THREADS
    assert plan.shared_bytes == (splits - 1) * threads_x * rows_y * (8 + 3) * 4


@pytest.mark.parametrize("states", [2, 6])  # two dense states are planned as the two-way kernel
def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in(states):
    views = _dense(
        v=_view((states, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((states, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    plan = _plan(views)
    assert plan.args[_plan_module.OUT_ARGUMENT] == views["out"].ptr
    assert plan.args[_plan_module.OUT_LSE_ARGUMENT] == views["out_lse"].ptr
