"""The two-way merges: vLLM's ``merge_attn_states``, the functional ``merge_state``, FlashInfer's in-place merge.

Shapes, everywhere in this package:

* values ``v``: ``[num_tokens, num_heads, head_size]``, float32, float16 or
  bfloat16, any token and head strides, contiguous last dimension;
* log-sum-exp ``s``: ``[num_heads, num_tokens]``, float32, natural log (or base 2
  with ``lse_base=2``), any strides (a token-major ``[num_tokens, num_heads]``
  buffer is passed as its transpose ``s.T``, no copy).
"""

from __future__ import annotations

import operator
from typing import Any

from . import _arrays, _conventions, _dispatch, _plan

_MERGE_ATTN_STATES_NAMES = _plan.TwoStateNames(
    "output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse"
)
_MERGE_STATE_NAMES = _plan.TwoStateNames("out", "out_lse", "v_a", "s_a", "v_b", "s_b")
_IN_PLACE_NAMES = _plan.TwoStateNames("v", "s", "v", "s", "v_other", "s_other", "mask")
fingerprint = _dispatch.fingerprint


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
    key = (
        "merge_attn_states", fingerprint(output), fingerprint(prefix_output), fingerprint(prefix_lse), fingerprint(suffix_output),
        fingerprint(suffix_lse), fingerprint(output_lse),
        _dispatch.UNSET if prefill_tokens_with_context is None else prefill_tokens_with_context, lse_base,
    )  # fmt: skip
    call = _dispatch.lookup(key)
    if call is None:
        names = _MERGE_ATTN_STATES_NAMES
        options = _plan.TwoStateOptions(
            _conventions.lse_base_flag(lse_base), _merge_tokens(prefill_tokens_with_context)
        )
        inputs = _describe_inputs(prefix_output, prefix_lse, suffix_output, suffix_lse, names)
        out = _arrays.describe(output, names.out)
        out_lse = None if output_lse is None else _arrays.describe(output_lse, names.out_lse)
        plan = _plan.plan_two_way(out, out_lse, *inputs, names, None, options)
        call = _dispatch.prepare_call(plan, _arrays.array_kind(prefix_output), inputs[0].device)
        _dispatch.remember(key, call)
    _dispatch.run(call, stream)


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
    key = (
        "merge_state", fingerprint(v_a), fingerprint(s_a), fingerprint(v_b), fingerprint(s_b), fingerprint(out),
        fingerprint(out_lse), _dispatch.UNSET if out_dtype is None else out_dtype, lse_base,
    )  # fmt: skip
    call = _dispatch.lookup(key)
    if call is not None:
        out, out_lse = _dispatch.run_with_fresh_outputs(call, v_a, out, out_lse, stream)
        return _arrays.to_caller_kind(out, call.kind), _arrays.to_caller_kind(out_lse, call.kind)
    names = _MERGE_STATE_NAMES
    kind = _arrays.array_kind(v_a)
    options = _plan.TwoStateOptions(_conventions.lse_base_flag(lse_base))
    inputs = _describe_inputs(v_a, s_a, v_b, s_b, names)
    # Inputs are checked before anything is allocated for them.
    state = _plan.check_two_states(*inputs, names)
    new_out, new_lse = out is None, out_lse is None
    out, out_view, out_lse, lse_view = allocate_outputs(
        v_a, kind, state, out, out_lse, out_dtype, names.out, names.out_lse
    )
    plan = _plan.plan_two_way(out_view, lse_view, *inputs, names, None, options)
    fresh = _dispatch.fresh_outputs(new_out, new_lse, state, out_view.dtype)
    call = _dispatch.prepare_call(plan, kind, state.device)._replace(fresh=fresh)
    _dispatch.run(call, stream)
    _dispatch.remember(key, call)  # repeats allocate what this call allocated
    return _arrays.to_caller_kind(out, kind), _arrays.to_caller_kind(out_lse, kind)


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
    key = (
        "merge_state_in_place", fingerprint(v), fingerprint(s), fingerprint(v_other), fingerprint(s_other),
        fingerprint(mask), lse_base,
    )  # fmt: skip
    call = _dispatch.lookup(key)
    if call is None:
        names = _IN_PLACE_NAMES
        options = _plan.TwoStateOptions(_conventions.lse_base_flag(lse_base))
        inputs = _describe_inputs(v, s, v_other, s_other, names)
        mask_view = None if mask is None else _arrays.describe(mask, names.mask)
        plan = _plan.plan_two_way(inputs[0], inputs[1], *inputs, names, mask_view, options)
        call = _dispatch.prepare_call(plan, _arrays.array_kind(v), inputs[0].device)
        _dispatch.remember(key, call)
    _dispatch.run(call, stream)


def allocate_outputs(
    like: Any, kind: str, state: _plan.StateShape, out, out_lse, out_dtype, out_name, out_lse_name
):
    """The caller's ``out``/``out_lse`` described, or new ones allocated in the caller's kind."""
    if out is None:
        dtype = state.dtype if out_dtype is None else _conventions.value_dtype_name(out_dtype)
        shape = (state.num_tokens, state.num_heads, state.head_size)
        out, out_view = _arrays.empty_values(like, kind, shape, dtype, state.device)
    else:
        out_view = _arrays.describe(out, out_name)
        if out_dtype is not None and _conventions.value_dtype_name(out_dtype) != out_view.dtype:
            raise TypeError(
                f"out_dtype: expected the dtype of out ({out_view.dtype}) or None, got {out_dtype!r}"
            )
    if out_lse is None:
        out_lse, lse_view = _arrays.empty_lse(like, kind, (state.num_heads, state.num_tokens), state.device)
    else:
        lse_view = _arrays.describe(out_lse, out_lse_name)
    return out, out_view, out_lse, lse_view


def _merge_tokens(prefill_tokens_with_context: Any) -> int | None:
    if prefill_tokens_with_context is None:
        return None
    try:
        if isinstance(prefill_tokens_with_context, bool):
            raise TypeError
        prefill_tokens_with_context = operator.index(prefill_tokens_with_context)
    except TypeError:
        raise TypeError(
            f"prefill_tokens_with_context: expected None or an int, got {type(prefill_tokens_with_context).__name__}"
        ) from None
    if prefill_tokens_with_context < 0:
        raise ValueError(f"prefill_tokens_with_context: expected >= 0, got {prefill_tokens_with_context}")
    return prefill_tokens_with_context


def _describe_inputs(v_a, s_a, v_b, s_b, names: _plan.TwoStateNames) -> tuple:
    return (
        _arrays.describe(v_a, names.v_a),
        _arrays.describe(s_a, names.s_a),
        _arrays.describe(v_b, names.v_b),
        _arrays.describe(s_b, names.s_b),
    )
