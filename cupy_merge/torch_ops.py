"""The torch integration, derived from the merges' declarations: registered ops, fakes, tracing, autograd.

Importing this module (``cupy_merge`` does) never imports torch. It registers two hooks with the
dispatcher:

* the *compiler* hook: while torch traces (``torch.compile``, ``torch.export``, ``make_fx``,
  ``torch.jit.trace`` or any ``TorchDispatchMode``), a public merge becomes its registered op ``torch.ops.cupy_merge.*``
  (outputs the caller left out are allocated in the graph), so Dynamo captures the whole graph;
  eager calls pay one predicate (0.1-0.3 us) and take the NVRTC path as before;
* the *autograd* hook: a functional merge of tensors that require grad runs through a
  ``torch.autograd.Function`` whose backward runs the merge's backward operation; compiled code
  takes the same Function, with the ops inside it.

Nothing here is written per merge. Each declaration (``cupy_merge._ops``) gives its ops: a merge
that writes into its arguments (``merge_attn_states``, ``merge_state_in_place``) one op of its own
signature; a merge that allocates its results one functional op (its signature without the
operands it writes and the options that only mean something with them) and, if it takes outputs,
one ``*_out`` op taking them first. Schemas are generated from the public signatures; the eager
kernels are the public functions themselves; the fakes check every shape rule from the tensors'
sizes (with the eager messages, without adding a guard) and allocate the results; a
differentiable declaration gets one autograd Function, whose backward is its backward operation.

The ops are defined on the light path (``torch.library.Library("cupy_merge", "FRAGMENT")``,
``define`` / ``impl`` on CUDA / ``register_fake``) when first needed, and at once when torch was
imported before ``cupy_merge``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from . import _arrays, _dispatch, _ops
from . import backward as _backward  # noqa: F401 - these attach the public functions to the declarations
from . import merge as _merge  # noqa: F401
from . import merge_many as _merge_many  # noqa: F401
from ._catalogue import VALUES_PER_ELEMENT
from ._operands import WRITTEN, BackwardOperands
from ._torch_autograd import (
    function_arguments,
    gradients_not_differentiable,
    make_functions,
    refuse_differentiating_gradients,
    refuse_tangents,
    refuse_traced_grad,
    refuse_undifferentiable,
    refuse_writes_under_grad,
    refuse_written_grad,
    requires_grad,
    tangents_unseen,
    writes_refused,
)

__all__ = ["NAMESPACE", "SCHEMAS", "ops"]

#: The torch library namespace: ``torch.ops.cupy_merge.<name>``.
NAMESPACE = "cupy_merge"

#: Tests with a CPU stand-in kernel set this: fakes then take CPU tensors (on the host device).
_SPECS_ON_HOST = False


# -- the ops, generated from the declarations ----------------------------------------------------------

#: The schema type of each option (its default is the public function's).
_OPTION_TYPES = {
    "lse_base": "str",
    "out_dtype": "ScalarType?",
    "prefill_tokens_with_context": "SymInt?",  # a count that changes between calls stays dynamic
    "quant_group_size": "int?",
    "scale_ue8m0": "bool",
    "quant_scale_ue8m0": "bool",
    "check_indptr": "bool",
    "is_sf_swizzled_layout": "bool",
}
#: Options that only mean something with the FP8 or NVFP4 block scales, an operand the functional ops do not take.
_WITH_WRITTEN = frozenset({"quant_group_size", "scale_ue8m0", "quant_scale_ue8m0", "is_sf_swizzled_layout"})
#: The outputs an ``*_out`` op takes first.
_OUTPUTS = ("out", "out_lse")


class _Argument(NamedTuple):
    """One argument of an op: the public function's argument of the same name."""

    name: str
    field: str | None  # its operand field; None for an option
    keyword: bool  # keyword-only
    schema: str  # e.g. "Tensor(a!) output", 'str lse_base="e"'


class _TorchOp(NamedTuple):
    """One registered op: its name, the merge it runs, its form (``"functional"``, ``"out"`` or
    ``"in place"``), its arguments and its returns."""

    name: str
    operation: _ops.Operation
    form: str
    arguments: tuple[_Argument, ...]
    returns: str

    @property
    def schema(self) -> str:
        positional = [a.schema for a in self.arguments if not a.keyword]
        keyword = [a.schema for a in self.arguments if a.keyword]
        listed = ", ".join(positional + (["*"] + keyword if keyword else []))
        return f"{self.name}({listed}) -> {self.returns}"

    @property
    def positional(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arguments if not a.keyword)


