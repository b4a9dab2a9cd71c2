"""Merges of JAX arrays: under ``jax.jit`` and ``vmap``, inside XLA's CUDA graphs, and eagerly.

Every merge here is one ``jax.experimental.buffer_callback`` (JAX 0.6.1 or newer)
marked ``command_buffer_compatible``: XLA hands the callback its own device buffers
and CUDA stream, and the callback launches cupy-merge's NVRTC kernel there. All the
work that is not a launch happens once, when JAX traces the call: the shape rules
(with the errors of ``cupy_merge``'s eager merges), the launch plan, NVRTC compilation
and module loading, for every local CUDA device. The callback itself reads the
buffers' addresses, patches them into the prepared launch and launches it on
``ctx.stream``: it allocates nothing, never synchronises and reads no device data, so
XLA may record it into a CUDA graph and replay it without Python.

The functions mirror cupy-merge's public merges, functionally (JAX arrays are
immutable): :func:`merge_state`, :func:`merge_states`, :func:`merge_states_varlen`,
:func:`merge_attn_states` and :func:`merge_state_in_place` return new arrays. The same
merges called as ``cupy_merge.merge_state(...)`` etc. on JAX arrays or tracers take the
same path. Eager calls run a cached ``jax.jit`` of the same function (one trace per
shapes, dtypes and options). ``vmap`` folds leading batch axes into the token axis
where the layout allows it (one launch), and maps over the batch otherwise.

``jax.grad`` and ``jax.value_and_grad`` differentiate the merges (a ``jax.custom_vjp``
around the batched merge): the backward is cupy-merge's backward kernel, planned and
compiled when JAX traces it and launched like the merges, from the merge's inputs (an N-way
or ragged merge's results too, which few rows of many states read instead of recomputing
the weights). Its ``vmap`` folds batches as the merge does.

Importing this module does not import JAX: it registers the JAX path of
``cupy_merge``'s merges and loads JAX on first use.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> import cupy_merge.jax as cmj
>>> v = jnp.ones((4, 8, 128), jnp.bfloat16)
>>> s = jnp.zeros((8, 4), jnp.float32)
>>> merged, lse = jax.jit(cmj.merge_state)(v, s, 3 * v, s)  # doctest: +SKIP
>>> float(merged[0, 0, 0]), round(float(lse[0, 0]), 4)  # doctest: +SKIP
(2.0, 0.6931)
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import operator
import threading
from typing import Any, NamedTuple

import numpy

from . import _arrays, _checks, _dispatch, _kernels, _plan, _tuning
from ._arrays import ArraySpec
from ._catalogue import FP8, ITEMSIZES, MAX_STATES_PER_TOKEN
from ._operands import BackwardOperands, ManyStateOperands, TwoStateOperands
from ._ops import (
    MERGE_ATTN_STATES,
    MERGE_STATE,
    MERGE_STATE_BACKWARD,
    MERGE_STATE_IN_PLACE,
    MERGE_STATES,
    MERGE_STATES_BACKWARD,
    MERGE_STATES_VARLEN,
    MERGE_STATES_VARLEN_BACKWARD,
)

__all__ = [
    "merge_attn_states",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_varlen",
]

#: What to install when JAX is missing.
JAX_HINT = (
    "cupy_merge.jax needs JAX 0.6.1 or newer with its CUDA plugin: pip install 'cupy-merge[jax]' "
    "'jax[cuda12]' (or 'jax[cuda13]')"
)
#: DLPack device type of CUDA memory (the callback launches only on it).
_DLPACK_CUDA = 2
#: The callback takes the element-aligned plan when any address has one of these bits set
#: (plans assume 16-byte alignment, what XLA's allocations give). Tests set it to ~0.
_MISALIGNED = 15
#: vmap maps over at most this many batch elements by unrolled calls, beyond by ``lax.map``.
_UNROLL = 8
#: Options of the two-way family's optional operands, in the order they are passed.
_TWO_OPTIONAL = ("mask", "sinks", "output_scale", "output_block_scale")
_MANY_OPTIONAL = ("sinks", "output_scale", "output_block_scale")


# -- JAX, loaded on first use -------------------------------------------------------------------


class _Jax(NamedTuple):
    jax: Any
    jnp: Any
    lax: Any
    buffer_callback: Any
    tracer: type


_loaded: list[_Jax] = []
_lock = threading.Lock()


def _jax() -> _Jax:
    """JAX's modules, imported once; ImportError naming what to install."""
    if _loaded:
        return _loaded[0]
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise ImportError(JAX_HINT) from None
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        raise ImportError(
            f"cupy_merge.jax needs jax.experimental.buffer_callback, new in JAX 0.6.1; this is JAX "
            f"{getattr(jax, '__version__', '?')}: pip install -U 'jax[cuda12]' (or 'jax[cuda13]')"
        ) from None
    tracer: Any = getattr(jax.core, "Tracer", None)
    if tracer is None:  # pragma: no cover - JAX moved it
        from jax._src.core import Tracer as tracer
    with _lock:
        if not _loaded:
            _loaded.append(_Jax(jax, jnp, jax.lax, buffer_callback, tracer))
    return _loaded[0]


def _devices_to_prepare() -> tuple[int, ...]:
    """The CUDA ordinals of JAX's local CUDA devices, where launches are prepared at trace time;
    RuntimeError when JAX has none."""
    jax = _jax().jax
    try:
        devices = jax.local_devices(backend="cuda")
    except RuntimeError:
        devices = []
    if not devices:
        try:
            platforms = sorted({device.platform for device in jax.devices()})
        except RuntimeError:
            platforms = []
        raise RuntimeError(
            f"cupy_merge.jax needs an NVIDIA GPU that JAX runs on; this JAX has only "
            f"{' and '.join(platforms) or 'no'} devices. Install JAX's CUDA plugin (pip install -U "
            f"'jax[cuda12]' or 'jax[cuda13]') on a machine with a GPU"
        )
    return tuple(sorted({d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devices}))


# -- what one traced merge is -------------------------------------------------------------------

# Layouts: how a buffer holds its logical array. Logical dim i is physical dim PERM[i].
# ""/"ht"/"nt"/"nht": as the core's layout ([H, T] LSE, [N, T, H, D] values, [N, H, T] LSE);
# "th": a token-major LSE buffer [T, H]; "tn": token-major N-way values [T, N, H, D];
# "tnh": token-major N-way LSE [T, N, H]. vmap folds batches into the token axis of these.
_PERMS: dict[str, tuple[int, ...] | None] = {
    "": None, "ht": None, "nt": None, "nht": None, "th": (1, 0), "tn": (1, 0, 2, 3), "tnh": (1, 2, 0),
}  # fmt: skip


class _Config(NamedTuple):
    """Everything static about one merge: the operation, its options and tuning, which operands
    are passed (in that order) and in which layout, and what the outputs alias."""

    operation: _dispatch.Operation
    options: Any
    tuning: _tuning.Tuning
    fields: tuple[str, ...]
    layouts: tuple[str, ...]
    out_layout: str = "ht"  # of out_lse: "ht" ([H, T]) or "th" ([T, H])
    in_place: bool = False  # out and out_lse alias v_a and s_a (a masked in-place merge)
    scales_aliased: bool = False  # the output_block_scale operand is aliased to the scales result

    def layout(self, field: str) -> str:
        return self.layouts[self.fields.index(field)]


class HostCall(NamedTuple):
    """What the callback knows of a merge on buffers that are not CUDA memory: the operation and
    options, every operand's logical :class:`ArraySpec` (strides in elements into its buffer) and
    each operand's index in the buffers (inputs, then outputs). :func:`_on_host` receives it."""

    operation: _dispatch.Operation
    options: Any
    specs: Any  # TwoStateOperands or ManyStateOperands of ArraySpec
    index: dict[str, int]  # type: ignore[assignment]  # (a field named like tuple.index)


class _Entry(NamedTuple):
    """A traced merge's launch: its buffer_callback (None when nothing is to be launched) and results."""

    call: Any
    results: tuple[tuple[tuple[int, ...], Any], ...]  # physical (shape, dtype) of each result
    fp8: bool
    host: HostCall | None = None
    zeroed: tuple[int, ...] = ()  # results that start as zeros (passed in as aliased inputs)


_entries: dict[tuple, _Entry] = {}


def _dtype_of(dtype: Any) -> Any:
    return numpy.dtype(dtype)


def _spec(shape: tuple[int, ...], dtype: Any, layout: str) -> ArraySpec:
    """The logical spec of a dense buffer of ``shape`` holding its array in ``layout``."""
    name = _arrays.dtype_name(dtype)
    itemsize = numpy.dtype(dtype).itemsize
    strides = _arrays.contiguous_strides(shape)
    perm = _PERMS[layout]
    if perm is not None and len(perm) == len(shape):
        shape = tuple(shape[p] for p in perm)
        strides = tuple(strides[p] for p in perm)
    return ArraySpec(tuple(shape), tuple(strides), name, itemsize, 0)


def _physical_lse(num_heads: int, num_tokens: int, layout: str) -> tuple[int, int]:
    return (num_tokens, num_heads) if layout == "th" else (num_heads, num_tokens)


def _entry(cfg: _Config, avals: tuple, build: Any = None) -> _Entry:
    key = (cfg, avals)
    entry = _entries.get(key)
    if entry is None:
        entry = (build or _build_entry)(cfg, avals)
        with _lock:
            if len(_entries) >= 4096:
                _entries.clear()
            _entries[key] = entry
    return entry


