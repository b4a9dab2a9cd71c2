"""The one call sequence every merge goes through, and the operations it serves.

A public merge normalises its options (``_checks``), names its operands in its
family's record (``_operands``) and calls :func:`call`:

1. *fingerprint* the arrays (address, shape, strides, dtype, device of each);
   torch tensors first by their addresses alone, with torch's own C++ check of
   the rest (:class:`Guarded`), which costs a fifth of reading it in Python;
2. *look up* the call prepared for that fingerprint, the options and the tuning;
3. on a miss, *prepare* it: describe every array (``_arrays``); find the
   *plan* for their specialisation (shape, strides, dtype, alignment class,
   device: no addresses), made once by checking every shape rule (``_checks``)
   and choosing the launches (``_plan``); check the address rules; *bind* the
   plan's pointer slots to the addresses (``_kernels``);
4. *remember* it (only calls whose every array has a fingerprint);
5. *run* it: allocate the outputs the caller did not give, on the stream that
   writes them, patch their addresses in, and launch.

Arrays without a cheap fingerprint (DLPack producers) take steps 3 and 5 on
every call, but their plan is found again by its specialisation. JAX arrays and
tracers, and calls under ``torch.compile``, are handed to the framework
integration that registered for them (``cupy_merge.jax``, ``cupy_merge.torch_ops``),
which plans from shapes alone with :func:`plan_specs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

from . import (
    _addresses,
    _array_rules,
    _arrays,
    _checks,
    _launch,
    _operands,
    _plan,
    _plan_backward,
    _quantised,
    _tuning,
)
from ._arrays import ArrayView
from ._catalogue import ITEMSIZES, VALUES_PER_ELEMENT
from ._operands import (
    WRITTEN,
    BackwardOperands,
    ForwardOperands,
    ManyStateOperands,
    Operands,
    Options,
    TwoStateOperands,
)
from ._ops import FORWARD_RESULTS, Operation

_MAX_CALLS = 4096
#: Guarded entries kept for one set of addresses (calls alternating shapes at the same pointers).
_GUARDED_PER_ADDRESSES = 4
#: Prepared calls by fingerprint (and :class:`Guarded` entries), for the default tuning (others:
#: ``_calls_by_tuning``).
_calls: dict[tuple, Any] = {}
#: The tuning ``_calls`` serves (the process's default when it was last set).
_calls_owner: _tuning.Tuning = _tuning.DEFAULT
_calls_by_tuning: dict[_tuning.Tuning, dict[tuple, Any]] = {}
#: Plans by specialisation (and options, tuning).
_plans: dict[tuple, Planned] = {}


class FreshOutput(NamedTuple):
    """An output allocated anew on each run: its operand field, shape and dtype (``zeroed``: filled
    with zeros, for outputs the kernel adds into or may leave partly unwritten; ``scratch``: no
    result, memory the call's launches pass between them)."""

    field: str
    shape: tuple[int, ...]
    dtype: str
    zeroed: bool = False
    scratch: bool = False


class Planned(NamedTuple):
    """What a specialisation gets: its launches, state shape, outputs to allocate, and how many
    rows a ragged merge's offsets may reach when they are checked on the host (else None)."""

    plan: _plan.Plan
    state: _operands.StateShape
    fresh: tuple[FreshOutput, ...]
    indptr_rows: int | None


class Call(NamedTuple):
    """A plan bound to addresses: what a fast-path hit runs."""

    launches: tuple[_launch.PreparedLaunch, ...]
    adapter: _arrays.Adapter  # results are handed back in its kind
    device: int
    fresh: tuple[tuple[FreshOutput, tuple[tuple[int, int, int], ...]], ...]  # (launch, slot, byte offset) to patch
    indptr_rows: int | None
    grad: bool = False  # a torch operand requires grad: run through autograd when grad mode is on
    written: tuple[str, ...] = ()  # the caller's torch tensors the launches write into
    likes: tuple[str | None, ...] = ()  # per fresh output, a torch input it is allocated from (or None)


class Guarded(NamedTuple):
    """A fast-path entry for torch tensors, found by their data pointers alone (its key ends with
    this class, so it never meets a fingerprint's key) and used only when ``guards`` passes them:
    torch's C++ check of the rest of what a fingerprint holds (:func:`_arrays.torch_guards`). A
    key holds the newest few entries (:data:`_GUARDED_PER_ADDRESSES`): one buffer's slices of
    several lengths share their addresses."""

    guards: Any
    call: Call


# -- framework integrations -----------------------------------------------------------------------


def _never() -> bool:
    return False


_compiling: Callable[[], bool] = _never
_compiled_call: Callable[..., Any] | None = None
_jax_call: Callable[..., Any] | None = None
_grad_enabled: Callable[[], bool] = _never
_autograd_call: Callable[..., Any] | None = None
refuse_forward_mode_hook: Callable[[Operation, Operands], None] = lambda operation, operands: None


def register_compiler(compiling: Callable[[], bool], compiled_call: Callable[..., Any]) -> None:
    """Under a compiler (``compiling()`` true while tracing) hand every call to ``compiled_call``."""
    global _compiling, _compiled_call
    _compiling, _compiled_call = compiling, compiled_call


def register_autograd(grad_enabled: Callable[[], bool], autograd_call: Callable[..., Any],
                      refuse_forward_mode: Callable[[Operation, Operands], None]) -> None:
    """Hand calls whose inputs require grad, while ``grad_enabled()``, to
    ``autograd_call(operation, options, operands, stream)`` (torch autograd); ``refuse_forward_mode``
    refuses tangents of forward-mode AD for what binds outside :func:`call` (:func:`cupy_merge.bind`)."""
    global _grad_enabled, _autograd_call, refuse_forward_mode_hook
    _grad_enabled, _autograd_call, refuse_forward_mode_hook = grad_enabled, autograd_call, refuse_forward_mode


def grad_enabled() -> bool:
    """Whether a call whose inputs require grad is recorded by autograd now (torch's grad mode,
    once the torch integration is registered; False before)."""
    return _grad_enabled()


def register_jax(jax_call: Callable[..., Any]) -> None:
    """Hand merges of JAX arrays and tracers to ``jax_call(operation, options, operands, stream)``."""
    global _jax_call
    _jax_call = jax_call


def set_default_tuning(tuning: _tuning.Tuning) -> None:
    """Make ``tuning`` the process's default; the calls prepared for the old one are kept with
    the other tunings'. Safe against concurrent calls: each step leaves ``call`` reading either
    the pair (``_calls``, ``_calls_owner``) as it was or the other tunings' dict of its own tuning,
    and no thread plans with the new default before ``_calls`` is its dict."""
    global _calls, _calls_owner
    old, old_calls = _calls_owner, _calls
    _calls_by_tuning[old] = old_calls
    _calls_owner = tuning
    _calls = _calls_by_tuning.setdefault(tuning, {})
    _tuning.set_default(tuning)


# -- the call sequence ----------------------------------------------------------------------------


#: What the compiler hook returns for a call it finds is not traced: :func:`call` runs it eagerly.
RUN_EAGERLY = object()


def call(operation: Operation, options: Options, operands: Operands, stream: Any) -> Any:
    """Run one merge: the call prepared for these arrays, options and tuning, or a new one."""
    if _compiling():
        result = _compiled_call(operation, options, operands, stream)  # type: ignore[misc]
        if result is not RUN_EAGERLY:
            return result
    tuning = _tuning.current()
    calls = _calls  # read before its owner (set_default_tuning sets them in the other order)
    if tuning is not _calls_owner:
        calls = _calls_by_tuning.setdefault(tuning, {})
    torch_operands = _arrays.torch_addresses(operands) if type(operands[2]) in _arrays.torch_types else None
    prepared: Call | None = None
    if torch_operands is not None:
        addresses, tensors = torch_operands
        for guarded in calls.get((operation, options, addresses, Guarded), ()):
            if guarded.guards.check(*tensors):
                prepared = guarded.call
                break
    if prepared is None:
        fingerprint = _arrays.fingerprints(operands)
        if fingerprint is None:  # an array kind without a cheap fingerprint: JAX's own path, or prepare afresh
            if _arrays.is_jax(operands[2]) and _jax_call is not None:  # v_a or v
                return _jax_call(operation, options, operands, stream)
            prepared = prepare(operation, options, operands, tuning)
        else:
            prepared = _remembered(calls, (operation, options, fingerprint), operation, options, operands, tuning)
            if torch_operands is not None:
                guards = _arrays.torch_guards(tensors)
                if guards is not None:
                    key = (operation, options, addresses, Guarded)
                    kept = calls.get(key, ())[: _GUARDED_PER_ADDRESSES - 1]
                    _remember(calls, key, (Guarded(guards, prepared), *kept))
    if prepared.grad and _grad_enabled():
        return _autograd_call(operation, options, operands, stream)  # type: ignore[misc]
    result = run(operation, prepared, operands, stream)
    if prepared.written:
        _arrays.TORCH.mark_written(tuple(getattr(operands, field) for field in prepared.written))
    return result


def _remembered(calls: dict, key: tuple, operation: Operation, options: Options, operands: Operands,
                tuning: _tuning.Tuning) -> Call:
    """The call prepared for ``key`` (operation, options, fingerprint), prepared now if new."""
    prepared = calls.get(key)
    if prepared is None:
        prepared = prepare(operation, options, operands, tuning)
        _remember(calls, key, prepared)
    return prepared


def _remember(calls: dict, key: tuple, entry: Any) -> None:
    if len(calls) >= _MAX_CALLS:
        calls.clear()
    calls[key] = entry


def prepare(operation: Operation, options: Options, operands: Operands, tuning: _tuning.Tuning) -> Call:
    """Describe, check and plan one merge, and bind its launches; nothing runs on the GPU."""
    names = operation.names
    fields = operands._fields
    adapter = _arrays.adapter_for(operands[2], names[2])  # v_a or v: results come back in its kind
    views: dict[str, ArrayView] = {}
    tensors: list[str] = []
    for field in (*fields[2:], *fields[:2]):  # inputs first
        obj = getattr(operands, field)
        name = getattr(names, field)
        if obj is None and field not in operation.required:
            continue
        kind = _arrays.adapter_for(obj, name)
        if kind is _arrays.TORCH:
            tensors.append(field)
        if field in WRITTEN and not kind.writable(obj):
            what = "JAX arrays are immutable and cannot be written in place" if kind is _arrays.JAX else (
                "a read-only array cannot be written"
            )
            raise TypeError(
                f"{name}: {what}; leave it out (merge_state and merge_states return new arrays) or pass "
                f"a CuPy array or torch tensor"
            )
        views[field] = kind.describe(obj, name)
    described = type(operands)(**{field: views.get(field) for field in fields})
    planned = plan_for(operation, options, tuning, described)
    if isinstance(described, TwoStateOperands):
        _addresses.check_two_addresses(described, names)  # type: ignore[arg-type]
    elif isinstance(described, ManyStateOperands):
        _addresses.check_many_addresses(described, names)  # type: ignore[arg-type]
    # A gradient's outputs are always its own fresh arrays: no address rule applies.
    addresses = {field: view.ptr for field, view in views.items()}
    device = planned.state.device
    launches = tuple(
        _launch.prepare(launch, device, addresses, tuning.programmatic_launch) for launch in planned.plan
    )
    fresh = tuple(
        (output, tuple((index, slot, offset) for index, launch in enumerate(planned.plan)
                       for slot, field, offset in launch.pointers if field == output.field))
        for output in planned.fresh
    )  # fmt: skip
    grad, written = autograd_facts(operands, tensors)
    likes = tuple(_input_like(output, views, operands) for output in planned.fresh) if adapter is _arrays.TORCH else ()
    return Call(launches, adapter, device, fresh, planned.indptr_rows, grad, written, likes)


def _input_like(output: FreshOutput, views: dict[str, ArrayView], operands: Operands) -> str | None:
    """An input of the output's dtype that is a plain torch tensor (a subclass would make the
    output its own type, another kind has no ``new_empty``): torch allocates the output from it
    (no dtype and device to parse, 0.6 us less a tensor), every operand being on the call's device."""
    for field, view in views.items():
        if (field not in WRITTEN and view.dtype == output.dtype
                and type(getattr(operands, field)) in _arrays.torch_types):  # fmt: skip
            return field
    return None


def autograd_facts(operands: Operands, tensors: list[str]) -> tuple[bool, tuple[str, ...]]:
    """What autograd must know of a call, from its torch operands (``tensors``: their fields).

    Whether one requires grad: in grad mode the call then goes through autograd (the torch
    integration), which differentiates the functional merges and refuses to write into tensors
    that require grad or from inputs that do. And which given tensors the launches write into:
    their version counters are bumped after each run, as torch's own in-place and ``out=`` ops
    do, so a backward that saved one of them before the merge overwrote it raises instead of
    computing wrong gradients."""
    grad = any(getattr(operands, field).requires_grad for field in tensors)
    return grad, tuple(field for field in tensors if field in WRITTEN)


def requiring_grad(operands: Operands) -> list[str]:
    """The fields of the torch operands that require grad, written ones first (for messages)."""
    fields = sorted(operands._fields, key=lambda field: field not in WRITTEN)
    return [field for field in fields if getattr(getattr(operands, field), "requires_grad", False) is True]


def plan_for(operation: Operation, options: Options, tuning: _tuning.Tuning, views: Operands) -> Planned:
    """The plan of these arrays' specialisation: found again, or made by :func:`plan_specs`."""
    specs = type(views)(*(None if view is None else view.spec for view in views))
    lse_in_place = (
        isinstance(views, TwoStateOperands)
        and views.out_lse is not None
        and views.out_lse in (views.s_a, views.s_b)
    )
    key = (operation, options, tuning, specs, lse_in_place)
    planned = _plans.get(key)
    if planned is None:
        planned = plan_specs(operation, options, tuning, specs, lse_in_place)
        if len(_plans) >= _MAX_CALLS:
            _plans.clear()
        _plans[key] = planned
    return planned


def plan_specs(
    operation: Operation, options: Options, tuning: _tuning.Tuning, specs: Operands, lse_in_place: bool = False
) -> Planned:
    """Every shape rule of one merge and its launch plan, from its operands' specs: pure, GPU-free.

    Outputs the caller left out (``None``, where the operation allocates) are
    planned as fresh C-contiguous arrays. ``lse_in_place``: a two-way merge's
    ``out_lse`` is its ``s_a`` or ``s_b`` itself.
    """
    if isinstance(specs, BackwardOperands):
        return _plan_gradients(operation, options, tuning, specs)
    state, num_states, specs, fresh = check_specs(operation, options, specs)
    if operation.many:
        plan = _plan.plan_many_states(state, num_states, specs, options, tuning)  # type: ignore[arg-type]
        check_rows = specs.indptr is not None and options.check_indptr  # type: ignore[union-attr]
        return Planned(plan, state, fresh, num_states if check_rows else None)
    plan = _plan.plan_two_states(state, specs, options, tuning, lse_in_place)  # type: ignore[arg-type]
    return Planned(plan, state, fresh, None)


def check_specs(
    operation: Operation, options: Options, specs: Operands
) -> tuple[_operands.StateShape, int, Operands, tuple[FreshOutput, ...]]:
    """Every shape rule of one merge (not its address and value rules), from its operands' specs:
    the state's shape, the number of states, the specs with the outputs to allocate filled in as
    fresh C-contiguous arrays, and those outputs. What plans take, and torch's fakes check."""
    names = operation.names
    if isinstance(specs, BackwardOperands):
        state, num_states = _checks.check_backward(specs, names, options)  # type: ignore[arg-type]
        return state, num_states, specs, ()
    specs = specs._replace(out=_quantised.quantised_bytes(specs.out, specs.output_scale, specs.output_block_scale))
    if operation.many:
        state, num_states = _checks.check_many_inputs(specs, names)  # type: ignore[arg-type]
    else:
        state, num_states = _checks.check_two_inputs(specs, names), 2  # type: ignore[arg-type]
    specs, fresh = _fresh_outputs(operation, options.out_dtype, state, specs)  # type: ignore[union-attr]
    if operation.many:
        _checks.check_many(specs, names, options)  # type: ignore[arg-type]
    else:
        _checks.check_two(specs, names, options)  # type: ignore[arg-type]
    return state, num_states, specs, fresh


def _plan_gradients(
    operation: Operation, options: Any, tuning: _tuning.Tuning, specs: BackwardOperands
) -> Planned:
    """A merge's gradient: every gradient allocated C-contiguous, like the array it is of (the
    sinks' zeroed, as every token adds into them; the kernel writes every other element, a ragged
    batch's rows no token owns too)."""
    state, num_states = _checks.check_backward(specs, operation.names, options)  # type: ignore[arg-type]
    fresh = []
    pairs = [("grad_v", specs.v), ("grad_s", specs.s)]
    if specs.v_b is not None:
        pairs += [("grad_v_b", specs.v_b), ("grad_s_b", specs.s_b)]
    for field, like in pairs:
        dtype = like.dtype
        fresh.append(FreshOutput(field, tuple(like.shape), dtype))
        specs = specs._replace(**{field: _arrays.contiguous_spec(tuple(like.shape), dtype, like.itemsize, state.device)})
    if specs.sinks is not None:
        specs = specs._replace(grad_sinks=_arrays.contiguous_spec((state.num_heads,), "float32", 4, state.device))
    plan = _plan_backward.plan_backward(state, num_states, specs, options, tuning)
    if specs.sinks is not None:  # summed from the rows' terms by the plan's last launch (zeros with no launch)
        fresh.append(FreshOutput("grad_sinks", (state.num_heads,), "float32", zeroed=not plan))
        if plan:
            terms = (state.num_heads * state.num_tokens,)
            fresh.append(FreshOutput(_plan_backward.SINK_TERMS, terms, "float32", scratch=True))
    return Planned(plan, state, tuple(fresh), None)


def _fresh_outputs(
    operation: Operation, out_dtype: str | None, state: _operands.StateShape, specs: ForwardOperands
) -> tuple[ForwardOperands, tuple[FreshOutput, ...]]:
    """The outputs to allocate, as C-contiguous specs, and the list of them."""
    out = specs.out
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        raise TypeError(
            f"out_dtype: expected the dtype of {cast(ForwardOperands, operation.names).out} ({out.dtype}) or None, "
            f"got {out_dtype!r}"
        )
    if not operation.allocates:
        return specs, ()
    fresh = []
    if out is None:
        dtype = out_dtype or state.dtype
        values = (state.num_tokens, state.num_heads, state.head_size // VALUES_PER_ELEMENT.get(dtype, 1))
        specs = specs._replace(out=_arrays.contiguous_spec(values, dtype, ITEMSIZES[dtype], state.device))
        fresh.append(FreshOutput("out", values, dtype))
    if specs.out_lse is None:
        lse = (state.num_heads, state.num_tokens)
        specs = specs._replace(out_lse=_arrays.contiguous_spec(lse, "float32", 4, state.device))
        fresh.append(FreshOutput("out_lse", lse, "float32"))
    return specs, tuple(fresh)


def run(operation: Operation, prepared: Call, operands: Operands, stream: Any) -> Any:
    """Launch a prepared call on ``stream`` (default: the current stream of the arrays' kind)."""
    adapter, device = prepared.adapter, prepared.device
    if stream is None:
        stream_ptr = adapter.current_stream(device)
    else:
        stream_ptr = _arrays.stream_pointer(stream)
        check_stream(stream_ptr, prepared)
    if prepared.indptr_rows is not None:
        check_values(operation, prepared, operands, stream_ptr)
    outputs: dict[str, Any] = {}
    if prepared.fresh:
        outputs, patches = allocate(prepared, None if stream is None else stream_ptr, operands)
        for index, launch in enumerate(prepared.launches):
            _launch.launch_patched(launch, stream_ptr, patches[index])
    else:
        for launch in prepared.launches:
            _launch.launch(launch, stream_ptr)
    if not operation.returns:
        return None
    if operation.results is FORWARD_RESULTS:  # the common case, without a loop
        forward = cast(ForwardOperands, operands)
        return adapter.result(outputs.get("out", forward.out)), adapter.result(outputs.get("out_lse", forward.out_lse))
    return tuple(
        adapter.result(outputs[field] if field in outputs else getattr(operands, field))
        for field in operation.results
    )


def check_stream(stream_ptr: int, prepared: Call) -> None:
    """A stream given by the caller must belong to the arrays' device (the default and per-thread
    streams of the current device always do)."""
    if stream_ptr > 2 and prepared.launches:
        context = _launch.stream_context(stream_ptr)
        if context != prepared.launches[0].context:
            raise ValueError(
                f"stream: expected a stream of device {prepared.device}, where the arrays are; got one "
                f"of another device (or context)"
            )


def check_values(operation: Operation, prepared: Call, operands: Operands, stream: int | None = None) -> None:
    """The checks of argument *values* that run on every call: a ragged merge's indptr, when asked,
    copied to the host on the merge's stream."""
    if prepared.indptr_rows is not None:
        if stream is not None and _launch.capturing(stream):
            return  # a CUDA-graph capture cannot read the device: the kernel guards the offsets (NaN rows)
        values = _arrays.to_numpy(operands.indptr, stream)  # type: ignore[union-attr]
        _array_rules.indptr_values(values, prepared.indptr_rows, operation.names.indptr)  # type: ignore[union-attr]


def allocate(
    prepared: Call, stream: int | None, operands: Operands
) -> tuple[dict[str, Any], list[list[tuple[int, int]]]]:
    """The call's fresh outputs by field, allocated for ``stream`` (None: the current one), and each
    launch's pointer patches."""
    adapter, device = prepared.adapter, prepared.device
    if stream is not None and stream == adapter.current_stream(device):
        stream = None
    outputs: dict[str, Any] = {}
    patches: list[list[tuple[int, int]]] = [[] for _ in prepared.launches]
    likes = prepared.likes if stream is None else ()
    for number, (output, slots) in enumerate(prepared.fresh):
        like = likes[number] if likes else None
        if like is None:
            array = adapter.empty(output.shape, output.dtype, device, stream, output.zeroed)
        else:
            array = _arrays.TORCH.empty_as(getattr(operands, like), output.shape, output.zeroed)
        outputs[output.field] = array
        pointer = adapter.pointer(array)
        for index, slot, offset in slots:  # a gradient's later states lie an offset into it
            patches[index].append((slot, pointer + offset))
    return outputs, patches

