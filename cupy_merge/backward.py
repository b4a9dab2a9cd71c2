"""The gradients of the merges: one pass over the states, from the merge's inputs and its results' gradients.

With ``w_i = exp(s_i - S)`` (``S`` the merged LSE, sinks included), ``V = sum_i w_i V_i``
and incoming gradients ``dV`` (of ``V``) and ``dS`` (of ``S``)::

    dV_i = w_i dV
    ds_i = w_i (<dV, V_i - V> + dS)          (inner product over head_size)
    dz   = sum over tokens of w_z (dS - <dV, V>),   w_z = exp(z - S)

A state of weight zero gets zero gradients, never NaN, even when its values are
NaN. Without more, the kernel recomputes ``S`` from the LSEs and sums ``<dV, V>``
over the inputs in float32. Given the merge's results too (``out``,
``out_lse``, as it returned them), few rows of many states take a kernel whose
states are independent (``S`` read, ``<dV, V>`` from ``out``: no fold of a row's
LSEs and no sum over its states first, any share of them in any block), several
times faster there; ``out``'s rounding then enters the LSE and sinks' gradients
(about its dtype's precision, as FlashAttention's backward takes its ``D`` from
its output). These are what ``torch.autograd`` and
``jax.grad`` run through the merges (``cupy_merge.torch_ops``, ``cupy_merge.jax``);
call them directly for your own backward passes.
"""

from __future__ import annotations

from . import _dispatch, _ops, _options
from ._arrays import Stream
from ._operands import BackwardOperands
from .bound import declare
from .types import Array, LseBase


