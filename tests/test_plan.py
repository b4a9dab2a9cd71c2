"""Two-way merges: every rule and launch choice, on ArrayViews (no GPU needed)."""

from __future__ import annotations

import math
import types

import pytest
from bad_inputs import BAD_CASES, VALID, Spec, specs_for
from views import arguments, bound_args, family, from_specs, plan_checked, record, slot_fields, template, view

from cupy_merge import _array_rules, _arrays, _dispatch, _launch, _plan, _tuning
from cupy_merge import _catalogue as cat
from cupy_merge._operands import ManyStateOperands, ManyStateOptions, TwoStateOperands, TwoStateOptions
from cupy_merge._ops import (
    MERGE_ATTN_STATES,
    MERGE_STATE,
    MERGE_STATE_IN_PLACE,
    MERGE_STATES,
    MERGE_STATES_VARLEN,
)

ORDER = ["out", "out_lse", "v_a", "s_a", "v_b", "s_b"]
OPTIONS = TwoStateOptions()
DEFAULT = _tuning.DEFAULT
STRIDED = DEFAULT.replace(packed_kernels=False)


def _planned(views: dict, options=OPTIONS, operation=MERGE_STATE, tuning=DEFAULT):
    """The plan of an eager call with these views, after every shape and address rule."""
    return plan_checked(operation, options, views, tuning)


def _launch_of(views: dict, options=OPTIONS, tuning=DEFAULT, operation=MERGE_STATE):
    """The one launch of a merge planned from ``views``."""
    plan = _planned(views, options, operation, tuning).plan
    assert len(plan) == 1, plan
    return plan[0]


def _states(tokens, heads, head_size, dtype="float16"):
    values, lse = Spec((tokens, heads, head_size), dtype), Spec((heads, tokens), "float32")
    return from_specs({name: values if name.startswith(("out", "v")) and name != "out_lse" else lse
                       for name in ORDER}, ORDER)  # fmt: skip


def _template(launch):
    return family(launch), template(launch)


def test_a_contiguous_call_plans_the_packed_kernel_with_16_byte_packs():
    launch = _launch_of(_states(5, 3, 16))
    kernels, template_args = _template(launch)
    assert kernels is cat.TWO_PACKED
    assert template_args["VEC"] == "8" and template_args["LSE_IN_PLACE"] == "false"
    args = arguments(launch)
    assert (
        args["total_packs"] == 5 * 3 * 2 and args["packs_per_token"] == 3 * 2 and args["packs_per_row"] == 2
    )
    assert launch.grid[0] * launch.block[0] >= args["total_packs"]


@pytest.mark.parametrize("tokens, streaming", [(1024, "true"), (8192, "false")])
def test_packed_loads_stream_below_64_mb_of_traffic(tokens, streaming):
    # 3 arrays x tokens x 32 heads x 128 x 2 bytes: 25 MB at 1024 tokens, 201 MB at 8192.
    assert _template(_launch_of(_states(tokens, 32, 128)))[1]["STREAMING"] == streaming


def test_without_packed_kernels_every_call_plans_the_strided_one():
    kernels, template_args = _template(_launch_of(_states(5, 3, 16), tuning=STRIDED))
    assert kernels is cat.TWO_STRIDED and template_args["Index"] == "int"


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.id)
def test_every_bad_input_raises_naming_the_argument(case):
    with pytest.raises(case.error) as raised:
        _planned(from_specs(specs_for(case), ORDER))
    message = str(raised.value)
    assert message.startswith((f"{case.argument}: expected", f"{case.argument}: overlaps")), message


def test_token_major_lse_error_suggests_the_transpose():
    specs = dict(VALID, s_a=Spec(VALID["s_a"].shape[::-1], "float32"))
    with pytest.raises(ValueError, match="transposed view"):
        _planned(from_specs(specs, ORDER))


def test_in_place_output_identical_to_an_input_is_allowed():
    views = from_specs(VALID, ORDER)
    views["out"], views["out_lse"] = views["v_b"], views["s_a"]
    launch = _launch_of(views)
    assert _template(launch)[1]["LSE_IN_PLACE"] == "true"
    args = bound_args(launch, views)
    assert (args["out"], args["out_lse"]) == (views["v_b"].ptr, views["s_a"].ptr)


