"""The NVFP4 reference without a GPU: e2m1 rounding, block scales, special values, packing, the
128 x 4 scale swizzle, the format's error, and bit-exactness with torchao's quantiser where it imports."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_merge import reference

ml_dtypes = pytest.importorskip("ml_dtypes")

E4M3 = ml_dtypes.float8_e4m3fn


def codes_of(packed: np.ndarray) -> np.ndarray:
    """The e2m1 codes of packed bytes, [rows, K]: the low nibble is the first value."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def scale_bits(scales: np.ndarray) -> np.ndarray:
    return scales.view(np.uint8)


def one_block(*values: float) -> np.ndarray:
    """A block whose amax is 6, so that with global_scale 1 its scale is exactly 1 and each value is
    rounded to e2m1 as it is: 6 first, then ``values``, then zeros."""
    block = np.zeros(16, dtype=np.float32)
    block[0] = 6.0
    block[1 : 1 + len(values)] = values
    return block


def e2m1(code: int) -> float:
    magnitude = reference.E2M1_VALUES[code & 7]
    return -magnitude if code & 8 else magnitude


# -- e2m1 rounding --------------------------------------------------------------------------------

# Each halfway point between neighbouring e2m1 magnitudes, and the code that a tie goes to (the even one).
TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize(("midpoint", "even"), TIES)
def test_e2m1_rounds_to_nearest_with_ties_to_even_at_every_boundary(midpoint, even):
    below = np.nextafter(np.float32(midpoint), np.float32(0))
    above = np.nextafter(np.float32(midpoint), np.float32(7))
    lower = reference.E2M1_VALUES.index(max(m for m in reference.E2M1_VALUES if m < midpoint))
    x = one_block(midpoint, below, above, -midpoint, -below, -above)
    packed, scales = reference.quantize_nvfp4(x[None], 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[1.0]]
    up = lower + 1
    assert codes_of(packed)[0, :7].tolist() == [7, even, lower, up, 8 | even, 8 | lower, 8 | up]


def test_every_e2m1_value_is_kept_exactly():
    magnitudes = list(reference.E2M1_VALUES)
    x = one_block(*magnitudes, *(-m for m in magnitudes[1:]))
    packed, _ = reference.quantize_nvfp4(x[None], 1.0, is_sf_swizzled_layout=False)
    assert codes_of(packed)[0, :16].tolist() == [7, *range(8), *range(9, 16)]


def test_values_past_6_saturate():
    # amax / 6 = 1.0624 rounds down to the e4m3 scale 1.0, so the largest value scales to 6.37: saturated to 6.
    x = one_block(-6.3744, 6.2, 5.9)
    x[0] = 6.3744
    packed, scales = reference.quantize_nvfp4(x[None], 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[1.0]]
    assert codes_of(packed)[0, :4].tolist() == [7, 15, 7, 7]
    # A block past what the largest scale (448) covers: every value saturates.
    packed, scales = reference.quantize_nvfp4(np.full((1, 16), -1e6), 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[448.0]] and (codes_of(packed) == 15).all()


# -- block scales ---------------------------------------------------------------------------------


def test_the_block_scale_is_amax_over_6_times_the_global_scale_rounded_to_e4m3():
    # amax 3 with global scale 20: 3 / 6 * 20 = 10, an e4m3 value; 3.3 / 6 * 20 = 11 rounds to 11 (e4m3 has
    # 3 mantissa bits: 8, 9, 10, ..., 15 are exact); 3.45 / 6 * 20 = 11.5 is a tie, to even: 12.
    x = np.zeros((3, 16))
    x[:, 0] = [3.0, 3.3, 3.45]
    _, scales = reference.quantize_nvfp4(x, 20.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).ravel().tolist() == [10.0, 11.0, 12.0]


def test_each_16_values_of_a_row_get_their_own_scale():
    x = np.zeros((2, 48))
    x[0, 5], x[0, 20], x[0, 47], x[1, 0] = 6.0, -12.0, 0.75, 3.0
    packed, scales = reference.quantize_nvfp4(x, 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[1.0, 2.0, 0.125], [0.5, 2.0**-6, 2.0**-6]]
    codes = codes_of(packed)
    assert codes[0, 5] == 7 and codes[0, 20] == 15 and codes[0, 47] == 7 and codes[1, 0] == 7


