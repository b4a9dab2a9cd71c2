"""Bind a merge to its arrays once; relaunch it for the price of a kernel launch.

A serving loop merges into the same buffers step after step. Every call of a
merge function reads each array's pointer, shape, strides and dtype to find its
prepared launch again (about half of the host time of a small merge). ``bind``
does that, and every check, once; the object it returns relaunches the kernel
with nothing else on the host but, for torch tensors, a look at each tensor's
data pointer (a tensor's storage can be swapped or freed behind its back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _arrays, _dispatch, _kernels
from ._arrays import Stream
from .merge import merge_attn_states, merge_state, merge_state_in_place
from .merge_many import merge_states, merge_states_varlen

_BINDABLE = (merge_attn_states, merge_state, merge_state_in_place, merge_states, merge_states_varlen)


class BoundMerge:
    """One merge bound to its arrays: ``bound(stream=None)`` launches it again.

    Made by :func:`bind`. Holds every array it was bound to (and the outputs it
    allocated), so their memory stays valid for as long as the bound merge lives.
    It merges the arrays as they were when bound: shapes and strides are not read
    again (rebind after changing them in place). A torch tensor whose data
    pointer has changed since (``t.data = ...``, ``t.set_(...)``, a storage
    resized or freed) is refused with ``RuntimeError`` before anything is
    launched. Launched on a stream other than the current one, keep the bound
    merge alive until that stream has finished.

    Parameters
    ----------
    prepared : Prepared
        The merge's prepared call and arrays, as a merge returns them when given
        ``stream=PREPARE`` (what :func:`bind` does).

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.ones((2, 4, 8, 64), dtype=cupy.float32)
    >>> s = cupy.zeros((2, 8, 4), dtype=cupy.float32)
    >>> merge = cm.bind(cm.merge_states, v, s)
    >>> merge
    <BoundMerge of cupy arrays on device 0: launches a prepared kernel>
    """

    __slots__ = ("_adapter", "_device", "_keep_alive", "_launch", "_result", "_torch_pointers")

    def __init__(self, prepared: _dispatch.Prepared):
        operation, call, arrays = prepared
        if call.adapter.kind == "jax":
            raise TypeError(
                "merge: JAX arrays are immutable, so a bound merge cannot write into them again; "
                "call the merge each time instead"
            )
        out, out_lse, patches = _dispatch.allocate(call, arrays[0], arrays[1], None)
        self._launch = None if call.launch is None else _kernels.with_pointers(call.launch, patches)
        self._adapter = call.adapter
        self._device = call.device
        bound = (out, out_lse, *arrays[2:])
        self._keep_alive = bound
        self._result = (call.adapter.result(out), call.adapter.result(out_lse)) if operation.returns else None
        torch = _arrays.torch_module()
        self._torch_pointers = tuple(
            (tensor, tensor.data_ptr(), name)
            for tensor, name in zip(bound, operation.names)
            if torch is not None and isinstance(tensor, torch.Tensor)
        )

    def __call__(self, stream: Stream = None) -> Any:
        """Launch the merge again.

        Parameters
        ----------
        stream : Stream
            Where to launch: the current stream of the arrays' kind when None,
            as the merges do.

        Returns
        -------
        tuple or None
            What the merge returned when bound: the same output arrays each time
            for ``merge_state``, ``merge_states`` and ``merge_states_varlen``,
            None for the merges that write into their arguments.

        Examples
        --------
        >>> import cupy, cupy_merge as cm
        >>> v = cupy.ones((2, 4, 8, 64), dtype=cupy.float32)
        >>> s = cupy.zeros((2, 8, 4), dtype=cupy.float32)
        >>> merge = cm.bind(cm.merge_states, v, s)
        >>> out, lse = merge(stream=cupy.cuda.Stream.null)
        >>> merge()[0] is out
        True
        """
        for tensor, pointer, name in self._torch_pointers:
            if tensor.data_ptr() != pointer:
                raise RuntimeError(
                    f"{name}: no longer points at the memory this merge was bound to (its storage was "
                    f"replaced, resized or freed); bind the merge again"
                )
        if stream is None:
            stream_ptr = self._adapter.current_stream(self._device)
        else:
            stream_ptr = _arrays.stream_pointer(stream)
        if self._launch is not None:
            _kernels.launch(self._launch, stream_ptr)
        return self._result

    def __repr__(self) -> str:
        kernel = "nothing (empty arrays)" if self._launch is None else "a prepared kernel"
        return f"<BoundMerge of {self._adapter.kind} arrays on device {self._device}: launches {kernel}>"


def bind(merge: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Check and plan ``merge(*args, **kwargs)`` without launching it; return it bound.

    Parameters
    ----------
    merge : callable
        One of :func:`merge_attn_states`, :func:`merge_state`, :func:`merge_state_in_place`,
        :func:`merge_states`, :func:`merge_states_varlen`, or
        :func:`cupy_merge.distributed.merge_across_ranks` (which gives a
        ``BoundAcrossRanks``: buffers, launches and the local merge prepared once).
    *args : DeviceArray
        That function's positional arguments.
    **kwargs : object
        Its keyword arguments, without ``stream`` (give it to each launch).
        Outputs the merge would allocate are allocated once, here, and written
        by every launch. ``check_indptr`` (ragged merges) checks the offsets
        once, here; the kernel guards them on every launch (NaN rows for bad offsets).

    Returns
    -------
    BoundMerge or BoundAcrossRanks
        Call it (``bound()`` or ``bound(stream=s)``) to launch the merge.

    Raises
    ------
    TypeError
        ``merge`` is not one of the merges, ``stream`` was given, the arrays are
        JAX arrays (immutable), or an argument is of the wrong kind.
    ValueError
        As the merge itself would raise it, before anything runs.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v_a, v_b, out = cupy.zeros((3, 4, 8, 128), dtype=cupy.float16)
    >>> s_a, s_b = cupy.zeros((2, 8, 4), dtype=cupy.float32)
    >>> merge = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b)
    >>> for step in range(3):
    ...     v_a[...] = step  # new data in the same buffers
    ...     merge()  # or merge(stream=s)
    >>> float(out[0, 0, 0])  # the mean of 2 and 0, equal weights
    1.0
    """
    from .distributed import merge_across_ranks

    if not any(merge is bindable for bindable in (*_BINDABLE, merge_across_ranks)):
        names = ", ".join(f.__name__ for f in (*_BINDABLE, merge_across_ranks))
        raise TypeError(f"merge: expected one of cupy_merge's merges ({names}), got {merge!r}")
    if "stream" in kwargs:
        raise TypeError("stream: pass it to each launch of the bound merge, not to bind")
    if merge is merge_across_ranks:
        from .distributed import _bound

        return _bound.bind(*args, **kwargs)
    prepared = merge(*args, **kwargs, stream=_dispatch.PREPARE)
    _dispatch.check_values(*prepared)
    return BoundMerge(prepared)
