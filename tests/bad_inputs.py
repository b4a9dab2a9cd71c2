"""Every bad input to a two-way merge, described once and built either as ArrayViews (no GPU) or real arrays.

A case changes one argument of an otherwise valid ``merge_state`` call and
names the exception and the argument the message must start with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TOKENS, HEADS, HEAD_SIZE = 5, 3, 16


@dataclass(frozen=True)
class Spec:
    shape: tuple
    dtype: str
    last_stride: int = 1
    device: int = 0
    overlaps: str | None = None  # another argument this one partly overlaps
    byte_offset: int = 0  # start this many bytes into an aligned buffer (misaligned when not a multiple)
    broadcast: bool = False  # every token the same memory (token stride 0), as expand() makes


VALUES = Spec((TOKENS, HEADS, HEAD_SIZE), "float16")
LSE = Spec((HEADS, TOKENS), "float32")
VALID = {"out": VALUES, "out_lse": LSE, "v_a": VALUES, "s_a": LSE, "v_b": VALUES, "s_b": LSE}


@dataclass(frozen=True)
class BadCase:
    id: str
    argument: str
    spec: Spec
    error: type
    needs_devices: int = 1


BAD_CASES = [
    BadCase("values-2d", "v_a", replace(VALUES, shape=(TOKENS, HEADS * HEAD_SIZE)), ValueError),
    BadCase("lse-3d", "s_a", replace(LSE, shape=(HEADS, TOKENS, 1)), ValueError),
    BadCase("out-4d", "out", replace(VALUES, shape=(TOKENS, HEADS, HEAD_SIZE, 1)), ValueError),
    BadCase(
        "values-shape-mismatch", "v_b", replace(VALUES, shape=(TOKENS, HEADS, HEAD_SIZE + 8)), ValueError
    ),
    BadCase("lse-token-major", "s_b", replace(LSE, shape=(TOKENS, HEADS)), ValueError),
    BadCase("lse-too-few-tokens", "s_a", replace(LSE, shape=(HEADS, TOKENS - 1)), ValueError),
    BadCase("out-shape-mismatch", "out", replace(VALUES, shape=(TOKENS + 1, HEADS, HEAD_SIZE)), ValueError),
    BadCase("out-lse-shape-mismatch", "out_lse", replace(LSE, shape=(HEADS + 1, TOKENS)), ValueError),
    BadCase("float64-values", "v_a", replace(VALUES, dtype="float64"), TypeError),
    BadCase("integer-values", "v_a", replace(VALUES, dtype="int32"), TypeError),
    BadCase("mixed-value-dtypes", "v_b", replace(VALUES, dtype="float32"), TypeError),
    BadCase("float64-out", "out", replace(VALUES, dtype="float64"), TypeError),
    BadCase("float16-lse", "s_a", replace(LSE, dtype="float16"), TypeError),
    BadCase("integer-lse", "s_b", replace(LSE, dtype="int32"), TypeError),
    BadCase("float64-out-lse", "out_lse", replace(LSE, dtype="float64"), TypeError),
    BadCase("strided-head-dim", "v_b", replace(VALUES, last_stride=2), ValueError),
    BadCase("strided-out-head-dim", "out", replace(VALUES, last_stride=2), ValueError),
    BadCase("lse-on-other-device", "s_b", replace(LSE, device=1), ValueError, needs_devices=2),
    BadCase("out-on-other-device", "out", replace(VALUES, device=1), ValueError, needs_devices=2),
    BadCase("out-partly-overlaps-input", "out", replace(VALUES, overlaps="v_a"), ValueError),
    BadCase("out-lse-partly-overlaps-input", "out_lse", replace(LSE, overlaps="s_b"), ValueError),
    BadCase("misaligned-lse", "s_a", replace(LSE, byte_offset=2), ValueError),
    BadCase("misaligned-out-lse", "out_lse", replace(LSE, byte_offset=2), ValueError),
    BadCase("misaligned-values", "v_b", replace(VALUES, byte_offset=1), ValueError),
    BadCase("misaligned-out", "out", replace(VALUES, byte_offset=1), ValueError),
    BadCase("broadcast-out", "out", replace(VALUES, broadcast=True), ValueError),
    BadCase("broadcast-out-lse", "out_lse", replace(LSE, broadcast=True), ValueError),
]


def specs_for(case: BadCase) -> dict:
    specs = dict(VALID)
    specs[case.argument] = case.spec
    return specs


#: merge_state's argument names -> merge_attn_states' names.
VLLM_NAMES = {
    "out": "output",
    "out_lse": "output_lse",
    "v_a": "prefix_output",
    "s_a": "prefix_lse",
    "v_b": "suffix_output",
    "s_b": "suffix_lse",
}
