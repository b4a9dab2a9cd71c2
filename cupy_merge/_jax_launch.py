"""cupy_merge.jax, the launch layer: JAX loaded on first use; what one traced merge is (its config,
checks, plan, compiled launches and ``buffer_callback``, all made once when JAX traces it); and the
callback that, when XLA runs it, patches the buffers' addresses in and launches on XLA's stream."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple

import numpy

from . import _arrays, _checks, _dispatch, _launch, _ops, _plan_backward, _quantised, _tuning
from ._arrays import ArraySpec
from ._catalogue import FP8, ITEMSIZES, NVFP4, NVFP4_BLOCK
from ._operands import BackwardOperands

#: What to install when JAX is missing.
JAX_HINT = (
    "cupy_merge.jax needs JAX 0.6.1 or newer with its CUDA plugin: pip install 'jax[cuda12]>=0.6.1' "
    "(or 'jax[cuda13]>=0.6.1')"
)
#: DLPack device type of CUDA memory (the callback launches only on it).
_DLPACK_CUDA = 2
#: The callback takes the element-aligned plan when any address has one of these bits set
#: (plans assume 16-byte alignment, what XLA's allocations give). Tests set it to ~0.
_MISALIGNED = 15


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
#: The order of an operand given in its declared layout (the public functions' own).
_NATURAL = {_ops.LSE: "ht", _ops.ROW_LSE: "ht", _ops.STACKED: "nt", _ops.STACKED_LSE: "nht"}


def natural_orders(operation: _dispatch.Operation, fields: tuple[str, ...]) -> tuple[str, ...]:
    """The orders of ``fields`` as the public functions take them, from the operation's layouts."""
    return tuple(_NATURAL.get(operation.layouts[field], "") for field in fields)


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
    scratch: int = 0  # the last results are the launches' scratch, no result of the merge


#: How many entries each of the JAX integration's caches keeps before it starts again: a serving
#: loop passes a new prefill cut (a static option) every step, and each would otherwise stay for
#: the process's life.
CACHE_LIMIT = 4096
_entries: dict[tuple, _Entry] = {}


