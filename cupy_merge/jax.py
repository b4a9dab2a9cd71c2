"""Merges of JAX arrays: under ``jax.jit`` and ``vmap``, inside XLA's CUDA graphs, and eagerly.

Every merge here is one ``jax.experimental.buffer_callback`` (JAX 0.6.1 or newer)
marked ``command_buffer_compatible``: XLA hands the callback its own device buffers
and CUDA stream, and the callback launches cupy-merge's NVRTC kernel there. All the
work that is not a launch happens once, when JAX traces the call: the shape rules
(with the errors of ``cupy_merge``'s eager merges), the launch plan, NVRTC compilation
and module loading, for every local CUDA device. The callback itself reads the
buffers' addresses, patches them into the prepared launch and launches it on
``ctx.stream``: it allocates nothing, never synchronises and reads no device data, so
XLA may record it into a CUDA graph and replay it without Python.

The functions mirror cupy-merge's public merges, functionally (JAX arrays are
immutable): :func:`merge_state`, :func:`merge_states`, :func:`merge_states_varlen`,
:func:`merge_attn_states` and :func:`merge_state_in_place` return new arrays. The same
merges called as ``cupy_merge.merge_state(...)`` etc. on JAX arrays or tracers take the
same path. Eager calls run a cached ``jax.jit`` of the same function (one trace per
shapes, dtypes and options). ``vmap`` folds leading batch axes into the token axis
where the layout allows it (one launch), and maps over the batch otherwise.

``jax.grad`` and ``jax.value_and_grad`` differentiate the merges (a ``jax.custom_vjp``
around the batched merge): the backward is cupy-merge's backward kernel, planned and
compiled when JAX traces it and launched like the merges, from the merge's inputs (an N-way
or ragged merge's results too, which few rows of many states read instead of recomputing
the weights). Its ``vmap`` folds batches as the merge does.

Importing this module does not import JAX: it registers the JAX path of
``cupy_merge``'s merges and loads JAX on first use.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> import cupy_merge.jax as cmj
>>> v = jnp.ones((4, 8, 128), jnp.bfloat16)
>>> s = jnp.zeros((8, 4), jnp.float32)
>>> merged, lse = jax.jit(cmj.merge_state)(v, s, 3 * v, s)  # doctest: +SKIP
>>> float(merged[0, 0, 0]), round(float(lse[0, 0]), 4)  # doctest: +SKIP
(2.0, 0.6931)
"""

from __future__ import annotations

from typing import Any

from ._jax_entry import _clear_caches, _jax_call, _merge  # noqa: F401 - the dispatcher's JAX path, and a reset for tests
from ._jax_launch import JAX_HINT, HostCall  # noqa: F401 - what a CPU stand-in of the kernels receives
from ._ops import MERGE_ATTN_STATES, MERGE_STATE, MERGE_STATE_IN_PLACE, MERGE_STATES, MERGE_STATES_VARLEN

