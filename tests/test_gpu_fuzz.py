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


@st.composite
def _empty_splits(draw):
    """N-way states some of which are empty splits: a finite but tiny LSE and NaN values."""
    tokens = draw(st.integers(1, 40))
    heads = draw(st.integers(1, 5))
    head_size = draw(st.sampled_from([8, 16, 64, 128]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    num_states = draw(st.integers(2, 20))
    empty = draw(st.lists(st.integers(0, num_states - 1), min_size=1, max_size=num_states - 1, unique=True))
    tiny = draw(st.sampled_from([-200.0, -1000.0, -3.0e38, float(-np.finfo(np.float32).max)]))  # -200: 0 in float32 only
    packed = draw(st.booleans())
    ragged = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return tokens, heads, head_size, dtype, num_states, tuple(empty), tiny, packed, ragged, seed


@settings(max_examples=60, deadline=None)
@given(_empty_splits())
def test_empty_splits_with_tiny_lses_and_nan_values_never_leak(case):
    """Wherever an empty split is folded (first, between, last; split rows or not), it adds nothing."""
    import cupy

    from cupy_merge import _tuning

    tokens, heads, head_size, dtype, num_states, empty, tiny, packed, ragged, seed = case
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((num_states, tokens, heads, head_size)).astype(np.float32)
    s = (rng.standard_normal((num_states, heads, tokens)) * 4).astype(np.float32)
    v[list(empty)] = np.nan
    s[list(empty)] = tiny
    tuning = _tuning.DEFAULT if packed else _tuning.DEFAULT.replace(packed_kernels=False)
    device_v = to_device(v, dtype)
    with _tuning.use(tuning):
        if ragged:  # token t's states are rows t * num_states ...
            rows = device_v.transpose(1, 0, 2, 3).reshape(-1, heads, head_size)
            lse = cupy.asarray(np.ascontiguousarray(s.transpose(1, 2, 0).reshape(heads, -1)))
            indptr = cupy.arange(0, tokens * num_states + 1, num_states, dtype=cupy.int32)
            out, out_lse = cm.merge_states_varlen(rows, lse, indptr)
        else:
            out, out_lse = cm.merge_states(device_v, cupy.asarray(s))
    want_v, want_s = reference.merge_states(to_host(device_v), s)
    got_v = to_host(out)
    assert np.isfinite(got_v).all(), "an empty split's NaN values leaked"
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert relative_error(got_v, want_v) <= tolerance
    np.testing.assert_allclose(to_host(out_lse), want_s, rtol=1e-5, atol=1e-5)


class _Interface:
    """A bare __cuda_array_interface__ producer, read-only or not."""

    def __init__(self, array, read_only):
        interface = dict(array.__cuda_array_interface__)
        interface["data"] = (interface["data"][0], read_only)
        self.__cuda_array_interface__ = interface
        self._array = array


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from([8, 24, 64]), st.booleans(), st.booleans(),
       st.integers(0, 2**32 - 1))  # fmt: skip
def test_producers_and_byte_strides_are_read_or_refused_never_misread(tokens, heads, head_size, read_only,
                                                                         odd_stride, seed):  # fmt: skip
    """Any __cuda_array_interface__ producer is read; a read-only one is never written; a view whose
    byte strides are not whole elements is refused by name before anything is launched."""
    import cupy

    rng = np.random.default_rng(seed)
    v_a, v_b = (cupy.asarray(rng.standard_normal((tokens, heads, head_size)).astype(np.float32)) for _ in range(2))
    s_a, s_b = (cupy.asarray(rng.standard_normal((heads, tokens)).astype(np.float32)) for _ in range(2))
    out = cupy.full((tokens, heads, head_size), 7.0, dtype=cupy.float32)
    target = _Interface(out, read_only)
    if odd_stride:
        memory = cupy.zeros(heads * (4 * tokens + 2), dtype=cupy.uint8)
        s_a = cupy.ndarray((heads, tokens), cupy.float32, memptr=memory.data, strides=(4 * tokens + 2, 4))
        with pytest.raises(ValueError, match="^prefix_lse: expected strides that are whole elements"):
            cm.merge_attn_states(target, _Interface(v_a, True), s_a, v_b, s_b)
    elif read_only:
        with pytest.raises(TypeError, match="^output: a read-only array"):
            cm.merge_attn_states(target, _Interface(v_a, True), s_a, v_b, s_b)
    else:
        cm.merge_attn_states(target, _Interface(v_a, True), s_a, v_b, s_b)
        want, _ = reference.merge_state(v_a.get(), s_a.get(), v_b.get(), s_b.get())
        assert relative_error(to_host(out), want) <= 1e-5
        return
    cupy.cuda.Device().synchronize()
    assert (out == 7.0).all(), "a refused call wrote its output"