# -- special values -------------------------------------------------------------------------------


def test_nan_makes_its_block_nan_and_leaves_the_others_alone():
    x = np.ones((1, 32))
    x[0, 3] = np.nan
    packed, scales = reference.quantize_nvfp4(x, 1.0, is_sf_swizzled_layout=False)
    assert scale_bits(scales).tolist() == [[0x7F, 0x23]]  # NaN; 1 / 6 rounded to e4m3 (1.375 * 2**-3)
    assert (codes_of(packed)[0, :16] == 0).all()
    out = reference.dequantize_nvfp4(packed, scales, 1.0, x.shape, is_sf_swizzled_layout=False)
    assert np.isnan(out[0, :16]).all() and np.isfinite(out[0, 16:]).all()


def test_infinities_saturate_to_6_with_the_largest_scale():
    x = np.zeros((1, 16))
    x[0, :4] = [np.inf, -np.inf, 448.0 * 3, -1.0]
    packed, scales = reference.quantize_nvfp4(x, 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[448.0]]
    # 1344 / 448 = 3; -1 / 448 rounds to -0, which keeps its sign.
    assert codes_of(packed)[0, :5].tolist() == [7, 15, 5, 8, 0]


def test_an_all_zero_block_gets_the_floor_scale_and_zeros_keeping_their_sign():
    x = np.zeros((1, 16))
    x[0, 1::2] = -0.0
    x[0, 2] = 1e-30  # a tiny value: its block's scale would be far below the floor
    packed, scales = reference.quantize_nvfp4(x, 1.0, is_sf_swizzled_layout=False)
    assert scales.astype(float).tolist() == [[reference.NVFP4_SCALE_FLOOR]]
    assert codes_of(packed)[0].tolist() == [0, 8] * 8
    out = reference.dequantize_nvfp4(packed, scales, 1.0, x.shape, is_sf_swizzled_layout=False)
    assert (out == 0).all() and np.signbit(out[0]).tolist() == [False, True] * 8


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, -np.inf, 1e-45, 1e39, "two", None])
def test_a_bad_global_scale_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="global_scale"):
        reference.quantize_nvfp4(np.ones((1, 16)), bad)
    with pytest.raises(ValueError, match="global_scale"):
        reference.dequantize_nvfp4(
            np.zeros((1, 8), np.uint8), np.zeros((1, 1), np.uint8), bad, (1, 16), is_sf_swizzled_layout=False
        )


@pytest.mark.parametrize("shape", [(2, 24), (3, 4, 8), (17,), ()])
def test_a_head_size_not_a_multiple_of_16_is_refused_naming_it(shape):
    with pytest.raises(ValueError, match="head size"):
        reference.quantize_nvfp4(np.ones(shape), 1.0)
    with pytest.raises(ValueError, match="head size"):
        reference.dequantize_nvfp4(np.zeros((1, 8), np.uint8), np.zeros((1, 1), np.uint8), 1.0, shape)


def test_dequantize_refuses_arrays_of_the_wrong_shape_or_dtype():
    packed, scales = reference.quantize_nvfp4(np.ones((3, 32)), 1.0)
    with pytest.raises(ValueError, match="packed"):
        reference.dequantize_nvfp4(packed[:2], scales, 1.0, (3, 32))
    with pytest.raises(ValueError, match="scales"):
        reference.dequantize_nvfp4(packed, scales[:64], 1.0, (3, 32))
    with pytest.raises(ValueError, match="scales"):
        reference.dequantize_nvfp4(packed, scales.astype(np.float32), 1.0, (3, 32))


# -- packing --------------------------------------------------------------------------------------


def test_two_values_a_byte_the_first_in_the_low_nibble():
    x = one_block(0.5, -1.0, 1.5, 2.0, 3.0, -4.0, 0.0)
    packed, _ = reference.quantize_nvfp4(x[None], 1.0, is_sf_swizzled_layout=False)
    # codes 7, 1 | 10, 3 | 4, 5 | 14, 0 | 0, ...: byte j = code(2j) | code(2j + 1) << 4
    assert packed.dtype == np.uint8 and packed.shape == (1, 8)
    assert packed[0].tolist() == [0x17, 0x3A, 0x54, 0x0E, 0, 0, 0, 0]


