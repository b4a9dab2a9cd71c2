"""``python -m cupy_merge.tools.sweep``: kernel variants side by side, checked, one table per family.

Each variant is a :class:`~cupy_merge._tuning.Tuning` (some fields of the
default changed: block sizes, family switches, the chunk the kernels are
compiled with); the sweep merges each case under it (``_tuning.use``: its plans
and modules are cached apart) once to check it against the first variant's
result (the strided kernels', for the merges), then times it (CUDA events,
median, L2 flushed) next to a same-bytes copy. Cells are % of the copy's speed;
the last column is the largest relative error of any variant against the first.
Used for benchmarks/PERF.md: each sweep's prediction and result are recorded there.
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy

from .. import _tuning, merge_state, merge_states, merge_states_varlen
from ..backward import merge_states_backward, merge_states_varlen_backward
from .timing import copy_us, median_ms

TWO_CASES = [
    (1, 32, 128, "bfloat16"), (64, 32, 128, "bfloat16"), (256, 32, 128, "bfloat16"), (1024, 32, 128, "bfloat16"),
    (4096, 32, 128, "bfloat16"), (16384, 32, 128, "bfloat16"), (32768, 32, 128, "bfloat16"),
    (4096, 8, 64, "bfloat16"), (4096, 32, 256, "bfloat16"), (8192, 16, 512, "bfloat16"), (8192, 128, 128, "bfloat16"),
    (4096, 32, 128, "float16"), (4096, 32, 128, "float32"), (613, 16, 96, "bfloat16"),
]  # fmt: skip
TWO_VARIANTS = {
    "strided": {"packed_kernels": False},
    "packed": {},
    "t256": {"packed_two_threads": 256},
    "t64": {"packed_two_threads": 64},
    "cs-loads": {"packed_streaming_below": 2**62},
    "plain-loads": {"packed_streaming_below": 0},
    "pdl": {"programmatic_launch": True},
}
#: (states, tokens, heads, head_size); states < 0: ragged with 0..-2*states states a token.
MANY_CASES = [
    (16, 1, 32, 128), (64, 1, 32, 128), (8, 4, 8, 128), (16, 64, 32, 128), (64, 64, 32, 128), (8, 256, 32, 128), (4, 4096, 32, 128),
    (256, 16, 32, 128), (16, 1024, 32, 128), (8, 8192, 32, 128), (16, 2048, 8, 128), (3, 8192, 32, 128),
    (256, 1, 32, 128), (1024, 1, 32, 128), (4096, 1, 32, 128), (1024, 2, 32, 128), (256, 8, 32, 128), (4096, 8, 32, 128),
    (1024, 1, 8, 128),
    (-16, 512, 32, 128), (-8, 4096, 32, 128), (-100, 64, 32, 128), (-200, 64, 32, 128), (-100, 512, 32, 128),
    (-200, 512, 32, 128),
]  # fmt: skip
MANY_VARIANTS = {
    "strided": {"packed_kernels": False},
    "packed": {},
    "split16": {"packed_max_splits": 16, "min_blocks": 0},  # session 9's blocks (its serial combine is gone)
    "split64": {"packed_max_splits": 64},
    "blocks64": {"min_blocks": 64},
    "blocks256": {"min_blocks": 256},
    "pack2": {"min_pack_threads": 2},
    "pack8": {"min_pack_threads": 8},
    "head-blocks": {"packed_many_threads": 64, "min_row_threads": 16},
    "chunk2": {"merge_chunk": 2},
    "chunk8": {"merge_chunk": 8},  # gradients: chunks of 16-byte packs too big to stage (held in registers)
    "busy2x": {"busy_threads": 2 * _tuning.DEFAULT.busy_threads},  # twice the splits where rows are few
    "pdl": {"programmatic_launch": True},
    # Batch-invariant plans (a row's splits from its own count: one a `invariant_split_states`
    # states, at most `invariant_max_splits`), on either kernel.
    "inv": {"batch_invariant": True},
    "inv-strided": {"batch_invariant": True, "packed_kernels": False},
    "inv4": {"batch_invariant": True, "invariant_split_states": 4},
    "inv16": {"batch_invariant": True, "invariant_split_states": 16},
    "inv32": {"batch_invariant": True, "invariant_split_states": 32},
    "inv-max8": {"batch_invariant": True, "invariant_max_splits": 8},
    "inv-max32": {"batch_invariant": True, "invariant_max_splits": 32},
}

#: The gradient's cases, as MANY_CASES, each given the merge's results (``out``, ``out_lse``); its
#: variants against the kernel that recomputes S (the first column, and the error's reference),
#: its own variants recomputing too.
BACKWARD_CASES = [
    (2, 4096, 32, 128), (4, 4096, 32, 128),
    (1024, 1, 32, 128), (4096, 1, 32, 128), (256, 8, 32, 128), (64, 64, 32, 128), (16, 64, 32, 128),
    (8, 256, 32, 128), (16, 1024, 32, 128), (8, 4096, 32, 128), (16, 2048, 8, 128), (24, 1024, 32, 128), (32, 1024, 32, 128), (48, 512, 32, 128),
    (-8, 64, 32, 128), (-8, 512, 32, 128), (-8, 4096, 32, 128), (-100, 64, 32, 128), (-500, 8, 32, 128),
]  # fmt: skip
_RECOMPUTE = {"backward_from_output_states": 2**62}
BACKWARD_VARIANTS = {
    "recompute": _RECOMPUTE,
    "default": {},
    "given-all": {"backward_from_output_states": 2, "backward_from_output_rows": 2**62},  # every case
    "given-1pack": {"backward_from_output_two_pack_rows": 2**62},
    "given-2pack": {"backward_from_output_two_pack_rows": 0},
    # The kernel given the results with its chunks held in registers, asking L2 for the next or
    # not (session 18's kernel); recomputing cases as "held" and "no-prefetch".
    "given-held": {"backward_async": False},
    "given-no-prefetch": {"backward_async": False, "backward_prefetch": False},
    # Half and twice the splits of the kernel given the results (dense and ragged; recomputing
    # cases as a busy_threads variant).
    "given-busy-half": {"backward_busy_threads": _tuning.DEFAULT.backward_busy_threads // 2,
                        "backward_from_output_ragged_busy_threads": _tuning.DEFAULT.backward_from_output_ragged_busy_threads // 2},
    "given-busy2x": {"backward_busy_threads": 2 * _tuning.DEFAULT.backward_busy_threads,
                     "backward_from_output_ragged_busy_threads": 2 * _tuning.DEFAULT.backward_from_output_ragged_busy_threads},
    # The kernel given the results with other chunks in flight (stages x chunk states): dense rows
    # (default 4 x 2) and ragged ones (default 2 x 4).
    "given-s2c4": {"backward_given_stages": 2, "backward_given_chunk": 4},  # session 19's
    "given-s3c3": {"backward_given_stages": 3, "backward_given_chunk": 3},
    "given-s5c2": {"backward_given_stages": 5, "backward_given_chunk": 2},
    "given-ragged-s3c2": {"backward_given_ragged_stages": 3, "backward_given_ragged_chunk": 2},
    "given-ragged-s4c2": {"backward_given_ragged_stages": 4, "backward_given_ragged_chunk": 2},
    # The recomputing kernel's dense rows with other chunks in flight (stages x chunk states;
    # default 3 x 2 since session 22, 2 x 4 before), or at 6 blocks a multiprocessor (80 registers).
    "s2c4": {**_RECOMPUTE, "backward_stages": 2, "backward_chunk": 4},
    "s4c2": {**_RECOMPUTE, "backward_stages": 4, "backward_chunk": 2},
    "b6": {**_RECOMPUTE, "backward_blocks": 6},
    "s2c2-b6": {**_RECOMPUTE, "backward_stages": 2, "backward_chunk": 2, "backward_blocks": 6},
    "busy2x": {"backward_busy_threads": 2 * _tuning.DEFAULT.backward_busy_threads},
    "busy4x": {"backward_busy_threads": 4 * _tuning.DEFAULT.backward_busy_threads},
    # Many rows split over groups too (more, smaller blocks of work: fewer idle slots in the last wave).
    "busy8x": {"backward_busy_threads": 8 * _tuning.DEFAULT.backward_busy_threads},
    "busy16x": {"backward_busy_threads": 16 * _tuning.DEFAULT.backward_busy_threads},
    # Long rows over groups only where rows are few (before session 21).
    "no-long-groups": {**_RECOMPUTE, "backward_group_chunks": 0},
    "one-block": {**_RECOMPUTE, "backward_groups": 1, "backward_split_chunks": 2**62},
    "no-splits": {**_RECOMPUTE, "backward_split_chunks": 2**62},
    "split1": {**_RECOMPUTE, "backward_split_chunks": 1},
    "two-packs": {**_RECOMPUTE, "backward_two_pack_rows": 0},
    # One pack a lane for every row (twice the lanes and blocks of two), one group, no splits.
    "one-pack": {**_RECOMPUTE, "backward_two_pack_rows": 2**62, "backward_busy_threads": 2**62,
                 "backward_groups": 1, "backward_split_chunks": 2**62},
    "invariant": {"batch_invariant": True},  # given the results: always the kernel that reads them
    "fold1": {**_RECOMPUTE, "backward_fold": 1},  # a dependent load a state, as session 13's fold
    "fold4": {**_RECOMPUTE, "backward_fold": 4},
    "no-prefetch": {**_RECOMPUTE, "backward_prefetch": False, "backward_async": False},
    "held": {**_RECOMPUTE, "backward_async": False},  # each chunk in registers across its loads (session 15)
}


def tuning_of(settings: dict) -> _tuning.Tuning:
    """A variant's tuning: the default with ``settings`` changed."""
    return _tuning.DEFAULT.replace(**settings)


