"""The float64 reference: the merge identity it exists for, and its rules for empty and NaN rows."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_merge import reference


def _random_qkv(rng, tokens, heads, head_size, kv_len):
    q = rng.standard_normal((tokens, heads, head_size))
    k = rng.standard_normal((kv_len, heads, head_size))
    v = rng.standard_normal((kv_len, heads, head_size))
    return q, k, v


@pytest.mark.parametrize("split", [1, 17, 50, 99])
def test_merging_two_halves_of_the_kv_equals_attention_over_all_of_it(rng, split):
    q, k, v = _random_qkv(rng, tokens=7, heads=3, head_size=16, kv_len=100)
    full_out, full_lse = reference.attention(q, k, v)
    out_a, lse_a = reference.attention(q, k[:split], v[:split])
    out_b, lse_b = reference.attention(q, k[split:], v[split:])
    merged_out, merged_lse = reference.merge_state(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(merged_out, full_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged_lse, full_lse, rtol=1e-12)


def test_an_empty_piece_contributes_nothing(rng):
    q, k, v = _random_qkv(rng, tokens=4, heads=2, head_size=8, kv_len=10)
    full_out, full_lse = reference.attention(q, k, v)
    empty_out, empty_lse = reference.attention(q, k[:0], v[:0])
    assert np.all(empty_lse == -np.inf)
    merged_out, merged_lse = reference.merge_state(full_out, full_lse, empty_out, empty_lse)
    np.testing.assert_allclose(merged_out, full_out, rtol=1e-14)
    np.testing.assert_allclose(merged_lse, full_lse, rtol=1e-14)


def test_both_empty_states_give_zero_and_neg_inf(rng):
    v = rng.standard_normal((3, 2, 4))
    for empty in (-np.inf, np.inf):
        s = np.full((2, 3), empty)
        out, lse = reference.merge_state(v, s, v, s)
        assert np.all(out == 0.0)
        assert np.all(lse == -np.inf)


def test_pos_inf_lse_is_read_as_an_empty_row(rng):
    v_a, v_b = rng.standard_normal((2, 3, 2, 4))
    s_a = rng.standard_normal((2, 3))
    out, lse = reference.merge_state(v_a, s_a, v_b, np.full((2, 3), np.inf))
    np.testing.assert_allclose(out, v_a, rtol=1e-15)
    np.testing.assert_allclose(lse, s_a, rtol=1e-15)


def test_values_of_an_empty_state_are_ignored_even_when_nan(rng):
    v_a = rng.standard_normal((3, 2, 4))
    s_a = rng.standard_normal((2, 3))
    garbage = np.full_like(v_a, np.nan)
    out, _ = reference.merge_state(v_a, s_a, garbage, np.full((2, 3), -np.inf))
    np.testing.assert_allclose(out, v_a, rtol=1e-15)


def test_a_nan_lse_poisons_only_its_own_row(rng):
    v_a, v_b = rng.standard_normal((2, 3, 2, 4))
    s_a, s_b = rng.standard_normal((2, 2, 3))
    s_a[1, 2] = np.nan
    out, lse = reference.merge_state(v_a, s_a, v_b, s_b)
    assert np.isnan(lse[1, 2]) and np.all(np.isnan(out[2, 1]))
    lse[1, 2] = 0.0
    out[2, 1] = 0.0
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(out))


def test_merge_is_stable_for_large_lse(rng):
    v_a, v_b = rng.standard_normal((2, 3, 2, 4))
    s = np.full((2, 3), 1e4)
    out, lse = reference.merge_state(v_a, s, v_b, s)
    np.testing.assert_allclose(out, (v_a + v_b) / 2, rtol=1e-12)
    np.testing.assert_allclose(lse, 1e4 + np.log(2), rtol=1e-15)
