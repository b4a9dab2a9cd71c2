"""Bind a merge to its arrays once; relaunch it for the price of a kernel launch.

A serving loop merges into the same buffers step after step. Every call of a
merge function reads each array's pointer, shape, strides and dtype to find its
prepared launch again (about half of the host time of a small merge). ``bind``
does that, and every check, once; the object it returns relaunches the kernel
with nothing else on the host but, for torch tensors, a look at each tensor's
data pointer and its storage's size (a tensor's storage can be swapped, resized or
freed behind its back).

Each bindable merge *declares* how it is bound (:func:`declare`): the library's
merges through their dispatcher operation, the cross-rank merge its own way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from . import _arrays, _dispatch, _launch, _ops, _tuning
from ._arrays import Stream
from ._operands import WRITTEN
from .types import Bound

#: The attribute under which a merge keeps its binder: ``binder(*args, **kwargs) -> bound merge``.
BINDER = "__cupy_merge_bind__"

Merge = TypeVar("Merge", bound=Callable[..., Any])


def declare(merge: Merge, operation: _dispatch.Operation) -> Merge:
    """Attach ``merge`` (the public function calling ``operation``) to its declaration, and make
    it bindable by :func:`bind`."""
    signature = _ops.declare(merge, operation)
    setattr(merge, BINDER, functools.partial(_bind_operation, operation, signature))
    return merge


def _bind_operation(operation: _dispatch.Operation, signature: inspect.Signature, *args: Any, **kwargs: Any):
    arguments = signature.bind(*args, **kwargs)
    arguments.apply_defaults()
    given = arguments.arguments
    operands = type(operation.names)(*(given.get(name) for name in operation.names))
    accepted = inspect.signature(operation.options).parameters
    options = operation.options(**{name: value for name, value in given.items() if name in accepted})
    prepared = _dispatch.prepare(operation, options, operands, _tuning.current())
    _dispatch.refuse_forward_mode_hook(operation, operands)
    if prepared.grad and _dispatch.grad_enabled():
        field = _dispatch.requiring_grad(operands)[0]
        what = f"{getattr(operation.names, field)} requires grad" if field in WRITTEN else "an input requires grad"
        raise RuntimeError(
            f"bind({operation.name}): {what}, and a bound merge records no autograd graph; "
            f"bind under torch.no_grad() or detached tensors, or call {operation.name} itself (differentiable)"
        )
    _dispatch.check_values(operation, prepared, operands)
    return BoundMerge(operation, prepared, operands)


class BoundMerge:
    """One merge bound to its arrays: ``bound(stream=None)`` launches it again.

    Made by :func:`bind`. Holds every array it was bound to (and the outputs it
    allocated), and each torch tensor's storage as bound, so their memory stays
    valid for as long as the bound merge lives. It merges the arrays as they were
    when bound: shapes and strides are not read again (rebind after changing them
    in place). A torch tensor moved to other memory since (``t.data = ...``,
    ``t.set_(...)``) or whose storage was resized or freed is refused with
    ``RuntimeError`` before anything is launched. Launched on a stream other
    than the current one, keep the bound merge alive until that stream has
    finished.

    Parameters
    ----------
    operation : Operation
        The merge, as the dispatcher knows it.
    prepared : Call
        Its call, prepared for the arrays.
    operands : TwoStateOperands or ManyStateOperands
        The arrays, by name.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.ones((2, 4, 8, 64), dtype=cupy.float32)
    >>> s = cupy.zeros((2, 8, 4), dtype=cupy.float32)
    >>> merge = cm.bind(cm.merge_states, v, s)
    >>> merge
    <BoundMerge of cupy arrays on device 0: launches a prepared kernel>
    """

    __slots__ = ("_adapter", "_call", "_device", "_guard", "_keep_alive", "_launches", "_result", "_written")

    def __init__(self, operation: _dispatch.Operation, prepared: _dispatch.Call, operands: Any):
        if prepared.adapter.kind == "jax":
            raise TypeError(
                "merge: JAX arrays are immutable, so a bound merge cannot write into them again; "
                "call the merge each time instead (under jax.jit it is one launch)"
            )
        outputs, patches = _dispatch.allocate(prepared, None, operands)
        self._launches = tuple(
            _launch.with_pointers(launch, patch) if patch else launch
            for launch, patch in zip(prepared.launches, patches)
        )
        self._call = prepared
        self._adapter = prepared.adapter
        self._device = prepared.device
        bound = operands._replace(**outputs)
        self._keep_alive = bound
        self._result = (
            (prepared.adapter.result(bound.out), prepared.adapter.result(bound.out_lse))
            if operation.returns
            else None
        )
        self._guard = PointerGuard(tuple(bound), tuple(operation.names))
        # Every launch writes the same tensors again, the outputs allocated here too (a caller may
        # have saved one for backward): their version counters count each launch.
        torch = _arrays.torch_module()
        self._written = tuple(
            array for field, array in zip(bound._fields, bound)
            if field in WRITTEN and torch is not None and isinstance(array, torch.Tensor)
        )  # fmt: skip

    def __call__(self, stream: Stream = None) -> Any:
        """Launch the merge again.

        Parameters
        ----------
        stream : Stream
            Where to launch: the current stream of the arrays' kind when None,
            as the merges do (else a stream of the arrays' device).

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
        self._guard.check()
        if stream is None:
            stream_ptr = self._adapter.current_stream(self._device)
        else:
            stream_ptr = _arrays.stream_pointer(stream)
            _dispatch.check_stream(stream_ptr, self._call)
        for launch in self._launches:
            _launch.launch(launch, stream_ptr)
        if self._written:
            _arrays.TORCH.mark_written(self._written)
        return self._result

    def __repr__(self) -> str:
        kernel = "nothing (empty arrays)" if not self._launches else "a prepared kernel"
        return f"<BoundMerge of {self._adapter.kind} arrays on device {self._device}: launches {kernel}>"


class PointerGuard:
    """A bound merge's torch tensors as bound: their data pointers and storages. Each storage is
    held, so its memory cannot be handed to another tensor while the merge is bound; a tensor moved
    to other memory since (``t.set_(...)``, ``t.data = ...``, a storage reallocated or freed) or
    whose storage was resized in place (where the allocator could hand back the same address) is
    refused before anything is launched."""

    __slots__ = ("_tensors",)

    def __init__(self, arrays: tuple, names: tuple):
        torch = _arrays.torch_module()
        tensors = []
        for array, name in zip(arrays, names):
            if torch is not None and isinstance(array, torch.Tensor):
                storage = array.untyped_storage()
                tensors.append((array, array.data_ptr(), storage, storage.nbytes(), name))
        self._tensors = tuple(tensors)

    def check(self) -> None:
        for tensor, pointer, storage, nbytes, name in self._tensors:
            if tensor.data_ptr() != pointer or storage.nbytes() != nbytes:
                raise RuntimeError(
                    f"{name}: no longer points at the memory this merge was bound to (its storage was "
                    f"replaced, resized or freed); bind the merge again"
                )


def bind(merge: Callable[..., Any], *args: Any, **kwargs: Any) -> Bound:
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
    binder = getattr(merge, BINDER, None)
    if binder is None:
        raise TypeError(
            f"merge: expected one of cupy_merge's merges (merge_attn_states, merge_state, merge_state_in_place, "
            f"merge_states, merge_states_varlen, merge_across_ranks), got {merge!r}"
        )
    if "stream" in kwargs:
        raise TypeError("stream: pass it to each launch of the bound merge, not to bind")
    return binder(*args, **kwargs)
