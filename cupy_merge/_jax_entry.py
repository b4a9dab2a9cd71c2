"""cupy_merge.jax, the entry points: how a call reaches its jitted merge (the route of its call
pattern, remembered by its arguments as given), the checks made before tracing (placement, offsets
on the host, outputs that JAX arrays cannot be), and the dispatcher's JAX path."""

from __future__ import annotations

import inspect
import operator
from typing import Any, NamedTuple

import numpy

from . import _array_rules, _arrays, _dispatch, _jax_launch, _options, _tuning
from ._catalogue import NVFP4
from ._jax_launch import _Config, _entries, _jax, remember
from ._jax_transforms import (
    _backward_call,
    _batched,
    _differentiable,
    _once_differentiable,
)
from ._operands import BackwardOperands, ManyStateOperands, TwoStateOperands
from ._ops import MERGE_STATE_IN_PLACE, MERGE_STATES_VARLEN

#: Options of the two-way family's optional operands, in the order they are passed.
_TWO_OPTIONAL = ("mask", "sinks", "output_scale", "output_block_scale")
_MANY_OPTIONAL = ("sinks", "output_scale", "output_block_scale")


# -- the entry points -----------------------------------------------------------------------------

_jitted: dict[tuple, Any] = {}  # bounded, as every cache of the JAX integration (_jax_launch.CACHE_LIMIT)


def _function(operation, options, tuning, fields: tuple[str, ...], in_place: bool, scales_aliased: bool):
    """The cached ``jax.jit`` of one merge's traced function (no retracing between calls)."""
    key = (operation, options, tuning, fields, in_place, scales_aliased)
    function = _jitted.get(key)
    if function is None:
        layouts = _jax_launch.natural_orders(operation, fields)
        cfg = _Config(operation, options, tuning, fields, layouts, "ht", in_place, scales_aliased)
        function = remember(_jitted, key, _jax().jax.jit(_differentiable(cfg)))
    return function


def _clear_caches() -> None:
    """Forget every traced merge (for tests that change how launches are prepared)."""
    with _jax_launch._lock:
        _entries.clear()
        _jitted.clear()
        _routes.clear()
        _quick.clear()
    _batched.cache_clear()
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
        if isinstance(scale, (float, int)) and not isinstance(scale, bool):  # NumPy's float64 too: a float
            passed = (*passed[: route.scale], numpy.float32(scale), *passed[route.scale + 1 :])
        elif getattr(scale, "weak_type", False) and scale.dtype.kind in "fiu":  # a Python number, traced
            passed = (*passed[: route.scale], scale.astype(numpy.float32), *passed[route.scale + 1 :])
    try:
        return route.function(*passed)
    except (AttributeError, TypeError, ValueError) as error:
        _refuse_sequences(passed, route.names)
        if "output_block_scale" not in route.names:  # group scales asked for by quant_group_size
            _raise_in_jax_words(error)
        raise


def _refuse_sequences(arrays: tuple, names: tuple) -> None:
    """A Python list or tuple where an array goes (JAX reads it as a tree of scalars, and the trace
    fails naming no argument): refused by its name, as ``jax.numpy`` refuses lists."""
    for x, name in zip(arrays, names):
        if isinstance(x, (list, tuple)):
            raise TypeError(
                f"{name}: expected a JAX array, got a Python {type(x).__name__}; pass jax.numpy.asarray({name})"
            )


def _has_cuda_devices() -> bool:
    try:
        return bool(_jax_launch._devices_to_prepare())
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
        route = remember(_routes, key, _Route(function, operator.itemgetter(*indices), required, names, scale))
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
            remember(_quick, key, route)
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
    _array_rules.indptr_values(values, v.shape[0], names.indptr)


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

        function = remember(_jitted, key, _jax().jax.jit(backward))
    arrays = tuple(getattr(operands, field) for field in fields)
    try:
        grads = list(function(*arrays))
    except (AttributeError, TypeError):
        _refuse_sequences(arrays, tuple(getattr(names, field) for field in fields))
        raise
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
        nvfp4 = _options.optional_value_dtype(arguments.get("out_dtype")) == NVFP4
        if block_scale is None and (arguments.get("quant_group_size") is not None or nvfp4):
            block_scale = _FRESH_SCALES  # the merge allocates the group (or NVFP4 block) scales
        given = dict(zip(point.options, values))
        try:
            options = operation.options(**given, output_block_scale=None if block_scale is None else True)
        except (TypeError, ValueError) as error:
            if arrays[-1] is None:  # the caller asked for group scales by quant_group_size, not by array
                _raise_in_jax_words(error)
            raise
        return _route(operation, options, type(names)._make((*arrays[:-1], block_scale)), in_place)

    return _run(key, arrays, slow)


#: The core's words for group scales the caller passes, and the JAX merges' (which allocate them).
_GROUP_SCALE_WORDS = (
    ("output_block_scale: a scale is for", "quant_group_size: group scales are for"),
    ("without output_block_scale", "without quant_group_size"),
    ("no output_block_scale given", 'out_dtype is not "nvfp4"'),
)


def _raise_in_jax_words(error: Exception) -> None:
    """Raise the core's error about ``output_block_scale`` again in the words of a JAX call that did
    not pass it (it asks for group scales by ``quant_group_size``); other errors are left alone."""
    if type(error) not in (TypeError, ValueError):
        return
    message = str(error)
    for core, jax in _GROUP_SCALE_WORDS:
        message = message.replace(core, jax)
    if message != str(error):
        raise type(error)(message) from None