def _build_entry(cfg: _Config, avals: tuple) -> _Entry:
    """Check, plan, compile and prepare one merge (trace time), and make its buffer_callback."""
    operation, options, tuning = cfg.operation, cfg.options, cfg.tuning
    names: Any = operation.names
    record = type(names)
    inputs = {
        field: _spec(shape, dtype, layout)
        for field, layout, (shape, dtype) in zip(cfg.fields, cfg.layouts, avals)
    }
    physical = {field: shape for field, (shape, _) in zip(cfg.fields, avals)}
    specs = record(**{field: inputs.get(field) for field in record._fields})
    if operation.many:
        state, _ = _checks.check_many_inputs(specs, names)
    else:
        state = _checks.check_two_inputs(specs, names)
    tokens, heads, head_size = state.num_tokens, state.num_heads, state.head_size
    out_dtype = options.out_dtype or state.dtype
    results: list[tuple[str, tuple[int, ...], Any]] = []  # (field, physical shape, dtype)
    if cfg.in_place:
        out, out_lse = specs.v_a, specs.s_a
        results += [("out", physical["v_a"], _dtype_of(avals[cfg.fields.index("v_a")][1])),
                    ("out_lse", physical["s_a"], numpy.dtype("float32"))]  # fmt: skip
    else:
        out_shape = (tokens, heads, head_size)
        out = _arrays.contiguous_spec(out_shape, out_dtype, ITEMSIZES[out_dtype], 0)
        lse_shape = _physical_lse(heads, tokens, cfg.out_layout)
        out_lse = _spec(lse_shape, numpy.float32, cfg.out_layout)
        stored = numpy.dtype("uint8") if out_dtype == FP8 else _jax_dtype(out_dtype)
        results += [("out", out_shape, stored), ("out_lse", lse_shape, numpy.dtype("float32"))]
    block_scale = specs.output_block_scale
    if options.group_size is not None:
        if block_scale is None:
            scale_shape = (tokens, heads * head_size // options.group_size)
            block_scale = _arrays.contiguous_spec(scale_shape, "float32", 4, 0)
        else:
            scale_shape = physical["output_block_scale"]
        results.append(("output_block_scale", scale_shape, numpy.dtype("float32")))
    specs = specs._replace(out=out, out_lse=out_lse, output_block_scale=block_scale)
    planned = _dispatch.plan_specs(operation, options, tuning, specs, cfg.in_place)
    shapes = tuple((shape, dtype) for _, shape, dtype in results)
    if not planned.plan:  # zero tokens or heads: nothing to launch (an empty CUDA graph can crash)
        return _Entry(None, shapes, out_dtype == FP8)
    # Addresses XLA gives are 16-byte aligned; a second plan for addresses aligned only to their
    # elements (a buffer XLA passes at an offset), chosen by the callback from the addresses.
    loose = specs._replace(**{
        field: spec._replace(align=min(spec.align, spec.itemsize))
        for field, spec in zip(specs._fields, specs) if spec is not None
    })  # fmt: skip
    loose_plan = _dispatch.plan_specs(operation, options, tuning, loose, cfg.in_place).plan
    index = {field: position for position, field in enumerate(cfg.fields)}
    index.update({field: len(cfg.fields) + position for position, (field, _, _) in enumerate(results)})
    devices = _devices_to_prepare()
    fast = _prepare(planned.plan, devices, tuning)
    slow = fast if loose_plan == planned.plan else _prepare(loose_plan, devices, tuning)
    host = HostCall(operation, options, specs, index)
    callback = _callback(fast, _slots(planned.plan, index), slow, _slots(loose_plan, index), host)
    aliases = {}
    if cfg.in_place:
        aliases = {cfg.fields.index("v_a"): 0, cfg.fields.index("s_a"): 1}
    if cfg.scales_aliased:
        aliases[cfg.fields.index("output_block_scale")] = len(results) - 1
    jax = _jax()
    call = jax.buffer_callback(
        callback,
        tuple(jax.jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
        input_output_aliases=aliases or None,
        command_buffer_compatible=True,
    )
    return _Entry(call, shapes, out_dtype == FP8, host)


def _jax_dtype(name: str) -> Any:
    if name in ("bfloat16", FP8):
        import ml_dtypes

        return numpy.dtype(getattr(ml_dtypes, name))
    return numpy.dtype(name)


def _prepare(plan: tuple, devices: tuple[int, ...], tuning: _tuning.Tuning) -> dict[int, tuple]:
    """Each launch compiled, loaded and packed for every device (addresses patched at each call)."""
    return {
        device: tuple(_kernels.prepare(launch, device, {}, tuning.programmatic_launch) for launch in plan)
        for device in devices
    }


def _slots(plan: tuple, index: dict[str, int]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per launch, its pointer parameters as (parameter, buffer index, byte offset)."""
    return tuple(
        tuple((slot, index[field], offset) for slot, field, offset in launch.pointers) for launch in plan
    )


# -- the callback (run time) ----------------------------------------------------------------------

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _pointer(buffer: Any) -> int:
    """A Buffer's device address: its CUDA array interface, or its DLPack tensor's data (XLA's
    array interface has no FP8 type; FP8 results are declared uint8, so this is a fallback)."""
    try:
        return buffer.__cuda_array_interface__["data"][0] or 0
    except Exception:  # noqa: BLE001 - jaxlib raises its own error type for unsupported dtypes
        capsule = buffer.__dlpack__()
        return ctypes.c_void_p.from_address(_capsule_pointer(capsule, b"dltensor")).value or 0


def _stream_of(context: Any) -> int:
    return context.stream


def _callback(fast: dict, fast_slots: tuple, slow: dict, slow_slots: tuple, host: HostCall):
    """The buffer_callback's function: read addresses, patch them in, launch on XLA's stream.

    Capture-safe: it launches only on ``ctx.stream``, allocates nothing, never synchronises and
    reads no device data, so XLA can record it into a command buffer (a CUDA graph)."""
    launch_patched = _kernels.launch_patched

    def callback(context, outputs, *inputs):
        buffers = (*inputs, *outputs)
        kind, device = buffers[-1].__dlpack_device__()
        if kind != _DLPACK_CUDA:
            _on_host(host, buffers)
            return
        pointers = [_pointer(buffer) for buffer in buffers]
        bits = 0
        for pointer in pointers:
            bits |= pointer
        launches, slots = (slow, slow_slots) if bits & _MISALIGNED else (fast, fast_slots)
        prepared = launches.get(device)
        if prepared is None:
            raise RuntimeError(
                f"cupy_merge.jax: the merge runs on CUDA device {device}, which JAX did not list when it "
                f"traced the call (launches are prepared for {sorted(launches)})"
            )
        stream = _stream_of(context)
        for launch, launch_slots in zip(prepared, slots):
            launch_patched(
                launch, stream,
                [(slot, pointers[i] + offset if pointers[i] else 0) for slot, i, offset in launch_slots],
            )  # fmt: skip

    return callback


def _on_host(call: HostCall, buffers: tuple) -> None:
    """A merge placed on a non-CUDA device (JAX on CPU): refused. Tests replace this with NumPy."""
    raise RuntimeError(
        f"cupy_merge.jax: {call.operation.name} was placed on a {_device_kind(buffers)} device, but its kernels "
        f"run on NVIDIA GPUs only; run it on a CUDA device (jax.devices('cuda'))"
    )


def _device_kind(buffers: tuple) -> str:
    kind = buffers[-1].__dlpack_device__()[0]
    return {1: "CPU", 10: "ROCm"}.get(int(kind), f"DLPack type {int(kind)}")


# -- the traced function, its batching rules and its derivative ----------------------------------


def _raw(cfg: _Config, arrays: tuple) -> tuple:
    """One merge on the traced ``arrays`` (its operands in ``cfg.fields`` order, in ``cfg.layouts``)."""
    jax = _jax()
    avals = tuple((tuple(x.shape), numpy.dtype(x.dtype)) for x in arrays)
    entry = _entry(cfg, avals)
    if entry.call is None:
        return _varying(_empty_results(cfg, entry, arrays), arrays)
    outputs = list(entry.call(*arrays))
    if entry.fp8:
        outputs[0] = jax.lax.bitcast_convert_type(outputs[0], jax.jnp.float8_e4m3fn)
    return _varying(tuple(outputs), arrays)


# -- inside shard_map: the mesh axes a value varies over (JAX's "vma" type) --------------------------


def _vma(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere, or on a JAX
    without the type)."""
    typeof = getattr(_jax().jax, "typeof", None)
    if typeof is None:
        return frozenset()
    aval = typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10: the axes' types; 0.6-0.9: ``vma`` alone
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x: Any, axes: frozenset) -> Any:
    """``x`` typed as varying over ``axes`` too (its values unchanged)."""
    missing = tuple(sorted(axes - _vma(x)))
    if not missing:
        return x
    lax = _jax().lax
    pcast = getattr(lax, "pcast", None)
    return pcast(x, missing, to="varying") if pcast is not None else lax.pvary(x, missing)


def _varying(results: tuple, arrays: tuple) -> tuple:
    """A callback's results typed as varying over every axis its operands vary over: XLA's
    callbacks give untyped (replicated) results, which ``shard_map``'s type check refuses where
    they meet the operands' types (a custom VJP's gradients, a scan's carry)."""
    axes = frozenset().union(*(_vma(x) for x in arrays))
    return tuple(_vary(x, axes) for x in results) if axes else results


def _typed_like(grad: Any, primal: Any) -> Any:
    """A gradient of the type of its primal inside ``shard_map``: summed over the axes the primal
    does not vary over (a replicated operand, such as the sinks, gets every shard's share, as
    JAX's own rules give it), cast to vary over those it does."""
    if grad is None:
        return None
    extra = _vma(grad) - _vma(primal)
    if extra:
        grad = _jax().lax.psum(grad, tuple(sorted(extra)))
    return _vary(grad, _vma(primal))


def _empty_results(cfg: _Config, entry: _Entry, arrays: tuple) -> tuple:
    """Results of a merge with no tokens or no heads: empty arrays (the inputs, in place)."""
    jnp = _jax().jnp
    if cfg.in_place:
        return arrays[cfg.fields.index("v_a")], arrays[cfg.fields.index("s_a")]
    results = []
    for position, (shape, dtype) in enumerate(entry.results):
        if position == 0 and entry.fp8:
            dtype = jnp.float8_e4m3fn
        fill = -numpy.inf if position == 1 else 0
        results.append(jnp.full(shape, fill, dtype))
    if cfg.scales_aliased:
        results[-1] = arrays[cfg.fields.index("output_block_scale")]
    return tuple(results)


@functools.cache
def _batched(cfg: _Config):
    """The merge of ``cfg`` with its batching rule (``jax.custom_batching.custom_vmap``)."""
    jax = _jax().jax

    def merge(*arrays):
        return _raw(cfg, arrays)

    function = jax.custom_batching.custom_vmap(merge)
    rule = _rule_many if cfg.operation.many and "indptr" not in cfg.fields else _rule_two
    if "indptr" in cfg.fields:
        rule = _rule_varlen
    function.def_vmap(functools.partial(rule, cfg))
    return function


@functools.cache
def _differentiable(cfg: _Config):
    """:func:`_batched` with its derivative: ``jax.custom_vjp`` outside the ``custom_vmap`` (the
    order JAX requires), whose backward runs the merge's backward kernel (:func:`_vjp_backward`)
    from the merge's inputs (and an N-way or ragged merge's results: its residuals)."""
    jax = _jax().jax
    function = jax.custom_vjp(_batched(cfg))
    function.defvjp(functools.partial(_vjp_forward, cfg), functools.partial(_vjp_backward, cfg))
    return function


def _vjp_forward(cfg: _Config, *arrays: Any) -> tuple:
    """The merge, keeping its inputs and results for the backward; an FP8 output is refused (it has
    no gradient: rounding to FP8 is a step function). Only a differentiated call comes here."""
    if cfg.options.out_dtype == FP8:
        raise TypeError(
            f"cupy_merge.jax.{cfg.operation.name}: an FP8 (float8_e4m3fn) output is not differentiable; merge to "
            f"float32, float16 or bfloat16 to take gradients through the merge (and quantise after it), or "
            f"apply jax.lax.stop_gradient to its inputs"
        )
    results = _once_differentiable(cfg)(*arrays)
    return results, (arrays, tuple(results[:2]) if cfg.operation.many else None)


@functools.cache
def _once_differentiable(cfg: _Config):
    """:func:`_batched` as the custom_vjp's forward calls it: a derivative of it would be a second
    derivative of the merge (``jax.grad`` of ``jax.grad``), refused clearly."""
    jax = _jax().jax
    function = jax.custom_jvp(_batched(cfg))
    function.defjvp(functools.partial(_no_second_derivative, cfg.operation.name))
    return function


def _vjp_backward(cfg: _Config, residuals: tuple, cotangents: tuple) -> tuple:
    """The gradients of every operand of ``cfg`` (None for offsets and masks): one backward kernel,
    an N-way or ragged merge's given its results (which few rows of many states read)."""
    arrays, results = residuals
    given = dict(zip(cfg.fields, arrays))
    grad_out, grad_lse = cotangents[0], cotangents[1]
    options = _checks.backward_options(lse_base=2 if cfg.options.lse_base_2 else "e")
    sinks = ("sinks",) if "sinks" in given else ()
    if not cfg.operation.many:
        named = _two_way_gradients(cfg, given, grad_out, grad_lse, options)
    else:
        fields: tuple[str, ...]
        if "indptr" in given:
            operation, fields = MERGE_STATES_VARLEN_BACKWARD, ("v", "s", "indptr", "grad_out", "grad_lse")
        else:
            operation, fields = MERGE_STATES_BACKWARD, ("v", "s", "grad_out", "grad_lse")
        fields += ("merged", "merged_lse")
        values = dict(given, grad_out=grad_out, grad_lse=grad_lse, merged=results[0], merged_lse=results[1])
        grads = _backward_call(operation, options, cfg.tuning, fields + sinks, values)
        named = {"v": grads[0], "s": grads[1], "sinks": grads[2] if sinks else None}
    return tuple(_typed_like(named.get(field), given[field]) for field in cfg.fields)


def _either(*masks: Any) -> Any:
    """The union of the token masks given (None: no token)."""
    given = [mask for mask in masks if mask is not None]
    return functools.reduce(operator.or_, given) if given else None


def _two_way_gradients(cfg: _Config, given: dict, grad_out: Any, grad_lse: Any, options: Any) -> dict:
    """A two-way merge's gradients. Tokens the kernel does not merge are handed to it with empty
    (``-inf``) LSEs, which give exactly zero gradients whatever the values hold, and get their
    own after: where the mask of the in-place merge is False, ``v_a``/``s_a`` pass through (the
    gradients of an identity); past a prefill cut ``v_b``/``s_b`` do (with sinks, the kernel
    merges ``v_b`` with the sink alone there, as the forward does)."""
    jnp = _jax().jnp
    v_a, s_a, v_b, s_b = (given[field] for field in ("v_a", "s_a", "v_b", "s_b"))
    sinks, mask = given.get("sinks"), given.get("mask")
    tokens = v_a.shape[0]
    cut = getattr(cfg.options, "merge_tokens", None)
    pass_a = pass_b = only_b = None  # [T] masks: a (b) passes through; b merged with the sinks alone
    if mask is not None:
        pass_a = ~mask.astype(bool)
    if cut is not None and cut < tokens:
        tail = jnp.arange(tokens) >= cut
        pass_b, only_b = (tail, None) if sinks is None else (None, tail)
    drop_a, drop_b = _either(pass_a, pass_b, only_b), _either(pass_a, pass_b)
    if drop_a is not None:
        s_a = jnp.where(drop_a[None, :], -jnp.inf, s_a)
    kernel_lse = grad_lse
    if drop_b is not None:
        s_b = jnp.where(drop_b[None, :], -jnp.inf, s_b)
        kernel_lse = jnp.where(drop_b[None, :], 0.0, grad_lse)  # nothing merged there: no sink gradient
    values = {"v": v_a, "s": s_a, "v_b": v_b, "s_b": s_b, "grad_out": grad_out, "grad_lse": kernel_lse,
              "sinks": sinks}  # fmt: skip
    fields = ("v", "s", "v_b", "s_b", "grad_out", "grad_lse") + (() if sinks is None else ("sinks",))
    grad_v_a, grad_s_a, grad_v_b, grad_s_b, *grad_sinks = _backward_call(
        MERGE_STATE_BACKWARD, options, cfg.tuning, fields, values
    )
    if pass_a is not None:
        grad_v_a = jnp.where(pass_a[:, None, None], grad_out.astype(grad_v_a.dtype), grad_v_a)
        grad_s_a = jnp.where(pass_a[None, :], grad_lse, grad_s_a)
    if pass_b is not None:
        grad_v_b = jnp.where(pass_b[:, None, None], grad_out.astype(grad_v_b.dtype), grad_v_b)
        grad_s_b = jnp.where(pass_b[None, :], grad_lse, grad_s_b)
    return {"v_a": grad_v_a, "s_a": grad_s_a, "v_b": grad_v_b, "s_b": grad_s_b,
            "sinks": grad_sinks[0] if grad_sinks else None}  # fmt: skip


def _backward_call(operation: _dispatch.Operation, options: Any, tuning: _tuning.Tuning, fields: tuple,
                   values: dict) -> tuple:  # fmt: skip
    """One backward merge on arrays in the forward's own layouts (LSEs ``[H, T]``, N-way states
    ``[N, T, H, D]``, ``[N, H, T]``): ``(grad_v, grad_s[, grad_v_b, grad_s_b][, grad_sinks])``."""
    dense = operation is MERGE_STATES_BACKWARD
    layouts = tuple(
        "nt" if dense and field == "v" else "nht" if dense and field == "s" else
        "ht" if field in ("s", "s_b", "grad_lse", "merged_lse") else "" for field in fields
    )  # fmt: skip
    cfg = _Config(operation, options, tuning, fields, layouts)
    return tuple(_backward_function(cfg)(*(values[field] for field in fields)))


@functools.cache
def _backward_function(cfg: _Config):
    """:func:`_backward_batched` behind a derivative rule that refuses (second derivatives)."""
    jax = _jax().jax
    function = jax.custom_jvp(_backward_batched(cfg))
    function.defjvp(functools.partial(_no_second_derivative, cfg.operation.name))
    return function


def _no_second_derivative(name: str, primals: Any, tangents: Any) -> Any:
    merge = name.removesuffix("_backward")
    raise NotImplementedError(
        f"cupy_merge.jax.{merge}: merges are differentiable once; the gradient of a merge is not "
        f"differentiable again (jax.grad of jax.grad, jax.hessian, forward mode over a gradient are refused "
        f"rather than wrong)"
    )


def _sequential(cfg: _Config, size: int, in_batched: list, args: tuple, function: Any = None):
    """vmap by mapping: one merge (``function``, the merge of ``cfg`` by default) per batch element
    (unrolled when few), stacked."""
    jax = _jax()
    function = function or _batched(cfg)
    if 0 < size <= _UNROLL:
        results = [
            function(*(x[i] if batched else x for x, batched in zip(args, in_batched))) for i in range(size)
        ]
        stacked = tuple(jax.jnp.stack(column) for column in zip(*results))
    else:
        mapped = tuple(x for x, batched in zip(args, in_batched) if batched)

        def one(slices):
            given = iter(slices)
            return function(*(next(given) if batched else x for x, batched in zip(args, in_batched)))

        stacked = tuple(jax.lax.map(one, mapped))
    return stacked, (True,) * len(stacked)


def _broadcast(x: Any, batched: bool, size: int) -> Any:
    return x if batched else _jax().jnp.broadcast_to(x, (size, *x.shape))


def _lse_token_major(x: Any, layout: str, batched: bool, size: int) -> Any:
    """A batch of 2-D LSEs ([B, H, T] "ht" or [B, T, H] "th") as one token-major [B * T, H] buffer:
    free for "th" and for one token; a transpose of the (small) LSE otherwise."""
    x = _broadcast(x, batched, size)
    if layout == "th":
        return x.reshape(size * x.shape[1], x.shape[2])
    _, heads, tokens = x.shape
    if tokens == 1:
        return x.reshape(size, heads)
    return _jax().jnp.swapaxes(x, 1, 2).reshape(size * tokens, heads)


def _lse_unfold(x: Any, size: int, tokens: int, layout: str) -> Any:
    """A token-major [B * T, H] result back to the batch of ``layout`` ([B, H, T] or [B, T, H])."""
    heads = x.shape[-1]
    x = x.reshape(size, tokens, heads)
    if layout == "th":
        return x
    if tokens == 1:
        return x.reshape(size, heads, 1)
    return _jax().jnp.swapaxes(x, 1, 2)


def _fold_rows(x: Any, batched: bool, size: int) -> Any:
    """[B, T, ...] (broadcast when unbatched) as [B * T, ...]: free for dense token-major arrays."""
    x = _broadcast(x, batched, size)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(cfg: _Config, outputs: tuple, size: int, tokens: int) -> tuple:
    out = outputs[0].reshape(size, tokens, *outputs[0].shape[1:])
    unfolded = [out, _lse_unfold(outputs[1], size, tokens, cfg.out_layout)]
    if len(outputs) > 2:
        unfolded.append(outputs[2].reshape(size, tokens, outputs[2].shape[-1]))
    return tuple(unfolded)


def _rule_two(cfg: _Config, size: int, in_batched: list, *args: Any):
    """Two-way merges: B folded into the tokens ([B, T, H, D] -> [B * T, H, D], free; the LSEs
    token-major, free for one token), one launch. Sequential when a value array, the sinks or the
    scale is not batched alike, or a prefill cut would fall inside the folded tokens."""
    if cfg.in_place:
        # The outputs alias v_a and s_a: each batch element needs its own copy to be written into
        # (mapped elements sharing one unbatched buffer would all write into it), and so the
        # whole batch folds into one launch.
        args = tuple(_broadcast(x, batched, size) if field in ("v_a", "s_a", "v_b", "s_b") else x
                     for field, x, batched in zip(cfg.fields, args, in_batched))  # fmt: skip
        in_batched = [batched or field in ("v_a", "s_a", "v_b", "s_b") for field, batched in zip(cfg.fields, in_batched)]
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    tokens = given["v_a"].shape[-3]
    cut = getattr(cfg.options, "merge_tokens", None)
    if not (batched["v_a"] and batched["v_b"]) or batched.get("sinks") or batched.get("output_scale"):
        return _sequential(cfg, size, in_batched, args)
    if cut is not None:
        # The cut counts each batch element's own tokens: one past every token is no cut at all,
        # and one inside them would fall once into the folded tokens, so each element is merged alone.
        if cut < tokens:
            return _sequential(cfg, size, in_batched, args)
        cfg = cfg._replace(options=cfg.options._replace(merge_tokens=None))
    folded, inner = _fold_tokens(cfg, size, in_batched, args)
    outputs = _batched(inner._replace(out_layout="th"))(*folded)
    return _unfold(cfg, outputs, size, tokens), (True,) * len(outputs)


#: How a batch folds into the tokens of each operand of a two-way merge and its gradient: "rows"
#: ([B, T, ...] -> [B * T, ...], free), "lse" ([B, H, T] or [B, T, H] -> token-major [B * T, H]),
#: "shared" (one for the whole batch: the sinks, the scale).
_FOLDS = {
    "v_a": "rows", "v_b": "rows", "v": "rows", "mask": "rows", "output_block_scale": "rows", "grad_out": "rows",
    "merged": "rows", "s_a": "lse", "s_b": "lse", "s": "lse", "grad_lse": "lse", "merged_lse": "lse",
    "sinks": "shared", "output_scale": "shared",
}  # fmt: skip


def _fold_tokens(cfg: _Config, size: int, in_batched: list, args: tuple) -> tuple[list, _Config]:
    """A two-way merge's (or gradient's) operands with the batch folded into their tokens, and the
    config of the folded call (LSEs token-major)."""
    folded, layouts = [], []
    for field, layout, x, batched in zip(cfg.fields, cfg.layouts, args, in_batched):
        fold = _FOLDS[field]
        if fold == "rows":
            x = _fold_rows(x, batched, size)
        elif fold == "lse":
            x, layout = _lse_token_major(x, layout, batched, size), "th"
        folded.append(x)
        layouts.append(layout)
    return folded, cfg._replace(layouts=tuple(layouts))


def _rule_many(cfg: _Config, size: int, in_batched: list, *args: Any):
    """N-way merges: B folded into the tokens where the values allow it for free (one token, one
    state, or token-major values), the LSE made token-major; sequential otherwise."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, layout = given["v"], cfg.layout("v")
    if not batched["v"] or batched.get("sinks") or batched.get("output_scale"):
        return _sequential(cfg, size, in_batched, args)
    if layout == "tn":
        _, tokens, states, heads, head_size = v.shape
        v, v_layout = v.reshape(size * tokens, states, heads, head_size), "tn"
    else:
        _, states, tokens, heads, head_size = v.shape
        if tokens == 1:  # [B, N, 1, H, D] is token-major [T' = B, N, H, D]
            v, v_layout = v.reshape(size, states, heads, head_size), "tn"
        elif states == 1:
            v, v_layout = v.reshape(1, size * tokens, heads, head_size), "nt"
        else:  # folding would copy every value: one launch per batch element instead
            return _sequential(cfg, size, in_batched, args)
    s = _broadcast(given["s"], batched["s"], size)
    if cfg.layout("s") == "tnh":
        s = s.reshape(size * tokens, states, heads)
    elif tokens == 1:
        s = s.reshape(size, states, heads)
    else:
        s = jnp.transpose(s, (0, 3, 1, 2)).reshape(size * tokens, states, heads)
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(v)
        elif field == "s":
            folded.append(s)
        elif field == "output_block_scale":
            folded.append(_fold_rows(x, batched[field], size))
        else:
            folded.append(x)
    layouts = tuple(
        v_layout if field == "v" else "tnh" if field == "s" else lay
        for field, lay in zip(cfg.fields, cfg.layouts)
    )
    outputs = _batched(cfg._replace(layouts=layouts, out_layout="th"))(*folded)
    return _unfold(cfg, outputs, size, tokens), (True,) * len(outputs)


def _rule_varlen(cfg: _Config, size: int, in_batched: list, *args: Any):
    """Ragged merges: the batches' rows back to back ([B, S, H, D] -> [B * S, H, D], free), each
    batch's offsets shifted by its first row, and one extra token a batch spanning the rows
    between its last offset and the next batch's first (dropped after). Offsets a batch's own
    rows do not cover give NaN, as unbatched. Sequential when the values, sinks or scale are not
    batched alike, or group scales are given to write into."""
    jax = _jax()
    jnp = jax.jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, indptr = given["v"], given["indptr"]
    tokens = indptr.shape[-1] - 1
    if not batched["v"] or batched.get("sinks") or batched.get("output_scale") or cfg.scales_aliased:
        return _sequential(cfg, size, in_batched, args)
    _, rows, heads, head_size = v.shape
    if tokens == 0 or (indptr.dtype == numpy.int32 and size * rows >= 2**31 - 1):  # int32 offsets overflow
        return _sequential(cfg, size, in_batched, args)
    indptr = _broadcast(indptr, batched["indptr"], size)
    begin, end = indptr[:, :-1], indptr[:, 1:]
    valid = (begin >= 0) & (end >= begin) & (end <= rows) & (end - begin <= MAX_STATES_PER_TOKEN)
    shifted = jnp.clip(indptr, 0, rows) + (jnp.arange(size, dtype=indptr.dtype) * rows)[:, None]
    offsets = jnp.concatenate([shifted.reshape(-1), jnp.full((1,), size * rows, indptr.dtype)])
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(v.reshape(size * rows, heads, head_size))
        elif field == "s":
            folded.append(_lse_token_major(x, cfg.layout("s"), batched["s"], size))
        elif field == "indptr":
            folded.append(offsets)
        else:
            folded.append(x)
    layouts = tuple("th" if field == "s" else lay for field, lay in zip(cfg.fields, cfg.layouts))
    outputs = _batched(cfg._replace(layouts=layouts, out_layout="th"))(*folded)
    kept = tokens + 1
    out = outputs[0].reshape(size, kept, heads, head_size)[:, :tokens]
    lse = outputs[1].reshape(size, kept, heads)[:, :tokens]
    results = [
        jnp.where(valid[:, :, None, None], out, jnp.nan),
        _lse_unfold(jnp.where(valid[:, :, None], lse, jnp.nan).reshape(size * tokens, heads), size, tokens,
                    cfg.out_layout),
    ]  # fmt: skip
    if len(outputs) > 2:
        scales = outputs[2].reshape(size, kept, outputs[2].shape[-1])[:, :tokens]
        results.append(jnp.where(valid[:, :, None], scales, jnp.nan))
    return tuple(results), (True,) * len(results)


# -- the backward merges: traced like the merges, and batched ---------------------------------------

#: The array each value or LSE gradient is of (it takes that array's shape, dtype and layout).
_GRADIENT_OF = {"grad_v": "v", "grad_s": "s", "grad_v_b": "v_b", "grad_s_b": "s_b"}


def _build_backward_entry(cfg: _Config, avals: tuple) -> _Entry:
    """Check, plan, compile and prepare one backward merge (trace time), and make its buffer_callback.

    Each value or LSE gradient is written in the layout of the array it is of (a batch folded
    into the tokens unfolds as its inputs fold: free for values); the gradients that must start
    as zeros (the sinks', which every token adds into) are passed in as zeros and aliased to the
    results."""
    operation, options, tuning = cfg.operation, cfg.options, cfg.tuning
    physical = {field: (tuple(shape), dtype) for field, (shape, dtype) in zip(cfg.fields, avals)}
    inputs = {
        field: _spec(shape, dtype, layout)
        for field, layout, (shape, dtype) in zip(cfg.fields, cfg.layouts, avals)
    }
    specs = BackwardOperands(**{field: inputs.get(field) for field in BackwardOperands._fields})
    planned = _dispatch.plan_specs(operation, options, tuning, specs)  # every shape rule; what to allocate
    results: list[tuple[str, tuple[int, ...], Any]] = []
    gradients = {}
    for fresh in planned.fresh:
        like = _GRADIENT_OF.get(fresh.field)
        if like is None:  # the sinks'
            shape, dtype = tuple(fresh.shape), numpy.dtype("float32")
            gradients[fresh.field] = _arrays.contiguous_spec(shape, "float32", 4, 0)
        else:
            shape, dtype = physical[like]
            gradients[fresh.field] = _spec(shape, dtype, cfg.layout(like))
        results.append((fresh.field, shape, numpy.dtype(dtype)))
    zeroed = tuple(position for position, fresh in enumerate(planned.fresh) if fresh.zeroed)
    shapes = tuple((shape, dtype) for _, shape, dtype in results)
    if not planned.plan:  # no heads, or no tokens of a dense merge: nothing to write
        return _Entry(None, shapes, False, zeroed=zeroed)
    specs = specs._replace(**gradients)
    names: Any = operation.names
    state, num_states = _checks.check_backward(specs, names, options)
    plan = _plan.plan_backward(state, num_states, specs, options, tuning)
    loose = specs._replace(**{
        field: spec._replace(align=min(spec.align, spec.itemsize))
        for field, spec in zip(specs._fields, specs) if spec is not None
    })  # fmt: skip
    loose_plan = _plan.plan_backward(state, num_states, loose, options, tuning)
    first_result = len(cfg.fields) + len(zeroed)  # buffers: inputs, the zeros, then the results
    index = {field: position for position, field in enumerate(cfg.fields)}
    index.update({field: first_result + position for position, (field, _, _) in enumerate(results)})
    devices = _devices_to_prepare()
    fast = _prepare(plan, devices, tuning)
    slow = fast if loose_plan == plan else _prepare(loose_plan, devices, tuning)
    host = HostCall(operation, options, specs, index)
    callback = _callback(fast, _slots(plan, index), slow, _slots(loose_plan, index), host)
    aliases = {len(cfg.fields) + k: position for k, position in enumerate(zeroed)}
    jax = _jax()
    call = jax.buffer_callback(
        callback,
        tuple(jax.jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
        input_output_aliases=aliases or None,
        command_buffer_compatible=True,
    )
    return _Entry(call, shapes, False, host, zeroed)


def _raw_backward(cfg: _Config, arrays: tuple) -> tuple:
    """One backward merge on the traced ``arrays`` (``cfg.fields`` order, in ``cfg.layouts``)."""
    jnp = _jax().jnp
    avals = tuple((tuple(x.shape), numpy.dtype(x.dtype)) for x in arrays)
    entry = _entry(cfg, avals, _build_backward_entry)
    if entry.call is None:
        return tuple(jnp.zeros(shape, dtype) for shape, dtype in entry.results)
    zeros = [jnp.zeros(*entry.results[position]) for position in entry.zeroed]
    return _varying(tuple(entry.call(*arrays, *zeros)), arrays)


@functools.cache
def _backward_batched(cfg: _Config):
    """The backward merge of ``cfg`` with its batching rule (vmap of a gradient, gradient of a vmap)."""
    jax = _jax().jax

    def gradients(*arrays):
        return _raw_backward(cfg, arrays)

    function = jax.custom_batching.custom_vmap(gradients)
    rule = {
        MERGE_STATE_BACKWARD: _rule_two_backward,
        MERGE_STATES_BACKWARD: _rule_many_backward,
        MERGE_STATES_VARLEN_BACKWARD: _rule_varlen_backward,
    }[cfg.operation]
    function.def_vmap(functools.partial(rule, cfg))
    return function


def _backward_sequential(cfg: _Config, size: int, in_batched: list, args: tuple):
    return _sequential(cfg, size, in_batched, args, _backward_batched(cfg))


def _rows_unfold(x: Any, size: int, tokens: int) -> Any:
    return x.reshape(size, tokens, *x.shape[1:])


def _rule_two_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """A two-way merge's gradients, batched as the merge is: B folded into the tokens, one launch;
    one launch a batch element when a value array is not batched or with sinks (whose gradient
    sums over the tokens: each batch element has its own)."""
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    if not (batched["v"] and batched["v_b"]) or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    tokens = given["v"].shape[-3]
    folded, inner = _fold_tokens(cfg, size, in_batched, args)
    grads = _backward_batched(inner)(*folded)
    results = tuple(
        _lse_unfold(grad, size, tokens, cfg.layout(of)) if _FOLDS[of] == "lse" else _rows_unfold(grad, size, tokens)
        for grad, of in zip(grads, ("v", "s", "v_b", "s_b"))
    )
    return results, (True,) * 4


def _rule_many_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """An N-way merge's gradients, folded as the merge folds (one token, one state, or token-major
    values: free for the values); one launch a batch element otherwise, or with sinks."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, layout = given["v"], cfg.layout("v")
    if not batched["v"] or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    if layout == "tn":
        _, tokens, states, heads, head_size = v.shape
        folded_v, v_layout = v.reshape(size * tokens, states, heads, head_size), "tn"
    else:
        _, states, tokens, heads, head_size = v.shape
        if tokens == 1:
            folded_v, v_layout = v.reshape(size, states, heads, head_size), "tn"
        elif states == 1:
            folded_v, v_layout = v.reshape(1, size * tokens, heads, head_size), "nt"
        else:
            return _backward_sequential(cfg, size, in_batched, args)
    s = _broadcast(given["s"], batched["s"], size)
    transposed = cfg.layout("s") != "tnh" and tokens != 1
    if transposed:
        folded_s = jnp.transpose(s, (0, 3, 1, 2)).reshape(size * tokens, states, heads)
    else:
        folded_s = s.reshape(size * tokens, states, heads)
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(folded_v)
        elif field == "s":
            folded.append(folded_s)
        elif field in ("grad_out", "merged"):
            folded.append(_fold_rows(x, batched[field], size))
        else:  # grad_lse, merged_lse
            folded.append(_lse_token_major(x, cfg.layout(field), batched[field], size))
    layouts = tuple(
        v_layout if field == "v" else "tnh" if field == "s" else "th" if field in ("grad_lse", "merged_lse") else lay
        for field, lay in zip(cfg.fields, cfg.layouts)
    )  # fmt: skip
    grad_v, grad_s = _backward_batched(cfg._replace(layouts=layouts))(*folded)
    if transposed:
        grad_s = jnp.transpose(grad_s.reshape(size, tokens, states, heads), (0, 2, 3, 1))
    else:
        grad_s = grad_s.reshape(s.shape)
    return (grad_v.reshape(v.shape), grad_s), (True, True)


def _pad_token(x: Any, layout: str) -> Any:
    """One more token of zeros at the end of each batch element's token axis."""
    axis = {"th": 1, "ht": 2}.get(layout, 1)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, 1)
    return _jax().jnp.pad(x, widths)


def _rule_varlen_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """A ragged merge's gradients, folded as the merge folds (the batches' rows back to back, their
    offsets shifted, one extra token a batch over the rows between batches, with zero
    cotangents). Rows that no token with offsets in range owns are handed to the kernel with
    empty LSEs, so they (the extra tokens' included) get zero gradients whatever their values
    hold, as unbatched. Gradients need non-decreasing offsets, batched or not. One launch a
    batch element when the values are not batched, with sinks, or when a batch element holds
    more rows than a token may have states (the extra token would be out of range, and the
    kernel zeroes such a token's rows with one row of threads a head)."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, indptr = given["v"], given["indptr"]
    tokens = indptr.shape[-1] - 1
    if not batched["v"] or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    _, rows, heads, head_size = v.shape
    if tokens == 0 or rows > MAX_STATES_PER_TOKEN or (indptr.dtype == numpy.int32 and size * rows >= 2**31 - 1):
        return _backward_sequential(cfg, size, in_batched, args)
    indptr = _broadcast(indptr, batched["indptr"], size)
    begin, end = indptr[:, :-1], indptr[:, 1:]
    valid = (begin >= 0) & (end >= begin) & (end <= rows)  # the backward kernel's own rule
    shifted = jnp.clip(indptr, 0, rows) + (jnp.arange(size, dtype=indptr.dtype) * rows)[:, None]
    offsets = jnp.concatenate([shifted.reshape(-1), jnp.full((1,), size * rows, indptr.dtype)])
    batch = jnp.arange(size)[:, None]
    edges = jnp.zeros((size, rows + 1), jnp.int32)
    edges = (
        edges.at[batch, jnp.where(valid, begin, rows)].add(1).at[batch, jnp.where(valid, end, rows)].add(-1)
    )
    owned = jnp.cumsum(edges, axis=1)[:, :rows] > 0  # [B, rows]
    folded = []
    for field, x in zip(cfg.fields, args):
        layout = cfg.layout(field)
        if field == "v":
            folded.append(v.reshape(size * rows, heads, head_size))
        elif field == "s":
            x = _broadcast(x, batched[field], size)
            keep = owned[:, :, None] if layout == "th" else owned[:, None, :]
            folded.append(_lse_token_major(jnp.where(keep, x, -jnp.inf), layout, True, size))
        elif field == "indptr":
            folded.append(offsets)
        elif field in ("grad_out", "merged"):
            folded.append(_fold_rows(_pad_token(_broadcast(x, batched[field], size), "th"), True, size))
        else:  # grad_lse, merged_lse (the extra tokens' 0: their rows' empty LSEs give weights of 0)
            x = _broadcast(x, batched[field], size)
            if field == "merged_lse":  # offsets out of range merged to NaN; folded, their rows are -inf
                x = jnp.where(valid[:, :, None] if layout == "th" else valid[:, None, :], x, -jnp.inf)
            folded.append(_lse_token_major(_pad_token(x, layout), layout, True, size))
    layouts = tuple(
        "th" if field in ("s", "grad_lse", "merged_lse") else lay for field, lay in zip(cfg.fields, cfg.layouts)
    )
    grad_v, grad_s = _backward_batched(cfg._replace(layouts=layouts))(*folded)
    results = (grad_v.reshape(size, rows, heads, head_size), _lse_unfold(grad_s, size, rows, cfg.layout("s")))
    return results, (True, True)


# -- the entry points -----------------------------------------------------------------------------

_jitted: dict[tuple, Any] = {}


def _function(operation, options, tuning, fields: tuple[str, ...], in_place: bool, scales_aliased: bool):
    """The cached ``jax.jit`` of one merge's traced function (no retracing between calls)."""
    key = (operation, options, tuning, fields, in_place, scales_aliased)
    function = _jitted.get(key)
    if function is None:
        layouts = tuple("ht" if field in ("s_a", "s_b") or (field == "s" and "indptr" in fields) else
                        "nt" if field == "v" and "indptr" not in fields else
                        "nht" if field == "s" else "" for field in fields)  # fmt: skip
        cfg = _Config(operation, options, tuning, fields, layouts, "ht", in_place, scales_aliased)
        function = _jax().jax.jit(_differentiable(cfg))
        with _lock:
            function = _jitted.setdefault(key, function)
    return function


def _clear_caches() -> None:
    """Forget every traced merge (for tests that change how launches are prepared)."""
    with _lock:
        _entries.clear()
        _jitted.clear()
        _routes.clear()
        _quick.clear()
    _batched.cache_clear()
    _backward_batched.cache_clear()
    _backward_function.cache_clear()
    _once_differentiable.cache_clear()
    _differentiable.cache_clear()


#: Stands for group scales the merge allocates (cupy-merge's option rules want the array).
_FRESH_SCALES = object()


class _Route(NamedTuple):
    """How one call pattern reaches its jitted function: which operands it passes, in order."""

    function: Any
    operands: Any  # operator.itemgetter of the operands passed (a tuple)
    required: tuple[int, ...]  # the operands that may not be None
    names: tuple[str, ...]  # the public names of the operands passed
    scale: int  # the position of output_scale among them, or -1


#: The platforms of JAX devices whose arrays the kernels read (tests add JAX's CPU for a stand-in).
_LAUNCH_PLATFORMS = frozenset({"gpu", "cuda"})
_placements: dict[Any, frozenset] = {}  # the platforms of a sharding's devices


def _call(route: _Route, arrays: tuple) -> tuple:
    """Run a route's jitted function on the operands it passes: each concrete array checked to be
    on a CUDA device (a CPU array would reach the kernels' callback on the CPU), and a weakly
    typed scale (a Python float; float64 under ``jax_enable_x64``) taken as the float32 it means."""
    passed = route.operands(arrays)
    # The values decide where XLA runs the merge (arrays on two devices are JAX's own error).
    _check_placement(passed[:1], route.names)
    if route.scale >= 0:
        scale = passed[route.scale]
        if type(scale) in (float, int):
            passed = (*passed[: route.scale], numpy.float32(scale), *passed[route.scale + 1 :])
        elif getattr(scale, "weak_type", False) and scale.dtype.kind == "f":
            passed = (*passed[: route.scale], scale.astype(numpy.float32), *passed[route.scale + 1 :])
    return route.function(*passed)


def _has_cuda_devices() -> bool:
    try:
        return bool(_devices_to_prepare())
    except RuntimeError:  # a JAX without CUDA: the merge says what to install when it is traced
        return False


def _check_placement(arrays: tuple, names: tuple) -> None:
    """Each concrete JAX array must lie on a CUDA device, where JAX has one (``ValueError`` naming it)."""
    tracer = _jax().tracer
    for x, name in zip(arrays, names):
        if x is None or isinstance(x, tracer) or not hasattr(x, "sharding"):
            continue
        sharding = x.sharding
        platforms = _placements.get(sharding)
        if platforms is None:
            platforms = frozenset(device.platform for device in sharding.device_set)
            if len(_placements) < 256:
                _placements[sharding] = platforms
        if not platforms <= _LAUNCH_PLATFORMS and _has_cuda_devices():
            kinds = sorted(platform.upper() for platform in platforms)
            raise ValueError(
                f"{name}: expected a JAX array on a CUDA device, got one on {' and '.join(kinds)}; the kernels run "
                f"on NVIDIA GPUs only: place it with jax.device_put(x, jax.devices('cuda')[0])"
            )


_routes: dict[tuple, _Route] = {}
#: Routes by the public call's own arguments (options as given, which operands are None).
_quick: dict[tuple, _Route] = {}
#: Per family: the operands every call passes, and the optional ones (by index into the record).
_REQUIRED = {
    "two": tuple(TwoStateOperands._fields.index(f) for f in ("v_a", "s_a", "v_b", "s_b")),
    "many": tuple(ManyStateOperands._fields.index(f) for f in ("v", "s")),
    "varlen": tuple(ManyStateOperands._fields.index(f) for f in ("v", "s", "indptr")),
}
_OPTIONAL = {
    "two": tuple(TwoStateOperands._fields.index(f) for f in _TWO_OPTIONAL),
    "many": tuple(ManyStateOperands._fields.index(f) for f in _MANY_OPTIONAL),
    "varlen": tuple(ManyStateOperands._fields.index(f) for f in _MANY_OPTIONAL),
}


def _family(operation: _dispatch.Operation) -> str:
    if operation is MERGE_STATES_VARLEN:
        return "varlen"
    return "many" if operation.many else "two"


def _route(operation: _dispatch.Operation, options: Any, operands: Any, in_place: bool = False) -> _Route:
    """Check what can be checked before tracing and find the jitted function of this call pattern."""
    family = _family(operation)
    required = _REQUIRED[family]
    for index in required:
        if operands[index] is None:
            raise TypeError(f"{operation.names[index]}: expected a JAX array, got None")
    if family == "varlen" and options.check_indptr:
        _check_indptr_on_host(operands, operation.names)  # type: ignore[arg-type]
        options = options._replace(check_indptr=False)
    present = tuple(operands[index] is not None and operands[index] is not _FRESH_SCALES
                    for index in _OPTIONAL[family])  # fmt: skip
    key = (operation, options, _tuning.current(), in_place, present)
    route = _routes.get(key)
    if route is None:
        indices = required + tuple(index for index, given in zip(_OPTIONAL[family], present) if given)
        fields = tuple(operands._fields[index] for index in indices)
        scales_aliased = "output_block_scale" in fields
        function = _function(operation, options, key[2], fields, in_place, scales_aliased)
        names = tuple(operation.names[index] for index in indices)
        scale = fields.index("output_scale") if "output_scale" in fields else -1
        route = _Route(function, operator.itemgetter(*indices), required, names, scale)
        with _lock:
            if len(_routes) >= 4096:
                _routes.clear()
            _routes[key] = route
    return route


def _apply(operation: _dispatch.Operation, options: Any, operands: Any, in_place: bool = False) -> tuple:
    """Run one merge of JAX arrays (or tracers): its jitted function on the operands given."""
    route = _route(operation, options, operands, in_place)
    return _call(route, operands)


def _run(key: tuple | None, arrays: tuple, slow: Any) -> tuple:
    """A public merge's call: the route remembered for ``key`` (its arguments as given), else the one
    ``slow()`` finds (options normalised, operands checked). ``arrays``: the operand record's values."""
    route = None
    if key is not None:
        try:
            route = _quick.get(key)
        except TypeError:  # an unhashable argument: the slow path explains it, or takes it
            key = None
    if route is not None:
        for index in route.required:
            if arrays[index] is None:
                route = None
                break
    if route is None:
        route = slow()
        if key is not None:
            with _lock:
                if len(_quick) >= 4096:
                    _quick.clear()
                _quick[key] = route
    return _call(route, arrays)


def _check_indptr_on_host(operands: ManyStateOperands, names: ManyStateOperands) -> None:
    """``check_indptr=True``: a concrete indptr is copied to the host and checked (a constant under
    ``jax.jit`` too, once, when traced); a traced one cannot be: its values exist only when the
    computation runs."""
    indptr, v = operands.indptr, operands.v
    if isinstance(indptr, _jax().tracer):
        raise ValueError(  # noqa: TRY004 - a value (True) that cannot be honoured here
            f"check_indptr: {names.indptr}'s values cannot be checked on the host under jax.jit, vmap or "
            f"other JAX transformations (it would read device memory while tracing); pass "
            f"check_indptr=False: tokens whose offsets are out of range then come out NaN, and nothing "
            f"outside {names.v} is read"
        )
    shape: tuple = getattr(indptr, "shape", ())
    if len(shape) != 1 or shape[0] < 1 or len(getattr(v, "shape", ())) != 3:
        return  # the shape rules refuse it when the call is traced
    values = numpy.asarray(indptr)
    if values.dtype.kind not in "iu":
        return
    _checks.indptr_values(values, v.shape[0], names.indptr)


#: The eager merges' words for an output that is a JAX array (``_dispatch.prepare`` says the same).
_IMMUTABLE = "JAX arrays are immutable and cannot be written in place"
_FOREIGN_OUTPUT = "a merge of JAX arrays returns new JAX arrays and writes into none"


def _jax_call(operation: _dispatch.Operation, options: Any, operands: Any, stream: Any) -> Any:
    """cupy-merge's public merges on JAX arrays and tracers (registered with the dispatcher)."""
    names = operation.names
    if isinstance(names, BackwardOperands):
        _refuse_stream(stream)
        return _apply_backward(operation, options, operands)
    if not isinstance(names, (TwoStateOperands, ManyStateOperands)):
        raise NotImplementedError(f"{operation.name}: not available for JAX arrays yet")
    if not operation.allocates:
        out = operands.out
        what = _IMMUTABLE if out is None or _arrays.is_jax(out) else _FOREIGN_OUTPUT
        returned = "(v, s)" if operation is MERGE_STATE_IN_PLACE else "(output, output_lse)"
        raise TypeError(
            f"{names.out}: {what}; leave it out and call cupy_merge.jax.{operation.name}(...) instead, which "
            f"returns the merged {returned}"
        )
    for field in ("out", "out_lse", "output_block_scale"):
        obj = getattr(operands, field)
        if obj is None:
            continue
        what = _IMMUTABLE if _arrays.is_jax(obj) else _FOREIGN_OUTPUT
        hint = (
            f" and call cupy_merge.jax.{operation.name}(..., quant_group_size=...), which returns the group "
            f"scales as a third result"
            if field == "output_block_scale"
            else f" ({operation.name} returns new arrays)"
        )
        raise TypeError(f"{getattr(names, field)}: {what}; leave it out{hint}")
    _refuse_stream(stream)
    return _apply(operation, options, operands)


def _refuse_stream(stream: Any) -> None:
    if stream is not None:
        raise TypeError(
            f"stream: expected None for JAX arrays, got {stream!r}; the merge runs on XLA's own stream, "
            f"ordered with the computation around it"
        )


#: The backward merges' operands, in the order they are passed.
_BACKWARD_INPUTS = ("v", "s", "v_b", "s_b", "indptr", "grad_out", "grad_lse", "sinks", "merged", "merged_lse")


def _apply_backward(operation: _dispatch.Operation, options: Any, operands: BackwardOperands) -> tuple:
    """cupy-merge's backward merges (``cupy_merge.merge_states_backward(...)``, ...) on JAX arrays
    and tracers: a cached ``jax.jit`` of the backward the merges' derivatives run."""
    names = operation.names
    for field in sorted(operation.required):
        if getattr(operands, field) is None:
            raise TypeError(f"{getattr(names, field)}: expected a JAX array, got None")
    fields = tuple(field for field in _BACKWARD_INPUTS if getattr(operands, field) is not None)
    _check_placement(tuple(getattr(operands, field) for field in fields), tuple(getattr(names, field) for field in fields))
    tuning = _tuning.current()
    key = (operation, options, tuning, fields)
    function = _jitted.get(key)
    if function is None:

        def backward(*arrays):
            return _backward_call(operation, options, tuning, fields, dict(zip(fields, arrays)))

        function = _jax().jax.jit(backward)
        with _lock:
            function = _jitted.setdefault(key, function)
    grads = list(function(*(getattr(operands, field) for field in fields)))
    if operands.sinks is None:
        grads.append(None)  # grad_sinks
    return tuple(grads)


_dispatch.register_jax(_jax_call)


# -- the public JAX merges: one entry, from the declarations --------------------------------------


class _EntryPoint(NamedTuple):
    """What one public JAX merge passes on: the argument name of each operand of its record (None
    for the outputs it returns), its option arguments (those its declaration's options builder
    takes) and its optional operands (by index into the record)."""

    names: tuple[str | None, ...]
    options: tuple[str, ...]
    optional: tuple[int, ...]


_entry_points: dict[_dispatch.Operation, _EntryPoint] = {}


def _entry_point(operation: _dispatch.Operation, arguments: dict) -> _EntryPoint:
    point = _entry_points.get(operation)
    if point is None:
        accepted = inspect.signature(operation.options).parameters
        options = tuple(name for name in arguments if name in accepted and name != "output_block_scale")
        records = operation.names
        names = tuple(None if field in ("out", "out_lse") else name for field, name in zip(records._fields, records))
        point = _entry_points.setdefault(operation, _EntryPoint(names, options, _OPTIONAL[_family(operation)]))
    return point


def _merge(operation: _dispatch.Operation, arguments: dict, in_place: bool = False) -> tuple:
    """A public JAX merge called with ``arguments`` (its own, by name): the jitted function of its
    call pattern, remembered by the options as given (with their types: True is not 1) and which
    optional operands are given; the outputs it writes are its results (JAX arrays are immutable)."""
    point = _entry_points.get(operation) or _entry_point(operation, arguments)
    names = operation.names
    arrays = tuple(map(arguments.get, point.names))
    values = tuple(map(arguments.__getitem__, point.options))
    key = None
    if arguments.get("check_indptr") is not True:  # check_indptr=True reads indptr on every call
        key = (operation, _tuning.current(), in_place, values, tuple(map(type, values)),
               tuple([arrays[index] is None for index in point.optional]))  # fmt: skip

    def slow() -> _Route:
        block_scale = arrays[-1]
        if block_scale is None and arguments.get("quant_group_size") is not None:
            block_scale = _FRESH_SCALES  # the merge allocates the group scales
        given = dict(zip(point.options, values))
        options = operation.options(**given, output_block_scale=None if block_scale is None else True)
        operands = type(names)._make((*arrays[:-1], block_scale))
        return _route(operation, options, operands, in_place)

    return _run(key, arrays, slow)


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out_dtype: Any = None,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    lse_base: Any = "e",
) -> tuple:
    """Merge two attention states of JAX arrays and return the merged ``(v, s)``.

    :func:`cupy_merge.merge_state` as a JAX function: under ``jax.jit``, ``vmap`` (batches
    folded into the tokens: one launch) and eagerly (a cached jitted call). The kernel runs
    on XLA's stream, ordered with the computation around it, and inside XLA's CUDA graphs.

    Parameters
    ----------
    v_a : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s_a : jax.Array
        Log-sum-exp of ``v_a``'s scores, float32 ``[num_heads, num_tokens]``. ``+inf`` is
        read as ``-inf`` (an empty row).
    v_b : jax.Array
        Like ``v_a``, of its dtype.
    s_b : jax.Array
        Like ``s_a``.
    out_dtype : str or dtype, optional
        Dtype of the merged values: float32, float16, bfloat16 or ``"float8_e4m3fn"``
        (``jnp.float8_e4m3fn``, with a scale); the input dtype by default.
    sinks : jax.Array, optional
        Attention sinks, float32 ``[num_heads]`` natural-log logits, each counted once in
        its head's denominator (the output LSE includes it).
    output_scale : jax.Array, optional
        An FP8 output's per-tensor scale: float32, one element (a Python float works too),
        read on the device at each run. Values are ``clamp(v / scale, -448, 448)``.
    output_block_scale : jax.Array, optional
        With ``quant_group_size``: a float32 ``[num_tokens, num_heads * head_size //
        quant_group_size]`` buffer the group scales are returned in (aliased to the third
        result: donate it to the enclosing ``jax.jit`` to have the merge write into its
        memory). Leave it out to have the scales allocated.
    quant_group_size : int, optional
        FP8 group scales: each ``quant_group_size`` consecutive elements of a token's heads
        (a divisor of ``head_size``) get the scale ``max(max|v|, 1e-10) / 448``, returned as a
        third result.
    scale_ue8m0 : bool
        Round each group scale up to a power of two.
    lse_base : {"e", 2}
        Base of every LSE in and out.

    Returns
    -------
    v : jax.Array
        The merged values, ``[num_tokens, num_heads, head_size]`` of ``out_dtype``
        (``jnp.float8_e4m3fn`` for FP8).
    s : jax.Array
        The merged LSE, float32 ``[num_heads, num_tokens]``.
    scales : jax.Array
        Only with ``quant_group_size``: float32 ``[num_tokens, num_heads * head_size //
        quant_group_size]``, the scale of each group (``v * scale`` dequantises).

    Raises
    ------
    TypeError, ValueError
        A bad argument, when the call is traced, with the messages of the eager merges.
    RuntimeError
        JAX has no CUDA device.

    Notes
    -----
    Differentiable in reverse mode (``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``, under
    ``jit`` and ``vmap``) with respect to ``v_a``, ``s_a``, ``v_b``, ``s_b`` and ``sinks``: the
    backward kernel (:func:`cupy_merge.merge_state_backward`) runs on XLA's stream, from the
    inputs alone. An FP8 output is not differentiable (``TypeError`` when differentiated);
    ``jax.jvp`` is refused by JAX (a ``custom_vjp``).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v_a = jnp.ones((16, 8, 128), jnp.bfloat16)
    >>> s_a = s_b = jnp.zeros((8, 16), jnp.float32)
    >>> v, s = jax.jit(cmj.merge_state)(v_a, s_a, 3 * v_a, s_b)  # doctest: +SKIP
    >>> float(v[0, 0, 0]), round(float(s[0, 0]), 4)  # doctest: +SKIP
    (2.0, 0.6931)
    >>> v8, s, scales = cmj.merge_state(v_a, s_a, v_a, s_b, out_dtype="float8_e4m3fn",
    ...                                 quant_group_size=128)  # doctest: +SKIP
    >>> v8.dtype, scales.shape  # doctest: +SKIP
    (dtype(float8_e4m3fn), (16, 8))
    """
    return _merge(MERGE_STATE, locals())


