"""The torch integration: registered ops, fakes from shapes, ``torch.compile`` routing and autograd.

Importing this module (``cupy_merge`` does) never imports torch. It registers two hooks with the
dispatcher:

* the *compiler* hook: while torch traces (``torch.compile``, ``torch.export``, ``make_fx`` or any
  ``TorchDispatchMode``), a public merge becomes its registered op ``torch.ops.cupy_merge.*``
  (outputs the caller left out are allocated in the graph), so Dynamo captures the whole graph;
  eager calls pay one predicate (0.1-0.2 us) and take the NVRTC path as before;
* the *autograd* hook: a functional merge of tensors that require grad runs through a
  ``torch.autograd.Function`` whose backward calls the backward kernels (:mod:`cupy_merge.backward`);
  compiled code takes the same Function, with the ops inside it.

The ops are defined on the light path (``torch.library.Library("cupy_merge", "FRAGMENT")``,
``define`` / ``impl`` on CUDA / ``register_fake``) when first needed, and at once when torch was
imported before ``cupy_merge``. Their CUDA kernels are the eager merges, on torch's current stream;
their fakes check every shape rule from the tensors' sizes (with the eager messages) without adding a
guard, and allocate the outputs. ``python -m cupy_merge.torch_ops`` prints the host-cost table.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _arrays, _checks, _dispatch, _tuning
from . import backward as _backward
from . import merge as _merge
from . import merge_many as _merge_many
from ._catalogue import FP8
from ._operands import WRITTEN, BackwardOperands, ManyStateOperands, TwoStateOperands

__all__ = ["NAMESPACE", "SCHEMAS", "host_cost_table", "ops"]

#: The torch library namespace: ``torch.ops.cupy_merge.<name>``.
NAMESPACE = "cupy_merge"

_TWO_FP8 = "Tensor? output_scale=None, Tensor(c!)? output_block_scale=None, int? quant_group_size=None, "
_FP8_OUT = "Tensor? output_scale=None, Tensor(c!)? output_block_scale=None, int? quant_group_size=None, bool scale_ue8m0=False"

#: Every op's schema. Written tensors are declared (``Tensor(a!)``); the ``*_out`` and in-place ops
#: return nothing. Argument names are the public functions' (errors name them alike).
SCHEMAS: dict[str, str] = {
    # vLLM's signature, as cupy_merge.merge_attn_states takes it.
    "merge_attn_states": (
        "merge_attn_states(Tensor(a!) output, Tensor prefix_output, Tensor prefix_lse, Tensor suffix_output, "
        "Tensor suffix_lse, Tensor(b!)? output_lse=None, SymInt? prefill_tokens_with_context=None, "
        + _TWO_FP8
        + 'bool quant_scale_ue8m0=False, *, bool scale_ue8m0=False, Tensor? sinks=None, str lse_base="e") -> ()'
    ),
    "merge_state": (
        "merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, *, ScalarType? out_dtype=None, "
        'Tensor? sinks=None, Tensor? output_scale=None, str lse_base="e") -> (Tensor, Tensor)'
    ),
    "merge_state_out": (
        "merge_state_out(Tensor(a!) out, Tensor(b!) out_lse, Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, *, "
        "ScalarType? out_dtype=None, Tensor? sinks=None, " + _FP8_OUT + ', str lse_base="e") -> ()'
    ),
    "merge_state_in_place": (
        "merge_state_in_place(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, Tensor? mask=None, *, "
        'Tensor? sinks=None, str lse_base="e") -> ()'
    ),
    "merge_states": (
        'merge_states(Tensor v, Tensor s, *, str lse_base="e", ScalarType? out_dtype=None, Tensor? sinks=None, '
        "Tensor? output_scale=None) -> (Tensor, Tensor)"
    ),
    "merge_states_out": (
        'merge_states_out(Tensor(a!) out, Tensor(b!) out_lse, Tensor v, Tensor s, *, str lse_base="e", '
        "ScalarType? out_dtype=None, Tensor? sinks=None, " + _FP8_OUT + ") -> ()"
    ),
    "merge_states_varlen": (
        'merge_states_varlen(Tensor v, Tensor s, Tensor indptr, *, str lse_base="e", ScalarType? out_dtype=None, '
        "bool check_indptr=True, Tensor? sinks=None, Tensor? output_scale=None) -> (Tensor, Tensor)"
    ),
    "merge_states_varlen_out": (
        "merge_states_varlen_out(Tensor(a!) out, Tensor(b!) out_lse, Tensor v, Tensor s, Tensor indptr, *, "
        'str lse_base="e", ScalarType? out_dtype=None, bool check_indptr=True, Tensor? sinks=None, '
        + _FP8_OUT
        + ") -> ()"
    ),
    "merge_state_backward": (
        "merge_state_backward(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor grad_v, Tensor? grad_s=None, "
        '*, Tensor? out=None, Tensor? out_lse=None, Tensor? sinks=None, str lse_base="e") -> '
        "(Tensor, Tensor, Tensor, Tensor, Tensor?)"
    ),
    "merge_states_backward": (
        "merge_states_backward(Tensor v, Tensor s, Tensor grad_v, Tensor? grad_s=None, *, Tensor? out=None, "
        'Tensor? out_lse=None, Tensor? sinks=None, str lse_base="e") -> (Tensor, Tensor, Tensor?)'
    ),
    "merge_states_varlen_backward": (
        "merge_states_varlen_backward(Tensor v, Tensor s, Tensor indptr, Tensor grad_v, Tensor? grad_s=None, *, "
        'Tensor? out=None, Tensor? out_lse=None, Tensor? sinks=None, str lse_base="e") -> (Tensor, Tensor, Tensor?)'
    ),
}

#: The ops that allocate their results (the rest write into their arguments).
FUNCTIONAL = (
    "merge_state",
    "merge_states",
    "merge_states_varlen",
    "merge_state_backward",
    "merge_states_backward",
    "merge_states_varlen_backward",
)

_MERGE_ATTN_STATES = _merge._MERGE_ATTN_STATES
_MERGE_STATE = _merge._MERGE_STATE
_MERGE_STATE_IN_PLACE = _merge._MERGE_STATE_IN_PLACE
_MERGE_STATES = _merge_many._MERGE_STATES
_MERGE_STATES_VARLEN = _merge_many._MERGE_STATES_VARLEN
_MERGE_STATE_BACKWARD = _backward._MERGE_STATE_BACKWARD
_MERGE_STATES_BACKWARD = _backward._MERGE_STATES_BACKWARD
_MERGE_STATES_VARLEN_BACKWARD = _backward._MERGE_STATES_VARLEN_BACKWARD

#: Tests with a CPU stand-in kernel set this: fakes then take CPU tensors (on the host device).
_SPECS_ON_HOST = False


# -- the hooks: no torch until the caller has imported it ---------------------------------------------

_LOCK = threading.Lock()
_LIB: Any = None  # the Library holding the ops: they live as long as it does
_FUNCTIONS: dict[str, Any] = {}  # the autograd.Function classes, made with the ops
# Bound by the first eager look at a loaded torch; never changed while Dynamo traces (it guards on them).
_dynamo_compiling: Callable[[], bool] | None = None  # torch.compiler.is_dynamo_compiling
_dispatch_modes: Callable[[], int] = int  # torch._C._len_torch_dispatch_stack


def _compiling() -> bool:
    """The compiler hook's predicate, run by every merge call: true while torch traces.

    Dynamo (``torch.compile``, strict ``torch.export``) folds ``is_dynamo_compiling()`` to True, so
    nothing of the eager path is traced; ``make_fx``, non-strict export and other tracers push a
    dispatch mode. In eager code: two calls, 0.1-0.2 us.
    """
    dynamo = _dynamo_compiling
    if dynamo is None:
        return _first_look()
    return dynamo() or _dispatch_modes() > 0


def _first_look() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False  # no torch loaded: nothing can be tracing
    if _supported(torch) and torch.compiler.is_dynamo_compiling():
        return True  # the first merge of the process met inside Dynamo: it changes no global here
    _bind(torch)
    return _dispatch_modes() > 0


def _supported(torch: Any) -> bool:
    """Whether this torch has what the integration uses (torch 2.4 and newer)."""
    return hasattr(torch.library, "register_fake") and hasattr(torch.compiler, "is_dynamo_compiling")


def _never() -> bool:
    return False


def _bind(torch: Any) -> None:
    """Define the ops, then bind the predicate's two functions (eager code only). An older torch
    gets no ops: merges then run eagerly as before, never traced."""
    global _dynamo_compiling, _dispatch_modes
    if not _supported(torch):
        _dynamo_compiling = _never
        return
    _attach()
    _dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", int)
    _dynamo_compiling = torch.compiler.is_dynamo_compiling


def _attach() -> None:
    """Define the ops and the autograd Functions (once; any thread)."""
    if _LIB is not None:
        return
    with _LOCK:
        if _LIB is None:
            torch = sys.modules["torch"]
            if not _FUNCTIONS:
                _FUNCTIONS.update(_make_functions(torch))
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


def _define(torch: Any) -> None:
    global _LIB
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # keep it: the registrations die with it
    tags = (torch.Tag.pt2_compliant_tag,)
    for name, schema in SCHEMAS.items():
        lib.define(schema, tags=tags)
        lib.impl(name, _KERNELS[name], "CUDA")
        # The kernel is the public merge, which handles autograd itself (the autograd hook: the
        # functional merges are differentiable, the others refuse inputs that require grad): autograd
        # falls through to it, skipping the dispatcher's "no autograd kernel" fallback (and its cost).
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _FAKES[name], lib=lib)
    _LIB = lib


# -- CUDA kernels: the eager merges (torch's current stream; compiling() is false in them) -------------


def _merge_attn_states_kernel(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                              prefill_tokens_with_context=None, output_scale=None, output_block_scale=None,
                              quant_group_size=None, quant_scale_ue8m0=False, *, scale_ue8m0=False, sinks=None,
                              lse_base="e"):  # fmt: skip
    # merge.merge_attn_states' body, one Python frame less (the op's eager cost is measured against it).
    options = _checks.two_state_options(
        lse_base=lse_base,
        prefill_tokens_with_context=prefill_tokens_with_context,
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        quant_scale_ue8m0=quant_scale_ue8m0,
    )
    operands = TwoStateOperands(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, None,
                                sinks, output_scale, output_block_scale)  # fmt: skip
    _dispatch.call(_MERGE_ATTN_STATES, options, operands, None)


def _merge_state_kernel(v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None, lse_base="e"):
    return _merge.merge_state(v_a, s_a, v_b, s_b, out_dtype=out_dtype, sinks=sinks, output_scale=output_scale,
                              lse_base=lse_base)  # fmt: skip


def _merge_state_out_kernel(out, out_lse, v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None,
                            output_block_scale=None, quant_group_size=None, scale_ue8m0=False, lse_base="e"):  # fmt: skip
    _merge.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, out_dtype=out_dtype, sinks=sinks,
                       output_scale=output_scale, output_block_scale=output_block_scale,
                       quant_group_size=quant_group_size, scale_ue8m0=scale_ue8m0, lse_base=lse_base)  # fmt: skip


def _merge_state_in_place_kernel(v, s, v_other, s_other, mask=None, *, sinks=None, lse_base="e"):
    _merge.merge_state_in_place(v, s, v_other, s_other, mask, sinks=sinks, lse_base=lse_base)


def _merge_states_kernel(v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None):
    return _merge_many.merge_states(v, s, lse_base=lse_base, out_dtype=out_dtype, sinks=sinks,
                                    output_scale=output_scale)  # fmt: skip


def _merge_states_out_kernel(out, out_lse, v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None,
                             output_block_scale=None, quant_group_size=None, scale_ue8m0=False):  # fmt: skip
    _merge_many.merge_states(v, s, out=out, out_lse=out_lse, lse_base=lse_base, out_dtype=out_dtype, sinks=sinks,
                             output_scale=output_scale, output_block_scale=output_block_scale,
                             quant_group_size=quant_group_size, scale_ue8m0=scale_ue8m0)  # fmt: skip


def _merge_states_varlen_kernel(v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True, sinks=None,
                                output_scale=None):  # fmt: skip
    # check_indptr inside a CUDA-graph capture: the dispatcher skips the host copy (it cannot be
    # captured) and the kernel's guard gives NaN rows for offsets out of range.
    return _merge_many.merge_states_varlen(v, s, indptr, lse_base=lse_base, out_dtype=out_dtype,
                                           check_indptr=check_indptr, sinks=sinks, output_scale=output_scale)  # fmt: skip


def _merge_states_varlen_out_kernel(out, out_lse, v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True,
                                    sinks=None, output_scale=None, output_block_scale=None, quant_group_size=None,
                                    scale_ue8m0=False):  # fmt: skip
    _merge_many.merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, lse_base=lse_base, out_dtype=out_dtype,
                                    check_indptr=check_indptr, sinks=sinks, output_scale=output_scale,
                                    output_block_scale=output_block_scale, quant_group_size=quant_group_size,
                                    scale_ue8m0=scale_ue8m0)  # fmt: skip


def _merge_state_backward_kernel(v_a, s_a, v_b, s_b, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                                 lse_base="e"):  # fmt: skip
    return _backward.merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s, out=out, out_lse=out_lse, sinks=sinks,
                                          lse_base=lse_base)  # fmt: skip


def _merge_states_backward_kernel(v, s, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None, lse_base="e"):
    return _backward.merge_states_backward(v, s, grad_v, grad_s, out=out, out_lse=out_lse, sinks=sinks,
                                           lse_base=lse_base)  # fmt: skip


def _merge_states_varlen_backward_kernel(v, s, indptr, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                                         lse_base="e"):  # fmt: skip
    return _backward.merge_states_varlen_backward(v, s, indptr, grad_v, grad_s, out=out, out_lse=out_lse, sinks=sinks,
                                                  lse_base=lse_base)  # fmt: skip


_KERNELS: dict[str, Callable[..., Any]] = {
    "merge_attn_states": _merge_attn_states_kernel,
    "merge_state": _merge_state_kernel,
    "merge_state_out": _merge_state_out_kernel,
    "merge_state_in_place": _merge_state_in_place_kernel,
    "merge_states": _merge_states_kernel,
    "merge_states_out": _merge_states_out_kernel,
    "merge_states_varlen": _merge_states_varlen_kernel,
    "merge_states_varlen_out": _merge_states_varlen_out_kernel,
    "merge_state_backward": _merge_state_backward_kernel,
    "merge_states_backward": _merge_states_backward_kernel,
    "merge_states_varlen_backward": _merge_states_varlen_backward_kernel,
}


# -- fakes: every shape rule from sizes alone, then the outputs --------------------------------------


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
    spec = _arrays.TORCH.spec(tensor, name, _SPECS_ON_HOST)  # layout, device, lazy bits: as eagerly
    if all(type(x) is int for x in spec.shape + spec.strides):
        return spec
    hints = [_hint(x) for x in spec.shape + spec.strides]
    if None in hints:
        return None
    sizes = [int(x) for x in hints if x is not None]
    return spec._replace(shape=tuple(sizes[: len(spec.shape)]), strides=tuple(sizes[len(spec.shape) :]))


def _requires_grad(*tensors: Any) -> bool:
    for tensor in tensors:
        if tensor is not None and tensor.requires_grad:
            return True
    return False


def _writes_refused(operation: _dispatch.Operation) -> RuntimeError:
    return RuntimeError(
        f"{operation.name}: writes into its arguments, so autograd cannot differentiate it; an input "
        f"requires grad: use merge_state, merge_states or merge_states_varlen (functional), or call it "
        f"under torch.no_grad()"
    )


def _refuse_written_grad(operation: _dispatch.Operation, operands: Any) -> None:
    """In grad mode, a merge into a given tensor that requires grad is refused, as torch's own
    ``out=`` ops refuse it (under ``torch.no_grad()`` it writes)."""
    if not sys.modules["torch"].is_grad_enabled():
        return
    for field in WRITTEN:
        tensor = getattr(operands, field, None)
        if tensor is not None and tensor.requires_grad:
            name = getattr(operation.names, field)
            raise RuntimeError(
                f"{name}: requires grad, and {operation.name} writes into it; a merge into given tensors is not "
                f"differentiable (as torch's out= ops are not): pass a tensor that does not require grad, "
                f"leave it out (merge_state, merge_states and merge_states_varlen allocate their outputs), or "
                f"merge under torch.no_grad()"
            )


def _refuse_writes_under_grad(operation: _dispatch.Operation, *inputs: Any) -> None:
    """A form that writes into its arguments refuses inputs that require grad in grad mode (under
    ``torch.no_grad()`` it runs, as the eager path does)."""
    if sys.modules["torch"].is_grad_enabled() and _requires_grad(*inputs):
        raise _writes_refused(operation)


def _check(operation: _dispatch.Operation, options: Any, operands: Any) -> None:
    """Every shape rule of one call (``_dispatch.plan_specs`` without the launch plan), on the
    operands' sizes, with the eager path's messages. The address rules (overlaps) and the values'
    rules (``check_indptr``) run in the kernel."""
    _refuse_written_grad(operation, operands)
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
    described = type(operands)(**{field: specs.get(field) for field in fields})
    if isinstance(described, BackwardOperands):
        _checks.check_backward(described, names, options)  # type: ignore[arg-type]
        return
    scaled = described.output_scale is not None or described.output_block_scale is not None
    described = described._replace(out=_checks.fp8_bytes(described.out, scaled))
    if operation.many:
        state, _ = _checks.check_many_inputs(described, names)  # type: ignore[arg-type]
    else:
        state = _checks.check_two_inputs(described, names)  # type: ignore[arg-type]
    described, _ = _dispatch._fresh_outputs(operation, options.out_dtype, state, described)
    if operation.many:
        _checks.check_many(described, names, options)  # type: ignore[arg-type]
    else:
        _checks.check_two(described, names, options)  # type: ignore[arg-type]


def _refuse_traced_grad(operation: _dispatch.Operation, *inputs: Any) -> None:
    """A functional op put in differentiated compiled code by hand carries no autograd formula of
    its own: say so at trace time (the public functions are differentiable, compiled too)."""
    torch = sys.modules["torch"]
    if torch.is_grad_enabled() and _requires_grad(*inputs):
        raise RuntimeError(
            f"torch.ops.cupy_merge.{operation.name}: the op has no autograd formula inside compiled code; "
            f"call cupy_merge.{operation.name}(...) instead (differentiable eagerly and under torch.compile)"
        )


def _values(torch: Any, like: Any, num_tokens: Any, dtype: Any) -> Any:
    return torch.empty((num_tokens, like.shape[-2], like.shape[-1]), dtype=dtype or like.dtype, device=like.device)


def _lse(torch: Any, like: Any, num_tokens: Any) -> Any:
    return torch.empty((like.shape[-2], num_tokens), dtype=torch.float32, device=like.device)


def _merge_attn_states_fake(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                            prefill_tokens_with_context=None, output_scale=None, output_block_scale=None,
                            quant_group_size=None, quant_scale_ue8m0=False, *, scale_ue8m0=False, sinks=None,
                            lse_base="e"):  # fmt: skip
    prefill = prefill_tokens_with_context
    options = _checks.two_state_options(
        lse_base=lse_base,
        prefill_tokens_with_context=prefill if prefill is None else _hint(prefill),
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        quant_scale_ue8m0=quant_scale_ue8m0,
    )
    inputs = (prefix_output, prefix_lse, suffix_output, suffix_lse, sinks, output_scale)
    _refuse_writes_under_grad(_MERGE_ATTN_STATES, *inputs)
    _check(_MERGE_ATTN_STATES, options, TwoStateOperands(output, output_lse, prefix_output, prefix_lse, suffix_output,
                                                         suffix_lse, None, sinks, output_scale, output_block_scale))  # fmt: skip


def _merge_state_fake(v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None, lse_base="e"):
    torch = sys.modules["torch"]
    options = _checks.two_state_options(lse_base=lse_base, out_dtype=out_dtype)
    _refuse_traced_grad(_MERGE_STATE, v_a, s_a, v_b, s_b, sinks)
    _check(_MERGE_STATE, options, TwoStateOperands(None, None, v_a, s_a, v_b, s_b, None, sinks, output_scale))
    return _values(torch, v_a, v_a.shape[0], out_dtype), _lse(torch, v_a, v_a.shape[0])


def _merge_state_out_fake(out, out_lse, v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None,
                          output_block_scale=None, quant_group_size=None, scale_ue8m0=False, lse_base="e"):  # fmt: skip
    options = _checks.two_state_options(lse_base=lse_base, out_dtype=out_dtype, output_block_scale=output_block_scale,
                                        quant_group_size=quant_group_size, scale_ue8m0=scale_ue8m0)  # fmt: skip
    _check(_MERGE_STATE, options, TwoStateOperands(out, out_lse, v_a, s_a, v_b, s_b, None, sinks, output_scale,
                                                   output_block_scale))  # fmt: skip


def _merge_state_in_place_fake(v, s, v_other, s_other, mask=None, *, sinks=None, lse_base="e"):
    _refuse_writes_under_grad(_MERGE_STATE_IN_PLACE, v, s, v_other, s_other, mask, sinks)
    options = _checks.two_state_options(lse_base=lse_base)
    _check(_MERGE_STATE_IN_PLACE, options, TwoStateOperands(v, s, v, s, v_other, s_other, mask, sinks))


def _merge_states_fake(v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None):
    torch = sys.modules["torch"]
    options = _checks.many_state_options(lse_base=lse_base, out_dtype=out_dtype)
    _refuse_traced_grad(_MERGE_STATES, v, s, sinks)
    _check(_MERGE_STATES, options, ManyStateOperands(None, None, v, s, None, sinks, output_scale))
    return _values(torch, v, v.shape[1], out_dtype), _lse(torch, v, v.shape[1])


def _merge_states_out_fake(out, out_lse, v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None,
                           output_block_scale=None, quant_group_size=None, scale_ue8m0=False):  # fmt: skip
    options = _checks.many_state_options(lse_base=lse_base, out_dtype=out_dtype, output_block_scale=output_block_scale,
                                         quant_group_size=quant_group_size, scale_ue8m0=scale_ue8m0)  # fmt: skip
    _check(_MERGE_STATES, options, ManyStateOperands(out, out_lse, v, s, None, sinks, output_scale, output_block_scale))


def _merge_states_varlen_fake(v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True, sinks=None,
                              output_scale=None):  # fmt: skip
    torch = sys.modules["torch"]
    options = _checks.many_state_options(lse_base=lse_base, out_dtype=out_dtype, check_indptr=check_indptr)
    _refuse_traced_grad(_MERGE_STATES_VARLEN, v, s, sinks)
    _check(_MERGE_STATES_VARLEN, options, ManyStateOperands(None, None, v, s, indptr, sinks, output_scale))
    num_tokens = indptr.shape[0] - 1 if indptr.dim() == 1 else 0
    return _values(torch, v, num_tokens, out_dtype), _lse(torch, v, num_tokens)


def _merge_states_varlen_out_fake(out, out_lse, v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True,
                                  sinks=None, output_scale=None, output_block_scale=None, quant_group_size=None,
                                  scale_ue8m0=False):  # fmt: skip
    options = _checks.many_state_options(lse_base=lse_base, out_dtype=out_dtype, check_indptr=check_indptr,
                                         output_block_scale=output_block_scale, quant_group_size=quant_group_size,
                                         scale_ue8m0=scale_ue8m0)  # fmt: skip
    _check(_MERGE_STATES_VARLEN, options, ManyStateOperands(out, out_lse, v, s, indptr, sinks, output_scale,
                                                            output_block_scale))  # fmt: skip


def _like(torch: Any, tensor: Any) -> Any:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)  # C-contiguous, as the kernel's


def _grad_sinks(torch: Any, sinks: Any) -> Any:
    return None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)


def _merge_state_backward_fake(v_a, s_a, v_b, s_b, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                               lse_base="e"):  # fmt: skip
    torch = sys.modules["torch"]
    options = _checks.backward_options(lse_base=lse_base)
    _check(_MERGE_STATE_BACKWARD, options, BackwardOperands(None, None, v_a, s_a, grad_v, grad_s, v_b, s_b,
                                                            sinks=sinks, merged=out, merged_lse=out_lse))  # fmt: skip
    return _like(torch, v_a), _like(torch, s_a), _like(torch, v_b), _like(torch, s_b), _grad_sinks(torch, sinks)


def _merge_states_backward_fake(v, s, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None, lse_base="e"):
    torch = sys.modules["torch"]
    options = _checks.backward_options(lse_base=lse_base)
    _check(_MERGE_STATES_BACKWARD, options, BackwardOperands(None, None, v, s, grad_v, grad_s, sinks=sinks,
                                                             merged=out, merged_lse=out_lse))  # fmt: skip
    return _like(torch, v), _like(torch, s), _grad_sinks(torch, sinks)


def _merge_states_varlen_backward_fake(v, s, indptr, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                                       lse_base="e"):  # fmt: skip
    torch = sys.modules["torch"]
    options = _checks.backward_options(lse_base=lse_base)
    _check(_MERGE_STATES_VARLEN_BACKWARD, options, BackwardOperands(None, None, v, s, grad_v, grad_s, indptr=indptr,
                                                                    sinks=sinks, merged=out, merged_lse=out_lse))  # fmt: skip
    return _like(torch, v), _like(torch, s), _grad_sinks(torch, sinks)


_FAKES: dict[str, Callable[..., Any]] = {
    "merge_attn_states": _merge_attn_states_fake,
    "merge_state": _merge_state_fake,
    "merge_state_out": _merge_state_out_fake,
    "merge_state_in_place": _merge_state_in_place_fake,
    "merge_states": _merge_states_fake,
    "merge_states_out": _merge_states_out_fake,
    "merge_states_varlen": _merge_states_varlen_fake,
    "merge_states_varlen_out": _merge_states_varlen_out_fake,
    "merge_state_backward": _merge_state_backward_fake,
    "merge_states_backward": _merge_states_backward_fake,
    "merge_states_varlen_backward": _merge_states_varlen_backward_fake,
}


# -- under tracing: the public merges become the ops (Dynamo traces this code) ---------------------------


def _lse_base(options: Any) -> str:
    return "2" if options.lse_base_2 else "e"


def _dtype(torch: Any, name: str | None) -> Any:
    return None if name is None else getattr(torch, name)


def _tokens(tensor: Any, ndim: int, axis: int) -> Any:
    # A tensor of another rank gets no output of its own shape: the fake refuses that input first.
    return tensor.shape[axis] if tensor.dim() == ndim else 0


def _compiled_call(operation: _dispatch.Operation, options: Any, operands: Any, stream: Any) -> Any:
    """The compiler hook: the public merge as its op, outputs left out allocated in the graph."""
    _attach()
    torch = sys.modules["torch"]
    primary = operands[2]
    if not isinstance(primary, torch.Tensor):
        if torch.compiler.is_compiling():
            raise TypeError(
                f"{operation.names[2]}: under torch.compile a merge takes torch tensors, got {type(primary).__name__}"
            )
        # A user's dispatch mode over CuPy arrays: nothing of torch is traced, run eagerly.
        return _dispatch.run(operation, _dispatch.prepare(operation, options, operands, _tuning.current()),
                             operands, stream)  # fmt: skip
    if stream is not None:
        raise ValueError(
            "stream: a traced merge runs on torch's current stream; pass stream=None and enter "
            "torch.cuda.stream(s) around the call instead"
        )
    if isinstance(operands, BackwardOperands):
        return _traced_backward(torch, operation, options, operands)
    _refuse_written_grad(operation, operands)
    if operation.many:
        return _traced_many(torch, operation, options, operands)
    return _traced_two(torch, operation, options, operands)


def _traced_two(torch: Any, operation: _dispatch.Operation, options: Any, o: TwoStateOperands) -> Any:
    ops_ = torch.ops.cupy_merge
    lse_base = _lse_base(options)
    inputs = (o.v_a, o.s_a, o.v_b, o.s_b, o.mask, o.sinks, o.output_scale)
    if operation.name == "merge_attn_states":
        _refuse_writes_under_grad(operation, *inputs)
        ops_.merge_attn_states.default(o.out, o.v_a, o.s_a, o.v_b, o.s_b, o.out_lse, options.merge_tokens,
                                       o.output_scale, o.output_block_scale, options.group_size, False,
                                       scale_ue8m0=bool(options.scale_ue8m0), sinks=o.sinks, lse_base=lse_base)  # fmt: skip
        return None
    if operation.name == "merge_state_in_place":
        _refuse_writes_under_grad(operation, *inputs)
        ops_.merge_state_in_place.default(o.out, o.out_lse, o.v_b, o.s_b, o.mask, sinks=o.sinks, lse_base=lse_base)
        return None
    dtype = _dtype(torch, options.out_dtype)
    if torch.is_grad_enabled() and _requires_grad(*inputs):
        _refuse_undifferentiable(operation, options, o)
        return _FUNCTIONS["merge_state"].apply(o.v_a, o.s_a, o.v_b, o.s_b, o.sinks, options.out_dtype,
                                               options.lse_base_2)  # fmt: skip
    if o.out is None and o.out_lse is None and o.output_block_scale is None:
        return ops_.merge_state.default(o.v_a, o.s_a, o.v_b, o.s_b, out_dtype=dtype, sinks=o.sinks,
                                        output_scale=o.output_scale, lse_base=lse_base)  # fmt: skip
    num_tokens = _tokens(o.v_a, 3, 0)
    out = _values(torch, o.v_a, num_tokens, dtype) if o.out is None else o.out
    out_lse = _lse(torch, o.v_a, num_tokens) if o.out_lse is None else o.out_lse
    ops_.merge_state_out.default(out, out_lse, o.v_a, o.s_a, o.v_b, o.s_b, out_dtype=dtype, sinks=o.sinks,
                                 output_scale=o.output_scale, output_block_scale=o.output_block_scale,
                                 quant_group_size=options.group_size, scale_ue8m0=bool(options.scale_ue8m0),
                                 lse_base=lse_base)  # fmt: skip
    return out, out_lse


def _traced_many(torch: Any, operation: _dispatch.Operation, options: Any, o: ManyStateOperands) -> Any:
    ops_ = torch.ops.cupy_merge
    lse_base = _lse_base(options)
    dtype = _dtype(torch, options.out_dtype)
    ragged = operation.name == "merge_states_varlen"
    if _requires_grad(o.v, o.s, o.sinks, o.output_scale) and torch.is_grad_enabled():
        _refuse_undifferentiable(operation, options, o)
        if ragged:
            return _FUNCTIONS["merge_states_varlen"].apply(o.v, o.s, o.indptr, o.sinks, options.out_dtype,
                                                           options.check_indptr, options.lse_base_2)  # fmt: skip
        return _FUNCTIONS["merge_states"].apply(o.v, o.s, o.sinks, options.out_dtype, options.lse_base_2)
    if o.out is None and o.out_lse is None and o.output_block_scale is None:
        if ragged:
            return ops_.merge_states_varlen.default(o.v, o.s, o.indptr, lse_base=lse_base, out_dtype=dtype,
                                                    check_indptr=options.check_indptr, sinks=o.sinks,
                                                    output_scale=o.output_scale)  # fmt: skip
        return ops_.merge_states.default(o.v, o.s, lse_base=lse_base, out_dtype=dtype, sinks=o.sinks,
                                         output_scale=o.output_scale)  # fmt: skip
    num_tokens = _tokens(o.indptr, 1, 0) - 1 if ragged else _tokens(o.v, 4, 1)
    out = _values(torch, o.v, num_tokens, dtype) if o.out is None else o.out
    out_lse = _lse(torch, o.v, num_tokens) if o.out_lse is None else o.out_lse
    written = {"out_dtype": dtype, "sinks": o.sinks, "output_scale": o.output_scale,
               "output_block_scale": o.output_block_scale, "quant_group_size": options.group_size,
               "scale_ue8m0": bool(options.scale_ue8m0), "lse_base": lse_base}  # fmt: skip
    if ragged:
        ops_.merge_states_varlen_out.default(out, out_lse, o.v, o.s, o.indptr, check_indptr=options.check_indptr,
                                             **written)  # fmt: skip
    else:
        ops_.merge_states_out.default(out, out_lse, o.v, o.s, **written)
    return out, out_lse


def _traced_backward(torch: Any, operation: _dispatch.Operation, options: Any, o: BackwardOperands) -> Any:
    ops_ = torch.ops.cupy_merge
    lse_base = _lse_base(options)
    results = {"out": o.merged, "out_lse": o.merged_lse}
    if operation.name == "merge_state_backward":
        return ops_.merge_state_backward.default(o.v, o.s, o.v_b, o.s_b, o.grad_out, o.grad_lse, sinks=o.sinks,
                                                 lse_base=lse_base, **results)  # fmt: skip
    if operation.name == "merge_states_varlen_backward":
        return ops_.merge_states_varlen_backward.default(o.v, o.s, o.indptr, o.grad_out, o.grad_lse, sinks=o.sinks,
                                                         lse_base=lse_base, **results)  # fmt: skip
    return ops_.merge_states_backward.default(o.v, o.s, o.grad_out, o.grad_lse, sinks=o.sinks, lse_base=lse_base,
                                              **results)  # fmt: skip


# -- autograd ---------------------------------------------------------------------------------------------


def _refuse_undifferentiable(operation: _dispatch.Operation, options: Any, operands: Any) -> None:
    given = [name for field, name in (("out", "out="), ("out_lse", "out_lse="),
                                      ("output_block_scale", "output_block_scale="))
             if getattr(operands, field) is not None]  # fmt: skip
    if given:
        raise RuntimeError(
            f"{operation.name}: an input requires grad, and a merge into given tensors ({', '.join(given)}) is not "
            f"differentiable; leave them out (the merge allocates its outputs) or merge under torch.no_grad()"
        )
    if options.out_dtype == FP8 or operands.output_scale is not None:
        raise RuntimeError(
            f"{operation.name}: an input requires grad, and an FP8 (float8_e4m3fn) output is not differentiable; "
            f"merge to float32, float16 or bfloat16, or under torch.no_grad()"
        )


def _autograd_call(operation: _dispatch.Operation, options: Any, operands: Any, stream: Any) -> Any:
    """The autograd hook: an eager functional merge of tensors that require grad, in grad mode."""
    _attach()
    if operation.name.endswith("_backward"):
        raise RuntimeError(
            f"{operation.name}: an input requires grad in grad mode (backward(create_graph=True)?); "
            f"the merges' gradients are not differentiable again"
        )
    _refuse_written_grad(operation, operands)
    if not operation.returns:
        raise _writes_refused(operation)
    _refuse_undifferentiable(operation, options, operands)
    args: tuple[Any, ...]
    if operation.name == "merge_state":
        o = operands
        function = _FUNCTIONS["merge_state"]
        args = (o.v_a, o.s_a, o.v_b, o.s_b, o.sinks, options.out_dtype, options.lse_base_2)
    elif operation.name == "merge_states_varlen":
        function = _FUNCTIONS["merge_states_varlen"]
        args = (operands.v, operands.s, operands.indptr, operands.sinks, options.out_dtype, options.check_indptr,
                options.lse_base_2)  # fmt: skip
    else:
        function = _FUNCTIONS["merge_states"]
        args = (operands.v, operands.s, operands.sinks, options.out_dtype, options.lse_base_2)
    if stream is None:
        return function.apply(*args)
    # Autograd runs each backward on the stream its forward ran on: make the caller's stream current.
    with _arrays.TORCH.scope(_arrays.stream_pointer(stream), operands[2].device.index):
        return function.apply(*args)


def _unit_last(grad: Any) -> Any:
    """Incoming gradients may be broadcast views (``v.sum()``'s has stride 0); the kernels read a
    contiguous last dimension."""
    return grad if grad.shape[-1] <= 1 or grad.stride(-1) == 1 else grad.contiguous()


def _dense(grad: Any) -> Any:
    """An LSE's gradient as a dense array (a broadcast one has zero strides): a few bytes a token."""
    return grad if grad.is_contiguous() else grad.contiguous()


def _make_functions(torch: Any) -> dict[str, Any]:
    """The three differentiable merges. Their forward runs the merge (the op while tracing), their
    backward the backward merge through the public function (its op while tracing)."""

    def lse_base(flag: int) -> str:
        return "2" if flag else "e"

    class MergeState(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v_a, s_a, v_b, s_b, sinks, out_dtype, lse_base_2):
            base = lse_base(lse_base_2)
            if _compiling():
                v, s = torch.ops.cupy_merge.merge_state.default(v_a, s_a, v_b, s_b, out_dtype=_dtype(torch, out_dtype),
                                                                sinks=sinks, lse_base=base)  # fmt: skip
            else:  # grad mode is off in here: the dispatcher runs the merge
                options = _checks.two_state_options(lse_base=base, out_dtype=out_dtype)
                operands = TwoStateOperands(None, None, v_a, s_a, v_b, s_b, None, sinks)
                v, s = _dispatch.call(_MERGE_STATE, options, operands, None)
            ctx.save_for_backward(v_a, s_a, v_b, s_b, sinks)
            ctx.lse_base = base
            return v, s

        @staticmethod
        def backward(ctx, grad_v, grad_s):
            v_a, s_a, v_b, s_b, sinks = ctx.saved_tensors
            grad_v, grad_s = _unit_last(grad_v), _dense(grad_s)
            grads = _backward.merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s, sinks=sinks,
                                                   lse_base=ctx.lse_base)  # fmt: skip
            return grads[0], grads[1], grads[2], grads[3], grads[4], None, None

    class MergeStates(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v, s, sinks, out_dtype, lse_base_2):
            base = lse_base(lse_base_2)
            if _compiling():
                merged, lse = torch.ops.cupy_merge.merge_states.default(v, s, lse_base=base,
                                                                        out_dtype=_dtype(torch, out_dtype), sinks=sinks)  # fmt: skip
            else:
                options = _checks.many_state_options(lse_base=base, out_dtype=out_dtype)
                merged, lse = _dispatch.call(_MERGE_STATES, options, ManyStateOperands(None, None, v, s, None, sinks),
                                             None)  # fmt: skip
            ctx.save_for_backward(v, s, sinks, merged, lse)
            ctx.lse_base = base
            return merged, lse

        @staticmethod
        def backward(ctx, grad_v, grad_s):
            v, s, sinks, merged, lse = ctx.saved_tensors
            grad_v, grad_s = _unit_last(grad_v), _dense(grad_s)
            grads = _backward.merge_states_backward(v, s, grad_v, grad_s, out=merged, out_lse=lse, sinks=sinks,
                                                    lse_base=ctx.lse_base)  # fmt: skip
            return grads[0], grads[1], grads[2], None, None

    class MergeStatesVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v, s, indptr, sinks, out_dtype, check_indptr, lse_base_2):
            base = lse_base(lse_base_2)
            if _compiling():
                merged, lse = torch.ops.cupy_merge.merge_states_varlen.default(
                    v, s, indptr, lse_base=base, out_dtype=_dtype(torch, out_dtype), check_indptr=check_indptr,
                    sinks=sinks,
                )  # fmt: skip
            else:
                options = _checks.many_state_options(lse_base=base, out_dtype=out_dtype, check_indptr=check_indptr)
                operands = ManyStateOperands(None, None, v, s, indptr, sinks)
                merged, lse = _dispatch.call(_MERGE_STATES_VARLEN, options, operands, None)
            ctx.save_for_backward(v, s, indptr, sinks, merged, lse)
            ctx.lse_base = base
            return merged, lse

        @staticmethod
        def backward(ctx, grad_v, grad_s):
            v, s, indptr, sinks, merged, lse = ctx.saved_tensors
            grad_v, grad_s = _unit_last(grad_v), _dense(grad_s)
            grads = _backward.merge_states_varlen_backward(v, s, indptr, grad_v, grad_s, out=merged, out_lse=lse,
                                                           sinks=sinks, lse_base=ctx.lse_base)  # fmt: skip
            return grads[0], grads[1], None, grads[2], None, None, None

    return {"merge_state": MergeState, "merge_states": MergeStates, "merge_states_varlen": MergeStatesVarlen}