def _default(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _torch_op(operation: _ops.Operation, form: str) -> _TorchOp:
    """The op of ``operation`` in ``form``, from its public signature and operand record."""
    by_name = operation.fields_by_name()
    parameters = [p for p in operation.signature.parameters.values() if p.name != "stream"]  # type: ignore[union-attr]
    if form == "out":  # its outputs first, required and positional
        parameters.sort(key=lambda p: by_name.get(p.name) not in _OUTPUTS)
    letters = iter("abcdefgh")
    arguments = []
    for p in parameters:
        field = by_name.get(p.name)
        written = field in WRITTEN
        if form == "functional" and (written or p.name in _WITH_WRITTEN):
            continue
        first = form == "out" and field in _OUTPUTS
        if field is None:
            schema = f"{_OPTION_TYPES[p.name]} {p.name}={_default(p.default)}"
        else:
            optional = p.default is not inspect.Parameter.empty and not first
            alias = f"({next(letters)}!)" if written else ""
            schema = f"Tensor{alias}{'?' if optional else ''} {p.name}{'=None' if optional else ''}"
        arguments.append(_Argument(p.name, field, p.kind is inspect.Parameter.KEYWORD_ONLY and not first, schema))
    if form != "functional":
        returns = "()"
    else:
        returns = "(" + ", ".join("Tensor?" if r == "grad_sinks" else "Tensor" for r in operation.results) + ")"
    name = operation.name + ("_out" if form == "out" else "")
    return _TorchOp(name, operation, form, tuple(arguments), returns)


def _torch_ops() -> dict[str, _TorchOp]:
    generated: dict[str, _TorchOp] = {}
    for operation in _ops.OPERATIONS.values():
        forms: tuple[str, ...]
        if not operation.allocates:
            forms = ("in place",)
        elif operation.is_backward:
            forms = ("functional",)
        else:
            forms = ("functional", "out")
        for form in forms:
            op = _torch_op(operation, form)
            generated[op.name] = op
    return generated


def _into(function: Callable[..., Any], out: Any, out_lse: Any, *args: Any, **kwargs: Any) -> None:
    """An ``*_out`` op's kernel: the public merge into the given outputs."""
    function(*args, out=out, out_lse=out_lse, **kwargs)


def _kernel(op: _TorchOp) -> Callable[..., Any]:
    """An op's CUDA kernel: the public merge itself (on torch's current stream; ``compiling()`` is
    false in it). With ``check_indptr`` inside a CUDA-graph capture the dispatcher skips the host
    copy, and the kernel's guard gives NaN rows for offsets out of range."""
    function = op.operation.function
    assert function is not None, op.name  # attached when its module was imported
    return functools.partial(_into, function) if op.form == "out" else function


# -- the hooks: no torch until the caller has imported it ---------------------------------------------

_LOCK = threading.Lock()
_LIB: Any = None  # the Library holding the ops: they live as long as it does
_FUNCTIONS: dict[str, Any] = {}  # the autograd.Function classes, made with the ops
# Bound by the first eager look at a loaded torch; never changed while Dynamo traces (it guards on them).
_dynamo_compiling: Callable[[], bool] | None = None  # torch.compiler.is_dynamo_compiling
_dispatch_modes: Callable[[], int] = int  # torch._C._len_torch_dispatch_stack
_jit_tracing: Callable[[], Any] = type(None)  # torch._C._get_tracing_state (None: not tracing)


class _NoForwardAD:
    _current_level = -1


_forward_ad: Any = _NoForwardAD  # torch.autograd.forward_ad: _current_level >= 0 inside a dual level
# refuse_tangents, never compiled by Dynamo on its own (frames Dynamo compiles see fake tensors: no
# tangents); made at its first use, as torch.compiler.disable imports Dynamo (a second at import).
_refuse_tangents: Callable[[Any, Any], None] | None = None


def _compiling() -> bool:
    """The compiler hook's predicate, run by every merge call: true while torch traces, or while
    forward-mode AD is on (the hook then refuses tangents and hands an untraced call back).

    Dynamo (``torch.compile``, strict ``torch.export``) folds ``is_dynamo_compiling()`` to True, so
    nothing of the eager path is traced; ``make_fx``, non-strict export and other tracers push a
    dispatch mode; ``torch.jit.trace`` sets a tracing state (which it clears inside the ops it
    records, so their kernels run eagerly). In eager code: three calls and a read, 0.2-0.3 us.
    """
    dynamo = _dynamo_compiling
    if dynamo is None:
        return _first_look()
    return dynamo() or _dispatch_modes() > 0 or _jit_tracing() is not None or _forward_ad._current_level >= 0


def _tracing() -> bool:
    """Whether torch traces now (:func:`_compiling` without forward-mode AD)."""
    return bool(_dynamo_compiling and _dynamo_compiling()) or _dispatch_modes() > 0 or _jit_tracing() is not None


def _first_look() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False  # no torch loaded: nothing can be tracing
    if _supported(torch) and torch.compiler.is_dynamo_compiling():
        return True  # the first merge of the process met inside Dynamo: it changes no global here
    _bind(torch)
    return _compiling()


def _supported(torch: Any) -> bool:
    """Whether this torch has what the integration uses (torch 2.4 and newer)."""
    return hasattr(torch.library, "register_fake") and hasattr(torch.compiler, "is_dynamo_compiling")


def _never() -> bool:
    return False


def _bind(torch: Any) -> None:
    """Define the ops, then bind the predicate's functions (eager code only). An older torch
    gets no ops: merges then run eagerly as before, never traced."""
    global _dynamo_compiling, _dispatch_modes, _jit_tracing, _forward_ad
    if not _supported(torch):
        _dynamo_compiling = _never
        return
    _attach()
    _dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", int)
    _jit_tracing = getattr(torch._C, "_get_tracing_state", type(None))
    forward_ad = getattr(torch.autograd, "forward_ad", None)
    _forward_ad = forward_ad if hasattr(forward_ad, "_current_level") else _NoForwardAD
    _dynamo_compiling = torch.compiler.is_dynamo_compiling


def _attach() -> None:
    """Define the ops and the autograd Functions (once; any thread)."""
    if _LIB is not None:
        return
    with _LOCK:
        if _LIB is None:
            torch = sys.modules["torch"]
            if not _FUNCTIONS:
                _FUNCTIONS.update(make_functions(torch, _tracing))
            if _supported(torch):
                _define(torch)


# Dynamo runs this at trace time instead of tracing it (torch.compiler.assume_constant_result, without
# importing torch): the first merge of a process may be met inside torch.compile.
_attach._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _grad_enabled() -> bool:
    return bool(sys.modules["torch"].is_grad_enabled())


def ops() -> Any:
    """The registered ops, ``torch.ops.cupy_merge``, defined now if they are not yet.

    They are defined when ``cupy_merge`` is imported after torch, or at the first merge called (or
    traced) after torch was imported. Code that imports ``cupy_merge`` before torch and then calls
    ``torch.ops.cupy_merge.*`` directly (or loads an exported program) calls this once first.

    Returns
    -------
    torch._ops._OpNamespace
        ``torch.ops.cupy_merge``: ``merge_attn_states``, ``merge_state``, ``merge_state_out``,
        ``merge_state_in_place``, ``merge_states``, ``merge_states_out``, ``merge_states_varlen``,
        ``merge_states_varlen_out`` and the three ``*_backward`` ops (see :data:`SCHEMAS`).

    Raises
    ------
    ImportError
        torch is not installed.

    Examples
    --------
    >>> from cupy_merge import torch_ops
    >>> torch_ops.ops().merge_attn_states  # doctest: +SKIP
    <OpOverloadPacket(op='cupy_merge.merge_attn_states')>
    """
    import torch

    if not _supported(torch):
        raise ImportError(f"cupy_merge's torch ops need torch 2.4 or newer, got {torch.__version__}")
    _bind(torch)
    return torch.ops.cupy_merge


_TORCH_OPS = _torch_ops()
#: Every op's schema. Written tensors are declared (``Tensor(a!)``); the ``*_out`` and in-place ops
#: return nothing. Argument names are the public functions' (errors name them alike).
SCHEMAS: dict[str, str] = {name: op.schema for name, op in _TORCH_OPS.items()}
#: The op each traced merge becomes: its functional form (or its only one), and its ``*_out`` form.
_FUNCTIONAL = {op.operation.name: op for op in _TORCH_OPS.values() if op.form != "out"}
_INTO = {op.operation.name: op for op in _TORCH_OPS.values() if op.form == "out"}


def _define(torch: Any) -> None:
    global _LIB
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # keep it: the registrations die with it
    tags = (torch.Tag.pt2_compliant_tag,)
    for name, op in _TORCH_OPS.items():
        lib.define(op.schema, tags=tags)
        lib.impl(name, _kernel(op), "CUDA")
        # The kernel is the public merge, which handles autograd itself (the autograd hook: the
        # functional merges are differentiable, the others refuse inputs that require grad): autograd
        # falls through to it, skipping the dispatcher's "no autograd kernel" fallback (and its cost).
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", functools.partial(_fake, op), lib=lib)
    _LIB = lib


# -- an op's arguments, both ways: from the dispatcher's operands and options, to them ----------------


def _option_argument(name: str, options: Any, torch: Any) -> Any:
    """The public argument ``name`` that gives ``options`` (the options builders' inverse)."""
    if name == "lse_base":
        return "2" if options.lse_base_2 else "e"
    if name == "out_dtype":
        return None if options.out_dtype is None else getattr(torch, options.out_dtype)
    if name == "prefill_tokens_with_context":
        return options.merge_tokens
    if name == "quant_group_size":
        return options.group_size
    if name == "scale_ue8m0":
        return bool(options.scale_ue8m0)
    if name == "quant_scale_ue8m0":
        return False  # given as scale_ue8m0
    if name == "is_sf_swizzled_layout":
        return options.swizzled_scales
    return options.check_indptr


def _call_op(torch: Any, op: _TorchOp, options: Any, operands: Any) -> Any:
    """The registered op on the operands and options of one traced merge (positional arguments by
    position, as the graph then records them)."""
    values = [
        getattr(operands, a.field) if a.field is not None else _option_argument(a.name, options, torch)
        for a in op.arguments
    ]
    positional = [value for a, value in zip(op.arguments, values) if not a.keyword]
    keyword = {a.name: value for a, value in zip(op.arguments, values) if a.keyword}
    return getattr(torch.ops.cupy_merge, op.name).default(*positional, **keyword)


def _from_arguments(op: _TorchOp, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """The operands and options of an op called with ``args`` and ``kwargs`` (SymInt options as
    the sizes they were traced with: the checks never add a guard)."""
    given = dict(zip(op.positional, args), **kwargs)
    operation = op.operation
    record = type(operation.names)
    operands = record(*(given.get(name) if name else None for name in operation.names))
    accepted = inspect.signature(operation.options).parameters
    options = operation.options(**{
        name: _hint(value) if _OPTION_TYPES.get(name) == "SymInt?" and value is not None else value
        for name, value in given.items() if name in accepted
    })  # fmt: skip
    return operands, options


def _read(operands: Any) -> tuple:
    """The operands a merge reads (an in-place merge's state too: it is read and written)."""
    return tuple(getattr(operands, field) for field in operands._fields if field not in WRITTEN)


# -- fakes: every shape rule from sizes alone, then the results --------------------------------------


def _size_hint_function() -> Callable[[Any], Any] | None:
    from torch.fx.experimental import symbolic_shapes

    return getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "size_hint", None)


def _hint(value: Any) -> int | None:
    """A size as a Python int: a SymInt's hint (the size it was traced with), read without adding a
    guard, so the rules below never specialise a dynamic size; None for a data-dependent size."""
    if type(value) is int:
        return value
    node = getattr(value, "node", None)
    if node is not None and node.has_hint():
        return int(node.hint)
    hint_of = _size_hint_function()
    try:
        hint = None if hint_of is None else hint_of(value)
    except (RuntimeError, AssertionError, TypeError, ValueError):  # an unbacked size: no hint
        return None
    return None if hint is None else int(hint)


def _spec(tensor: Any, name: str) -> _arrays.ArraySpec | None:
    spec = _arrays.TORCH.spec(tensor, name, _SPECS_ON_HOST, meta=True)  # layout, device, lazy bits: as eagerly
    if all(type(x) is int for x in spec.shape + spec.strides):
        return spec
    hints = [_hint(x) for x in spec.shape + spec.strides]
    if None in hints:
        return None
    sizes = [int(x) for x in hints if x is not None]
    return spec._replace(shape=tuple(sizes[: len(spec.shape)]), strides=tuple(sizes[len(spec.shape) :]))


def _check(operation: _ops.Operation, options: Any, operands: Any) -> None:
    """Every shape rule of one call (``_dispatch.check_specs``), on the operands' sizes, with the
    eager path's messages. The address rules (overlaps) and the values' rules (``check_indptr``)
    run in the kernel."""
    refuse_written_grad(operation, operands)
    names = operation.names
    fields = operands._fields
    specs: dict[str, Any] = {}
    for field in (*fields[2:], *fields[:2]):  # inputs first, as the eager path describes them
        tensor = getattr(operands, field)
        if tensor is None:
            continue
        spec = _spec(tensor, getattr(names, field))
        if spec is None:  # a data-dependent size: the kernel checks at run time
            return
        specs[field] = spec
    _dispatch.check_specs(operation, options, type(operands)(**{field: specs.get(field) for field in fields}))


def _tokens(tensor: Any, ndim: int, axis: int) -> Any:
    # A tensor of another rank gets no output of its own shape: the fake refuses that input first.
    return tensor.shape[axis] if tensor.dim() == ndim else 0


def _num_tokens(operation: _ops.Operation, operands: Any) -> Any:
    if operation.ragged:
        return _tokens(operands.indptr, 1, 0) - 1
    return _tokens(operands.v, 4, 1) if operation.many else _tokens(operands.v_a, 3, 0)


def _merged(torch: Any, operation: _ops.Operation, options: Any, operands: Any) -> tuple[Any, Any]:
    """New C-contiguous outputs of a forward merge: values ``[T, H, D]`` (NVFP4: ``[T, H, D // 2]``,
    two values a byte) and LSE ``[H, T]``."""
    like = operands[2]  # v_a or v
    tokens = _num_tokens(operation, operands)
    dtype = like.dtype if options.out_dtype is None else getattr(torch, options.out_dtype)
    row = like.shape[-1] // VALUES_PER_ELEMENT.get(options.out_dtype, 1)
    values = torch.empty((tokens, like.shape[-2], row), dtype=dtype, device=like.device)
    return values, torch.empty((like.shape[-2], tokens), dtype=torch.float32, device=like.device)


def _gradients(torch: Any, operands: BackwardOperands) -> tuple:
    """A backward merge's results: each gradient like the array it is of, C-contiguous (the sinks'
    only with sinks)."""
    of = (operands.v, operands.s) + (() if operands.v_b is None else (operands.v_b, operands.s_b))
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in of]
    sinks = operands.sinks
    grads.append(None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device))
    return tuple(grads)


