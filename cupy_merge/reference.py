"""NumPy float64 reference of the merge, with the same rules as the GPU merges.

Meant for tests and for users' own checks: slow, exact to float64, host only.
Pass NumPy arrays (``cupy_array.get()``, ``tensor.float().cpu().numpy()``) of any
floating dtype. Shapes, offsets and options follow the GPU merges' rules, with
their error messages (``cupy_merge._checks``); empty, NaN, ``+inf`` and sink
rows follow their semantics.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from . import _array_rules, _catalogue, _checks, _options
from ._arrays import HOST, ArraySpec, contiguous_strides
from ._operands import ManyStateOperands, TwoStateOperands
from ._options import lse_base_flag

# The quantised outputs' references live in their own module; users import them from this one.
from ._reference_formats import (
    E2M1_MAX,  # noqa: F401 - public here
    E2M1_VALUES,  # noqa: F401 - public here
    FP8_ABS_MAX_FLOOR,  # noqa: F401 - public here
    FP8_MAX,  # noqa: F401 - public here
    NVFP4_BLOCK,  # noqa: F401 - public here
    NVFP4_SCALE_FLOOR,  # noqa: F401 - public here
    _f64,
    _host,
    dequantize_nvfp4,
    nvfp4_scales_from_swizzled,
    nvfp4_swizzled_scales,
    quantize_fp8,
    quantize_fp8_groups,
    quantize_nvfp4,
)

__all__ = [
    "attention",
    "dequantize_nvfp4",
    "merge_state",
    "merge_state_backward",
    "merge_states",
    "merge_states_backward",
    "merge_states_varlen",
    "merge_states_varlen_backward",
    "nvfp4_scales_from_swizzled",
    "nvfp4_swizzled_scales",
    "quantize_fp8",
    "quantize_fp8_groups",
    "quantize_nvfp4",
]

def merge_state(
    v_a: ArrayLike,
    s_a: ArrayLike,
    v_b: ArrayLike,
    s_b: ArrayLike,
    lse_base: str | int = "e",
    *,
    sinks: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two attention states in float64.

    Parameters
    ----------
    v_a : array_like
        Attention output of the first piece, ``[num_tokens, num_heads, head_size]``.
    s_a : array_like
        Its log-sum-exp, ``[num_heads, num_tokens]``, in base ``lse_base``.
    v_b : array_like
        Attention output of the second piece, like ``v_a``.
    s_b : array_like
        Its log-sum-exp, like ``s_a``.
    lse_base : {"e", 2}
        Base of the LSEs in and out.
    sinks : array_like, optional
        Attention sinks, ``[num_heads]`` natural-log logits: one more state of
        value 0 and LSE ``sink`` in each head's merge.

    Returns
    -------
    v : numpy.ndarray
        Float64 ``[num_tokens, num_heads, head_size]``.
    s : numpy.ndarray
        Float64 ``[num_heads, num_tokens]`` (the sinks included).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> v = np.ones((2, 1, 4)); s = np.zeros((1, 2))
    >>> out, lse = reference.merge_state(v, s, 3 * v, s)
    >>> out[0, 0], lse[0]
    (array([2., 2., 2., 2.]), array([0.69314718, 0.69314718]))
    """
    names = TwoStateOperands("out", "out_lse", "v_a", "s_a", "v_b", "s_b", sinks="sinks")
    arrays = [_host(x, name) for x, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b"))]
    specs = [_spec(x) for x in arrays]
    values = names._replace(out=None, out_lse=None, v_a=specs[0], s_a=specs[1], v_b=specs[2], s_b=specs[3],
                            mask=None, sinks=None, output_scale=None, output_block_scale=None)  # fmt: skip
    state = _checks.check_two_inputs(values, names)
    sink = _sinks(sinks, state.num_heads, "v_a")
    return merge_states(np.stack(arrays[::2]), np.stack(arrays[1::2]), lse_base, sinks=sink)


def merge_states(
    v: ArrayLike, s: ArrayLike, lse_base: str | int = "e", *, sinks: ArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Merge any number of states in float64.

    Parameters
    ----------
    v : array_like
        ``[num_states, num_tokens, num_heads, head_size]``.
    s : array_like
        ``[num_states, num_heads, num_tokens]``, in base ``lse_base``.
    lse_base : {"e", 2}
        Base of the LSEs in and out.
    sinks : array_like, optional
        Attention sinks, ``[num_heads]`` natural-log logits.

    Returns
    -------
    v : numpy.ndarray
        ``[num_tokens, num_heads, head_size]``; no states at all, or only empty
        ones, give 0.
    s : numpy.ndarray
        ``[num_heads, num_tokens]``; ``-inf`` for such tokens (the sink with sinks).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> out, lse = reference.merge_states(np.ones((4, 1, 1, 2)), np.zeros((4, 1, 1)), lse_base=2)
    >>> out.ravel(), lse.ravel()
    (array([1., 1.]), array([2.]))
    """
    v, s = _host(v, "v"), _host(s, "s")
    names = ManyStateOperands("out", "out_lse", "v", "s", "indptr", "sinks")
    specs = ManyStateOperands(None, None, _spec(v), _spec(s))
    state, _ = _checks.check_many_inputs(specs, names)
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    out, lse = _merge(_f64(v), _f64(s) * log_base, _sinks(sinks, state.num_heads, "v"))
    return out, lse / log_base


def merge_states_varlen(
    v: ArrayLike,
    s: ArrayLike,
    indptr: ArrayLike,
    lse_base: str | int = "e",
    *,
    check_indptr: bool = True,
    sinks: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged merge in float64: token ``t`` merges rows ``indptr[t]:indptr[t + 1]``.

    Parameters
    ----------
    v : array_like
        ``[total_states, num_heads, head_size]``.
    s : array_like
        ``[num_heads, total_states]``, in base ``lse_base``.
    indptr : array_like
        ``[num_tokens + 1]`` int32 or int64 offsets.
    lse_base : {"e", 2}
        Base of the LSEs in and out.
    check_indptr : bool
        Refuse bad offsets with ``ValueError``, as the GPU merge does; False gives
        NaN rows for them instead, as its kernel does.
    sinks : array_like, optional
        Attention sinks, ``[num_heads]`` natural-log logits.

    Returns
    -------
    v : numpy.ndarray
        ``[num_tokens, num_heads, head_size]``.
    s : numpy.ndarray
        ``[num_heads, num_tokens]``.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> out, lse = reference.merge_states_varlen(np.ones((3, 1, 2)), np.zeros((1, 3)), [0, 0, 3])
    >>> out[:, 0], lse[0]
    (array([[0., 0.],
           [1., 1.]]), array([      -inf, 1.09861229]))
    """
    v, s, indptr = _host(v, "v"), _host(s, "s"), np.asarray(indptr)
    names = ManyStateOperands("out", "out_lse", "v", "s", "indptr", "sinks")
    specs = ManyStateOperands(None, None, _spec(v), _spec(s), _spec(indptr, index=True))
    state, total = _checks.check_many_inputs(specs, names)
    check_indptr = _options.flag(check_indptr, "check_indptr")
    if check_indptr:
        _array_rules.indptr_values(indptr, total)
    sink = _sinks(sinks, state.num_heads, "v")
    v, s = _f64(v), _f64(s)
    num_tokens = len(indptr) - 1
    out = np.zeros((num_tokens, *v.shape[1:]))
    lse = np.full((v.shape[1], num_tokens), -np.inf)
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    for token in range(num_tokens):
        begin, end = int(indptr[token]), int(indptr[token + 1])
        if begin < 0 or end < begin or end > total or end - begin > _catalogue.MAX_STATES_PER_TOKEN:
            out[token], lse[:, token] = np.nan, np.nan  # the kernel's rule for offsets out of range
            continue
        merged, merged_lse = _merge(v[begin:end, None], s[:, begin:end].T[:, :, None] * log_base, sink)
        out[token], lse[:, token] = merged[0], merged_lse[:, 0] / log_base
    return out, lse


def merge_states_backward(
    v: ArrayLike,
    s: ArrayLike,
    grad_v: ArrayLike,
    grad_s: ArrayLike | None = None,
    *,
    sinks: ArrayLike | None = None,
    lse_base: str | int = "e",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The gradients of :func:`merge_states` in float64, by the merge's closed form.

    With ``w_i = exp(s_i - S)`` and ``V`` the merge: ``dV_i = w_i dV``,
    ``ds_i = w_i (<dV, V_i - V> + dS)``, ``dz = sum_t w_z (dS - <dV, V>)``; a state of
    weight zero gets zero gradients even when its values are NaN.

    Parameters
    ----------
    v : array_like
        ``[num_states, num_tokens, num_heads, head_size]``.
    s : array_like
        ``[num_states, num_heads, num_tokens]``, in base ``lse_base``.
    grad_v : array_like
        The gradient of the merged values, ``[num_tokens, num_heads, head_size]``.
    grad_s : array_like, optional
        The gradient of the merged LSE, ``[num_heads, num_tokens]``; None for zero.
    sinks : array_like, optional
        ``[num_heads]`` natural-log logits.
    lse_base : {"e", 2}
        Base of the LSEs (and of the LSE whose gradient ``grad_s`` is).

    Returns
    -------
    grad_states_v : numpy.ndarray
        Float64, like ``v``.
    grad_states_s : numpy.ndarray
        Float64, like ``s``.
    grad_sinks : numpy.ndarray or None
        Float64 ``[num_heads]`` with sinks, else None.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> v = np.stack([np.ones((1, 1, 2)), 3 * np.ones((1, 1, 2))]); s = np.zeros((2, 1, 1))
    >>> grad_v, grad_s, _ = reference.merge_states_backward(v, s, np.ones((1, 1, 2)))
    >>> grad_v[:, 0, 0, 0].tolist(), grad_s[:, 0, 0].tolist()
    ([0.5, 0.5], [-1.0, 1.0])
    """
    v, s = _host(v, "v"), _host(s, "s")
    names = ManyStateOperands("out", "out_lse", "v", "s", "indptr", "sinks")
    state, _ = _checks.check_many_inputs(ManyStateOperands(None, None, _spec(v), _spec(s)), names)
    sink = _sinks(sinks, state.num_heads, "v")
    grad_v = _gradient(grad_v, "grad_v", (state.num_tokens, state.num_heads, state.head_size))
    grad_s = _gradient(grad_s, "grad_s", (state.num_heads, state.num_tokens))
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    return _backward(_f64(v), _f64(s) * log_base, grad_v, grad_s / log_base, sink, log_base)


def merge_state_backward(
    v_a: ArrayLike,
    s_a: ArrayLike,
    v_b: ArrayLike,
    s_b: ArrayLike,
    grad_v: ArrayLike,
    grad_s: ArrayLike | None = None,
    *,
    sinks: ArrayLike | None = None,
    lse_base: str | int = "e",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The gradients of :func:`merge_state` in float64 (see :func:`merge_states_backward`).

    Parameters
    ----------
    v_a, s_a, v_b, s_b : array_like
        The merge's inputs.
    grad_v : array_like
        The gradient of the merged values.
    grad_s : array_like, optional
        The gradient of the merged LSE; None for zero.
    sinks : array_like, optional
        ``[num_heads]`` natural-log logits.
    lse_base : {"e", 2}
        Base of the LSEs.

    Returns
    -------
    tuple
        Float64 gradients of ``v_a``, ``s_a``, ``v_b``, ``s_b`` and the sinks (None without).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> v = np.ones((1, 1, 2)); s = np.zeros((1, 1))
    >>> grads = reference.merge_state_backward(v, s, 3 * v, s, np.ones((1, 1, 2)))
    >>> grads[0][0, 0].tolist(), float(grads[1][0, 0])
    ([0.5, 0.5], -1.0)
    """
    arrays = [_host(x, name) for x, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b"))]
    names = TwoStateOperands("out", "out_lse", "v_a", "s_a", "v_b", "s_b", sinks="sinks")
    _checks.check_two_inputs(TwoStateOperands(None, None, *(_spec(x) for x in arrays)), names)
    grad_states_v, grad_states_s, grad_sinks = merge_states_backward(
        np.stack(arrays[::2]), np.stack(arrays[1::2]), grad_v, grad_s, sinks=sinks, lse_base=lse_base
    )
    return grad_states_v[0], grad_states_s[0], grad_states_v[1], grad_states_s[1], grad_sinks


def merge_states_varlen_backward(
    v: ArrayLike,
    s: ArrayLike,
    indptr: ArrayLike,
    grad_v: ArrayLike,
    grad_s: ArrayLike | None = None,
    *,
    sinks: ArrayLike | None = None,
    lse_base: str | int = "e",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The gradients of :func:`merge_states_varlen` in float64 (rows no token owns: zero).

    Parameters
    ----------
    v : array_like
        ``[total_states, num_heads, head_size]``.
    s : array_like
        ``[num_heads, total_states]``.
    indptr : array_like
        ``[num_tokens + 1]`` offsets (checked as :func:`merge_states_varlen` checks them).
    grad_v : array_like
        ``[num_tokens, num_heads, head_size]``.
    grad_s : array_like, optional
        ``[num_heads, num_tokens]``; None for zero.
    sinks : array_like, optional
        ``[num_heads]`` natural-log logits.
    lse_base : {"e", 2}
        Base of the LSEs.

    Returns
    -------
    tuple
        Float64 gradients of ``v``, ``s`` and the sinks (None without).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> grad_v, _, _ = reference.merge_states_varlen_backward(np.ones((3, 1, 2)), np.zeros((1, 3)), [0, 1, 3],
    ...                                                        np.ones((2, 1, 2)))
    >>> grad_v[:, 0, 0].tolist()
    [1.0, 0.5, 0.5]
    """
    v, s, indptr = _host(v, "v"), _host(s, "s"), np.asarray(indptr)
    names = ManyStateOperands("out", "out_lse", "v", "s", "indptr", "sinks")
    state, total = _checks.check_many_inputs(ManyStateOperands(None, None, _spec(v), _spec(s), _spec(indptr, index=True)), names)
    _array_rules.indptr_values(indptr, total)
    grad_v = _gradient(grad_v, "grad_v", (state.num_tokens, state.num_heads, state.head_size))
    grad_s = _gradient(grad_s, "grad_s", (state.num_heads, state.num_tokens))
    sink = _sinks(sinks, state.num_heads, "v")
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    v, s = _f64(v), _f64(s) * log_base
    grad_states_v, grad_states_s = np.zeros_like(v), np.zeros_like(s)
    grad_sinks = None if sink is None else np.zeros_like(sink)
    for token in range(len(indptr) - 1):
        rows = slice(int(indptr[token]), int(indptr[token + 1]))
        token_v, token_s, token_z = _backward(v[rows, None], s[:, rows].T[:, :, None], grad_v[token : token + 1],
                                              grad_s[:, token : token + 1] / log_base, sink, log_base)  # fmt: skip
        grad_states_v[rows], grad_states_s[:, rows] = token_v[:, 0], token_s[:, :, 0].T
        if grad_sinks is not None:
            grad_sinks += token_z
    return grad_states_v, grad_states_s, grad_sinks


def _gradient(grad: ArrayLike | None, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if grad is None:
        return np.zeros(shape)
    array = _host(grad, name)
    _array_rules.expect_shape(_spec(array), shape, name, "the shape of the merge's result")
    return _f64(array)


def _backward(v, s, grad_v, grad_s, sinks, log_base):
    """Natural-log ``s`` and ``grad_s``; the gradients with ``s``'s back in the caller's base."""
    all_weights, _, _ = _weights(s, sinks)  # a NaN row's weights are NaN, and so its gradients
    weights = all_weights[: v.shape[0]]  # [states, heads, tokens]
    with np.errstate(invalid="ignore"):
        w = np.swapaxes(weights, 1, 2)[..., None]  # [states, tokens, heads, 1]
        merged = np.where(w == 0.0, 0.0, w * v).sum(axis=0)
        inner = np.einsum("thd,sthd->sht", grad_v, np.where(w == 0.0, 0.0, v))
        dot_v = np.einsum("thd,thd->ht", grad_v, merged)
        grad_states_v = np.where(w == 0.0, 0.0, w * grad_v[None])
        grad_states_s = np.where(weights == 0.0, 0.0, weights * (inner - dot_v[None] + grad_s[None])) * log_base
        grad_sinks = None
        if sinks is not None:  # w_z: the sink's weight (1 for a +inf sink, which takes it all)
            grad_sinks = (all_weights[-1] * (grad_s - dot_v)).sum(axis=1)
    return grad_states_v, grad_states_s, grad_sinks


def _spec(array: np.ndarray, index: bool = False) -> ArraySpec:
    """What the GPU merges' shape rules read of a host array: its shape, and a dtype they take for
    values and LSEs (the reference takes any floating dtype and computes in float64); offsets keep
    their own dtype, so that the index rule judges them as the GPU merges do."""
    floating = array.dtype.kind == "f" or array.dtype.name == "bfloat16"
    dtype = "float32" if floating and not index else array.dtype.name
    return ArraySpec(array.shape, contiguous_strides(array.shape), dtype, 4, HOST)


def _sinks(sinks: ArrayLike | None, num_heads: int, like: str) -> np.ndarray | None:
    if sinks is None:
        return None
    array = _host(sinks, "sinks")
    _array_rules.expect_ndim(_spec(array), 1, "sinks", "[num_heads]")
    _array_rules.expect_shape(_spec(array), (num_heads,), "sinks", f"num_heads of {like}")
    return _f64(array)


def _weights(s: np.ndarray, sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The merge's rules on natural-log ``s`` ``[states, heads, tokens]`` (``sinks`` ``[heads]``: one
    more state a head): each state's weight ``[states (+1, the sink last), heads, tokens]``, the
    merged LSE ``[heads, tokens]`` and where a NaN LSE or sink makes the row NaN. +inf LSEs are
    empty states, and so are states whose weight underflows in float32; a +inf sink takes all the
    weight (LSE +inf); an all-empty row weighs nothing."""
    s = np.where(s == np.inf, -np.inf, s)  # FlashAttention-2 marks empty rows with +inf
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[None, :, None], (1, *s.shape[1:]))])
    if s.shape[0] == 0:
        return np.zeros(s.shape), np.full(s.shape[1:], -np.inf), np.zeros(s.shape[1:], dtype=bool)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        any_nan = np.isnan(s).any(axis=0)
        takes_all = np.isposinf(s).any(axis=0)
        s_max = np.max(s, axis=0)
        all_empty = s_max == -np.inf
        shifted = s - np.where(all_empty | takes_all, 0.0, s_max)
        weights = np.where(takes_all, np.isposinf(s), np.exp(shifted))
        # A weight that underflows to 0 in float32 (an LSE more than ~103 below its row's largest), as
        # the kernels compute it, is 0: such a state adds nothing, even where its values are NaN.
        weights = np.where(weights.astype(np.float32) == 0, 0.0, weights)
        total = weights.sum(axis=0)
        weights = weights / np.where(all_empty, 1.0, total)
        lse = np.where(all_empty, -np.inf, np.where(takes_all, np.inf, s_max + np.log(total)))
    return weights, lse, any_nan


def _merge(v: np.ndarray, s: np.ndarray, sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``v`` ``[states, tokens, heads, dim]``, ``s`` ``[states, heads, tokens]``, natural log;
    ``sinks`` ``[heads]``: a state of value 0 and LSE ``sink`` in every token of its head."""
    weights, lse, any_nan = _weights(s, sinks)
    weights = weights[: v.shape[0]]  # the sink's value is 0
    with np.errstate(invalid="ignore"):
        # [states, heads, tokens] -> [states, tokens, heads, 1], to scale rows of v.
        w = np.swapaxes(weights, 1, 2)[..., None]
        # A state of weight zero contributes nothing, even if its values are NaN.
        out = np.where(w == 0.0, 0.0, w * v).sum(axis=0)
    return np.where(any_nan.T[..., None], np.nan, out), np.where(any_nan, np.nan, lse)


def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention in float64, returning the output and its log-sum-exp.

    What a piece of a split attention computes: merging the pieces' results gives
    attention over the whole sequence (the tests check exactly that).

    Parameters
    ----------
    q : array_like
        Queries, ``[num_tokens, num_heads, head_size]``.
    k : array_like
        Keys, ``[kv_len, num_heads, head_size]``.
    v : array_like
        Values, ``[kv_len, num_heads, head_size]``.
    scale : float, optional
        Score scale; ``1 / sqrt(head_size)`` by default.

    Returns
    -------
    out : numpy.ndarray
        ``[num_tokens, num_heads, head_size]``; zeros for an empty KV (``kv_len == 0``).
    lse : numpy.ndarray
        ``[num_heads, num_tokens]`` (natural log); ``-inf`` for an empty KV.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> q, k, v = np.ones((1, 1, 4)), np.ones((2, 1, 4)), np.arange(8.0).reshape(2, 1, 4)
    >>> out, lse = reference.attention(q, k, v)
    >>> out[0, 0], round(float(lse[0, 0]), 4)
    (array([2., 3., 4., 5.]), 2.6931)
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = np.einsum("thd,khd->htk", q, k) * scale
    if k.shape[0] == 0:
        return np.zeros(q.shape[:2] + v.shape[2:]), np.full(scores.shape[:2], -np.inf)
    s_max = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - s_max)
    total = p.sum(axis=-1, keepdims=True)
    out = np.einsum("htk,khd->thd", p / total, v)
    return out, (s_max + np.log(total))[..., 0]
