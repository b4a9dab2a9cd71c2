"""The third reliability pass on a GPU: each defect of the review, pinned by the behaviour the README states."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import fill_nan, relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import _launch, _tuning, reference

pytestmark = pytest.mark.gpu

STRIDED = _tuning.DEFAULT.replace(packed_kernels=False)
FLT_MAX = float(np.finfo(np.float32).max)


def _tuning_of(packed: bool):
    return _tuning.use(_tuning.DEFAULT if packed else STRIDED)


# -- 1. A state of zero weight contributes exactly 0, even if its values are NaN, in N-way merges ----


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tokens", [1, 2048])  # 1: rows split over thread groups; 2048: not split
@pytest.mark.parametrize("tiny", [-1000.0, -FLT_MAX])
@pytest.mark.parametrize("first", [0, 5])  # the empty split folded before the others, or in their midst
def test_tiny_lse_states_with_nan_values_contribute_nothing(rng, packed, tokens, tiny, first):
    import cupy

    states, heads, head_size = 12, 8, 128
    v = rng.standard_normal((states, tokens, heads, head_size)).astype(np.float32)
    s = (rng.standard_normal((states, heads, tokens)) * 3).astype(np.float32)
    v[first] = np.nan  # an empty split: never written
    s[first] = tiny
    out = cupy.full((tokens, heads, head_size), np.nan, dtype=cupy.float32)
    out_lse = cupy.full((heads, tokens), np.nan, dtype=cupy.float32)
    with _tuning_of(packed):
        cm.merge_states(cupy.asarray(v), cupy.asarray(s), out=out, out_lse=out_lse)
    want_v, want_s = reference.merge_states(v, s)
    got_v = to_host(out)
    assert np.isfinite(got_v).all(), "a zero-weight state's NaN values leaked into the merge"
    assert relative_error(got_v, want_v) <= 1e-5
    assert relative_error(to_host(out_lse), want_s) <= 1e-6


@pytest.mark.parametrize("packed", [True, False])
def test_tiny_lse_rows_with_nan_values_in_a_ragged_merge_contribute_nothing(rng, packed):
    import cupy

    counts = np.array([9, 1, 30, 5])
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, heads, head_size = int(indptr[-1]), 4, 64
    v = rng.standard_normal((rows, heads, head_size)).astype(np.float32)
    s = (rng.standard_normal((heads, rows)) * 3).astype(np.float32)
    for token in range(len(counts)):
        if counts[token] > 1:  # each token's first row: an empty split
            v[indptr[token]] = np.nan
            s[:, indptr[token]] = -FLT_MAX
    with _tuning_of(packed):
        got_v, got_s = cm.merge_states_varlen(cupy.asarray(v), cupy.asarray(s), cupy.asarray(indptr))
    want_v, want_s = reference.merge_states_varlen(v, s, indptr)
    assert np.isfinite(to_host(got_v)).all(), "a zero-weight row's NaN values leaked into the merge"
    assert relative_error(to_host(got_v), want_v) <= 1e-5
    assert relative_error(to_host(got_s), want_s) <= 1e-6


# -- 2. The prefill cut copies the suffix bit for bit -------------------------------------------------


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tokens_past_the_prefill_cut_take_the_suffix_bit_for_bit(rng, packed, dtype):
    import cupy

    tokens, heads, head_size, cut = 40, 4, 64, 17
    prefix = to_device(rng.standard_normal((tokens, heads, head_size)), dtype)
    suffix = to_device(rng.standard_normal((tokens, heads, head_size)), dtype)
    bits = {"float32": np.uint32, "float16": np.uint16}[dtype]
    suffix.view(bits)[cut:, :, ::3] = 1 << (8 * np.dtype(bits).itemsize - 1)  # -0.0: must stay negative
    s_p, s_s = (cupy.asarray((rng.standard_normal((heads, tokens)) * 3).astype(np.float32)) for _ in range(2))
    out = cupy.full_like(prefix, np.nan)
    out_lse = cupy.full_like(s_p, np.nan)
    with _tuning_of(packed):
        cm.merge_attn_states(out, prefix, s_p, suffix, s_s, out_lse, prefill_tokens_with_context=cut)
    np.testing.assert_array_equal(out[cut:].get().view(bits), suffix[cut:].get().view(bits))
    np.testing.assert_array_equal(out_lse[:, cut:].get().view(np.uint32), s_s[:, cut:].get().view(np.uint32))
    want, _ = reference.merge_state(to_host(prefix[:cut]), to_host(s_p[:, :cut]), to_host(suffix[:cut]),
                                    to_host(s_s[:, :cut]))  # fmt: skip
    assert relative_error(to_host(out[:cut]), want) <= 1e-2


def test_fp8_tokens_past_the_prefill_cut_keep_the_sign_of_zero(rng):
    import cupy

    tokens, heads, head_size, cut = 24, 2, 32, 5
    prefix = to_device(rng.standard_normal((tokens, heads, head_size)), "float16")
    suffix = to_device(rng.standard_normal((tokens, heads, head_size)), "float16")
    suffix.view(cupy.uint16)[cut:] = 0x8000  # -0.0
    s_p, s_s = (cupy.asarray(rng.standard_normal((heads, tokens)).astype(np.float32)) for _ in range(2))
    out = cupy.full((tokens, heads, head_size), 0x55, dtype=cupy.uint8)
    scale = cupy.asarray([0.5], dtype=cupy.float32)
    cm.merge_attn_states(out, prefix, s_p, suffix, s_s, None, cut, scale)
    assert (out[cut:].get() == 0x80).all(), "FP8 of -0.0 is the byte 0x80"


# -- 3. FP8 group scales with the LSE written in place, rows longer than a block -------------------


@pytest.mark.parametrize("head_size, group, dtype", [(2048, 1, "float16"), (8192, 128, "float32")])
def test_group_scales_with_the_lse_in_place_merge_rows_longer_than_a_block(rng, head_size, group, dtype):
    import cupy
    import ml_dtypes

    tokens, heads = 3, 2
    v_a = to_device(rng.standard_normal((tokens, heads, head_size)), dtype)
    v_b = to_device(rng.standard_normal((tokens, heads, head_size)), dtype)
    s_a, s_b = (cupy.asarray((rng.standard_normal((heads, tokens)) * 2).astype(np.float32)) for _ in range(2))
    want_v, want_s = reference.merge_state(to_host(v_a), s_a.get(), to_host(v_b), s_b.get())
    out = cupy.zeros((tokens, heads, head_size), dtype=cupy.uint8)
    scales = cupy.full((tokens, heads * head_size // group), np.nan, dtype=cupy.float32)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, s_a, output_block_scale=scales, quant_group_size=group)
    cupy.cuda.Device().synchronize()
    assert relative_error(s_a.get().astype(np.float64), want_s) <= 1e-6, "the LSE written in place is wrong"
    values = out.get().view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(tokens, -1, group)
    dequantised = (values * scales.get()[..., None]).reshape(tokens, heads, head_size)
    assert np.isfinite(scales.get()).all()
    assert relative_error(dequantised, want_v) <= 7e-2  # FP8 keeps 3 mantissa bits


# -- 5, 6. CuPy views the kernels cannot address; read-only producers --------------------------------


def test_byte_strides_that_are_not_whole_elements_are_refused_before_launch():
    import cupy

    memory = cupy.zeros(4 * 66, dtype=cupy.uint8)
    lse = cupy.ndarray((4, 16), cupy.float32, memptr=memory.data, strides=(66, 4))  # 66-byte rows
    v = cupy.zeros((16, 4, 8), dtype=cupy.float32)
    with pytest.raises(ValueError, match="^s_a: expected strides that are whole elements"):
        cm.merge_state(v, lse, v, cupy.zeros((4, 16), dtype=cupy.float32))
    base = cupy.full(64 * 32 * 2, 7, dtype=cupy.uint8)
    backwards = cupy.ndarray((2, 4, 8), cupy.float16, memptr=base.data + base.nbytes - 16, strides=(-65, 16, 2))
    with pytest.raises(ValueError, match="^out: expected strides that are whole elements"):
        cm.merge_state(*(cupy.zeros((2, 4, 8), cupy.float16), cupy.zeros((4, 2), cupy.float32)) * 2, out=backwards)
    cupy.cuda.Device().synchronize()
    assert (base == 7).all(), "something was written"


class _ReadOnly:
    """A __cuda_array_interface__ producer that marks its memory read-only."""

    def __init__(self, array):
        self._array = array
        interface = dict(array.__cuda_array_interface__)
        interface["data"] = (interface["data"][0], True)
        self.__cuda_array_interface__ = interface


def test_a_read_only_producer_is_read_but_never_written():
    import cupy

    v = cupy.ones((4, 2, 8), dtype=cupy.float32)
    s = cupy.zeros((2, 4), dtype=cupy.float32)
    out, out_lse = cm.merge_state(_ReadOnly(v), _ReadOnly(s), _ReadOnly(v), _ReadOnly(s))
    assert float(out[0, 0, 0]) == 1.0 and abs(float(out_lse[0, 0]) - np.log(2.0)) < 1e-6  # inputs: read
    target = cupy.full((4, 2, 8), 7.0, dtype=cupy.float32)
    with pytest.raises(TypeError, match="^output: a read-only array"):
        cm.merge_attn_states(_ReadOnly(target), v, s, v, s)
    with pytest.raises(TypeError, match="^out_lse: a read-only array"):
        cm.merge_state(v, s, v, s, out_lse=_ReadOnly(cupy.zeros((2, 4), dtype=cupy.float32)))
    assert (target == 7.0).all()


# -- 9. Outputs whose elements interleave without sharing memory are accepted -------------------------


def test_an_output_whose_rows_interleave_without_sharing_elements_is_written(rng):
    import cupy

    v_a, v_b = (cupy.asarray(rng.standard_normal((3, 2, 4)).astype(np.float32)) for _ in range(2))
    s_a, s_b = (cupy.asarray(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(2))
    memory = cupy.full(32, np.nan, dtype=cupy.float32)
    out = cupy.ndarray((3, 2, 4), cupy.float32, memptr=memory.data, strides=(32, 48, 4))  # (8, 12, 1) elements
    cm.merge_state(v_a, s_a, v_b, s_b, out=out)
    want, _ = reference.merge_state(v_a.get(), s_a.get(), v_b.get(), s_b.get())
    assert relative_error(to_host(out), want) <= 1e-6


# -- 11. Merges of very many states stay within the inputs' range ---------------------------------


def test_a_ragged_token_with_more_states_than_a_merge_takes_is_refused_or_nan(rng):
    import cupy

    rows = 2 + 65537  # token 1: one state more than a merge takes
    v = cupy.full((rows, 1, 8), 3.0, dtype=cupy.float16)
    s = cupy.zeros((1, rows), dtype=cupy.float32)
    indptr = cupy.asarray([0, 2, rows], dtype=cupy.int32)
    with pytest.raises(ValueError, match="^indptr: expected at most 65536 states a token"):
        cm.merge_states_varlen(v, s, indptr)
    out, lse = cm.merge_states_varlen(v, s, indptr, check_indptr=False)
    got = to_host(out)
    assert (got[0] == 3.0).all() and np.isnan(got[1]).all() and np.isnan(to_host(lse)[:, 1]).all()


def test_a_merge_of_the_most_states_a_token_takes_stays_in_range():
    import cupy

    states = 65536
    v = cupy.full((states, 1, 1, 8), 3.0, dtype=cupy.float32)
    s = cupy.zeros((states, 1, 1), dtype=cupy.float32)
    out, lse = cm.merge_states(v, s)
    assert np.allclose(to_host(out), 3.0, rtol=1e-6)
    assert abs(float(lse[0, 0]) - np.log(states)) <= 1e-5


# -- also: the first merge of a process may run inside a CUDA-graph capture --------------------------


def test_the_first_merge_of_a_module_can_be_captured_in_a_cuda_graph(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(_launch, "_functions", {})
    monkeypatch.setattr(_launch, "_loaded", {})
    v_a, v_b = (to_device(rng.standard_normal((8, 4, 64)), "bfloat16", "torch") for _ in range(2))
    s_a, s_b = (to_device(rng.standard_normal((4, 8)), "float32", "torch") for _ in range(2))
    out = torch.empty_like(v_a)
    fill_nan(out)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b)  # loads its module during the capture
    graph.replay()
    torch.cuda.synchronize()
    want, _ = reference.merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    assert relative_error(to_host(out), want) <= 1e-2