def merge_state_backward(
    v_a: Array,
    s_a: Array,
    v_b: Array,
    s_b: Array,
    grad_v: Array,
    grad_s: Array | None = None,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    sinks: Array | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> tuple[Array, Array, Array, Array, Array | None]:
    """The gradients of :func:`cupy_merge.merge_state` with respect to its two states (and sinks).

    Parameters
    ----------
    v_a, s_a, v_b, s_b : DeviceArray
        The merge's inputs, as :func:`cupy_merge.merge_state` took them: values
        ``[num_tokens, num_heads, head_size]``, float32 LSEs ``[num_heads, num_tokens]``.
    grad_v : DeviceArray
        The gradient of the merged values, ``[num_tokens, num_heads, head_size]``, of
        any value dtype (the merge's output dtype).
    grad_s : DeviceArray, optional
        The gradient of the merged LSE, float32 ``[num_heads, num_tokens]``; None for zero.
    out, out_lse : DeviceArray, optional
        The merge's results as it returned them (both or neither): the merged values
        ``[num_tokens, num_heads, head_size]`` in ``grad_v``'s dtype and the merged LSE, float32
        ``[num_heads, num_tokens]``. Few rows of many states then take ``S`` and ``<dV, V>``
        from them (``out``'s rounding enters the LSE gradients).
    sinks : DeviceArray, optional
        The merge's sinks, float32 ``[num_heads]``.
    lse_base : {"e", 2}
        The base of the merge's LSEs (and of ``grad_s``'s LSE).
    stream : Stream
        As for the merges.

    Returns
    -------
    grad_v_a, grad_s_a, grad_v_b, grad_s_b : DeviceArray
        The gradients of the inputs: values in their dtype, LSEs float32, C-contiguous.
    grad_sinks : DeviceArray or None
        Float32 ``[num_heads]`` with sinks, else None.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v_a, v_b = cupy.ones((2, 3, 1, 8), dtype=cupy.float32)
    >>> s_a = s_b = cupy.zeros((1, 3), dtype=cupy.float32)
    >>> grads = cm.merge_state_backward(v_a, s_a, v_b, s_b, cupy.ones_like(v_a))
    >>> float(grads[0][0, 0, 0]), float(grads[1][0, 0])  # half the weight; V_a = V, so no LSE gradient
    (0.5, 0.0)
    """
    options = _options.backward_options(lse_base=lse_base)
    operands = BackwardOperands(None, None, v_a, s_a, grad_v, grad_s, v_b, s_b, sinks=sinks, merged=out, merged_lse=out_lse)
    return _dispatch.call(_ops.MERGE_STATE_BACKWARD, options, operands, stream)


def merge_states_backward(
    v: Array,
    s: Array,
    grad_v: Array,
    grad_s: Array | None = None,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    sinks: Array | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> tuple[Array, Array, Array | None]:
    """The gradients of :func:`cupy_merge.merge_states` with respect to its states (and sinks).

    Parameters
    ----------
    v : DeviceArray
        The merge's states, ``[num_states, num_tokens, num_heads, head_size]``.
    s : DeviceArray
        Their LSEs, float32 ``[num_states, num_heads, num_tokens]``.
    grad_v : DeviceArray
        The gradient of the merged values, ``[num_tokens, num_heads, head_size]``.
    grad_s : DeviceArray, optional
        The gradient of the merged LSE, float32 ``[num_heads, num_tokens]``; None for zero.
    out, out_lse : DeviceArray, optional
        The merge's results as it returned them (both or neither): the merged values
        ``[num_tokens, num_heads, head_size]`` in ``grad_v``'s dtype and the merged LSE, float32
        ``[num_heads, num_tokens]``. Few rows of many states then take ``S`` and ``<dV, V>``
        from them (``out``'s rounding enters the LSE gradients).
    sinks : DeviceArray, optional
        The merge's sinks, float32 ``[num_heads]``.
    lse_base : {"e", 2}
        The base of the LSEs.
    stream : Stream
        As for the merges.

    Returns
    -------
    grad_states_v : DeviceArray
        Like ``v`` (its dtype), C-contiguous.
    grad_states_s : DeviceArray
        Like ``s``, float32, C-contiguous.
    grad_sinks : DeviceArray or None
        Float32 ``[num_heads]`` with sinks, else None.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.ones((4, 2, 1, 8), dtype=cupy.float32)
    >>> s = cupy.zeros((4, 1, 2), dtype=cupy.float32)
    >>> grad_states_v, grad_states_s, _ = cm.merge_states_backward(v, s, cupy.ones((2, 1, 8), cupy.float32))
    >>> float(grad_states_v[0, 0, 0, 0])  # a quarter of the weight each
    0.25
    """
    options = _options.backward_options(lse_base=lse_base)
    operands = BackwardOperands(None, None, v, s, grad_v, grad_s, sinks=sinks, merged=out, merged_lse=out_lse)
    return _dispatch.call(_ops.MERGE_STATES_BACKWARD, options, operands, stream)


def merge_states_varlen_backward(
    v: Array,
    s: Array,
    indptr: Array,
    grad_v: Array,
    grad_s: Array | None = None,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    sinks: Array | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> tuple[Array, Array, Array | None]:
    """The gradients of :func:`cupy_merge.merge_states_varlen` with respect to its rows (and sinks).

    Rows no token owns (before ``indptr[0]``, from ``indptr[-1]`` on, or between the offsets of a
    token whose offsets are out of range) get zero gradients. With offsets that decrease, every
    row's gradient is unspecified: the merge's ``check_indptr=True`` refuses such offsets.

    Parameters
    ----------
    v : DeviceArray
        The rows, ``[total_states, num_heads, head_size]``.
    s : DeviceArray
        Their LSEs, float32 ``[num_heads, total_states]``.
    indptr : DeviceArray
        Int32 or int64 ``[num_tokens + 1]`` offsets, as the merge took them (not checked on the host).
    grad_v : DeviceArray
        The gradient of the merged values, ``[num_tokens, num_heads, head_size]``.
    grad_s : DeviceArray, optional
        The gradient of the merged LSE, float32 ``[num_heads, num_tokens]``; None for zero.
    out, out_lse : DeviceArray, optional
        The merge's results as it returned them (both or neither): the merged values
        ``[num_tokens, num_heads, head_size]`` in ``grad_v``'s dtype and the merged LSE, float32
        ``[num_heads, num_tokens]``. Few rows of many states then take ``S`` and ``<dV, V>``
        from them (``out``'s rounding enters the LSE gradients).
    sinks : DeviceArray, optional
        The merge's sinks, float32 ``[num_heads]``.
    lse_base : {"e", 2}
        The base of the LSEs.
    stream : Stream
        As for the merges.

    Returns
    -------
    grad_states_v : DeviceArray
        Like ``v``, C-contiguous; every element written (zeros for rows no token owns).
    grad_states_s : DeviceArray
        Like ``s``, float32.
    grad_sinks : DeviceArray or None
        Float32 ``[num_heads]`` with sinks, else None.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v, s = cupy.ones((3, 1, 8), dtype=cupy.float32), cupy.zeros((1, 3), dtype=cupy.float32)
    >>> indptr = cupy.array([0, 1, 3], dtype=cupy.int32)
    >>> grad_v, _, _ = cm.merge_states_varlen_backward(v, s, indptr, cupy.ones((2, 1, 8), cupy.float32))
    >>> [float(grad_v[row, 0, 0]) for row in range(3)]
    [1.0, 0.5, 0.5]
    """
    options = _options.backward_options(lse_base=lse_base)
    operands = BackwardOperands(
        None, None, v, s, grad_v, grad_s, indptr=indptr, sinks=sinks, merged=out, merged_lse=out_lse
    )
    return _dispatch.call(_ops.MERGE_STATES_VARLEN_BACKWARD, options, operands, stream)


declare(merge_state_backward, _ops.MERGE_STATE_BACKWARD)
declare(merge_states_backward, _ops.MERGE_STATES_BACKWARD)
declare(merge_states_varlen_backward, _ops.MERGE_STATES_VARLEN_BACKWARD)

__all__ = ["merge_state_backward", "merge_states_backward", "merge_states_varlen_backward"]