if __name__ != "__main__":  # (python -m cupy_merge.torch_ops runs a second copy: it only measures)
    _dispatch.register_compiler(_compiling, _compiled_call)
    _dispatch.register_autograd(_grad_enabled, _autograd_call)
    if "torch" in sys.modules and hasattr(sys.modules["torch"], "library"):
        _bind(sys.modules["torch"])  # torch came first: the ops exist from now on


# -- host cost -------------------------------------------------------------------------------------------


def _per_call(call: Callable[[], Any], torch: Any, batch: int, batches: int) -> float:
    """Median microseconds a call over batches of back-to-back calls, each batch synchronised."""
    for _ in range(batch):
        call()
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batch):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(times)


def _decode_steps(torch: Any, heads: int, head_size: int, splits: int, split_len: int) -> dict[str, Any]:
    """A split-KV decode step (one query token; plain matmuls per split, then ``merge_states``),
    compiled with ``reduce-overhead`` and eager with the merge bound, over one static KV cache."""
    import cupy_merge as cm

    dtype = torch.bfloat16
    scale = head_size**-0.5
    keys = torch.randn(splits, heads, head_size, split_len, device="cuda", dtype=dtype)  # K^T per split
    values = torch.randn(splits, heads, split_len, head_size, device="cuda", dtype=dtype)
    query = torch.randn(1, heads, head_size, device="cuda", dtype=dtype)

    def step(q):
        scores = torch.matmul(q.transpose(0, 1), keys).float() * scale  # [splits, heads, 1, split_len]
        lse = torch.logsumexp(scores, dim=-1)  # [splits, heads, 1]
        partial = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(dtype), values)  # [splits, heads, 1, D]
        return cm.merge_states(partial.transpose(1, 2), lse)

    torch._dynamo.mark_static_address(keys)
    torch._dynamo.mark_static_address(values)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")

    def compiled_step():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(query)

    scores = torch.empty(splits, heads, 1, split_len, device="cuda", dtype=dtype)
    lse = torch.empty(splits, heads, 1, device="cuda")
    partial = torch.empty(splits, heads, 1, head_size, device="cuda", dtype=dtype)
    merge = cm.bind(cm.merge_states, partial.transpose(1, 2), lse)

    def eager_step():
        torch.matmul(query.transpose(0, 1), keys, out=scores)
        scaled = scores.float() * scale
        torch.logsumexp(scaled, dim=-1, out=lse)
        torch.matmul(torch.exp(scaled - lse.unsqueeze(-1)).to(dtype), values, out=partial)
        return merge()

    for _ in range(3):  # warm-up and capture
        compiled_step()
    want = eager_step()[0].float()
    got = compiled_step()[0].float()
    error = float((got - want).norm() / want.norm())
    if error > 2e-2:
        raise AssertionError(f"the compiled decode step differs from the eager one: relative error {error:.2e}")
    return {"compiled": compiled_step, "eager": eager_step}


