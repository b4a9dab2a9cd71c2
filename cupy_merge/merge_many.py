"""N-way merges in one pass: dense ``merge_states`` and ragged ``merge_states_varlen``."""

from __future__ import annotations

from typing import Any

from . import _arrays, _conventions, _dispatch, _plan_many
from .merge import allocate_outputs

fingerprint = _dispatch.fingerprint
_NAMES = _plan_many.NAMES


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
    return _merge(v, s, None, out, out_lse, lse_base, out_dtype, stream)


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
    return _merge(v, s, indptr, out, out_lse, lse_base, out_dtype, stream, check_indptr)


def _merge(v, s, indptr, out, out_lse, lse_base, out_dtype, stream, check_indptr=False):
    # A host check of indptr reads its values, so those calls always take the full path.
    key = None
    if not check_indptr:
        key = (
            "merge_states",  # dense and ragged differ by the indptr fingerprint, () when dense
            fingerprint(out), fingerprint(out_lse), fingerprint(v), fingerprint(s), fingerprint(indptr),
            _dispatch.UNSET if out_dtype is None else out_dtype, lse_base,
        )  # fmt: skip
        call = _dispatch.lookup(key)
        if call is not None:
            out, out_lse = _dispatch.run_with_fresh_outputs(call, v, out, out_lse, stream)
            return _arrays.to_caller_kind(out, call.kind), _arrays.to_caller_kind(out_lse, call.kind)
    out, out_lse, call = _plan_call(v, s, indptr, out, out_lse, lse_base, out_dtype, check_indptr)
    _dispatch.run(call, stream)
    if key is not None:
        _dispatch.remember(key, call)
    return _arrays.to_caller_kind(out, call.kind), _arrays.to_caller_kind(out_lse, call.kind)


def _plan_call(v, s, indptr, out, out_lse, lse_base, out_dtype, check_indptr):
    """The full path: describe and check every input before anything is allocated, then plan.

    The call it returns records which outputs it allocated, for repeats to allocate again.
    """
    lse_base_2 = _conventions.lse_base_flag(lse_base)
    kind = _arrays.array_kind(v)
    v_view, s_view = _arrays.describe(v, _NAMES.v), _arrays.describe(s, _NAMES.s)
    if indptr is None:
        state, _ = _plan_many.check_many_states(v_view, s_view)
        indptr_view = None
    else:
        indptr_view = _arrays.describe(indptr, _NAMES.indptr)
        state, total_states = _plan_many.check_varlen_states(v_view, s_view, indptr_view)
        if check_indptr:
            _plan_many.check_indptr_values(_arrays.to_numpy(indptr), total_states, _NAMES.indptr)
    new_out, new_lse = out is None, out_lse is None
    out, out_view, out_lse, lse_view = allocate_outputs(
        v, kind, state, out, out_lse, out_dtype, _NAMES.out, _NAMES.out_lse
    )
    plan = _plan_many.plan_many(out_view, lse_view, v_view, s_view, indptr_view, lse_base_2)
    fresh = _dispatch.fresh_outputs(new_out, new_lse, state, out_view.dtype)
    return out, out_lse, _dispatch.prepare_call(plan, kind, state.device)._replace(fresh=fresh)
