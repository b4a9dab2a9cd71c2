"""The gradients' launch choices: how the gradient kernels take a merge's rows, and their launches.

As ``_plan`` for the merges (pure, GPU-free, address-free; pointers are slots naming operands),
for the three gradient operations: which of the two gradient kernels (recomputing the merged LSE,
or reading the merge's results), packs a lane, lanes a row, groups and blocks a row's states split
over, and the last launch that sums the sinks' gradients from the rows' terms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _catalogue as cat
from ._arrays import ArraySpec
from ._operands import BackwardOperands, BackwardOptions, StateShape
from ._plan import (
    MAX_GRID_X,
    MAX_GRID_Y,
    KernelLaunch,
    Plan,
    Pointer,
    _launch,
    _lse_strides,
    _pointer,
    _state_spec,
    _used,
    choose_vector_width,
    fast_divisor,
    index_type,
)
from ._tuning import Tuning

#: Threads of a block of the backward kernel (rows of `lanes` threads each).
BACKWARD_THREADS = 128
#: The most groups a row's states split over: a group is at least a warp of the block.
BACKWARD_MAX_GROUPS = BACKWARD_THREADS // 32
#: Blocks a ragged gradient launches at least (when its rows could need them): the rows no token
#: owns are zeroed by a grid-stride loop after the tokens', so a batch of few tokens over many rows
#: (a preallocated buffer) must not leave that to a handful of blocks. About a wave of 8 blocks
#: on 132 multiprocessors; blocks past the tokens' rows go straight to the zeroing.
BACKWARD_ZEROING_BLOCKS = 1024


class BackwardRows(NamedTuple):
    """How the gradient kernel takes a row: ``held`` packs a lane in registers (PACKS; 0: the lanes
    loop over the packs, for rows of more than 64 or none, whose null arrays must not be read),
    ``short`` 2 or 4 for dense rows of exactly 2 or at most 4 states held whole in registers (0:
    longer rows), ``lanes`` threads a row (a power of two up to 32), ``groups`` of threads of a
    block its states are split over (1, 2 or 4), a chunk of states at a time each, and ``splits``
    blocks that take a share of the row's states each (recomputing S: then a finishing launch
    writes the LSE gradients; given the merge's results, none)."""

    held: int
    short: int
    lanes: int
    groups: int = 1
    splits: int = 1


