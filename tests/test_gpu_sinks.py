"""Attention sinks in every merge on a GPU: counted exactly once, where the partial states meet."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import fill_nan, relative_error, to_device, to_host
from sinks_reference import attention_with_sinks, split_states

import cupy_merge as cm
from cupy_merge import _tuning, reference

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
KERNELS = {"packed": _tuning.DEFAULT, "strided": _tuning.DEFAULT.replace(packed_kernels=False)}


def _sinks(rng, heads, backend="cupy"):
    return to_device(rng.standard_normal(heads) * 2, "float32", backend)


def _expect(got_v, got_s, want_v, want_s, dtype, base=1.0):
    got_v, got_s = to_host(got_v), to_host(got_s)
    assert np.isfinite(got_v).all() and np.isfinite(got_s).all(), "an output was not written"
    assert relative_error(got_v, want_v) <= TOLERANCE[dtype]
    assert relative_error(got_s * base, want_s) <= 1e-5


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("pieces, tokens", [(2, 7), (5, 1), (16, 64)])
def test_n_way_merges_with_sinks_are_attention_with_sinks_over_the_whole_sequence(
    rng, kernels, dtype, lse_base, pieces, tokens
):
    heads, head_size = 8, 64
    (q, k, v), values, lses = split_states(rng, tokens, heads, head_size, 40 * pieces, pieces, empty=(1,))
    base = np.log(2.0) if lse_base == 2 else 1.0
    v_dev = to_device(values, dtype)
    s_dev = to_device(lses / base, "float32")
    sinks = _sinks(rng, heads)
    with _tuning.use(KERNELS[kernels]):
        got_v, got_s = cm.merge_states(v_dev, s_dev, sinks=sinks, lse_base=lse_base)
    want_v, want_s = reference.merge_states(to_host(v_dev), lses, sinks=to_host(sinks))
    _expect(got_v, got_s, want_v, want_s, dtype, base)
    if dtype == "float32":
        exact_v, _ = attention_with_sinks(q, k, v, to_host(sinks))
        assert relative_error(to_host(got_v), exact_v) <= 1e-5


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_every_two_way_entry_point_counts_the_sink_once(rng, kernels, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    tokens, heads, head_size = 33, 4, 128
    (q, k, v), values, lses = split_states(rng, tokens, heads, head_size, 60, 2)
    v_a, v_b = (to_device(x, "float32", backend) for x in values)
    s_a, s_b = (to_device(x, "float32", backend) for x in lses)
    sinks = _sinks(rng, heads, backend)
    want_v, want_s = attention_with_sinks(q, k, v, to_host(sinks))
    with _tuning.use(KERNELS[kernels]):
        got = cm.merge_state(v_a, s_a, v_b, s_b, sinks=sinks)
        _expect(*got, want_v, want_s, "float32")
        out, out_lse = (x.clone() if backend == "torch" else x.copy() for x in (v_a, s_a))
        fill_nan(out)
        fill_nan(out_lse)
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, sinks=sinks)
        _expect(out, out_lse, want_v, want_s, "float32")
        cm.merge_state_in_place(v_a, s_a, v_b, s_b, sinks=sinks)
        _expect(v_a, s_a, want_v, want_s, "float32")


@pytest.mark.parametrize("kernels", KERNELS)
def test_tokens_past_the_prefill_cut_take_the_suffix_merged_with_the_sink_alone(rng, kernels):
    import cupy

    tokens, heads, head_size, cut = 20, 4, 64, 9
    prefix, suffix = (to_device(rng.standard_normal((tokens, heads, head_size)), "float32") for _ in range(2))
    s_p, s_s = (to_device(rng.standard_normal((heads, tokens)) * 2, "float32") for _ in range(2))
    sinks = cupy.asarray(np.array([0.5, -np.inf, 2.0, -1.0], dtype=np.float32))  # head 1: no sink
    out, out_lse = cupy.full_like(prefix, np.nan), cupy.full_like(s_p, np.nan)
    with _tuning.use(KERNELS[kernels]):
        cm.merge_attn_states(out, prefix, s_p, suffix, s_s, out_lse, cut, sinks=sinks)
    host = [to_host(x) for x in (prefix, s_p, suffix, s_s)]
    merged_v, merged_s = reference.merge_state(*(x[:cut] if x.ndim == 3 else x[:, :cut] for x in host),
                                               sinks=to_host(sinks))  # fmt: skip
    alone_v, alone_s = reference.merge_states(host[2][None, cut:], host[3][None, :, cut:], sinks=to_host(sinks))
    assert relative_error(to_host(out[:cut]), merged_v) <= 1e-5
    assert relative_error(to_host(out_lse[:, :cut]), merged_s) <= 1e-6
    assert relative_error(to_host(out[cut:]), alone_v) <= 1e-5
    assert relative_error(to_host(out_lse[:, cut:]), alone_s) <= 1e-6
    # Without a sink (head 1) the suffix is copied bit for bit.
    np.testing.assert_array_equal(out[cut:, 1].get().view(np.uint32), suffix[cut:, 1].get().view(np.uint32))
    np.testing.assert_array_equal(out_lse[1, cut:].get().view(np.uint32), s_s[1, cut:].get().view(np.uint32))


def test_masked_out_tokens_stay_untouched_with_sinks(rng):
    import cupy

    v, w = (to_device(rng.standard_normal((6, 2, 32)), "float16") for _ in range(2))
    s, t = (to_device(rng.standard_normal((2, 6)), "float32") for _ in range(2))
    before_v, before_s = v.copy(), s.copy()
    mask = cupy.asarray([True, False, True, False, False, True])
    cm.merge_state_in_place(v, s, w, t, mask=mask, sinks=_sinks(rng, 2))
    untouched = ~mask.get()
    np.testing.assert_array_equal(v.get()[untouched], before_v.get()[untouched])
    np.testing.assert_array_equal(s.get()[:, untouched], before_s.get()[:, untouched])


@pytest.mark.parametrize("kernels", KERNELS)
def test_ragged_tokens_with_no_states_get_zero_and_their_sink(rng, kernels):
    import cupy

    counts = np.array([3, 0, 1, 0, 7])
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows, heads, head_size = int(indptr[-1]), 4, 32
    v = to_device(rng.standard_normal((rows, heads, head_size)), "bfloat16")
    s = to_device(rng.standard_normal((heads, rows)) * 2, "float32")
    sinks = _sinks(rng, heads)
    with _tuning.use(KERNELS[kernels]):
        got_v, got_s = cm.merge_states_varlen(v, s, cupy.asarray(indptr), sinks=sinks)
    want_v, want_s = reference.merge_states_varlen(to_host(v), to_host(s), indptr, sinks=to_host(sinks))
    _expect(got_v, got_s, want_v, want_s, "bfloat16")
    assert (to_host(got_v)[counts == 0] == 0).all()
    np.testing.assert_allclose(to_host(got_s)[:, counts == 0], np.repeat(to_host(sinks)[:, None], 2, 1), rtol=1e-6)


def test_n_way_with_no_states_gives_zero_and_the_sink(rng):
    import cupy

    sinks = _sinks(rng, 3)
    out, lse = cm.merge_states(cupy.zeros((0, 4, 3, 16), cupy.float16), cupy.zeros((0, 3, 4), cupy.float32),
                               sinks=sinks)  # fmt: skip
    assert (to_host(out) == 0).all()
    np.testing.assert_allclose(to_host(lse), np.repeat(to_host(sinks)[:, None], 4, 1), rtol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
def test_nan_and_infinite_sinks(rng, kernels):
    import cupy

    v = to_device(rng.standard_normal((3, 5, 4, 16)), "float32")
    s = to_device(rng.standard_normal((3, 4, 5)), "float32")
    sinks = cupy.asarray(np.array([np.nan, -np.inf, np.inf, 0.0], dtype=np.float32))
    with _tuning.use(KERNELS[kernels]):
        got_v, got_s = (to_host(x) for x in cm.merge_states(v, s, sinks=sinks))
        two_v, two_s = (to_host(x) for x in cm.merge_state(v[0], s[0], v[1], s[1], sinks=sinks))
    plain_v, _ = reference.merge_states(to_host(v), to_host(s))
    assert np.isnan(got_v[:, 0]).all() and np.isnan(got_s[0]).all()
    # -inf: no sink (relative to the row's norm: an element near zero after cancellation is off
    # by a few float32 ulps of the larger terms, seen once in ~2000 runs)
    assert relative_error(got_v[:, 1], plain_v[:, 1]) <= 1e-5
    assert (got_v[:, 2] == 0).all() and np.isposinf(got_s[2]).all()  # +inf: all the weight
    assert np.isnan(two_v[:, 0]).all() and (two_v[:, 2] == 0).all() and np.isposinf(two_s[2]).all()


@pytest.mark.parametrize("scale_kind", ["tensor", "group"])
def test_fp8_outputs_with_sinks(rng, scale_kind):
    import cupy
    import ml_dtypes

    v = to_device(rng.standard_normal((4, 8, 4, 128)), "bfloat16")
    s = to_device(rng.standard_normal((4, 4, 8)), "float32")
    sinks = _sinks(rng, 4)
    want_v, _ = reference.merge_states(to_host(v), to_host(s), sinks=to_host(sinks))
    if scale_kind == "tensor":
        scale = cupy.asarray([0.01], dtype=cupy.float32)
        out, _ = cm.merge_states(v, s, out_dtype="float8_e4m3fn", output_scale=scale, sinks=sinks)
        got = out.get().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.01
    else:
        scales = cupy.full((8, 4), np.nan, dtype=cupy.float32)
        out, _ = cm.merge_states(v, s, out_dtype="float8_e4m3fn", output_block_scale=scales, quant_group_size=128,
                                 sinks=sinks)  # fmt: skip
        got = out.get().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scales.get()[..., None]
    assert relative_error(got, want_v) <= 7e-2


def test_a_bound_merge_with_sinks_reads_the_sinks_at_each_launch(rng):
    import cupy

    v = to_device(rng.standard_normal((6, 3, 2, 64)), "float16")
    s = to_device(rng.standard_normal((6, 2, 3)), "float32")
    sinks = cupy.zeros(2, dtype=cupy.float32)
    merge = cm.bind(cm.merge_states, v, s, sinks=sinks)
    for value in (0.0, 3.0):
        sinks[...] = value
        out, lse = merge()
        want_v, want_s = reference.merge_states(to_host(v), to_host(s), sinks=to_host(sinks))
        _expect(out, lse, want_v, want_s, "float16")
