"""The one call sequence every merge goes through, and the operations it serves.

A public merge normalises its options (``_checks``), lists its arrays in its
operation's order and calls :func:`call`:

1. *fingerprint* the arrays (pointer, shape, strides, dtype, device of each);
2. *look up* the prepared call for that fingerprint and the options;
3. on a miss, *prepare* it: describe every array (``_arrays``), check every rule
   (``_checks``), choose the launch (``_plan``), compile and pack it (``_kernels``);
4. *remember* it (only calls whose every array has a fingerprint);
5. *run* it: allocate the outputs the caller did not give, on the stream that
   writes them, patch their pointers in, and launch.

:func:`prepare` is also what ``bind`` uses, once, with nothing cached.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

from . import _arrays, _checks, _kernels, _plan
from ._arrays import ArrayView
from ._catalogue import ITEMSIZES

_MAX_CALLS = 4096
_calls: dict[tuple, Call] = {}

#: Passed as ``stream`` by ``bind``: the merge returns its prepared call instead of running.
PREPARE = object()

OUT, OUT_LSE = 0, 1  # every operation's arrays start with its two outputs
# ... and end with the FP8 output's scales: per tensor (read) and per group (written).
TWO_MASK, TWO_OUT_SCALE, TWO_GROUP_SCALE = 6, 7, 8
MANY_INDPTR, MANY_OUT_SCALE, MANY_GROUP_SCALE = 4, 5, 6


class Operation(NamedTuple):
    """A public merge as the dispatcher sees it.

    ``names`` spell the arguments as the public function does, in the order of its
    arrays: ``(out, out_lse, v_a, s_a, v_b, s_b, mask, output_scale, output_block_scale)``
    for two-way merges, ``(out, out_lse, v, s, indptr, output_scale, output_block_scale)``
    for N-way ones.
    """

    name: str
    names: _checks.TwoStateNames | _checks.ManyStateNames
    many: bool  # N-way (plan_many_states) or two-way
    allocates: bool  # outputs left as None are allocated (else out_lse None is simply not written)
    returns: bool  # the public function returns (out, out_lse)
    optional: frozenset[int]  # positions that may be None
    written: frozenset[int]  # positions the merge writes

    @classmethod
    def two_states(
        cls, name: str, names: _checks.TwoStateNames, *, allocates: bool, returns: bool
    ) -> Operation:
        optional = {OUT_LSE, TWO_MASK, TWO_OUT_SCALE, TWO_GROUP_SCALE} | ({OUT} if allocates else set())
        written = frozenset({OUT, OUT_LSE, TWO_GROUP_SCALE})
        return cls(name, names, False, allocates, returns, frozenset(optional), written)

    @classmethod
    def many_states(cls, name: str, *, ragged: bool) -> Operation:
        optional = {OUT, OUT_LSE, MANY_OUT_SCALE, MANY_GROUP_SCALE} | (set() if ragged else {MANY_INDPTR})
        written = frozenset({OUT, OUT_LSE, MANY_GROUP_SCALE})
        return cls(name, _checks.ManyStateNames(), True, True, True, frozenset(optional), written)


class FreshOutput(NamedTuple):
    """An output allocated anew on each run: its position in the arrays and its kernel argument slot."""

    position: int
    slot: int
    shape: tuple[int, ...]
    dtype: str


class Call(NamedTuple):
    launch: _kernels.PreparedLaunch | None  # None: nothing to launch (no tokens or heads)
    adapter: _arrays.Adapter  # results are handed back in its kind
    device: int
    fresh: tuple[FreshOutput, ...]
    indptr_rows: int | None  # set when indptr's values are checked on the host on each run


class Prepared(NamedTuple):
    """What a merge returns when called with ``stream=PREPARE``."""

    operation: Operation
    call: Call
    arrays: tuple


def call(operation: Operation, options: tuple, arrays: tuple, stream: Any) -> Any:
    """Run one merge: the cached prepared call for these arrays and options, or a new one."""
    if stream is PREPARE:
        return Prepared(operation, prepare(operation, options, arrays), arrays)
    fingerprint = _arrays.fingerprints(arrays)
    if fingerprint is None:  # an array kind without a cheap fingerprint: always the full path
        return run(operation, prepare(operation, options, arrays), arrays, stream)
    key = (operation.name, options, fingerprint)
    prepared = _calls.get(key)
    if prepared is None:
        prepared = prepare(operation, options, arrays)
        if len(_calls) >= _MAX_CALLS:
            _calls.clear()
        _calls[key] = prepared
    return run(operation, prepared, arrays, stream)


def prepare(operation: Operation, options: tuple, arrays: tuple) -> Call:
    """Describe, check and plan one merge, and pack its launch; nothing runs on the GPU."""
    names = operation.names
    primary = 2  # v_a or v: results come back in its kind
    adapter = _arrays.adapter_for(arrays[primary], names[primary])
    views: list[ArrayView | None] = [None] * len(arrays)
    for position in [*range(primary, len(arrays)), OUT, OUT_LSE]:  # inputs first
        obj = arrays[position]
        if obj is None and position in operation.optional:
            continue
        kind = _arrays.adapter_for(obj, names[position])
        if position in operation.written and not kind.writable:
            raise TypeError(
                f"{names[position]}: JAX arrays are immutable and cannot be written in place; leave it out "
                f"(merge_state and merge_states return new arrays) or pass a CuPy array or torch tensor"
            )
        views[position] = kind.describe(obj, names[position])
    planned = plan_call(operation, options, views)
    launch = None if planned.plan is None else _kernels.prepare(planned.plan, planned.device)
    return Call(launch, adapter, planned.device, planned.fresh, planned.indptr_rows)


class Planned(NamedTuple):
    plan: _plan.LaunchPlan | None
    device: int
    fresh: tuple[FreshOutput, ...]
    indptr_rows: int | None


def plan_call(operation: Operation, options: tuple, views: list[ArrayView | None]) -> Planned:
    """Every check of one merge and its launch plan, from the arrays' views: pure and GPU-free.

    Outputs the caller left out (``None``, where the operation allocates) are
    planned as fresh C-contiguous arrays; their pointers are patched in on each run.
    """
    if operation.many:
        return _plan_many(operation, cast(_plan.ManyStateOptions, options), views)
    return _plan_two(operation, cast(_plan.TwoStateOptions, options), views)


def _plan_two(operation: Operation, options: _plan.TwoStateOptions, views: list[ArrayView | None]) -> Planned:
    names = cast(_checks.TwoStateNames, operation.names)
    out, out_lse, v_a, s_a, v_b, s_b, mask, out_scale, group_scale = views
    state = _checks.check_two_inputs(_given(v_a), _given(s_a), _given(v_b), _given(s_b), names)
    out = _checks.fp8_bytes(out, out_scale is not None or group_scale is not None)
    out, out_lse, fresh = _outputs(operation, options.out_dtype, state, out, out_lse)
    _checks.check_two_states(
        out, out_lse, _given(v_a), _given(s_a), _given(v_b), _given(s_b), mask, state, names
    )
    values = [(_given(v_a), names.v_a), (_given(v_b), names.v_b)]
    others = _named(views, names, exclude=TWO_GROUP_SCALE)
    _checks.check_quantisation(out, out_scale, group_scale, options.group_size, values, others, state, names)
    scales = _plan.OutputScales(out_scale, group_scale)
    plan = _plan.plan_two_states(
        state, out, out_lse, _given(v_a), _given(s_a), _given(v_b), _given(s_b), mask, options, scales
    )
    return Planned(plan, state.device, _fresh(fresh, plan), None)


def _plan_many(
    operation: Operation, options: _plan.ManyStateOptions, views: list[ArrayView | None]
) -> Planned:
    names = cast(_checks.ManyStateNames, operation.names)
    out, out_lse, v, s, indptr, out_scale, group_scale = views
    state, num_states = _checks.check_many_inputs(_given(v), _given(s), indptr, names)
    out = _checks.fp8_bytes(out, out_scale is not None or group_scale is not None)
    out, out_lse, fresh = _outputs(operation, options.out_dtype, state, out, out_lse)
    _checks.check_many_states(out, out_lse, _given(v), _given(s), indptr, state, names)
    others = _named(views, names, exclude=MANY_GROUP_SCALE)
    _checks.check_quantisation(
        out, out_scale, group_scale, options.group_size, [(_given(v), names.v)], others, state, names
    )
    scales = _plan.OutputScales(out_scale, group_scale)
    plan = _plan.plan_many_states(
        state, num_states, out, out_lse, _given(v), _given(s), indptr, options, scales
    )
    indptr_rows = num_states if indptr is not None and options.check_indptr else None
    return Planned(plan, state.device, _fresh(fresh, plan), indptr_rows)


def _named(views: list[ArrayView | None], names: tuple, exclude: int) -> list[tuple[ArrayView, str]]:
    """Every given view but one, with its argument name (a shared view is listed once)."""
    named: list[tuple[ArrayView, str]] = []
    for position, (view, name) in enumerate(zip(views, names)):
        if view is not None and position != exclude and all(view is not seen for seen, _ in named):
            named.append((view, name))
    return named


def _given(view: ArrayView | None) -> ArrayView:
    """A view ``prepare`` described: only optional positions may be None."""
    assert view is not None
    return view


def _outputs(
    operation: Operation,
    out_dtype: str | None,
    state: _checks.StateShape,
    out: ArrayView | None,
    out_lse: ArrayView | None,
) -> tuple[ArrayView, ArrayView | None, list[tuple[int, tuple[int, ...], str]]]:
    """The outputs' views; the ones to allocate as fresh views, listed as (position, shape, dtype)."""
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        raise TypeError(
            f"out_dtype: expected the dtype of {operation.names.out} ({out.dtype}) or None, got {out_dtype!r}"
        )
    fresh: list[tuple[int, tuple[int, ...], str]] = []
    if operation.allocates and out is None:
        shape = (state.num_tokens, state.num_heads, state.head_size)
        out = _fresh_view(shape, out_dtype or state.dtype, state.device)
        fresh.append((OUT, shape, out.dtype))
    if operation.allocates and out_lse is None:
        out_lse = _fresh_view((state.num_heads, state.num_tokens), "float32", state.device)
        fresh.append((OUT_LSE, out_lse.shape, "float32"))
    return _given(out), out_lse, fresh