def backward_rows(packs: int, rows: int, row_states: int, ragged: bool, tuning: Tuning) -> BackwardRows:
    """The gradient kernel's way through ``rows`` (token, head) pairs of ``packs`` packs and
    ``row_states`` states each (ragged: the mean, rounded up).

    Rows that are not short split their states over as many groups, and then blocks, as keep the
    threads at most ``tuning.backward_busy_threads``, each group at least
    ``tuning.backward_split_chunks`` chunks of a split's share; long dense rows over groups of
    ``tuning.backward_group_chunks`` chunks or more, however many rows; they take two packs a lane where
    that many threads are still reached, or where rows alone are ``tuning.backward_two_pack_rows``
    or more."""
    if packs == 0:
        return BackwardRows(0, 0, 1)
    if not ragged and 1 <= row_states <= 4 and packs <= 32:
        return BackwardRows(1, 2 if row_states == 2 else 4, _lanes(packs, 1))
    if tuning.batch_invariant:  # a row's sums follow its packs alone: one group, one block a row
        return _invariant_rows(packs)
    held = 0 if packs > 64 else 2 if packs > 32 else 1
    if held == 1 and packs > 1:
        lanes, chunks = _lanes(packs, 2), -(-row_states // _span(2, ragged, tuning))
        busy = rows * lanes * min(chunks, tuning.backward_groups, BACKWARD_MAX_GROUPS)
        held = 2 if rows >= tuning.backward_two_pack_rows or busy >= tuning.backward_busy_threads else 1
    lanes = _lanes(packs, held) if held else 32
    chunks = -(-row_states // _span(held, ragged, tuning))
    busy = tuning.backward_busy_threads
    most_groups = min(chunks, tuning.backward_groups, BACKWARD_MAX_GROUPS)
    groups = _halvings(rows * lanes, most_groups, busy)
    if held and not ragged and tuning.backward_group_chunks:  # long rows: groups of that many chunks, however many rows
        groups = max(groups, _power_of_two_up_to(min(most_groups, chunks // tuning.backward_group_chunks)))
    most = min(chunks // (groups * tuning.backward_split_chunks), MAX_GRID_Y)
    splits = _halvings(rows * lanes * groups, most, busy) if most >= 2 else 1
    return BackwardRows(held, 0, lanes, groups, splits)


def _invariant_rows(packs: int) -> BackwardRows:
    """A batch-invariant gradient's way through rows of ``packs`` packs: the many-rows choice of
    packs a lane (two where a row has more than one), whatever the number of rows, so that the
    lanes a row's sums over its packs meet in are the row's own (one group: its states' sums
    in one order)."""
    held = 0 if packs > 64 else 2 if packs > 1 else 1
    return BackwardRows(held, 0, _lanes(packs, held) if held else 32)


def _lanes(packs: int, held: int) -> int:
    """Lanes a row of ``packs`` packs takes at ``held`` a lane: a power of two up to 32."""
    return min(32, 1 << (-(-packs // held) - 1).bit_length())


def _span(held: int, ragged: bool, tuning: Tuning) -> int:
    """States a group takes at a time: the kernel's kChunk (one state where lanes loop over packs)."""
    return 1 if held == 0 else 2 if ragged and held == 2 else tuning.merge_chunk


def _power_of_two_up_to(most: int) -> int:
    """The largest power of two up to ``most`` (at least 1)."""
    return 1 << (max(most, 1).bit_length() - 1)


def _halvings(threads: int, most: int, busy: int) -> int:
    """The largest power of two up to ``most`` that keeps ``threads`` times it within ``busy``
    threads (at least 1): how many ways work of ``threads`` threads is split."""
    return _power_of_two_up_to(min(most, busy // threads) if threads else most)


def backward_from_output_rows(packs: int, rows: int, row_states: int, ragged: bool, tuning: Tuning) -> BackwardRows:
    """The way through ``rows`` rows of ``packs`` packs and ``row_states`` states (ragged: the
    mean) of the gradient given the merge's results: ``held`` packs a lane (two from
    ``tuning.backward_from_output_two_pack_rows`` rows, where a row has more than one; 0 for
    rows of none or of more than 64), one group, and as many blocks a row (a share of its
    chunks each, no finishing launch) as keep the threads within ``tuning.backward_busy_threads``
    (ragged: ``backward_from_output_ragged_busy_threads``)."""
    if packs == 0:
        return BackwardRows(0, 0, 1)
    # Batch-invariant: the packs a lane (its sums' order) never follow the rows; the blocks a row
    # may (a state's sums are its own in this kernel).
    two = packs > 32 or (packs > 1 and (tuning.batch_invariant or rows >= tuning.backward_from_output_two_pack_rows))
    held = 0 if packs > 64 else 2 if two else 1
    lanes = _lanes(packs, held) if held else 32
    # Held chunks' states: staged dense chunks are smaller (backward_given_chunk), so the splits
    # stay within the chunks either way.
    chunks = -(-row_states // (tuning.merge_chunk if held else 1))
    busy = tuning.backward_from_output_ragged_busy_threads if ragged else tuning.backward_busy_threads
    return BackwardRows(held, 0, lanes, 1, _halvings(rows * lanes, min(chunks, MAX_GRID_Y), busy))


def plan_backward(
    state: StateShape, num_states: int, specs: BackwardOperands, options: BackwardOptions, tuning: Tuning
) -> Plan:
    """The launch of a merge's gradient: a row of ``lanes`` threads (a power of two up to 32) per
    (token, head), over its states; the gradients written are C-contiguous (allocated by the call).

    Given the merge's results (``merged``, ``merged_lse``), fewer than
    ``tuning.backward_from_output_rows`` rows of at least ``tuning.backward_from_output_states``
    states take the kernel that reads them (one launch: each state's gradients its own, a row's
    states split over any number of blocks, none of which folds the row's LSEs)."""
    num_tokens, num_heads, head_size = state.num_tokens, state.num_heads, state.head_size
    v, grad_out = specs.v, specs.grad_out
    two_way, ragged = specs.v_b is not None, specs.indptr is not None
    # A ragged batch's rows no token owns are zeroed by the kernel, even with no tokens.
    if num_heads == 0 or (num_tokens == 0 and not (ragged and num_states > 0)):
        return ()
    rows = num_tokens * num_heads
    # Ragged: the mean (counting rows no token owns); no tokens: nothing to split.
    row_states = (-(-num_states // num_tokens) if num_tokens else 0) if ragged else num_states
    long_rows = row_states >= tuning.backward_from_output_states
    if tuning.batch_invariant:  # by the rows' states alone (a ragged batch's mean follows the batch)
        from_output = ragged or long_rows
    else:
        from_output = long_rows and rows < tuning.backward_from_output_rows
    from_output = from_output and specs.merged is not None
    source = cat.BACKWARD_FROM_OUTPUT_SOURCE if from_output else cat.BACKWARD_SOURCE
    module = cat.Module(source, state.dtype, grad_out.dtype, specs.sinks is not None, tuning.compile_options)
    values = [v, grad_out, specs.grad_v] + ([specs.v_b, specs.grad_v_b] if two_way else [])
    if not two_way:  # the dense stack's (or ragged batch's) second state is one stride on
        values += [_state_spec(v, 1), _state_spec(specs.grad_v, 1)]
    if from_output:
        values.append(specs.merged)
    given = [spec for spec in values if spec is not None]
    widths = cat.vector_widths(state.dtype, grad_out.dtype)
    vec = choose_vector_width(given, head_size, widths, every_stride=tuning.batch_invariant)
    rows_of = backward_from_output_rows if from_output else backward_rows
    held, short, lanes, groups, splits = rows_of(head_size // vec, rows, row_states, ragged, tuning)
    rows_y = BACKWARD_THREADS // (lanes * groups)
    block = (lanes, rows_y, groups)
    token_blocks = -(-rows // rows_y)
    # Rows no ragged token owns may be any of the batch's: the launch that zeroes them takes blocks
    # enough for them too (a split plan's finishing launch; the launch given the results when it
    # does not split: split, every block of its splits takes a share of them).
    zeroing_blocks = token_blocks
    if ragged:
        zeroing_blocks = max(token_blocks, _zeroing_blocks(num_states * num_heads, rows_y * groups))
    args: dict[str, Any] = {
        "gv0": Pointer("grad_v"), "gs0": Pointer("grad_s"), "v0": Pointer("v"), "s0": Pointer("s"),
        "grad_out": Pointer("grad_out"), "grad_lse": _pointer(specs, "grad_lse"),
        "sinks": _pointer(specs, "sinks"), "sink_terms": Pointer(SINK_TERMS) if specs.sinks is not None else 0,
        "indptr": _pointer(specs, "indptr"), "indptr_bytes": specs.indptr.itemsize if ragged else 8,
        "indptr_stride": specs.indptr.strides[0] if ragged else 0,
        "num_states": num_states, "num_tokens": num_tokens, "num_heads": num_heads, "head_size": head_size,
        "grad_out_stride_token": grad_out.strides[0], "grad_out_stride_head": grad_out.strides[1],
        **_lse_strides("grad_lse", specs.grad_lse), "sinks_stride": _used(specs.sinks, 0),
        "lanes": lanes, "lse_base_2": options.lse_base_2,
    }  # fmt: skip
    for array, first, rest in (("v", "v", "v_b"), ("gv", "grad_v", "grad_v_b"), ("s", "s", "s_b"),
                               ("gs", "grad_s", "grad_s_b")):  # fmt: skip
        lse = array in ("s", "gs")
        head_first, head_rest, token_first, token_rest, step = _backward_strides(
            getattr(specs, first), getattr(specs, rest), two_way, ragged, lse
        )
        second = Pointer(rest) if two_way else Pointer(first, step * getattr(specs, first).itemsize)
        args.update({
            f"{array}1": second, f"{array}_stride_state": step,
            f"{array}0_stride_head": head_first, f"{array}1_stride_head": head_rest,
            f"{array}0_stride_token": token_first, f"{array}1_stride_token": token_rest,
        })  # fmt: skip
    index = index_type(
        [v, specs.s, specs.grad_v, specs.grad_s, specs.v_b, specs.s_b, specs.grad_v_b, specs.grad_s_b, grad_out,
         specs.grad_lse] + ([specs.merged, specs.merged_lse] if from_output else []),
        rows,
        num_states,
    )  # fmt: skip
    if index == "int":  # the 32-bit kernels' token = row / heads
        head = fast_divisor(num_heads)
        args.update({"head_multiplier": head.multiplier, "head_shift": head.shift})
    else:
        args.update({"head_multiplier": 0, "head_shift": 0})
    template = {"TIn": state.dtype, "TOut": grad_out.dtype, "VEC": vec, "PACKS": held, "RAGGED": ragged,
                "SINKS": specs.sinks is not None, "Index": index}  # fmt: skip
    if from_output:
        merged = specs.merged
        args.update({
            "out": Pointer("merged"), "out_lse": Pointer("merged_lse"),
            "out_stride_token": merged.strides[0], "out_stride_head": merged.strides[1],
            **_lse_strides("out_lse", specs.merged_lse),
        })  # fmt: skip
        grid = (_grid_x(zeroing_blocks if splits == 1 else token_blocks), splits, 1)
        launch = _launch(cat.BACKWARD_FROM_OUTPUT, module, template, grid, block, 0, args)
        return (launch, *_sum_sinks(specs, state, module))
    template["SHORT"] = short
    if splits == 1:
        whole = _launch(cat.BACKWARD, module, template, (_grid_x(zeroing_blocks), 1, 1), block, 0, {**args, "finish": 0})
        return (whole, *_sum_sinks(specs, state, module))
    split = _launch(cat.BACKWARD, module, template, (_grid_x(token_blocks), splits, 1), block, 0, {**args, "finish": 0})
    # The finishing launch, over the rows' LSEs and LSE gradients only: the same block shape (its
    # groups fold the merged LSE as the split launch's did, to the bit).
    finish = _launch(cat.BACKWARD, module, template, (_grid_x(zeroing_blocks), 1, 1), block, 0, {**args, "finish": 1})
    return (split, finish, *_sum_sinks(specs, state, module))


#: The gradient kernels' scratch: each row's term of its sink's gradient, ``[heads, tokens]``
#: float32 (every row's written: a ragged token of bad offsets adds 0).
SINK_TERMS = "sink_terms"


def _sum_sinks(specs: BackwardOperands, state: StateShape, module: cat.Module) -> tuple[KernelLaunch, ...]:
    """The launch that adds the rows' sink terms into the sinks' gradients, in a fixed order."""
    if specs.sinks is None:
        return ()
    args = {"grad_sinks": Pointer("grad_sinks"), "sink_terms": Pointer(SINK_TERMS),
            "num_tokens": state.num_tokens, "num_heads": state.num_heads}  # fmt: skip
    grid = (_grid_x(state.num_heads), 1, 1)
    threads = cat.SINK_SUM_THREADS
    return (_launch(cat.SUM_SINK_TERMS, module, {"THREADS": threads}, grid, (threads, 1, 1), 0, args),)


def _grid_x(blocks: int) -> int:
    """A grid's first dimension for ``blocks`` blocks: at least 1, at most CUDA's limit."""
    return max(1, min(blocks, MAX_GRID_X))


def _zeroing_blocks(rows: int, thread_rows: int) -> int:
    """Blocks enough to zero ``rows`` rows of values (a batch's rows times its heads) at
    ``thread_rows`` rows of threads a block, up to BACKWARD_ZEROING_BLOCKS."""
    return min(-(-rows // thread_rows), BACKWARD_ZEROING_BLOCKS)


def _backward_strides(first: ArraySpec, rest: ArraySpec | None, two_way: bool, ragged: bool, lse: bool):
    """(head, head, token, token, state) strides of a state array's first and later states: values
    ``[..., tokens, heads, D]`` (two-way ``[T, H, D]`` each), LSEs ``[..., heads, tokens]``."""
    if two_way:
        assert rest is not None
        head, token = (0, 1) if lse else (1, 0)
        return first.strides[head], rest.strides[head], first.strides[token], rest.strides[token], 0
    if ragged:  # values [rows, H, D], LSE [H, rows]: a row is a state, no token stride
        head_stride, state_stride = (first.strides[0], first.strides[1]) if lse else (first.strides[1], first.strides[0])
        return head_stride, head_stride, 0, 0, state_stride
    head, token = (1, 2) if lse else (2, 1)  # dense: [S, H, T] or [S, T, H, D]
    return first.strides[head], first.strides[head], first.strides[token], first.strides[token], first.strides[0]