def _fake(op: _TorchOp, *args: Any, **kwargs: Any) -> Any:
    """An op's fake: the refusals of grad mode, every shape rule, then its results' shapes."""
    torch = sys.modules["torch"]
    operands, options = _from_arguments(op, args, kwargs)
    operation = op.operation
    if operation.is_backward:
        refuse_differentiating_gradients(operation, *_read(operands))
    elif op.form == "functional":
        refuse_traced_grad(operation, *_read(operands))
    else:  # in place, or *_out: writes into its arguments
        refuse_writes_under_grad(operation, *_read(operands))
    _check(operation, options, operands)
    if op.form != "functional":
        return None
    return _gradients(torch, operands) if operation.is_backward else _merged(torch, operation, options, operands)


# -- under tracing: the public merges become the ops (Dynamo traces this code) ---------------------------


def _compiled_call(operation: _ops.Operation, options: Any, operands: Any, stream: Any) -> Any:
    """The compiler hook: the public merge as its op, outputs left out allocated in the graph
    (``_dispatch.RUN_EAGERLY`` for a call nothing traces: CuPy arrays under a user's dispatch mode,
    tensors without tangents inside a forward-mode AD level)."""
    _attach()
    torch = sys.modules["torch"]
    if _forward_ad._current_level >= 0:  # a dual level is open (in some thread: torch keeps one)
        if _dynamo_compiling is not None and _dynamo_compiling():  # fake tensors: no tangent to see
            raise tangents_unseen(operation)
        refuse_forward_mode(operation, operands)
        if not _tracing():
            return _dispatch.RUN_EAGERLY
    primary = operands[2]
    if not isinstance(primary, torch.Tensor):
        if torch.compiler.is_compiling():
            raise TypeError(
                f"{operation.names[2]}: under torch.compile a merge takes torch tensors, got {type(primary).__name__}"
            )
        return _dispatch.RUN_EAGERLY  # a user's dispatch mode over CuPy arrays: nothing of torch is traced
    if stream is not None:
        raise ValueError(
            "stream: a merge that torch traces or sees through a dispatch mode (torch.compile, torch.export, "
            "torch.jit.trace, FlopCounterMode...) runs on torch's current stream; pass stream=None and enter "
            "torch.cuda.stream(s) around the call instead"
        )
    if operation.is_backward:
        refuse_differentiating_gradients(operation, *_read(operands))
        if _jit_tracing() is not None:
            raise TypeError(
                f"{operation.name}: torch.jit.trace cannot record the backward merges (their optional "
                f"grad_sinks result, Tensor?, is no type the tracer takes); trace with torch.compile or "
                f"torch.export, or call it outside the trace"
            )
        return _call_op(torch, _FUNCTIONAL[operation.name], options, operands)
    refuse_written_grad(operation, operands)
    inputs = _read(operands)
    if not operation.allocates:
        refuse_writes_under_grad(operation, *inputs)
        _call_op(torch, _FUNCTIONAL[operation.name], options, operands)
        return None
    if torch.is_grad_enabled() and requires_grad(*inputs):
        refuse_undifferentiable(operation, options, operands)
        # Dynamo cannot trace a Function given one tensor twice (merge_state(x, s, x, s)): a view each further time.
        arguments = _distinct(function_arguments(operation, options, operands))
        return _FUNCTIONS[operation.name].apply(*arguments)
    if operands.out is None and operands.out_lse is None and operands.output_block_scale is None:
        return _call_op(torch, _FUNCTIONAL[operation.name], options, operands)
    out, out_lse = _merged(torch, operation, options, operands)
    out = out if operands.out is None else operands.out
    out_lse = out_lse if operands.out_lse is None else operands.out_lse
    _call_op(torch, _INTO[operation.name], options, operands._replace(out=out, out_lse=out_lse))
    return out, out_lse