def merge_attn_states(
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    prefill_tokens_with_context: int | None = None,
    output_scale: Any = None,
    *,
    out_dtype: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    quant_scale_ue8m0: bool = False,
    sinks: Any = None,
    lse_base: Any = "e",
) -> tuple:
    """vLLM's ``merge_attn_states`` as a JAX function: returns ``(output, output_lse)``.

    vLLM's op writes into ``output``; JAX arrays are immutable, so this one returns it
    (``output_lse`` too). Tokens at or past ``prefill_tokens_with_context`` take the suffix
    unchanged.

    Parameters
    ----------
    prefix_output : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    prefix_lse : jax.Array
        Float32 ``[num_heads, num_tokens]``.
    suffix_output : jax.Array
        Like ``prefix_output``, of its dtype.
    suffix_lse : jax.Array
        Like ``prefix_lse``.
    prefill_tokens_with_context : int, optional
        A Python int (static): tokens at or past it take the suffix (values and LSE, bit
        for bit; with sinks, the suffix merged with the sink). None merges every token.
    output_scale : jax.Array, optional
        An FP8 output's per-tensor scale, as for :func:`merge_state`.
    out_dtype : str or dtype, optional
        The output's dtype, as for :func:`merge_state` (vLLM gives it by ``output``).
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`: the group scales come back as a third result.
    scale_ue8m0 : bool
        As for :func:`merge_state`.
    quant_scale_ue8m0 : bool
        vLLM's name for ``scale_ue8m0``.
    sinks : jax.Array, optional
        As for :func:`merge_state`.
    lse_base : {"e", 2}
        As for :func:`merge_state`.

    Returns
    -------
    output : jax.Array
        ``[num_tokens, num_heads, head_size]``.
    output_lse : jax.Array
        ``[num_heads, num_tokens]``.
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable as :func:`merge_state`; past ``prefill_tokens_with_context`` the suffix's
    gradients are those of what the token took (the suffix itself, or its merge with the sink).

    Examples
    --------
    >>> import jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((4, 8, 128), jnp.float16)
    >>> s = jnp.zeros((8, 4), jnp.float32)
    >>> out, lse = cmj.merge_attn_states(v, s, 3 * v, s, prefill_tokens_with_context=2)  # doctest: +SKIP
    >>> float(out[0, 0, 0]), float(out[3, 0, 0])  # doctest: +SKIP
    (2.0, 3.0)
    """
    return _merge(MERGE_ATTN_STATES, locals())


