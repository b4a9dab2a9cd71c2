"""torch autograd for the merges: the refusals (what autograd cannot differentiate, said before
anything runs) and the ``autograd.Function`` of each differentiable declaration, whose backward is
its backward operation (``_ops``). ``torch_ops`` makes the Functions with the ops and calls them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, cast

from . import _dispatch, _ops, _options, _tuning
from ._catalogue import FP8
from ._operands import WRITTEN, BackwardOperands, ManyStateOptions, TwoStateOptions


def requires_grad(*tensors: Any) -> bool:
    for tensor in tensors:
        if tensor is not None and tensor.requires_grad:
            return True
    return False


def writes_refused(operation: _ops.Operation) -> RuntimeError:
    return RuntimeError(
        f"{operation.name}: writes into its arguments, so autograd cannot differentiate it; an input "
        f"requires grad: use merge_state, merge_states or merge_states_varlen (functional), or call it "
        f"under torch.no_grad()"
    )


def refuse_writes_under_grad(operation: _ops.Operation, *inputs: Any) -> None:
    """A form that writes into its arguments refuses inputs that require grad in grad mode (under
    ``torch.no_grad()`` it runs, as the eager path does)."""
    if sys.modules["torch"].is_grad_enabled() and requires_grad(*inputs):
        raise writes_refused(operation)


def gradients_not_differentiable(operation: _ops.Operation) -> RuntimeError:
    return RuntimeError(
        f"{operation.name}: an input requires grad in grad mode (backward(create_graph=True)?); "
        f"the merges' gradients are not differentiable again"
    )


def refuse_differentiating_gradients(operation: _ops.Operation, *inputs: Any) -> None:
    """A backward merge traced in grad mode on inputs that require grad is refused, as eagerly."""
    if sys.modules["torch"].is_grad_enabled() and requires_grad(*inputs):
        raise gradients_not_differentiable(operation)


def refuse_written_grad(operation: _ops.Operation, operands: Any) -> None:
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


_REVERSE_ONLY = ("cupy-merge's merges are differentiable in reverse mode only (loss.backward(), "
                 "torch.autograd.grad, eagerly and under torch.compile): their tangents are not computed")


def refuse_tangents(operation: _ops.Operation, operands: Any) -> None:
    """Forward-mode AD's dual tensors need not require grad, so nothing else would notice one:
    refuse its tangent rather than return results without theirs."""
    torch = sys.modules["torch"]
    for field, tensor in zip(operands._fields, operands):
        if not isinstance(tensor, torch.Tensor):
            continue
        try:
            tangent = torch.autograd.forward_ad.unpack_dual(tensor).tangent
        except RuntimeError:  # below autograd (a compiled graph's kernel): no tangent can be read there
            return
        if tangent is not None:
            raise TypeError(
                f"{getattr(operation.names, field)}: a dual tensor of forward-mode AD (torch.autograd.forward_ad, "
                f"torch.func.jvp); {_REVERSE_ONLY}"
            )


def tangents_unseen(operation: _ops.Operation) -> TypeError:
    """A merge traced inside a forward-mode AD level: its inputs' tangents cannot be seen."""
    return TypeError(
        f"{operation.name}: traced (torch.compile, torch.export, ...) inside a forward-mode AD level "
        f"(torch.autograd.forward_ad.dual_level), where its inputs' tangents cannot be seen; {_REVERSE_ONLY}"
    )


def refuse_traced_grad(operation: _ops.Operation, *inputs: Any) -> None:
    """A functional op put in differentiated compiled code by hand carries no autograd formula of
    its own: say so at trace time (the public functions are differentiable, compiled too)."""
    torch = sys.modules["torch"]
    if torch.is_grad_enabled() and requires_grad(*inputs):
        raise RuntimeError(
            f"torch.ops.cupy_merge.{operation.name}: the op has no autograd formula inside compiled code; "
            f"call cupy_merge.{operation.name}(...) instead (differentiable eagerly and under torch.compile)"
        )


def refuse_undifferentiable(operation: _ops.Operation, options: Any, operands: Any) -> None:
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


def _inputs(operation: _ops.Operation) -> tuple[str, ...]:
    """The operands a differentiable merge's Function takes: those with gradients, then the others
    its backward reads (a ragged merge's offsets)."""
    return operation.gradients + tuple(f for f in operation.backward_inputs.values() if f not in operation.gradients)


def function_arguments(operation: _ops.Operation, options: Any, operands: Any) -> tuple:
    """A Function's arguments: its operands, then the options' fields (constants to Dynamo)."""
    return (*(getattr(operands, field) for field in _inputs(operation)), *options)


def _unit_last(grad: Any) -> Any:
    """Incoming gradients may be broadcast views (``v.sum()``'s has stride 0); the kernels read a
    contiguous last dimension."""
    return grad if grad.shape[-1] <= 1 or grad.stride(-1) == 1 else grad.contiguous()


def _dense(grad: Any) -> Any:
    """An LSE's gradient as a dense array (a broadcast one has zero strides): a few bytes a token."""
    return grad if grad.is_contiguous() else grad.contiguous()


def _make_function(torch: Any, operation: _ops.Operation, compiling: Callable[[], bool]) -> Any:
    """The autograd Function of a differentiable merge. Its forward runs the merge (the op while
    tracing), its backward the merge's backward operation (its op while tracing), from the merge's
    inputs (and its results, where the backward reads them)."""
    fields = _inputs(operation)
    count = len(fields)
    record = type(operation.names)
    option_type = ManyStateOptions if operation.many else TwoStateOptions
    backward = cast(_ops.Operation, operation.backward)

    class Merge(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            options = option_type(*args[count:])
            given = dict(zip(fields, args[:count]))
            operands = record(*(given.get(field) for field in record._fields))
            merged, lse = _dispatch.call(operation, options, operands, None)  # grad mode is off in here
            ctx.save_for_backward(*args[:count], *((merged, lse) if operation.backward_reads_results else ()))
            ctx.lse_base = "2" if options.lse_base_2 else "e"
            # Autograd's thread runs the backward outside this context (compiled code: the process's default).
            ctx.tuning = None if compiling() else _tuning.current()
            return merged, lse

        @staticmethod
        def backward(ctx, grad_v, grad_s):
            saved = ctx.saved_tensors
            given = dict(zip(fields, saved[:count]))
            merged, merged_lse = saved[count:] or (None, None)
            arrays = {field: given[of] for field, of in operation.backward_inputs.items()}
            operands = BackwardOperands(None, None, grad_out=_unit_last(grad_v), grad_lse=_dense(grad_s), merged=merged,
                                        merged_lse=merged_lse, **arrays)  # fmt: skip
            options = _options.backward_options(lse_base=ctx.lse_base)
            with contextlib.nullcontext() if ctx.tuning is None else _tuning.use(ctx.tuning):
                grads = _dispatch.call(backward, options, operands, None)
            by_field = dict(zip(operation.gradients, grads))
            return (*(by_field.get(field) for field in fields), *(None,) * len(option_type._fields))

    Merge.__name__ = Merge.__qualname__ = "".join(part.title() for part in operation.name.split("_"))
    return Merge


def make_functions(torch: Any, compiling: Callable[[], bool]) -> dict[str, Any]:
    """The autograd Function of every differentiable merge (``compiling``: true while torch traces)."""
    return {op.name: _make_function(torch, op, compiling) for op in _ops.OPERATIONS.values() if op.backward is not None}
