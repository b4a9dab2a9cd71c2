"""The conformance matrix, generated from the merges' declarations (``cupy_merge._ops``).

Every cell is one operation x one way of calling it x one variant (sinks or none, LSE base e or 2,
an FP8 output where the operation takes a scale). Nothing here names an operation: the inputs
come from each declaration's family (two states, stacked states, ragged rows), the call from its
public signature (which operands it reads and writes), the reference from ``cupy_merge.reference``,
the gradients from its backward declaration. A new operation or option in ``_ops`` is covered
without new test code; a cell that cannot work is listed in :data:`REFUSED` with the reason, and
its test checks that the call is refused with a clear error.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np

from cupy_merge import _ops, reference
from cupy_merge._operands import WRITTEN

TOKENS, HEADS, HEAD_SIZE, STATES = 5, 4, 64, 3
FP8 = "float8_e4m3fn"
SCALE = 0.25


class Variant(NamedTuple):
    sinks: bool
    lse_base: Any
    fp8: bool

    @property
    def id(self) -> str:
        return f"{'sinks' if self.sinks else 'plain'}-base{self.lse_base}{'-fp8' if self.fp8 else ''}"


FORWARD = [operation for operation in _ops.OPERATIONS.values() if not operation.is_backward]


def takes(operation: _ops.Operation, argument: str) -> bool:
    return argument in operation.signature.parameters  # type: ignore[union-attr]


def variants(operation: _ops.Operation) -> list[Variant]:
    fp8 = (False, True) if takes(operation, "output_scale") else (False,)
    return [Variant(*values) for values in itertools.product((False, True), ("e", 2), fp8)]


def cases(ways: list[str], differentiable: bool = False) -> list[tuple[_ops.Operation, Variant, str]]:
    """Every (operation, variant, way) cell; ``differentiable``: only operations with a backward, and
    variants without FP8 (rounding to FP8 has no gradient)."""
    cells = []
    for operation in FORWARD:
        if differentiable and operation.backward is None:
            continue
        for variant in variants(operation):
            if differentiable and variant.fp8:
                continue
            cells.extend((operation, variant, way) for way in ways)
    return cells


class Refusal(NamedTuple):
    """Cells that cannot work: refused before anything runs, with an error whose message has ``words``."""

    ways: tuple[str, ...]
    applies: Any  # (operation, variant) -> bool
    words: str  # a regular expression
    why: str


#: Every refused cell, by rule (docs/api.rst lists them): the matrix checks each one is refused.
REFUSED = (
    Refusal(("torch.autograd", "torch.autograd compiled"), lambda operation, variant: not operation.returns,
            "differentia", "a merge that writes into its arguments has no torch gradient (its JAX form "
            "returns new arrays, and the functional merges are differentiable)"),
    Refusal(("torch.autograd", "torch.autograd compiled", "jax.grad", "jax.shard_map grad"),
            lambda operation, variant: variant.fp8,
            r"FP8 \(float8_e4m3fn\) output is not differentiable",
            "an FP8 output has no gradient: rounding to FP8 is a step function"),
)  # fmt: skip


def refused_cases(ways: list[str]) -> list[tuple[_ops.Operation, Variant, str]]:
    """Every (operation, variant, way) cell a rule of :data:`REFUSED` refuses."""
    return [(operation, variant, way) for operation in FORWARD for variant in variants(operation) for way in ways
            if any(way in rule.ways and rule.applies(operation, variant) for rule in REFUSED)]  # fmt: skip


def case_id(cell: tuple) -> str:
    operation, variant, way = cell
    return f"{operation.name}-{variant.id}-{way}"


def family(operation: _ops.Operation) -> str:
    return "ragged" if operation.ragged else "stacked" if operation.many else "two"


def inputs(operation: _ops.Operation, variant: Variant, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random float32 inputs by field (values, LSEs with a wide range and an empty state,
    offsets with an empty token, sinks)."""
    def lse(*shape):
        x = (rng.standard_normal(shape) * 4).astype(np.float32)
        x.flat[0] = -np.inf  # an empty state somewhere
        return x

    arrays: dict[str, np.ndarray] = {}
    kind = family(operation)
    if kind == "two":
        for suffix in ("a", "b"):
            arrays[f"v_{suffix}"] = rng.standard_normal((TOKENS, HEADS, HEAD_SIZE)).astype(np.float32)
            arrays[f"s_{suffix}"] = lse(HEADS, TOKENS)
    elif kind == "stacked":
        arrays["v"] = rng.standard_normal((STATES, TOKENS, HEADS, HEAD_SIZE)).astype(np.float32)
        arrays["s"] = lse(STATES, HEADS, TOKENS)
    else:
        counts = np.array([2, 0, 3, 1, 4])[:TOKENS]
        arrays["indptr"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        rows = int(arrays["indptr"][-1])
        arrays["v"] = rng.standard_normal((rows, HEADS, HEAD_SIZE)).astype(np.float32)
        arrays["s"] = lse(HEADS, rows)
    if variant.sinks:
        arrays["sinks"] = rng.standard_normal(HEADS).astype(np.float32)
    return arrays


def reference_merge(operation: _ops.Operation, variant: Variant, arrays: dict) -> tuple[np.ndarray, np.ndarray]:
    """The float64 merge (quantised to FP8 values, as float64, for an FP8 output)."""
    kind = family(operation)
    sinks = arrays.get("sinks")
    if kind == "two":
        out, lse = reference.merge_state(arrays["v_a"], arrays["s_a"], arrays["v_b"], arrays["s_b"], variant.lse_base,
                                         sinks=sinks)  # fmt: skip
    elif kind == "stacked":
        out, lse = reference.merge_states(arrays["v"], arrays["s"], variant.lse_base, sinks=sinks)
    else:
        out, lse = reference.merge_states_varlen(arrays["v"], arrays["s"], arrays["indptr"], variant.lse_base,
                                                 check_indptr=False, sinks=sinks)  # fmt: skip
    if variant.fp8:
        out = reference.quantize_fp8(out, SCALE).astype(np.float64)
    return out, lse


def reference_gradients(operation: _ops.Operation, variant: Variant, arrays: dict, grad_out: np.ndarray,
                        grad_lse: np.ndarray) -> dict[str, np.ndarray]:  # fmt: skip
    """The float64 gradients by field of the operation's differentiable operands."""
    kind = family(operation)
    sinks = arrays.get("sinks")
    if kind == "two":
        grads = reference.merge_state_backward(arrays["v_a"], arrays["s_a"], arrays["v_b"], arrays["s_b"], grad_out,
                                               grad_lse, sinks=sinks, lse_base=variant.lse_base)  # fmt: skip
    elif kind == "stacked":
        grads = reference.merge_states_backward(arrays["v"], arrays["s"], grad_out, grad_lse, sinks=sinks,
                                                lse_base=variant.lse_base)  # fmt: skip
    else:
        grads = reference.merge_states_varlen_backward(arrays["v"], arrays["s"], arrays["indptr"], grad_out, grad_lse,
                                                       sinks=sinks, lse_base=variant.lse_base)  # fmt: skip
    return {field: grad for field, grad in zip(operation.gradients, grads) if grad is not None}


def public_arguments(operation: _ops.Operation, variant: Variant, arrays: dict, make: Any, nan_like: Any,
                     scale: Any = None) -> tuple[dict, dict]:  # fmt: skip
    """The public function's keyword arguments for ``arrays`` (``make(numpy array)`` gives the
    array kind), and the outputs it writes by field: required outputs are made and poisoned with
    NaN (``nan_like(shape, dtype_name)``); an in-place merge's state is a copy of its input."""
    names = operation.names
    kwargs: dict[str, Any] = {"lse_base": variant.lse_base}
    written: dict[str, Any] = {}
    read_names = {getattr(names, field) for field in names._fields if field not in WRITTEN}
    for field in names._fields:
        name = getattr(names, field)
        if not name or name in kwargs:
            continue
        if field in arrays:
            kwargs[name] = make(arrays[field])
    for field in ("out", "out_lse"):
        name = getattr(names, field)
        if field not in operation.required and not (field == "out_lse" and not operation.allocates):
            continue
        if name in read_names:  # in place: its state, a copy of the input
            written[field] = kwargs[name]
            continue
        shape = (TOKENS, HEADS, HEAD_SIZE) if field == "out" else (HEADS, TOKENS)
        dtype = FP8 if field == "out" and variant.fp8 else "float32"
        written[field] = kwargs[name] = nan_like(shape, dtype)
    if variant.fp8:
        kwargs["output_scale"] = scale
        if operation.allocates:
            kwargs["out_dtype"] = FP8
    return kwargs, written


def fp8_step(x: np.ndarray) -> np.ndarray:
    """The spacing of float8_e4m3fn at |x| (2^(e - 3); 2^-9 below 2^-6)."""
    magnitude = np.minimum(np.abs(x), 448.0)
    return 2.0 ** (np.floor(np.log2(np.maximum(magnitude, 2.0**-6))) - 3)


def expect_close(got: np.ndarray, want: np.ndarray, tolerance: float, what: str) -> None:
    """Float64 ``got`` against ``want``: NaN and infinities where the reference has them (nothing
    unwritten), then norm-relative error over the finite elements."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert (np.isnan(got) == np.isnan(want)).all(), f"{what}: NaN where the reference has none (unwritten?)"
    infinite = np.isinf(want)
    assert (got[infinite] == want[infinite]).all(), f"{what}: infinities differ"
    finite = np.isfinite(want)
    error = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"


def expect_merged(got_v: np.ndarray, got_s: np.ndarray, want: tuple, variant: Variant) -> None:
    want_v, want_s = want
    if variant.fp8:  # the kernel rounds its float32 merge: within one FP8 step of the float64 one
        assert got_v.shape == want_v.shape and not np.isnan(got_v).any(), "FP8 values unwritten"
        assert (np.abs(got_v - want_v) <= fp8_step(want_v)).all(), "FP8 values more than one step off"
    else:
        expect_close(got_v, want_v, 1e-5, "values")
    expect_close(got_s, want_s, 1e-6, "LSE")
