"""The benchmark's cases and their traffic: pure definitions, nothing here touches a GPU.

A :class:`Case` names one measurement: its family (which merge, forward or gradient, with or
without sinks, to bfloat16 or FP8) and its shape. :func:`all_cases` lists the merge table's
cases, :func:`host_cases` the host-cost table's; :func:`traffic_bytes` is the bytes a case
must move (what the same-bytes copy moves); :func:`flashinfer_supports` says whether
FlashInfer's launchers take the shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy

#: Every family of the merge table, in the order the table lists them.
FAMILIES = (
    "two-way",
    "n-way",
    "ragged",
    "fp8",
    "fp8-group",
    "nvfp4",
    "two-way+sinks",
    "n-way+sinks",
    "ragged+sinks",
    "two-way-bwd",
    "n-way-bwd",
    "ragged-bwd",
)
#: The pseudo-family of the host-cost table (for ``--only``).
HOST = "host"
#: Elements per scale of the group-scaled FP8 rows.
FP8_GROUP = 128
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
LSE_ITEMSIZE = 4
INDPTR_ITEMSIZE = 4  # int32 offsets (what FlashInfer's ABI takes; the library takes int64 too)


@dataclass(frozen=True)
class Case:
    """One measurement: a family and a shape (bfloat16 unless ``dtype`` says otherwise).

    ``states`` is the number of states of an N-way merge and the mean number of states per
    token of a ragged one (each token gets 0 to ``2 * states``, :func:`ragged_counts`).
    """

    family: str
    tokens: int
    heads: int = 32
    head_size: int = 128
    dtype: str = "bfloat16"
    states: int = 2

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {self.family!r}")

    @property
    def kind(self) -> str:
        """``two-way``, ``n-way``, ``ragged`` or ``fp8``: the merge the family times."""
        base = self.family.split("+")[0].removesuffix("-bwd")
        return "fp8" if base.startswith("fp8") or base == "nvfp4" else base

    @property
    def sinks(self) -> bool:
        return self.family.endswith("+sinks")

    @property
    def backward(self) -> bool:
        return self.family.endswith("-bwd")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def rows(self) -> int:
        """The states stored: 2 a token two-way, ``states`` a token N-way, the ragged total."""
        if self.kind == "ragged":
            return int(ragged_counts(self.states, self.tokens).sum())
        if self.kind == "n-way":
            return self.states * self.tokens
        return 2 * self.tokens

    @property
    def label(self) -> str:
        """The short ``case`` column, e.g. ``T=1 S=1024 H=32 D=128 bf16``."""
        parts = [f"T={self.tokens}"]
        if self.kind == "n-way":
            parts.append(f"S={self.states}")
        elif self.kind == "ragged":
            parts.append(f"S~{self.states} R={self.rows}")
        parts += [f"H={self.heads}", f"D={self.head_size}", _SHORT_DTYPES[self.dtype]]
        if self.family == "fp8":
            parts.append("->e4m3")
        elif self.family == "fp8-group":
            parts.append(f"->e4m3 g{FP8_GROUP}")
        elif self.family == "nvfp4":
            parts.append("->nvfp4")
        return " ".join(parts)


@functools.cache
def ragged_counts(mean: int, tokens: int, seed: int = 0) -> numpy.ndarray:
    """States per token of a ragged case: uniform in ``0 .. 2 * mean``, a fixed seed."""
    counts = numpy.random.default_rng(seed).integers(0, 2 * mean + 1, size=tokens)
    counts.flags.writeable = False
    return counts


def ragged_indptr(mean: int, tokens: int) -> numpy.ndarray:
    """Int32 offsets ``[tokens + 1]`` of :func:`ragged_counts`."""
    return numpy.concatenate([[0], numpy.cumsum(ragged_counts(mean, tokens))]).astype(numpy.int32)


def traffic_bytes(case: Case) -> int:
    """Bytes the case must read and write at least: what its same-bytes copy moves.

    A state (or a gradient of one) is ``heads * (head_size * itemsize + 4)`` bytes a token:
    its values and its float32 LSE.

    * two-way: two states read, one written; N-way and ragged: every stored state read
      (ragged: and ``tokens + 1`` int32 offsets), one a token written; sinks add the float32
      ``[heads]`` logits;
    * backward: the states, the merged result's gradient (values and LSE) read, one gradient
      per stored state written: ``2 * rows + tokens`` states' worth;
    * FP8: two bfloat16 states and the float32 scale read, FP8 values and the float32 LSE
      written; group-scaled: plus one float32 scale per 128 elements written;
    * NVFP4: the same with half a byte a value, and one e4m3 scale per 16 values written (the
      swizzled layout's padding too).
    """
    state = case.heads * (case.head_size * case.itemsize + LSE_ITEMSIZE)
    rows, tokens = case.rows, case.tokens
    indptr = (tokens + 1) * INDPTR_ITEMSIZE if case.kind == "ragged" else 0
    if case.family == "nvfp4":
        elements = tokens * case.heads * case.head_size
        lse = tokens * case.heads * LSE_ITEMSIZE
        return elements * 2 * case.itemsize + elements // 2 + nvfp4_scale_bytes(case) + 3 * lse + 4
    if case.kind == "fp8":
        elements = tokens * case.heads * case.head_size
        lse = tokens * case.heads * LSE_ITEMSIZE
        traffic = elements * (2 * case.itemsize + 1) + 3 * lse + 4
        if case.family == "fp8-group":
            traffic += elements // FP8_GROUP * 4
        return traffic
    if case.backward:
        return (2 * rows + tokens) * state + indptr
    sinks = case.heads * 4 if case.sinks else 0
    return (rows + tokens) * state + indptr + sinks


def nvfp4_scale_bytes(case: Case) -> int:
    """An NVFP4 case's swizzled block scales: rows padded to 128, blocks to 4."""
    blocks = case.heads * case.head_size // 16
    return -(-case.tokens // 128) * 128 * -(-blocks // 4) * 4


def flashinfer_supports(case: Case) -> bool:
    """Whether FlashInfer's bfloat16 launchers (cascade.cuh) take the case.

    Its head_size dispatch knows 64, 128, 256 and 512 (anything else throws, which a C ABI
    cannot pass on), and its two-way and few-states N-way kernels run one block of
    ``head_size / vec_size * heads`` threads, at most 1024.
    """
    if case.family not in ("two-way", "n-way", "ragged") or case.dtype != "bfloat16":
        return False
    if case.head_size not in (64, 128, 256, 512):
        return False
    vec_size = max(16 // case.itemsize, case.head_size // 32)
    threads = case.head_size // vec_size * case.heads
    if case.kind == "two-way" or (case.kind == "n-way" and case.states < case.tokens):
        return threads <= 1024
    return True


# (tokens, heads, head_size): two-way, bfloat16 unless a fourth entry names the dtype.
TWO_WAY = [
    (1, 32, 128), (16, 32, 128), (64, 32, 128), (256, 32, 128), (613, 16, 96),
    (1024, 32, 128), (4096, 32, 128), (8192, 32, 128), (16384, 32, 128), (32768, 32, 128),
    (4096, 128, 128), (8192, 128, 128), (4096, 32, 64), (4096, 32, 256), (8192, 16, 512),
    (4096, 32, 128, "float16"), (4096, 32, 128, "float32"),
]  # fmt: skip
QUICK_TWO_WAY = [(1, 32, 128), (64, 32, 128), (1024, 32, 128), (8192, 32, 128), (8192, 128, 128)]
# (states, tokens): N-way at 32 heads of 128; the second line is few tokens by many states.
N_WAY = [
    (16, 1), (16, 64), (64, 64), (4, 4096), (8, 8192), (16, 1024), (64, 256), (256, 16),
    *((states, tokens) for tokens in (1, 2, 8) for states in (256, 1024, 4096)),
]  # fmt: skip
QUICK_N_WAY = [(16, 64), (4, 4096), (1024, 1), (256, 8)]
# (mean states per token, tokens): ragged at 32 heads of 128.
RAGGED = [(8, 1024), (16, 4096), (100, 64), (100, 512), (200, 64), (200, 512)]
QUICK_RAGGED = [(8, 1024), (200, 64)]
# (tokens, heads, head_size): bfloat16 in, FP8 (or NVFP4) out; 128 heads as vLLM's measurement of its fused op.
FP8 = [(1, 128, 128), (64, 32, 128), (1024, 128, 128), (4096, 32, 128), (8192, 32, 128), (16384, 32, 128)]
QUICK_FP8 = [(1, 128, 128), (1024, 128, 128), (8192, 32, 128)]
# Sinks: each case timed with and without, in the same run.
SINKS = [
    Case("two-way+sinks", 4096),
    Case("two-way+sinks", 1),
    Case("n-way+sinks", 1024, states=16),
    Case("n-way+sinks", 1, states=1024),
    Case("ragged+sinks", 1024, states=8),
]
QUICK_SINKS = SINKS
# Gradients, ~1 MB to a few hundred MB of traffic (two-way tokens; N-way and ragged (states, tokens));
# the second line of each family is few rows of many states.
BACKWARD = [
    *(Case("two-way-bwd", tokens) for tokens in (64, 1024, 4096, 8192)),
    *(Case("n-way-bwd", tokens, states=states) for states, tokens in ((4, 16), (16, 64), (4, 1024),
                                                                         (16, 1024), (4, 4096))),
    *(Case("n-way-bwd", tokens, states=states) for states, tokens in ((64, 64), (256, 8), (1024, 1))),
    *(Case("ragged-bwd", tokens, states=8) for tokens in (64, 512, 4096)),
    Case("ragged-bwd", 64, states=100),
]  # fmt: skip
QUICK_BACKWARD = [
    Case("two-way-bwd", 1024),
    Case("n-way-bwd", 1024, states=16),
    Case("ragged-bwd", 512, states=8),
]
# (tokens, heads, head_size) of the host-cost table: decode sizes, where host cost matters.
HOST_SHAPES = [(1, 32, 128), (16, 32, 128), (64, 32, 128)]
QUICK_HOST_SHAPES = [(1, 32, 128), (64, 32, 128)]


def _two_way(shape) -> Case:
    tokens, heads, head_size, *dtype = shape
    return Case("two-way", tokens, heads, head_size, *dtype)


def all_cases(quick: bool = False) -> list[Case]:
    """The merge table's cases, in table order: every family of :data:`FAMILIES`."""
    cases = [_two_way(shape) for shape in (QUICK_TWO_WAY if quick else TWO_WAY)]
    cases += [Case("n-way", t, states=s) for s, t in (QUICK_N_WAY if quick else N_WAY)]
    cases += [Case("ragged", t, states=m) for m, t in (QUICK_RAGGED if quick else RAGGED)]
    for family in ("fp8", "fp8-group", "nvfp4"):
        cases += [Case(family, *shape) for shape in (QUICK_FP8 if quick else FP8)]
    cases += QUICK_SINKS if quick else SINKS
    cases += QUICK_BACKWARD if quick else BACKWARD
    return cases


def host_cases(quick: bool = False) -> list[Case]:
    """The host-cost table's cases: two-way merges of decode size."""
    return [_two_way(shape) for shape in (QUICK_HOST_SHAPES if quick else HOST_SHAPES)]


def select(cases: list[Case], families: list[str] | None) -> list[Case]:
    """The cases of the given families (all of them for None), order kept."""
    return list(cases) if families is None else [case for case in cases if case.family in families]