def merge_state_in_place(
    v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None, *, sinks: Any = None, lse_base: Any = "e"
) -> tuple:
    """FlashInfer's ``merge_state_in_place`` as a JAX function: returns the updated ``(v, s)``.

    With a ``mask``, tokens where it is False keep ``v`` and ``s`` unchanged: the results
    alias ``v`` and ``s`` (``input_output_aliases``), so the kernel writes only the masked
    tokens. XLA copies ``v`` and ``s`` first unless they are donated (``jax.jit(...,
    donate_argnums=...)`` around the caller), in which case the merge updates their
    memory. Without a mask every token is merged into new arrays (no copy).

    Parameters
    ----------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s : jax.Array
        Its LSE, float32 ``[num_heads, num_tokens]``.
    v_other : jax.Array
        Like ``v``, of its dtype.
    s_other : jax.Array
        Like ``s``.
    mask : jax.Array, optional
        Bool ``[num_tokens]``: True merges the token, False leaves it as it is.
    sinks : jax.Array, optional
        Attention sinks, float32 ``[num_heads]`` (counted in this merge).
    lse_base : {"e", 2}
        Base of every LSE in and out.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``, the dtype of ``v``.
    s : jax.Array
        ``[num_heads, num_tokens]``.

    Notes
    -----
    Differentiable as :func:`merge_state` with respect to ``v``, ``s``, ``v_other``, ``s_other``
    and ``sinks``: where the mask is False, ``v`` and ``s`` pass their gradients through and
    ``v_other``'s and ``s_other``'s are zero, whatever those tokens hold.

    Examples
    --------
    >>> import jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((3, 8, 64), jnp.float32)
    >>> s = jnp.zeros((8, 3), jnp.float32)
    >>> v, s = cmj.merge_state_in_place(v, s, 3 * v, s, jnp.array([True, False, True]))  # doctest: +SKIP
    >>> float(v[0, 0, 0]), float(v[1, 0, 0])  # doctest: +SKIP
    (2.0, 1.0)
    """
    return _merge(MERGE_STATE_IN_PLACE, locals(), in_place=mask is not None)


