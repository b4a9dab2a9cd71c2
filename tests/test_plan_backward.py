"""The gradient kernel's plans on ArrayViews: which rows are short, lanes, offsets. No GPU needed."""

from __future__ import annotations

import pytest
from views import arguments, template, view

from cupy_merge import _catalogue as cat
from cupy_merge import _dispatch, _plan, _plan_backward, _tuning
from cupy_merge._operands import BackwardOperands, BackwardOptions
from cupy_merge._ops import MERGE_STATE_BACKWARD, MERGE_STATES_BACKWARD, MERGE_STATES_VARLEN_BACKWARD

TOKENS, HEADS = 5, 3


def _plan_of(operation, operands, tuning=_tuning.DEFAULT):
    """The plan's gradient launch (the first: a split plan's finishing launch follows it)."""
    planned = _dispatch.plan_for(operation, BackwardOptions(), tuning, operands)
    assert len(planned.plan) in (1, 2)
    for launch in planned.plan:
        assert launch.kernel in cat.module_instances(launch.module), launch.kernel
    return planned.plan[0]


def _dense(states, head_size=128, dtype="bfloat16", grad_out=None):
    return BackwardOperands(
        None, None,
        view((states, TOKENS, HEADS, head_size), dtype, ptr=1 << 32),
        view((states, HEADS, TOKENS), "float32", ptr=2 << 32),
        grad_out or view((TOKENS, HEADS, head_size), dtype, ptr=3 << 32),
        view((HEADS, TOKENS), "float32", ptr=4 << 32),
    )  # fmt: skip


def _two_way(head_size=128):
    return BackwardOperands(
        None, None,
        view((TOKENS, HEADS, head_size), "bfloat16", ptr=1 << 32), view((HEADS, TOKENS), "float32", ptr=2 << 32),
        view((TOKENS, HEADS, head_size), "bfloat16", ptr=3 << 32), None,
        view((TOKENS, HEADS, head_size), "bfloat16", ptr=5 << 32), view((HEADS, TOKENS), "float32", ptr=6 << 32),
    )  # fmt: skip


def _ragged(rows, tokens=TOKENS):
    """A ragged batch of ``tokens`` over ``rows`` rows of 64 bfloat16 values."""
    return BackwardOperands(
        None, None,
        view((rows, HEADS, 64), "bfloat16", ptr=1 << 32), view((HEADS, rows), "float32", ptr=2 << 32),
        view((tokens, HEADS, 64), "bfloat16", ptr=3 << 32), None,
        indptr=view((tokens + 1,), "int32", ptr=4 << 32),
    )  # fmt: skip