def test_interleaved_but_not_identical_output_is_rejected():
    views = from_specs(VALID, ORDER)
    views["out"] = views["v_a"]._replace(strides=(views["v_a"].strides[0], 1, 1))
    with pytest.raises(ValueError, match="^out: "):
        _planned(views)


def test_in_place_into_a_broadcast_input_is_rejected():
    views = from_specs(VALID, ORDER)
    broadcast = views["v_a"]._replace(strides=(0, *views["v_a"].strides[1:]))
    views["v_a"] = views["out"] = broadcast
    with pytest.raises(ValueError, match="^out: expected an output whose elements do not share memory"):
        _planned(views)


def test_an_in_place_lse_whose_row_spans_two_warps_takes_the_strided_kernel():
    views = _states(4, 2, 512)  # 64 packs a row
    views["out_lse"] = views["s_b"]
    assert _template(_launch_of(views))[0] is cat.TWO_STRIDED
    views = _states(4, 2, 256)  # 32 packs: one warp a row
    views["out_lse"] = views["s_b"]
    assert _template(_launch_of(views))[1]["LSE_IN_PLACE"] == "true"


@pytest.mark.parametrize("tokens, heads", [(0, 4), (4, 0), (0, 0)])
def test_zero_tokens_or_heads_is_a_no_op(tokens, heads):
    assert _planned(_states(tokens, heads, 16)).plan == ()


def test_head_size_zero_still_writes_the_lse_with_the_strided_kernel():
    launch = _launch_of(_states(5, 3, 0))
    assert _template(launch)[0] is cat.TWO_STRIDED


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
    values = view((3, 2, head_size), dtype, 4096 + misalign).spec
    assert _plan.choose_vector_width([values], head_size, cat.VECTOR_WIDTHS[itemsize]) == expected


def test_a_token_stride_that_breaks_alignment_narrows_the_vector_and_takes_the_strided_kernel():
    views = _states(3, 2, 64)
    views["v_a"] = views["v_a"]._replace(strides=(130, 64, 1))  # 130 = 2 * 64 + 2 padding
    assert _plan.choose_vector_width([views["v_a"].spec], 64, (8, 4, 2, 1)) == 2
    kernels, template_args = _template(_launch_of(views))
    assert kernels is cat.TWO_STRIDED and template_args["VEC"] == "2"


def test_heads_not_back_to_back_take_the_strided_kernel():
    views = _states(3, 4, 64)
    views["v_b"] = views["v_b"]._replace(strides=(4 * 72, 72, 1))  # heads padded to 72
    assert _template(_launch_of(views))[0] is cat.TWO_STRIDED


