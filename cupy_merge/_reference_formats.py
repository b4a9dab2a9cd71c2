"""NumPy references of the merges' quantised outputs: FP8 per tensor and per group, and NVFP4.

They quantise a float64 merge (:mod:`cupy_merge.reference`) as the GPU merges' FP8 and NVFP4
outputs do, dequantise NVFP4 again, and move NVFP4's block scales to and from the 128 x 4
swizzled layout the FP4 GEMMs read. Users import them from :mod:`cupy_merge.reference`, which
re-exports every public name here. The host-array helpers both modules use (``_host``,
``_f64``) live here too, so that this module needs nothing of ``reference``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

#: The largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: Group scales are at least this largest magnitude over FP8_MAX (an all-zero group stays finite).
FP8_ABS_MAX_FLOOR = 1e-10


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
    if ue8m0:  # up to the next power of two on the float32 bits, as the kernel (log2 in float32 rounds
        # a scale a few ulps above a power of two down onto it, and ceil then keeps it)
        bits = scales.astype(np.float32).view(np.uint32)
        up = ((bits & np.uint32(0x007FFFFF)) != 0) & (bits < np.uint32(0x7F800000))
        rounded = ((bits + np.uint32(0x00800000)) & np.uint32(0xFF800000)).view(np.float32)
        scales = np.where(up, rounded, scales).astype(np.float32)
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
    v: ArrayLike, global_scale: float, *, is_sf_swizzled_layout: bool = True
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
    is_sf_swizzled_layout : bool
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
    >>> packed, scales = reference.quantize_nvfp4(v, 4.0, is_sf_swizzled_layout=False)
    >>> packed[0, :2].tolist(), scales.astype(float).tolist()
    ([199, 2], [[2.0]])
    >>> reference.dequantize_nvfp4(packed, scales, 4.0, v.shape, is_sf_swizzled_layout=False)[0, :4].tolist()
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
    if is_sf_swizzled_layout:
        return packed, nvfp4_swizzled_scales(scale_fp8)
    return packed, scale_fp8


def dequantize_nvfp4(
    packed: ArrayLike,
    scales: ArrayLike,
    global_scale: float,
    shape: tuple[int, ...],
    *,
    is_sf_swizzled_layout: bool = True,
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
    is_sf_swizzled_layout : bool
        Whether ``scales`` are in the 128 x 4 swizzled layout (the merges' keyword of the same
        name, FlashInfer's and vLLM's).

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
    >>> reference.dequantize_nvfp4(packed, scales, 2.0, (16,), is_sf_swizzled_layout=False)[:2].tolist()
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
    if is_sf_swizzled_layout:
        block_scales = nvfp4_scales_from_swizzled(block_scales, rows, blocks)
    elif block_scales.shape != (rows, blocks):
        raise ValueError(
            f"scales: expected shape {(rows, blocks)} for values of shape {shape}, got {block_scales.shape}"
        )
    codes = np.stack([codes_bytes & 0xF, codes_bytes >> 4], axis=-1).reshape(rows, blocks, NVFP4_BLOCK)
    magnitude = np.asarray(E2M1_VALUES)[codes & 7]
    values = np.where(codes & 8, -magnitude, magnitude)
    out = values * block_scales.astype(np.float64)[..., None] / float(np.float32(global_scale))  # exact, then one rounding
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
