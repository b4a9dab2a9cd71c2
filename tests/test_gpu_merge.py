"""The two-way merge on a GPU against the float64 reference.

Tolerances, as norm-relative error ||got - ref|| / ||ref||, where the reference
is computed from the very values the kernel read (inputs already rounded):
* float32: 1e-5. Arithmetic is float32 (exp, one division, one FMA per
  element); its error is a few ulp, about 1e-7, so 1e-5 leaves room and still
  catches any wrong weight or index.
* float16 / bfloat16: 1e-2. The only extra error is the final rounding of each
  output element to the 16-bit type: at most 2^-11 (float16) and 2^-9
  (bfloat16) relative, well under 1e-2; a wrong weight shows as 1e-1 or more.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import backend_for, fill_nan, relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def _lse(rng, heads, tokens):
    # Spread of +-8 makes the weights range from near 0 to near 1.
    return (rng.standard_normal((heads, tokens)) * 8).astype(np.float32)


def _random_states(rng, tokens, heads, head_size, dtype, backend):
    v_a = to_device(rng.standard_normal((tokens, heads, head_size)), dtype, backend)
    v_b = to_device(rng.standard_normal((tokens, heads, head_size)), dtype, backend)
    s_a = to_device(_lse(rng, heads, tokens), "float32", backend)
    s_b = to_device(_lse(rng, heads, tokens), "float32", backend)
    return v_a, s_a, v_b, s_b


def _expect_merged(out, out_lse, v_a, s_a, v_b, s_b, dtype):
    """``out``/``out_lse`` hold the merge of the host copies of the inputs, every element written."""
    want_v, want_s = reference.merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    got_v, got_s = to_host(out), to_host(out_lse)
    assert np.isfinite(got_v).all(), "an output element was not written (NaN poison survived)"
    assert np.isfinite(got_s).all(), "an output LSE was not written"
    assert relative_error(got_v, want_v) <= TOLERANCE[dtype]
    assert relative_error(got_s, want_s) <= 1e-6


def _empty_like(v, s):
    out, out_lse = (v.clone(), s.clone()) if hasattr(v, "clone") else (v.copy(), s.copy())
    fill_nan(out)
    fill_nan(out_lse)
    return out, out_lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("heads", [4, 8, 16, 32])
@pytest.mark.parametrize("tokens", [256, 512, 613, 1024, 1536, 4096])
def test_merge_matches_reference_over_the_seed_grid(rng, tokens, heads, head_size, dtype):
    states = _random_states(rng, tokens, heads, head_size, dtype, backend_for(dtype))
    out, out_lse = _empty_like(states[0], states[1])
    cm.merge_state(*states, out=out, out_lse=out_lse)
    _expect_merged(out, out_lse, *states, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [1, 7, 72, 100, 192, 576])
def test_any_head_size_is_merged(rng, head_size, dtype):
    states = _random_states(rng, 37, 5, head_size, dtype, backend_for(dtype))
    out, out_lse = _empty_like(states[0], states[1])
    cm.merge_attn_states(out, *states, output_lse=out_lse)
    _expect_merged(out, out_lse, *states, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_offset", [0, 1, 3])
def test_strided_views_cut_from_larger_buffers(rng, dtype, head_offset):
    backend = backend_for(dtype)
    tokens, heads, head_size = 33, 4, 64

    def view(buffer):
        return buffer[1 : 1 + tokens, 1 : 1 + heads, head_offset : head_offset + head_size]

    big = [
        to_device(rng.standard_normal((tokens + 2, heads + 3, head_size + 5)), dtype, backend)
        for _ in range(3)
    ]
    v_a, v_b, out = view(big[0]), view(big[1]), view(big[2])
    fill_nan(out)
    s_a = to_device(_lse(rng, heads * 2, tokens * 3), "float32", backend)[::2, ::3]
    s_b = to_device(_lse(rng, heads, tokens), "float32", backend)
    out_lse = to_device(np.zeros((heads, tokens)), "float32", backend)
    fill_nan(out_lse)
    outside_before = to_host(big[2]).copy()
    cm.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    _expect_merged(out, out_lse, v_a, s_a, v_b, s_b, dtype)
    outside_after = to_host(big[2])
    mask = np.ones(outside_after.shape, dtype=bool)
    mask[1 : 1 + tokens, 1 : 1 + heads, head_offset : head_offset + head_size] = False
    np.testing.assert_array_equal(outside_after[mask], outside_before[mask])


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_major_lse_is_passed_as_its_transpose(rng, dtype):
    backend = backend_for(dtype)
    tokens, heads = 100, 8
    v_a, _, v_b, _ = _random_states(rng, tokens, heads, 128, dtype, backend)
    s_a = to_device(_lse(rng, tokens, heads), "float32", backend)  # [tokens, heads]
    s_b = to_device(_lse(rng, tokens, heads), "float32", backend)
    out_lse_token_major = to_device(np.zeros((tokens, heads)), "float32", backend)
    fill_nan(out_lse_token_major)
    v, _ = cm.merge_state(v_a, s_a.T, v_b, s_b.T, out_lse=out_lse_token_major.T)
    _expect_merged(v, out_lse_token_major.T, v_a, s_a.T, v_b, s_b.T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_inf_and_nan_pattern_follows_the_reference(rng, dtype):
    tokens, heads, head_size = 64, 7, 32
    backend = backend_for(dtype)
    specials = np.array([0.0, -np.inf, np.inf, np.nan], dtype=np.float32)
    # Every pair of (finite, -inf, +inf, NaN) for (s_a, s_b) appears in some row.
    pattern_a = np.resize(np.repeat(np.arange(4), 4), (heads, tokens))
    pattern_b = np.resize(np.tile(np.arange(4), 4), (heads, tokens))
    lse_a = np.where(pattern_a == 0, _lse(rng, heads, tokens), specials[pattern_a])
    lse_b = np.where(pattern_b == 0, _lse(rng, heads, tokens), specials[pattern_b])
    v_a = rng.standard_normal((tokens, heads, head_size))
    v_b = rng.standard_normal((tokens, heads, head_size))
    v_b[pattern_b.T == 1] = np.nan  # values of an empty state are garbage and must be ignored
    dev = [
        to_device(x, d, backend)
        for x, d in ((v_a, dtype), (lse_a, "float32"), (v_b, dtype), (lse_b, "float32"))
    ]
    v, s = cm.merge_state(*dev)
    want_v, want_s = reference.merge_state(*(to_host(x) for x in dev))
    got_v, got_s = to_host(v), to_host(s)
    np.testing.assert_array_equal(np.isnan(got_v), np.isnan(want_v))
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(want_s))
    np.testing.assert_array_equal(got_s[np.isinf(want_s)], want_s[np.isinf(want_s)])
    both_empty = np.isinf(want_s) & (want_s < 0)
    assert np.all(got_v[both_empty.T] == 0.0)
    finite = np.isfinite(want_v)
    assert relative_error(got_v[finite], want_v[finite]) <= TOLERANCE[dtype]
    finite_s = np.isfinite(want_s)
    assert relative_error(got_s[finite_s], want_s[finite_s]) <= 1e-6


@pytest.mark.parametrize("alias", ["out=v_a", "out=v_b", "out_lse=s_a", "out_lse=s_b", "both"])
def test_in_place_merge_into_an_input(rng, alias):
    dtype = "bfloat16"
    states = list(_random_states(rng, 300, 8, 128, dtype, backend_for(dtype)))
    want_v, want_s = reference.merge_state(*(to_host(x) for x in states))
    kwargs = {
        "out=v_a": {"out": states[0]},
        "out=v_b": {"out": states[2]},
        "out_lse=s_a": {"out_lse": states[1]},
        "out_lse=s_b": {"out_lse": states[3]},
        "both": {"out": states[2], "out_lse": states[1]},
    }[alias]
    v, s = cm.merge_state(*states, **kwargs)
    for name, target in kwargs.items():
        assert (v if name == "out" else s) is target
    assert relative_error(to_host(v), want_v) <= TOLERANCE[dtype]
    assert relative_error(to_host(s), want_s) <= 1e-6


def test_a_nan_value_affects_only_its_own_element(rng):
    v_a, s_a, v_b, s_b = _random_states(rng, 50, 4, 64, "float32", "cupy")
    v_a[10, 2, 5] = np.nan
    v, s = cm.merge_state(v_a, s_a, v_b, s_b)
    got = to_host(v)
    assert np.isnan(got[10, 2, 5])
    got[10, 2, 5] = 0
    assert np.isfinite(got).all() and np.isfinite(to_host(s)).all()


@pytest.mark.parametrize("tokens, heads", [(0, 8), (8, 0)])
def test_zero_tokens_or_heads_is_a_no_op(rng, tokens, heads):
    states = _random_states(rng, tokens, heads, 64, "float16", "cupy")
    v, s = cm.merge_state(*states)
    assert v.shape == (tokens, heads, 64) and s.shape == (heads, tokens)


def test_tensors_over_two_to_the_31_elements(rng):
    import cupy

    tokens, heads, head_size = 2**17 + 3, 128, 128  # 2^31 + 49152 elements each
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 6 * tokens * heads * head_size * 2:
        pytest.skip("not enough GPU memory for three 4 GiB arrays")
    v_a = cupy.empty((tokens, heads, head_size), dtype=np.float16)
    v_b = cupy.empty_like(v_a)
    for v in (v_a, v_b):
        v[...] = cupy.random.standard_normal(v.shape, dtype=cupy.float32)
    s_a = cupy.asarray(_lse(rng, heads, tokens))
    s_b = cupy.asarray(_lse(rng, heads, tokens))
    out = cupy.full_like(v_a, np.nan)
    cm.merge_state(v_a, s_a, v_b, s_b, out=out)
    rows = np.r_[0:2, tokens // 2, tokens - 3 : tokens]  # the last rows sit past 2^31 elements
    want, _ = reference.merge_state(
        to_host(v_a[rows]), to_host(s_a[:, rows]), to_host(v_b[rows]), to_host(s_b[:, rows])
    )
    assert relative_error(to_host(out[rows]), want) <= TOLERANCE["float16"]
    assert not bool(cupy.isnan(out).any())


@pytest.mark.parametrize("given", [None, "out", "out_lse"])
def test_repeated_allocating_calls_get_fresh_outputs_each_time(rng, given):
    # Repeats replay the first call's launch with new output pointers: every allocated
    # result is its own and keeps its values while later calls run on new data.
    import cupy

    tokens, heads, head_size = 19, 4, 64
    buffers = {
        "out": cupy.empty((tokens, heads, head_size), np.float16),
        "out_lse": cupy.empty((heads, tokens), np.float32),
    }
    results = []
    for _ in range(3):
        states = _random_states(rng, tokens, heads, head_size, "float16", "cupy")
        v, s = cm.merge_state(*states, **({given: buffers[given]} if given else {}))
        want = reference.merge_state(*(to_host(x) for x in states))
        results.append((v, s, v.copy(), s.copy(), *want))
    for v, s, v_then, s_then, want_v, want_s in results:
        assert relative_error(to_host(v_then), want_v) <= TOLERANCE["float16"]
        assert relative_error(to_host(s_then), want_s) <= 1e-6
        if given != "out":
            assert relative_error(to_host(v), want_v) <= TOLERANCE["float16"]  # not overwritten since
        if given != "out_lse":
            assert relative_error(to_host(s), want_s) <= 1e-6
    allocated = [r[0] for r in results] if given != "out" else [r[1] for r in results]
    assert len({x.data.ptr for x in allocated}) == 3