def merge_states(
    v: Any,
    s: Any,
    *,
    lse_base: Any = "e",
    out_dtype: Any = None,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
) -> tuple:
    """Merge ``num_states`` attention states of the same tokens in one pass (JAX arrays).

    Parameters
    ----------
    v : jax.Array
        ``[num_states, num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s : jax.Array
        Float32 ``[num_states, num_heads, num_tokens]``.
    lse_base : {"e", 2}
        Base of the LSE in and out.
    out_dtype : str or dtype, optional
        As for :func:`merge_state`.
    sinks : jax.Array, optional
        As for :func:`merge_state`; no states at all then give 0 and LSE ``sink``.
    output_scale : jax.Array, optional
        As for :func:`merge_state`.
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`.
    scale_ue8m0 : bool
        As for :func:`merge_state`.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``; 0 for a token whose states are all empty.
    s : jax.Array
        ``[num_heads, num_tokens]``; ``-inf`` for such a token.
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable with respect to ``v``, ``s`` and ``sinks``, as :func:`merge_state`
    (:func:`cupy_merge.merge_states_backward`).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((16, 4, 8, 128), jnp.float32)  # 16 splits of 4 tokens
    >>> s = jnp.zeros((16, 8, 4), jnp.float32)
    >>> out, lse = jax.jit(cmj.merge_states)(v, s)  # doctest: +SKIP
    >>> out.shape, round(float(lse[0, 0]), 4)  # doctest: +SKIP
    ((4, 8, 128), 2.7726)
    """
    return _merge(MERGE_STATES, locals())


