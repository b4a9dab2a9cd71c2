"""python -m cupy_merge.bench: every merge of the library against a copy of the same bytes, in one table.

Each row is one case (cupy_merge/tools/bench_cases.py lists them): two-way, N-way and ragged
merges, FP8 outputs (per-tensor and group scales), NVFP4 outputs, the same with attention sinks, and the
gradients. All times are CUDA-event medians in microseconds, after warm-up, with the L2 flushed
before each repetition (cupy_merge/tools/timing.py), measured in one run:

  merge_us         this library, native layout (the gradients as autograd calls them: allocating,
                   given the merge's results out and out_lse)
  copy_us          a device-to-device copy moving the same bytes (read + write): the ceiling
  pct_of_copy      100 * copy_us / merge_us;  gbps: bytes moved / merge_us;  mbytes: the bytes
  torch_us         the same formula in eager torch, where there is one (FP8: and its quantisation)
  compiled_us      that formula through torch.compile (two-way; --no-compile skips it)
  graph_us         the merge replayed from a torch CUDA graph (two-way): no host cost
  chained_us       an N-way merge as chained two-way merges (up to 64 states)
  unfused_us       FP8: a merge to bfloat16, then a separate one-pass per-tensor quantisation;
                   NVFP4: the same with a one-pass NVFP4 quantisation (a thread a block of 16)
  baseline_us      sinks rows: the same merge without sinks, timed alternately with it; gradient
                   rows: the gradients without the merge's results (S recomputed from the LSEs)
  overhead_pct     100 * (merge_us - baseline_us) / baseline_us, the sinks' cost (gradients: below 0,
                   what the merge's results save)
  flashinfer_us    with --flashinfer: FlashInfer's kernel on its own layout (token-major, base-2 LSE)
  cm_fi_layout_us  this library on FlashInfer's layout (strided views, lse_base=2)
  fi_over_cm       flashinfer_us / the better of merge_us and cm_fi_layout_us: above 1, ours is faster
  maxdiff          the largest |FlashInfer - ours| of the merged values, checked once a case

A second table gives host time per call (no synchronisation; batches of 256 calls, fewer than
the launch queue holds; the median batch) at decode sizes: merge_attn_states on CuPy arrays
and torch tensors (host_*), a merge bound once with cupy_merge.bind (bound_*), merge_state
allocating (alloc_torch_us), and the yardsticks cupy.add / torch.add, into out= and allocating.

--flashinfer alone times the installed flashinfer package's merge_state, merge_states and
variable_length_merge_states (as a user calls them: allocating their results). --flashinfer DIR
instead builds FlashInfer's header-only merge kernels from a source tree (DIR/include) with nvcc,
through a small C shim this package writes out (cupy_merge/tools/bench_flashinfer.py), into a
temporary library loaded with ctypes; it needs torch and nvcc. No FlashInfer code is part of this
package. Without --flashinfer the FlashInfer columns are '-'.
"""

from __future__ import annotations

import argparse
import sys

import cupy

from .bench_cases import FAMILIES, HOST, Case, all_cases, host_cases
from .bench_cases import select as select_cases
from .bench_flashinfer import CASCADE_HEADER, HOW_TO_GET, from_package, from_source_tree, is_source_tree
from .bench_report import HOST_COLUMNS, environment, environment_line, format_table, plot, write_results
from .bench_runners import Context, quantiser, run_case, run_host_case

# ---------------------------------------------------------------------------------------------
# The command line


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` prints this module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m cupy_merge.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a few cases of each family only")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument(
        "--only",
        metavar="FAMILIES",
        type=_families,
        help=f"comma-separated families to run, of: {', '.join(FAMILIES + (HOST,))}",
    )
    parser.add_argument(
        "--flashinfer",
        metavar="DIR",
        nargs="?",
        const="",
        help="time FlashInfer beside: the installed flashinfer package, or with DIR a FlashInfer source "
        "tree whose include/ is built with nvcc (needs torch)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="time the cross-rank strategies instead (run under torchrun, one rank per GPU)",
    )
    parser.add_argument(
        "--invariant",
        action="store_true",
        help="time each merge in batch-invariant mode too (cupy_merge.batch_invariant): its cost in %%",
    )
    parser.add_argument("--out", metavar="FILE", help="write the rows to FILE.csv or FILE.json")
    parser.add_argument(
        "--plot", metavar="FILE", help="write a PNG of %% of copy (and FI/cm) against traffic"
    )
    return parser


def _families(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES + (HOST,)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown families {unknown or [text]}; expected some of {', '.join(FAMILIES + (HOST,))}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a bad option exits with status 2."""
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The command


def main(argv=None) -> int:
    """Run the benchmark (or, with --distributed, the cross-rank one); the exit status."""
    args = parse_args(argv)
    if args.distributed:
        from . import bench_distributed

        return bench_distributed.main()
    flashinfer = None
    if args.flashinfer == "":  # --flashinfer alone: the installed package, found before any GPU work
        flashinfer = from_package()
        if flashinfer is None:
            print(HOW_TO_GET, file=sys.stderr)
            return 2
    elif args.flashinfer is not None and not is_source_tree(args.flashinfer):
        print(f"--flashinfer: {args.flashinfer} is not a FlashInfer source tree (no {CASCADE_HEADER})\n"
              f"{HOW_TO_GET}", file=sys.stderr)  # fmt: skip
        return 2
    if not cupy.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    torch = _torch()
    ctx = Context(torch=torch, compile_torch=not args.no_compile, flashinfer=flashinfer, invariant=args.invariant)
    if args.flashinfer:
        ctx.flashinfer = from_source_tree(args.flashinfer, str(cupy.cuda.Device().compute_capability), torch)
    cases = select_cases(all_cases(args.quick), args.only)
    hosts = host_cases(args.quick) if args.only is None or HOST in args.only else []
    if any(case.kind == "fp8" for case in cases):
        ctx.quantise = quantiser()
    env = environment()
    if ctx.flashinfer is not None:
        env["flashinfer"] = ctx.flashinfer.source
    total = len(cases) + len(hosts)
    rows: list[dict] = []
    host_rows: list[dict] = []
    try:
        for index, case in enumerate(cases, 1):
            _progress(index, total, case)
            rows.append(run_case(ctx, case))
            _release_memory(torch)
        for index, case in enumerate(hosts, len(cases) + 1):
            _progress(index, total, case)
            host_rows.append(run_host_case(ctx, case))
    except BaseException as error:  # a broken device or ^C: the rows measured so far are still shown
        print(f"\nstopped after {len(rows) + len(host_rows)} of {total} cases: {error!r}", file=sys.stderr)
        _report(rows, host_rows, env, args)
        raise
    print(file=sys.stderr)
    _report(rows, host_rows, env, args)
    return 0


def _report(rows: list[dict], host_rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """The environment line, the two tables, and the files asked for."""
    print(environment_line(env))
    if rows:
        print(format_table(rows))
    if host_rows:
        print("\nhost cost per call (us, no synchronisation)")
        print(format_table(host_rows, HOST_COLUMNS))
    if args.out:
        write_results(rows, host_rows, env, args.out)
    if args.plot and rows:
        plot(rows, env, args.plot)


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _release_memory(torch) -> None:
    """Return the case's buffers to the device so the next, larger case fits beside the L2 flush."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _progress(index: int, total: int, case: Case) -> None:
    width = 30
    done = width * (index - 1) // total
    bar = "#" * done + "." * (width - done)
    print(f"\r[{bar}] {index}/{total} {case.family} {case.label}   ", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