def _dtype(name: str):
    from .._arrays import cupy_dtype

    return cupy_dtype(name)


def _row(label: str, nbytes: int, run, variants: dict) -> tuple[str, list[float], float]:
    results, cells = {}, []
    for name, settings in variants.items():
        with _tuning.use(tuning_of(settings)):
            value = run()
            results[name] = [cupy.asnumpy(x.astype(cupy.float32)) for x in value]
            cells.append(median_ms(run) * 1e3)
    base = results[next(iter(variants))]
    worst = 0.0
    for got in results.values():
        for g, w in zip(got, base):
            finite = numpy.isfinite(w)
            scale = max(float(numpy.linalg.norm(w[finite])), 1e-30)
            worst = max(worst, float(numpy.linalg.norm((g - w)[finite])) / scale)
    copy = copy_us(nbytes)
    return label, [copy, *[100 * copy / cell for cell in cells], cells[0]], worst


def _label(states: int, tokens: int, heads: int) -> str:
    return f"ragged T={tokens} mean {-states}" if states < 0 else f"S={states} T={tokens} H={heads}"


def _all(label: str) -> bool:
    return True


def _states(rng, states: int, tokens: int, heads: int, head_size: int):
    """Values, LSEs, ragged offsets (None when dense) and a label; states < 0: ragged, 0..-2*states a token."""
    indptr = None
    shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    if states < 0:
        counts = rng.integers(0, -2 * states + 1, size=tokens)
        indptr = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(counts)]).astype(numpy.int32))
        shape, lse_shape = (int(counts.sum()),), (heads, int(counts.sum()))
    else:
        shape, lse_shape = (states, tokens), (states, heads, tokens)
    v = cupy.asarray(rng.standard_normal((*shape, heads, head_size), dtype=numpy.float32)).astype(_dtype("bfloat16"))
    s = cupy.asarray(rng.standard_normal(lse_shape, dtype=numpy.float32) * 4)
    return v, s, indptr, _label(states, tokens, heads)