def host_cost_table(
    tokens: int = 1,
    heads: int = 32,
    head_size: int = 128,
    splits: int = 4,
    split_len: int = 256,
    batch: int = 256,
    batches: int = 40,
    file: Any = None,
) -> dict[str, float]:
    """Print and return the host cost of the torch paths: microseconds a call on this GPU.

    Rows: the eager ``cm.merge_attn_states`` (bf16, ``tokens x heads x head_size``), the same merge as
    the registered op (packet and ``.default``), ``torch.add(a, b, out=c)`` and the bound merge as
    yardsticks, and a split-KV decode step (``splits`` splits of ``split_len`` keys, plain matmuls,
    then ``merge_states``) compiled with ``mode="reduce-overhead"`` against the same step in eager
    mode with its merge bound (``cm.bind``). Each row is the median over ``batches`` batches of
    ``batch`` calls, synchronised after each batch.

    Parameters
    ----------
    tokens, heads, head_size : int
        The merge's shape.
    splits, split_len : int
        The decode step's KV splits and their length.
    batch, batches : int
        Calls a batch, and batches a row.
    file : file-like, optional
        Where to print (standard output by default).

    Returns
    -------
    dict
        Microseconds a call by row name.

    Raises
    ------
    RuntimeError
        No CUDA device.

    Examples
    --------
    >>> from cupy_merge import torch_ops
    >>> table = torch_ops.host_cost_table()  # doctest: +SKIP
    """
    import torch

    import cupy_merge as cm

    if not torch.cuda.is_available():
        raise RuntimeError("host_cost_table: needs a CUDA device")
    ops_ = ops()
    dtype = torch.bfloat16
    v_a, v_b, out = (torch.randn(tokens, heads, head_size, device="cuda", dtype=dtype) for _ in range(3))
    s_a, s_b, out_lse = (torch.randn(heads, tokens, device="cuda") for _ in range(3))
    packet, overload = ops_.merge_attn_states, ops_.merge_attn_states.default
    bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
    steps = _decode_steps(torch, heads, head_size, splits, split_len)
    rows: dict[str, Callable[[], Any]] = {
        "cm.merge_attn_states (eager)": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.ops.cupy_merge.merge_attn_states": lambda: packet(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.ops.cupy_merge.merge_attn_states.default": lambda: overload(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.add(a, b, out=c)": lambda: torch.add(v_a, v_b, out=out),
        "cm.bind(cm.merge_attn_states) relaunch": bound,
        f"decode step, compiled reduce-overhead ({splits}x{split_len} keys)": steps["compiled"],
        f"decode step, eager with cm.bind ({splits}x{split_len} keys)": steps["eager"],
    }
    results: dict[str, float] = {}
    for _round in range(2):  # the first round warms every path
        results = {name: _per_call(call, torch, batch, batches) for name, call in rows.items()}
    width = max(map(len, results))
    print(f"host cost per call, {tokens}x{heads}x{head_size} bf16, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", file=file)  # fmt: skip
    for name, micros in results.items():
        print(f"  {name:<{width}}  {micros:7.2f} us", file=file)
    eager, packet_cost = results["cm.merge_attn_states (eager)"], results["torch.ops.cupy_merge.merge_attn_states"]
    compiled_cost, eager_step_cost = list(results.values())[-2:]
    print(f"  op / eager: {packet_cost / eager:.2f}x (target <= 1.3x); compiled step / eager bound step: "
          f"{compiled_cost / eager_step_cost:.2f}x (target <= 1x)", file=file)  # fmt: skip
    return results


if __name__ == "__main__":
    import importlib

    importlib.import_module("cupy_merge.torch_ops").host_cost_table()  # the copy cupy_merge registered