def test_leading_dimensions_are_rows():
    x = np.random.default_rng().standard_normal((3, 5, 32))
    packed, scales = reference.quantize_nvfp4(x, 7.0, is_sf_swizzled_layout=False)
    flat_packed, flat_scales = reference.quantize_nvfp4(x.reshape(15, 32), 7.0, is_sf_swizzled_layout=False)
    assert packed.shape == (15, 16) and scales.shape == (15, 2)
    assert (packed == flat_packed).all() and (scale_bits(scales) == scale_bits(flat_scales)).all()
    np.testing.assert_array_equal(
        reference.dequantize_nvfp4(packed, scales, 7.0, x.shape, is_sf_swizzled_layout=False),
        reference.dequantize_nvfp4(flat_packed, flat_scales, 7.0, (15, 32), is_sf_swizzled_layout=False).reshape(x.shape),
    )


# -- the 128 x 4 swizzle --------------------------------------------------------------------------


def swizzled_by_definition(scales: np.ndarray) -> np.ndarray:
    """cuBLAS's block-scaling-factors layout written out element by element: 512-byte tiles of 128 rows
    by 4 columns, row tiles outermost; in a tile, row r and column c at 16 * (r % 32) + 4 * (r // 32) + c."""
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(padded_rows * padded_cols, dtype=scales.dtype)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (padded_cols // 4) + c // 4
            out[512 * tile + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4] = scales[r, c]
    return out


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (128, 4), (129, 5), (300, 8), (37, 13), (256, 2)])
def test_the_swizzle_matches_the_layout_written_out_and_inverts(rows, cols):
    scales = np.random.default_rng().integers(1, 255, (rows, cols), dtype=np.uint8)
    swizzled = reference.nvfp4_swizzled_scales(scales)
    assert swizzled.shape == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    np.testing.assert_array_equal(swizzled.ravel(), swizzled_by_definition(scales))
    np.testing.assert_array_equal(reference.nvfp4_scales_from_swizzled(swizzled, rows, cols), scales)


def test_quantize_writes_the_swizzled_scales_and_dequantize_reads_them():
    x = np.random.default_rng().standard_normal((130, 80))
    packed, row_major = reference.quantize_nvfp4(x, 3.0, is_sf_swizzled_layout=False)
    packed_too, swizzled = reference.quantize_nvfp4(x, 3.0)
    assert (packed == packed_too).all() and swizzled.dtype == E4M3 and swizzled.shape == (256, 8)
    np.testing.assert_array_equal(
        scale_bits(swizzled), scale_bits(reference.nvfp4_swizzled_scales(row_major))
    )
    np.testing.assert_array_equal(
        reference.dequantize_nvfp4(packed, swizzled, 3.0, x.shape),
        reference.dequantize_nvfp4(packed, row_major, 3.0, x.shape, is_sf_swizzled_layout=False),
    )
    # uint8 bits are taken for the scales as well
    np.testing.assert_array_equal(
        reference.dequantize_nvfp4(packed, scale_bits(swizzled), 3.0, x.shape),
        reference.dequantize_nvfp4(packed, swizzled, 3.0, x.shape),
    )


# -- the format's error ---------------------------------------------------------------------------


