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
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any | None = None,
    prefill_tokens_with_context: int | None = None,
    *,
    lse_base: Any = "e",
    stream: Any = None,
) -> None:
    """Merge two attention states into ``output`` (vLLM's ``merge_attn_states``).

    Parameters
    ----------
    output : ``[num_tokens, num_heads, head_size]``, written
        Any value dtype (e.g. bfloat16 from float32 partials). May be the very
        same array as ``prefix_output`` or ``suffix_output``.
    prefix_output, suffix_output : ``[num_tokens, num_heads, head_size]``
        The two partial attention outputs, of one dtype.
    prefix_lse, suffix_lse : float32 ``[num_heads, num_tokens]``
        Their log-sum-exp. ``+inf`` is read as ``-inf`` (an empty row).
    output_lse : float32 ``[num_heads, num_tokens]``, optional, written
        The merged log-sum-exp; may be ``prefix_lse`` or ``suffix_lse`` itself.
    prefill_tokens_with_context : int, optional
        Tokens at or past this index take the suffix unchanged (values and LSE):
        they had no prefix context. ``None`` merges every token.
    lse_base : ``"e"`` or ``2``
        Base of every LSE in and out: natural log (vLLM) or base 2 (FlashInfer).
    stream : optional
        CUDA stream to launch on; defaults to torch's current stream for torch
        tensors and CuPy's current stream otherwise.

    Example
    -------
    >>> import cupy, cupy_merge as cm
    >>> v = cupy.random.randn(4, 8, 128).astype(cupy.float16)
    >>> s = cupy.random.randn(8, 4).astype(cupy.float32)
    >>> out = cupy.empty_like(v)
    >>> cm.merge_attn_states(out, v, s, v, s)
    >>> bool(cupy.allclose(out, v, atol=1e-3))
    True
    """
    options = TwoStateOptions(
        _checks.lse_base_flag(lse_base), _checks.token_count(prefill_tokens_with_context)
    )
    arrays = (output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, None)
    return _dispatch.call(_MERGE_ATTN_STATES, options, arrays, stream)


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out: Any | None = None,
    out_lse: Any | None = None,
    out_dtype: Any = None,
    lse_base: Any = "e",
    stream: Any = None,
) -> tuple[Any, Any]:
    """Merge two attention states and return the merged ``(v, s)``.

    Parameters
    ----------
    v_a, v_b : ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16
    s_a, s_b : float32 ``[num_heads, num_tokens]``
    out : ``[num_tokens, num_heads, head_size]``, optional
        Where to write the merged values; allocated (C-contiguous) if omitted.
        May be ``v_a`` or ``v_b`` itself for an in-place merge.
    out_lse : float32 ``[num_heads, num_tokens]``, optional
        Where to write the merged LSE; allocated if omitted; may be ``s_a`` or ``s_b``.
    out_dtype : optional
        Dtype of an allocated ``out`` (``"bfloat16"``, ``torch.float16``, ...);
        defaults to the input dtype. Must match ``out`` when both are given.
    lse_base : ``"e"`` or ``2``
        Base of every LSE in and out.
    stream : optional
        As for :func:`merge_attn_states`.

    Returns
    -------
    (v, s)
        In the caller's kind: CuPy arrays for CuPy input, torch tensors for
        torch input, JAX arrays for JAX input, CuPy arrays for other DLPack or
        ``__cuda_array_interface__`` producers.

    Example
    -------
    >>> import torch, cupy_merge as cm
    >>> v_a, v_b = torch.randn(2, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
    >>> s_a, s_b = torch.randn(2, 32, 16, device="cuda")
    >>> v, s = cm.merge_state(v_a, s_a, v_b, s_b)
    >>> v.shape, s.shape
    (torch.Size([16, 32, 128]), torch.Size([32, 16]))
    """
    options = TwoStateOptions(_checks.lse_base_flag(lse_base), None, _checks.optional_value_dtype(out_dtype))
    return _dispatch.call(_MERGE_STATE, options, (out, out_lse, v_a, s_a, v_b, s_b, None), stream)


def merge_state_in_place(
    v: Any,
    s: Any,
    v_other: Any,
    s_other: Any,
    mask: Any | None = None,
    *,
    lse_base: Any = "e",
    stream: Any = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (FlashInfer's ``merge_state_in_place``).

    Parameters
    ----------
    v, v_other : ``[num_tokens, num_heads, head_size]``, one value dtype; ``v`` is updated
    s, s_other : float32 ``[num_heads, num_tokens]``; ``s`` is updated
    mask : bool ``[num_tokens]``, optional
        Tokens where it is False are left untouched (nothing read or written), so
        one captured CUDA graph serves batches where only some tokens have a
        second state.
    lse_base, stream :
        As for :func:`merge_attn_states`.

    Example
    -------
    >>> import cupy, cupy_merge as cm
    >>> v, w = cupy.ones((2, 3, 8, 64), dtype=cupy.float32)
    >>> s, t = cupy.zeros((2, 8, 3), dtype=cupy.float32)
    >>> cm.merge_state_in_place(v, s, 3 * w, t, mask=cupy.array([True, False, True]))
    >>> float(v[0, 0, 0]), float(v[1, 0, 0])
    (2.0, 1.0)
    """
    options = TwoStateOptions(_checks.lse_base_flag(lse_base))
    return _dispatch.call(_MERGE_STATE_IN_PLACE, options, (v, s, v, s, v_other, s_other, mask), stream)
