"""cupy_merge.jax on a GPU against the float64 reference: jit, vmap, eager calls, every dtype, FP8,
empty states, +inf LSEs, base 2, sinks, ragged batches, and CUDA-graph replays with new data.

Tolerances are those of test_gpu_merge.py, as norm-relative error over the finite elements
(the reference computed from the very values the kernel read): 1e-5 for float32 values,
1e-2 for 16-bit values (their final rounding), 1e-6 for the float32 LSE; NaN and infinite
elements must sit exactly where the reference has them. FP8 outputs are compared as in
test_gpu_fp8.py: within one FP8 step of ``clamp(reference / scale, -448, 448)``.

XLA allocates the outputs; before each test the allocator's free memory is filled with NaN,
so an output element the kernel fails to write shows as NaN (outputs given to the merge,
group scales and masked tokens, are poisoned directly).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gpu_arrays import relative_error

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")
ml_dtypes = pytest.importorskip("ml_dtypes")


def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


if not _cuda_devices():
    pytest.skip("JAX has no CUDA device here", allow_module_level=True)

import jax.numpy as jnp

import cupy_merge as cm
import cupy_merge.jax as cmj
from cupy_merge import _jax_launch, _tuning, reference

DTYPES = ["float32", "float16", "bfloat16"]
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
FP8 = "float8_e4m3fn"


@pytest.fixture(autouse=True)
def _poisoned_allocator():
    """Fill the free memory XLA's allocator keeps with NaN: outputs it hands out next start as NaN."""
    poison = jnp.full((1 << 26,), jnp.nan, jnp.float32)  # 256 MiB
    poison.block_until_ready()
    del poison
    yield


def _device(host, dtype):
    return jnp.asarray(np.asarray(host, np.float32)).astype(dtype)


def _host(array) -> np.ndarray:
    return np.asarray(jnp.asarray(array).astype(jnp.float32)).astype(np.float64)


def _lse(rng, *shape):
    return (rng.standard_normal(shape) * 8).astype(np.float32)


def _states(rng, tokens, heads, head_size, dtype):
    v_a, v_b = (_device(rng.standard_normal((tokens, heads, head_size)), dtype) for _ in range(2))
    s_a, s_b = (jnp.asarray(_lse(rng, heads, tokens)) for _ in range(2))
    return v_a, s_a, v_b, s_b


def _expect(got, want, tolerance):
    """``got`` (any JAX array) against the float64 ``want``: the same NaN and infinities, then
    norm-relative error over the finite elements."""
    got, want = _host(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (np.isnan(got) == np.isnan(want)).all(), (
        "NaN where the reference has none (unwritten?), or the reverse"
    )
    infinite = np.isinf(want)
    assert (got[infinite] == want[infinite]).all() and np.isfinite(got[~infinite & ~np.isnan(want)]).all()
    finite = np.isfinite(want)
    assert relative_error(got[finite], want[finite]) <= tolerance


def _expect_merged(got_v, got_s, want_v, want_s, dtype):
    _expect(got_v, want_v, TOLERANCE[dtype])
    _expect(got_s, want_s, 1e-6)


def _fp8_step(x: np.ndarray) -> np.ndarray:
    """The spacing of float8_e4m3fn at |x|: 2^(e - 3) for normal numbers, 2^-9 below 2^-6."""
    magnitude = np.minimum(np.abs(x), 448.0)
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**-6)))
    return 2.0 ** (exponent - 3)


def _expect_fp8(got, want_scaled: np.ndarray) -> None:
    """A float8_e4m3fn result within one FP8 step of ``clamp(reference / scale, -448, 448)``."""
    assert got.dtype == jnp.float8_e4m3fn
    got = _host(got)
    want = np.clip(want_scaled, -448.0, 448.0)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), "NaN where the reference has none, or the reverse"
    worst = float((np.abs(got[~nan] - want[~nan]) / _fp8_step(want[~nan])).max(initial=0.0))
    assert worst <= 1.0, f"an element is {worst:.2f} FP8 steps from the reference"


def _expect_group_fp8(got, scales, want: np.ndarray, group: int, ue8m0: bool) -> None:
    """Group-scaled FP8 values and their scales against the reference's (a UE8M0 scale may round
    either way when its unrounded value lies within float32 rounding of a power of two)."""
    _, raw = reference.quantize_fp8_groups(want, group)
    _, expected = reference.quantize_fp8_groups(want, group, ue8m0)
    scales = np.asarray(scales)
    assert scales.shape == expected.shape and scales.dtype == np.float32
    close = np.isclose(scales, expected, rtol=1e-5)
    if ue8m0:
        with np.errstate(divide="ignore", invalid="ignore"):
            power = np.exp2(np.round(np.log2(raw)))
        close |= (np.abs(raw / power - 1) < 1e-5) & ((scales == power) | (scales == 2 * power))
    assert close.all(), f"group scales differ at {np.argwhere(~close)[:5].tolist()}"
    tokens = want.shape[0]
    per_element = np.repeat(scales.reshape(tokens, -1), group, axis=1).reshape(want.shape).astype(np.float64)
    _expect_fp8(got, want / per_element)


# -- two states -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 32, 128), (613, 8, 72), (37, 5, 7), (256, 4, 1), (64, 3, 576)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_merge_state_matches_the_reference(rng, dtype, shape):
    states = _states(rng, *shape, dtype)
    want = reference.merge_state(*(_host(x) for x in states))
    got = jax.jit(cmj.merge_state)(*states)
    assert got[0].dtype == states[0].dtype
    _expect_merged(*got, *want, dtype)


