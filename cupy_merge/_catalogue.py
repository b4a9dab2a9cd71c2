"""The kernels as the host sees them: families, template arguments, parameter order, modules.

Each :class:`KernelFamily` mirrors one ``__global__`` template in ``cuda_src/``:
its template parameters and its parameters, in order (a test parses the ``.cu``
source and compares). Plans name arguments by parameter; :meth:`KernelFamily.arguments`
puts them in the kernel's order, so no argument tuple is written out anywhere else.

A *module* is what NVRTC compiles at once: one source file for one (input dtype,
output dtype) pair, holding every instantiation the planner may choose for it.
"""

from __future__ import annotations

from typing import NamedTuple

#: Value dtype name -> the C++ type the kernels are instantiated with.
VALUE_CTYPES = {
    "float32": "float",
    "float16": "cupy_merge::half_t",
    "bfloat16": "cupy_merge::bfloat16_t",
}
ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

#: States the N-way kernels load per memory round trip (their MERGE_CHUNK): measured
#: best among 2, 4 and 8 for the strided kernel (session 3) and among 2 and 4 for the
#: packed one (session 4, sweep 1). Passed to NVRTC.
MERGE_CHUNK = 4
COMPILE_OPTIONS = ("-std=c++17", f"-DMERGE_CHUNK={MERGE_CHUNK}")

TWO_STATES_SOURCE = "merge_two_states.cu"
MANY_STATES_SOURCE = "merge_many_states.cu"


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
    if value in VALUE_CTYPES:
        return VALUE_CTYPES[value]
    return str(value)


TWO_STRIDED = KernelFamily(
    TWO_STATES_SOURCE,
    "merge_two_states",
    ("TIn", "TOut", "VEC", "ROWS", "Index"),
    (
        "out", "out_lse", "v_a", "lse_a", "v_b", "lse_b", "mask",
        "num_tokens", "num_heads", "head_size", "merge_tokens",
        "out_stride_token", "out_stride_head", "a_stride_token", "a_stride_head",
        "b_stride_token", "b_stride_head",
        "out_lse_stride_head", "out_lse_stride_token", "lse_a_stride_head", "lse_a_stride_token",
        "lse_b_stride_head", "lse_b_stride_token",
        "mask_stride", "lse_base_2", "out_lse_is_input",
    ),
)  # fmt: skip

TWO_PACKED = KernelFamily(
    TWO_STATES_SOURCE,
    "merge_two_states_packed",
    ("TIn", "TOut", "VEC", "STREAMING", "LSE_IN_PLACE"),
    (
        "out", "out_lse", "v_a", "lse_a", "v_b", "lse_b", "mask",
        "total_packs", "packs_per_token", "token_multiplier", "token_shift",
        "packs_per_row", "head_multiplier", "head_shift", "merge_tokens",
        "out_stride_token", "a_stride_token", "b_stride_token",
        "out_lse_stride_head", "out_lse_stride_token", "lse_a_stride_head", "lse_a_stride_token",
        "lse_b_stride_head", "lse_b_stride_token",
        "mask_stride", "lse_base_2",
    ),
)  # fmt: skip

MANY_STRIDED = KernelFamily(
    MANY_STATES_SOURCE,
    "merge_many_states",
    ("TIn", "TOut", "VEC", "SPLIT", "Index"),
    (
        "out", "out_lse", "v", "lse", "indptr", "indptr_bytes", "indptr_stride",
        "num_states", "num_tokens", "num_heads", "head_size",
        "out_stride_token", "out_stride_head", "v_stride_state", "v_stride_token", "v_stride_head",
        "out_lse_stride_head", "out_lse_stride_token",
        "lse_stride_state", "lse_stride_head", "lse_stride_token", "lse_base_2",
    ),
)  # fmt: skip

MANY_PACKED = KernelFamily(
    MANY_STATES_SOURCE,
    "merge_many_states_packed",
    ("TIn", "TOut", "VEC", "SPLIT"),
    (
        "out", "out_lse", "v", "lse", "indptr", "indptr_bytes", "indptr_stride",
        "num_states", "total_packs", "packs_per_token", "token_multiplier", "token_shift",
        "packs_per_row", "head_multiplier", "head_shift",
        "out_stride_token", "v_stride_state", "v_stride_token",
        "out_lse_stride_head", "out_lse_stride_token",
        "lse_stride_state", "lse_stride_head", "lse_stride_token", "lse_base_2",
    ),
)  # fmt: skip

FAMILIES = (TWO_STRIDED, TWO_PACKED, MANY_STRIDED, MANY_PACKED)

#: Elements per vector pack, widest first, by the smaller element size of input
#: and output: 16-byte packs where shapes and alignment allow.
VECTOR_WIDTHS = {4: (4, 2, 1), 2: (8, 4, 2, 1)}
#: Instantiated values of the other template parameters (the planner chooses among them).
STRIDED_ROWS = (1, 2)
INDEX_TYPES = ("int", "long long")


def vector_widths(in_dtype: str, out_dtype: str) -> tuple[int, ...]:
    return VECTOR_WIDTHS[min(ITEMSIZES[in_dtype], ITEMSIZES[out_dtype])]


def full_pack(in_dtype: str, out_dtype: str) -> int:
    """Elements in a 16-byte pack of the narrower of the two dtypes: the packed kernels' width."""
    return vector_widths(in_dtype, out_dtype)[0]


class Module(NamedTuple):
    source: str
    in_dtype: str
    out_dtype: str


def module_instances(module: Module) -> list[str]:
    """Every instantiation compiled together in ``module``."""
    a, b = module.in_dtype, module.out_dtype
    widths, full = vector_widths(a, b), full_pack(a, b)
    if module.source == TWO_STATES_SOURCE:
        return [
            TWO_STRIDED.instance(TIn=a, TOut=b, VEC=vec, ROWS=rows, Index=index)
            for vec in widths
            for rows in STRIDED_ROWS
            for index in INDEX_TYPES
        ] + [
            TWO_PACKED.instance(TIn=a, TOut=b, VEC=full, STREAMING=streaming, LSE_IN_PLACE=in_place)
            for streaming in (False, True)
            for in_place in (False, True)
        ]
    return [
        MANY_STRIDED.instance(TIn=a, TOut=b, VEC=vec, SPLIT=split, Index=index)
        for vec in widths
        for split in (False, True)
        for index in INDEX_TYPES
    ] + [MANY_PACKED.instance(TIn=a, TOut=b, VEC=full, SPLIT=split) for split in (False, True)]


def all_modules() -> list[Module]:
    return [
        Module(source, a, b)
        for source in (TWO_STATES_SOURCE, MANY_STATES_SOURCE)
        for a in VALUE_CTYPES
        for b in VALUE_CTYPES
    ]


def same_dtype_modules() -> list[Module]:
    """The modules a caller without dtype conversion uses (compiled ahead by the self-check)."""
    return [module for module in all_modules() if module.in_dtype == module.out_dtype]
