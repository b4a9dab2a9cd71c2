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

from . import _checks, _options
from ._arrays import HOST, ArraySpec, contiguous_strides
from ._operands import ManyStateOperands, TwoStateOperands
from ._options import lse_base_flag

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

#: The largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: Group scales are at least this largest magnitude over FP8_MAX (an all-zero group stays finite).
FP8_ABS_MAX_FLOOR = 1e-10


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
        _checks.indptr_values(indptr, total)
    sink = _sinks(sinks, state.num_heads, "v")
    v, s = _f64(v), _f64(s)
    num_tokens = len(indptr) - 1
    out = np.zeros((num_tokens, *v.shape[1:]))
    lse = np.full((v.shape[1], num_tokens), -np.inf)
    log_base = math.log(2.0) if lse_base_flag(lse_base) else 1.0
    for token in range(num_tokens):
        begin, end = int(indptr[token]), int(indptr[token + 1])
        if begin < 0 or end < begin or end > total or end - begin > _checks.MAX_STATES_PER_TOKEN:
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
    _checks.indptr_values(indptr, total)
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
    _checks.expect_shape(_spec(array), shape, name, "the shape of the merge's result")
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


#: Values per NVFP4 block scale.
NVFP4_BLOCK = 16
#: The largest e2m1 magnitude.
E2M1_MAX = 6.0
#: The magnitudes of the e2m1 codes 0 to 7; code | 8 is the same magnitude negated.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: The smallest block scale NVFP4 writes: the smallest normal float8_e4m3fn, 2**-6 (torchao's floor).
NVFP4_SCALE_FLOOR = 2.0**-6
# Halfway points between neighbouring e2m1 magnitudes; at one, ties go to the even code.
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def quantize_nvfp4(
    v: ArrayLike, global_scale: float, *, swizzled: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 of ``v``: e2m1 values two a byte and a float8_e4m3fn scale per 16 values.

    Bit for bit torchao's reference quantiser
    (``torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize`` with
    ``per_tensor_scale = float32(1 / global_scale)``), every step in float32 as
    there: ``v`` rounded to float32; per block of 16 consecutive values of a row,
    ``amax / 6``, divided by ``1 / global_scale``, clamped to ``[2**-6, 448]`` and
    rounded to e4m3 (nearest even): the block scale ``s``; each value times
    ``(1 / (1 / global_scale)) / s``, clamped to +-6 and rounded to the nearest
    e2m1 (ties to even). Dequantised, a value is ``e2m1 * s / global_scale``.

    Special values: a NaN makes its block's scale NaN (e4m3 ``0x7F``) and all its
    codes 0 (torchao's CPU cast writes code 4 there; the scale decides either
    way); ``+-inf`` give ``+-6`` and make their block's scale 448 (the other
    values of the block then scaled as by 448); an all-zero block gets the floor
    scale ``2**-6`` and codes 0, as do tiny blocks whose scale would fall below
    it; ``-0`` and negative values that round to 0 keep their sign (code 8).

    The test references of vLLM (``ref_nvfp4_quant``) and FlashInfer
    (``ref_fp4_quant``) have no floor: where ``amax / 6 * global_scale`` is below
    ``2**-6`` they write an e4m3 subnormal or 0 (an all-zero block: scale 0). With a calibrated global scale
    (``448 * 6 / amax``) such blocks are rare; elsewhere the two agree but for
    the last bit of their different float32 order of operations (their CUDA
    kernels also use approximate reciprocals).

    Parameters
    ----------
    v : array_like
        Values ``[..., K]``, ``K`` a multiple of 16; ``rows`` is the product of the
        leading dimensions (a merge's ``[num_tokens, num_heads, head_size]`` is
        quantised per ``num_tokens * num_heads`` rows; reshape it to
        ``[num_tokens, num_heads * head_size]`` for a GEMM's rows).
    global_scale : float
        The per-tensor quantisation scale, as vLLM's ``scaled_fp4_quant`` and
        FlashInfer's ``fp4_quantize`` take it (``448 * 6 / amax`` of the tensor
        uses the whole range): a positive finite float32 with a finite reciprocal.
    swizzled : bool
        Block scales in the 128 x 4 swizzled layout of CUTLASS's and cuBLAS's FP4
        GEMMs (:func:`nvfp4_swizzled_scales`); False for row-major ``[rows, K // 16]``.

    Returns
    -------
    packed : numpy.ndarray
        Uint8 ``[rows, K // 2]``: value ``2 j`` in the low nibble of byte ``j``,
        value ``2 j + 1`` in the high one; a nibble is sign (bit 3) and the index of
        the magnitude in ``E2M1_VALUES``.
    scales : numpy.ndarray
        ``ml_dtypes.float8_e4m3fn``, ``[ceil(rows / 128) * 128, ceil(K / 64) * 4]``
        swizzled with zero padding, or ``[rows, K // 16]``.

    Raises
    ------
    ValueError
        If ``K`` is not a multiple of 16 or ``global_scale`` is not a positive
        finite float32 with a finite reciprocal.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> v = np.array([[3.0, -1.0, 0.5, 0.0] + [0.0] * 12])
    >>> packed, scales = reference.quantize_nvfp4(v, 4.0, swizzled=False)
    >>> packed[0, :2].tolist(), scales.astype(float).tolist()
    ([199, 2], [[2.0]])
    >>> reference.dequantize_nvfp4(packed, scales, 4.0, v.shape, swizzled=False)[0, :4].tolist()
    [3.0, -1.0, 0.5, 0.0]
    """
    import ml_dtypes

    x = np.asarray(_host(v, "v"), dtype=np.float32)  # torchao's first step: data_hp.float()
    per_tensor = _nvfp4_per_tensor_scale(global_scale)
    rows, blocks = _nvfp4_shape(x.shape, "v")
    x = x.reshape(rows, blocks, NVFP4_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x), axis=-1)
        block_scale = amax / np.float32(E2M1_MAX) / per_tensor
        scale_fp8 = np.clip(block_scale, np.float32(NVFP4_SCALE_FLOOR), np.float32(FP8_MAX)).astype(
            ml_dtypes.float8_e4m3fn
        )
        reciprocal = (np.float32(1.0) / per_tensor) / scale_fp8.astype(np.float32)
        scaled = np.clip(x * reciprocal[..., None], np.float32(-E2M1_MAX), np.float32(E2M1_MAX))
    codes = _e2m1_codes(scaled)
    codes[np.isnan(amax)] = 0
    codes = codes.reshape(rows, blocks * NVFP4_BLOCK)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if swizzled:
        return packed, nvfp4_swizzled_scales(scale_fp8)
    return packed, scale_fp8


def dequantize_nvfp4(
    packed: ArrayLike,
    scales: ArrayLike,
    global_scale: float,
    shape: tuple[int, ...],
    *,
    swizzled: bool = True,
) -> np.ndarray:
    """The values NVFP4 bytes stand for, in float64: ``e2m1 * block scale / global_scale``.

    The inverse of :func:`quantize_nvfp4` (one rounding, in float64); a NaN block
    scale makes its 16 values NaN.

    Parameters
    ----------
    packed : array_like
        Uint8 ``[rows, K // 2]``, two e2m1 codes a byte, the first in the low nibble.
    scales : array_like
        Block scales, ``ml_dtypes.float8_e4m3fn`` (or their uint8 bits), swizzled
        ``[ceil(rows / 128) * 128, ceil(K / 64) * 4]`` or row-major ``[rows, K // 16]``.
    global_scale : float
        The quantisation's ``global_scale``.
    shape : tuple of int
        The shape of the quantised values, ``[..., K]``.
    swizzled : bool
        Whether ``scales`` are in the 128 x 4 swizzled layout.

    Returns
    -------
    numpy.ndarray
        Float64 of shape ``shape``.

    Raises
    ------
    ValueError
        If the shapes disagree or ``global_scale`` is bad (as in :func:`quantize_nvfp4`).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> packed = np.full((1, 8), 0x1F, dtype=np.uint8)  # low nibble 0xF (-6), high 0x1 (0.5)
    >>> scales = np.full((1, 1), 0x38, dtype=np.uint8)  # e4m3 1.0
    >>> reference.dequantize_nvfp4(packed, scales, 2.0, (16,), swizzled=False)[:2].tolist()
    [-3.0, 0.25]
    """
    import ml_dtypes

    _nvfp4_per_tensor_scale(global_scale)
    shape = tuple(int(n) for n in shape)
    rows, blocks = _nvfp4_shape(shape, "shape")
    codes_bytes = np.asarray(packed)
    if codes_bytes.dtype != np.uint8 or codes_bytes.shape != (rows, blocks * NVFP4_BLOCK // 2):
        raise ValueError(
            f"packed: expected uint8 of shape {(rows, blocks * NVFP4_BLOCK // 2)} for values of shape "
            f"{shape}, got {codes_bytes.dtype} {codes_bytes.shape}"
        )
    block_scales = np.asarray(scales)
    if block_scales.dtype == np.uint8:
        block_scales = block_scales.view(ml_dtypes.float8_e4m3fn)
    if block_scales.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"scales: expected float8_e4m3fn (or its uint8 bits), got {block_scales.dtype}")
    if swizzled:
        block_scales = nvfp4_scales_from_swizzled(block_scales, rows, blocks)
    elif block_scales.shape != (rows, blocks):
        raise ValueError(
            f"scales: expected shape {(rows, blocks)} for values of shape {shape}, got {block_scales.shape}"
        )
    codes = np.stack([codes_bytes & 0xF, codes_bytes >> 4], axis=-1).reshape(rows, blocks, NVFP4_BLOCK)
    magnitude = np.asarray(E2M1_VALUES)[codes & 7]
    values = np.where(codes & 8, -magnitude, magnitude)
    out = values * (block_scales.astype(np.float64) / float(np.float32(global_scale)))[..., None]
    return out.reshape(shape)


def nvfp4_swizzled_scales(scales: ArrayLike) -> np.ndarray:
    """Row-major block scales ``[rows, cols]`` in the 128 x 4 layout the FP4 GEMMs read.

    cuBLAS's "1D block scaling factors layout" (torchao's ``to_blocked``, vLLM's and
    FlashInfer's swizzled scale factors): rows padded with zeros to a multiple of
    128 and columns to a multiple of 4; tile ``(r // 128, c // 4)`` of 512 bytes
    starts at byte ``512 * ((r // 128) * (padded_cols // 4) + c // 4)``, and inside
    it scale ``(r, c)`` lies at ``16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4``.

    Parameters
    ----------
    scales : array_like
        ``[rows, cols]`` (for NVFP4, ``cols = K // 16``), of any dtype.

    Returns
    -------
    numpy.ndarray
        ``[ceil(rows / 128) * 128, ceil(cols / 4) * 4]``, ``scales``'s dtype, whose
        bytes in C order are the swizzled layout (torchao views the same bytes as
        ``[ceil(rows / 128) * 32, ceil(cols / 4) * 16]``).

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> swizzled = reference.nvfp4_swizzled_scales(np.arange(130.0)[:, None])
    >>> swizzled.shape, swizzled.ravel()[:6].tolist(), float(swizzled.ravel()[16])
    ((256, 4), [0.0, 0.0, 0.0, 0.0, 32.0, 0.0], 1.0)
    """
    array = np.asarray(scales)
    if array.ndim != 2:
        raise ValueError(f"scales: expected [rows, cols], got shape {array.shape}")
    rows, cols = array.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((row_tiles * 128, col_tiles * 4), dtype=array.dtype)
    padded[:rows, :cols] = array
    # [row tile, 4 groups of 32 rows, 32 rows, col tile, 4 cols] -> [row tile, col tile, 32 rows, 4 groups, 4 cols]
    tiles = padded.reshape(row_tiles, 4, 32, col_tiles, 4).transpose(0, 3, 2, 1, 4)
    return np.ascontiguousarray(tiles).reshape(padded.shape)


def nvfp4_scales_from_swizzled(swizzled: ArrayLike, rows: int, cols: int) -> np.ndarray:
    """The inverse of :func:`nvfp4_swizzled_scales`: row-major ``[rows, cols]`` again.

    Parameters
    ----------
    swizzled : array_like
        Swizzled scales, any shape holding ``ceil(rows / 128) * 128 * ceil(cols / 4) * 4``
        elements in C order.
    rows : int
        Rows of the row-major scales.
    cols : int
        Their columns (``K // 16``).

    Returns
    -------
    numpy.ndarray
        ``[rows, cols]``, the padding dropped.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_merge import reference
    >>> scales = np.arange(6.0).reshape(3, 2)
    >>> swizzled = reference.nvfp4_swizzled_scales(scales)
    >>> bool((reference.nvfp4_scales_from_swizzled(swizzled, 3, 2) == scales).all())
    True
    """
    array = np.asarray(swizzled)
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    if array.size != row_tiles * 128 * col_tiles * 4:
        raise ValueError(
            f"scales: expected {row_tiles * 128 * col_tiles * 4} swizzled scales for [{rows}, {cols}] "
            f"(rows padded to 128, columns to 4), got shape {array.shape}"
        )
    tiles = array.reshape(row_tiles, col_tiles, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)[:rows, :cols]


def _nvfp4_per_tensor_scale(global_scale: float) -> np.float32:
    """torchao's ``per_tensor_scale``, ``float32(1 / global_scale)``, or ValueError naming ``global_scale``."""
    with np.errstate(divide="ignore", over="ignore"):
        try:
            scale = np.float32(global_scale)
        except (TypeError, ValueError):
            raise ValueError(f"global_scale: expected a positive finite number, got {global_scale!r}") from None
        per_tensor = np.float32(1.0) / scale
    if not (scale > 0 and np.isfinite(scale) and np.isfinite(per_tensor)):
        raise ValueError(
            f"global_scale: expected a positive finite float32 with a finite reciprocal, got {global_scale!r}"
        )
    return per_tensor


def _nvfp4_shape(shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """``(rows, blocks)`` of values of ``shape`` ``[..., K]``, or ValueError naming the head size."""
    if len(shape) == 0 or shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"{name}: the last dimension (the head size K) must be a multiple of {NVFP4_BLOCK} for NVFP4, "
            f"got shape {tuple(shape)}"
        )
    return math.prod(shape[:-1]), shape[-1] // NVFP4_BLOCK


def _e2m1_codes(scaled: np.ndarray) -> np.ndarray:
    """The e2m1 codes (uint8, sign in bit 3) of float32 values in [-6, 6], nearest, ties to even."""
    magnitude = np.abs(scaled)
    # The number of midpoints below, plus one at a midpoint whose upper neighbour is the even code.
    index = np.searchsorted(_E2M1_MIDPOINTS, magnitude, side="left")
    at_midpoint = (index < len(_E2M1_MIDPOINTS)) & (_E2M1_MIDPOINTS[np.minimum(index, 6)] == magnitude)
    index = index + (at_midpoint & (index % 2 == 1))
    sign = np.signbit(scaled).astype(np.uint8) << 3
    return np.minimum(index, 7).astype(np.uint8) | sign


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _host(x: ArrayLike, name: str) -> np.ndarray:
    """A NumPy array of floats (or indices) as the reference takes it, or TypeError naming ``name``."""
    array = np.asarray(x)
    if array.dtype.kind not in "fiu" and array.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected a NumPy array of floats, got dtype {array.dtype}")
    return array


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
    _checks.expect_ndim(_spec(array), 1, "sinks", "[num_heads]")
    _checks.expect_shape(_spec(array), (num_heads,), "sinks", f"num_heads of {like}")
    return _f64(array)


def _weights(s: np.ndarray, sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The merge's rules on natural-log ``s`` ``[states, heads, tokens]`` (``sinks`` ``[heads]``: one
    more state a head): each state's weight ``[states (+1, the sink last), heads, tokens]``, the
    merged LSE ``[heads, tokens]`` and where a NaN LSE or sink makes the row NaN. +inf LSEs are
    empty states; a +inf sink takes all the weight (LSE +inf); an all-empty row weighs nothing."""
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