@pytest.mark.parametrize(
    "dtype, out_dtype", [("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16")]
)
def test_the_output_dtype_may_differ_from_the_inputs(rng, dtype, out_dtype):
    states = _states(rng, 129, 8, 128, dtype)
    want = reference.merge_state(*(_host(x) for x in states))
    got = jax.jit(lambda *a: cmj.merge_state(*a, out_dtype=out_dtype))(*states)
    assert got[0].dtype == jnp.dtype(out_dtype)
    _expect_merged(*got, *want, out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_calls_of_both_entry_points_match_the_reference(rng, dtype):
    states = _states(rng, 513, 32, 128, dtype)
    want = reference.merge_state(*(_host(x) for x in states))
    for merge in (cm.merge_state, cmj.merge_state):
        for _ in range(3):
            got = merge(*states)
            assert isinstance(got[0], jax.Array)
            _expect_merged(*got, *want, dtype)


@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_base_2_and_sinks(rng, lse_base, with_sinks):
    states = _states(rng, 77, 6, 64, "bfloat16")
    sinks = jnp.asarray(rng.standard_normal(6).astype(np.float32)) if with_sinks else None
    host_sinks = None if sinks is None else _host(sinks)
    want = reference.merge_state(*(_host(x) for x in states), lse_base, sinks=host_sinks)
    got = jax.jit(lambda *a: cmj.merge_state(*a, lse_base=lse_base, sinks=sinks))(*states)
    _expect_merged(*got, *want, "bfloat16")


def test_infinite_lses_are_empty_rows_and_two_empty_rows_give_zero_and_minus_infinity(rng):
    v_a, s_a, v_b, s_b = _states(rng, 8, 4, 32, "float32")
    s_a = s_a.at[:, 0].set(jnp.inf).at[:, 1].set(-jnp.inf).at[:, 2].set(-jnp.inf)
    s_b = s_b.at[:, 2].set(-jnp.inf).at[:, 3].set(jnp.inf)
    want = reference.merge_state(_host(v_a), _host(s_a), _host(v_b), _host(s_b))
    got = jax.jit(cmj.merge_state)(v_a, s_a, v_b, s_b)
    _expect_merged(*got, *want, "float32")
    assert (_host(got[0])[2] == 0).all() and np.isneginf(_host(got[1])[:, 2]).all()


def test_merge_attn_states_returns_the_output_and_takes_the_suffix_past_the_prefill_cut(rng):
    states = _states(rng, 40, 8, 128, "float16")
    host = [_host(x) for x in states]
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    for sink in (None, sinks):
        host_sink = None if sink is None else _host(sink)
        want_v, want_s = reference.merge_state(*host, sinks=host_sink)
        if sink is None:
            want_v[25:], want_s[:, 25:] = host[2][25:], host[3][:, 25:]
        else:
            want_v[25:], want_s[:, 25:] = reference.merge_states(host[2][None, 25:], host[3][None, :, 25:],
                                                                 sinks=host_sink)  # fmt: skip
        got = jax.jit(lambda *a, sink=sink: cmj.merge_attn_states(*a, 25, sinks=sink))(*states)
        _expect_merged(*got, want_v, want_s, "float16")


def test_the_in_place_merge_keeps_unmasked_tokens_and_updates_donated_buffers(rng):
    v, s, w, t = _states(rng, 50, 4, 64, "bfloat16")
    mask = jnp.asarray(rng.random(50) < 0.5)
    want_v, want_s = reference.merge_state(_host(v), _host(s), _host(w), _host(t))
    keep = ~np.asarray(mask)
    want_v[keep], want_s[:, keep] = _host(v)[keep], _host(s)[:, keep]
    got = jax.jit(cmj.merge_state_in_place)(v, s, w, t, mask)
    _expect_merged(*got, want_v, want_s, "bfloat16")
    assert (np.asarray(got[0])[keep] == np.asarray(v)[keep]).all(), "an unmasked token changed"
    donated = jax.jit(cmj.merge_state_in_place, donate_argnums=(0, 1))
    got = donated(jnp.copy(v), jnp.copy(s), w, t, mask)
    _expect_merged(*got, want_v, want_s, "bfloat16")
    got = cmj.merge_state_in_place(v, s, w, t)  # no mask: every token, new arrays
    _expect_merged(*got, *reference.merge_state(_host(v), _host(s), _host(w), _host(t)), "bfloat16")


# -- N states and ragged batches -----------------------------------------------------------------------


@pytest.mark.parametrize("num_states", [0, 1, 2, 3, 16, 65])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_merge_states_matches_the_reference(rng, dtype, num_states):
    v = _device(rng.standard_normal((num_states, 9, 4, 128)), dtype)
    s = jnp.asarray(_lse(rng, num_states, 4, 9))
    want = reference.merge_states(_host(v), _host(s))
    got = jax.jit(cmj.merge_states)(v, s)
    _expect_merged(*got, *want, dtype)
    sinks = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    want = reference.merge_states(_host(v), _host(s), 2, sinks=_host(sinks))
    got = jax.jit(lambda a, b: cm.merge_states(a, b, lse_base=2, sinks=sinks))(v, s)
    _expect_merged(*got, *want, dtype)


def _ragged(rng, counts, heads, head_size, dtype, padding=3):
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(indptr[-1]) + padding
    v = _device(rng.standard_normal((rows, heads, head_size)), dtype)
    s = jnp.asarray(_lse(rng, heads, rows))
    return v, s, jnp.asarray(indptr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_merges_under_jit_and_eagerly(rng, dtype):
    v, s, indptr = _ragged(rng, [3, 0, 1, 7, 2, 40], 8, 64, dtype)
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    for sink in (None, sinks):
        host_sink = None if sink is None else _host(sink)
        want = reference.merge_states_varlen(_host(v), _host(s), np.asarray(indptr), sinks=host_sink)
        merge = jax.jit(
            lambda a, b, c, sink=sink: cmj.merge_states_varlen(a, b, c, check_indptr=False, sinks=sink)
        )
        _expect_merged(*merge(v, s, indptr), *want, dtype)
        _expect_merged(*cm.merge_states_varlen(v, s, indptr, sinks=sink), *want, dtype)  # checked on the host
    with pytest.raises(ValueError, match="^indptr: expected non-decreasing offsets"):
        cmj.merge_states_varlen(v, s, jnp.array([0, 3, 2, 5], jnp.int32))
    bad = jnp.array([0, 3, 2, 5, 10_000], jnp.int32)  # unchecked: NaN rows, nothing read outside v
    got = jax.jit(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False))(v, s, bad)
    want = reference.merge_states_varlen(_host(v), _host(s), np.asarray(bad), check_indptr=False)
    _expect_merged(*got, *want, dtype)


# -- FP8 ------------------------------------------------------------------------------------------------


def test_fp8_with_a_per_tensor_scale_from_every_merge(rng):
    v_a, s_a, v_b, s_b = _states(rng, 96, 8, 128, "bfloat16")
    host = [_host(x) for x in (v_a, s_a, v_b, s_b)]
    scale = jnp.array([0.02], jnp.float32)
    want, want_lse = reference.merge_state(*host)
    got, lse = jax.jit(lambda *a: cmj.merge_state(*a, out_dtype=FP8, output_scale=scale))(v_a, s_a, v_b, s_b)
    _expect_fp8(got, want / np.float64(np.float32(0.02)))
    _expect(lse, want_lse, 1e-6)
    got, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=scale)  # eager, public
    _expect_fp8(got, want / np.float64(np.float32(0.02)))
    cut = reference.merge_state(*host)[0]
    cut[60:] = host[2][60:]
    got, _ = jax.jit(lambda *a: cmj.merge_attn_states(*a, 60, scale, out_dtype=jnp.float8_e4m3fn))(
        v_a, s_a, v_b, s_b
    )
    _expect_fp8(got, cut / np.float64(np.float32(0.02)))
    stacked, stacked_lse = jnp.stack([v_a, v_b, v_a]), jnp.stack([s_a, s_b, s_b])
    want_many, _ = reference.merge_states(_host(stacked), _host(stacked_lse))
    got, _ = jax.jit(lambda a, b: cmj.merge_states(a, b, out_dtype=FP8, output_scale=scale))(
        stacked, stacked_lse
    )
    _expect_fp8(got, want_many / np.float64(np.float32(0.02)))
    v, s, indptr = _ragged(rng, [2, 5, 0, 9], 8, 128, "float32")
    want_ragged, _ = reference.merge_states_varlen(_host(v), _host(s), np.asarray(indptr))
    merge = jax.jit(lambda a, b, c, d: cmj.merge_states_varlen(a, b, c, check_indptr=False, out_dtype=FP8,
                                                               output_scale=d))  # fmt: skip
    for value in (0.02, 0.5):  # the scale is read on the device at each run
        got, _ = merge(v, s, indptr, jnp.array([value], jnp.float32))
        _expect_fp8(got, want_ragged / np.float64(np.float32(value)))


