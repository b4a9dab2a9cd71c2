"""ArrayViews at fake, well separated, 256-byte aligned addresses: calls planned with no GPU."""

from __future__ import annotations

import numpy as np

from cupy_merge._arrays import ArrayView

ITEMSIZE = {"bfloat16": 2, "bool": 1, "float8_e4m3fn": 1}


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