def sweep_two(rng, variants: dict = TWO_VARIANTS, keep=_all) -> list:
    rows = []
    for tokens, heads, head_size, dtype in TWO_CASES:
        label = f"{tokens}x{heads}x{head_size} {dtype}"
        if not keep(label):
            continue
        v_a, v_b = (cupy.asarray(rng.standard_normal((tokens, heads, head_size), dtype=numpy.float32)).astype(_dtype(dtype))
                    for _ in range(2))  # fmt: skip
        s_a, s_b = (
            cupy.asarray(rng.standard_normal((heads, tokens), dtype=numpy.float32) * 4) for _ in range(2)
        )
        out, out_lse = cupy.empty_like(v_a), cupy.empty_like(s_a)
        nbytes = 3 * v_a.nbytes + 3 * s_a.nbytes
        run = lambda v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b, out=out, out_lse=out_lse: merge_state(
            v_a, s_a, v_b, s_b, out=out, out_lse=out_lse
        )
        rows.append(_row(label, nbytes, run, variants))
        print(".", end="", file=sys.stderr, flush=True)
    return rows


def sweep_many(rng, variants: dict = MANY_VARIANTS, keep=_all) -> list:
    def setup(v, s, indptr, tokens, heads, head_size):
        out = cupy.empty((tokens, heads, head_size), dtype=v.dtype)
        out_lse = cupy.empty((heads, tokens), dtype=cupy.float32)
        return v.nbytes + s.nbytes + out.nbytes + out_lse.nbytes, _many_run(v, s, indptr, out, out_lse)

    return _sweep_states(rng, MANY_CASES, variants, setup, keep)