@pytest.mark.parametrize("group, ue8m0", [(128, False), (64, True), (16, False)])
def test_fp8_with_group_scales_returned_as_a_third_result(rng, group, ue8m0):
    v_a, s_a, v_b, s_b = _states(rng, 33, 8, 128, "bfloat16")
    want, _ = reference.merge_state(*(_host(x) for x in (v_a, s_a, v_b, s_b)))
    merge = jax.jit(lambda *a: cmj.merge_state(*a, out_dtype=FP8, quant_group_size=group, scale_ue8m0=ue8m0))
    got, _, scales = merge(v_a, s_a, v_b, s_b)
    assert scales.shape == (33, 8 * 128 // group)
    _expect_group_fp8(got, scales, want, group, ue8m0)
    poisoned = jnp.full((33, 8 * 128 // group), jnp.nan, jnp.float32)  # returned into this buffer
    got, _, scales = cmj.merge_attn_states(v_a, s_a, v_b, s_b, out_dtype=FP8, output_block_scale=poisoned,
                                           quant_group_size=group, quant_scale_ue8m0=ue8m0)  # fmt: skip
    _expect_group_fp8(got, scales, want, group, ue8m0)
    v = _device(rng.standard_normal((5, 12, 8, 128)), "float16")
    s = jnp.asarray(_lse(rng, 5, 8, 12))
    want, _ = reference.merge_states(_host(v), _host(s))
    got, _, scales = jax.jit(lambda a, b: cmj.merge_states(a, b, out_dtype=FP8, quant_group_size=group,
                                                           scale_ue8m0=ue8m0))(v, s)  # fmt: skip
    _expect_group_fp8(got, scales, want, group, ue8m0)
    rows, rows_lse, indptr = _ragged(rng, [4, 0, 7], 8, 128, "bfloat16")
    want, _ = reference.merge_states_varlen(_host(rows), _host(rows_lse), np.asarray(indptr))
    got, _, scales = cmj.merge_states_varlen(rows, rows_lse, indptr, out_dtype=FP8, quant_group_size=group,
                                             scale_ue8m0=ue8m0)  # fmt: skip
    _expect_group_fp8(got, scales, want, group, ue8m0)


# -- empty merges --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, heads", [(0, 8), (5, 0), (0, 0)])
def test_no_tokens_or_no_heads_launch_nothing(rng, tokens, heads):
    v = jnp.zeros((tokens, heads, 64), jnp.bfloat16)
    s = jnp.zeros((heads, tokens), jnp.float32)
    got = jax.jit(cmj.merge_state)(v, s, v, s)
    assert got[0].shape == (tokens, heads, 64) and got[1].shape == (heads, tokens)
    got = jax.jit(cmj.merge_states)(jnp.stack([v, v, v]), jnp.stack([s, s, s]))
    assert got[0].shape == (tokens, heads, 64)
    got = cmj.merge_states_varlen(v, s, jnp.zeros(1, jnp.int32))
    assert got[0].shape == (0, heads, 64)


def test_no_states_give_zero_and_minus_infinity_or_the_sink(rng):
    v, s = jnp.zeros((0, 4, 8, 64), jnp.float32), jnp.zeros((0, 8, 4), jnp.float32)
    got_v, got_s = jax.jit(cmj.merge_states)(v, s)
    assert (_host(got_v) == 0).all() and np.isneginf(_host(got_s)).all()
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    got_v, got_s = cmj.merge_states(v, s, sinks=sinks)
    assert (_host(got_v) == 0).all()
    np.testing.assert_array_equal(_host(got_s), np.repeat(_host(sinks)[:, None], 4, axis=1))


# -- vmap ----------------------------------------------------------------------------------------------


def _batch_reference(function, *arrays):
    results = [function(*(x[b] for x in arrays)) for b in range(arrays[0].shape[0])]
    return tuple(np.stack(column) for column in zip(*results))


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_of_merge_state_under_jit_and_nested(rng, dtype, tokens):
    batch = [_states(rng, tokens, 8, 128, dtype) for _ in range(6)]
    v_a, s_a, v_b, s_b = (jnp.stack(column) for column in zip(*batch))
    host = [_host(x) for x in (v_a, s_a, v_b, s_b)]
    want = _batch_reference(reference.merge_state, *host)
    _expect_merged(*jax.jit(jax.vmap(cmj.merge_state))(v_a, s_a, v_b, s_b), *want, dtype)
    _expect_merged(*jax.vmap(cm.merge_state)(v_a, s_a, v_b, s_b), *want, dtype)
    nested = [x.reshape(2, 3, *x.shape[1:]) for x in (v_a, s_a, v_b, s_b)]
    got = jax.jit(jax.vmap(jax.vmap(cmj.merge_state)))(*nested)
    _expect_merged(got[0].reshape(want[0].shape), got[1].reshape(want[1].shape), *want, dtype)
    shared = jax.vmap(cmj.merge_state, in_axes=(0, 0, None, None))(v_a, s_a, v_b[0], s_b[0])  # one by one
    want = _batch_reference(
        lambda a, b: reference.merge_state(a, b, host[2][0], host[3][0]), host[0], host[1]
    )
    _expect_merged(*shared, *want, dtype)


def test_vmap_over_more_batch_elements_than_are_unrolled_maps_with_lax_map(rng):
    v = _device(rng.standard_normal((12, 5, 4, 64)), "float32")
    s = jnp.asarray(_lse(rng, 12, 4, 5))
    w, t = v[0] * 2, s[0] - 1
    got = jax.jit(jax.vmap(cmj.merge_state, in_axes=(0, 0, None, None)))(v, s, w, t)
    want = _batch_reference(lambda a, b: reference.merge_state(a, b, _host(w), _host(t)), _host(v), _host(s))
    _expect_merged(*got, *want, "float32")


@pytest.mark.parametrize("tokens, states", [(1, 16), (7, 1), (7, 5)])
def test_vmap_of_merge_states(rng, tokens, states):
    v = _device(rng.standard_normal((4, states, tokens, 8, 128)), "bfloat16")
    s = jnp.asarray(_lse(rng, 4, states, 8, tokens))
    want = _batch_reference(reference.merge_states, _host(v), _host(s))
    _expect_merged(*jax.jit(jax.vmap(cmj.merge_states))(v, s), *want, "bfloat16")
    nested = jax.vmap(jax.vmap(cmj.merge_states))(
        v.reshape(2, 2, *v.shape[1:]), s.reshape(2, 2, *s.shape[1:])
    )
    _expect_merged(nested[0].reshape(want[0].shape), nested[1].reshape(want[1].shape), *want, "bfloat16")


def test_vmap_of_ragged_merges_with_batched_and_shared_offsets(rng):
    v = _device(rng.standard_normal((3, 20, 4, 64)), "float16")
    s = jnp.asarray(_lse(rng, 3, 4, 20))
    indptr = jnp.array([[0, 3, 3, 9, 17], [0, 0, 1, 2, 20], [0, 8, 4, 9, 30]], jnp.int32)  # the last is bad
    merge = jax.jit(jax.vmap(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False)))
    host = [_host(v), _host(s), np.asarray(indptr)]
    want = _batch_reference(lambda a, b, c: reference.merge_states_varlen(a, b, c, check_indptr=False), *host)
    _expect_merged(*merge(v, s, indptr), *want, "float16")
    shared = jax.vmap(lambda a, b: cmj.merge_states_varlen(a, b, indptr[0], check_indptr=False))(v, s)
    want = _batch_reference(lambda a, b: reference.merge_states_varlen(a, b, host[2][0]), host[0], host[1])
    _expect_merged(*shared, *want, "float16")


def test_vmap_of_the_masked_in_place_merge(rng):
    batch = [_states(rng, 9, 4, 64, "float32") for _ in range(3)]
    v, s, w, t = (jnp.stack(column) for column in zip(*batch))
    mask = jnp.asarray(rng.random((3, 9)) < 0.5)
    want_v, want_s = _batch_reference(reference.merge_state, *(_host(x) for x in (v, s, w, t)))
    keep = ~np.asarray(mask)
    want_v[keep] = _host(v)[keep]
    want_s = np.where(keep[:, None, :], _host(s), want_s)
    _expect_merged(*jax.jit(jax.vmap(cmj.merge_state_in_place))(v, s, w, t, mask), want_v, want_s, "float32")


@pytest.mark.parametrize("size", [3, 10])
def test_vmap_over_masks_alone_gives_each_mask_its_own_output(rng, size):
    """The merged state shared, the masks batched: each element writes its own copy (issue 47)."""
    v, s, w, t = _states(rng, 9, 4, 64, "float32")
    masks = jnp.asarray(rng.random((size, 9)) < 0.5)
    merged_v, merged_s = reference.merge_state(*(_host(x) for x in (v, s, w, t)))
    for vmapped in (jax.vmap, lambda f, **k: jax.jit(jax.vmap(f, **k))):
        got_v, got_s = vmapped(cmj.merge_state_in_place, in_axes=(None, None, None, None, 0))(v, s, w, t, masks)
        for b in range(size):
            keep = ~np.asarray(masks[b])
            want_v = np.where(keep[:, None, None], _host(v), merged_v)
            want_s = np.where(keep[None, :], _host(s), merged_s)
            _expect_merged(got_v[b], got_s[b], want_v, want_s, "float32")


@pytest.mark.parametrize("cut", [2, 9, 10, 20])
def test_vmap_of_merge_attn_states_cuts_each_elements_own_tokens(rng, cut):
    batch = [_states(rng, 9, 4, 64, "bfloat16") for _ in range(3)]
    v, s, w, t = (jnp.stack(column) for column in zip(*batch))
    want_v, want_s = _batch_reference(reference.merge_state, *(_host(x) for x in (v, s, w, t)))
    want_v[:, cut:], want_s[:, :, cut:] = _host(w)[:, cut:], _host(t)[:, :, cut:]
    merge = jax.jit(jax.vmap(lambda *a: cmj.merge_attn_states(*a, prefill_tokens_with_context=cut)))
    _expect_merged(*merge(v, s, w, t), want_v, want_s, "bfloat16")


def test_grad_inside_shard_map_follows_the_reference_backward(rng):
    from jax.sharding import Mesh, PartitionSpec

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(_cuda_devices()[:1]), ("x",))
    v = _device(rng.standard_normal((5, 7, 4, 64)), "float32")
    s = jnp.asarray(_lse(rng, 5, 4, 7))
    sinks = jnp.asarray(_lse(rng, 4))
    grad_out = _device(rng.standard_normal((7, 4, 64)), "float32")
    grad_lse = jnp.asarray(rng.standard_normal((4, 7)).astype(np.float32))

    def loss(v, s, sinks):
        out, lse = cmj.merge_states(v, s, sinks=sinks)
        return jnp.sum(out * grad_out) + jnp.sum(lse * grad_lse)

    replicated = PartitionSpec()
    grads = jax.jit(shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                              in_specs=(PartitionSpec("x"), PartitionSpec("x"), replicated),
                              out_specs=(PartitionSpec("x"), PartitionSpec("x"), replicated)))(v, s, sinks)  # fmt: skip
    want = reference.merge_states_backward(_host(v), _host(s), _host(grad_out), _host(grad_lse), sinks=_host(sinks))
    for got, expected in zip(grads, want):
        _expect(got, expected, 1e-5)