def remember(cache: dict, key: tuple, value: Any) -> Any:
    """``cache[key]``, set to ``value`` where no other thread set it first; the cache emptied when full."""
    with _lock:
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        return cache.setdefault(key, value)


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
        entry = remember(_entries, key, (build or _build_entry)(cfg, avals))
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
        out_shape = (tokens, heads, head_size // 2 if out_dtype == NVFP4 else head_size)
        out = _arrays.contiguous_spec(out_shape, out_dtype, ITEMSIZES[out_dtype], 0)
        lse_shape = _physical_lse(heads, tokens, cfg.out_layout)
        out_lse = _spec(lse_shape, numpy.float32, cfg.out_layout)
        stored = numpy.dtype("uint8") if out_dtype in (FP8, NVFP4) else _jax_dtype(out_dtype)
        results += [("out", out_shape, stored), ("out_lse", lse_shape, numpy.dtype("float32"))]
    block_scale = specs.output_block_scale
    if options.group_size is not None or out_dtype == NVFP4:
        scale_dtype = numpy.dtype("uint8" if out_dtype == NVFP4 else "float32")
        if block_scale is None:
            if out_dtype == NVFP4:  # head sizes not a multiple of 16 are refused by the checks
                blocks = heads * head_size // NVFP4_BLOCK
                scale_shape = _quantised.nvfp4_scale_shape(tokens, blocks, options.swizzled_scales)
            else:
                scale_shape = (tokens, heads * head_size // options.group_size)
            block_scale = _arrays.contiguous_spec(scale_shape, scale_dtype.name, scale_dtype.itemsize, 0)
        else:  # aliased to the result: of its own dtype
            scale_shape = physical["output_block_scale"]
            scale_dtype = numpy.dtype(avals[cfg.fields.index("output_block_scale")][1])
        results.append(("output_block_scale", scale_shape, scale_dtype))
    specs = specs._replace(out=out, out_lse=out_lse, output_block_scale=block_scale)
    planned = _dispatch.plan_specs(operation, options, tuning, specs, cfg.in_place)
    shapes = tuple((shape, dtype) for _, shape, dtype in results)
    if not planned.plan:  # zero tokens or heads: nothing to launch (an empty CUDA graph can crash)
        return _Entry(None, shapes, out_dtype == FP8)
    try:
        loose_plan: tuple | None = _dispatch.plan_specs(operation, options, tuning, _loose(specs), cfg.in_place).plan
    except ValueError:  # an NVFP4 output needs its values aligned to pairs (_checks): aligned buffers only
        loose_plan = None
    index = _buffer_index(cfg.fields, results)
    aliases = {}
    if cfg.in_place:
        aliases = {cfg.fields.index("v_a"): 0, cfg.fields.index("s_a"): 1}
    if cfg.scales_aliased:
        aliases[cfg.fields.index("output_block_scale")] = len(results) - 1
    host = HostCall(operation, options, specs, index)
    call = _buffer_call(planned.plan, loose_plan, index, host, shapes, aliases, tuning)
    return _Entry(call, shapes, out_dtype == FP8, host)


def _loose(specs: Any) -> Any:
    """``specs`` aligned only to their elements. Addresses XLA gives are 16-byte aligned; a second
    plan for addresses aligned only to their elements (a buffer XLA passes at an offset) is chosen
    by the callback from the addresses."""
    return specs._replace(**{
        field: spec._replace(align=min(spec.align, spec.itemsize))
        for field, spec in zip(specs._fields, specs) if spec is not None
    })  # fmt: skip


def _buffer_index(fields: tuple[str, ...], results: list) -> dict[str, int]:
    """Each operand field's position among the callback's buffers: the inputs, then the results."""
    index = {field: position for position, field in enumerate(fields)}
    index.update({field: len(fields) + position for position, (field, _, _) in enumerate(results)})
    return index


def _buffer_call(plan: tuple, loose_plan: tuple | None, index: dict, host: HostCall, shapes: tuple, aliases: dict,
                 tuning: _tuning.Tuning) -> Any:  # fmt: skip
    """The ``buffer_callback`` of a traced merge: its launches prepared for every device (the
    element-aligned plan's too, where it differs), results of ``shapes``, ``aliases`` (input
    buffer -> result)."""
    devices = _devices_to_prepare()
    fast = _prepare(plan, devices, tuning)
    slow: dict | None = None
    slow_slots: tuple = ()
    if loose_plan is not None:
        slow = fast if loose_plan == plan else _prepare(loose_plan, devices, tuning)
        slow_slots = _slots(loose_plan, index)
    callback = _callback(fast, _slots(plan, index), slow, slow_slots, host)
    jax = _jax()
    return jax.buffer_callback(
        callback,
        tuple(jax.jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
        input_output_aliases=aliases or None,
        command_buffer_compatible=True,
    )


def _jax_dtype(name: str) -> Any:
    if name in ("bfloat16", FP8):
        import ml_dtypes

        return numpy.dtype(getattr(ml_dtypes, name))
    return numpy.dtype(name)


def _prepare(plan: tuple, devices: tuple[int, ...], tuning: _tuning.Tuning) -> dict[int, tuple]:
    """Each launch compiled, loaded and packed for every device (addresses patched at each call)."""
    return {
        device: tuple(_launch.prepare(launch, device, {}, tuning.programmatic_launch) for launch in plan)
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


def _callback(fast: dict, fast_slots: tuple, slow: dict | None, slow_slots: tuple, host: HostCall):
    """The buffer_callback's function: read addresses, patch them in, launch on XLA's stream.

    Capture-safe: it launches only on ``ctx.stream``, allocates nothing, never synchronises and
    reads no device data, so XLA can record it into a command buffer (a CUDA graph)."""
    launch_patched = _launch.launch_patched

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
        if launches is None:
            raise RuntimeError(
                f"cupy_merge.jax: {host.operation.name} was given a buffer at an offset that splits its values' "
                f"pairs, which an NVFP4 output cannot take; pass whole arrays"
            )
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


# -- the backward merges: traced like the merges, and batched ---------------------------------------

#: The array each value or LSE gradient is of (it takes that array's shape, dtype and layout).
_GRADIENT_OF = {"grad_v": "v", "grad_s": "s", "grad_v_b": "v_b", "grad_s_b": "s_b"}


def _build_backward_entry(cfg: _Config, avals: tuple) -> _Entry:
    """Check, plan, compile and prepare one backward merge (trace time), and make its buffer_callback.

    Each value or LSE gradient is written in the layout of the array it is of (a batch folded
    into the tokens unfolds as its inputs fold: free for values); the launches' scratch (each
    row's sink term) is one more result, which the caller drops."""
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
        if like is None:  # the sinks' (or the launches' scratch)
            shape, dtype = tuple(fresh.shape), numpy.dtype("float32")
            if not fresh.scratch:
                gradients[fresh.field] = _arrays.contiguous_spec(shape, "float32", 4, 0)
        else:
            shape, dtype = physical[like]
            gradients[fresh.field] = _spec(shape, dtype, cfg.layout(like))
        results.append((fresh.field, shape, numpy.dtype(dtype)))
    shapes = tuple((shape, dtype) for _, shape, dtype in results)
    scratch = sum(fresh.scratch for fresh in planned.fresh)
    if not planned.plan:  # no heads, or no tokens of a dense merge: zeros, nothing to launch
        return _Entry(None, shapes, False, scratch=scratch)
    specs = specs._replace(**gradients)
    names: Any = operation.names
    state, num_states = _checks.check_backward(specs, names, options)
    plan = _plan_backward.plan_backward(state, num_states, specs, options, tuning)
    loose_plan = _plan_backward.plan_backward(state, num_states, _loose(specs), options, tuning)
    index = _buffer_index(cfg.fields, results)
    host = HostCall(operation, options, specs, index)
    call = _buffer_call(plan, loose_plan, index, host, shapes, {}, tuning)
    return _Entry(call, shapes, False, host, scratch)
