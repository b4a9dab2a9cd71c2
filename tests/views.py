"""ArrayViews at fake, well separated, 256-byte aligned addresses: calls planned with no GPU.

Also what the planning tests share: an operation's operand record from views by
field name, planning with the checks an eager call makes (shape rules and plan,
then address rules), a launch's template and arguments by name, and its
arguments with the pointer slots bound to the views' addresses.
"""

from __future__ import annotations

import numpy as np

from cupy_merge import _addresses, _dispatch, _tuning
from cupy_merge import _catalogue as cat
from cupy_merge._arrays import ArrayView

ITEMSIZE = {"bfloat16": 2, "bool": 1, "float8_e4m3fn": 1, "float4_e2m1fn_x2": 1}


def contiguous_strides(shape):
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def view(shape, dtype="float16", ptr=1 << 32, strides=None, device=0):
    itemsize = ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    strides = contiguous_strides(shape) if strides is None else tuple(strides)
    return ArrayView(ptr, tuple(shape), strides, dtype, itemsize, device)


def from_specs(specs: dict, order: list[str]) -> dict:
    """Views of ``bad_inputs.Spec``s, each at its own address; overlapping ones share memory."""
    views = {}
    for index, name in enumerate(order):
        spec = specs[name]
        storage_shape = spec.shape[:-1] + (spec.shape[-1] * spec.last_stride,)
        strides = contiguous_strides(storage_shape)[:-1] + (spec.last_stride,)
        if spec.broadcast:
            strides = (0,) + strides[1:]
        views[name] = view(
            spec.shape, spec.dtype, ((index + 1) << 32) + spec.byte_offset, strides, spec.device
        )
    for name in order:
        spec = specs[name]
        if spec.overlaps:
            other = views[spec.overlaps]
            views[name] = other._replace(ptr=other.ptr - other.strides[0] * other.itemsize)
    return views


# -- planning ------------------------------------------------------------------------------------


def record(operation: _dispatch.Operation, views: dict):
    """``operation``'s operand record of ``views`` (by operand field); fields not given are None."""
    kind = type(operation.names)
    unknown = set(views) - set(kind._fields)
    assert not unknown, f"not operands of {operation.name}: {sorted(unknown)}"
    return kind(**{field: views.get(field) for field in kind._fields})


def plan_checked(operation: _dispatch.Operation, options, views, tuning: _tuning.Tuning = _tuning.DEFAULT):
    """What an eager call checks and plans for these views, in ``_dispatch.prepare``'s order: every
    shape rule and the plan (``plan_for``), then every address rule. ``views``: a record or a dict."""
    if isinstance(views, dict):
        views = record(operation, views)
    planned = _dispatch.plan_for(operation, options, tuning, views)
    for launch in planned.plan:  # every kernel a plan chooses is compiled in its module
        assert launch.kernel in cat.module_instances(launch.module), launch.kernel
    if operation.many:
        _addresses.check_many_addresses(views, operation.names)
    else:
        _addresses.check_two_addresses(views, operation.names)
    return planned


def family(launch) -> cat.KernelFamily:
    return next(f for f in cat.FAMILIES if launch.kernel.startswith(f"cupy_merge::{f.name}<"))


def template(launch) -> dict[str, str]:
    """The launch's template arguments by name, as C++ spells them."""
    values = launch.kernel[launch.kernel.index("<") + 1 : -1].split(", ")
    return dict(zip(family(launch).template, values))


def arguments(launch) -> dict[str, int]:
    """The launch's arguments by parameter name, as planned (0 in every pointer parameter)."""
    return dict(zip(family(launch).params, launch.args))


def _view_of(views, field: str):
    return views.get(field) if isinstance(views, dict) else getattr(views, field)


def bound_args(launch, views) -> dict[str, int]:
    """The launch's arguments by parameter name with each pointer slot filled as the launch is
    prepared: the address of the named operand's view plus the slot's byte offset."""
    args = list(launch.args)
    for slot, field, offset in launch.pointers:
        operand = _view_of(views, field)
        assert operand is not None, f"{launch.kernel}: a pointer slot names {field}, which was not given"
        args[slot] = operand.ptr + offset
    return dict(zip(family(launch).params, args))


def slot_fields(launch) -> dict[str, tuple[str, int]]:
    """Pointer parameter name -> (operand field, byte offset) for every slot of the launch."""
    params = family(launch).params
    return {params[slot]: (field, offset) for slot, field, offset in launch.pointers}