def test_a_python_float_scale_under_x64_and_a_cpu_array_refused_by_name(rng):
    v_a, s_a, v_b, s_b = _states(rng, 9, 4, 64, "bfloat16")
    want_v, want_s = reference.merge_state(*(_host(x) for x in (v_a, s_a, v_b, s_b)))
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    with enable(True):
        got_v, got_s = cmj.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=0.5)
    _expect_fp8(got_v, want_v / 0.5)
    _expect(got_s, want_s, 1e-6)
    on_cpu = jax.device_put(v_a, jax.devices("cpu")[0])
    for merge in (cmj.merge_state, cm.merge_state):
        with pytest.raises(ValueError, match=r"^v_a: expected a JAX array on a CUDA device, got one on CPU"):
            merge(on_cpu, s_a, v_b, s_b)


# -- addresses, replays, derivatives ------------------------------------------------------------------------


def test_the_element_aligned_plan_merges_alike(rng, monkeypatch):
    states = _states(rng, 45, 8, 128, "bfloat16")
    want = reference.merge_state(*(_host(x) for x in states))
    merge = jax.jit(cmj.merge_state)
    _expect_merged(*merge(*states), *want, "bfloat16")
    monkeypatch.setattr(_jax_launch, "_MISALIGNED", ~0)  # every address counts as misaligned: the scalar plan
    _expect_merged(*merge(*states), *want, "bfloat16")


