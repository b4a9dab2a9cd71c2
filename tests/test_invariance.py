"""Batch invariance, the planner's part (no GPU): in batch-invariant mode the association order of
a row (how many groups of threads fold its states, the lanes its gradient's sums meet in, which
gradient kernel) is a function of the row alone, whatever the batch, kernel or tuning.

The kernels' part (that they follow that order to the bit) is tests/test_gpu_invariance.py.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from views import arguments, family, plan_checked, template, view

import cupy_merge as cm
from cupy_merge import _catalogue as cat
from cupy_merge import _dispatch, _plan_backward, _tuning
from cupy_merge._operands import BackwardOperands, BackwardOptions, ManyStateOptions
from cupy_merge._ops import (
    MERGE_STATES,
    MERGE_STATES_BACKWARD,
    MERGE_STATES_VARLEN,
    MERGE_STATES_VARLEN_BACKWARD,
)

INVARIANT = _tuning.DEFAULT.replace(batch_invariant=True)
#: Tunings whose plans differ (kernel family, block shapes, splits by busy threads): an invariant
#: row must not notice which one planned it.
TUNINGS = [
    INVARIANT,
    INVARIANT.replace(packed_kernels=False),
    INVARIANT.replace(busy_threads=1 << 30, min_blocks=1 << 20, strided_threads=32),
    INVARIANT.replace(packed_many_threads=512, min_row_threads=4, max_block_threads=1024),
]


def _splits(launch) -> int:
    """How many groups of threads fold each row in ``launch``: each takes every splits-th chunk of
    the row's states, and their partials meet in one tree (both kernels), so this number is the
    row's association order."""
    return launch.block[1] if family(launch) is cat.MANY_PACKED else launch.block[2]