__all__ = [
    "merge_attn_states",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_varlen",
]


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out_dtype: Any = None,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    lse_base: Any = "e",
) -> tuple:
    """Merge two attention states of JAX arrays and return the merged ``(v, s)``.

    :func:`cupy_merge.merge_state` as a JAX function: under ``jax.jit``, ``vmap`` (batches
    folded into the tokens: one launch) and eagerly (a cached jitted call). The kernel runs
    on XLA's stream, ordered with the computation around it, and inside XLA's CUDA graphs.

    Parameters
    ----------
    v_a : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s_a : jax.Array
        Log-sum-exp of ``v_a``'s scores, float32 ``[num_heads, num_tokens]``. ``+inf`` is
        read as ``-inf`` (an empty row).
    v_b : jax.Array
        Like ``v_a``, of its dtype.
    s_b : jax.Array
        Like ``s_a``.
    out_dtype : str or dtype, optional
        Dtype of the merged values: float32, float16, bfloat16, ``"float8_e4m3fn"``
        (``jnp.float8_e4m3fn``, with a scale) or ``"nvfp4"`` (e2m1 values two a byte, as
        uint8 ``[num_tokens, num_heads, head_size // 2]``, with ``output_scale`` the global
        scale; the block scales come back as a third result, uint8 bytes of float8_e4m3fn);
        the input dtype by default.
    sinks : jax.Array, optional
        Attention sinks, float32 ``[num_heads]`` natural-log logits, each counted once in
        its head's denominator (the output LSE includes it).
    output_scale : jax.Array, optional
        An FP8 output's per-tensor scale: float32, one element (a Python float works too),
        read on the device at each run. Values are ``clamp(v / scale, -448, 448)``.
    output_block_scale : jax.Array, optional
        With ``quant_group_size``: a float32 ``[num_tokens, num_heads * head_size //
        quant_group_size]`` buffer the group scales are returned in (aliased to the third
        result: donate it to the enclosing ``jax.jit`` to have the merge write into its
        memory). Leave it out to have the scales allocated.
    quant_group_size : int, optional
        FP8 group scales: each ``quant_group_size`` consecutive elements of a token's heads
        (a divisor of ``head_size``) get the scale ``max(max|v|, 1e-10) / 448``, returned as a
        third result.
    scale_ue8m0 : bool
        Round each group scale up to a power of two.
    is_sf_swizzled_layout : bool
        NVFP4 block scales in the FP4 GEMMs' 128 x 4 swizzled layout (True) or row-major.
    lse_base : {"e", 2}
        Base of every LSE in and out.

    Returns
    -------
    v : jax.Array
        The merged values, ``[num_tokens, num_heads, head_size]`` of ``out_dtype``
        (``jnp.float8_e4m3fn`` for FP8).
    s : jax.Array
        The merged LSE, float32 ``[num_heads, num_tokens]``.
    scales : jax.Array
        Only with ``quant_group_size``: float32 ``[num_tokens, num_heads * head_size //
        quant_group_size]``, the scale of each group (``v * scale`` dequantises). With
        ``out_dtype="nvfp4"``: the block scales' float8_e4m3fn bytes as uint8, swizzled (or
        row-major with ``is_sf_swizzled_layout=False``; see :func:`cupy_merge.merge_attn_states`).

    Raises
    ------
    TypeError, ValueError
        A bad argument, when the call is traced, with the messages of the eager merges.
    RuntimeError
        JAX has no CUDA device.

    Notes
    -----
    Differentiable in reverse mode (``jax.grad``, ``jax.value_and_grad``, ``jax.vjp``, under
    ``jit`` and ``vmap``) with respect to ``v_a``, ``s_a``, ``v_b``, ``s_b`` and ``sinks``: the
    backward kernel (:func:`cupy_merge.merge_state_backward`) runs on XLA's stream, from the
    inputs alone. An FP8 output is not differentiable (``TypeError`` when differentiated);
    ``jax.jvp`` is refused by JAX (a ``custom_vjp``).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v_a = jnp.ones((16, 8, 128), jnp.bfloat16)
    >>> s_a = s_b = jnp.zeros((8, 16), jnp.float32)
    >>> v, s = jax.jit(cmj.merge_state)(v_a, s_a, 3 * v_a, s_b)  # doctest: +SKIP
    >>> float(v[0, 0, 0]), round(float(s[0, 0]), 4)  # doctest: +SKIP
    (2.0, 0.6931)
    >>> v8, s, scales = cmj.merge_state(v_a, s_a, v_a, s_b, out_dtype="float8_e4m3fn",
    ...                                 quant_group_size=128)  # doctest: +SKIP
    >>> v8.dtype, scales.shape  # doctest: +SKIP
    (dtype(float8_e4m3fn), (16, 8))
    """
    return _merge(MERGE_STATE, locals())