_REPLAY = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from cupy_merge import _launch, reference
    launches = [0]
    original = _launch.launch_patched
    def counting(*args):
        launches[0] += 1
        original(*args)
    _launch.launch_patched = counting  # before anything is traced: callbacks take it when built
    import cupy_merge.jax as cmj

    @jax.jit
    def step(x, s_a, v_b, s_b, c):
        v, s = cmj.merge_state(x * c, s_a + c, v_b, s_b)  # inputs XLA computes: new data, same buffers
        for _ in range(3):
            v, s = cmj.merge_state(v, s, v_b, s_b)
        return v, s

    def want(x, s_a, v_b, s_b, c):
        v, s = reference.merge_state(x * c, s_a + c, v_b, s_b)
        for _ in range(3):
            v, s = reference.merge_state(v, s, v_b, s_b)
        return v, s

    rng = np.random.default_rng()
    host = [rng.standard_normal((64, 8, 128)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)]
    host = [host[0], host[1], 2 * host[0][::-1].copy(), host[1][:, ::-1].copy()]
    arrays = [jnp.asarray(x) for x in host]
    runs, worst = 12, 0.0
    for run in range(runs):
        c = np.float32(rng.uniform(0.5, 2.0))
        got = step(*arrays, c)
        exact = want(*(x.astype(np.float64) for x in host), np.float64(c))
        for g, e in zip(got, exact):
            worst = max(worst, float(np.linalg.norm(np.asarray(g, np.float64) - e) / np.linalg.norm(e)))
        if run == runs // 2:  # new input arrays: new addresses, recorded again
            host = [x * np.float32(1.5) for x in host]
            arrays = [jnp.asarray(x) for x in host]
    print(json.dumps({"merges": 4 * runs, "launched_by_python": launches[0], "worst": worst}))
    """
)


@pytest.mark.parametrize(
    "flags", ["--xla_gpu_graph_min_graph_size=1", "", "--xla_gpu_enable_command_buffer="]
)
def test_a_jitted_chain_replays_with_new_data_in_and_out_of_cuda_graphs(flags):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["worst"] <= 1e-5, result
    if flags == "--xla_gpu_graph_min_graph_size=1":
        assert result["launched_by_python"] < result["merges"], (
            f"XLA called the callback for every merge: no CUDA graph was replayed ({result})"
        )
    if flags == "--xla_gpu_enable_command_buffer=":
        assert result["launched_by_python"] == result["merges"], result


def test_the_example_runs_and_checks_itself():
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "jax_split_kv_decode.py")
    done = subprocess.run([sys.executable, example], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


# -- gradients ----------------------------------------------------------------------------------------
#
# Every gradient against the float64 reference's backward, computed from the very values the kernel
# read (the inputs and the cotangents as the loss hands them over: R in the output's dtype, Q).
# Value gradients are stored in the inputs' dtype: TOLERANCE; LSE and sink gradients are float32,
# computed in float32 from those values: 1e-5 when everything is float32, else GRAD_TOLERANCE.
# Few rows of many states take the kernel given the merge's results, whose <dV, V> comes from the
# output as rounded to its dtype: their LSE and sink gradients carry that rounding, GIVEN_TOLERANCE
# for a 16-bit output (measured 3.5-4.1e-3 in bfloat16).

GRAD_TOLERANCE = 1e-3
GIVEN_TOLERANCE = 1e-2
FROM_OUTPUT_STATES = _tuning.DEFAULT.backward_from_output_states


def _weights(rng, shape, dtype="float32"):
    return _device(rng.standard_normal(shape), dtype)


def _linear_loss(merge, out_weight, lse_weight):
    """``sum(out * R) + sum(lse * Q)``: its cotangents are R (in the output's dtype) and Q."""

    def loss(*args):
        out, lse = merge(*args)[:2]
        return (out.astype(jnp.float32) * out_weight.astype(jnp.float32)).sum() + (lse * lse_weight).sum()

    return loss


def _expect_grads(got, want, kinds, dtype, out_dtype=None, given_results=False):
    """Gradients against the reference's: ``kinds`` says which are of values ("v") and which of
    LSEs or sinks ("s"); ``given_results``: the kernel read the merge's results."""
    assert len(got) == len(want) == len(kinds)
    exact = dtype == "float32" and (out_dtype or dtype) == "float32"
    inexact = GIVEN_TOLERANCE if given_results else GRAD_TOLERANCE
    for got_one, want_one, kind in zip(got, want, kinds):
        tolerance = TOLERANCE[dtype] if kind == "v" else 1e-5 if exact else inexact
        _expect(got_one, want_one, tolerance)


def _batched_host(function, *arrays):
    """``function`` (a reference backward) over the batch elements, stacked per result."""
    results = [function(*(x[b] for x in arrays)) for b in range(len(arrays[0]))]
    return [np.stack(column) for column in zip(*results) if column[0] is not None]


@pytest.mark.parametrize("shape", [(1, 32, 128), (613, 8, 72), (37, 5, 7), (64, 3, 576)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_of_merge_state_matches_the_reference_backward(rng, dtype, shape):
    states = _states(rng, *shape, dtype)
    tokens, heads, _ = shape
    out_weight, lse_weight = _weights(rng, shape, dtype), _weights(rng, (heads, tokens))
    loss = _linear_loss(cmj.merge_state, out_weight, lse_weight)
    want = reference.merge_state_backward(*(_host(x) for x in states), _host(out_weight), _host(lse_weight))
    got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*states)
    assert [g.dtype for g in got] == [states[0].dtype, jnp.float32] * 2
    _expect_grads(got, want[:4], "vsvs", dtype)
    value, again = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(*states)
    np.testing.assert_allclose(float(value), float(jax.jit(loss)(*states)), rtol=1e-5)
    for got_one, again_one in zip(got, again):  # no atomics without sinks: the same bits
        np.testing.assert_array_equal(np.asarray(got_one), np.asarray(again_one))
    eager = jax.grad(_linear_loss(cm.merge_state, out_weight, lse_weight), (0, 1, 2, 3))(
        *states
    )  # the core's
    _expect_grads(eager, want[:4], "vsvs", dtype)


@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize(
    "dtype, out_dtype",
    [("bfloat16", None), ("float32", None), ("bfloat16", "float32"), ("float32", "bfloat16")],
)
def test_grad_with_sinks_base_2_and_another_output_dtype(rng, lse_base, dtype, out_dtype):
    states = _states(rng, 77, 6, 64, dtype)
    sinks = jnp.asarray(rng.standard_normal(6).astype(np.float32))
    out_weight, lse_weight = _weights(rng, (77, 6, 64), out_dtype or dtype), _weights(rng, (6, 77))

    def merge(a, b, c, d, z):
        return cmj.merge_state(a, b, c, d, sinks=z, lse_base=lse_base, out_dtype=out_dtype)

    got = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), (0, 1, 2, 3, 4)))(*states, sinks)
    want = reference.merge_state_backward(*(_host(x) for x in states), _host(out_weight), _host(lse_weight),
                                          sinks=_host(sinks), lse_base=lse_base)  # fmt: skip
    _expect_grads(got, want, "vsvss", dtype, out_dtype)


