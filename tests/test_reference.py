"""The float64 reference: the merge identity it exists for, and its rules for empty and NaN rows."""

from __future__ import annotations

import itertools

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


def _chunk_states(q, k, v, edges):
    parts = [reference.attention(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


@pytest.mark.parametrize("chunks", [1, 2, 3, 8, 64])
def test_merging_n_chunks_of_the_kv_equals_attention_over_all_of_it(rng, chunks):
    q, k, v = _random_qkv(rng, tokens=5, heads=3, head_size=16, kv_len=200)
    edges = np.sort(np.concatenate([[0, 200], rng.integers(0, 201, size=chunks - 1)]))  # some chunks empty
    v_parts, s_parts = _chunk_states(q, k, v, edges)
    merged_out, merged_lse = reference.merge_states(v_parts, s_parts)
    full_out, full_lse = reference.attention(q, k, v)
    np.testing.assert_allclose(merged_out, full_out, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(merged_lse, full_lse, rtol=1e-12)


def test_base_2_lse_gives_the_same_merge_in_base_2(rng):
    v = rng.standard_normal((4, 6, 2, 8))
    s = rng.standard_normal((4, 2, 6)) * 5
    out_e, lse_e = reference.merge_states(v, s)
    out_2, lse_2 = reference.merge_states(v, s / np.log(2), lse_base=2)
    np.testing.assert_allclose(out_2, out_e, rtol=1e-13)
    np.testing.assert_allclose(lse_2 * np.log(2), lse_e, rtol=1e-13)


def test_zero_states_give_zero_and_neg_inf():
    out, lse = reference.merge_states(np.zeros((0, 3, 2, 4)), np.zeros((0, 2, 3)))
    assert out.shape == (3, 2, 4) and np.all(out == 0) and np.all(lse == -np.inf)


def test_ragged_merge_equals_attention_per_token(rng):
    heads, head_size = 2, 8
    counts = [2, 0, 5, 1]
    rows_v, rows_s, wanted = [], [], []
    for count in counts:
        q, k, v = _random_qkv(rng, tokens=1, heads=heads, head_size=head_size, kv_len=10 * count)
        edges = np.linspace(0, 10 * count, count + 1).astype(int)
        if count:
            v_parts, s_parts = _chunk_states(q, k, v, edges)
            rows_v.append(v_parts[:, 0])
            rows_s.append(s_parts[:, :, 0])
        wanted.append(reference.attention(q, k, v))
    indptr = np.concatenate([[0], np.cumsum(counts)])
    out, lse = reference.merge_states_varlen(np.concatenate(rows_v), np.concatenate(rows_s).T, indptr)
    for token, (want_out, want_lse) in enumerate(wanted):
        np.testing.assert_allclose(out[token], want_out[0], rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(lse[:, token], want_lse[:, 0], rtol=1e-12)
    assert np.all(out[1] == 0) and np.all(lse[:, 1] == -np.inf)
