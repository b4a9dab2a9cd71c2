"""N-way merges in one pass: dense ``merge_states`` and ragged ``merge_states_varlen``."""

from __future__ import annotations

from typing import Any

from . import _dispatch, _ops, _options
from ._arrays import Stream
from ._operands import ManyStateOperands
from .bound import declare
from .types import Array, LseBase


def merge_states(
    v: Array,
    s: Array,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    lse_base: LseBase = "e",
    out_dtype: Any = None,
    sinks: Array | None = None,
    output_scale: Array | None = None,
    output_block_scale: Array | None = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    stream: Stream = None,
) -> tuple[Array, Array]:
    """Merge ``num_states`` attention states of the same tokens in one pass over memory.

    Split-KV decoding's last step: each state is the attention of the same
    queries over one split of the KV sequence. At most 65,536 states a token
    (float32 sums of more drift out of the inputs' range).

    Parameters
    ----------
    v : DeviceArray
        ``[num_states, num_tokens, num_heads, head_size]``, float32, float16 or
        bfloat16, any strides with a contiguous last dimension: FlashInfer's
        token-major ``[num_tokens, num_states, num_heads, head_size]`` buffer is
        passed as ``buffer.transpose(1, 0, 2, 3)`` (torch: ``buffer.transpose(0, 1)``).
    s : DeviceArray
        Their log-sum-exp, float32 ``[num_states, num_heads, num_tokens]``, any
        strides (``[num_tokens, num_states, num_heads]`` as ``lse.transpose(1, 2, 0)``,
        torch: ``lse.permute(1, 2, 0)``). ``+inf`` is read as ``-inf``.
    out : DeviceArray, optional
        ``[num_tokens, num_heads, head_size]`` of any value dtype; allocated if
        omitted. Must not overlap the inputs.
    out_lse : DeviceArray, optional
        Float32 ``[num_heads, num_tokens]``; allocated if omitted.
    lse_base : {"e", 2}
        Base of the LSE in and out: natural log (vLLM) or base 2 (FlashInfer).
    out_dtype : str or dtype, optional
        Dtype of an allocated ``out``, e.g. bfloat16 from float32 partials, or
        ``"float8_e4m3fn"`` with a scale, or ``"nvfp4"`` with its scales
        (``[num_tokens, num_heads, head_size // 2]``: two values a byte).
    sinks : DeviceArray, optional
        Attention sinks, float32 ``[num_heads]`` natural-log logits, each counted
        once in its head's denominator (a state of value 0 and LSE ``sink``); no
        states then give 0 and LSE ``sink``.
    output_scale : DeviceArray, optional
        An FP8 output's per-tensor scale or an NVFP4 output's global scale, as for
        :func:`cupy_merge.merge_attn_states`.
    output_block_scale : DeviceArray, optional
        An FP8 output's per-group scales or an NVFP4 output's block scales, written; as
        for :func:`cupy_merge.merge_attn_states`.
    quant_group_size : int, optional
        As for :func:`cupy_merge.merge_attn_states`.
    scale_ue8m0 : bool
        As for :func:`cupy_merge.merge_attn_states`.
    is_sf_swizzled_layout : bool
        As for :func:`cupy_merge.merge_attn_states` (NVFP4 block scales' layout).
    stream : Stream
        As for :func:`cupy_merge.merge_attn_states`.

    Returns
    -------
    v : DeviceArray
        ``[num_tokens, num_heads, head_size]``; a token whose states are all
        empty (``-inf``) gets 0.
    s : DeviceArray
        ``[num_heads, num_tokens]``; ``-inf`` for such a token. Both in the
        caller's array kind.

    See Also
    --------
    merge_states_varlen : A different number of states for each token.

    Notes
    -----
    Differentiable as :func:`cupy_merge.merge_state` is (torch autograd, eager
    and compiled; ``jax.grad``), through :func:`cupy_merge.merge_states_backward`.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.ones((16, 4, 8, 128), dtype=cupy.float32)  # 16 splits of 4 tokens
    >>> s = cupy.zeros((16, 8, 4), dtype=cupy.float32)
    >>> out, lse = cm.merge_states(v, s, out_dtype="float16")
    >>> out.dtype, out.shape, float(out[0, 0, 0]), round(float(lse[0, 0]), 4)
    (dtype('float16'), (4, 8, 128), 1.0, 2.7726)
    """
    options = _options.many_state_options(
        lse_base=lse_base,
        out_dtype=out_dtype,
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        is_sf_swizzled_layout=is_sf_swizzled_layout,
    )
    operands = ManyStateOperands(out, out_lse, v, s, None, sinks, output_scale, output_block_scale)
    return _dispatch.call(_ops.MERGE_STATES, options, operands, stream)


