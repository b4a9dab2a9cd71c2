"""NumPy float64 reference of the merge, with the same rules for empty and NaN rows.

Meant for tests and for users' own checks: slow, exact to float64, host only.
Pass NumPy arrays (``cupy_array.get()``, ``tensor.float().cpu().numpy()``).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from ._checks import lse_base_flag

__all__ = [
    "attention",
    "merge_state",
    "merge_states",
    "merge_states_varlen",
    "quantize_fp8",
    "quantize_fp8_groups",
]

#: The largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: Group scales are at least this largest magnitude over FP8_MAX (an all-zero group stays finite).
FP8_ABS_MAX_FLOOR = 1e-10


def merge_state(
    v_a: ArrayLike, s_a: ArrayLike, v_b: ArrayLike, s_b: ArrayLike, lse_base: str | int = "e"
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

    Returns
    -------
    v : numpy.ndarray
        Float64 ``[num_tokens, num_heads, head_size]``.
    s : numpy.ndarray
        Float64 ``[num_heads, num_tokens]``.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> v = np.ones((2, 1, 4)); s = np.zeros((1, 2))
    >>> out, lse = reference.merge_state(v, s, 3 * v, s)
    >>> out[0, 0], lse[0]
    (array([2., 2., 2., 2.]), array([0.69314718, 0.69314718]))
    """
    return merge_states(np.stack([_f64(v_a), _f64(v_b)]), np.stack([_f64(s_a), _f64(s_b)]), lse_base)


def merge_states(v: ArrayLike, s: ArrayLike, lse_base: str | int = "e") -> tuple[np.ndarray, np.ndarray]:
    """Merge any number of states in float64.

    Parameters
    ----------
    v : array_like
        ``[num_states, num_tokens, num_heads, head_size]``.
    s : array_like
        ``[num_states, num_heads, num_tokens]``, in base ``lse_base``.
    lse_base : {"e", 2}
        Base of the LSEs in and out.

    Returns
    -------
    v : numpy.ndarray
        ``[num_tokens, num_heads, head_size]``; no states at all, or only empty
        ones, give 0.
    s : numpy.ndarray
        ``[num_heads, num_tokens]``; ``-inf`` for such tokens.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> out, lse = reference.merge_states(np.ones((4, 1, 1, 2)), np.zeros((4, 1, 1)), lse_base=2)
    >>> out.ravel(), lse.ravel()
    (array([1., 1.]), array([2.]))
    """
    v, s = _f64(v), _f64(s)
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    if s.shape[0] == 0:
        return np.zeros(v.shape[1:]), np.full(s.shape[1:], -np.inf)
    out, lse = _merge(v, s * log_base)
    return out, lse / log_base


def merge_states_varlen(
    v: ArrayLike, s: ArrayLike, indptr: ArrayLike, lse_base: str | int = "e"
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged merge in float64: token ``t`` merges rows ``indptr[t]:indptr[t + 1]``.

    Parameters
    ----------
    v : array_like
        ``[total_states, num_heads, head_size]``.
    s : array_like
        ``[num_heads, total_states]``, in base ``lse_base``.
    indptr : array_like
        ``[num_tokens + 1]`` integer offsets.
    lse_base : {"e", 2}
        Base of the LSEs in and out.

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
    v, s, indptr = _f64(v), _f64(s), np.asarray(indptr)
    num_tokens = len(indptr) - 1
    out = np.zeros((num_tokens, *v.shape[1:]))
    lse = np.full((v.shape[1], num_tokens), -np.inf)
    for token in range(num_tokens):
        rows = slice(indptr[token], indptr[token + 1])
        merged, merged_lse = merge_states(v[rows, None], s[:, rows].T[:, :, None], lse_base)
        out[token], lse[:, token] = merged[0], merged_lse[:, 0]
    return out, lse


def quantize_fp8(v: ArrayLike, scale: float) -> np.ndarray:
    """FP8 (float8_e4m3fn) of ``v / scale``: clamped to +-448 (infinities too), nearest even, NaN kept.

    Parameters
    ----------
    v : array_like
        Values, e.g. a merge's float64 output.
    scale : float
        The per-tensor scale (vLLM's ``output_scale``).

    Returns
    -------
    numpy.ndarray
        Of dtype ``ml_dtypes.float8_e4m3fn``, the shape of ``v``.

    Examples
    --------
    >>> from cupy_merge import reference
    >>> reference.quantize_fp8([1.0, 1000.0, -3.3], 0.5).astype(float).tolist()
    [2.0, 448.0, -6.5]
    """
    import ml_dtypes

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scaled = np.clip(_f64(v) / scale, -FP8_MAX, FP8_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn)


def quantize_fp8_groups(v: ArrayLike, group_size: int, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """FP8 with a scale per ``group_size`` consecutive elements of each token's heads.

    A group's scale is ``max(max|v|, 1e-10) / 448`` in float32 (a NaN in the
    group makes it NaN), rounded up to a power of two when ``ue8m0``; its
    elements are quantised as by :func:`quantize_fp8` with that scale.

    Parameters
    ----------
    v : array_like
        ``[num_tokens, num_heads, head_size]``.
    group_size : int
        A divisor of ``head_size``.
    ue8m0 : bool
        Round each scale up to a power of two.

    Returns
    -------
    values : numpy.ndarray
        ``ml_dtypes.float8_e4m3fn`` of the shape of ``v``.
    scales : numpy.ndarray
        Float32 ``[num_tokens, num_heads * head_size // group_size]``.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> values, scales = reference.quantize_fp8_groups(np.array([[[1.0, -4.0, 0.0, 0.0]]]), 2, ue8m0=True)
    >>> values.astype(float).tolist(), scales.tolist()
    ([[[64.0, -256.0, 0.0, 0.0]]], [[0.015625, 2.2737367544323206e-13]])
    """
    v = _f64(v)
    num_tokens = v.shape[0]
    groups = v.reshape(num_tokens, -1, group_size)
    with np.errstate(invalid="ignore"):
        amax = np.abs(groups).max(axis=-1).astype(np.float32)
    scales = np.where(np.isnan(amax), amax, np.maximum(amax, np.float32(FP8_ABS_MAX_FLOOR))) / np.float32(
        FP8_MAX
    )
    if ue8m0:
        with np.errstate(divide="ignore", invalid="ignore"):
            scales = np.where(np.isfinite(scales), np.exp2(np.ceil(np.log2(scales))), scales).astype(
                np.float32
            )
    values = quantize_fp8(groups / scales[..., None].astype(np.float64), 1.0)
    return values.reshape(v.shape), scales


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _merge(v: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``v`` ``[states, tokens, heads, dim]``, ``s`` ``[states, heads, tokens]``, natural log."""
    s = np.where(s == np.inf, -np.inf, s)  # FlashAttention-2 marks empty rows with +inf
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s_max = np.max(s, axis=0)
        all_empty = s_max == -np.inf
        shifted = s - np.where(all_empty, 0.0, s_max)
        weights = np.exp(shifted)
        total = weights.sum(axis=0)
        weights = weights / np.where(all_empty, 1.0, total)
        lse = np.where(all_empty, -np.inf, s_max + np.log(total))
        # [states, heads, tokens] -> [states, tokens, heads, 1], to scale rows of v.
        w = np.swapaxes(weights, 1, 2)[..., None]
        # A state of weight zero contributes nothing, even if its values are NaN.
        contributions = np.where(w == 0.0, 0.0, w * v)
    return contributions.sum(axis=0), lse


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