def _fresh(
    fresh: list[tuple[int, tuple[int, ...], str]], plan: _plan.LaunchPlan | None
) -> tuple[FreshOutput, ...]:
    slots = {OUT: plan.out_slot, OUT_LSE: plan.out_lse_slot} if plan is not None else {OUT: 0, OUT_LSE: 0}
    return tuple(FreshOutput(position, slots[position], shape, dtype) for position, shape, dtype in fresh)


def _fresh_view(shape: tuple[int, ...], dtype: str, device: int) -> ArrayView:
    """An output to be allocated: C-contiguous, aligned, sharing memory with nothing (null until allocated)."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return ArrayView(0, shape, tuple(reversed(strides)), dtype, ITEMSIZES[dtype], device)


def run(operation: Operation, prepared: Call, arrays: tuple, stream: Any) -> Any:
    """Launch a prepared call on ``stream`` (default: the current stream of the arrays' kind)."""
    adapter, device = prepared.adapter, prepared.device
    stream_ptr = adapter.current_stream(device) if stream is None else _arrays.stream_pointer(stream)
    if prepared.indptr_rows is not None:
        check_values(operation, prepared, arrays)
    out, out_lse = arrays[OUT], arrays[OUT_LSE]
    if prepared.fresh:
        out, out_lse, patches = allocate(prepared, out, out_lse, None if stream is None else stream_ptr)
        if prepared.launch is not None:
            _kernels.launch_patched(prepared.launch, stream_ptr, patches)
    elif prepared.launch is not None:
        _kernels.launch(prepared.launch, stream_ptr)
    if not operation.returns:
        return None
    return adapter.result(out), adapter.result(out_lse)


def check_values(operation: Operation, prepared: Call, arrays: tuple) -> None:
    """The checks of argument *values* that run on every call: a ragged merge's indptr, when asked."""
    if prepared.indptr_rows is not None:
        names = cast(_checks.ManyStateNames, operation.names)
        _checks.indptr_values(_arrays.to_numpy(arrays[MANY_INDPTR]), prepared.indptr_rows, names.indptr)


def allocate(prepared: Call, out: Any, out_lse: Any, stream: int | None) -> tuple[Any, Any, list]:
    """The call's fresh outputs, allocated for ``stream`` (None: the current one), and their pointer patches."""
    adapter, device = prepared.adapter, prepared.device
    if stream is not None and stream == adapter.current_stream(device):
        stream = None
    patches = []
    for fresh in prepared.fresh:
        array = adapter.empty(fresh.shape, fresh.dtype, device, stream)
        patches.append((fresh.slot, adapter.pointer(array)))
        if fresh.position == OUT:
            out = array
        else:
            out_lse = array
    return out, out_lse, patches