def merge_states_varlen(
    v: Any,
    s: Any,
    indptr: Any,
    *,
    lse_base: Any = "e",
    out_dtype: Any = None,
    check_indptr: bool = True,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
) -> tuple:
    """Merge a ragged batch: token ``t`` owns rows ``indptr[t]:indptr[t + 1]`` (JAX arrays).

    The number of tokens comes from ``indptr``'s shape (static); its values are read by the
    kernel on the device.

    Parameters
    ----------
    v : jax.Array
        ``[total_states, num_heads, head_size]``.
    s : jax.Array
        Float32 ``[num_heads, total_states]``.
    indptr : jax.Array
        Int32 or int64 ``[num_tokens + 1]``: non-decreasing offsets from 0.
    lse_base : {"e", 2}
        As for :func:`merge_states`.
    out_dtype : str or dtype, optional
        As for :func:`merge_state`.
    check_indptr : bool
        Eager calls copy ``indptr`` to the host and check it before launching (one
        synchronisation). Under ``jax.jit`` (and ``vmap``) its values do not exist yet, so
        True is refused with ``ValueError``: pass False, and tokens whose offsets are out of
        range come out NaN (nothing outside ``v`` is ever read).
    sinks : jax.Array, optional
        As for :func:`merge_state`.
    output_scale : jax.Array, optional
        As for :func:`merge_state`.
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`.
    scale_ue8m0 : bool
        As for :func:`merge_state`.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``; 0 for a token with no rows.
    s : jax.Array
        ``[num_heads, num_tokens]``; ``-inf`` for such a token (its sink with sinks).
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable with respect to ``v``, ``s`` and ``sinks``
    (:func:`cupy_merge.merge_states_varlen_backward`); ``indptr``'s gradient is zero (``float0``
    with ``allow_int=True``). Rows no token owns get zero gradients; so do the rows of a token
    whose offsets are out of range. The gradients, like the backward kernel's, assume
    non-decreasing offsets.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((5, 8, 64), jnp.float16)
    >>> s = jnp.zeros((8, 5), jnp.float32)
    >>> indptr = jnp.array([0, 2, 2, 5], jnp.int32)
    >>> merge = jax.jit(lambda v, s, i: cmj.merge_states_varlen(v, s, i, check_indptr=False))
    >>> out, lse = merge(v, s, indptr)  # doctest: +SKIP
    >>> float(out[0, 0, 0]), float(out[1, 0, 0]), bool(jnp.isneginf(lse[:, 1]).all())  # doctest: +SKIP
    (1.0, 0.0, True)
    """
    return _merge(MERGE_STATES_VARLEN, locals())
