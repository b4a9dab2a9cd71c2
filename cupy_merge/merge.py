"""The two-way merges: vLLM's ``merge_attn_states``, the functional ``merge_state``, FlashInfer's in-place merge.

Shapes, everywhere in this package:

* values ``v``: ``[num_tokens, num_heads, head_size]``, float32, float16 or
  bfloat16, any token and head strides, contiguous last dimension;
* log-sum-exp ``s``: ``[num_heads, num_tokens]``, float32, natural log (or base 2
  with ``lse_base=2``), any strides (a token-major ``[num_tokens, num_heads]``
  buffer is passed as its transpose ``s.T``, no copy).
"""

from __future__ import annotations

from typing import Any

from . import _checks, _dispatch
from ._arrays import DeviceArray, Stream
from ._plan import TwoStateOptions

_MERGE_ATTN_STATES = _dispatch.Operation.two_states(
    "merge_attn_states",
    _checks.TwoStateNames(
        "output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse"
    ),
    allocates=False,
    returns=False,
)
_MERGE_STATE = _dispatch.Operation.two_states(
    "merge_state",
    _checks.TwoStateNames("out", "out_lse", "v_a", "s_a", "v_b", "s_b"),
    allocates=True,
    returns=True,
)
_MERGE_STATE_IN_PLACE = _dispatch.Operation.two_states(
    "merge_state_in_place",
    _checks.TwoStateNames("v", "s", "v", "s", "v_other", "s_other", "mask"),
    allocates=False,
    returns=False,
)


def merge_attn_states(
    output: DeviceArray,
    prefix_output: DeviceArray,
    prefix_lse: DeviceArray,
    suffix_output: DeviceArray,
    suffix_lse: DeviceArray,
    output_lse: DeviceArray | None = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: DeviceArray | None = None,
    *,
    output_block_scale: DeviceArray | None = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    lse_base: str | int = "e",
    stream: Stream = None,
) -> None:
    """Merge two attention states into ``output`` (vLLM's ``merge_attn_states``).

    The signature and meaning of vLLM's op, so serving code can swap it in:
    ``output = w_p * prefix_output + w_s * suffix_output`` with weights from the
    two log-sum-exps, written in place; nothing is returned.

    Parameters
    ----------
    output : DeviceArray
        ``[num_tokens, num_heads, head_size]``, written. Any value dtype (e.g.
        bfloat16 from float32 partials), or FP8 ``float8_e4m3fn`` with a scale
        (CuPy: ``uint8`` holding its bytes). May be the very same array as
        ``prefix_output`` or ``suffix_output``; must not overlap anything else.
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
    output_block_scale : DeviceArray, optional
        An FP8 output's per-group scales, written: float32
        ``[num_tokens, num_heads * head_size // quant_group_size]``, any strides.
        A group is ``quant_group_size`` consecutive elements of a token's heads;
        its scale is ``max(max|v|, 1e-10) / 448`` and its elements get
        ``v / scale`` as above. Needs each value array's heads back to back.
    quant_group_size : int, optional
        Elements per group scale, a divisor of ``head_size`` (128 is common);
        required with ``output_block_scale``.
    scale_ue8m0 : bool
        Round each group scale up to a power of two (UE8M0, as DeepGEMM reads them).
    lse_base : {"e", 2}
        Base of every LSE in and out: natural log (vLLM) or base 2 (FlashInfer).
    stream : Stream
        Where to launch: torch's current stream for torch tensors, CuPy's
        current stream otherwise, unless given.

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
    options = TwoStateOptions(
        _checks.lse_base_flag(lse_base),
        _checks.token_count(prefill_tokens_with_context),
        None,
        *_checks.quant_group(quant_group_size, output_block_scale, scale_ue8m0),
    )
    arrays = (output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, None,
              output_scale, output_block_scale)  # fmt: skip
    return _dispatch.call(_MERGE_ATTN_STATES, options, arrays, stream)


def merge_state(
    v_a: DeviceArray,
    s_a: DeviceArray,
    v_b: DeviceArray,
    s_b: DeviceArray,
    *,
    out: DeviceArray | None = None,
    out_lse: DeviceArray | None = None,
    out_dtype: Any = None,
    output_scale: DeviceArray | None = None,
    output_block_scale: DeviceArray | None = None,
    quant_group_size: int | None = None,
    scale_ue8m0: bool = False,
    lse_base: str | int = "e",
    stream: Stream = None,
) -> tuple[DeviceArray, DeviceArray]:
    """Merge two attention states and return the merged ``(v, s)``.

    FlashInfer's ``merge_state`` with NumPy-style ``out=`` arguments: outputs not
    given are allocated (C-contiguous, on the stream that writes them).

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
        ``"float8_e4m3fn"``, ...); the input dtype by default. Must match ``out``
        when both are given.
    output_scale : DeviceArray, optional
        An FP8 output's per-tensor scale, as for :func:`merge_attn_states`.
    output_block_scale : DeviceArray, optional
        An FP8 output's per-group scales, written; as for :func:`merge_attn_states`.
    quant_group_size : int, optional
        As for :func:`merge_attn_states`.
    scale_ue8m0 : bool
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
    options = TwoStateOptions(
        _checks.lse_base_flag(lse_base),
        None,
        _checks.optional_value_dtype(out_dtype),
        *_checks.quant_group(quant_group_size, output_block_scale, scale_ue8m0),
    )
    arrays = (out, out_lse, v_a, s_a, v_b, s_b, None, output_scale, output_block_scale)
    return _dispatch.call(_MERGE_STATE, options, arrays, stream)


def merge_state_in_place(
    v: DeviceArray,
    s: DeviceArray,
    v_other: DeviceArray,
    s_other: DeviceArray,
    mask: DeviceArray | None = None,
    *,
    lse_base: str | int = "e",
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
    lse_base : {"e", 2}
        Base of every LSE in and out.
    stream : Stream
        As for :func:`merge_attn_states`.

    Returns
    -------
    None
        The result is in ``v`` and ``s``.

    Examples
    --------
    >>> import cupy, cupy_merge as cm
    >>> v, w = cupy.ones((2, 3, 8, 64), dtype=cupy.float32)
    >>> s, t = cupy.zeros((2, 8, 3), dtype=cupy.float32)
    >>> cm.merge_state_in_place(v, s, 3 * w, t, mask=cupy.array([True, False, True]))
    >>> float(v[0, 0, 0]), float(v[1, 0, 0])
    (2.0, 1.0)
    """
    options = TwoStateOptions(_checks.lse_base_flag(lse_base))
    arrays = (v, s, v, s, v_other, s_other, mask, None, None)
    return _dispatch.call(_MERGE_STATE_IN_PLACE, options, arrays, stream)
