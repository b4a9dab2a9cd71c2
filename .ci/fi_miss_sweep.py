"""Issue 51's kernel misses against FlashInfer: the planner's variants (through ``_tuning.use``) and,
with ``--branching``, the two-way kernel's non-grouped path weighing with ``weigh_pack_branching``
(patched into the source this process compiles; the disk cache is keyed by the source text). Each
variant is checked against FlashInfer's result, then timed paired with FlashInfer's kernel in the
same process (CUDA events, L2 flushed; five rounds, each timing every variant in an order rotated
round by round; the medians), with a same-bytes copy.
The predictions being tested: docs/PERF.md, session 28 (a helper's static analysis).

Usage (device, carry .anchors): python3 .ci/fi_miss_sweep.py [--ragged | --two-way: those cases only];
python3 .ci/fi_miss_sweep.py --branching
"""

import functools
import statistics
import sys

import torch

import cupy_merge as cm
from cupy_merge import _kernels, _tuning
from cupy_merge.tools.bench_cases import ragged_indptr
from cupy_merge.tools.bench_flashinfer import from_source_tree
from cupy_merge.tools.timing import copy_us, median_ms

BRANCHING = "--branching" in sys.argv
DEFAULT = _tuning.DEFAULT
N_WAY_VARIANTS = {
    "default": DEFAULT,
    "default again (the noise)": DEFAULT,
    "min_blocks 132": DEFAULT.replace(min_blocks=132),
    "min_blocks 256": DEFAULT.replace(min_blocks=256),
    "row 8, 64 threads, min_blocks 512": DEFAULT.replace(min_row_threads=8, packed_many_threads=64, min_blocks=512),
    "min_blocks 256, 8 packs": DEFAULT.replace(min_blocks=256, min_pack_threads=8),
    "plain loads": DEFAULT.replace(packed_streaming_below=0),
}
TWO_WAY_VARIANTS = {
    "default": DEFAULT,
    "default again (the noise)": DEFAULT,
    "64 threads": DEFAULT.replace(packed_two_threads=64),
    "32 threads": DEFAULT.replace(packed_two_threads=32),
    "plain loads": DEFAULT.replace(packed_streaming_below=0),
}
RAGGED_VARIANTS = {
    "default": DEFAULT,
    "no ragged floor (session 30)": DEFAULT.replace(ragged_min_splits=1),
    "ragged floor 8": DEFAULT.replace(ragged_min_splits=8),
    "ragged floor 4 from 32 states": DEFAULT.replace(ragged_split_states=32),
}
ONLY_RAGGED = "--ragged" in sys.argv
ONLY_TWO_WAY = "--two-way" in sys.argv
ROUNDS = 5


def _patch_branching() -> None:
    read = _kernels._read

    def patched(name: str) -> str:
        text = read(name)
        if name == "merge_two_states.cu":
            old = "  weigh_pack(w, a, b, merged);\n  return output_pack"
            assert old in text, "merge_pack's weighing changed: update this script"
            text = text.replace(old, "  weigh_pack_branching(w, a, b, merged);\n  return output_pack")
        return text

    _kernels._read = patched


def _us(run) -> float:
    return median_ms(run) * 1e3


def measure(label: str, variants: dict, ours, theirs, out, their_out, traffic: int, rows: list) -> None:
    """``ours`` under each variant's tuning checked against ``theirs`` (NaN-poisoned first), then
    timed paired with ``theirs``: every variant in each round, the order rotated round by round
    (session 32: with each variant's rounds back to back, the same kernel measured up to 7 % apart
    by its place in the sequence)."""
    diffs = {}
    for variant, tuning in variants.items():
        with _tuning.use(tuning):
            out.fill_(float("nan"))
            ours()
            theirs()
            torch.cuda.synchronize()
            assert not torch.isnan(out.float()).any(), f"{label} {variant}: an element was not written"
            diffs[variant] = (out.float() - their_out.float()).abs().max().item()
    names = list(variants)
    times: dict = {name: ([], []) for name in names}
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            with _tuning.use(variants[name]):
                times[name][0].append(_us(ours))
                times[name][1].append(_us(theirs))
    for name in names:
        a, b = statistics.median(times[name][0]), statistics.median(times[name][1])
        rows.append((label, name, a, b, b / a, copy_us(traffic) / a * 100, diffs[name]))
        print(f"{label:24s} {name:34s} ours {a:8.2f} fi {b:8.2f} fi/ours {b / a:5.3f} "
              f"copy% {rows[-1][5]:5.1f} diff {diffs[name]:.3g}", flush=True)  # fmt: skip


