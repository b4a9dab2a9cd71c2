"""N-way and ragged checks, plans and conventions, on ArrayViews: no GPU needed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from views import arguments, bound_args, family, plan_checked, slot_fields, template
from views import view as _make_view

from cupy_merge import _array_rules, _options, _tuning
from cupy_merge import _catalogue as cat
from cupy_merge._operands import ManyStateOptions
from cupy_merge._ops import MERGE_STATES, MERGE_STATES_VARLEN

STATES, TOKENS, HEADS, HEAD_SIZE = 6, 5, 3, 64
STRIDED = _tuning.DEFAULT.replace(packed_kernels=False)


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


def _plan(views, options=None, tuning=_tuning.DEFAULT):
    """The one launch of the merge of ``views``, after every shape and address rule."""
    options = options or ManyStateOptions()
    operation = MERGE_STATES if views["indptr"] is None else MERGE_STATES_VARLEN
    plan = plan_checked(operation, options, views, tuning).plan
    assert len(plan) == 1, plan
    return plan[0]


def _template(plan):
    return family(plan), template(plan)


def _args(plan):
    return arguments(plan)


def test_a_dense_call_plans_the_packed_kernel():
    plan = _plan(_dense())
    kernels, template_args = _template(plan)
    # A few rows: their states are split over thread groups (the "true" instantiation).
    assert kernels is cat.MANY_PACKED and template_args["VEC"] == "8" and template_args["SPLIT"] == "true"
    assert _args(plan)["num_states"] == STATES


def test_without_packed_kernels_a_dense_call_plans_the_strided_kernel():
    plan = _plan(_dense(), tuning=STRIDED)
    assert (
        plan.kernel
        == "cupy_merge::merge_many_states<cupy_merge::half_t, cupy_merge::half_t, 8, true, int, false>"
    )
    assert _args(plan)["num_states"] == STATES


def test_a_state_stride_that_breaks_alignment_narrows_the_vector():
    v = _view(
        (STATES, TOKENS, HEADS, HEAD_SIZE),
        strides=(TOKENS * HEADS * HEAD_SIZE + 2, HEADS * HEAD_SIZE, HEAD_SIZE, 1),
        ptr=3 << 32,
    )
    kernels, template_args = _template(_plan(_dense(v=v)))
    assert kernels is cat.MANY_STRIDED and template_args["VEC"] == "2"


def test_a_float32_input_into_a_bfloat16_output_still_moves_16_bytes():
    v = _view((STATES, TOKENS, HEADS, HEAD_SIZE), "float32", ptr=3 << 32)
    out = _view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=1 << 32)
    plan = _plan(_dense(v=v, out=out))
    assert plan.kernel.startswith("cupy_merge::merge_many_states_packed<float, cupy_merge::bfloat16_t, 8,")
    assert plan.module == cat.Module("merge_many_states.cu", "float32", "bfloat16")
    assert plan.module[:3] == ("merge_many_states.cu", "float32", "bfloat16")


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
    views = _ragged()
    plan = _plan(views)
    args = bound_args(plan, views)
    assert args["indptr"] == 5 << 32 and args["indptr_bytes"] == 4
    assert plan.slots("indptr") == [family(plan).position("indptr")]
    assert args["num_states"] == 20  # rows in all, the bound every offset is checked against
    assert (args["v_stride_state"], args["v_stride_token"]) == (HEADS * HEAD_SIZE // 8, 0)  # in packs
    args = _args(_plan(_ragged(), tuning=STRIDED))
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
        _array_rules.indptr_values(np.array(values), 20)
    _array_rules.indptr_values(np.array([0, 0, 20]), 20)


@pytest.mark.parametrize("base, flag", [("e", 0), (np.e, 0), (2, 1), ("2", 1)])
def test_lse_base_accepts_e_and_2(base, flag):
    assert _options.lse_base_flag(base) == flag


@pytest.mark.parametrize("base", [10, "ln", True, None, 2.5, np.array(2), [2]])
def test_any_other_lse_base_is_rejected(base):
    with pytest.raises(ValueError, match="^lse_base: expected"):
        _options.lse_base_flag(base)


@pytest.mark.parametrize(
    "dtype, name",
    [("bfloat16", "bfloat16"), (np.float16, "float16"), ("float32", "float32"), (np.dtype("f4"), "float32")],
)
def test_output_dtypes_are_named_from_any_spelling(dtype, name):
    assert _options.value_dtype_name(dtype) == name


@pytest.mark.parametrize("dtype", ["float64", np.int8, "nonsense"])
def test_other_output_dtypes_are_rejected(dtype):
    with pytest.raises(TypeError, match="^out_dtype: expected"):
        _options.value_dtype_name(dtype)


def test_two_dense_states_go_to_the_two_way_kernel_as_views():
    views = _dense(
        v=_view((2, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((2, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    plan = _plan(views)
    args = bound_args(plan, views)
    assert _template(plan)[0] is cat.TWO_PACKED
    assert args["v_a"] == 3 << 32 and args["v_b"] == (3 << 32) + TOKENS * HEADS * HEAD_SIZE * 2
    assert args["lse_a"] == 4 << 32 and args["lse_b"] == (4 << 32) + HEADS * TOKENS * 4
    # The views of the two states are slots into v and s at each state's byte offset.
    slots = slot_fields(plan)
    assert (slots["v_a"], slots["v_b"]) == (("v", 0), ("v", TOKENS * HEADS * HEAD_SIZE * 2))
    assert (slots["lse_a"], slots["lse_b"]) == (("s", 0), ("s", HEADS * TOKENS * 4))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("states, tokens, expected", [(64, 4096, 1), (64, 64, 4), (256, 16, 16), (3, 16, 1)])
def test_few_rows_split_their_states_over_more_threads(packed, states, tokens, expected):
    views = _dense(
        v=_view((states, tokens, 32, 128), ptr=3 << 32),
        s=_view((states, 32, tokens), "float32", ptr=4 << 32),
        out=_view((tokens, 32, 128), ptr=1 << 32),
        out_lse=_view((32, tokens), "float32", ptr=2 << 32),
    )
    plan = _plan(views, tuning=_tuning.DEFAULT.replace(packed_kernels=packed))
    kernels, template_args = _template(plan)
    assert kernels is (cat.MANY_PACKED if packed else cat.MANY_STRIDED)
    assert template_args["SPLIT"] == ("true" if expected > 1 else "false")
    if packed:
        threads_x, splits, _ = plan.block
        assert plan.shared_bytes == (splits - 1) * threads_x * (8 + 3) * 4
    else:
        threads_x, rows_y, splits = plan.block
        assert plan.shared_bytes == (splits - 1) * threads_x * rows_y * (8 + 3) * 4
    assert splits == expected and math.prod(plan.block) <= 1024


@pytest.mark.parametrize(
    "states, tokens, heads, block",
    [
        (1024, 1, 32, (4, 128, 1)),  # 512 packs: 128 blocks of 4 packs, each split 128 ways
        (4096, 1, 32, (4, 128, 1)),  # the block holds no more (packed_block_limit): 8 chunks a split
        (1024, 2, 32, (8, 64, 1)),  # 1024 packs: 128 blocks of 8, fewer splits
        (256, 8, 32, (32, 16, 1)),  # 4096 packs fill 128 blocks of 32 packs
        (64, 1, 32, (8, 16, 1)),  # narrowed to 128 threads a block
        (16, 1, 32, (32, 4, 1)),  # a decode step of 16 states: one block of 128 threads
        (8, 4, 8, (64, 2, 1)),  # two splits of one chunk each
    ],
)
def test_few_rows_take_narrow_blocks_of_many_splits(states, tokens, heads, block):
    views = _dense(
        v=_view((states, tokens, heads, 128), ptr=3 << 32),
        s=_view((states, heads, tokens), "float32", ptr=4 << 32),
        out=_view((tokens, heads, 128), ptr=1 << 32),
        out_lse=_view((heads, tokens), "float32", ptr=2 << 32),
    )
    plan = _plan(views)
    assert plan.block == block
    packs = tokens * heads * 16
    assert plan.grid == (-(-packs // block[0]), 1, 1)
    assert plan.shared_bytes == (block[1] - 1) * block[0] * (8 + 3) * 4 <= 48 * 1024
    assert math.prod(block) <= _tuning.DEFAULT.packed_block_limit


@pytest.mark.parametrize("states", [2, 6])  # two dense states are planned as the two-way kernel
def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in(states):
    views = _dense(
        v=_view((states, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32),
        s=_view((states, HEADS, TOKENS), "float32", ptr=4 << 32),
    )
    plan = _plan(views)
    kernels = family(plan)
    assert plan.slots("out") == [kernels.position("out")] and plan.slots("out_lse") == [
        kernels.position("out_lse")
    ]
    assert plan.args[kernels.position("out")] == plan.args[kernels.position("out_lse")] == 0  # no address
    args = bound_args(plan, views)
    assert args["out"] == views["out"].ptr
    assert args["out_lse"] == views["out_lse"].ptr


def test_head_size_zero_plans_the_strided_kernel():
    views = _dense(
        v=_view((STATES, TOKENS, HEADS, 0), ptr=3 << 32), out=_view((TOKENS, HEADS, 0), ptr=1 << 32)
    )
    assert _template(_plan(views))[0] is cat.MANY_STRIDED


def test_two_billion_stride_0_states_take_64_bit_offsets():
    # Dense merges take at most MAX_STATES_PER_TOKEN states a token (see the test below); a ragged
    # batch's rows are not bounded so, and the kernels count them in the offset type.
    rows = 2**31
    views = _ragged(
        v=_view((rows, HEADS, HEAD_SIZE), ptr=3 << 32, strides=(0, HEAD_SIZE, 1)),
        s=_view((HEADS, rows), "float32", ptr=4 << 32, strides=(1, 0)),
    )
    plan = _plan(views)
    kernels, template_args = _template(plan)
    assert kernels is cat.MANY_STRIDED and template_args["Index"] == "long long"
    assert _args(plan)["num_states"] == rows
    dense = _dense(
        v=_view((rows, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32, strides=(0, HEADS * HEAD_SIZE, HEAD_SIZE, 1)),
        s=_view((rows, HEADS, TOKENS), "float32", ptr=4 << 32, strides=(0, TOKENS, 1)),
    )
    with pytest.raises(ValueError, match=f"^v: expected at most {cat.MAX_STATES_PER_TOKEN} states a token"):
        _plan(dense)


def test_a_dense_merge_of_more_states_a_token_than_the_kernels_take_is_refused_naming_v():
    most = cat.MAX_STATES_PER_TOKEN
    assert most == 65536
    for states in (most, most + 1):
        views = _dense(
            v=_view(
                (states, TOKENS, HEADS, HEAD_SIZE), ptr=3 << 32, strides=(0, HEADS * HEAD_SIZE, HEAD_SIZE, 1)
            ),
            s=_view((states, HEADS, TOKENS), "float32", ptr=4 << 32, strides=(0, TOKENS, 1)),
        )
        if states == most:
            assert _args(_plan(views))["num_states"] == most
        else:
            with pytest.raises(
                ValueError, match=rf"^v: expected at most 65536 states a token .*got {most + 1}"
            ):
                _plan(views)
    # The ragged merge's bound is checked with its offsets, on the host.
    with pytest.raises(ValueError, match=rf"^indptr: expected at most 65536 states a token, got {most + 1}"):
        _array_rules.indptr_values(np.array([0, 1, most + 2]), most + 2)


def test_ragged_rows_of_many_states_take_at_least_four_splits():
    """Session 31's sweep: 512 tokens of ~200 states reached 94 % of the copy at four splits, 85 % at
    the one the threads alone asked for; rows of a few states keep one."""
    from cupy_merge import _plan, _tuning

    tuning, packs = _tuning.DEFAULT, 32 * 128 // 8  # 32 heads of 128 bf16 values, 8 a pack
    assert _plan.choose_packed_block(512 * packs, 200, 1, tuning, ragged=True)[1] == 4
    assert _plan.choose_packed_block(512 * packs, 200, 1, tuning)[1] == 1  # dense rows: the threads decide
    assert _plan.choose_packed_block(1024 * packs, 8, 1, tuning, ragged=True)[1] == 1
    assert _plan.choose_packed_block(64 * packs, 100, 1, tuning, ragged=True)[1] == 4
    assert _plan.choose_packed_block(512 * packs, 200, 1, tuning.replace(ragged_min_splits=1), ragged=True)[1] == 1
