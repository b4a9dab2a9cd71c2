"""The address rules: outputs that overlap inputs or each other, refused with the arguments named.

Functions of :class:`ArrayView` (shapes, strides and addresses), run where addresses exist (eager
calls, ``bind``), after the shape rules (``_checks``). An output may be exactly an input where a
merge writes in place; it may never partly overlap one, and an N-way or cross-rank merge's outputs
may not alias its inputs at all (it reads them many times).
"""

from __future__ import annotations

from typing import NamedTuple

from ._array_rules import named_operands
from ._arrays import ArrayView
from ._operands import ManyStateOperands, RankOperands, TwoStateOperands


def _byte_extent(view: ArrayView) -> tuple[int, int] | None:
    """[first, last) byte touched by ``view``; ``None`` for an empty array or a fresh output (null)."""
    if 0 in view.shape or view.ptr == 0:
        return None
    low = high = 0
    for extent, stride in zip(view.shape, view.strides):
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return view.ptr + low * view.itemsize, view.ptr + (high + 1) * view.itemsize


def overlaps(a: ArrayView, b: ArrayView) -> bool:
    extent_a, extent_b = _byte_extent(a), _byte_extent(b)
    if extent_a is None or extent_b is None:
        return False
    return extent_a[0] < extent_b[1] and extent_b[0] < extent_a[1]


def expect_no_partial_overlap(
    outputs: list[tuple[ArrayView, str]], inputs: list[tuple[ArrayView, str]]
) -> None:
    """An output may be exactly an input (in place) but must not partly overlap anything."""
    for index, (out, out_name) in enumerate(outputs):
        for other, other_name in inputs + outputs[index + 1 :]:
            in_place = out == other and (other, other_name) in inputs
            if not in_place and overlaps(out, other):
                raise ValueError(
                    f"{out_name}: overlaps {other_name} in memory without being the very same "
                    f"array; write in place only into an identical array (same pointer, shape "
                    f"and strides), or into separate memory"
                )


def expect_separate(outputs: list[tuple[ArrayView, str]], inputs: list[tuple[ArrayView, str]]) -> None:
    """Outputs that may not alias the inputs at all (or each other)."""
    for index, (output, output_name) in enumerate(outputs):
        for view, name in inputs + outputs[index + 1 :]:
            if overlaps(output, view):
                raise ValueError(
                    f"{output_name}: expected memory separate from {name}; the merge reads its "
                    f"inputs many times and cannot write over them"
                )


def _scales_apart(views: NamedTuple, names: NamedTuple) -> None:
    """Neither kind of FP8 scale may share memory with another array of the call: the per-tensor
    scale is read by every thread while outputs are written, the group scales are written."""
    for field in ("output_scale", "output_block_scale"):
        scale = getattr(views, field)
        if scale is None:
            continue
        for other, other_name in named_operands(views, names, views._fields):
            if other is not scale and overlaps(scale, other):
                raise ValueError(
                    f"{getattr(names, field)}: overlaps {other_name} in memory; the scale needs its own memory"
                )


def check_two_addresses(views: TwoStateOperands, names: TwoStateOperands) -> None:
    """Every address rule of a two-way call: outputs in place or apart, scales apart."""
    _scales_apart(views, names)
    inputs = named_operands(views, names, ("v_a", "s_a", "v_b", "s_b", "mask", "sinks", "output_scale"))
    outputs = named_operands(views, names, ("out", "out_lse", "output_block_scale"))
    expect_no_partial_overlap(outputs, inputs)


def check_many_addresses(views: ManyStateOperands, names: ManyStateOperands) -> None:
    """Every address rule of an N-way call: the N-way merge reads its inputs many times, so
    its outputs may not alias them at all; scales apart."""
    _scales_apart(views, names)
    inputs = named_operands(views, names, ("v", "s", "indptr", "sinks", "output_scale"))
    outputs = named_operands(views, names, ("out", "out_lse", "output_block_scale"))
    expect_separate(outputs, inputs)


def check_rank_addresses(views: RankOperands, names: RankOperands) -> None:
    """The outputs may not alias the inputs or each other (collectives read and write around them)."""
    inputs = [(getattr(views, f), getattr(names, f)) for f in ("v", "s", "sinks") if getattr(views, f) is not None]
    outputs = [(getattr(views, f), getattr(names, f)) for f in ("out", "out_lse") if getattr(views, f) is not None]
    expect_separate(outputs, inputs)