def merge_states_varlen(
    v: Array,
    s: Array,
    indptr: Array,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    lse_base: LseBase = "e",
    out_dtype: Any = None,
    check_indptr: bool = True,
    sinks: Array | None = None,
    output_scale: Array | None = None,
    output_block_scale: Array | None = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    stream: Stream = None,
) -> tuple[Array, Array]:
    """Merge a ragged batch: token ``t`` owns rows ``indptr[t]:indptr[t + 1]`` of ``v`` and ``s``.

    Parameters
    ----------
    v : DeviceArray
        ``[total_states, num_heads, head_size]``: every token's states, back to back.
    s : DeviceArray
        Their log-sum-exp, float32 ``[num_heads, total_states]`` (token-major
        buffers as ``lse.T``).
    indptr : DeviceArray
        Int32 or int64 ``[num_tokens + 1]`` on the GPU: non-decreasing offsets
        starting at 0, at most 65,536 rows a token; a token with no rows gets 0
        and ``-inf`` (with sinks: 0 and its sink).
    out : DeviceArray, optional
        As for :func:`merge_states`.
    out_lse : DeviceArray, optional
        As for :func:`merge_states`.
    lse_base : {"e", 2}
        As for :func:`merge_states`.
    out_dtype : str or dtype, optional
        As for :func:`merge_states`.
    check_indptr : bool
        Copy ``indptr`` to the host (on the merge's stream) and check it before
        launching: a synchronisation. Pass False inside CUDA graphs, hot loops,
        ``torch.compile`` and ``jax.jit`` (where it is refused): the kernel then
        writes NaN for any token whose offsets are out of range, never reading
        outside ``v``.
    sinks : DeviceArray, optional
        As for :func:`merge_states`.
    output_scale : DeviceArray, optional
        As for :func:`merge_states`.
    output_block_scale : DeviceArray, optional
        As for :func:`merge_states`.
    quant_group_size : int, optional
        As for :func:`merge_states`.
    scale_ue8m0 : bool
        As for :func:`merge_states`.
    is_sf_swizzled_layout : bool
        As for :func:`merge_states`.
    stream : Stream
        As for :func:`cupy_merge.merge_attn_states`.

    Returns
    -------
    v : DeviceArray
        ``[num_tokens, num_heads, head_size]``.
    s : DeviceArray
        ``[num_heads, num_tokens]``.

    Notes
    -----
    Differentiable as :func:`cupy_merge.merge_state` is (torch autograd, eager
    and compiled; ``jax.grad``), through :func:`cupy_merge.merge_states_varlen_backward`.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.ones((5, 8, 64), dtype=cupy.float16)  # 5 states in all
    >>> s = cupy.zeros((8, 5), dtype=cupy.float32)
    >>> indptr = cupy.array([0, 2, 2, 5], dtype=cupy.int32)  # 3 tokens: 2, 0 and 3 states
    >>> out, lse = cm.merge_states_varlen(v, s, indptr)
    >>> out.shape, float(out[0, 0, 0]), float(out[1, 0, 0]), bool(cupy.isneginf(lse[:, 1]).all())
    ((3, 8, 64), 1.0, 0.0, True)
    """
    options = _options.many_state_options(
        lse_base=lse_base,
        out_dtype=out_dtype,
        check_indptr=check_indptr,
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        is_sf_swizzled_layout=is_sf_swizzled_layout,
    )
    operands = ManyStateOperands(out, out_lse, v, s, indptr, sinks, output_scale, output_block_scale)
    return _dispatch.call(_ops.MERGE_STATES_VARLEN, options, operands, stream)


declare(merge_states, _ops.MERGE_STATES)
declare(merge_states_varlen, _ops.MERGE_STATES_VARLEN)
