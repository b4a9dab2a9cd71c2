"""A peer's merge as a declaration: which core merge it is, and each argument's core operand and
layout in the peer's own axis names. :class:`PeerMerge` derives the rest: the checks in the peer's
words, the results allocated in the peer's layout, and the views the core merge is handed (their
axis order from the peer's layout and the core's, ``_ops``), so no drop-in is written by hand.

>>> MERGE_STATE = PeerMerge(                                    # doctest: +SKIP
...     _ops.MERGE_STATE, (Arg("v_a", "v_a", VALUES), Arg("v_b", "v_b", VALUES), Arg("s_a", "s_a", LSE),
...     Arg("s_b", "s_b", LSE)), results=(Arg("V", "out", VALUES), Arg("S", "out_lse", LSE)), ...)
>>> V, S = MERGE_STATE({"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b}, stream, lse_base=2)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy_merge as _cm

from .. import _ops
from . import (
    INDEX_DTYPES,
    VALUE_DTYPES,
    bytes_as_bool,
    cast,
    dtype_of,
    empty,
    expect_dtype,
    expect_like,
    expect_ndim,
    expect_shape,
    expect_unit_last_stride,
    expect_values,
    index_array,
    lse_input,
    lse_output,
    permute,
    refuse_grad,
    shape_of,
    take,
)

#: The peers' axis names, as the core's axes: T tokens, H heads, D the head size, N states a
#: token, R ragged rows, O offsets.
AXES = {"seq_len": "T", "num_heads": "H", "head_dim": "D", "num_states": "N", "total_num_states": "R",
        "seq_len + 1": "O"}  # fmt: skip
#: The core's axes of each operand layout (a token-major operand: as many as it has).
_CORE_AXES = {
    _ops.VALUES: "THD", _ops.TOKENS: "THD", _ops.LSE: "HT", _ops.STACKED: "NTHD", _ops.STACKED_LSE: "NHT",
    _ops.ROWS: "RHD", _ops.ROW_LSE: "HR", _ops.OFFSETS: "O",
}  # fmt: skip
_VALUE_LAYOUTS = (_ops.VALUES, _ops.STACKED, _ops.ROWS)
_LSE_LAYOUTS = (_ops.LSE, _ops.STACKED_LSE, _ops.ROW_LSE)
#: Offset dtypes the peers cast to int32 themselves (a copy here too).
_CASTABLE_OFFSETS = ("int16", "int8", "uint8", "uint16", "uint32")
#: Mask dtypes read as FlashInfer's CUDA kernel reads a mask, a byte a token, nonzero merging (a bool view).
_BYTE_FLAGS = ("uint8", "int8")


@dataclass(frozen=True)
class Arg:
    """One argument of a peer's merge: its name, the core operand field it is, its axes in the
    peer's names (:data:`AXES`). An LSE of float16, bfloat16 or float64 is cast to a float32 copy
    where ``castable`` (the peer casts it), else refused with ``note``; a mask refused with it."""

    name: str
    field: str
    axes: tuple[str, ...]
    castable: bool = True
    note: str = ""

    @property
    def layout(self) -> str:
        return "[" + ", ".join(self.axes) + "]"


@dataclass(frozen=True)
class PeerMerge:
    """One peer's merge: the core ``operation`` it calls, its ``arguments`` in the order they are
    checked (the first, values, sizes every axis; offsets size ``seq_len``), the ``results`` it
    returns (allocated C-contiguous in the peer's layout where the caller gives none), and the
    words of its errors: ``values_convention``, ``convention`` (of its LSEs) and ``swapped`` (a
    hint for a 2-D LSE given with its extents swapped)."""

    operation: _ops.Operation
    arguments: tuple[Arg, ...]
    results: tuple[Arg, ...]
    values_convention: str
    convention: str
    swapped: str = ""

    def __call__(self, given: dict[str, Any], stream: Any, convention: str = "", **options: Any) -> tuple | None:
        """Check the arguments ``given`` by the peer's names, call the core merge with ``options``
        on ``stream``, and return the results (None for an in-place merge)."""
        first, *rest = self.arguments
        values, adapter = take(given[first.name], first.name)
        shape = expect_values(values, first.name, len(first.axes), first.layout, self.values_convention)
        sizes = dict(zip(first.axes, shape))
        convention = convention or self.convention
        core = {first.field: values}
        for arg in rest:
            if arg.field in self.operation.required or given.get(arg.name) is not None:
                core[arg.field] = self._input(arg, given.get(arg.name), first, values, sizes, convention)
        results = []
        for arg in self.results:
            extents = tuple(sizes[axis] for axis in arg.axes)
            obj = given.get(arg.name)
            if obj is None:
                obj = empty(values, adapter, extents, dtype_of(values) if arg.field == "out" else "float32", stream)
            else:
                obj = self._output(arg, obj, extents, first, convention)
            results.append(obj)
            core[arg.field] = obj
        by_arg = {arg.field: arg for arg in (*self.arguments, *self.results)}
        refuse_grad(((by_arg[field].name, x) for field, x in core.items()),
                    self.operation.name if self.operation.backward else "merge_state")  # fmt: skip
        names = self.operation.names
        views = {getattr(names, field): self._core_view(by_arg[field], x) for field, x in core.items()}
        getattr(_cm, self.operation.name)(**views, **options, stream=stream)
        return tuple(results) if results else None

    def _input(self, arg: Arg, obj: Any, first: Arg, values: Any, sizes: dict, convention: str) -> Any:
        """An input after ``first``, checked: values like the first; an LSE, offsets or a mask of
        the extents its axes have."""
        layout = self.operation.layouts[arg.field]
        if layout in _VALUE_LAYOUTS:
            obj, _ = take(obj, arg.name)
            expect_like(obj, values, arg.name, first.name)
            return obj
        if layout in _LSE_LAYOUTS:
            extents = tuple(sizes[axis] for axis in arg.axes)
            hint = self.swapped if len(extents) == 2 else ""
            return lse_input(obj, arg.name, extents, arg.layout, first.name, convention, castable=arg.castable,
                             swapped_hint=hint, cast_note=arg.note)  # fmt: skip
        if layout is _ops.OFFSETS:
            obj = index_array(obj, arg.name, INDEX_DTYPES + _CASTABLE_OFFSETS, arg.layout)
            if dtype_of(obj) not in INDEX_DTYPES:
                obj = cast(obj, "int32")
            (count,) = shape_of(obj)
            if count < 1:
                raise ValueError(f"{arg.name}: expected {arg.layout} offsets, at least one (0), got an empty array")
            sizes["seq_len"] = count - 1
            return obj
        obj, _ = take(obj, arg.name)  # a mask
        expect_ndim(obj, 1, arg.name, arg.layout, "one flag a token")
        expect_shape(obj, (sizes["seq_len"],), arg.name, arg.layout, first.name, "one flag a token")
        if dtype_of(obj) in _BYTE_FLAGS:
            return bytes_as_bool(obj)
        if dtype_of(obj) != "bool":
            raise TypeError(
                f"{arg.name}: expected dtype bool, uint8 or int8 {arg.layout} (nonzero merges the token), "
                f"got {dtype_of(obj)}; {arg.note}"
            )
        return obj

    def _output(self, arg: Arg, obj: Any, extents: tuple[int, ...], first: Arg, convention: str) -> Any:
        """A result the caller gave, checked: values of any value dtype, an LSE of float32."""
        if arg.field != "out":
            return lse_output(obj, arg.name, extents, arg.layout, first.name, convention)
        obj, _ = take(obj, arg.name)
        expect_ndim(obj, len(extents), arg.name, arg.layout, self.values_convention)
        expect_shape(obj, extents, arg.name, arg.layout, first.name, self.values_convention)
        expect_dtype(obj, arg.name, VALUE_DTYPES)
        expect_unit_last_stride(obj, arg.name, arg.layout)
        return obj

    def _core_view(self, arg: Arg, obj: Any) -> Any:
        """``obj`` as the core takes it: its axes in the core's order (a view)."""
        peer = [AXES[axis] for axis in arg.axes]
        order = tuple(peer.index(axis) for axis in _CORE_AXES[self.operation.layouts[arg.field]][: len(peer)])
        return obj if order == tuple(range(len(order))) else permute(obj, *order)