def test_huge_tensors_take_the_strided_kernel_with_64_bit_offsets():
    tokens, heads, head_size = 2**20, 64, 64  # 2^32 elements
    values = view((tokens, heads, head_size), "bfloat16", 1 << 40)
    lse = view((heads, tokens), "float32", 1 << 41)
    views = {"out": values._replace(ptr=1 << 42), "out_lse": lse._replace(ptr=1 << 43), "v_a": values, "s_a": lse,
             "v_b": values._replace(ptr=1 << 44), "s_b": lse._replace(ptr=1 << 45)}  # fmt: skip
    launch = _launch_of(views)
    kernels, template_args = _template(launch)
    assert kernels is cat.TWO_STRIDED and template_args["Index"] == "long long"
    token_blocks = -(-tokens // (launch.block[1] * int(template_args["ROWS"])))
    assert launch.grid == (token_blocks * heads, 1, 1) and math.prod(launch.grid) < 2**31


@pytest.mark.parametrize("head_size", [1, 7, 64, 128, 576, 4096])
@pytest.mark.parametrize("tokens", [1, 3, 4096])
def test_strided_block_covers_every_row_within_hardware_limits(head_size, tokens):
    threads_x, rows = _plan.choose_block(head_size, tokens, DEFAULT)
    assert 1 <= threads_x * rows <= 1024 and rows <= tokens


def test_offsets_are_32_bit_only_while_every_array_fits():
    small = view((4096, 32, 128), "bfloat16").spec
    assert _plan.index_type([small, None], 4096 * 32) == "int"
    far = view((2, 32, 128), "bfloat16", strides=(2**30, 128, 1)).spec
    assert _plan.index_type([small, far], 2 * 32) == "long long"
    assert _plan.index_type([small, far._replace(strides=(-(2**30), 128, 1))], 2 * 32) == "long long"
    # head_size 0: no array spans tokens x heads, which the kernels still loop over.
    assert _plan.index_type([view((2**26, 32, 0), strides=(0, 0, 1)).spec], 2**26 * 32) == "long long"
    assert _plan.index_type([view((0, 32, 128), strides=(2**31, 128, 1)).spec], 0) == "int"
    # Stride-0 states: tiny extents, but the kernels count the states in the offset type.
    assert (
        _plan.index_type([view((2**31, 1, 2, 8), strides=(0, 16, 8, 1)).spec], 2, num_states=2**31)
        == "long long"
    )


@pytest.fixture
def no_compiling(monkeypatch):
    """``_launch.prepare`` binds addresses without a GPU: the kernel lookup is a stand-in."""
    monkeypatch.setattr(
        _launch, "get_function", lambda module, kernel, device: _launch.Function(1, 2, None)
    )


def test_plans_put_the_output_pointers_where_fresh_outputs_are_patched_in(no_compiling):
    views = _states(5, 3, 16)
    families = set()
    for tuning in (DEFAULT, STRIDED):
        launch = _launch_of(views, tuning=tuning)
        kernels = family(launch)
        families.add(kernels)
        out_slot, out_lse_slot = kernels.position("out"), kernels.position("out_lse")
        assert launch.slots("out") == [out_slot] and launch.slots("out_lse") == [out_lse_slot]
        assert launch.args[out_slot] == launch.args[out_lse_slot] == 0  # no address in the plan
        prepared = _launch.prepare(launch, 0, {field: v.ptr for field, v in views.items()})
        assert prepared.values[out_slot] == views["out"].ptr
        assert prepared.values[out_lse_slot] == views["out_lse"].ptr
        # A fresh output has no address when prepared: its slot stays null until patched in.
        fresh = _launch.prepare(launch, 0, {f: v.ptr for f, v in views.items() if not f.startswith("out")})
        assert fresh.values[out_slot] == fresh.values[out_lse_slot] == 0
    assert families == {cat.TWO_PACKED, cat.TWO_STRIDED}


def test_missing_outputs_are_planned_as_fresh_arrays_and_patched_in():
    views = _states(5, 3, 16)
    del views["out"], views["out_lse"]
    planned = _planned(views, TwoStateOptions(out_dtype="float32"))
    assert [(f.field, f.shape, f.dtype) for f in planned.fresh] == [
        ("out", (5, 3, 16), "float32"),
        ("out_lse", (3, 5), "float32"),
    ]
    (launch,) = planned.plan
    kernels = family(launch)
    assert [launch.slots(f.field) for f in planned.fresh] == [
        [kernels.position("out")],
        [kernels.position("out_lse")],
    ]
    assert launch.module.out_dtype == "float32"


def test_out_dtype_must_match_a_given_output():
    with pytest.raises(TypeError, match="^out_dtype: expected the dtype of out"):
        _planned(_states(5, 3, 16), TwoStateOptions(out_dtype="float32"))


@pytest.mark.parametrize("tokens, rows", [(64, 1), (1024, 1), (2048, 2), (4096, 2)])
def test_small_strided_merges_give_each_thread_one_row(tokens, rows):
    assert _template(_launch_of(_states(tokens, 32, 128), tuning=STRIDED))[1]["ROWS"] == str(rows)


def test_the_in_place_merge_with_a_mask_reads_and_writes_v_and_s():
    views = _states(5, 3, 16)
    views["out"], views["out_lse"] = views["v_a"], views["s_a"]
    views["mask"] = view((5,), "bool", 9 << 32)
    launch = _launch_of(views, operation=MERGE_STATE_IN_PLACE)
    args = bound_args(launch, views)
    assert args["mask"] == 9 << 32 and args["mask_stride"] == 1
    assert (
        (args["out"], args["out_lse"]) == (args["v_a"], args["lse_a"]) == (views["v_a"].ptr, views["s_a"].ptr)
    )
    with pytest.raises(TypeError, match="^mask: expected a bool array"):
        views["mask"] = view((5,), "int8", 9 << 32)
        _planned(views, operation=MERGE_STATE_IN_PLACE)


@pytest.mark.parametrize("divisor", [1, 2, 3, 6, 7, 16, 96, 100, 4096, 12345, 2**20 + 1, 2**30 - 1])
def test_fast_division_matches_integer_division(divisor):
    import random

    fast = _plan.fast_divisor(divisor)
    numbers = [0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 1, 2**30] + [
        random.randrange(2**31) for _ in range(2000)
    ]
    assert all(_plan.fast_divide(n, fast) == n // divisor for n in numbers)


# -- the seams: plans without addresses, pointer slots, tunings, self-overlap ---------------------


def _moved(views: dict, shift: int) -> dict:
    return {name: v._replace(ptr=v.ptr + shift) for name, v in views.items()}


def _specs_of(views: dict, kind=TwoStateOperands):
    return kind(**{name: v.spec for name, v in views.items()})


def _all_args(plan) -> set[int]:
    return {arg for launch in plan for arg in launch.args}


@pytest.mark.parametrize("tuning", [DEFAULT, STRIDED], ids=["packed", "strided"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_plan_made_from_specs_alone_equals_the_plan_of_views_at_any_address_of_its_class(tuning, in_place):
    views = _states(5, 3, 16)
    if in_place:
        views["out"], views["out_lse"] = views["v_a"], views["s_b"]
    from_specs_alone = _dispatch.plan_specs(MERGE_STATE, OPTIONS, tuning, _specs_of(views), in_place)
    for shift in (0, 16, 4096 + 48, 1 << 36):  # every address 16-byte aligned: the same class
        moved = _moved(views, shift)
        assert (
            _dispatch.plan_for(MERGE_STATE, OPTIONS, tuning, record(MERGE_STATE, moved)) == from_specs_alone
        )
        assert not {v.ptr for v in moved.values()} & _all_args(from_specs_alone.plan)
    # Alignment is the one address fact a plan depends on: 8-byte aligned views plan narrower packs,
    # and equal what specs of that alignment class plan.
    moved = _moved(views, 8)
    planned = _dispatch.plan_for(MERGE_STATE, OPTIONS, tuning, record(MERGE_STATE, moved))
    assert planned == _dispatch.plan_specs(MERGE_STATE, OPTIONS, tuning, _specs_of(moved), in_place)
    assert all(spec.align == 8 for spec in _specs_of(moved) if spec is not None)
    assert template(planned.plan[0])["VEC"] == "4" and template(from_specs_alone.plan[0])["VEC"] == "8"


@pytest.mark.parametrize("ragged", [False, True])
def test_an_n_way_plan_made_from_specs_alone_equals_the_plan_of_views_anywhere(ragged):
    heads, head_size = 3, 64
    views = {
        "out": view((4, heads, head_size), ptr=1 << 32),
        "out_lse": view((heads, 4), "float32", ptr=2 << 32),
        "v": view((9, heads, head_size) if ragged else (6, 4, heads, head_size), ptr=3 << 32),
        "s": view((heads, 9) if ragged else (6, heads, 4), "float32", ptr=4 << 32),
    }
    if ragged:
        views["indptr"] = view((5,), "int64", ptr=5 << 32)
    operation = MERGE_STATES_VARLEN if ragged else MERGE_STATES
    options = ManyStateOptions()
    from_specs_alone = _dispatch.plan_specs(operation, options, DEFAULT, _specs_of(views, ManyStateOperands))
    for shift in (0, 16, 1 << 36):
        moved = _moved(views, shift)
        assert _dispatch.plan_for(operation, options, DEFAULT, record(operation, moved)) == from_specs_alone
        assert not {v.ptr for v in moved.values()} & _all_args(from_specs_alone.plan)


#: Each kernel pointer parameter and the operand field whose address it takes.
POINTER_FIELDS = {
    "out": "out", "out_lse": "out_lse", "output_scale": "output_scale", "v_a": "v_a", "lse_a": "s_a",
    "v_b": "v_b", "lse_b": "s_b", "mask": "mask", "output_block_scale": "output_block_scale",
    "sinks": "sinks", "v": "v", "lse": "s", "indptr": "indptr",
}  # fmt: skip


def _two(out_dtype="float16", **changes):
    views = _states(5, 3, 64)
    if out_dtype != "float16":
        views["out"] = view((5, 3, 64), out_dtype, ptr=views["out"].ptr)
    views.update(changes)
    return {name: v for name, v in views.items() if v is not None}


def _many(ragged=False, **changes):
    views = {
        "out": view((4, 3, 64), ptr=1 << 32),
        "out_lse": view((3, 4), "float32", ptr=2 << 32),
        "v": view((9, 3, 64) if ragged else (6, 4, 3, 64), ptr=3 << 32),
        "s": view((3, 9) if ragged else (6, 3, 4), "float32", ptr=4 << 32),
        "indptr": view((5,), "int32", ptr=5 << 32) if ragged else None,
    }
    views.update(changes)
    return {name: v for name, v in views.items() if v is not None}


SINKS = view((3,), "float32", ptr=10 << 32)
SCALE = view((1,), "float32", ptr=11 << 32)
BLOCK_SCALES = view((5, 3 * 64 // 32), "float32", ptr=12 << 32)
SLOT_CASES = {
    "two-packed": (MERGE_STATE, OPTIONS, _two(), DEFAULT),
    "two-strided": (MERGE_STATE, OPTIONS, _two(), STRIDED),
    "two-without-lse": (MERGE_ATTN_STATES, OPTIONS, _two(out_lse=None), DEFAULT),
    "two-in-place-mask": (MERGE_STATE_IN_PLACE, OPTIONS,
                          _two(out=_two()["v_a"], out_lse=_two()["s_a"], mask=view((5,), "bool", 9 << 32)), DEFAULT),
    "two-sinks": (MERGE_STATE, OPTIONS, _two(sinks=SINKS), DEFAULT),
    "two-sinks-strided": (MERGE_STATE, OPTIONS, _two(sinks=SINKS), STRIDED),
    "two-fp8-scale": (MERGE_STATE, OPTIONS, _two("float8_e4m3fn", output_scale=SCALE), DEFAULT),
    "two-fp8-scale-strided": (MERGE_STATE, OPTIONS, _two("float8_e4m3fn", output_scale=SCALE), STRIDED),
    "two-fp8-groups": (MERGE_STATE, TwoStateOptions(group_size=32),
                       _two("float8_e4m3fn", output_block_scale=BLOCK_SCALES), DEFAULT),
    "many-packed": (MERGE_STATES, ManyStateOptions(), _many(), DEFAULT),
    "many-strided": (MERGE_STATES, ManyStateOptions(), _many(), STRIDED),
    "many-sinks": (MERGE_STATES, ManyStateOptions(), _many(sinks=SINKS), DEFAULT),
    "ragged-packed": (MERGE_STATES_VARLEN, ManyStateOptions(), _many(True), DEFAULT),
    "ragged-strided-sinks": (MERGE_STATES_VARLEN, ManyStateOptions(), _many(True, sinks=SINKS), STRIDED),
    "many-fp8-scale": (MERGE_STATES, ManyStateOptions(),
                       _many(out=view((4, 3, 64), "float8_e4m3fn", ptr=1 << 32), output_scale=SCALE), STRIDED),
    "many-fp8-groups": (MERGE_STATES, ManyStateOptions(group_size=32),
                        _many(out=view((4, 3, 64), "float8_e4m3fn", ptr=1 << 32),
                              output_block_scale=view((4, 6), "float32", ptr=12 << 32)), DEFAULT),
}  # fmt: skip


@pytest.mark.parametrize("case", SLOT_CASES)
def test_a_plans_pointer_slots_name_exactly_the_operands_its_kernel_reads_and_writes(case):
    operation, options, views, tuning = SLOT_CASES[case]
    (launch,) = _planned(views, options, operation, tuning).plan
    kernels = family(launch)
    expected = {
        param: (POINTER_FIELDS[param], 0)
        for param in kernels.params
        if param in POINTER_FIELDS and POINTER_FIELDS[param] in views
    }
    assert slot_fields(launch) == expected
    assert {field for field, _ in expected.values()} == set(views)  # every operand, and only those
    # No address in the plan: pointer parameters hold 0 until bound; those of absent operands stay null.
    assert all(
        launch.args[kernels.position(param)] == 0 for param in POINTER_FIELDS if param in kernels.params
    )
    assert len({slot for slot, _, _ in launch.pointers}) == len(launch.pointers)
    assert template(launch)["SINKS"] == ("true" if "sinks" in views else "false")


def test_calls_and_plans_under_another_tuning_are_cached_apart(monkeypatch):
    monkeypatch.setattr(_dispatch, "_calls", {})
    monkeypatch.setattr(_dispatch, "_calls_by_tuning", {})
    prepared = []

    def prepare(operation, options, operands, tuning):
        prepared.append(tuning)
        return types.SimpleNamespace(tuning=tuning, grad=False, written=())

    monkeypatch.setattr(_dispatch, "prepare", prepare)
    monkeypatch.setattr(_dispatch, "run", lambda operation, call, operands, stream: call)
    monkeypatch.setattr(_arrays, "fingerprints", lambda operands: ("the same arrays",))
    operands = TwoStateOperands(None, None, "v_a", "s_a", "v_b", "s_b")
    first = _dispatch.call(MERGE_STATE, OPTIONS, operands, None)
    with _tuning.use(STRIDED):
        second = _dispatch.call(MERGE_STATE, OPTIONS, operands, None)
        assert _dispatch.call(MERGE_STATE, OPTIONS, operands, None) is second
    assert _dispatch.call(MERGE_STATE, OPTIONS, operands, None) is first
    assert prepared == [DEFAULT, STRIDED]  # each prepared once, under its own tuning
    assert (first.tuning, second.tuning) == (DEFAULT, STRIDED)
    (cached,) = _dispatch._calls.values()
    assert cached is first and list(_dispatch._calls_by_tuning) == [STRIDED]
    (cached,) = _dispatch._calls_by_tuning[STRIDED].values()
    assert cached is second
    # Plans of the same views: one a tuning, each found again.
    views = record(MERGE_STATE, _states(5, 3, 16))
    packed = _dispatch.plan_for(MERGE_STATE, OPTIONS, DEFAULT, views)
    strided = _dispatch.plan_for(MERGE_STATE, OPTIONS, STRIDED, views)
    assert family(packed.plan[0]) is cat.TWO_PACKED and family(strided.plan[0]) is cat.TWO_STRIDED
    assert _dispatch.plan_for(MERGE_STATE, OPTIONS, DEFAULT, views) is packed
    assert _dispatch.plan_for(MERGE_STATE, OPTIONS, STRIDED, views) is strided
    # A tuning's compile options make modules of their own (compiled and loaded apart).
    chunk8 = DEFAULT.replace(merge_chunk=8)
    many = record(MERGE_STATES, _many())
    default_module = _dispatch.plan_for(MERGE_STATES, ManyStateOptions(), DEFAULT, many).plan[0].module
    chunk8_module = _dispatch.plan_for(MERGE_STATES, ManyStateOptions(), chunk8, many).plan[0].module
    assert "-DMERGE_CHUNK=8" in chunk8_module.options and chunk8_module != default_module
    assert default_module.options == cat.DEFAULT_COMPILE_OPTIONS


@pytest.mark.parametrize(
    "shape, strides, shared",
    [
        ((3, 2, 4), (8, 12, 1), False),  # strides that do not nest, yet every element apart
        ((2, 3), (2, 1), True),  # rows overlap by one element
        ((2, 2, 2), (3, 2, 1), True),  # (1, 0, 0) and (0, 1, 1) meet
        ((2, 4, 4), (3, 8, 1), True),
        ((2, 2), (1, 1), True),
        ((4,), (0,), True),  # a broadcast
        ((3, 2), (-1, 1), True),
        ((4,), (1,), False),
        ((2, 2, 2), (4, 2, 1), False),
        ((3, 2), (-2, 1), False),
        ((2, 3, 4), (12, -4, 1), False),
        ((3, 3), (2, 3), False),
        ((1, 5), (0, 1), False),  # a stride of an extent-1 dimension is never used
    ],
)
def test_shares_elements_is_exact_for_any_strides(shape, strides, shared):
    assert _array_rules.shares_elements(shape, strides) is shared
    spec = view(shape, "float32", strides=strides).spec
    if shared:
        with pytest.raises(ValueError, match="^out: expected an output whose elements do not share memory"):
            _array_rules.expect_no_self_overlap(spec, "out")
    else:
        _array_rules.expect_no_self_overlap(spec, "out")


def test_an_output_with_strides_that_do_not_nest_is_accepted_when_its_elements_are_apart():
    views = _states(3, 2, 4, "float32")
    views["out"] = view((3, 2, 4), "float32", ptr=views["out"].ptr, strides=(8, 12, 1))
    assert _planned(views).plan  # planned, and every address rule passed
    views["out"] = view(
        (3, 2, 4), "float32", ptr=views["out"].ptr, strides=(8, 3, 1)
    )  # (0, 1, 0) and (0, 0, 3) meet
    with pytest.raises(ValueError, match="^out: expected an output whose elements do not share memory"):
        _planned(views)


def test_strides_too_irregular_to_decide_are_refused(monkeypatch):
    monkeypatch.setattr(_array_rules, "_OVERLAP_SEARCH_BUDGET", 3)
    with pytest.raises(
        ValueError, match="^out: expected an output whose elements provably do not share memory"
    ):
        _array_rules.expect_no_self_overlap(view((5, 5, 5), "float32", strides=(31, 7, 1)).spec, "out")


class _Family:
    """A kernel family of no parameters: what _plan._launch reads of one past its limit check."""

    name = "a_kernel"
    params: tuple = ()

    @staticmethod
    def instance(**template):
        return "a_kernel<>"

    @staticmethod
    def arguments(**values):
        return ()


@pytest.mark.parametrize(
    "grid, block, within",
    [
        ((2**31 - 1, 65535, 65535), (1024, 1, 1), True), ((1, 1, 1), (1, 1, 64), True), ((1, 1, 1), (16, 1, 64), True),
        ((2**31, 1, 1), (128, 1, 1), False), ((0, 1, 1), (128, 1, 1), False), ((1, 65536, 1), (128, 1, 1), False),
        ((1, 1, 65536), (128, 1, 1), False), ((1, 0, 1), (128, 1, 1), False), ((1, 1, 1), (1025, 1, 1), False),
        ((1, 1, 1), (1, 1025, 1), False), ((1, 1, 1), (1, 1, 65), False), ((1, 1, 1), (32, 32, 2), False),
        ((1, 1, 1), (0, 1, 1), False),
    ],
)  # fmt: skip
def test_a_launch_past_cudas_grid_and_block_limits_is_refused_before_the_driver(grid, block, within):
    """CUDA takes grids of up to 2**31 - 1 blocks in x and 65535 in y and z, blocks of up to 1024
    threads (1024, 1024 and 64 in x, y and z): a plan past them is a planner's mistake, named here."""
    if within:
        assert _plan._launch(_Family, None, {}, grid, block, 0, {}).grid == grid
    else:
        with pytest.raises(RuntimeError, match=r"^cupy_merge planned a a_kernel launch past CUDA's limits"):
            _plan._launch(_Family, None, {}, grid, block, 0, {})


@pytest.mark.parametrize("extra, vec", [(0, "8"), (4, "4"), (2, "2"), (1, "1")])
def test_two_states_of_an_n_way_merge_take_the_vectors_their_second_states_offset_allows(extra, vec):
    """Two stacked states go to the two-way kernel, the second read at its state offset: a state
    stride of ``extra`` bfloat16 elements past a whole row of packs aligns it to 2 * extra bytes,
    and the vectors narrow to that (wider ones would be misaligned loads)."""
    tokens, heads, head_size = 4, 2, 64
    stride = tokens * heads * head_size + extra
    views = {
        "out": view((tokens, heads, head_size), "bfloat16", ptr=1 << 32),
        "out_lse": view((heads, tokens), "float32", ptr=2 << 32),
        "v": view((2, tokens, heads, head_size), "bfloat16", ptr=3 << 32,
                  strides=(stride, heads * head_size, head_size, 1)),
        "s": view((2, heads, tokens), "float32", ptr=4 << 32),
    }  # fmt: skip
    (launch,) = plan_checked(MERGE_STATES, ManyStateOptions(), views).plan
    assert "merge_two_states" in launch.kernel and template(launch)["VEC"] == vec
