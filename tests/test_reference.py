"""The float64 reference: the merge identity it exists for, and its rules for empty and NaN rows."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from cupy_merge import _array_rules, _arrays, _dispatch, _tuning, reference
from cupy_merge._ops import MERGE_STATE, MERGE_STATES, MERGE_STATES_VARLEN


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


@pytest.mark.parametrize("gap, empty", [(200.0, True), (120.0, True), (90.0, False), (40.0, False)])
def test_a_state_whose_weight_underflows_in_float32_is_empty_even_with_nan_values(gap, empty):
    """The kernels compute weights in float32: one below its smallest subnormal (a gap of more than
    ~103) is 0 there, and the reference agrees, rather than multiply NaN values by 1e-87."""
    v, s = np.ones((2, 1, 1, 4)), np.array([[[0.0]], [[-gap]]])
    v[1] = np.nan
    merged_v, merged_s = reference.merge_states(v, s)
    assert np.isfinite(merged_v).all() == empty and merged_s.item() == pytest.approx(0.0, abs=1e-12)
    grads = reference.merge_states_backward(v, s, np.ones((1, 1, 4)), np.ones((1, 1)))
    assert np.isfinite(grads[1]).all() == empty  # ds_i reads v_i; dV_i = w_i dV does not
    if empty:
        assert (merged_v == 1).all() and (grads[0][1] == 0).all() and grads[1][1].item() == 0


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
    # Relative to the whole result: an element near zero after cancellation differs by a few
    # float64 ulps of the larger terms (seen once on random data, 2e-13 of itself).
    assert np.linalg.norm(out_2 - out_e) <= 1e-13 * np.linalg.norm(out_e)
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


# -- the GPU merges' rules ------------------------------------------------------------------------


def _gpu_error(operation, **shapes):
    """The exception the GPU merge raises for operands of these shapes (float16 values, float32
    LSEs, int64 offsets; checked and planned from specs alone, no GPU)."""

    def spec(field, shape):
        dtype, itemsize = {"v": ("float16", 2), "v_a": ("float16", 2), "v_b": ("float16", 2),
                           "indptr": ("int64", 8)}.get(field, ("float32", 4))  # fmt: skip
        return _arrays.contiguous_spec(tuple(shape), dtype, itemsize, 0)

    kind = type(operation.names)
    specs = kind(None, None, **{field: spec(field, shape) for field, shape in shapes.items()})
    with pytest.raises((TypeError, ValueError)) as raised:
        _dispatch.plan_specs(operation, operation.options(), _tuning.DEFAULT, specs)
    return raised.value


def _same_error(gpu_error, call):
    with pytest.raises(type(gpu_error)) as raised:
        call()
    assert str(raised.value) == str(gpu_error)


TWO_WAY = {"v_a": (5, 3, 16), "s_a": (3, 5), "v_b": (5, 3, 16), "s_b": (3, 5)}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"v_a": (5, 48)}, "^v_a: expected a 3-D array"),
        ({"s_a": (3, 5, 1)}, "^s_a: expected a 2-D array"),
        ({"v_b": (5, 3, 24)}, r"^v_b: expected shape \(5, 3, 16\) \(the shape of v_a\)"),
        ({"s_b": (5, 3)}, "^s_b: expected shape .*transposed view"),
        ({"s_a": (3, 4)}, r"^s_a: expected shape \(num_heads, num_tokens\)"),
        ({"sinks": (4,)}, r"^sinks: expected shape \(3,\) \(num_heads of v_a\)"),
        ({"sinks": (3, 1)}, "^sinks: expected a 1-D array"),
    ],
)
def test_the_two_way_reference_raises_the_gpu_merges_messages_for_bad_shapes(changes, words):
    shapes = dict(TWO_WAY, **changes)
    gpu_error = _gpu_error(MERGE_STATE, **shapes)
    assert re.match(words, str(gpu_error)), gpu_error
    arrays = {name: np.zeros(shape) for name, shape in shapes.items()}
    sinks = arrays.pop("sinks", None)
    _same_error(gpu_error, lambda: reference.merge_state(**arrays, sinks=sinks))


@pytest.mark.parametrize(
    "shapes, words",
    [
        ({"v": (5, 3, 16), "s": (6, 3, 5)}, "^v: expected a 4-D array"),
        ({"v": (6, 5, 3, 16), "s": (3, 5)}, "^s: expected a 3-D array"),
        ({"v": (6, 5, 3, 16), "s": (7, 3, 5)}, r"^s: expected shape \(num_states, num_heads, num_tokens\)"),
        ({"v": (6, 5, 3, 16), "s": (6, 5, 3)}, "^s: expected shape .*transposed view"),
        (
            {"v": (6, 5, 3, 16), "s": (6, 3, 5), "sinks": (2,)},
            r"^sinks: expected shape \(3,\) \(num_heads of v\)",
        ),
        ({"v": (65537, 1, 1, 1), "s": (65537, 1, 1)}, "^v: expected at most 65536 states a token"),
    ],
)
def test_the_n_way_reference_raises_the_gpu_merges_messages_for_bad_shapes(shapes, words):
    gpu_error = _gpu_error(MERGE_STATES, **shapes)
    assert re.match(words, str(gpu_error)), gpu_error
    arrays = {name: np.zeros(shape) for name, shape in shapes.items()}
    _same_error(
        gpu_error, lambda: reference.merge_states(arrays["v"], arrays["s"], sinks=arrays.get("sinks"))
    )


@pytest.mark.parametrize(
    "shapes, words",
    [
        ({"v": (9, 3, 16), "s": (3, 9), "indptr": (5, 1)}, "^indptr: expected a 1-D array"),
        ({"v": (9, 3, 16), "s": (3, 9), "indptr": (0,)}, r"^indptr: expected num_tokens \+ 1 >= 1 entries"),
        (
            {"v": (9, 3, 16), "s": (3, 8), "indptr": (5,)},
            r"^s: expected shape \(num_heads, total_states\) = \(3, 9\)",
        ),
        ({"v": (9, 3, 16), "s": (9, 3), "indptr": (5,)}, r"^s: expected shape \(num_heads, total_states\)"),
        ({"v": (2, 9, 3, 16), "s": (3, 9), "indptr": (5,)}, "^v: expected a 3-D array"),
        ({"v": (9, 3, 16), "s": (3, 9), "indptr": (5,), "sinks": (1,)}, r"^sinks: expected shape \(3,\)"),
    ],
)
def test_the_ragged_reference_raises_the_gpu_merges_messages_for_bad_shapes(shapes, words):
    gpu_error = _gpu_error(MERGE_STATES_VARLEN, **shapes)
    assert re.match(words, str(gpu_error)), gpu_error
    v, s = np.zeros(shapes["v"]), np.zeros(shapes["s"])
    indptr = np.zeros(shapes["indptr"], dtype=np.int64)
    sinks = np.zeros(shapes["sinks"]) if "sinks" in shapes else None
    _same_error(gpu_error, lambda: reference.merge_states_varlen(v, s, indptr, sinks=sinks))


def test_a_float_indptr_is_refused_as_the_gpu_refuses_it():
    with pytest.raises(TypeError) as gpu:
        _array_rules.expect_index_array(_arrays.contiguous_spec((5,), "float32", 4, 0), MERGE_STATES.names.indptr)
    _same_error(gpu.value, lambda: reference.merge_states_varlen(np.zeros((4, 3, 8)), np.zeros((3, 4)),
                                                                 np.zeros(5, dtype=np.float32)))  # fmt: skip


@pytest.mark.parametrize(
    "indptr, words",
    [
        ([1, 2, 4], "first entry to be 0, got 1"),
        ([0, 3, 2], r"non-decreasing offsets, got indptr\[1\] = 3 > indptr\[2\] = 2"),
        ([0, 2, 5], "last entry to be at most total_states = 4, got 5"),
    ],
)
def test_bad_offsets_raise_the_gpu_merges_messages_when_checked(rng, indptr, words):
    v, s = rng.standard_normal((4, 2, 3)), rng.standard_normal((2, 4))
    with pytest.raises(ValueError) as gpu:
        _array_rules.indptr_values(np.array(indptr), 4)  # what merge_states_varlen(check_indptr=True) runs
    with pytest.raises(ValueError, match=f"^indptr: expected .*{words}") as raised:
        reference.merge_states_varlen(v, s, np.array(indptr))
    assert str(raised.value) == str(gpu.value)


def test_bad_offsets_give_nan_rows_without_the_check_as_the_kernel_does(rng):
    v, s = rng.standard_normal((4, 2, 3)), rng.standard_normal((2, 4))
    # Token 0 is fine; 1 decreases (2 -> 1), 2 ends past the 4 rows, 3 decreases (5 -> 4); 4 is fine.
    indptr = np.array([0, 2, 1, 5, 4, 4])
    with pytest.raises(ValueError, match="^indptr: expected non-decreasing offsets"):
        reference.merge_states_varlen(v, s, indptr)
    out, lse = reference.merge_states_varlen(v, s, indptr, check_indptr=False)
    assert out.shape == (5, 2, 3) and lse.shape == (2, 5)
    for token in (1, 2, 3):
        assert np.isnan(out[token]).all() and np.isnan(lse[:, token]).all()
    want, want_lse = reference.merge_states_varlen(v, s, np.array([0, 2]))
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(lse[:, 0], want_lse[:, 0])
    assert (out[4] == 0).all() and (lse[:, 4] == -np.inf).all()  # an empty token, not a bad one
    # A negative start is out of range too.
    out, lse = reference.merge_states_varlen(v, s, np.array([-1, 2]), check_indptr=False)
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_more_states_a_token_than_the_kernels_take_give_a_nan_row_without_the_check():
    rows = 65536 + 2
    v, s = np.ones((rows, 1, 2)), np.zeros((1, rows))
    indptr = np.array([0, 1, rows])  # token 1: 65537 states
    with pytest.raises(
        ValueError, match="^indptr: expected at most 65536 states a token, got 65537 for token 1"
    ):
        reference.merge_states_varlen(v, s, indptr)
    out, lse = reference.merge_states_varlen(v, s, indptr, check_indptr=False)
    assert np.isnan(out[1]).all() and np.isnan(lse[:, 1]).all()
    np.testing.assert_array_equal(out[0], [[1.0, 1.0]])
    assert lse[0, 0] == 0.0


def test_check_indptr_must_be_a_bool():
    with pytest.raises(TypeError, match="^check_indptr: expected True or False"):
        reference.merge_states_varlen(
            np.zeros((1, 1, 2)), np.zeros((1, 1)), np.array([0, 1]), check_indptr="no"
        )


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: reference.merge_state(np.ones((2, 1, 4), np.int32), np.zeros((1, 2)), np.ones((2, 1, 4)),
                                       np.zeros((1, 2))), r"^v_a: expected dtype float32, float16 or bfloat16, got int32"),
        (lambda: reference.merge_states(np.ones((2, 2, 1, 4)), np.zeros((2, 1, 2), np.int64)),
         r"^s: expected a float32 log-sum-exp, got dtype int64"),
        (lambda: reference.merge_states_varlen(np.ones((2, 1, 4), np.uint8), np.zeros((1, 2)), np.array([0, 2])),
         r"^v: expected dtype float32, float16 or bfloat16, got uint8"),
    ],
)  # fmt: skip
def test_integer_states_are_refused_as_the_gpu_merges_refuse_them(call, words):
    with pytest.raises(TypeError, match=words):
        call()
