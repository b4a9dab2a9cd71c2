"""The kernels as the host sees them: families, template arguments, parameter order, modules.

Each :class:`KernelFamily` mirrors one ``__global__`` template in ``cuda_src/``:
its template parameters and its parameters, in order (a test parses the ``.cu``
source and compares). Plans name arguments by parameter; :meth:`KernelFamily.arguments`
puts them in the kernel's order, so no argument tuple is written out anywhere else.

A *module* is what NVRTC compiles at once: one source file for one (input dtype,
output dtype) pair and set of compile options, holding every instantiation the
planner may choose for it; merges with attention sinks have modules of their own
(``Module.sinks``), compiled only when a merge with sinks first runs.
"""

from __future__ import annotations

from typing import NamedTuple

from . import _tuning

#: Value dtype name -> the C++ type the kernels are instantiated with.
VALUE_CTYPES = {
    "float32": "float",
    "float16": "cupy_merge::half_t",
    "bfloat16": "cupy_merge::bfloat16_t",
}
#: FP8 (OCP float8_e4m3fn): an output dtype only, written with a per-tensor or per-group scale.
FP8 = "float8_e4m3fn"
#: NVFP4 (e2m1 values two a byte, torch's ``float4_e2m1fn_x2``): an output dtype only, written
#: with a float8_e4m3fn scale per 16 values and a float32 global scale.
NVFP4 = "float4_e2m1fn_x2"
#: Values per NVFP4 block scale.
NVFP4_BLOCK = 16
#: Output dtype name -> C++ type: the value dtypes, FP8 and NVFP4.
OUTPUT_CTYPES = {**VALUE_CTYPES, FP8: "cupy_merge::fp8_e4m3_t", NVFP4: "cupy_merge::nvfp4x2_t"}
#: Bytes an element; an NVFP4 element holds two values.
ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8: 1, NVFP4: 1}
#: Values an element holds (1 but for NVFP4).
VALUES_PER_ELEMENT = {NVFP4: 2}
#: Elements of any array lie within this many of its start for the 32-bit kernels
#: (2**30, not 2**31, leaves room for the sums a grid-stride loop forms past the last item).
INDEX_32_LIMIT = 2**30
#: The largest FP8 group: a group's packs are threads of one block.
MAX_QUANT_GROUP = 1024
#: The most states one token merges (kMaxStatesPerToken in cuda_src/ragged.cuh): float32 sums
#: of 2^16 equal terms are off by up to 7e-4 of their value, and drift further beyond.
MAX_STATES_PER_TOKEN = 65536

TWO_STATES_SOURCE = "merge_two_states.cu"
MANY_STATES_SOURCE = "merge_many_states.cu"
RANKS_SOURCE = "merge_across_ranks.cu"
BACKWARD_SOURCE = "merge_backward.cu"
BACKWARD_FROM_OUTPUT_SOURCE = "merge_backward_from_output.cu"


class KernelFamily(NamedTuple):
    source: str
    name: str
    template: tuple[str, ...]
    params: tuple[str, ...]

    def instance(self, **template_arguments: object) -> str:
        """The C++ name expression of one instantiation, e.g. ``cupy_merge::f<float, 4>``."""
        if set(template_arguments) != set(self.template):
            raise TypeError(
                f"{self.name}: template arguments {sorted(template_arguments)} != {self.template}"
            )
        text = ", ".join(_cpp(template_arguments[name]) for name in self.template)
        return f"cupy_merge::{self.name}<{text}>"

    def arguments(self, **values: int) -> tuple[int, ...]:
        """The kernel's arguments in parameter order; every parameter must be given."""
        if set(values) != set(self.params):
            missing, extra = set(self.params) - set(values), set(values) - set(self.params)
            raise TypeError(f"{self.name}: missing arguments {sorted(missing)}, unknown {sorted(extra)}")
        return tuple(int(values[name]) for name in self.params)

    def position(self, param: str) -> int:
        return self.params.index(param)