def assert_within_the_format(x: np.ndarray, global_scale: float) -> None:
    """Each value dequantises to within half an e2m1 step (at its scaled magnitude) of itself, the value
    rounded to float32 first, allowing float32's rounding of the scaling. Holds for blocks the largest
    scale covers (amax / 6 * global_scale <= 448, so that a block overflows 6 by 1 / 16 at most)."""
    packed, scales = reference.quantize_nvfp4(x, global_scale, is_sf_swizzled_layout=False)
    out = reference.dequantize_nvfp4(packed, scales, global_scale, x.shape, is_sf_swizzled_layout=False)
    x32 = x.astype(np.float32).astype(np.float64)
    g = float(np.float32(global_scale))
    step = np.repeat(scales.astype(np.float64) / g, 16, axis=-1).reshape(x.shape)  # dequantised e2m1 unit
    scaled = np.abs(x32) / step
    half_step = np.where(scaled < 2, 0.25, np.where(scaled < 4, 0.5, 1.0))
    bound = half_step * step + 1e-6 * np.abs(x32)
    assert (np.abs(out - x32) <= bound).all(), np.max(np.abs(out - x32) / bound)


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 300.0])
def test_dequantised_values_are_within_the_format_error_of_the_input(magnitude):
    rng = np.random.default_rng()
    x = rng.standard_normal((rng.integers(1, 200), 16 * rng.integers(1, 9))) * magnitude
    x[x == 0] = magnitude  # never zeros
    global_scale = 448.0 * 6.0 / np.abs(x).max()  # the whole e4m3 range, as the ecosystem calibrates it
    assert_within_the_format(x, global_scale)
    # and the error against float64 itself: at most an e2m1 step of the block's largest value, over 6
    packed, scales = reference.quantize_nvfp4(x, global_scale, is_sf_swizzled_layout=False)
    out = reference.dequantize_nvfp4(packed, scales, global_scale, x.shape, is_sf_swizzled_layout=False)
    amax = np.abs(x.reshape(x.shape[0], -1, 16)).max(axis=-1, keepdims=True)
    assert (np.abs(out - x).reshape(amax.shape[0], -1, 16) <= amax / 6 * (1 + 2.0**-4) * (1 + 1e-6)).all()


# -- properties -----------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

FINITE = st.floats(-(2.0**100), 2.0**100, width=32)
SHAPES = st.tuples(st.integers(1, 6), st.integers(1, 4).map(lambda n: 16 * n))
GLOBAL_SCALES = st.floats(2.0**-100, 2.0**100, width=32)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, SHAPES, elements=FINITE), GLOBAL_SCALES)
def test_any_finite_values_dequantise_within_the_format_or_saturate(x, global_scale):
    packed, scales = reference.quantize_nvfp4(x, global_scale, is_sf_swizzled_layout=False)
    amax = np.abs(x.reshape(x.shape[0], -1, 16).astype(np.float64)).max(axis=-1)
    covered = amax / 6 * float(global_scale) <= 448 * (1 - 2.0**-20)
    scale = scales.astype(np.float64)
    assert (scale >= reference.NVFP4_SCALE_FLOOR).all() and (scale <= 448).all()
    # a covered block's scale is amax / 6 * global_scale to within e4m3's rounding (or the floor)
    wanted = np.maximum(amax / 6 * float(global_scale), reference.NVFP4_SCALE_FLOOR)
    assert (np.abs(scale - wanted) <= wanted * (2.0**-4 + 1e-6))[covered].all()
    rows = np.flatnonzero(covered.all(axis=1))
    if len(rows):
        assert_within_the_format(x[rows], float(global_scale))
    out = reference.dequantize_nvfp4(packed, scales, global_scale, x.shape, is_sf_swizzled_layout=False)
    assert (np.abs(out) <= 6 * 448 / float(np.float32(global_scale)) * (1 + 1e-12)).all()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, SHAPES, elements=FINITE), GLOBAL_SCALES)
def test_negating_the_input_flips_every_sign_bit_and_nothing_else(x, global_scale):
    packed, scales = reference.quantize_nvfp4(x, global_scale)
    negated, negated_scales = reference.quantize_nvfp4(-x, global_scale)
    assert (negated == packed ^ 0x88).all() and (scale_bits(negated_scales) == scale_bits(scales)).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(0, 20), st.randoms(use_true_random=False))
def test_the_swizzle_is_a_permutation_with_zero_padding_and_inverts(rows, cols, random):
    scales = np.array([random.randrange(1, 256) for _ in range(rows * cols)], dtype=np.uint8).reshape(
        rows, cols
    )
    swizzled = reference.nvfp4_swizzled_scales(scales)
    assert swizzled.size == -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert np.count_nonzero(swizzled) == scales.size
    assert sorted(swizzled[swizzled != 0].tolist()) == sorted(scales.ravel().tolist())
    np.testing.assert_array_equal(reference.nvfp4_scales_from_swizzled(swizzled.ravel(), rows, cols), scales)


# -- bit for bit with torchao ---------------------------------------------------------------------


def torchao_nvfp4():
    """torchao's NVFP4 tensor and torch, or a skip where torchao does not import (not installed, or
    built for another torch)."""
    try:
        import torch
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except ImportError as error:
        pytest.skip(f"torchao's NVFP4 reference does not import: {error}")
    return torch, NVFP4Tensor