def two_way(fi, rows: list) -> None:
    sizes = [(4096, 8, 64), (4096, 32, 128), (1, 32, 128)]
    if ONLY_TWO_WAY:  # the benchmark's two-way cases too
        sizes += [(64, 32, 128), (1024, 32, 128), (8192, 32, 128), (256, 8, 128), (16384, 8, 64)]
    for tokens, heads, head_size in sizes:
        v_a, v_b = (torch.randn(tokens, heads, head_size, device="cuda").bfloat16() for _ in range(2))
        s_a, s_b = (torch.randn(tokens, heads, device="cuda") * 3 for _ in range(2))  # FlashInfer's [T, H], base 2
        out, out_lse = torch.empty_like(v_a), torch.empty(heads, tokens, device="cuda")
        theirs = fi.two_way(v_a, s_a, v_b, s_b)
        ours = functools.partial(cm.merge_state, v_a, s_a.T, v_b, s_b.T, out=out, out_lse=out_lse, lse_base=2)
        variants = {"branching": DEFAULT} if BRANCHING else TWO_WAY_VARIANTS
        measure(f"two {tokens}x{heads}x{head_size}", variants, ours, theirs, out, theirs(),
                3 * v_a.nbytes + 3 * s_a.nbytes, rows)  # fmt: skip


def n_way(fi, rows: list) -> None:
    for states, tokens, heads in [(32, 4, 64), (16, 64, 32), (16, 1, 32), (64, 64, 32), (256, 16, 32),
                                  (1024, 1, 32), (256, 8, 32)]:  # fmt: skip
        v = torch.randn(tokens, states, heads, 128, device="cuda").bfloat16()  # FlashInfer's layout
        s = torch.randn(tokens, states, heads, device="cuda") * 3
        out, out_lse = torch.empty(tokens, heads, 128, device="cuda").bfloat16(), torch.empty(heads, tokens, device="cuda")
        theirs = fi.n_way(v, s)
        their_out = theirs()
        ours = functools.partial(cm.merge_states, v.transpose(0, 1), s.permute(1, 2, 0), out=out, out_lse=out_lse,
                                 lse_base=2)  # fmt: skip
        measure(f"n-way S{states} T{tokens} H{heads}", N_WAY_VARIANTS, ours, theirs, out, their_out,
                v.nbytes + out.nbytes + s.nbytes, rows)  # fmt: skip


def ragged(fi, rows: list) -> None:
    for mean, tokens in [(200, 512), (100, 512), (200, 64), (100, 64), (16, 4096), (8, 1024)]:
        indptr = torch.as_tensor(ragged_indptr(mean, tokens), device="cuda")
        total = int(indptr[-1])
        v = torch.randn(total, 32, 128, device="cuda").bfloat16()
        s = torch.randn(total, 32, device="cuda") * 3
        out, out_lse = torch.empty(tokens, 32, 128, device="cuda").bfloat16(), torch.empty(32, tokens, device="cuda")
        theirs = fi.ragged(v, s, indptr, tokens)
        their_out = theirs()
        ours = functools.partial(cm.merge_states_varlen, v, s.T, indptr, out=out, out_lse=out_lse, lse_base=2,
                                 check_indptr=False)  # fmt: skip
        measure(f"ragged {mean}x{tokens}", RAGGED_VARIANTS, ours, theirs, out, their_out,
                v.nbytes + out.nbytes + s.nbytes, rows)  # fmt: skip


def main() -> None:
    if BRANCHING:
        _patch_branching()
    fi = from_source_tree(".anchors/flashinfer", "90", torch)
    torch.manual_seed(0)
    rows: list = []
    if not ONLY_RAGGED:
        two_way(fi, rows)
    if not BRANCHING and not ONLY_TWO_WAY:
        if not ONLY_RAGGED:
            n_way(fi, rows)
        ragged(fi, rows)
    print("\ncase | variant | ours us | FlashInfer us | FlashInfer / ours | % of copy")
    for label, variant, ours, theirs, ratio, copy, _ in rows:
        print(f"{label} | {variant} | {ours:.2f} | {theirs:.2f} | {ratio:.3f} | {copy:.1f}")


if __name__ == "__main__":
    main()