def sweep_backward(rng, variants: dict = BACKWARD_VARIANTS, keep=_all) -> list:
    """The bytes a case counts are those of the kernel that recomputes S (without ``out`` and
    ``out_lse``), so that the columns compare times."""

    def setup(v, s, indptr, tokens, heads, head_size):
        grad = cupy.asarray(rng.standard_normal((tokens, heads, head_size), dtype=numpy.float32)).astype(v.dtype)
        grad_s = cupy.asarray(rng.standard_normal((heads, tokens), dtype=numpy.float32))
        results = _many_run(v, s, indptr, None, None)()
        nbytes = 2 * (v.nbytes + s.nbytes) + grad.nbytes + grad_s.nbytes
        return nbytes, _backward_run(v, s, indptr, grad, grad_s, results)

    return _sweep_states(rng, BACKWARD_CASES, variants, setup, keep)


def _sweep_states(rng, cases: list, variants: dict, setup, keep=_all) -> list:
    """A row a case of (states, tokens, heads, head_size) (states < 0: ragged) whose label ``keep``
    takes; ``setup(v, s, indptr, tokens, heads, head_size)`` gives the bytes the call moves and the call."""
    rows = []
    for states, tokens, heads, head_size in cases:
        if not keep(_label(states, tokens, heads)):
            continue
        v, s, indptr, label = _states(rng, states, tokens, heads, head_size)
        nbytes, run = setup(v, s, indptr, tokens, heads, head_size)
        rows.append(_row(label, nbytes, run, variants))
        print(".", end="", file=sys.stderr, flush=True)
    return rows


def _backward_run(v, s, indptr, grad, grad_s, results):
    out, out_lse = results
    if indptr is None:
        return lambda: merge_states_backward(v, s, grad, grad_s, out=out, out_lse=out_lse)[:2]
    return lambda: merge_states_varlen_backward(v, s, indptr, grad, grad_s, out=out, out_lse=out_lse)[:2]


def _many_run(v, s, indptr, out, out_lse):
    if indptr is None:
        return lambda: merge_states(v, s, out=out, out_lse=out_lse)
    return lambda: merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, check_indptr=False)


def _table(title: str, rows: list, variants: dict) -> str:
    names = ["copy us", *[f"{n} %" for n in variants], f"{next(iter(variants))} us", "max rel err"]
    width = max(len(r[0]) for r in rows)
    lines = [title, f"{'case':<{width}} " + " ".join(f"{n:>10}" for n in names)]
    for label, cells, worst in rows:
        lines.append(f"{label:<{width}} " + " ".join(f"{c:>10.1f}" for c in cells) + f" {worst:>10.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupy_merge.tools.sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--family", choices=["two", "many", "backward", "all"], default="all")
    parser.add_argument("--variants", help="comma-separated variants to run, the first the reference (default: all)")
    parser.add_argument("--cases", help="comma-separated beginnings of case labels to run, e.g. 'S=16 T=1024,ragged' (default: all)")
    args = parser.parse_args(argv)
    chosen = args.variants.split(",") if args.variants else None
    families: dict[str, dict] = {"two": TWO_VARIANTS, "many": MANY_VARIANTS, "backward": BACKWARD_VARIANTS}
    known = families.get(args.family)
    if chosen and known is not None and set(chosen) - set(known):
        unknown = ", ".join(sorted(set(chosen) - set(known)))
        parser.error(f"--variants: {unknown} not among {', '.join(known)}")
    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to sweep")
        return 0
    rng = numpy.random.default_rng()

    beginnings = args.cases.split(",") if args.cases else None

    def keep(label: str) -> bool:
        return beginnings is None or any(label.startswith(b) for b in beginnings)

    def picked(variants: dict) -> dict:
        return {name: variants[name] for name in chosen if name in variants} if chosen else variants

    if args.family in ("two", "all"):
        variants = picked(TWO_VARIANTS)
        print(_table("two-way, % of same-bytes copy", sweep_two(rng, variants, keep), variants), flush=True)
    if args.family in ("many", "all"):
        variants = picked(MANY_VARIANTS)
        print(_table("N-way and ragged (bf16), % of same-bytes copy", sweep_many(rng, variants, keep), variants), flush=True)
    if args.family in ("backward", "all"):
        variants = picked(BACKWARD_VARIANTS)
        print(_table("gradients (bf16), % of same-bytes copy", sweep_backward(rng, variants, keep), variants), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
