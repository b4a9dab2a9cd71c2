"""N-way and ragged merges, LSE bases, output dtypes, the token mask and prefill_tokens_with_context, on a GPU.

Tolerances are norm-relative against the float64 reference computed from the
values the kernel read. N-way in float32 sums up to 1024 products per element
in float32: its error grows like sqrt(num_states) ulp, so 1e-5 still leaves a
margin of ~10 at 1024 states, while any wrong weight or index gives 1e-2 or
more. 16-bit outputs add one rounding (2^-9 at most): 1e-2.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gpu_arrays import backend_for, fill_nan, relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import _dispatch, _plan, _tuning, reference

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
LN2 = np.log(2.0)


def _lse(rng, *shape):
    return (rng.standard_normal(shape) * 6).astype(np.float32)


def _empty_outputs(tokens, heads, head_size, dtype, backend):
    out = to_device(np.zeros((tokens, heads, head_size)), dtype, backend)
    out_lse = to_device(np.zeros((heads, tokens)), "float32", backend)
    fill_nan(out)
    fill_nan(out_lse)
    return out, out_lse


def _expect(got_v, got_s, want_v, want_s, dtype, lse_tolerance=1e-6):
    got_v, got_s = to_host(got_v), to_host(got_s)
    assert not np.isnan(got_v).any(), "an output element was not written (NaN poison survived)"
    assert not np.isnan(got_s).any(), "an output LSE was not written"
    assert relative_error(got_v, want_v) <= TOLERANCE[dtype]
    finite = np.isfinite(want_s)
    np.testing.assert_array_equal(got_s[~finite], want_s[~finite])
    assert relative_error(got_s[finite], want_s[finite]) <= lse_tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_states", [1, 2, 3, 8, 64, 256, 1024])
def test_merge_states_matches_reference(rng, num_states, dtype):
    backend = backend_for(dtype)
    tokens, heads, head_size = (7, 4, 64) if num_states >= 256 else (37, 8, 128)
    v = to_device(rng.standard_normal((num_states, tokens, heads, head_size)), dtype, backend)
    s = to_device(_lse(rng, num_states, heads, tokens), "float32", backend)
    out, out_lse = _empty_outputs(tokens, heads, head_size, dtype, backend)
    got_v, got_s = cm.merge_states(v, s, out=out, out_lse=out_lse)
    assert got_v is out and got_s is out_lse
    _expect(out, out_lse, *reference.merge_states(to_host(v), to_host(s)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_states, tokens, heads, head_size",
    [(4, 2048, 16, 128), (3, 9, 5, 1), (6, 9, 5, 7), (9, 9, 5, 100), (33, 9, 5, 576)],
)
def test_many_tokens_and_any_head_size(rng, num_states, tokens, heads, head_size, dtype):
    # 2048 x 16 rows need no state splits; a few tokens with many states use them.
    backend = backend_for(dtype)
    v = to_device(rng.standard_normal((num_states, tokens, heads, head_size)), dtype, backend)
    s = to_device(_lse(rng, num_states, heads, tokens), "float32", backend)
    out, out_lse = _empty_outputs(tokens, heads, head_size, dtype, backend)
    cm.merge_states(v, s, out=out, out_lse=out_lse)
    _expect(out, out_lse, *reference.merge_states(to_host(v), to_host(s)), dtype)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_every_input_and_output_dtype_pair(rng, in_dtype, out_dtype):
    backend = "torch" if "torch" in (backend_for(in_dtype), backend_for(out_dtype)) else "cupy"
    v = to_device(rng.standard_normal((5, 29, 6, 96)), in_dtype, backend)
    s = to_device(_lse(rng, 5, 6, 29), "float32", backend)
    got_v, got_s = cm.merge_states(v, s, out_dtype=out_dtype)
    assert str(got_v.dtype).removeprefix("torch.") == out_dtype
    _expect(got_v, got_s, *reference.merge_states(to_host(v), to_host(s)), out_dtype)
    # The two-way merge converts too, into a caller's out of another dtype.
    out = to_device(np.zeros((29, 6, 96)), out_dtype, backend)
    fill_nan(out)
    cm.merge_attn_states(out, v[0], s[0], v[1], s[1])
    want, _ = reference.merge_state(to_host(v[0]), to_host(s[0]), to_host(v[1]), to_host(s[1]))
    assert relative_error(to_host(out), want) <= TOLERANCE[out_dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_token_major_buffers_pass_as_transposed_views(rng, dtype):
    backend = backend_for(dtype)
    tokens, states, heads, head_size = 33, 6, 4, 128
    v_token_major = to_device(rng.standard_normal((tokens, states, heads, head_size)), dtype, backend)
    s_token_major = to_device(_lse(rng, tokens, states, heads), "float32", backend)
    if backend == "torch":
        v, s = v_token_major.transpose(0, 1), s_token_major.permute(1, 2, 0)
    else:
        v, s = v_token_major.transpose(1, 0, 2, 3), s_token_major.transpose(1, 2, 0)
    out, _ = _empty_outputs(tokens, heads, head_size, dtype, backend)
    lse_token_major = to_device(np.zeros((tokens, heads)), "float32", backend)
    fill_nan(lse_token_major)
    cm.merge_states(v, s, out=out, out_lse=lse_token_major.T)
    _expect(out, lse_token_major.T, *reference.merge_states(to_host(v), to_host(s)), dtype)


def test_states_cut_from_a_larger_buffer_leave_the_rest_alone(rng):
    import cupy

    big = cupy.asarray(rng.standard_normal((10, 40, 9, 136)).astype(np.float32))
    v = big[1:9:2, 3:35, 2:8, 8:136]  # strided in states, tokens and heads
    s = cupy.asarray(_lse(rng, 8, 12, 70))[::2, ::2, 3:35]
    out_big = cupy.full((40, 9, 136), np.nan, dtype=np.float32)
    out = out_big[3:35, 2:8, 8:136]
    out_lse = cupy.full((6, 32), np.nan, dtype=np.float32)
    cm.merge_states(v, s, out=out, out_lse=out_lse)
    _expect(out, out_lse, *reference.merge_states(to_host(v), to_host(s)), "float32")
    untouched = np.ones(out_big.shape, dtype=bool)
    untouched[3:35, 2:8, 8:136] = False
    assert np.isnan(to_host(out_big)[untouched]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_base_2_lse_in_and_out(rng, dtype):
    backend = backend_for(dtype)
    v = to_device(rng.standard_normal((4, 50, 8, 64)), dtype, backend)
    s_natural = _lse(rng, 4, 8, 50)
    s2 = to_device(s_natural / LN2, "float32", backend)
    got_v, got_s = cm.merge_states(v, s2, lse_base=2)
    want_v, want_s = reference.merge_states(to_host(v), to_host(s2), lse_base=2)
    _expect(got_v, got_s, want_v, want_s, dtype, lse_tolerance=2e-6)
    # Same for both two-way merges, including against the natural-log answer.
    v2, s2_two = cm.merge_state(v[0], s2[0], v[1], s2[1], lse_base=2)
    want_v, want_s = reference.merge_state(to_host(v[0]), s_natural[0], to_host(v[1]), s_natural[1])
    _expect(v2, s2_two, want_v, want_s / LN2, dtype, lse_tolerance=2e-6)
    out, out_lse = _empty_outputs(50, 8, 64, dtype, backend)
    cm.merge_attn_states(out, v[0], s2[0], v[1], s2[1], out_lse, lse_base=2)
    _expect(out, out_lse, want_v, want_s / LN2, dtype, lse_tolerance=2e-6)


def test_base_2_lse_fed_as_natural_is_wrong_which_is_why_the_flag_exists(rng):
    import cupy

    v = cupy.asarray(rng.standard_normal((3, 20, 4, 64)).astype(np.float32))
    s = cupy.asarray(_lse(rng, 3, 4, 20))
    right, _ = cm.merge_states(v, s, lse_base=2)
    wrong, _ = cm.merge_states(v, s)
    assert relative_error(to_host(wrong), to_host(right)) > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_inf_and_nan_pattern_across_many_states(rng, dtype):
    backend = backend_for(dtype)
    states, tokens, heads = 5, 60, 3
    s = _lse(rng, states, heads, tokens)
    kind = rng.integers(0, 8, size=(states, heads, tokens))
    s[kind == 1] = -np.inf
    s[kind == 2] = np.inf  # read as -inf
    s[kind == 3] = np.nan
    s[:, :, :6] = -np.inf  # some rows with every state empty
    s[1, :, 6:9] = np.inf
    s[[0, 2, 3, 4], :, 6:9] = -np.inf
    v = rng.standard_normal((states, tokens, heads, 32))
    v[np.swapaxes(np.isinf(s), 1, 2)] = np.nan  # empty states hold garbage
    v_dev, s_dev = to_device(v, dtype, backend), to_device(s, "float32", backend)
    got_v, got_s = cm.merge_states(v_dev, s_dev)
    want_v, want_s = reference.merge_states(to_host(v_dev), s)
    got_v, got_s = to_host(got_v), to_host(got_s)
    np.testing.assert_array_equal(np.isnan(got_v), np.isnan(want_v))
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(want_s))
    empty = np.isneginf(want_s)
    assert empty[:, :9].all() and (got_v[empty.T] == 0).all() and np.isneginf(got_s[empty]).all()
    finite = np.isfinite(want_v)
    assert relative_error(got_v[finite], want_v[finite]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_merge_with_empty_tokens(rng, dtype, index_dtype):
    import cupy

    backend = backend_for(dtype)
    counts = np.array([3, 0, 1, 17, 0, 0, 64, 2, 5, 0])
    indptr_host = np.concatenate([[0], np.cumsum(counts)])
    total = int(indptr_host[-1]) + 3  # trailing rows no token owns
    v = to_device(rng.standard_normal((total, 6, 80)), dtype, backend)
    s = to_device(_lse(rng, 6, total), "float32", backend)
    if backend == "torch":
        import torch

        indptr = torch.tensor(indptr_host, dtype=getattr(torch, index_dtype), device="cuda")
    else:
        indptr = cupy.asarray(indptr_host.astype(index_dtype))
    out, out_lse = _empty_outputs(len(counts), 6, 80, dtype, backend)
    cm.merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse)
    want_v, want_s = reference.merge_states_varlen(to_host(v), to_host(s), indptr_host)
    _expect(out, out_lse, want_v, want_s, dtype)
    assert (to_host(out)[counts == 0] == 0).all()


def test_varlen_checks_indptr_on_the_host_and_guards_it_on_the_device(rng):
    import cupy

    v = cupy.asarray(rng.standard_normal((6, 2, 16)).astype(np.float32))
    s = cupy.asarray(_lse(rng, 2, 6))
    for bad, message in (([1, 3, 6], "first entry"), ([0, 4, 2], "non-decreasing"), ([0, 3, 7], "at most")):
        with pytest.raises(ValueError, match=f"indptr: expected.*{message}"):
            cm.merge_states_varlen(v, s, cupy.asarray(bad, dtype=np.int32))
    # Unchecked, a bad token gets NaN and the good ones are merged; nothing outside v is read.
    indptr = cupy.asarray([0, 2, 99, 6, 6], dtype=np.int64)
    out, lse = cm.merge_states_varlen(v, s, indptr, check_indptr=False)
    got = to_host(out)
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    want, _ = reference.merge_states_varlen(to_host(v), to_host(s), [0, 2])
    assert relative_error(got[0], want[0]) <= 1e-5
    assert (got[3] == 0).all() and np.isneginf(to_host(lse)[:, 3]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_merge_with_a_token_mask(rng, dtype):
    backend = backend_for(dtype)
    tokens, heads, head_size = 70, 5, 128
    v = to_device(rng.standard_normal((tokens, heads, head_size)), dtype, backend)
    s = to_device(_lse(rng, heads, tokens), "float32", backend)
    v_other = to_device(rng.standard_normal((tokens, heads, head_size)), dtype, backend)
    s_other = to_device(_lse(rng, heads, tokens), "float32", backend)
    mask_host = rng.random(tokens) < 0.5
    if backend == "torch":
        import torch

        mask = torch.from_numpy(mask_host).cuda()
    else:
        import cupy

        mask = cupy.asarray(mask_host)
    before_v, before_s = to_host(v), to_host(s)
    want_v, want_s = reference.merge_state(before_v, before_s, to_host(v_other), to_host(s_other))
    cm.merge_state_in_place(v, s, v_other, s_other, mask)
    got_v, got_s = to_host(v), to_host(s)
    np.testing.assert_array_equal(got_v[~mask_host], before_v[~mask_host])
    np.testing.assert_array_equal(got_s[:, ~mask_host], before_s[:, ~mask_host])
    assert relative_error(got_v[mask_host], want_v[mask_host]) <= TOLERANCE[dtype]
    assert relative_error(got_s[:, mask_host], want_s[:, mask_host]) <= 1e-6
    cm.merge_state_in_place(v, s, v_other, s_other)  # no mask: every token
    want_v, _ = reference.merge_state(got_v, got_s, to_host(v_other), to_host(s_other))
    assert relative_error(to_host(v), want_v) <= TOLERANCE[dtype]


@pytest.mark.parametrize("prefill", [0, 1, 40, 100, 1000])
def test_prefill_tokens_with_context_copies_the_suffix_past_it(rng, prefill):
    backend = backend_for("bfloat16")
    tokens = 100
    v_a, v_b = (to_device(rng.standard_normal((tokens, 8, 128)), "bfloat16", backend) for _ in range(2))
    s_a, s_b = (to_device(_lse(rng, 8, tokens), "float32", backend) for _ in range(2))
    out, out_lse = _empty_outputs(tokens, 8, 128, "bfloat16", backend)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, prefill)
    want_v, want_s = reference.merge_state(*(to_host(x) for x in (v_a, s_a, v_b, s_b)))
    got_v, got_s = to_host(out), to_host(out_lse)
    cut = min(prefill, tokens)
    np.testing.assert_array_equal(got_v[cut:], to_host(v_b)[cut:])
    np.testing.assert_array_equal(got_s[:, cut:], to_host(s_b)[:, cut:])
    if cut:
        assert relative_error(got_v[:cut], want_v[:cut]) <= 1e-2
        assert relative_error(got_s[:, :cut], want_s[:, :cut]) <= 1e-6


def test_many_states_from_attention_split_into_chunks(rng):
    import cupy

    tokens, heads, head_size, kv_len, chunks = 9, 4, 64, 1000, 13
    q, k, v = (rng.standard_normal((n, heads, head_size)) for n in (tokens, kv_len, kv_len))
    edges = np.linspace(0, kv_len, chunks + 1).astype(int)
    edges[3] = edges[4]  # one empty chunk
    parts = [reference.attention(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(edges)]
    v_parts = cupy.asarray(np.stack([p[0] for p in parts]).astype(np.float32))
    s_parts = cupy.asarray(np.stack([p[1] for p in parts]).astype(np.float32))
    got_v, got_s = cm.merge_states(v_parts, s_parts)
    want_v, want_s = reference.attention(q, k, v)
    assert relative_error(to_host(got_v), want_v) <= 1e-5
    assert relative_error(to_host(got_s), want_s) <= 1e-6


def test_repeated_calls_see_new_data_and_new_buffers(rng):
    import cupy

    v = cupy.asarray(rng.standard_normal((4, 16, 8, 64)).astype(np.float32))
    s = cupy.asarray(_lse(rng, 4, 8, 16))
    out, out_lse = cupy.empty((16, 8, 64), np.float32), cupy.empty((8, 16), np.float32)
    for _ in range(3):  # the fast path replays the launch with the same buffers
        v[...] = cupy.asarray(rng.standard_normal(v.shape).astype(np.float32))
        cm.merge_states(v, s, out=out, out_lse=out_lse)
        _expect(out, out_lse, *reference.merge_states(to_host(v), to_host(s)), "float32")
    out2 = cupy.full_like(out, np.nan)
    cm.merge_states(v, s, out=out2, out_lse=out_lse)
    _expect(out2, out_lse, *reference.merge_states(to_host(v), to_host(s)), "float32")
    with pytest.raises(ValueError, match="out: expected shape"):
        cm.merge_states(v, s, out=out[:8], out_lse=out_lse)


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("ragged", [False, True])
def test_repeated_allocating_calls_get_fresh_outputs_each_time(rng, backend, ragged):
    # The second call on the same inputs replays the first one's launch with new output
    # pointers: each result must be its own, correct, and untouched by the later calls.
    if backend == "torch":
        pytest.importorskip("torch")
    if ragged:
        v = to_device(rng.standard_normal((9, 8, 64)), "float16", backend)
        s = to_device(_lse(rng, 8, 9), "float32", backend)
        indptr = to_device(np.array([0, 2, 2, 5, 9]), "int32", backend)
        merge = lambda: cm.merge_states_varlen(v, s, indptr, check_indptr=False)
        want = lambda: reference.merge_states_varlen(to_host(v), to_host(s), to_host(indptr).astype(int))
    else:
        v = to_device(rng.standard_normal((5, 16, 8, 64)), "float16", backend)
        s = to_device(_lse(rng, 5, 8, 16), "float32", backend)
        merge = lambda: cm.merge_states(v, s)
        want = lambda: reference.merge_states(to_host(v), to_host(s))
    results = []
    for _ in range(3):
        v[...] = to_device(rng.standard_normal(tuple(v.shape)), "float16", backend)
        results.append((merge(), want()))
    pointers = set()
    for (got_v, got_s), (want_v, want_s) in results:
        _expect(got_v, got_s, want_v, want_s, "float16")
        pointers.add(got_v.data_ptr() if backend == "torch" else got_v.data.ptr)
    assert len(pointers) == 3


def _bad_calls(cupy):
    v = cupy.ones((3, 8, 4, 64), dtype=np.float16)
    s = cupy.zeros((3, 4, 8), dtype=np.float32)
    out = cupy.full((8, 4, 64), 7, dtype=np.float16)
    out_lse = cupy.full((4, 8), 7, dtype=np.float32)
    indptr = cupy.asarray([0, 1, 3], dtype=np.int32)
    two = (v[0], s[0], v[1], s[1])
    return (
        out,
        out_lse,
        [
            ("v", TypeError, lambda: cm.merge_states(v.astype(np.float64), s, out=out, out_lse=out_lse)),
            ("s", ValueError, lambda: cm.merge_states(v, s[:2], out=out, out_lse=out_lse)),
            ("out", ValueError, lambda: cm.merge_states(v, s, out=out[:4], out_lse=out_lse)),
            ("out", ValueError, lambda: cm.merge_states(v, s, out=v[0], out_lse=out_lse)),
            (
                "out_dtype",
                TypeError,
                lambda: cm.merge_states(v, s, out=out, out_lse=out_lse, out_dtype="float32"),
            ),
            ("out_dtype", TypeError, lambda: cm.merge_states(v, s, out_dtype="float64")),
            ("lse_base", ValueError, lambda: cm.merge_states(v, s, out=out, out_lse=out_lse, lse_base=10)),
            (
                "indptr",
                TypeError,
                lambda: cm.merge_states_varlen(v[0, :3], s[0, :, :3], indptr.astype(np.float32)),
            ),
            ("indptr", ValueError, lambda: cm.merge_states_varlen(v[0, :3], s[0, :, :3], indptr + 1)),
            (
                "mask",
                TypeError,
                lambda: cm.merge_state_in_place(out, out_lse, *two[2:], mask=cupy.ones(8, np.int32)),
            ),
            (
                "mask",
                ValueError,
                lambda: cm.merge_state_in_place(out, out_lse, *two[2:], mask=cupy.ones(7, bool)),
            ),
            ("prefill_tokens_with_context", ValueError, lambda: cm.merge_attn_states(out, *two, out_lse, -1)),
            ("prefill_tokens_with_context", TypeError, lambda: cm.merge_attn_states(out, *two, out_lse, 2.5)),
            ("lse_base", ValueError, lambda: cm.merge_attn_states(out, *two, out_lse, lse_base="2.0")),
        ],
    )


def test_every_bad_call_raises_naming_the_argument_and_writes_nothing():
    import cupy

    out, out_lse, calls = _bad_calls(cupy)
    for argument, error, call in calls:
        with pytest.raises(error, match=f"^{argument}: expected"):
            call()
    cupy.cuda.runtime.deviceSynchronize()
    assert (out == 7).all() and (out_lse == 7).all()


@pytest.fixture
def planner(monkeypatch):
    """Plan under another tuning, or with 64-bit offsets forced: a context; no call or plan made
    under one setting is reused under another."""

    def switch(index_32_limit=None, **tuning):
        for cache in ("_calls", "_plans", "_calls_by_tuning"):
            monkeypatch.setattr(_dispatch, cache, {})
        if index_32_limit is not None:
            monkeypatch.setattr(_plan, "INDEX_32_LIMIT", index_32_limit)
        return _tuning.use(_tuning.DEFAULT.replace(**tuning))

    return switch


@pytest.mark.parametrize("num_states", [2, 5, 64])
def test_both_kernel_families_and_both_offset_widths_agree(rng, num_states, planner):
    # Large arrays take the 64-bit instantiations (test_gpu_merge covers one past 2^31
    # elements); here every variant runs on the same data. The strided kernel gives the same
    # bits in either offset width; the packed one sums in another order (two passes).
    v = to_device(rng.standard_normal((num_states, 37, 8, 128)), "float16", "cupy")
    s = to_device(_lse(rng, num_states, 8, 37), "float32", "cupy")
    packed = [to_host(x) for x in cm.merge_states(v, s)]
    with planner(packed_kernels=False):
        narrow = [to_host(x) for x in cm.merge_states(v, s)]
    with planner(index_32_limit=0, packed_kernels=False):
        wide = [to_host(x) for x in cm.merge_states(v, s)]
    for got, want in zip(wide, narrow):
        np.testing.assert_array_equal(got, want)
    want = reference.merge_states(to_host(v), to_host(s))
    for variant in (packed, narrow, wide):
        _expect(*variant, *want, "float16")


#: (tokens, heads, head_size, states): few rows, so the packed kernel's blocks narrow and
#: split each pack's states many ways, combined as a tree (shuffles, then shared memory).
WIDE_SPLIT_CASES = [
    (1, 32, 128, 1024),  # 4 packs x 128 splits: three shuffle levels, four through shared memory
    (2, 8, 64, 301),  # 76 splits: not a power of two
    (3, 1, 32, 9),  # 42 packs (not a power of two: no shuffles) x 3 splits, 12 of the packs real
    (1, 2, 96, 4100),  # rows of 12 packs, states past the splits' last chunk
]


def _with_empty_and_broken_states(rng, s, v):
    """Empty states (-inf and +inf, with NaN values) scattered over ``s`` [states, heads, tokens]
    and ``v`` [states, tokens, heads, head_size]; one NaN LSE in head 0's first token."""
    kind = rng.integers(0, 20, size=s.shape)
    s[kind == 0] = -np.inf
    s[kind == 1] = np.inf
    s[-1, 0, 0] = np.nan
    v[np.swapaxes(np.isinf(s), 1, 2)] = np.nan
    return s, v


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", WIDE_SPLIT_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_few_rows_of_many_states_combine_their_splits_as_a_tree(rng, case, dtype, sinks):
    tokens, heads, head_size, states = case
    backend = backend_for(dtype)
    s, v = _with_empty_and_broken_states(
        rng, _lse(rng, states, heads, tokens), rng.standard_normal((states, tokens, heads, head_size))
    )
    v_dev, s_dev = to_device(v, dtype, backend), to_device(s, "float32", backend)
    sink = (rng.standard_normal(heads) * 3).astype(np.float32) if sinks else None
    sink_dev = to_device(sink, "float32", backend) if sinks else None
    out, out_lse = _empty_outputs(tokens, heads, head_size, dtype, backend)
    cm.merge_states(v_dev, s_dev, out=out, out_lse=out_lse, sinks=sink_dev)
    want_v, want_s = reference.merge_states(to_host(v_dev), s, sinks=sink)
    got_v, got_s = to_host(out), to_host(out_lse)
    np.testing.assert_array_equal(np.isnan(got_v), np.isnan(want_v))  # the NaN row, and only it
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(want_s))
    assert np.isnan(got_s[0, 0]) and np.isfinite(got_s[:, 1:]).all() and np.isfinite(got_s[1:]).all()
    finite = np.isfinite(want_v)
    assert relative_error(got_v[finite], want_v[finite]) <= TOLERANCE[dtype]
    assert relative_error(got_s[np.isfinite(want_s)], want_s[np.isfinite(want_s)]) <= 1e-6