def test_a_two_way_gradient_takes_the_two_state_short_rows():
    launch = _plan_of(MERGE_STATE_BACKWARD, _two_way())
    assert template(launch)["SHORT"] == "2" and template(launch)["PACKS"] == "1"
    assert launch.block == (16, _plan_backward.BACKWARD_THREADS // 16, 1)  # 16 packs of 8 a row


@pytest.mark.parametrize("states, short", [(1, "4"), (2, "2"), (3, "4"), (4, "4"), (5, "0"), (64, "0")])
def test_dense_rows_of_at_most_four_states_are_short(states, short):
    assert template(_plan_of(MERGE_STATES_BACKWARD, _dense(states)))["SHORT"] == short


def test_rows_of_more_packs_than_lanes_are_not_short():
    launch = _plan_of(MERGE_STATES_BACKWARD, _dense(2, head_size=512, dtype="float32"))  # 128 packs of 4
    assert template(launch)["PACKS"] == "0" and template(launch)["SHORT"] == "0"
    assert launch.block == (32, _plan_backward.BACKWARD_THREADS // 64, 2)  # its two states over two groups


def test_ragged_rows_are_never_short():
    launch = _plan_of(MERGE_STATES_VARLEN_BACKWARD, _ragged(7))
    assert template(launch)["RAGGED"] == "true" and template(launch)["SHORT"] == "0"


def test_the_32_bit_kernels_divide_rows_by_heads_with_the_hosts_multiplier():
    args = arguments(_plan_of(MERGE_STATES_BACKWARD, _dense(3)))
    divisor = _plan.fast_divisor(HEADS)
    assert (args["head_multiplier"], args["head_shift"]) == (divisor.multiplier, divisor.shift)
    assert all(_plan.fast_divide(row, divisor) == row // HEADS for row in range(TOKENS * HEADS))


def test_a_huge_incoming_gradient_alone_takes_64_bit_offsets():
    """dV's and dS's offsets are computed in Index too: their extent counts."""
    assert template(_plan_of(MERGE_STATES_BACKWARD, _dense(3)))["Index"] == "int"
    huge = view((TOKENS, HEADS, 128), "bfloat16", ptr=3 << 32, strides=(cat.INDEX_32_LIMIT, 128, 1))
    assert template(_plan_of(MERGE_STATES_BACKWARD, _dense(3, grad_out=huge)))["Index"] == "long long"


def test_rows_of_no_values_take_the_path_that_loads_only_packs_that_exist():
    """head_size 0: V is a null pointer, and one pack a lane would load a pack of it anyway."""
    launch = _plan_of(MERGE_STATES_BACKWARD, _dense(3, head_size=0))
    assert template(launch)["PACKS"] == "0" and template(launch)["SHORT"] == "0"
    launch = _plan_of(MERGE_STATE_BACKWARD, _two_way(head_size=0))
    assert template(launch)["PACKS"] == "0"


def test_64_bit_kernels_get_no_divisor():
    huge = view((TOKENS, HEADS, 128), "bfloat16", ptr=3 << 32, strides=(cat.INDEX_32_LIMIT, 128, 1))
    args = arguments(_plan_of(MERGE_STATES_BACKWARD, _dense(3, grad_out=huge)))
    assert (args["head_multiplier"], args["head_shift"]) == (0, 0)


TWO_PACK_ROWS = _tuning.DEFAULT.backward_two_pack_rows


@pytest.mark.parametrize("packs, rows, states, ragged, want", [
    (16, 256, 16, False, (1, 0, 16)),  # few rows: one pack a lane, for more threads
    (16, 2048, 16, False, (2, 0, 8)),  # two packs, four groups of threads: rows enough
    (16, 2048, 5, False, (1, 0, 16)),  # two chunks of states allow two groups only
    (16, TWO_PACK_ROWS, 16, False, (2, 0, 8)),
    (16, TWO_PACK_ROWS, 8, True, (2, 0, 8)),
    (16, 1 << 20, 2, False, (1, 2, 16)),  # short rows stay one pack a lane
    (24, 1 << 20, 9, False, (2, 0, 16)),
    (64, 10, 2, False, (2, 0, 32)),  # more packs than lanes: two a lane, never short
    (65, 10, 2, False, (0, 0, 32)),
    (0, 10, 2, False, (0, 0, 1)),
])  # fmt: skip
def test_rows_of_many_states_take_two_packs_a_lane_when_there_are_threads_enough(packs, rows, states, ragged, want):
    assert _plan_backward.backward_rows(packs, rows, states, ragged, _tuning.DEFAULT)[:3] == want


@pytest.mark.parametrize("packs, rows, states, ragged, held, groups", [
    (16, 1024, 2, False, 1, 1),  # short rows: one group
    (16, 2048, 16, False, 2, 4),  # 2048 rows x 8 lanes x 4 groups: busy_threads
    (16, 2048, 5, False, 1, 2),  # two chunks of 4 states
    (16, 4096, 16, False, 2, 2),
    (16, 1 << 20, 1000, False, 2, 4),  # rows enough alone, but long: groups of three chunks or more
    (16, 16384, 48, False, 2, 4),
    (16, 16384, 24, False, 2, 2),
    (16, 32768, 16, False, 2, 1),  # four chunks: groups of two measured no faster
    (16, 131072, 8, False, 2, 1),
    (16, 1 << 20, 1000, True, 2, 1),  # ragged rows keep one group where rows are enough
    (16, 2048, 8, True, 2, 4),  # ragged rows of two packs take chunks of 2
    (16, 2048, 3, True, 1, 1),
    (100, 64, 9, False, 0, 4),  # rows that loop over their packs split state by state
    (100, 4096, 9, False, 0, 1),
])  # fmt: skip
def test_few_rows_of_many_chunks_split_their_states_over_groups(packs, rows, states, ragged, held, groups):
    got = _plan_backward.backward_rows(packs, rows, states, ragged, _tuning.DEFAULT)
    assert (got.held, got.groups) == (held, groups)
    assert got.lanes * groups <= _plan_backward.BACKWARD_THREADS
    assert _plan_backward.backward_rows(packs, rows, states, ragged, _tuning.DEFAULT.replace(backward_groups=1)).groups == 1


@pytest.mark.parametrize("rows, states, groups", [(2048, 16, 4), (1 << 20, 1000, 1), (16384, 48, 1), (131072, 8, 1)])
def test_without_group_chunks_only_rows_too_few_for_the_gpu_split_over_groups(rows, states, groups):
    tuning = _tuning.DEFAULT.replace(backward_group_chunks=0)
    assert _plan_backward.backward_rows(16, rows, states, False, tuning).groups == groups


def test_groups_share_the_blocks_threads():
    launch = _plan_of(MERGE_STATES_BACKWARD, _dense(16))
    lanes, rows_y, groups = launch.block
    assert groups == 4 and lanes * rows_y * groups == _plan_backward.BACKWARD_THREADS
    assert launch.grid[0] == -(-TOKENS * HEADS // rows_y)


def test_a_ragged_batch_of_no_tokens_still_launches_to_zero_its_rows():
    launch = _plan_of(MERGE_STATES_VARLEN_BACKWARD, _ragged(7, tokens=0))
    assert launch.grid[0] >= 1 and arguments(launch)["num_tokens"] == 0


@pytest.mark.parametrize("tokens, rows", [(2, 300_000), (64, 523), (4096, 33_000)])
def test_a_ragged_gradient_has_blocks_enough_to_zero_the_rows_no_token_owns(tokens, rows):
    """Rows no token owns are zeroed by a grid-stride loop: few tokens over many rows still get
    up to BACKWARD_ZEROING_BLOCKS blocks; batches of many tokens keep their tokens' grid. A split
    plan (2 tokens of a mean of 150000 rows) zeroes in its finishing launch, and its split launch
    keeps the tokens' grid."""
    planned = _dispatch.plan_for(MERGE_STATES_VARLEN_BACKWARD, BackwardOptions(), _tuning.DEFAULT,
                                 _ragged(rows, tokens))  # fmt: skip
    zeroing = planned.plan[-1]
    _, rows_y, groups = zeroing.block  # the zeroing runs over every group's rows of threads
    tokens_blocks = -(-tokens * HEADS // rows_y)
    zeroing_blocks = min(-(-rows * HEADS // (rows_y * groups)), _plan_backward.BACKWARD_ZEROING_BLOCKS)
    assert zeroing.grid[0] == max(tokens_blocks, zeroing_blocks)
    if len(planned.plan) == 2:
        split = planned.plan[0]
        assert split.grid[1] > 1 and split.grid[0] == -(-tokens * HEADS // split.block[1])


def test_every_row_kind_the_planner_chooses_is_instantiated():
    kinds = set()
    for packs in range(70):
        for rows in (1, TWO_PACK_ROWS - 1, TWO_PACK_ROWS):
            for states in (0, 1, 2, 3, 4, 5, 64):
                for ragged in (False, True):
                    held, short, lanes, groups, _ = _plan_backward.backward_rows(packs, rows, states, ragged, _tuning.DEFAULT)
                    assert packs <= max(held, 1) * lanes or held == 0, (packs, held, lanes)
                    assert groups == 1 or not short, (states, groups)
                    kinds.add((held, short, ragged))
    assert kinds == set(cat.BACKWARD_ROW_KINDS)


def test_rows_too_few_for_groups_alone_split_their_states_over_blocks_then_finish():
    """1024 states of one token, 32 heads: four groups give 2048 threads, so the states split over
    32 blocks a row (a share of 32 states each), and a second launch finishes."""
    operands = BackwardOperands(
        None, None,
        view((1024, 1, 32, 128), "bfloat16", ptr=1 << 32), view((1024, 32, 1), "float32", ptr=2 << 32),
        view((1, 32, 128), "bfloat16", ptr=3 << 32), view((32, 1), "float32", ptr=4 << 32),
    )  # fmt: skip
    planned = _dispatch.plan_for(MERGE_STATES_BACKWARD, BackwardOptions(), _tuning.DEFAULT, operands)
    main, finish = planned.plan
    assert main.block == (16, 2, 4) and main.grid == (16, 32, 1)
    # The same block shape (its groups fold the merged LSE as the split launch's, to the bit).
    assert finish.kernel == main.kernel and finish.block == main.block and finish.grid == (16, 1, 1)
    assert (arguments(main)["finish"], arguments(finish)["finish"]) == (0, 1)
    unsplit = _tuning.DEFAULT.replace(backward_split_chunks=10**6)
    (launch,) = _dispatch.plan_for(MERGE_STATES_BACKWARD, BackwardOptions(), unsplit, operands).plan
    assert launch.grid[1] == 1


@pytest.mark.parametrize("rows, states, ragged, splits", [
    (32, 1024, False, 32),
    (32 * 8, 256, False, 4),
    (2048, 16, False, 1),  # groups fill the GPU alone
    (64 * 32, 100, True, 1),  # ragged: the mean's chunks
    (32, 100, True, 2),  # 25 chunks: a share of at least two a group
])  # fmt: skip
def test_splits_keep_the_threads_within_busy_threads(rows, states, ragged, splits):
    got = _plan_backward.backward_rows(16, rows, states, ragged, _tuning.DEFAULT)
    assert got.splits == splits
    assert rows * got.lanes * got.groups * got.splits <= max(_tuning.DEFAULT.backward_busy_threads, rows * got.lanes)


def test_no_tokens_over_a_large_buffer_do_not_split():
    """A ragged batch of no tokens has no states to split: one launch, its zeroing grid."""
    (launch,) = _dispatch.plan_for(MERGE_STATES_VARLEN_BACKWARD, BackwardOptions(), _tuning.DEFAULT,
                                   _ragged(100_000, tokens=0)).plan  # fmt: skip
    assert launch.grid == (_plan_backward.BACKWARD_ZEROING_BLOCKS, 1, 1)


def _with_results(operands, head_size=128, dtype="bfloat16", tokens=TOKENS):
    """``operands`` given the merge's results too (``merged``, ``merged_lse``)."""
    return operands._replace(merged=view((tokens, HEADS, head_size), dtype, ptr=8 << 32),
                             merged_lse=view((HEADS, tokens), "float32", ptr=9 << 32))  # fmt: skip


FROM_OUTPUT_STATES = _tuning.DEFAULT.backward_from_output_states


def _reads_the_results(launch):
    family = cat.BACKWARD_FROM_OUTPUT
    return launch.kernel.startswith(f"cupy_merge::{family.name}<") and launch.module.source == family.source


@pytest.mark.parametrize("states, given", [(2, False), (FROM_OUTPUT_STATES - 1, False), (FROM_OUTPUT_STATES, True),
                                           (1000, True)])  # fmt: skip
def test_few_rows_of_many_states_take_the_kernel_given_the_merges_results(states, given):
    assert _reads_the_results(_plan_of(MERGE_STATES_BACKWARD, _with_results(_dense(states)))) == given
    assert not _reads_the_results(_plan_of(MERGE_STATES_BACKWARD, _dense(states)))


def test_rows_enough_recompute_the_merged_lse_even_given_it():
    def stack(tokens):
        return _with_results(BackwardOperands(
            None, None,
            view((64, tokens, HEADS, 128), "bfloat16", ptr=1 << 32), view((64, HEADS, tokens), "float32", ptr=2 << 32),
            view((tokens, HEADS, 128), "bfloat16", ptr=3 << 32),
        ), tokens=tokens)  # fmt: skip

    tokens = -(-_tuning.DEFAULT.backward_from_output_rows // HEADS)
    assert not _reads_the_results(_plan_of(MERGE_STATES_BACKWARD, stack(tokens)))
    assert _reads_the_results(_plan_of(MERGE_STATES_BACKWARD, stack(tokens - 1)))


def test_a_two_way_gradient_given_its_results_still_recomputes_them_but_can_be_told_not_to():
    assert not _reads_the_results(_plan_of(MERGE_STATE_BACKWARD, _with_results(_two_way())))
    every = _tuning.DEFAULT.replace(backward_from_output_states=2)
    launch = _plan_of(MERGE_STATE_BACKWARD, _with_results(_two_way()), every)
    assert _reads_the_results(launch)
    args = arguments(launch)
    assert (args["out_stride_token"], args["out_stride_head"]) == (HEADS * 128, 128)


def test_a_ragged_batch_given_its_results_takes_one_launch_that_also_zeroes_the_rows_no_token_owns():
    planned = _dispatch.plan_for(MERGE_STATES_VARLEN_BACKWARD, BackwardOptions(),
                                 _tuning.DEFAULT.replace(backward_from_output_states=2),
                                 _with_results(_ragged(4000, tokens=1000), head_size=64, tokens=1000))  # fmt: skip
    (launch,) = planned.plan
    assert template(launch)["RAGGED"] == "true" and _reads_the_results(launch)
    assert launch.grid[1] == 1  # 4 states a token, rows enough: one block a row
    assert launch.grid[0] > -(-1000 * HEADS // launch.block[1])  # blocks for every row of the batch


@pytest.mark.parametrize("packs, rows, states, ragged, want", [
    (16, 32, 1024, False, (1, 16, 128)),  # few rows of many states: a block a chunk of 4 (256 chunks, busy at 128)
    (16, 32, 1024, True, (1, 16, 256)),  # ragged: twice the threads
    (16, 1 << 16, 16, False, (1, 16, 1)),  # rows enough: one block a row
    (33, 10, 9, False, (2, 32, 2)),  # more packs than lanes: two a lane; 3 chunks, split in powers of two
    (100, 10, 9, False, (0, 32, 8)),  # lanes that loop over packs split state by state
    (0, 10, 9, False, (0, 1, 1)),
])  # fmt: skip
def test_the_kernel_given_the_results_splits_few_rows_over_blocks(packs, rows, states, ragged, want):
    got = _plan_backward.backward_from_output_rows(packs, rows, states, ragged, _tuning.DEFAULT.replace(
        backward_from_output_two_pack_rows=2**62))  # fmt: skip
    assert (got.held, got.lanes, got.splits) == want


def test_the_merges_results_come_both_or_neither_and_as_the_merge_returned_them():
    operands = _with_results(_dense(5))
    for missing in ("merged", "merged_lse"):
        with pytest.raises(ValueError, match="^out(_lse)?: expected it with out"):
            _plan_of(MERGE_STATES_BACKWARD, operands._replace(**{missing: None}))
    with pytest.raises(TypeError, match=r"^out: expected the dtype of grad_v \(bfloat16\)"):
        _plan_of(MERGE_STATES_BACKWARD, operands._replace(merged=view((TOKENS, HEADS, 128), "float32", ptr=8 << 32)))
    with pytest.raises(ValueError, match="^out: expected shape"):
        _plan_of(MERGE_STATES_BACKWARD, operands._replace(merged=view((TOKENS, HEADS, 64), "bfloat16", ptr=8 << 32)))
    with pytest.raises(ValueError, match="^out_lse: expected shape"):
        _plan_of(MERGE_STATES_BACKWARD, operands._replace(merged_lse=view((TOKENS, HEADS), "float32", ptr=9 << 32)))


@pytest.mark.parametrize("states", [3, 12])
def test_dense_states_are_stepped_by_their_state_stride(states):
    """A state's values and LSE follow the previous one's by the state stride of their arrays
    ([S, T, H, D] and [S, H, T]); the gradients', written like them, by theirs. Strided views:
    each stride is its own number."""
    v = view((states, TOKENS, HEADS, 64), "bfloat16", ptr=1 << 32, strides=(5 * TOKENS * HEADS * 64, HEADS * 64, 64, 1))
    s = view((states, HEADS, TOKENS), "float32", ptr=2 << 32, strides=(3 * HEADS * TOKENS, TOKENS, 1))
    operands = _dense(states, head_size=64)._replace(v=v, s=s)
    args = arguments(_plan_of(MERGE_STATES_BACKWARD, operands))
    assert args["v_stride_state"] == 5 * TOKENS * HEADS * 64 and args["s_stride_state"] == 3 * HEADS * TOKENS
    assert args["v0_stride_token"] == HEADS * 64 and args["v0_stride_head"] == 64
    assert args["s0_stride_head"] == TOKENS and args["s0_stride_token"] == 1
    assert args["gv_stride_state"] == TOKENS * HEADS * 64 and args["gs_stride_state"] == HEADS * TOKENS


@pytest.mark.parametrize(
    "field, bad, error, words",
    [
        ("grad_out", {"dtype": "int32"}, TypeError, r"^grad_v: expected dtype float32, float16 or bfloat16, got int32"),
        ("grad_out", {"device": 1}, ValueError, r"^grad_v: expected an array on device 0 \(where v is\)"),
        ("grad_out", {"offset": 1}, ValueError, r"^grad_v: expected an address aligned to its 2-byte elements"),
        ("grad_lse", {"device": 1}, ValueError, r"^grad_s: expected an array on device 0 \(where v is\)"),
        ("grad_lse", {"shape": (HEADS, TOKENS, 1)}, ValueError, r"^grad_s: expected a 2-D array \[num_heads, num_tokens\]"),
        ("grad_lse", {"offset": 2}, ValueError, r"^grad_s: expected an address aligned to its 4-byte elements"),
        ("grad_lse", {"dtype": "float16"}, TypeError, r"^grad_s: expected a float32 log-sum-exp, got dtype float16"),
    ],
)  # fmt: skip
def test_a_bad_incoming_gradient_is_refused_by_its_name(field, bad, error, words):
    base = _dense(3, head_size=64)
    good = getattr(base, field)
    shape = bad.get("shape", good.shape)
    strides = None if "shape" in bad else good.strides
    replaced = view(shape, bad.get("dtype", good.dtype), ptr=good.ptr + bad.get("offset", 0), strides=strides,
                    device=bad.get("device", 0))  # fmt: skip
    with pytest.raises(error, match=words):
        _plan_of(MERGE_STATES_BACKWARD, base._replace(**{field: replaced}))
