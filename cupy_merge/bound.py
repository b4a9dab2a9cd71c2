"""Bind a merge to its arrays once; relaunch it for the price of a kernel launch.

A serving loop merges into the same buffers step after step. Every call of a
merge function reads each array's pointer, shape, strides and dtype to find its
prepared launch again (about half of the host time of a small merge). ``bind``
does that, and every check, once; the object it returns relaunches the kernel
with nothing else on the host.

Example
-------
>>> import cupy, cupy_merge as cm
>>> v_a, v_b, out = cupy.random.randn(3, 4, 8, 128).astype(cupy.float16)
>>> s_a, s_b = cupy.random.randn(2, 8, 4).astype(cupy.float32)
>>> merge = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b)
>>> for step in range(3):
...     v_a[...] = step            # new data in the same buffers
...     merge()                    # or merge(stream=s)
"""

from __future__ import annotations

from typing import Any

from . import _arrays, _dispatch, _kernels
from .merge import merge_attn_states, merge_state, merge_state_in_place
from .merge_many import merge_states, merge_states_varlen

_BINDABLE = (merge_attn_states, merge_state, merge_state_in_place, merge_states, merge_states_varlen)


class BoundMerge:
    """One merge bound to its arrays: ``bound(stream=None)`` launches it again.

    Holds references to every array it was bound to, so their memory stays valid
    for as long as the bound merge lives. It merges the arrays as they were when
    bound: their shapes and strides are not read again (rebind after changing
    them in place, e.g. with ``a.shape = ...``). Returns what the merge returned
    when bound (the same output arrays every time, for the functions that return
    them).
    """

    __slots__ = ("_current_stream", "_device", "_keep_alive", "_kind", "_prepared", "_result")

    def __init__(self, call: _dispatch.Call, result: Any, keep_alive: tuple):
        self._prepared = call.prepared
        self._kind = call.kind
        self._device = call.device
        self._current_stream = _arrays.current_stream_getter(call.kind)
        self._result = result
        self._keep_alive = keep_alive

    def __call__(self, stream: Any = None) -> Any:
        """Launch on ``stream`` (default: the current stream of the arrays' kind, as the merges do)."""
        if stream is None:
            stream_ptr = self._current_stream(self._device)
        else:
            stream_ptr = _arrays.stream_pointer(stream, self._kind, self._device)
        if self._prepared is not None:
            _kernels.launch_prepared(self._prepared, stream_ptr)
        return self._result

    def __repr__(self) -> str:
        kernel = "nothing (empty arrays)" if self._prepared is None else "a prepared kernel"
        return f"<BoundMerge of {self._kind} arrays on device {self._device}: launches {kernel}>"


def bind(merge: Any, *args: Any, **kwargs: Any) -> BoundMerge:
    """Check and plan ``merge(*args, **kwargs)`` without launching it; return it bound.

    ``merge`` is one of :func:`merge_attn_states`, :func:`merge_state`,
    :func:`merge_state_in_place`, :func:`merge_states` or :func:`merge_states_varlen`;
    the arguments are that function's, without ``stream`` (give it to each launch).
    Output arrays that the merge allocates are allocated once, here, and written by
    every launch. ``check_indptr`` (ragged merges) checks the offsets once, here;
    the kernel guards them on every launch (NaN rows for bad offsets).
    """
    if not any(merge is bindable for bindable in _BINDABLE):
        names = ", ".join(f.__name__ for f in _BINDABLE)
        raise TypeError(f"merge: expected one of cupy_merge's merges ({names}), got {merge!r}")
    if "stream" in kwargs:
        raise TypeError("stream: pass it to each launch of the bound merge, not to bind")
    with _dispatch.capture() as captured:
        result = merge(*args, **kwargs)
    call = captured.call
    if call.kind == "jax":
        raise TypeError(
            "merge: JAX arrays are immutable, so a bound merge cannot write into them again; "
            "call the merge each time instead"
        )
    return BoundMerge(call, result, (args, tuple(kwargs.values())))
