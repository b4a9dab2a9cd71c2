"""The kernels' tuning as one frozen value: family switches, block sizes, chunk and compile options.

Every number here was chosen by a measurement on an H200 (benchmarks/PERF.md names
each). The planner reads them from the :class:`Tuning` it is given, the
compiled modules carry its compile options, and every cache is keyed by it, so
a sweep or a test runs another tuning with :func:`use` and leaves nothing of
it behind::

    with _tuning.use(_tuning.DEFAULT.replace(packed_kernels=False)):
        cm.merge_state(...)   # planned on the strided kernels, cached apart
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch and compile choices. The defaults are the measured best (benchmarks/PERF.md)."""

    #: Plan the lean packed kernels where the layout allows (False: the strided kernels for everything).
    packed_kernels: bool = True
    #: Strided kernels: 64-thread blocks beat 128-1024; two rows a thread 8-12 points of copy speed
    #: above one, and one below 32 MB of traffic 0.03-0.45 us faster (sweep 10).
    strided_threads: int = 64
    strided_small_traffic: int = 32_000_000
    #: Packed kernels (session 4 sweeps 1 and 2): 128-thread blocks measured 0-3 points of copy speed
    #: above 256 and 512; loads with the .cs hint below 64 MB of traffic, plain loads from 64 MB.
    packed_two_threads: int = 128
    packed_many_threads: int = 128
    packed_streaming_below: int = 64_000_000
    #: N-way splits: when rows alone give fewer than busy_threads threads, a row's states are split
    #: over up to max_splits thread groups of one block (sessions 3-8).
    busy_threads: int = 128 * 1024
    max_splits: int = 16
    #: ... and ragged rows of ragged_split_states states or more on average take at least
    #: ragged_min_splits (where their chunks allow), however many threads the rows give. Session 31
    #: (.ci/fi_miss_sweep.py, 32 heads of 128, bf16): 512 tokens of ~200 states 85.5 -> 94.1 % of the
    #: copy at four splits (FlashInfer / ours 0.935 -> 1.033), of ~100 84.2 -> 93.2 %; 64 tokens
    #: (four splits already) lost 16 points at sixteen; rows of 8-16 states gained nothing.
    ragged_min_splits: int = 4
    ragged_split_states: int = 64
    max_block_threads: int = 256
    #: The packed N-way kernel's fewest threads across rows in a block...
    min_row_threads: int = 32
    #: ... unless that leaves fewer than min_blocks blocks (few rows): then blocks narrow, down to
    #: min_pack_threads packs, and take more splits (up to packed_max_splits, combined as a tree:
    #: few tokens with hundreds of states, session 10).
    min_blocks: int = 128
    min_pack_threads: int = 4
    packed_max_splits: int = 256
    #: The packed N-way kernel's largest block: its split instantiations take more than the 64
    #: registers a thread that a 1024-thread block allows (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
    packed_block_limit: int = 512
    #: States the N-way kernels load per memory round trip (MERGE_CHUNK): best among 2, 4 and 8 for
    #: the strided kernel (session 3), among 2 and 4 for the packed one (session 4, sweep 1).
    merge_chunk: int = 4
    #: Gradients: rows from which rows that are not short (dense rows of more than 4 states, every
    #: ragged row) take two packs a lane (half the lanes, twice the bytes each in flight). Below, the
    #: fewer blocks leave multiprocessors idle: 2048 rows reached 59 % of the copy with one pack a
    #: lane and 53 % with two; 16384-32768 rows 69-72 % with one and 75-81 % with two (session 12).
    backward_two_pack_rows: int = 8192
    #: Gradients: the most groups of threads a row's states are split over (1, 2 or 4), one chunk
    #: of states a group at a time, where a row has chunks enough and the rows alone give fewer
    #: than backward_busy_threads threads (about a wave at two packs a lane: 4 blocks of 128 on
    #: 132 multiprocessors). Session 13: 2048 rows of 16 states 60 -> 75 % of the copy; 8192 rows
    #: and more lost 2-24 points with groups (a barrier a row), so they keep one.
    backward_groups: int = 4
    backward_busy_threads: int = 65536
    #: Gradients: dense rows of at least twice this many chunks split over groups however many
    #: rows there are, each group taking this many chunks or more (0: groups only where rows are
    #: too few). Session 21 (sweeps, staged chunks): 16384 rows of 48 states 64.5 -> 76.5 % of the
    #: copy at four groups of three chunks; groups of two chunks within run-to-run spread (32768
    #: rows of 16 states 79.1 -> 78.9 and 80.6, 16384 of 16 at 8 heads 77.4 -> 77.2), of one chunk
    #: 1-10 points slower (rows of 8 states). Ragged rows keep one group: 131072 rows of ~8 states
    #: lost 8.5 points at two (a warp's rows of uneven length wait at each row's barrier). Rows of
    #: 24-44 states (two groups of three chunks or more) are not measured.
    backward_group_chunks: int = 3
    #: Gradients: rows still too few then split their states over blocks (a share each, then a
    #: finishing launch for the LSE gradients), each group taking at least this many chunks of a
    #: share (every block reads all of its rows' LSEs for their merged LSE). Session 13: 1024
    #: states of one token 7 -> 13 % of the copy, 256 x 8 34 -> 40 %; a share of one chunk (1)
    #: measured the same.
    backward_split_chunks: int = 2
    #: Gradients: LSEs a lane loads at once while it folds its row's merged LSE (MERGE_FOLD). One
    #: (a dependent load a state) left rows of hundreds of states waiting on memory (session 14).
    backward_fold: int = 8
    #: Gradients: rows that are not short ask L2 for their next chunk of states as they load one
    #: (MERGE_PREFETCH; where their chunks are held in registers, in both gradient kernels): they
    #: wait on memory at the occupancy their registers allow (session 14).
    backward_prefetch: bool = True
    #: Gradients (both kernels): rows that are not short stage their chunks in shared memory
    #: through cp.async, two chunks in flight a thread, rather than hold one in registers across
    #: its loads' wait (MERGE_ASYNC; on sm_90 and sm_100, whose 228 KB of shared memory a
    #: multiprocessor holds 5 staged blocks; packs of 4, 8 or 16 bytes). Session 16:
    #: registers 128 -> 92 (two packs a lane, 5 blocks where 4), 131072 rows of 8 states 78 -> 85 %
    #: of the copy, ragged 4096 tokens of ~8 83 -> 91 %, 512 tokens 72 -> 77 %; rows of 16 states
    #: 80 -> 78 % (two of their four chunks in flight at once, where the L2 prefetch had a third).
    #: The kernel given the results (session 19): rows of 64 states 76 -> 81 %, ragged rows of
    #: ~100 71 -> 78 %, 256 rows of 8 91 -> 99 %.
    backward_async: bool = True
    #: ... with, for dense rows, backward_stages chunks of backward_chunk states in flight a thread
    #: (MERGE_BACKWARD_*, within 36 KiB of shared memory: the kernel's other arrays take up to 8;
    #: ragged rows two of their held chunk's). The planner counts a row's chunks in merge_chunk
    #: states either way. Session 22, % of the copy: three chunks of two against two of four
    #: (fewer bytes in flight, 9 KB less shared memory a block) 79.6 -> 84.0 at 1024 tokens of
    #: 16 states, 84.6 -> 86.9 at 4096 of 8, +1.8-3.3 at 24-32 states and 256 tokens of 8,
    #: +0.2-1.2 at 48 states and 2048 tokens of 16 x 8 heads; four of two within 1.2 of two of four.
    backward_chunk: int = 2
    backward_stages: int = 3
    #: ... and blocks a multiprocessor keeps of those of two packs a lane (MERGE_BACKWARD_BLOCKS:
    #: their registers' bound, 96 -> 80 at 6; shared memory may allow fewer). Six measured 0-4
    #: points slower than five at three chunks of two (session 22).
    backward_blocks: int = 5
    #: Gradients given the merge's results (``out``, ``out_lse``): fewer rows than this of at least
    #: backward_from_output_states states (ragged: on average) take the kernel that reads them
    #: (each state's gradients its own: no fold, no sum over the states first, any share of a
    #: row's states in any block); the rest ignore them and recompute S, which moves a state's
    #: worth of bytes less. Session 15: 32-256 rows of 256-4096 states 12-53 -> 93-95 % of the
    #: copy, 2048 rows of 16-64 states 72-73 -> 78-81 %, ragged 256 rows of ~500 states 33 -> 79
    #: %; from 16384 rows, and rows of 8 or fewer states, 1-12 points below.
    backward_from_output_rows: int = 16384
    backward_from_output_states: int = 16
    #: ... its threads as for the other kernel (backward_busy_threads), ragged batches' four times
    #: that (their longest rows decide: 256 rows of ~500 states 68 -> 77 % at twice, session 15;
    #: with the chunks staged, twice -> four times: 2048 rows of ~100 states 77.5 -> 80.3 %, 256
    #: rows of ~500 84.0 -> 85.9, where dense rows lost 3-6 points at more or fewer, session 19) ...
    backward_from_output_ragged_busy_threads: int = 262144
    #: ... and two packs a lane from this many rows (one below; where a row has more than one):
    #: one measured 5-17 points lower at 32-2048 rows, within 2 from 16384 (session 15).
    backward_from_output_two_pack_rows: int = 0
    #: ... and, staged, backward_given_stages chunks of backward_given_chunk states in flight a
    #: thread (dense rows; ragged rows the _ragged_ pair; MERGE_GIVEN_*, within 48 KiB of shared
    #: memory). Session 20, the same bytes in flight: dense rows four chunks of two against two of
    #: four 81.8 -> 85.6 % of the copy at 2048 rows of 64 states, 97-100 -> 99-103 % at 8-256
    #: rows of 256-4096; ragged rows 0.1-4 points lower (2048 rows of ~100, 256 of ~500).
    backward_given_chunk: int = 2
    backward_given_stages: int = 4
    backward_given_ragged_chunk: int = 4
    backward_given_ragged_stages: int = 2
    #: Batch-invariant plans (``cupy_merge.batch_invariant``): a row's result is the same bits
    #: whatever else is in the batch. A dense N-way row of n states is folded by
    #: min(invariant_max_splits, ceil(n / invariant_split_states)) groups of threads whose partials
    #: meet in one tree, a ragged row by one (never a number of splits chosen from the batch's
    #: size); gradients take a way through their rows chosen from the rows' shape alone (their
    #: sums over a row's packs and states follow it). Session 25's sweep: 16 states a split kept
    #: rows of 64 states x 64 tokens at 82 % of the copy (8: 73 %), and single tokens of
    #: thousands of states need many splits (16: 30 % at 4096 states); at most 64, the most a
    #: block's z dimension holds (the strided kernel's splits; session 26: 65 failed to launch).
    batch_invariant: bool = False
    invariant_split_states: int = 16
    invariant_max_splits: int = 64
    #: Programmatic dependent launch on sm_90 and newer: a merge's blocks start while the kernel
    #: before it drains, and wait for its results before their first load. Off by default: in a
    #: CUDA-graph chain (producer, merge, consumer) it saved nothing measurable (within +-1 us at
    #: 1-512 tokens) and its launch through cuLaunchKernelEx costs ~1.6 us more host time a call
    #: (benchmarks/PERF.md, session 9).
    programmatic_launch: bool = False

    def __post_init__(self) -> None:
        # Cache keys hash this value on every cold call: once is enough.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def compile_options(self) -> tuple[str, ...]:
        """The NVRTC options every module of this tuning is compiled with."""
        return (
            "-std=c++17",
            f"-DMERGE_CHUNK={self.merge_chunk}",
            f"-DMERGE_FOLD={self.backward_fold}",
            f"-DMERGE_PREFETCH={int(self.backward_prefetch)}",
            f"-DMERGE_ASYNC={int(self.backward_async)}",
            f"-DMERGE_BACKWARD_CHUNK={self.backward_chunk}",
            f"-DMERGE_BACKWARD_STAGES={self.backward_stages}",
            f"-DMERGE_BACKWARD_BLOCKS={self.backward_blocks}",
            f"-DMERGE_GIVEN_CHUNK={self.backward_given_chunk}",
            f"-DMERGE_GIVEN_STAGES={self.backward_given_stages}",
            f"-DMERGE_GIVEN_RAGGED_CHUNK={self.backward_given_ragged_chunk}",
            f"-DMERGE_GIVEN_RAGGED_STAGES={self.backward_given_ragged_stages}",
        )

    def replace(self, **changes: object) -> Tuning:
        """A copy with some fields changed, e.g. ``DEFAULT.replace(packed_kernels=False)``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


#: The default tuning; ``CUPY_MERGE_PDL=1`` in the environment turns programmatic launch on,
#: ``CUPY_MERGE_BATCH_INVARIANT=1`` batch-invariant plans.
DEFAULT = Tuning(
    programmatic_launch=os.environ.get("CUPY_MERGE_PDL", "0") == "1",
    batch_invariant=os.environ.get("CUPY_MERGE_BATCH_INVARIANT", "0") == "1",
)

_current: contextvars.ContextVar[Tuning] = contextvars.ContextVar("cupy_merge_tuning")


def current() -> Tuning:
    """The tuning merges on this thread (and task) plan with: :data:`DEFAULT` unless inside :func:`use`."""
    return _current.get(DEFAULT)


def set_default(tuning: Tuning) -> None:
    """Make ``tuning`` the process's default, for every thread not inside :func:`use` (the
    dispatcher's ``set_default_tuning`` keeps the calls it prepared for each default apart)."""
    global DEFAULT
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected a cupy_merge._tuning.Tuning, got {type(tuning).__name__}")
    DEFAULT = tuning


@contextlib.contextmanager
def use(tuning: Tuning) -> Iterator[Tuning]:
    """Plan every merge inside the block with ``tuning``; restored on exit."""
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected a cupy_merge._tuning.Tuning, got {type(tuning).__name__}")
    token = _current.set(tuning)
    try:
        yield tuning
    finally:
        _current.reset(token)