def _canonical(count: int, tuning: _tuning.Tuning) -> int:
    return max(1, min(tuning.invariant_max_splits, -(-count // tuning.invariant_split_states)))


def _many(tokens, states, heads, head_size, dtype="bfloat16", indptr=False, out_dtype=None):
    rows = (states,) if indptr else (states, tokens)
    views = {
        "out": view((tokens, heads, head_size), out_dtype or dtype, ptr=1 << 32),
        "out_lse": view((heads, tokens), "float32", ptr=2 << 32),
        "v": view((*rows, heads, head_size), dtype, ptr=3 << 32),
        "s": view((states, heads) if indptr else (states, heads, tokens), "float32", ptr=4 << 32),
        "indptr": view((tokens + 1,), "int32", ptr=5 << 32) if indptr else None,
    }
    if indptr:
        views["s"] = view((heads, states), "float32", ptr=4 << 32)
    return views


@settings(max_examples=60, deadline=None)
@given(
    states=st.integers(3, 4000),  # past 64 splits: the planner must stay within a block's z
    tokens=st.sampled_from([1, 2, 7, 64, 1000, 20000]),
    heads=st.sampled_from([1, 8, 32]),
    head_size=st.sampled_from([64, 128, 256, 40]),
    tuning=st.sampled_from(TUNINGS),
)
def test_a_dense_row_is_folded_by_as_many_groups_as_its_own_count_asks(
    states, tokens, heads, head_size, tuning
):
    plan = plan_checked(
        MERGE_STATES, ManyStateOptions(), _many(tokens, states, heads, head_size), tuning
    ).plan
    (launch,) = plan
    assert _splits(launch) == _canonical(states, tuning)


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 5000),
    tokens=st.sampled_from([1, 3, 100, 4096]),
    tuning=st.sampled_from(TUNINGS),
)
def test_a_ragged_row_is_folded_by_one_group_whatever_the_batch(total, tokens, tuning):
    """A block cannot give each ragged row the splits its own count asks for without idling most
    of its threads (session 25's sweep: 9 % of the copy at 4096 tokens of ~8 states), so every
    ragged row is folded by one group, in order."""
    plan = plan_checked(MERGE_STATES_VARLEN, ManyStateOptions(), _many(tokens, total, 8, 128, indptr=True), tuning).plan
    (launch,) = plan
    assert _splits(launch) == 1


@pytest.mark.parametrize("group_size", [16, 128, 256])
def test_group_scaled_fp8_rows_keep_their_order_and_whole_groups_a_block(group_size):
    options = ManyStateOptions(out_dtype="float8_e4m3fn", group_size=group_size)
    for tokens in (1, 9, 1000):
        views = _many(tokens, 300, 8, 256, out_dtype="float8_e4m3fn")
        views["output_block_scale"] = view((tokens, 8 * 256 // group_size), "float32", ptr=6 << 32)
        (launch,) = plan_checked(MERGE_STATES, options, views, INVARIANT).plan
        packs_per_group = group_size // 8
        assert launch.block[0] % packs_per_group == 0
        most = min(INVARIANT.invariant_max_splits, INVARIANT.packed_block_limit // max(group_size, 4))
        assert _splits(launch) == min(most, _canonical(300, INVARIANT))
        assert launch.block[0] * launch.block[1] <= INVARIANT.packed_block_limit and launch.block[0] >= 4


@pytest.mark.parametrize("group_size", [64, 128])
def test_group_scaled_fp8_splits_do_not_follow_the_arrays_alignment(group_size):
    """A misaligned output takes narrower packs, so more of them a group: the splits must not change."""
    options = ManyStateOptions(out_dtype="float8_e4m3fn", group_size=group_size)
    splits = set()
    for offset in (0, 4, 2):  # 16-, 4- and 2-byte aligned values
        views = _many(7, 4096, 8, 128)
        views["v"] = view((4096, 7, 8, 128), "bfloat16", ptr=(3 << 32) + offset)
        views["out"] = view((7, 8, 128), "float8_e4m3fn", ptr=1 << 32)
        views["output_block_scale"] = view((7, 8 * 128 // group_size), "float32", ptr=6 << 32)
        (launch,) = plan_checked(MERGE_STATES, options, views, INVARIANT).plan
        assert launch.block[0] * launch.block[1] <= INVARIANT.packed_block_limit
        splits.add(_splits(launch))
    assert splits == {INVARIANT.packed_block_limit // group_size}, splits


def test_outside_the_mode_the_splits_follow_the_batch():
    """What the mode changes: one token of 256 states is split more ways than 20000 tokens are."""
    few = plan_checked(MERGE_STATES, ManyStateOptions(), _many(1, 256, 8, 128), _tuning.DEFAULT).plan[0]
    many = plan_checked(MERGE_STATES, ManyStateOptions(), _many(20000, 256, 8, 128), _tuning.DEFAULT).plan[0]
    assert few.block[1] > many.block[1]


def _backward(tokens, states, head_size=128, ragged=False, merged=True, sinks=False):
    heads = 4
    rows = (states,) if ragged else (states, tokens)
    lse = (heads, states) if ragged else (states, heads, tokens)
    return BackwardOperands(
        None, None,
        view((*rows, heads, head_size), "bfloat16", ptr=1 << 32), view(lse, "float32", ptr=2 << 32),
        view((tokens, heads, head_size), "bfloat16", ptr=3 << 32), view((heads, tokens), "float32", ptr=4 << 32),
        indptr=view((tokens + 1,), "int32", ptr=5 << 32) if ragged else None,
        sinks=view((heads,), "float32", ptr=6 << 32) if sinks else None,
        merged=view((tokens, heads, head_size), "bfloat16", ptr=7 << 32) if merged else None,
        merged_lse=view((heads, tokens), "float32", ptr=8 << 32) if merged else None,
    )  # fmt: skip


def _gradient_way(launch) -> tuple:
    """What a gradient's bits depend on beyond the row: the kernel, packs a lane, lanes a row, and
    (the kernel that folds S itself) the groups and blocks a row's states split over."""
    args, shape = arguments(launch), template(launch)
    own_fold = family(launch) is cat.BACKWARD
    return (family(launch).name, shape["PACKS"], shape["VEC"], args["lanes"],
            launch.block[2] if own_fold else 1, launch.grid[1] if own_fold else 1)  # fmt: skip


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("head_size", [64, 128, 512, 40])
def test_a_gradients_way_through_a_row_does_not_follow_the_batch(ragged, merged, head_size):
    operation = MERGE_STATES_VARLEN_BACKWARD if ragged else MERGE_STATES_BACKWARD
    ways = set()
    for tokens, mean in ((1, 48), (3, 2), (64, 700), (2048, 8), (40000, 48), (5, 5000)):
        states = mean * tokens if ragged else 48  # ragged: batches of other mean rows
        planned = _dispatch.plan_for(
            operation, BackwardOptions(), INVARIANT, _backward(tokens, states, head_size, ragged, merged)
        )
        ways.add(_gradient_way(planned.plan[0]))
    assert len(ways) == 1, ways


@pytest.mark.parametrize("merged", [False, True])
def test_one_token_of_a_batchs_layout_takes_the_batchs_vector_width(merged):
    """A stride of extent 1 is never used, but in batch-invariant mode it still decides the
    gradient's width (its sums follow it): one token sliced from a batch whose token stride is
    odd must not take wider packs than the batch."""
    ways = set()
    for tokens in (1, 64):
        operands = _backward(tokens, 48, merged=merged)
        grad_out = view((tokens, 4, 128), "bfloat16", ptr=3 << 32, strides=(513, 128, 1))
        planned = _dispatch.plan_for(MERGE_STATES_BACKWARD, BackwardOptions(), INVARIANT,
                                     operands._replace(grad_out=grad_out))  # fmt: skip
        ways.add(_gradient_way(planned.plan[0]))
    assert len(ways) == 1, ways


def test_the_sinks_gradient_is_summed_from_the_rows_terms_by_a_last_launch():
    planned = _dispatch.plan_for(MERGE_STATES_BACKWARD, BackwardOptions(), _tuning.DEFAULT,
                                 _backward(64, 16, sinks=True))  # fmt: skip
    *gradients, last = planned.plan
    assert family(last) is cat.SUM_SINK_TERMS
    assert {field for _, field, _ in last.pointers} == {"grad_sinks", _plan_backward.SINK_TERMS}
    assert all(_plan_backward.SINK_TERMS in {field for _, field, _ in launch.pointers} for launch in gradients)
    fresh = {output.field: output for output in planned.fresh}
    assert fresh[_plan_backward.SINK_TERMS].scratch and not fresh[_plan_backward.SINK_TERMS].zeroed  # every row's term written
    assert fresh[_plan_backward.SINK_TERMS].shape == (4 * 64,)
    assert not fresh["grad_sinks"].zeroed  # written whole by the sum


# -- the switch ------------------------------------------------------------------------------------------


def test_the_context_manager_is_per_thread_and_restores_the_mode():
    seen = []
    with cm.batch_invariant():
        assert cm.is_batch_invariant()
        worker = threading.Thread(target=lambda: seen.append(cm.is_batch_invariant()))
        worker.start()
        worker.join()
        with cm.batch_invariant(False):
            assert not cm.is_batch_invariant()
        assert cm.is_batch_invariant()
    assert not cm.is_batch_invariant() and seen == [False]


def test_the_process_wide_switch_keeps_the_calls_prepared_for_each_mode_apart():
    before = _dispatch._calls
    try:
        cm.set_batch_invariant(True)
        assert cm.is_batch_invariant() and _tuning.DEFAULT.batch_invariant
        assert _dispatch._calls is not before  # calls prepared in the other mode are not served
        seen = []
        worker = threading.Thread(target=lambda: seen.append(cm.is_batch_invariant()))
        worker.start()
        worker.join()
        assert seen == [True]
    finally:
        cm.set_batch_invariant(False)
    assert _dispatch._calls is before and not _tuning.DEFAULT.batch_invariant


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_the_switches_take_booleans_alone(bad):
    with pytest.raises(TypeError, match="enabled: expected True or False"):
        cm.set_batch_invariant(bad)
    with pytest.raises(TypeError, match="enabled: expected True or False"), cm.batch_invariant(bad):
        pass
