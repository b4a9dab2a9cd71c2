"""The two-way merges: vLLM's ``merge_attn_states``, the functional ``merge_state``, FlashInfer's in-place merge.

Shapes, everywhere in this package:

* values ``v``: ``[num_tokens, num_heads, head_size]``, float32, float16 or
  bfloat16, any token and head strides, contiguous last dimension;
* log-sum-exp ``s``: ``[num_heads, num_tokens]``, float32, natural log (or base 2
  with ``lse_base=2``), any strides (a token-major ``[num_tokens, num_heads]``
  buffer is passed as its transpose ``s.T``, no copy);
* attention sinks ``sinks``: float32 ``[num_heads]`` natural-log logits, any stride.
"""

from __future__ import annotations

from typing import Any

from . import _dispatch, _ops, _options
from ._arrays import Stream
from ._operands import TwoStateOperands
from .bound import declare
from .types import Array, LseBase


def merge_attn_states(
    output: Array,
    prefix_output: Array,
    prefix_lse: Array,
    suffix_output: Array,
    suffix_lse: Array,
    output_lse: Array | None = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: Array | None = None,
    output_block_scale: Array | None = None,
    quant_group_size: int | None = None,
    quant_scale_ue8m0: bool = False,
    *,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    sinks: Array | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> None:
    """Merge two attention states into ``output`` (vLLM's ``merge_attn_states``).

    The signature and meaning of vLLM's op, so serving code can swap it in:
    ``output = w_p * prefix_output + w_s * suffix_output`` with weights from the
    two log-sum-exps, written in place; nothing is returned. Under
    ``torch.compile`` it is the registered op ``torch.ops.cupy_merge.merge_attn_states``.

    Parameters
    ----------
    output : DeviceArray
        ``[num_tokens, num_heads, head_size]``, written. Any value dtype (e.g.
        bfloat16 from float32 partials), or FP8 ``float8_e4m3fn`` with a scale
        (CuPy: ``uint8`` holding its bytes). May be the very same array as
        ``prefix_output`` or ``suffix_output``; must not overlap anything else.
        Or NVFP4: ``[num_tokens, num_heads, head_size // 2]`` of torch's
        ``float4_e2m1fn_x2`` (or ``uint8``, as vLLM gives it: two e2m1 values a
        byte, the first in the low nibble), with ``output_scale`` its global scale
        and ``output_block_scale`` its float8_e4m3fn block scales (see
        :doc:`/nvfp4`).
    prefix_output : DeviceArray
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    prefix_lse : DeviceArray
        Log-sum-exp of ``prefix_output``'s scores: float32 ``[num_heads, num_tokens]``,
        any strides (a token-major buffer as its transpose). ``+inf`` is read as
        ``-inf`` (an empty row).
    suffix_output : DeviceArray
        Like ``prefix_output``, of its dtype.
    suffix_lse : DeviceArray
        Like ``prefix_lse``.
    output_lse : DeviceArray, optional
        The merged log-sum-exp, float32 ``[num_heads, num_tokens]``, written; may
        be ``prefix_lse`` or ``suffix_lse`` itself. Not written when None.
    prefill_tokens_with_context : int, optional
        Tokens at or past this index take the suffix unchanged (values and LSE,
        bit for bit; an FP8 output gets the quantised suffix): they had no
        prefix context. None merges every token.
    output_scale : DeviceArray, optional
        An FP8 output's per-tensor scale, vLLM's ``output_scale``: float32, one
        element, on the device; read at each launch (a replayed CUDA graph
        uses the scale of the replay). ``output`` gets
        ``clamp(v / scale, -448, 448)`` rounded to nearest even (NaN stays NaN),
        computed as ``v * (1 / scale)``. It must be positive and finite.
        An NVFP4 output's global scale (``448 * 6 / amax``, multiplied as vLLM's
        ``scaled_fp4_quant`` and FlashInfer's ``fp4_quantize`` take it).
    output_block_scale : DeviceArray, optional
        An FP8 output's per-group scales, written: float32
        ``[num_tokens, num_heads * head_size // quant_group_size]``, any strides.
        A group is ``quant_group_size`` consecutive elements of a token's heads;
        its scale is ``max(max|v|, 1e-10) / 448`` and its elements get
        ``v / scale`` as above. Needs each value array's heads back to back.
        An NVFP4 output's block scales, written: float8_e4m3fn (CuPy: uint8), one
        per 16 values of a token's heads, in the 128 x 4 swizzled layout of the FP4
        GEMMs, ``[ceil(num_tokens / 128) * 128, ceil(num_heads * head_size / 64) * 4]``
        with its padding zeroed, or ``[num_tokens, num_heads * head_size // 16]``
        with ``is_sf_swizzled_layout=False``.
    quant_group_size : int, optional
        Elements per group scale, a divisor of ``head_size`` (128 is common);
        required with ``output_block_scale``.
    quant_scale_ue8m0 : bool
        The name vLLM gives ``scale_ue8m0``, in vLLM's position.
    scale_ue8m0 : bool
        Round each group scale up to a power of two (UE8M0, as DeepGEMM reads them).
    is_sf_swizzled_layout : bool
        NVFP4 block scales in the swizzled layout (True, FlashInfer's and vLLM's
        default) or row-major (False).
    sinks : DeviceArray, optional
        Attention sinks, float32 ``[num_heads]``: each head's logit counted once in
        the denominator, ``lse = log(exp(s_p) + exp(s_s) + exp(sink))``; the output
        LSE includes it (do not merge the result again with the sinks). Tokens past
        ``prefill_tokens_with_context`` take the suffix merged with the sink alone.
    lse_base : {"e", 2}
        Base of every LSE in and out: natural log (vLLM) or base 2 (FlashInfer).
        Sinks are natural-log logits either way.
    stream : Stream
        Where to launch: torch's current stream for torch tensors, CuPy's
        current stream otherwise, unless given (it must be of the arrays' device).

    Returns
    -------
    None
        The result is in ``output`` (and ``output_lse``).

    Raises
    ------
    TypeError
        An argument of the wrong kind or dtype; the message names it.
    ValueError
        A wrong shape, device, stride, alignment or overlap; the message names it.
    RuntimeError
        A torch input requires grad in grad mode: this form writes into its
        arguments, so autograd cannot differentiate it (use :func:`merge_state`).

    See Also
    --------
    merge_state : The same merge, returning new arrays when no output is given.
    bind : Check and plan once, relaunch for the price of a kernel launch.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.random.standard_normal((4, 8, 128), dtype=cupy.float32).astype(cupy.float16)
    >>> s = cupy.zeros((8, 4), dtype=cupy.float32)
    >>> out = cupy.empty_like(v)
    >>> cm.merge_attn_states(out, v, s, v, s)  # a state merged with itself is itself
    >>> bool(cupy.allclose(out, v, atol=1e-3))
    True
    """
    options = _options.two_state_options(
        lse_base=lse_base,
        prefill_tokens_with_context=prefill_tokens_with_context,
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        quant_scale_ue8m0=quant_scale_ue8m0,
        is_sf_swizzled_layout=is_sf_swizzled_layout,
    )
    operands = TwoStateOperands(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, None,
                                sinks, output_scale, output_block_scale)  # fmt: skip
    return _dispatch.call(_ops.MERGE_ATTN_STATES, options, operands, stream)


def merge_state(
    v_a: Array,
    s_a: Array,
    v_b: Array,
    s_b: Array,
    *,
    out: Array | None = None,
    out_lse: Array | None = None,
    out_dtype: Any = None,
    sinks: Array | None = None,
    output_scale: Array | None = None,
    output_block_scale: Array | None = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> tuple[Array, Array]:
    """Merge two attention states and return the merged ``(v, s)``.

    FlashInfer's ``merge_state`` semantics (in cupy-merge's layout: LSE
    ``[num_heads, num_tokens]``, natural log by default; ``cupy_merge.compat.flashinfer``
    has FlashInfer's own) with NumPy-style ``out=`` arguments: outputs not given
    are allocated (C-contiguous, on the stream that writes them). Works on JAX
    arrays, inside ``jax.jit`` too, and under ``torch.compile``.

    Parameters
    ----------
    v_a : DeviceArray
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s_a : DeviceArray
        Log-sum-exp of ``v_a``'s scores, float32 ``[num_heads, num_tokens]``.
    v_b : DeviceArray
        Like ``v_a``, of its dtype.
    s_b : DeviceArray
        Like ``s_a``.
    out : DeviceArray, optional
        ``[num_tokens, num_heads, head_size]`` to write the merged values into;
        allocated if omitted. May be ``v_a`` or ``v_b`` itself (in place).
    out_lse : DeviceArray, optional
        Where to write the merged LSE, float32 ``[num_heads, num_tokens]``;
        allocated if omitted; may be ``s_a`` or ``s_b``.
    out_dtype : str or dtype, optional
        Dtype of an allocated ``out`` (``"bfloat16"``, ``torch.float16``,
        ``"float8_e4m3fn"``, ``"nvfp4"``, ...); the input dtype by default. Must
        match ``out`` when both are given.
    sinks : DeviceArray, optional
        Attention sinks, float32 ``[num_heads]``, as for :func:`merge_attn_states`.
    output_scale : DeviceArray, optional
        An FP8 output's per-tensor scale or an NVFP4 output's global scale, as for
        :func:`merge_attn_states`.
    output_block_scale : DeviceArray, optional
        An FP8 output's per-group scales or an NVFP4 output's block scales,
        written; as for :func:`merge_attn_states`.
    quant_group_size : int, optional
        As for :func:`merge_attn_states`.
    scale_ue8m0 : bool
        As for :func:`merge_attn_states`.
    is_sf_swizzled_layout : bool
        As for :func:`merge_attn_states`.
    lse_base : {"e", 2}
        Base of every LSE in and out.
    stream : Stream
        As for :func:`merge_attn_states`.

    Returns
    -------
    v : DeviceArray
        The merged values, ``[num_tokens, num_heads, head_size]``.
    s : DeviceArray
        The merged log-sum-exp, ``[num_heads, num_tokens]``. Both in the caller's
        kind: CuPy for CuPy, torch for torch, JAX for JAX, CuPy for other producers.

    See Also
    --------
    merge_states : Any number of states in one pass.

    Notes
    -----
    Differentiable: torch tensors that require grad (``nn.Parameter`` too) get
    gradients through autograd, eagerly and under ``torch.compile``; JAX arrays
    through ``jax.grad`` and ``jax.vjp`` (the backward is
    :func:`cupy_merge.merge_state_backward`). A merge into given ``out=`` tensors,
    or to FP8, raises ``RuntimeError`` when an input requires grad in grad mode;
    inside a ``torch.func`` transform it raises ``TypeError``.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v_a = cupy.ones((16, 32, 128), dtype=cupy.float32)
    >>> v_b = 3 * v_a
    >>> s_a = s_b = cupy.zeros((32, 16), dtype=cupy.float32)  # equal weights
    >>> v, s = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype="float16")
    >>> v.dtype, float(v[0, 0, 0]), round(float(s[0, 0]), 4)
    (dtype('float16'), 2.0, 0.6931)
    """
    options = _options.two_state_options(
        lse_base=lse_base,
        out_dtype=out_dtype,
        output_block_scale=output_block_scale,
        quant_group_size=quant_group_size,
        scale_ue8m0=scale_ue8m0,
        is_sf_swizzled_layout=is_sf_swizzled_layout,
    )
    operands = TwoStateOperands(out, out_lse, v_a, s_a, v_b, s_b, None, sinks, output_scale, output_block_scale)
    return _dispatch.call(_ops.MERGE_STATE, options, operands, stream)


def merge_state_in_place(
    v: Array,
    s: Array,
    v_other: Array,
    s_other: Array,
    mask: Array | None = None,
    *,
    sinks: Array | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (FlashInfer's ``merge_state_in_place``).

    Parameters
    ----------
    v : DeviceArray
        ``[num_tokens, num_heads, head_size]``, updated in place.
    s : DeviceArray
        Its log-sum-exp, float32 ``[num_heads, num_tokens]``, updated in place.
    v_other : DeviceArray
        Like ``v``, of its dtype.
    s_other : DeviceArray
        Like ``s``.
    mask : DeviceArray, optional
        Bool ``[num_tokens]``: tokens where it is False are left untouched
        (nothing read or written), so one captured CUDA graph serves batches
        where only some tokens have a second state.
    sinks : DeviceArray, optional
        Attention sinks, float32 ``[num_heads]``, as for :func:`merge_attn_states`
        (counted in this merge: merging into ``(v, s)`` again with sinks counts them again).
    lse_base : {"e", 2}
        Base of every LSE in and out.
    stream : Stream
        As for :func:`merge_attn_states`.

    Returns
    -------
    None
        The result is in ``v`` and ``s``.

    Notes
    -----
    Writes into its arguments, so not differentiable: a torch input that
    requires grad raises ``RuntimeError`` in grad mode (under ``torch.no_grad()``
    it runs). :func:`cupy_merge.jax.merge_state_in_place` returns new arrays and
    is differentiable.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v, w = cupy.ones((2, 3, 8, 64), dtype=cupy.float32)
    >>> s, t = cupy.zeros((2, 8, 3), dtype=cupy.float32)
    >>> cm.merge_state_in_place(v, s, 3 * w, t, mask=cupy.array([True, False, True]))
    >>> float(v[0, 0, 0]), float(v[1, 0, 0])
    (2.0, 1.0)
    """
    options = _options.two_state_options(lse_base=lse_base)
    operands = TwoStateOperands(v, s, v, s, v_other, s_other, mask, sinks, None, None)
    return _dispatch.call(_ops.MERGE_STATE_IN_PLACE, options, operands, stream)


declare(merge_attn_states, _ops.MERGE_ATTN_STATES)
declare(merge_state, _ops.MERGE_STATE)
declare(merge_state_in_place, _ops.MERGE_STATE_IN_PLACE)