@pytest.mark.parametrize("num_states", [0, 1, 3, 16, 65])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_of_merge_states_matches_the_reference_backward(rng, dtype, num_states):
    v = _device(rng.standard_normal((num_states, 9, 4, 128)), dtype)
    lse = _lse(rng, num_states, 4, 9)
    if num_states > 1:
        lse[0, 1] = -np.inf  # a head whose first state is empty
    s = jnp.asarray(lse)
    sinks = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    out_weight, lse_weight = _weights(rng, (9, 4, 128), dtype), _weights(rng, (4, 9))
    for sink, base, merge_states in ((None, "e", cmj.merge_states), (sinks, 2, cm.merge_states)):

        def merge(a, b, z, base=base, merge_states=merge_states):
            return merge_states(a, b, lse_base=base, sinks=z)

        got = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), (0, 1, 2)))(v, s, sink)
        want = reference.merge_states_backward(_host(v), lse, _host(out_weight), _host(lse_weight),
                                               sinks=None if sink is None else _host(sink), lse_base=base)  # fmt: skip
        given = num_states >= FROM_OUTPUT_STATES
        if sink is None:
            assert got[2] is None
            _expect_grads(got[:2], want[:2], "vs", dtype, given_results=given)
        else:
            _expect_grads(got, want, "vss", dtype, given_results=given)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_of_ragged_merges_zeroes_the_rows_no_token_owns(rng, dtype):
    v, s, indptr = _ragged(rng, [3, 0, 1, 7, 2, 40], 8, 64, dtype)  # 3 rows past the last offset
    v = v.at[-3:].set(jnp.nan)  # whatever they hold
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    tokens = indptr.shape[0] - 1
    out_weight, lse_weight = _weights(rng, (tokens, 8, 64), dtype), _weights(rng, (8, tokens))
    host_v = np.nan_to_num(_host(v))  # the reference reads the unowned rows too
    for sink, base in ((None, "e"), (sinks, 2)):

        def merge(a, b, c, z, base=base):
            return cmj.merge_states_varlen(a, b, c, check_indptr=False, sinks=z, lse_base=base)

        got = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), (0, 1, 3)))(v, s, indptr, sink)
        want = reference.merge_states_varlen_backward(host_v, _host(s), np.asarray(indptr), _host(out_weight),
                                                      _host(lse_weight), sinks=None if sink is None else _host(sink),
                                                      lse_base=base)  # fmt: skip
        assert (_host(got[0])[-3:] == 0).all() and (_host(got[1])[:, -3:] == 0).all()
        if sink is None:
            _expect_grads(got[:2], want[:2], "vs", dtype)
        else:
            _expect_grads(got, want, "vss", dtype)
    eager = jax.grad(_linear_loss(lambda a, b: cm.merge_states_varlen(a, b, indptr), out_weight, lse_weight),
                     (0, 1))(v, s)  # the core's, indptr checked on the host  # fmt: skip
    want = reference.merge_states_varlen_backward(host_v, _host(s), np.asarray(indptr), _host(out_weight),
                                                  _host(lse_weight))  # fmt: skip
    _expect_grads(eager, want[:2], "vs", dtype)


def test_the_prefill_cut_and_the_masked_in_place_merge_pass_gradients_through(rng):
    v, s, w, t = _states(rng, 40, 8, 128, "float16")
    host = [_host(x) for x in (v, s, w, t)]
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    out_weight, lse_weight = _weights(rng, (40, 8, 128), "float16"), _weights(rng, (8, 40))
    weights = _host(out_weight), _host(lse_weight)

    def part(x, tokens):
        return x[tokens] if x.ndim == 3 else x[:, tokens]

    for sink in (None, sinks):
        host_sink = None if sink is None else _host(sink)
        loss = _linear_loss(
            lambda *a, sink=sink: cmj.merge_attn_states(*a, 25, sinks=sink), out_weight, lse_weight
        )
        got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(v, s, w, t)
        head = slice(0, 25)
        want = [np.zeros_like(x) for x in host]
        merged = reference.merge_state_backward(*(part(x, head) for x in host), *(part(x, head) for x in weights),
                                                sinks=host_sink)  # fmt: skip
        for index in range(4):
            part(want[index], head)[...] = merged[index]
        if sink is None:
            want[2][25:], want[3][:, 25:] = weights[0][25:], weights[1][:, 25:]
        else:
            tail = reference.merge_states_backward(host[2][None, 25:], host[3][None, :, 25:], weights[0][25:],
                                                   weights[1][:, 25:], sinks=host_sink)  # fmt: skip
            want[2][25:], want[3][:, 25:] = tail[0][0], tail[1][0]
        _expect_grads(got, want, "vsvs", "float16")
    w_nan = w.at[3].set(jnp.nan)  # a token the mask keeps: v_other's NaN reaches no gradient
    mask = np.asarray(rng.random(40) < 0.5)
    mask[3] = False
    loss = _linear_loss(lambda *a: cmj.merge_state_in_place(*a, jnp.asarray(mask), sinks=sinks), out_weight,
                        lse_weight)  # fmt: skip
    got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(v, s, w_nan, t)
    want = [np.zeros_like(x) for x in host]
    merged = reference.merge_state_backward(*(part(x, mask) for x in host), *(part(x, mask) for x in weights),
                                            sinks=_host(sinks))  # fmt: skip
    for index in range(4):
        if index % 2 == 0:
            want[index][mask] = merged[index]
        else:
            want[index][:, mask] = merged[index]
    want[0][~mask], want[1][:, ~mask] = weights[0][~mask], weights[1][:, ~mask]
    _expect_grads(got, want, "vsvs", "float16")


