"""The per-call fast path: recognise a repeated call by its arrays and relaunch its prepared kernel.

Serving loops call a merge on the same buffers step after step. A call's
*fingerprint* is the data pointer, shape, strides and dtype of each CuPy array
or torch tensor it was given, plus its scalar options; everything the checks and
the plan depend on. The first call with a fingerprint takes the full path
(describe, check, plan, pack the arguments); a repeat skips straight to
``cuLaunchKernel``. Pointers are unique across devices (CUDA's unified address
space), so the device need not be part of the fingerprint. Other array kinds
(DLPack, ``__cuda_array_interface__``) always take the full path.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, NamedTuple

import cupy

from . import _arrays, _kernels, _plan

_NOT_AN_ARRAY: tuple = ()
UNSET = object()  # stands for an option left at None inside keys, where None means "not cacheable"
_torch_tensor: type | None = None
_calls: dict[tuple, Call] = {}
_MAX_CALLS = 4096


class FreshOutputs(NamedTuple):
    """Outputs a call allocates anew each time: ``(shape, dtype name)`` of ``out`` and
    ``shape`` of ``out_lse``, each None where the caller passes its own."""

    values: tuple | None
    lse: tuple | None


class Call(NamedTuple):
    prepared: _kernels.PreparedLaunch | None  # None: nothing to launch (an empty array)
    kind: str
    device: int
    fresh: FreshOutputs | None = None  # set on calls that allocate their outputs


def fingerprint(obj: Any) -> tuple | None:
    """What identifies an array for planning, or ``None`` when it must take the full path."""
    cls = type(obj)
    if cls is cupy.ndarray:
        return (obj.data.ptr, obj.shape, obj.strides, obj.dtype)
    if cls is _torch_tensor:
        return (obj.data_ptr(), obj.shape, obj.stride(), obj.dtype)
    if obj is None:
        return _NOT_AN_ARRAY
    _learn_torch()
    return None


def _learn_torch() -> None:
    global _torch_tensor
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_tensor = torch.Tensor


def lookup(key: tuple) -> Call | None:
    """The prepared call for ``key``; keys start with the public function's name, so two
    functions given the same arrays never share a launch."""
    try:
        return _calls.get(key)
    except TypeError:  # an unhashable option; the full path reports it
        return None


def remember(key: tuple, call: Call) -> None:
    if None in key:  # an array without a fingerprint: never cached
        return
    if len(_calls) >= _MAX_CALLS:
        _calls.clear()
    _calls[key] = call


def prepare_call(plan, kind: str, device: int) -> Call:
    return Call(None if plan is None else _kernels.prepare(plan, device), kind, device)


def fresh_outputs(new_out: bool, new_lse: bool, state, out_dtype_name: str) -> FreshOutputs:
    """What a repeat of a call allocates: ``out`` and/or ``out_lse``, as the first call did."""
    values = ((state.num_tokens, state.num_heads, state.head_size), out_dtype_name) if new_out else None
    return FreshOutputs(values, (state.num_heads, state.num_tokens) if new_lse else None)


def run_with_fresh_outputs(call: Call, like: Any, out: Any, out_lse: Any, stream: Any) -> tuple[Any, Any]:
    """Repeat an allocating call: allocate its outputs, point its prepared launch at them, run.

    Fresh allocations are aligned and never overlap the inputs, so the plan made for
    the first call's outputs holds for any later ones; only the pointers change.
    """
    if call.fresh.values is None and call.fresh.lse is None:
        run(call, stream)  # the caller gave both outputs: the cached launch as it is
        return out, out_lse
    patches = []
    if call.fresh.values is not None:
        out = _arrays.empty(like, call.kind, *call.fresh.values, call.device)
        patches.append((_plan.OUT_ARGUMENT, _arrays.data_pointer(out)))
    if call.fresh.lse is not None:
        out_lse = _arrays.empty(like, call.kind, call.fresh.lse, "float32", call.device)
        patches.append((_plan.OUT_LSE_ARGUMENT, _arrays.data_pointer(out_lse)))
    prepared = None if call.prepared is None else _kernels.with_pointers(call.prepared, patches)
    run(Call(prepared, call.kind, call.device), stream)
    return out, out_lse


def run(call: Call, stream: Any) -> None:
    if _capturing and _take_captured(call):
        return
    stream_ptr = _arrays.stream_pointer(
        stream, call.kind, call.device
    )  # checked even when there is nothing to do
    if call.prepared is not None:
        _kernels.launch_prepared(call.prepared, stream_ptr)


# bind() plans a merge without launching it: inside capture(), run() hands its call
# over instead. The module-wide count keeps run()'s common case to one global read.
_capturing = 0
_capturing_lock = threading.Lock()  # += on a global is not atomic across threads
_capture_slot = threading.local()


class _Captured:
    call: Call | None = None


@contextlib.contextmanager
def capture():
    """Inside this block, on this thread, ``run`` records its call instead of launching it."""
    global _capturing
    captured = _Captured()
    _capture_slot.target = captured
    with _capturing_lock:
        _capturing += 1
    try:
        yield captured
    finally:
        with _capturing_lock:
            _capturing -= 1
        _capture_slot.target = None
    if captured.call is None:
        raise RuntimeError("bind: the merge planned no launch")  # every merge runs exactly once


def _take_captured(call: Call) -> bool:
    target = getattr(_capture_slot, "target", None)
    if target is None:
        return False
    target.call = call
    return True