def merge_attn_states(
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    prefill_tokens_with_context: int | None = None,
    output_scale: Any = None,
    *,
    out_dtype: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    quant_scale_ue8m0: bool = False,
    sinks: Any = None,
    lse_base: Any = "e",
) -> tuple:
    """vLLM's ``merge_attn_states`` as a JAX function: returns ``(output, output_lse)``.

    vLLM's op writes into ``output``; JAX arrays are immutable, so this one returns it
    (``output_lse`` too). Tokens at or past ``prefill_tokens_with_context`` take the suffix
    unchanged.

    Parameters
    ----------
    prefix_output : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    prefix_lse : jax.Array
        Float32 ``[num_heads, num_tokens]``.
    suffix_output : jax.Array
        Like ``prefix_output``, of its dtype.
    suffix_lse : jax.Array
        Like ``prefix_lse``.
    prefill_tokens_with_context : int, optional
        A Python int (static): tokens at or past it take the suffix (values and LSE, bit
        for bit; with sinks, the suffix merged with the sink). None merges every token.
    output_scale : jax.Array, optional
        An FP8 output's per-tensor scale, as for :func:`merge_state`.
    out_dtype : str or dtype, optional
        The output's dtype, as for :func:`merge_state` (vLLM gives it by ``output``).
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`: the group scales come back as a third result.
    scale_ue8m0 : bool
        As for :func:`merge_state`.
    is_sf_swizzled_layout : bool
        As for :func:`merge_state`.
    quant_scale_ue8m0 : bool
        vLLM's name for ``scale_ue8m0``.
    sinks : jax.Array, optional
        As for :func:`merge_state`.
    lse_base : {"e", 2}
        As for :func:`merge_state`.

    Returns
    -------
    output : jax.Array
        ``[num_tokens, num_heads, head_size]``.
    output_lse : jax.Array
        ``[num_heads, num_tokens]``.
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable as :func:`merge_state`; past ``prefill_tokens_with_context`` the suffix's
    gradients are those of what the token took (the suffix itself, or its merge with the sink).

    Examples
    --------
    >>> import jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((4, 8, 128), jnp.float16)
    >>> s = jnp.zeros((8, 4), jnp.float32)
    >>> out, lse = cmj.merge_attn_states(v, s, 3 * v, s, prefill_tokens_with_context=2)  # doctest: +SKIP
    >>> float(out[0, 0, 0]), float(out[3, 0, 0])  # doctest: +SKIP
    (2.0, 3.0)
    """
    return _merge(MERGE_ATTN_STATES, locals())


def merge_state_in_place(
    v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None, *, sinks: Any = None, lse_base: Any = "e"
) -> tuple:
    """FlashInfer's ``merge_state_in_place`` as a JAX function: returns the updated ``(v, s)``.

    With a ``mask``, tokens where it is False keep ``v`` and ``s`` unchanged: the results
    alias ``v`` and ``s`` (``input_output_aliases``), so the kernel writes only the masked
    tokens. XLA copies ``v`` and ``s`` first unless they are donated (``jax.jit(...,
    donate_argnums=...)`` around the caller), in which case the merge updates their
    memory. Without a mask every token is merged into new arrays (no copy).

    Parameters
    ----------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s : jax.Array
        Its LSE, float32 ``[num_heads, num_tokens]``.
    v_other : jax.Array
        Like ``v``, of its dtype.
    s_other : jax.Array
        Like ``s``.
    mask : jax.Array, optional
        Bool ``[num_tokens]``: True merges the token, False leaves it as it is.
    sinks : jax.Array, optional
        Attention sinks, float32 ``[num_heads]`` (counted in this merge).
    lse_base : {"e", 2}
        Base of every LSE in and out.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``, the dtype of ``v``.
    s : jax.Array
        ``[num_heads, num_tokens]``.

    Notes
    -----
    Differentiable as :func:`merge_state` with respect to ``v``, ``s``, ``v_other``, ``s_other``
    and ``sinks``: where the mask is False, ``v`` and ``s`` pass their gradients through and
    ``v_other``'s and ``s_other``'s are zero, whatever those tokens hold.

    Examples
    --------
    >>> import jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((3, 8, 64), jnp.float32)
    >>> s = jnp.zeros((8, 3), jnp.float32)
    >>> v, s = cmj.merge_state_in_place(v, s, 3 * v, s, jnp.array([True, False, True]))  # doctest: +SKIP
    >>> float(v[0, 0, 0]), float(v[1, 0, 0])  # doctest: +SKIP
    (2.0, 1.0)
    """
    return _merge(MERGE_STATE_IN_PLACE, locals(), in_place=mask is not None)


