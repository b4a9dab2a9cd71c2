"""The vocabulary of a call: operands by name (one record per call family) and options by keyword.

A record type serves every stage of a call with the same fields: the user's
arrays, their descriptions (``ArrayView`` / ``ArraySpec``), and the argument
names the public function spells them with, for error messages. A new array
operand is one field here and its rule in ``_checks``; nothing is numbered.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class TwoStateOperands(NamedTuple):
    """The arrays of a two-way merge. ``out`` and ``out_lse`` are written (``out_lse`` may be None:
    not written), ``output_block_scale`` too (FP8 group scales); the rest are read."""

    out: Any
    out_lse: Any
    v_a: Any
    s_a: Any
    v_b: Any
    s_b: Any
    mask: Any = None
    sinks: Any = None
    output_scale: Any = None
    output_block_scale: Any = None


class ManyStateOperands(NamedTuple):
    """The arrays of an N-way merge: dense (``indptr`` None) or ragged."""

    out: Any
    out_lse: Any
    v: Any
    s: Any
    indptr: Any = None
    sinks: Any = None
    output_scale: Any = None
    output_block_scale: Any = None


class RankOperands(NamedTuple):
    """The arrays of a cross-rank merge: this rank's state, its outputs, the sinks."""

    v: Any
    s: Any
    out: Any = None
    out_lse: Any = None
    sinks: Any = None


class BackwardOperands(NamedTuple):
    """The arrays of a merge's gradient: the states merged (``v``, ``s``; a two-way merge's
    second state in ``v_b``, ``s_b``; a ragged batch's ``indptr``; the ``sinks``), the
    gradients of the merged values and LSE (``grad_out``, ``grad_lse``: None for 0), the
    merge's results if the caller kept them (``merged``, ``merged_lse``: both or neither), and
    the gradients written (allocated by the call)."""

    grad_v: Any
    grad_s: Any
    v: Any
    s: Any
    grad_out: Any
    grad_lse: Any = None
    v_b: Any = None
    s_b: Any = None
    grad_v_b: Any = None
    grad_s_b: Any = None
    indptr: Any = None
    sinks: Any = None
    grad_sinks: Any = None
    merged: Any = None
    merged_lse: Any = None


ForwardOperands = TwoStateOperands | ManyStateOperands
Operands = TwoStateOperands | ManyStateOperands | BackwardOperands

#: The operands every merge may write.
WRITTEN = frozenset({"out", "out_lse", "output_block_scale", "grad_v", "grad_s", "grad_v_b", "grad_s_b", "grad_sinks"})


class TwoStateOptions(NamedTuple):
    """Normalised options of a two-way merge (``_options.two_state_options`` builds them).

    ``merge_tokens``: tokens at or past it take state b (vLLM's
    ``prefill_tokens_with_context``); ``group_size``: FP8 group scales (None: none, or NVFP4's
    16); ``swizzled_scales``: NVFP4 block scales in the GEMMs' 128 x 4 tiles.
    """

    lse_base_2: int = 0
    merge_tokens: int | None = None
    out_dtype: str | None = None
    group_size: int | None = None
    scale_ue8m0: int = 0
    swizzled_scales: bool = True


class ManyStateOptions(NamedTuple):
    """Normalised options of an N-way merge (``_options.many_state_options`` builds them)."""

    lse_base_2: int = 0
    out_dtype: str | None = None
    check_indptr: bool = False
    group_size: int | None = None
    scale_ue8m0: int = 0
    swizzled_scales: bool = True


class BackwardOptions(NamedTuple):
    """Normalised options of a merge's gradient (``_options.backward_options`` builds them)."""

    lse_base_2: int = 0


Options = TwoStateOptions | ManyStateOptions | BackwardOptions


def given(operands: NamedTuple) -> dict[str, Any]:
    """The fields that hold something, by name."""
    return {name: value for name, value in zip(operands._fields, operands) if value is not None}


class StateShape(NamedTuple):
    """The merged state's shape, dtype and device, as the rules find them from the inputs."""

    num_tokens: int
    num_heads: int
    head_size: int
    dtype: str
    device: int