def refuse_forward_mode(operation: _ops.Operation, operands: Any) -> None:
    """Refuse the operands' tangents while a dual level is open (the dispatcher's hook for calls that
    bypass the compiler hook, :func:`cupy_merge.bind`)."""
    global _refuse_tangents
    if _forward_ad._current_level < 0:
        return
    if _refuse_tangents is None:
        _refuse_tangents = sys.modules["torch"].compiler.disable(refuse_tangents)
    _refuse_tangents(operation, operands)


def _distinct(arguments: tuple) -> tuple:
    """``arguments`` with each tensor met again replaced by a view of it (autograd sums their gradients)."""
    distinct: list = []
    for argument in arguments:
        if hasattr(argument, "view_as") and any(argument is earlier for earlier in distinct):
            argument = argument.view_as(argument)  # (by identity: Dynamo before 2.13 cannot trace id())
        distinct.append(argument)
    return tuple(distinct)


# -- autograd ---------------------------------------------------------------------------------------------


def _autograd_call(operation: _ops.Operation, options: Any, operands: Any, stream: Any) -> Any:
    """The autograd hook: an eager merge of tensors that require grad, in grad mode."""
    _attach()
    if operation.is_backward:
        raise gradients_not_differentiable(operation)
    refuse_written_grad(operation, operands)
    if not operation.returns:
        raise writes_refused(operation)
    refuse_undifferentiable(operation, options, operands)
    function, arguments = _FUNCTIONS[operation.name], function_arguments(operation, options, operands)
    if stream is None:
        return function.apply(*arguments)
    # Autograd runs each backward on the stream its forward ran on: make the caller's stream current.
    with _arrays.TORCH.scope(_arrays.stream_pointer(stream), operands[2].device.index):
        return function.apply(*arguments)


_dispatch.register_compiler(_compiling, _compiled_call)
_dispatch.register_autograd(_grad_enabled, _autograd_call, refuse_forward_mode)
if "torch" in sys.modules and hasattr(sys.modules["torch"], "library"):
    _bind(sys.modules["torch"])  # torch came first: the ops exist from now on
