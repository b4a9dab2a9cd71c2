"""N-way merges in one pass: dense ``merge_states`` and ragged ``merge_states_varlen``."""

from __future__ import annotations

from typing import Any

from . import _checks, _dispatch
from ._plan import ManyStateOptions

_MERGE_STATES = _dispatch.Operation.many_states("merge_states", ragged=False)
_MERGE_STATES_VARLEN = _dispatch.Operation.many_states("merge_states_varlen", ragged=True)


def merge_states(
    v: Any,
    s: Any,
    *,
    out: Any | None = None,
    out_lse: Any | None = None,
    lse_base: Any = "e",
    out_dtype: Any = None,
    stream: Any = None,
) -> tuple[Any, Any]:
    """Merge ``num_states`` attention states of the same tokens in one pass over memory.

    Parameters
    ----------
    v : ``[num_states, num_tokens, num_heads, head_size]``, float32, float16 or bfloat16
        Any strides with a contiguous last dimension: FlashInfer's token-major
        ``[num_tokens, num_states, num_heads, head_size]`` buffer is passed as
        ``buffer.transpose(1, 0, 2, 3)`` (torch: ``buffer.transpose(0, 1)``), no copy.
    s : float32 ``[num_states, num_heads, num_tokens]``
        Their log-sum-exp, any strides (``[num_tokens, num_states, num_heads]`` as
        ``lse.transpose(1, 2, 0)`` / ``lse.permute(1, 2, 0)``). +inf is read as -inf.
    out : ``[num_tokens, num_heads, head_size]``, optional
        Any value dtype; allocated if omitted. Must not overlap the inputs.
    out_lse : float32 ``[num_heads, num_tokens]``, optional
    lse_base : ``"e"`` or ``2``
        Base of the LSE in and out: natural log (vLLM) or base 2 (FlashInfer).
    out_dtype : optional
        Dtype of an allocated ``out``, e.g. bfloat16 from float32 partials.
    stream : optional
        As for :func:`cupy_merge.merge_attn_states`.

    Returns
    -------
    (v, s) : ``[num_tokens, num_heads, head_size]`` and ``[num_heads, num_tokens]`` in the
    caller's array kind. A token whose states are all empty (-inf) gets 0 and -inf.

    Example
    -------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.random.randn(16, 4, 8, 128).astype(cupy.float32)   # 16 splits
    >>> s = cupy.random.randn(16, 8, 4).astype(cupy.float32)
    >>> out, lse = cm.merge_states(v, s, out_dtype="float16")
    >>> out.dtype, out.shape, lse.shape
    (dtype('float16'), (4, 8, 128), (8, 4))
    """
    options = ManyStateOptions(_checks.lse_base_flag(lse_base), _checks.optional_value_dtype(out_dtype))
    return _dispatch.call(_MERGE_STATES, options, (out, out_lse, v, s, None), stream)


def merge_states_varlen(
    v: Any,
    s: Any,
    indptr: Any,
    *,
    out: Any | None = None,
    out_lse: Any | None = None,
    lse_base: Any = "e",
    out_dtype: Any = None,
    check_indptr: bool = True,
    stream: Any = None,
) -> tuple[Any, Any]:
    """Merge a ragged batch: token ``t`` owns rows ``indptr[t]:indptr[t + 1]`` of ``v`` and ``s``.

    Parameters
    ----------
    v : ``[total_states, num_heads, head_size]``
    s : float32 ``[num_heads, total_states]`` (token-major buffers as ``lse.T``)
    indptr : int32 or int64 ``[num_tokens + 1]`` on the GPU
        Non-decreasing offsets starting at 0; a token with no rows gets 0 and -inf.
    check_indptr : bool
        Copy ``indptr`` to the host and check it before launching (a
        synchronisation). Pass False inside CUDA graphs or hot loops: the kernel
        then writes NaN for any token whose offsets are out of range, never
        reading outside ``v``.
    out, out_lse, lse_base, out_dtype, stream :
        As for :func:`merge_states`.

    Example
    -------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.random.randn(5, 8, 64).astype(cupy.float16)   # 5 states in all
    >>> s = cupy.random.randn(8, 5).astype(cupy.float32)
    >>> indptr = cupy.array([0, 2, 2, 5], dtype=cupy.int32)     # 3 tokens: 2, 0 and 3 states
    >>> out, lse = cm.merge_states_varlen(v, s, indptr)
    >>> out.shape, bool(cupy.isneginf(lse[:, 1]).all())
    ((3, 8, 64), True)
    """
    options = ManyStateOptions(
        _checks.lse_base_flag(lse_base),
        _checks.optional_value_dtype(out_dtype),
        _checks.flag(check_indptr, "check_indptr"),
    )
    return _dispatch.call(_MERGE_STATES_VARLEN, options, (out, out_lse, v, s, indptr), stream)
