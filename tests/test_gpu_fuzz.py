"""A property-based fuzz on a GPU: random shapes, strides, offsets, dtypes and inf/NaN LSEs against the reference."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

SPECIAL = [np.inf, -np.inf, np.nan]


@st.composite
def _merges(draw):
    tokens = draw(st.integers(0, 40))
    heads = draw(st.integers(1, 6))
    head_size = draw(st.sampled_from([1, 3, 8, 16, 24, 64, 72, 128, 256]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    out_dtype = draw(st.sampled_from([None, "float32", "float16", "bfloat16"]))
    num_states = draw(st.integers(0, 9))
    pad = (draw(st.integers(0, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 8)))
    transpose_lse = draw(st.booleans())
    specials = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return tokens, heads, head_size, dtype, out_dtype, num_states, pad, transpose_lse, specials, seed


@settings(max_examples=60, deadline=None)
@given(_merges())
def test_random_shapes_strides_dtypes_and_specials_follow_the_reference(case):
    """N states in views cut at random offsets of padded buffers, LSEs with inf/NaN, any output dtype."""
    import cupy

    tokens, heads, head_size, dtype, out_dtype, num_states, pad, transpose_lse, specials, seed = case
    rng = np.random.default_rng(seed)
    pad_t, pad_h, pad_d = pad
    offset = int(rng.integers(0, pad_d + 1))
    big = to_device(
        rng.standard_normal((num_states, tokens + pad_t, heads + pad_h, head_size + pad_d)), dtype
    )
    v = big[:, pad_t:, :heads, offset : offset + head_size]
    lse = (rng.standard_normal((num_states, heads, tokens)) * 6).astype(np.float32)
    flat = lse.reshape(-1)
    for index in rng.integers(0, max(flat.size, 1), size=specials if flat.size else 0):
        flat[index] = SPECIAL[int(rng.integers(0, 3))]
    if transpose_lse:
        s = cupy.asarray(np.ascontiguousarray(lse.transpose(0, 2, 1))).transpose(0, 2, 1)
    else:
        s = cupy.asarray(lse)
    out, out_lse = cm.merge_states(v, s, out_dtype=out_dtype)
    want_v, want_s = reference.merge_states(to_host(v), lse)
    got_v, got_s = to_host(out), to_host(out_lse)
    assert out.dtype.name == (out_dtype or dtype)
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(want_s))
    finite = np.isfinite(want_s)
    np.testing.assert_allclose(got_s[finite], want_s[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_s[~finite], want_s[~finite])
    rows_nan = np.isnan(want_v)
    np.testing.assert_array_equal(np.isnan(got_v), rows_nan)
    tolerance = 1e-5 if (out_dtype or dtype) == "float32" and dtype == "float32" else 1e-2
    assert relative_error(np.where(rows_nan, 0, got_v), np.where(rows_nan, 0, want_v)) <= tolerance
