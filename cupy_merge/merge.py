"""The public merge functions: check, allocate what is missing, launch.

Shapes, everywhere in this package:

* values ``v``: ``[num_tokens, num_heads, head_size]``, float32, float16 or
  bfloat16, any token and head strides, contiguous last dimension;
* log-sum-exp ``s``: ``[num_heads, num_tokens]``, float32, natural log, any
  strides (a token-major ``[num_tokens, num_heads]`` buffer is passed as its
  transpose ``s.T``, no copy).
"""

from __future__ import annotations

from typing import Any

from . import _arrays, _kernels, _plan

_MERGE_ATTN_STATES_NAMES = _plan.TwoStateNames(
    "output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse"
)
_MERGE_STATE_NAMES = _plan.TwoStateNames("out", "out_lse", "v_a", "s_a", "v_b", "s_b")


def merge_attn_states(
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any | None = None,
    *,
    stream: Any = None,
) -> None:
    """Merge two attention states into ``output`` (vLLM's ``merge_attn_states``).

    Parameters
    ----------
    output : ``[num_tokens, num_heads, head_size]``, written
        May be the very same array as ``prefix_output`` or ``suffix_output``.
    prefix_output, suffix_output : ``[num_tokens, num_heads, head_size]``
        The two partial attention outputs; same dtype as ``output``.
    prefix_lse, suffix_lse : float32 ``[num_heads, num_tokens]``
        Their log-sum-exp. ``+inf`` is read as ``-inf`` (an empty row).
    output_lse : float32 ``[num_heads, num_tokens]``, optional, written
        The merged log-sum-exp; may be ``prefix_lse`` or ``suffix_lse`` itself.
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
    names = _MERGE_ATTN_STATES_NAMES
    kind = _arrays.array_kind(prefix_output)
    inputs = _describe_inputs(prefix_output, prefix_lse, suffix_output, suffix_lse, names)
    out = _arrays.describe(output, names.out)
    out_lse = None if output_lse is None else _arrays.describe(output_lse, names.out_lse)
    _launch(_plan.plan_two_way(out, out_lse, *inputs, names), inputs[0].device, stream, kind)


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out: Any | None = None,
    out_lse: Any | None = None,
    stream: Any = None,
) -> tuple[Any, Any]:
    """Merge two attention states and return the merged ``(v, s)``.

    Parameters
    ----------
    v_a, v_b : ``[num_tokens, num_heads, head_size]``, float32, float16 or bfloat16
    s_a, s_b : float32 ``[num_heads, num_tokens]``, natural-log LSE
    out : like ``v_a``, optional
        Where to write the merged values; allocated (C-contiguous) if omitted.
        May be ``v_a`` or ``v_b`` itself for an in-place merge.
    out_lse : float32 ``[num_heads, num_tokens]``, optional
        Where to write the merged LSE; allocated if omitted; may be ``s_a`` or ``s_b``.
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
    names = _MERGE_STATE_NAMES
    kind = _arrays.array_kind(v_a)
    inputs = _describe_inputs(v_a, s_a, v_b, s_b, names)
    # Inputs are checked before anything is allocated for them.
    state = _plan.check_two_states(*inputs, names)
    if out is None:
        out, out_view = _arrays.empty_values_like(v_a, kind, inputs[0])
    else:
        out_view = _arrays.describe(out, names.out)
    if out_lse is None:
        out_lse, lse_view = _arrays.empty_lse(v_a, kind, (state.num_heads, state.num_tokens), state.device)
    else:
        lse_view = _arrays.describe(out_lse, names.out_lse)
    _launch(_plan.plan_two_way(out_view, lse_view, *inputs, names), state.device, stream, kind)
    return _arrays.to_caller_kind(out, kind), _arrays.to_caller_kind(out_lse, kind)


def _describe_inputs(v_a, s_a, v_b, s_b, names: _plan.TwoStateNames) -> tuple:
    return (
        _arrays.describe(v_a, names.v_a),
        _arrays.describe(s_a, names.s_a),
        _arrays.describe(v_b, names.v_b),
        _arrays.describe(s_b, names.s_b),
    )


def _launch(plan: _plan.LaunchPlan | None, device: int, stream: Any, kind: str) -> None:
    stream_ptr = _arrays.stream_pointer(stream, kind, device)  # checked even when there is nothing to do
    if plan is not None:
        _kernels.launch(plan, device, stream_ptr)