def test_zero_weight_states_with_nan_values_get_zero_gradients(rng):
    v_a, s_a, v_b, s_b = _states(rng, 16, 4, 64, "float32")
    v_a, s_a = v_a.at[:5].set(jnp.nan), s_a.at[:, :5].set(-jnp.inf)  # empty states holding NaN
    out_weight, lse_weight = _weights(rng, (16, 4, 64)), _weights(rng, (4, 16))
    got = jax.jit(jax.grad(_linear_loss(cmj.merge_state, out_weight, lse_weight), (0, 1, 2, 3)))(
        v_a, s_a, v_b, s_b
    )
    assert all(np.isfinite(_host(g)).all() for g in got)
    assert (_host(got[0])[:5] == 0).all() and (_host(got[1])[:, :5] == 0).all()
    want = reference.merge_state_backward(*(_host(x) for x in (v_a, s_a, v_b, s_b, out_weight, lse_weight)))
    _expect_grads(got, want[:4], "vsvs", "float32")
    v = np.asarray(rng.standard_normal((5, 6, 4, 64)), np.float32)
    lse = _lse(rng, 5, 4, 6)
    v[2], lse[2] = np.nan, -3.0e38  # a weight that underflows to zero
    sinks = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    out_weight, lse_weight = _weights(rng, (6, 4, 64)), _weights(rng, (4, 6))
    merge = functools.partial(cmj.merge_states, sinks=sinks)
    got = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), (0, 1)))(
        jnp.asarray(v), jnp.asarray(lse)
    )
    assert np.isfinite(_host(got[0])).all() and np.isfinite(_host(got[1])).all()
    assert (_host(got[0])[2] == 0).all() and (_host(got[1])[2] == 0).all()
    rows = jnp.asarray(v.reshape(30, 4, 64))
    rows_lse = jnp.asarray(np.moveaxis(lse, 1, 0).reshape(4, 30))
    indptr = jnp.array([0, 12, 12, 30], jnp.int32)
    out_weight, lse_weight = _weights(rng, (3, 4, 64)), _weights(rng, (4, 3))
    merge = functools.partial(cmj.merge_states_varlen, indptr=indptr, check_indptr=False)
    got = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), (0, 1)))(rows, rows_lse)
    assert np.isfinite(_host(got[0])).all() and np.isfinite(_host(got[1])).all()
    nan_rows = np.isnan(v.reshape(30, 4, 64)).any(axis=(1, 2))
    assert (_host(got[0])[nan_rows] == 0).all() and (_host(got[1])[:, nan_rows] == 0).all()


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_of_grad_and_grad_of_vmap(rng, dtype, with_sinks):
    batch = [_states(rng, 37, 8, 128, dtype) for _ in range(4)]
    v_a, s_a, v_b, s_b = (jnp.stack(column) for column in zip(*batch))
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32)) if with_sinks else None
    host_sinks = None if sinks is None else _host(sinks)
    out_weight, lse_weight = _weights(rng, (37, 8, 128), dtype), _weights(rng, (8, 37))
    weights = _host(out_weight), _host(lse_weight)
    loss = _linear_loss(lambda *a: cmj.merge_state(*a, sinks=sinks), out_weight, lse_weight)
    host = [_host(x) for x in (v_a, s_a, v_b, s_b)]
    want = _batched_host(lambda *a: reference.merge_state_backward(*a, *weights, sinks=host_sinks)[:4], *host)
    for transform in (jax.vmap(jax.grad(loss, (0, 1, 2, 3))),
                      jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1, 2, 3))):  # fmt: skip
        _expect_grads(jax.jit(transform)(v_a, s_a, v_b, s_b), want, "vsvs", dtype)
    nested = [x.reshape(2, 2, *x.shape[1:]) for x in (v_a, s_a, v_b, s_b)]
    got = jax.jit(jax.vmap(jax.vmap(jax.grad(loss, (0, 1, 2, 3)))))(*nested)
    _expect_grads([g.reshape(w.shape) for g, w in zip(got, want)], want, "vsvs", dtype)
    v = _device(rng.standard_normal((3, 5, 7, 8, 64)), dtype)  # N-way: per batch element; one token: folded
    s = jnp.asarray(_lse(rng, 3, 5, 8, 7))
    for tokens in (7, 1):
        v_t, s_t = v[:, :, :tokens], s[..., :tokens]
        out_weight, lse_weight = _weights(rng, (tokens, 8, 64), dtype), _weights(rng, (8, tokens))
        loss = _linear_loss(
            lambda a, b: cmj.merge_states(a, b, lse_base=2, sinks=sinks), out_weight, lse_weight
        )
        weights = _host(out_weight), _host(lse_weight)
        want = _batched_host(lambda a, b, weights=weights: reference.merge_states_backward(
            a, b, *weights, sinks=host_sinks, lse_base=2)[:2], _host(v_t), _host(s_t))  # fmt: skip
        _expect_grads(jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(v_t, s_t), want, "vs", dtype)
        got = jax.jit(jax.grad(lambda a, b, loss=loss: jax.vmap(loss)(a, b).sum(), (0, 1)))(v_t, s_t)
        _expect_grads(got, want, "vs", dtype)
    rows = _device(rng.standard_normal((3, 20, 8, 64)), dtype).at[0, 18:].set(jnp.nan)  # ragged: folded
    rows_lse = jnp.asarray(_lse(rng, 3, 8, 20))
    indptr = jnp.array([[0, 3, 3, 9, 17], [0, 0, 1, 2, 20], [0, 8, 8, 9, 19]], jnp.int32)
    out_weight, lse_weight = _weights(rng, (4, 8, 64), dtype), _weights(rng, (8, 4))
    loss = _linear_loss(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False, sinks=sinks),
                        out_weight, lse_weight)  # fmt: skip
    want = _batched_host(lambda a, b, c: reference.merge_states_varlen_backward(
        np.nan_to_num(a), b, c, _host(out_weight), _host(lse_weight), sinks=host_sinks)[:2],
        _host(rows), _host(rows_lse), np.asarray(indptr))  # fmt: skip
    for transform in (
        jax.vmap(jax.grad(loss, (0, 1))),
        jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1)),
    ):
        got = jax.jit(transform)(rows, rows_lse, indptr)
        assert (_host(got[0])[0, 17:] == 0).all()
        _expect_grads(got, want, "vs", dtype)
    if with_sinks:  # the sinks' gradient of each batch element, and their sum under grad of vmap
        sink_loss = _linear_loss(lambda a, b, c, d, z: cmj.merge_state(a, b, c, d, sinks=z), *(
            _weights(rng, (37, 8, 128), dtype), _weights(rng, (8, 37))))  # fmt: skip
        per_element = jax.jit(jax.vmap(jax.grad(sink_loss, 4), in_axes=(0, 0, 0, 0, None)))(
            v_a, s_a, v_b, s_b, sinks
        )
        total = jax.jit(jax.grad(lambda z: jax.vmap(sink_loss, in_axes=(0, 0, 0, 0, None))(v_a, s_a, v_b, s_b, z)
                                 .sum()))(sinks)  # fmt: skip
        assert per_element.shape == (4, 8)
        _expect(total, _host(per_element).sum(0), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_public_backward_merges_on_jax_arrays(rng, dtype):
    v = _device(rng.standard_normal((3, 33, 8, 128)), dtype)
    s = jnp.asarray(_lse(rng, 3, 8, 33))
    grad_v, grad_s = _weights(rng, (33, 8, 128), "float32"), _weights(rng, (8, 33))
    sinks = jnp.asarray(rng.standard_normal(8).astype(np.float32))
    got = jax.jit(lambda *a: cm.merge_states_backward(*a, sinks=sinks, lse_base=2))(v, s, grad_v, grad_s)
    want = reference.merge_states_backward(_host(v), _host(s), _host(grad_v), _host(grad_s), sinks=_host(sinks),
                                           lse_base=2)  # fmt: skip
    _expect_grads(got, want, "vss", dtype, "float32")
    got = cm.merge_state_backward(v[0], s[0], v[1], s[1], grad_v)  # eager, no LSE gradient
    want = reference.merge_state_backward(*(_host(x) for x in (v[0], s[0], v[1], s[1], grad_v)))
    assert got[4] is None
    _expect_grads(got[:4], want[:4], "vsvs", dtype, "float32")


def test_fp8_outputs_are_not_differentiable(rng):
    v, s, w, t = _states(rng, 4, 2, 64, "float32")
    scale = jnp.array([0.5], jnp.float32)
    with pytest.raises(TypeError, match=r"an FP8 \(float8_e4m3fn\) output is not differentiable"):
        jax.grad(lambda x: cmj.merge_state(x, s, w, t, out_dtype=FP8, output_scale=scale)[1].sum())(v)


_GRAD_REPLAY = textwrap.dedent(
    """
    import json
    import numpy as np, jax, jax.numpy as jnp
    from cupy_merge import _launch, reference
    launches = [0]
    original = _launch.launch_patched
    def counting(*args):
        launches[0] += 1
        original(*args)
    _launch.launch_patched = counting
    import cupy_merge.jax as cmj

    rng = np.random.default_rng()
    T, H, D = 64, 8, 128
    R, Q = rng.standard_normal((T, H, D)).astype(np.float32), rng.standard_normal((H, T)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    indptr = np.array([0, 40, 40, 100, 128], np.int32)
    R4, Q4 = R[:4], Q[:, :4]

    def loss(v, s, w, t, z, c):
        out, lse = cmj.merge_state(v * c, s + c, w, t, sinks=z)
        rows, rows_lse = jnp.concatenate([v, w]), jnp.concatenate([s, t], axis=1)
        ragged, ragged_lse = cmj.merge_states_varlen(rows, rows_lse, jnp.asarray(indptr), check_indptr=False)
        return (out * R).sum() + (lse * Q).sum() + (ragged * R4).sum() + (ragged_lse * Q4).sum()

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4)))  # the value keeps the forward merges alive

    def want(v, s, w, t, c):
        g = reference.merge_state_backward(v * c, s + c, w, t, R, Q, sinks=sinks.astype(np.float64))
        rows = reference.merge_states_varlen_backward(np.concatenate([v, w]), np.concatenate([s, t], axis=1),
                                                      indptr, R4, Q4)
        return [c * g[0] + rows[0][:T], g[1] + rows[1][:, :T], g[2] + rows[0][T:], g[3] + rows[1][:, T:], g[4]]

    host = [rng.standard_normal((T, H, D)).astype(np.float32), rng.standard_normal((H, T)).astype(np.float32)]
    host = [host[0], host[1], 2 * host[0][::-1].copy(), host[1][:, ::-1].copy()]
    arrays = [jnp.asarray(x) for x in host]
    runs, worst = 12, 0.0
    for run in range(runs):
        c = np.float32(rng.uniform(0.5, 2.0))
        _, got = step(*arrays, jnp.asarray(sinks), c)
        exact = want(*(x.astype(np.float64) for x in host), np.float64(c))
        for g, e in zip(got, exact):
            worst = max(worst, float(np.linalg.norm(np.asarray(g, np.float64) - e) / np.linalg.norm(e)))
        if run == runs // 2:
            host = [x * np.float32(1.5) for x in host]
            arrays = [jnp.asarray(x) for x in host]
    # Per step: two merges, two gradients, and the sum of the two-way gradient's sink terms.
    print(json.dumps({"launches": 5 * runs, "launched_by_python": launches[0], "worst": worst}))
    """
)


@pytest.mark.parametrize(
    "flags", ["--xla_gpu_graph_min_graph_size=1", "", "--xla_gpu_enable_command_buffer="]
)
def test_a_jitted_gradient_replays_with_new_data_in_and_out_of_cuda_graphs(flags):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    done = subprocess.run(
        [sys.executable, "-c", _GRAD_REPLAY], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["worst"] <= 1e-5, result
    if flags == "--xla_gpu_enable_command_buffer=":
        assert result["launched_by_python"] == result["launches"], result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vmapped_gradients_of_rows_of_many_states_fold_the_merges_results_too(rng, dtype):
    """Rows of many states take the gradient kernel given the merge's results; under vmap the
    results fold with the cotangents (dense: one token a batch element, folded into the tokens;
    ragged: the batches' rows back to back, a token of offsets out of range given an empty merged
    LSE), so each batch element's gradients are its own."""
    v = _device(rng.standard_normal((3, 40, 1, 8, 64)), dtype)  # [B, N, T=1, H, D]: folded
    s = jnp.asarray(_lse(rng, 3, 40, 8, 1))
    out_weight, lse_weight = _weights(rng, (1, 8, 64), dtype), _weights(rng, (8, 1))
    loss = _linear_loss(lambda a, b: cmj.merge_states(a, b), out_weight, lse_weight)
    want = _batched_host(lambda a, b: reference.merge_states_backward(a, b, _host(out_weight), _host(lse_weight))[:2],
                         _host(v), _host(s))  # fmt: skip
    for transform in (jax.vmap(jax.grad(loss, (0, 1))), jax.grad(lambda a, b: jax.vmap(loss)(a, b).sum(), (0, 1))):
        _expect_grads(jax.jit(transform)(v, s), want, "vs", dtype, given_results=True)
    rows = _device(rng.standard_normal((3, 90, 8, 64)), dtype)  # ragged, ~30 rows a token
    rows_lse = jnp.asarray(_lse(rng, 3, 8, 90))
    # Batch element 1's last token has offsets out of range (merged to NaN): its rows get zeros,
    # as unbatched, and the reference sees it empty.
    indptr = jnp.array([[0, 30, 31, 70], [0, 0, 45, 200], [2, 22, 60, 88]], jnp.int32)
    in_range = np.array([[0, 30, 31, 70], [0, 0, 45, 45], [2, 22, 60, 88]])
    out_weight, lse_weight = _weights(rng, (3, 8, 64), dtype), _weights(rng, (8, 3))
    loss = _linear_loss(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False), out_weight, lse_weight)
    want = []
    for b in range(3):  # the reference wants offsets from 0: rows before the first are zeros
        first = int(in_range[b, 0])
        grads = reference.merge_states_varlen_backward(_host(rows[b])[first:], _host(rows_lse[b])[:, first:],
                                                       in_range[b] - first, _host(out_weight),
                                                       _host(lse_weight))  # fmt: skip
        want.append((np.pad(grads[0], ((first, 0), (0, 0), (0, 0))), np.pad(grads[1], ((0, 0), (first, 0)))))
    want = [np.stack(column) for column in zip(*want)]
    for transform in (jax.vmap(jax.grad(loss, (0, 1))), jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1))):
        _expect_grads(jax.jit(transform)(rows, rows_lse, indptr), want, "vs", dtype, given_results=True)