def _cpp(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value in OUTPUT_CTYPES:
        return OUTPUT_CTYPES[value]
    return str(value)


#: The packed kernels' numbering of output packs over (token, head, pack)
#: (``_plan._packed_geometry`` fills them).
PACKED_GEOMETRY = (
    "total_packs", "packs_per_token", "token_multiplier", "token_shift",
    "packs_per_row", "head_multiplier", "head_shift",
)  # fmt: skip
#: The packed kernels' FP8 group scales (``_plan._group_geometry``).
GROUP_SCALES = (
    "output_block_scale", "block_scale_stride_token", "block_scale_stride_group",
    "packs_per_group", "group_multiplier", "group_shift", "scale_ue8m0",
    "block_scale_col_tiles", "block_scale_rows", "block_scale_padded_rows",
)  # fmt: skip
#: Every merge kernel's last parameters: attention sinks (read when SINKS).
SINKS = ("sinks", "sinks_stride")

TWO_STRIDED = KernelFamily(
    TWO_STATES_SOURCE,
    "merge_two_states",
    ("TIn", "TOut", "VEC", "ROWS", "Index", "SINKS"),
    (
        "out", "out_lse", "output_scale", "v_a", "lse_a", "v_b", "lse_b", "mask",
        "num_tokens", "num_heads", "head_size", "merge_tokens",
        "out_stride_token", "out_stride_head", "a_stride_token", "a_stride_head",
        "b_stride_token", "b_stride_head",
        "out_lse_stride_head", "out_lse_stride_token", "lse_a_stride_head", "lse_a_stride_token",
        "lse_b_stride_head", "lse_b_stride_token",
        "mask_stride", "lse_base_2", "out_lse_is_input", *SINKS,
    ),
)  # fmt: skip

TWO_PACKED = KernelFamily(
    TWO_STATES_SOURCE,
    "merge_two_states_packed",
    ("TIn", "TOut", "VEC", "STREAMING", "LSE_IN_PLACE", "GROUPED", "SINKS"),
    (
        "out", "out_lse", "output_scale", "v_a", "lse_a", "v_b", "lse_b", "mask",
        *PACKED_GEOMETRY, "merge_tokens",
        "out_stride_token", "a_stride_token", "b_stride_token",
        "out_lse_stride_head", "out_lse_stride_token", "lse_a_stride_head", "lse_a_stride_token",
        "lse_b_stride_head", "lse_b_stride_token",
        "mask_stride", "lse_base_2",
        *GROUP_SCALES, *SINKS,
    ),
)  # fmt: skip

MANY_STRIDED = KernelFamily(
    MANY_STATES_SOURCE,
    "merge_many_states",
    ("TIn", "TOut", "VEC", "SPLIT", "Index", "SINKS"),
    (
        "out", "out_lse", "output_scale", "v", "lse", "indptr", "indptr_bytes", "indptr_stride",
        "num_states", "num_tokens", "num_heads", "head_size",
        "out_stride_token", "out_stride_head", "v_stride_state", "v_stride_token", "v_stride_head",
        "out_lse_stride_head", "out_lse_stride_token",
        "lse_stride_state", "lse_stride_head", "lse_stride_token", "lse_base_2", *SINKS,
    ),
)  # fmt: skip

#: Parameters in the order of the constant-cache lines they are read from (the kernel's
#: comment says why): what a dense launch reads, then the FP8 scale, ragged offsets and groups.
MANY_PACKED = KernelFamily(
    MANY_STATES_SOURCE,
    "merge_many_states_packed",
    ("TIn", "TOut", "VEC", "SPLIT", "RAGGED", "GROUPED", "SINKS"),
    (
        "v", "lse",
        "num_states", "total_packs", "packs_per_token", "token_multiplier", "token_shift",
        "head_multiplier", "head_shift", "v_stride_state",
        "out", "out_lse",
        "v_stride_token", "lse_stride_state", "lse_stride_head", "lse_stride_token",
        "block_packs", "block_splits",
        "packs_per_row", "out_stride_token", "out_lse_stride_head", "out_lse_stride_token",
        "lse_base_2",
        "output_scale", "indptr", "indptr_bytes", "indptr_stride",
        *GROUP_SCALES, *SINKS,
    ),
)  # fmt: skip

RANK_PACK = KernelFamily(
    RANKS_SOURCE,
    "pack_states",
    ("T", "VEC"),
    (
        "packed", "v", "lse", "num_tokens", "num_heads", "head_size", "heads_per_shard",
        "chunk_bytes", "lse_offset", "v_stride_token", "v_stride_head", "lse_stride_head", "lse_stride_token",
    ),
)  # fmt: skip

RANK_SCALE = KernelFamily(
    RANKS_SOURCE,
    "scale_for_sum",
    ("T", "VEC"),
    (
        "scaled", "out_lse", "v", "gathered_lse", "world", "rank", "num_tokens", "num_heads", "head_size",
        "heads_per_shard", "chunk_elements", "first_head", "out_heads",
        "v_stride_token", "v_stride_head", "out_lse_stride_head", "out_lse_stride_token", "lse_base_2",
        *SINKS,
    ),
)  # fmt: skip

#: The gradient of every merge (two-way, N-way, ragged): states 0 and 1.. at their own pointers.
BACKWARD = KernelFamily(
    BACKWARD_SOURCE,
    "merge_states_backward",
    ("TIn", "TOut", "VEC", "PACKS", "SHORT", "RAGGED", "SINKS", "Index"),
    (
        "gv0", "gv1", "gs0", "gs1", "sink_terms", "v0", "v1", "s0", "s1", "grad_out", "grad_lse", "sinks",
        "indptr", "indptr_bytes", "indptr_stride", "num_states", "num_tokens", "num_heads", "head_size",
        "v0_stride_token", "v0_stride_head", "v1_stride_token", "v1_stride_head", "v_stride_state",
        "gv0_stride_token", "gv0_stride_head", "gv1_stride_token", "gv1_stride_head", "gv_stride_state",
        "s0_stride_head", "s0_stride_token", "s1_stride_head", "s1_stride_token", "s_stride_state",
        "gs0_stride_head", "gs0_stride_token", "gs1_stride_head", "gs1_stride_token", "gs_stride_state",
        "grad_out_stride_token", "grad_out_stride_head", "grad_lse_stride_head", "grad_lse_stride_token",
        "sinks_stride", "lanes", "lse_base_2", "head_multiplier", "head_shift", "finish",
    ),
)  # fmt: skip

#: The gradient given the merge's results (``out``, ``out_lse``): every state's gradients its own.
BACKWARD_FROM_OUTPUT = KernelFamily(
    BACKWARD_FROM_OUTPUT_SOURCE,
    "merge_states_backward_from_output",
    ("TIn", "TOut", "VEC", "PACKS", "RAGGED", "SINKS", "Index"),
    (
        "gv0", "gv1", "gs0", "gs1", "sink_terms", "v0", "v1", "s0", "s1", "grad_out", "grad_lse", "out", "out_lse",
        "sinks", "indptr", "indptr_bytes", "indptr_stride", "num_states", "num_tokens", "num_heads", "head_size",
        "v0_stride_token", "v0_stride_head", "v1_stride_token", "v1_stride_head", "v_stride_state",
        "gv0_stride_token", "gv0_stride_head", "gv1_stride_token", "gv1_stride_head", "gv_stride_state",
        "s0_stride_head", "s0_stride_token", "s1_stride_head", "s1_stride_token", "s_stride_state",
        "gs0_stride_head", "gs0_stride_token", "gs1_stride_head", "gs1_stride_token", "gs_stride_state",
        "grad_out_stride_token", "grad_out_stride_head", "grad_lse_stride_head", "grad_lse_stride_token",
        "out_stride_token", "out_stride_head", "out_lse_stride_head", "out_lse_stride_token",
        "sinks_stride", "lanes", "lse_base_2", "head_multiplier", "head_shift",
    ),
)  # fmt: skip

#: The sinks' gradients from the rows' terms the gradient kernels store (in both gradient modules).
SUM_SINK_TERMS = KernelFamily(
    BACKWARD_SOURCE, "sum_sink_terms", ("THREADS",), ("grad_sinks", "sink_terms", "num_tokens", "num_heads")
)
#: Threads of a block of sum_sink_terms (one block a head).
SINK_SUM_THREADS = 256

FAMILIES = (
    TWO_STRIDED, TWO_PACKED, MANY_STRIDED, MANY_PACKED, RANK_PACK, RANK_SCALE, BACKWARD, BACKWARD_FROM_OUTPUT,
    SUM_SINK_TERMS,
)  # fmt: skip

#: Elements per vector pack, widest first, by the smaller element size of input
#: and output: 16-byte packs where shapes and alignment allow.
VECTOR_WIDTHS = {4: (4, 2, 1), 2: (8, 4, 2, 1)}
#: Instantiated values of the other template parameters (the planner chooses among them).
STRIDED_ROWS = (1, 2)
#: The gradient kernel's (PACKS, SHORT, RAGGED): PACKS the packs of a row each lane holds in
#: registers (0: rows longer than that loop over them); SHORT rows (dense, of at most 2 or 4
#: states: two-way merges) are held whole in registers.
BACKWARD_ROW_KINDS = ((0, 0, False), (0, 0, True), (1, 0, False), (1, 0, True), (1, 2, False), (1, 4, False),
                      (2, 0, False), (2, 0, True))  # fmt: skip
INDEX_TYPES = ("int", "long long")


def vector_widths(in_dtype: str, out_dtype: str) -> tuple[int, ...]:
    """Pack widths by the narrower dtype; an FP8 output's by its input (16-byte loads, 4-8 byte
    stores); an NVFP4 output's a whole block of 16 values first (a thread its scale alone), then
    as FP8's but at least 2 (a whole byte of two values)."""
    if out_dtype == NVFP4:  # a thread a whole block of 16 where it can: no exchange between threads
        return (NVFP4_BLOCK, *(vec for vec in VECTOR_WIDTHS[ITEMSIZES[in_dtype]] if vec >= 2))
    if out_dtype == FP8:
        return VECTOR_WIDTHS[ITEMSIZES[in_dtype]]
    return VECTOR_WIDTHS[min(ITEMSIZES[in_dtype], ITEMSIZES[out_dtype])]


def many_widths(in_dtype: str, out_dtype: str) -> tuple[int, ...]:
    """The N-way kernels' pack widths: an NVFP4 output's without the whole block of 16 values a
    thread (107 registers there against 48 in the two-way kernel; ptxas, session 27)."""
    widths = vector_widths(in_dtype, out_dtype)
    return widths[1:] if out_dtype == NVFP4 else widths


def full_pack(in_dtype: str, out_dtype: str) -> int:
    """Elements in a 16-byte pack of the narrower of the two dtypes (an FP8 output's input): the packed kernels' width."""
    return vector_widths(in_dtype, out_dtype)[0]


#: The NVRTC options of the default tuning.
DEFAULT_COMPILE_OPTIONS = _tuning.DEFAULT.compile_options


class Module(NamedTuple):
    source: str
    in_dtype: str
    out_dtype: str
    sinks: bool = False
    options: tuple[str, ...] = DEFAULT_COMPILE_OPTIONS


def module_instances(module: Module) -> list[str]:
    """Every instantiation compiled together in ``module``.

    FP8 outputs add the group-scaled packed kernels at every width (a group's
    size decides the widest that divides it). A sinks module holds the same
    instantiations with sinks.
    """
    a, b, sinks = module.in_dtype, module.out_dtype, module.sinks
    sum_sinks = [SUM_SINK_TERMS.instance(THREADS=SINK_SUM_THREADS)] if sinks else []
    if module.source == BACKWARD_SOURCE:
        return [
            BACKWARD.instance(
                TIn=a, TOut=b, VEC=vec, PACKS=held, SHORT=short, RAGGED=ragged, SINKS=sinks, Index=index
            )
            for vec in vector_widths(a, b)
            for held, short, ragged in BACKWARD_ROW_KINDS
            for index in INDEX_TYPES
        ] + sum_sinks
    if module.source == BACKWARD_FROM_OUTPUT_SOURCE:
        return [
            BACKWARD_FROM_OUTPUT.instance(
                TIn=a, TOut=b, VEC=vec, PACKS=held, RAGGED=ragged, SINKS=sinks, Index=index
            )
            for vec in vector_widths(a, b)
            for held in (0, 1, 2)
            for ragged in (False, True)
            for index in INDEX_TYPES
        ] + sum_sinks
    if module.source == RANKS_SOURCE:
        return [
            family.instance(T=a, VEC=vec)
            for family in (RANK_PACK, RANK_SCALE)
            for vec in (1, 16 // ITEMSIZES[a])
        ]
    widths, full = vector_widths(a, b), full_pack(a, b)
    grouped = [(full, False)] + ([(vec, True) for vec in widths] if b == FP8 else [])
    if b == NVFP4:  # always grouped, always packed
        grouped = [(vec, True) for vec in widths]
        if module.source == TWO_STATES_SOURCE:
            return [
                TWO_PACKED.instance(
                    TIn=a, TOut=b, VEC=vec, STREAMING=streaming, LSE_IN_PLACE=False, GROUPED=True, SINKS=sinks
                )
                for vec in widths
                for streaming in (False, True)
            ]
        return [
            MANY_PACKED.instance(TIn=a, TOut=b, VEC=vec, SPLIT=split, RAGGED=ragged, GROUPED=True, SINKS=sinks)
            for vec in many_widths(a, b)
            for split in (False, True)
            for ragged in (False, True)
        ]
    if module.source == TWO_STATES_SOURCE:
        return [
            TWO_STRIDED.instance(TIn=a, TOut=b, VEC=vec, ROWS=rows, Index=index, SINKS=sinks)
            for vec in widths
            for rows in STRIDED_ROWS
            for index in INDEX_TYPES
        ] + [
            TWO_PACKED.instance(
                TIn=a, TOut=b, VEC=vec, STREAMING=streaming, LSE_IN_PLACE=in_place, GROUPED=group, SINKS=sinks
            )
            for vec, group in grouped
            for streaming in (False, True)
            for in_place in ((False,) if group else (False, True))  # the group barriers order in-place LSEs
        ]
    return [
        MANY_STRIDED.instance(TIn=a, TOut=b, VEC=vec, SPLIT=split, Index=index, SINKS=sinks)
        for vec in widths
        for split in (False, True)
        for index in INDEX_TYPES
    ] + [
        MANY_PACKED.instance(TIn=a, TOut=b, VEC=vec, SPLIT=split, RAGGED=ragged, GROUPED=group, SINKS=sinks)
        for vec, group in grouped
        for split in (False, True)
        for ragged in (False, True)
    ]


def all_modules(options: tuple[str, ...] = DEFAULT_COMPILE_OPTIONS, sinks: bool = False) -> list[Module]:
    """Every module of the merges and their gradients (with sinks: their sinks modules) and of
    the cross-rank steps."""
    return (
        [
            Module(source, a, b, sinks, options)
            for source in (TWO_STATES_SOURCE, MANY_STATES_SOURCE)
            for a in VALUE_CTYPES
            for b in OUTPUT_CTYPES
        ]
        + [
            Module(source, a, b, sinks, options)
            for source in (BACKWARD_SOURCE, BACKWARD_FROM_OUTPUT_SOURCE)
            for a in VALUE_CTYPES
            for b in VALUE_CTYPES
        ]
        + ([] if sinks else [Module(RANKS_SOURCE, a, a, False, options) for a in VALUE_CTYPES])
    )


def every_module(options: tuple[str, ...] = DEFAULT_COMPILE_OPTIONS) -> list[Module]:
    """What ``python -m cupy_merge --arch`` compiles: every module, with sinks and without."""
    return all_modules(options) + all_modules(options, sinks=True)


def same_dtype_modules() -> list[Module]:
    """The merges' modules a caller without dtype conversion uses (compiled ahead by the self-check)."""
    return [
        module
        for module in all_modules()
        if module.in_dtype == module.out_dtype and module.source in (TWO_STATES_SOURCE, MANY_STATES_SOURCE)
    ]