def torchao_quantize(x: np.ndarray, global_scale: float, swizzled: bool) -> tuple[np.ndarray, np.ndarray]:
    """torchao's reference quantiser (NVFP4Tensor.to_nvfp4 without its Triton kernel), whose
    per-tensor scale is the reciprocal of the global scale, as torchao's own MSLK path converts it."""
    torch, NVFP4Tensor = torchao_nvfp4()
    per_tensor_scale = torch.tensor(np.float32(1.0) / np.float32(global_scale))
    t = NVFP4Tensor.to_nvfp4(
        torch.from_numpy(x.astype(np.float32)), 16, per_tensor_scale, is_swizzled_scales=swizzled
    )
    return t.qdata.view(torch.uint8).numpy(), t.scale.view(torch.uint8).numpy()


@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize(("rows", "k"), [(1, 16), (7, 48), (128, 64), (200, 272), (300, 1024)])
def test_bit_for_bit_with_torchao(rows, k, calibrated):
    rng = np.random.default_rng()
    for _ in range(5):
        x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-15, 15))).astype(np.float32)
        amax = np.abs(x).max()
        global_scale = 448.0 * 6.0 / amax if calibrated else np.exp(rng.uniform(-20, 20)) / amax
        for swizzled in (False, True):
            theirs_packed, theirs_scales = torchao_quantize(x, global_scale, swizzled)
            packed, scales = reference.quantize_nvfp4(x, global_scale, is_sf_swizzled_layout=swizzled)
            np.testing.assert_array_equal(packed, theirs_packed)
            np.testing.assert_array_equal(scale_bits(scales).ravel(), theirs_scales.ravel())


def test_special_values_bit_for_bit_with_torchao_and_nan_blocks_by_their_scale():
    x = np.random.default_rng().standard_normal((5, 64)).astype(np.float32)
    x[0, :16] = 0.0  # an all-zero block
    x[0, 16:32] = -0.0
    x[1, 3], x[1, 20] = np.inf, -np.inf
    x[2, :16] = 1e-30  # a block below the floor scale
    x[3, 40:48] = 1e30  # beyond the largest scale
    x[4, 33] = np.nan
    theirs_packed, theirs_scales = torchao_quantize(x, 5.0, False)
    packed, scales = reference.quantize_nvfp4(x, 5.0, is_sf_swizzled_layout=False)
    np.testing.assert_array_equal(scale_bits(scales), theirs_scales)
    nan_block = np.zeros_like(packed, dtype=bool)
    nan_block[4, 16:24] = True  # torchao writes an artefact of its cast there; the NaN scale decides
    np.testing.assert_array_equal(packed[~nan_block], theirs_packed[~nan_block])


def test_dequantised_like_torchao():
    torch, NVFP4Tensor = torchao_nvfp4()
    x = np.random.default_rng().standard_normal((130, 96)).astype(np.float32)
    global_scale = 448.0 * 6.0 / np.abs(x).max()
    per_tensor_scale = torch.tensor(np.float32(1.0) / np.float32(global_scale))
    theirs = NVFP4Tensor.to_nvfp4(torch.from_numpy(x), 16, per_tensor_scale, is_swizzled_scales=True)
    packed, scales = reference.quantize_nvfp4(x, global_scale)
    ours = reference.dequantize_nvfp4(packed, scales, global_scale, x.shape)
    np.testing.assert_allclose(ours, theirs.dequantize(torch.float32).numpy(), rtol=1e-6, atol=0)


def test_any_finite_values_bit_for_bit_with_torchao():
    torchao_nvfp4()  # skip here rather than inside every example
    _any_finite_values_bit_for_bit_with_torchao()


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, SHAPES, elements=FINITE), GLOBAL_SCALES, st.booleans())
def _any_finite_values_bit_for_bit_with_torchao(x, global_scale, swizzled):
    theirs_packed, theirs_scales = torchao_quantize(x, global_scale, swizzled)
    packed, scales = reference.quantize_nvfp4(x, global_scale, is_sf_swizzled_layout=swizzled)
    np.testing.assert_array_equal(packed, theirs_packed)
    np.testing.assert_array_equal(scale_bits(scales).ravel(), theirs_scales.ravel())