def merge_states(
    v: Any,
    s: Any,
    *,
    lse_base: Any = "e",
    out_dtype: Any = None,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
) -> tuple:
    """Merge ``num_states`` attention states of the same tokens in one pass (JAX arrays).

    Parameters
    ----------
    v : jax.Array
        ``[num_states, num_tokens, num_heads, head_size]``, float32, float16 or bfloat16.
    s : jax.Array
        Float32 ``[num_states, num_heads, num_tokens]``.
    lse_base : {"e", 2}
        Base of the LSE in and out.
    out_dtype : str or dtype, optional
        As for :func:`merge_state`.
    sinks : jax.Array, optional
        As for :func:`merge_state`; no states at all then give 0 and LSE ``sink``.
    output_scale : jax.Array, optional
        As for :func:`merge_state`.
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`.
    scale_ue8m0 : bool
        As for :func:`merge_state`.
    is_sf_swizzled_layout : bool
        As for :func:`merge_state`.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``; 0 for a token whose states are all empty.
    s : jax.Array
        ``[num_heads, num_tokens]``; ``-inf`` for such a token.
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable with respect to ``v``, ``s`` and ``sinks``, as :func:`merge_state`
    (:func:`cupy_merge.merge_states_backward`).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((16, 4, 8, 128), jnp.float32)  # 16 splits of 4 tokens
    >>> s = jnp.zeros((16, 8, 4), jnp.float32)
    >>> out, lse = jax.jit(cmj.merge_states)(v, s)  # doctest: +SKIP
    >>> out.shape, round(float(lse[0, 0]), 4)  # doctest: +SKIP
    ((4, 8, 128), 2.7726)
    """
    return _merge(MERGE_STATES, locals())


def merge_states_varlen(
    v: Any,
    s: Any,
    indptr: Any,
    *,
    lse_base: Any = "e",
    out_dtype: Any = None,
    check_indptr: bool = True,
    sinks: Any = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
) -> tuple:
    """Merge a ragged batch: token ``t`` owns rows ``indptr[t]:indptr[t + 1]`` (JAX arrays).

    The number of tokens comes from ``indptr``'s shape (static); its values are read by the
    kernel on the device.

    Parameters
    ----------
    v : jax.Array
        ``[total_states, num_heads, head_size]``.
    s : jax.Array
        Float32 ``[num_heads, total_states]``.
    indptr : jax.Array
        Int32 or int64 ``[num_tokens + 1]``: non-decreasing offsets from 0.
    lse_base : {"e", 2}
        As for :func:`merge_states`.
    out_dtype : str or dtype, optional
        As for :func:`merge_state`.
    check_indptr : bool
        Eager calls copy ``indptr`` to the host and check it before launching (one
        synchronisation). Under ``jax.jit`` (and ``vmap``) its values do not exist yet, so
        True is refused with ``ValueError``: pass False, and tokens whose offsets are out of
        range come out NaN (nothing outside ``v`` is ever read).
    sinks : jax.Array, optional
        As for :func:`merge_state`.
    output_scale : jax.Array, optional
        As for :func:`merge_state`.
    output_block_scale : jax.Array, optional
        As for :func:`merge_state`.
    quant_group_size : int, optional
        As for :func:`merge_state`.
    scale_ue8m0 : bool
        As for :func:`merge_state`.
    is_sf_swizzled_layout : bool
        As for :func:`merge_state`.

    Returns
    -------
    v : jax.Array
        ``[num_tokens, num_heads, head_size]``; 0 for a token with no rows.
    s : jax.Array
        ``[num_heads, num_tokens]``; ``-inf`` for such a token (its sink with sinks).
    scales : jax.Array
        Only with ``quant_group_size``, as for :func:`merge_state`.

    Notes
    -----
    Differentiable with respect to ``v``, ``s`` and ``sinks``
    (:func:`cupy_merge.merge_states_varlen_backward`); ``indptr``'s gradient is zero (``float0``
    with ``allow_int=True``). Rows no token owns get zero gradients; so do the rows of a token
    whose offsets are out of range. The gradients, like the backward kernel's, assume
    non-decreasing offsets.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_merge.jax as cmj
    >>> v = jnp.ones((5, 8, 64), jnp.float16)
    >>> s = jnp.zeros((8, 5), jnp.float32)
    >>> indptr = jnp.array([0, 2, 2, 5], jnp.int32)
    >>> merge = jax.jit(lambda v, s, i: cmj.merge_states_varlen(v, s, i, check_indptr=False))
    >>> out, lse = merge(v, s, indptr)  # doctest: +SKIP
    >>> float(out[0, 0, 0]), float(out[1, 0, 0]), bool(jnp.isneginf(lse[:, 1]).all())  # doctest: +SKIP
    (1.0, 0.0, True)
    """
    return _merge(MERGE_STATES_VARLEN, locals())
