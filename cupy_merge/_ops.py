"""Every merge, declared once: its operands, options, results, gradients and forms.

An :class:`Operation` is what the dispatcher, ``bind`` and the framework integrations know of a
public merge. Its operand record (``_operands``) holds the public argument name of each operand
(which operands are written is the record's business: :data:`~cupy_merge._operands.WRITTEN`);
its options come from the public keyword arguments of the same names through its builder
(``_checks``); its results are the fields it returns; a differentiable merge names the backward
operation that gives its gradients and which of its operands they are of. The public function
itself (``merge.py``, ``merge_many.py``, ``backward.py``) is attached by :func:`declare`, so its
signature (argument order, defaults, keyword-only arguments) is part of the declaration too.

From these the torch integration generates its op schemas, eager kernels, fakes, traced calls
and autograd Functions (``torch_ops``), and ``bind`` its binder; nothing there is written per
merge. Adding a merge: a record of its operands, a declaration here, a kernel and a plan
(``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from . import _options
from ._operands import BackwardOperands, ManyStateOperands, Operands, Options, TwoStateOperands

#: What a merge returns: its values and LSE.
FORWARD_RESULTS = ("out", "out_lse")

# -- what each operand holds -----------------------------------------------------------------------
#: An operand's layout: the axes of its logical shape. A batching rule reads from it how a batch
#: of the operand folds into one launch's tokens (``_jax_batching``), an integration its natural
#: order. T tokens, H heads, D the head size, N states a token, R ragged rows.
VALUES = "values"  # one state's values [T, H, D]
TOKENS = "tokens"  # another array of a row a token [T, ...]: a mask, group scales, a result, a cotangent
LSE = "lse"  # [H, T]
STACKED = "stacked"  # N states of every token [N, T, H, D]
STACKED_LSE = "stacked_lse"  # [N, H, T]
ROWS = "rows"  # ragged states [R, H, D]: token t's are rows indptr[t]:indptr[t + 1]
ROW_LSE = "row_lse"  # [H, R]
OFFSETS = "offsets"  # [T + 1]
PER_HEAD = "per_head"  # [H]: the sinks and their gradient
SCALAR = "scalar"  # []: a scale on the device

#: The layout of each operand field whatever the family; the states' values and LSEs (and their
#: gradients) follow the family (:func:`_layouts`).
_FIXED_LAYOUTS = {
    "out": TOKENS, "out_lse": LSE, "mask": TOKENS, "output_block_scale": TOKENS, "grad_out": TOKENS,
    "grad_lse": LSE, "merged": TOKENS, "merged_lse": LSE, "indptr": OFFSETS, "sinks": PER_HEAD,
    "grad_sinks": PER_HEAD, "output_scale": SCALAR,
}  # fmt: skip
_STATE_VALUES = ("v_a", "v_b", "v", "grad_v", "grad_v_b")
_STATE_LSES = ("s_a", "s_b", "s", "grad_s", "grad_s_b")


def _layouts(names: Operands, ragged: bool) -> dict[str, str]:
    """Every declared operand field's layout: two states' [T, H, D] and [H, T], N-way states
    stacked, ragged ones as rows."""
    two_way = isinstance(names, TwoStateOperands) or bool(getattr(names, "v_b", None))
    values, lses = (VALUES, LSE) if two_way else (ROWS, ROW_LSE) if ragged else (STACKED, STACKED_LSE)
    return {
        field: values if field in _STATE_VALUES else lses if field in _STATE_LSES else _FIXED_LAYOUTS[field]
        for field in names._fields
        if getattr(names, field)
    }


class Operation:
    """A public merge as the rest of the package sees it.

    ``names`` is the family's operand record holding the public function's argument names (for
    error messages, and to find the arguments); ``options`` builds the family's options from the
    public keyword arguments of the same names. ``allocates``: outputs left as None are allocated
    (else an ``out_lse`` of None is not written); ``returns``: the public function returns its
    results. ``backward`` (a differentiable merge): the operation giving its gradients, with
    ``backward_inputs`` (the backward's operand field -> this merge's field), ``gradients`` (this
    merge's fields, in the order the backward returns their gradients) and whether it reads this
    merge's results (``backward_reads_results``). ``layouts``: each operand field's layout
    (:data:`VALUES`, :data:`STACKED`, ...). Compared by identity: one object per merge.
    """

    __slots__ = (
        "allocates", "backward", "backward_inputs", "backward_reads_results", "function", "gradients", "layouts",
        "name", "names", "options", "ragged", "required", "results", "returns", "signature",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        names: Operands,
        options: Callable[..., Options],
        *,
        allocates: bool,
        returns: bool,
        ragged: bool = False,
        backward: Operation | None = None,
        backward_inputs: dict[str, str] | None = None,
        backward_reads_results: bool = False,
    ):
        self.name = name
        self.names = names
        self.options = options
        self.allocates = allocates
        self.returns = returns
        self.ragged = ragged
        self.backward = backward
        self.backward_inputs = backward_inputs or {}
        self.backward_reads_results = backward_reads_results
        # The gradients the backward returns, named by this merge's fields.
        self.gradients = tuple(self.backward_inputs[field] for field in ("v", "s", "v_b", "s_b", "sinks")
                               if field in self.backward_inputs)  # fmt: skip
        self.function: Callable[..., Any] | None = None  # the public function (declare)
        self.signature: inspect.Signature | None = None
        if isinstance(names, BackwardOperands):
            two_way = bool(names.v_b)
            self.results: tuple[str, ...] = (
                ("grad_v", "grad_s", "grad_v_b", "grad_s_b", "grad_sinks") if two_way else ("grad_v", "grad_s", "grad_sinks")
            )
        else:
            self.results = FORWARD_RESULTS
        if isinstance(names, TwoStateOperands):
            inputs: tuple[str, ...] = ("v_a", "s_a", "v_b", "s_b")
        elif isinstance(names, BackwardOperands):
            inputs = ("v", "s", "grad_out") + (("v_b", "s_b") if names.v_b else ())
        else:
            inputs = ("v", "s")
        self.required = frozenset(inputs + (("indptr",) if ragged else ()) + (() if allocates else ("out",)))
        self.layouts = _layouts(names, ragged)

    @property
    def many(self) -> bool:
        return isinstance(self.names, ManyStateOperands)

    @property
    def is_backward(self) -> bool:
        return isinstance(self.names, BackwardOperands)

    def fields_by_name(self) -> dict[str, str]:
        """The operand field of each public argument name (a name written and read, such as the
        in-place merge's ``v``, is its written field)."""
        from ._operands import WRITTEN

        fields = sorted(self.names._fields, key=lambda field: field not in WRITTEN)
        by_name: dict[str, str] = {}
        for field in fields:
            name = getattr(self.names, field)
            if name:
                by_name.setdefault(name, field)
        return by_name

    def __repr__(self) -> str:
        return f"<merge operation {self.name}>"


# -- the declarations --------------------------------------------------------------------------------

_TWO_BACKWARD_NAMES = BackwardOperands(
    "grad_v_a", "grad_s_a", "v_a", "s_a", "grad_v", "grad_s", "v_b", "s_b", "grad_v_b", "grad_s_b",
    sinks="sinks", grad_sinks="grad_sinks", merged="out", merged_lse="out_lse",
)  # fmt: skip
_MANY_BACKWARD_NAMES = BackwardOperands(
    "grad_states_v", "grad_states_s", "v", "s", "grad_v", "grad_s", indptr="indptr", sinks="sinks",
    grad_sinks="grad_sinks", merged="out", merged_lse="out_lse",
)  # fmt: skip
_MANY_NAMES = ManyStateOperands("out", "out_lse", "v", "s", "indptr", "sinks", "output_scale", "output_block_scale")

MERGE_STATE_BACKWARD = Operation(
    "merge_state_backward", _TWO_BACKWARD_NAMES, _options.backward_options, allocates=True, returns=True
)
MERGE_STATES_BACKWARD = Operation(
    "merge_states_backward", _MANY_BACKWARD_NAMES, _options.backward_options, allocates=True, returns=True
)
MERGE_STATES_VARLEN_BACKWARD = Operation(
    "merge_states_varlen_backward", _MANY_BACKWARD_NAMES, _options.backward_options, allocates=True, returns=True,
    ragged=True,
)  # fmt: skip

MERGE_ATTN_STATES = Operation(
    "merge_attn_states",
    TwoStateOperands("output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
                     "mask", "sinks", "output_scale", "output_block_scale"),
    _options.two_state_options,
    allocates=False,
    returns=False,
)  # fmt: skip
MERGE_STATE = Operation(
    "merge_state",
    TwoStateOperands("out", "out_lse", "v_a", "s_a", "v_b", "s_b", "mask", "sinks", "output_scale",
                     "output_block_scale"),
    _options.two_state_options,
    allocates=True,
    returns=True,
    backward=MERGE_STATE_BACKWARD,
    backward_inputs={"v": "v_a", "s": "s_a", "v_b": "v_b", "s_b": "s_b", "sinks": "sinks"},
)  # fmt: skip
MERGE_STATE_IN_PLACE = Operation(
    "merge_state_in_place",
    TwoStateOperands("v", "s", "v", "s", "v_other", "s_other", "mask", "sinks", "output_scale",
                     "output_block_scale"),
    _options.two_state_options,
    allocates=False,
    returns=False,
)  # fmt: skip
MERGE_STATES = Operation(
    "merge_states", _MANY_NAMES, _options.many_state_options, allocates=True, returns=True,
    backward=MERGE_STATES_BACKWARD, backward_inputs={"v": "v", "s": "s", "sinks": "sinks"},
    backward_reads_results=True,
)  # fmt: skip
MERGE_STATES_VARLEN = Operation(
    "merge_states_varlen", _MANY_NAMES, _options.many_state_options, allocates=True, returns=True, ragged=True,
    backward=MERGE_STATES_VARLEN_BACKWARD, backward_inputs={"v": "v", "s": "s", "indptr": "indptr", "sinks": "sinks"},
    backward_reads_results=True,
)  # fmt: skip

#: Every merge by name, in the order the integrations list them.
OPERATIONS: dict[str, Operation] = {
    operation.name: operation
    for operation in (
        MERGE_ATTN_STATES, MERGE_STATE, MERGE_STATE_IN_PLACE, MERGE_STATES, MERGE_STATES_VARLEN,
        MERGE_STATE_BACKWARD, MERGE_STATES_BACKWARD, MERGE_STATES_VARLEN_BACKWARD,
    )
}  # fmt: skip


def declare(function: Callable[..., Any], operation: Operation) -> inspect.Signature:
    """Attach the public function of ``operation``: its signature is part of the declaration."""
    operation.function = function
    operation.signature = inspect.signature(function)
    return operation.signature
