"""cupy_merge.compat on a GPU: each peer's own test grid, in the peer's layout, against float64
references of the peer's documented semantics (``test_compat.py``), with fresh random data.

Adapted from (``/work/notes/peers.md``, sections 1.7, 2.3 and 3.3):

* FlashInfer ``tests/trace/test_merge_*_reference_correctness.py`` (their shapes, 1e-3),
  ``tests/utils/test_triton_cascade.py`` (2048 x 32 x 128 fp16, atol 1e-2; the N-way and ragged
  cases with fewer tokens) and ``tests/attention/test_shared_prefix_kernels.py::
  test_merge_state_in_place_with_mask`` (512 x 32 x 128 fp16, no / all / no tokens, 50 random masks);
* SGLang ``sgl-kernel/tests/test_merge_state_v2.py`` (tokens, heads and head sizes from its lists,
  fp16 and bf16, 10 % ``+inf`` in each LSE never at the same place, atol 1e-3, rtol 1e-2 for bf16);
* FlashAttention ``test_flash_attn_combine`` / ``_varlen`` / ``_virtual_batch_idx`` (its lists,
  sampled, batch 5 x 16 heads and 3 x 8; its non-contiguous partials, ``-inf`` splits, and its
  tolerance: LSE 1e-5, values within twice the rounding of the reference to the output dtype);
* xFormers ``tests/test_fmha_merge_attentions.py`` (``test_merge_attentions_against_ref``: 16 chunks,
  12 x 137 queries, 8 heads, 128, float32, 1e-4; ``_nobias``: one chunk twice, stacked or listed,
  with and without head groups and the LSE).

Outputs the API takes are poisoned with NaN first. torch tensors (the peers' kind) and CuPy arrays.
Sizes are kept moderate: the file runs in well under a minute on an H200 once kernels are compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import bfloat16_dtype, cupy_supports, fill_nan, to_host
from test_compat import (
    fa_combine,
    fi_merge_state,
    fi_merge_state_in_place,
    fi_merge_states,
    fi_variable_length_merge_states,
    sgl_merge_state_v2,
    xf_merge_attentions,
)

import cupy_merge as cm
from cupy_merge.compat import flash_attn, flashinfer, permute, sglang, xformers

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

BACKENDS = ["torch", "cupy"]
INF = float("inf")
#: (atol, rtol) on values: FlashInfer's and SGLang's 1e-3 (bf16: SGLang's rtol 1e-2); float32 tighter.
VALUE_TOL = {"float16": (1e-3, 1e-3), "bfloat16": (1e-3, 1e-2), "float32": (1e-5, 1e-5)}
#: (atol, rtol) on every LSE: float32 arithmetic (FlashAttention's own LSE tolerance).
LSE_TOL = (1e-5, 1e-5)


# -- helpers ----------------------------------------------------------------------------------------


def need(backend: str, dtype: str = "float32") -> None:
    if backend == "cupy" and not cupy_supports(dtype):
        pytest.skip(f"CuPy cannot hold {dtype} here (needs ml_dtypes)")


def randn(rng, shape, dtype="float32", backend="torch", scale=1.0):
    """Fresh normal data on the GPU (seeded from ``rng``), rounded to ``dtype``."""
    seed = int(rng.integers(2**62))
    if backend == "torch":
        generator = torch.Generator(device="cuda")
        generator.manual_seed(seed)
        x = torch.randn(tuple(shape), generator=generator, device="cuda", dtype=torch.float32) * scale
        return x.to(getattr(torch, dtype))
    x = cupy.random.default_rng(seed).standard_normal(tuple(shape), dtype=cupy.float32) * scale
    return x.astype(bfloat16_dtype() if dtype == "bfloat16" else dtype)


def device_array(host, dtype, backend):
    host = np.asarray(host, dtype=dtype)
    if backend == "torch":
        return torch.from_numpy(host).cuda()
    return cupy.asarray(host)


def assert_kind(x, backend: str) -> None:
    if backend == "torch":
        assert isinstance(x, torch.Tensor) and x.is_cuda
    else:
        assert isinstance(x, cupy.ndarray)


def dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def contiguous(x) -> bool:
    return x.is_contiguous() if hasattr(x, "is_contiguous") else x.flags.c_contiguous


def strides(x) -> tuple[int, ...]:
    return tuple(x.stride()) if hasattr(x, "stride") else tuple(s // x.itemsize for s in x.strides)


def expect(got, want: np.ndarray, tol: tuple[float, float], what: str = "") -> None:
    got = to_host(got)
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, atol=tol[0], rtol=tol[1], err_msg=what)


def set_where(x, mask: np.ndarray, value: float) -> None:
    """``x[mask] = value`` for a host bool mask."""
    if hasattr(x, "detach"):
        x[torch.from_numpy(mask).cuda()] = value
    else:
        x[cupy.asarray(mask)] = value


# -- FlashInfer: the trace grid (and cupy-merge's superset) ------------------------------------------

FI_TRACE_MERGE_STATE = [(16, 4, 64), (7, 2, 64)]
FI_SUPERSET = [(4, 4, 48), (33, 256, 128), (5, 3, 1), (9, 8, 200)]  # square; heads FI cannot launch; odd dims


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seq_len, num_heads, head_dim", FI_TRACE_MERGE_STATE + FI_SUPERSET)
def test_flashinfer_merge_state(rng, backend, dtype, seq_len, num_heads, head_dim):
    need(backend, dtype)
    v_a, v_b = (randn(rng, (seq_len, num_heads, head_dim), dtype, backend) for _ in range(2))
    s_a, s_b = (randn(rng, (seq_len, num_heads), backend=backend) for _ in range(2))
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    assert_kind(merged_v, backend)
    assert_kind(merged_s, backend)
    assert dtype_name(merged_v) == dtype and dtype_name(merged_s) == "float32"
    assert tuple(merged_s.shape) == (seq_len, num_heads) and contiguous(merged_v) and contiguous(merged_s)
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    expect(merged_v, want_v, VALUE_TOL[dtype], "V")
    expect(merged_s, want_s, LSE_TOL, "S")


FI_TRACE_IN_PLACE = [(128, 32, 128), (17, 8, 64)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seq_len, num_heads, head_dim", FI_TRACE_IN_PLACE + [(6, 6, 40)])
def test_flashinfer_merge_state_in_place(rng, backend, dtype, seq_len, num_heads, head_dim):
    need(backend, dtype)
    v, v_other = (randn(rng, (seq_len, num_heads, head_dim), dtype, backend) for _ in range(2))
    s, s_other = (randn(rng, (seq_len, num_heads), backend=backend) for _ in range(2))
    want_v, want_s = fi_merge_state_in_place(to_host(v), to_host(s), to_host(v_other), to_host(s_other))
    assert flashinfer.merge_state_in_place(v, s, v_other, s_other) is None
    expect(v, want_v, VALUE_TOL[dtype], "v")
    expect(s, want_s, LSE_TOL, "s")


FI_TRACE_MERGE_STATES = [(16, 3, 4, 64), (7, 2, 2, 64)]
FI_STATES_SUPERSET = [(5, 0, 2, 64), (5, 1, 3, 64), (4, 6, 4, 32), (3, 17, 2, 96)]  # none; one; square


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "seq_len, num_states, num_heads, head_dim", FI_TRACE_MERGE_STATES + FI_STATES_SUPERSET
)
def test_flashinfer_merge_states(rng, backend, dtype, seq_len, num_states, num_heads, head_dim):
    need(backend, dtype)
    v = randn(rng, (seq_len, num_states, num_heads, head_dim), dtype, backend)
    s = randn(rng, (seq_len, num_states, num_heads), backend=backend)
    merged_v, merged_s = flashinfer.merge_states(v, s)
    assert_kind(merged_v, backend)
    assert tuple(merged_v.shape) == (seq_len, num_heads, head_dim) and dtype_name(merged_v) == dtype
    assert tuple(merged_s.shape) == (seq_len, num_heads) and contiguous(merged_s)
    want_v, want_s = fi_merge_states(to_host(v), to_host(s))
    expect(merged_v, want_v, VALUE_TOL[dtype], "V")
    expect(merged_s, want_s, LSE_TOL, "S")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_flashinfer_variable_length_merge_states_with_empty_tokens(rng, backend, dtype, index_dtype):
    lengths = [3, 0, 5, 1, 0, 17]
    indptr = device_array(np.concatenate([[0], np.cumsum(lengths)]), index_dtype, backend)
    rows, num_heads, head_dim = sum(lengths), 4, 40
    v = randn(rng, (rows, num_heads, head_dim), dtype, backend)
    s = randn(rng, (rows, num_heads), backend=backend)
    merged_v, merged_s = flashinfer.variable_length_merge_states(v, s, indptr)
    assert_kind(merged_v, backend)
    want_v, want_s = fi_variable_length_merge_states(to_host(v), to_host(s), np.cumsum([0] + lengths))
    expect(merged_v, want_v, VALUE_TOL[dtype], "V")
    expect(merged_s, want_s, LSE_TOL, "S")  # empty tokens: 0 and -inf (FlashInfer's Triton: -5e4)


# -- FlashInfer: its Triton comparison grid (2048 x 32 x 128 fp16, atol 1e-2) ------------------------

TRITON_TOL = (1e-2, 1e-5)


def test_flashinfer_triton_grid_merge_state_and_in_place(rng):
    seq_len, num_heads, head_dim = 2048, 32, 128
    v_a, v_b = (randn(rng, (seq_len, num_heads, head_dim), "float16") for _ in range(2))
    s_a, s_b = (randn(rng, (seq_len, num_heads)) for _ in range(2))
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    expect(merged_v, want_v, TRITON_TOL, "merge_state V")
    expect(merged_s, want_s, TRITON_TOL, "merge_state S")
    flashinfer.merge_state_in_place(v_a, s_a, v_b, s_b)
    expect(v_a, want_v, TRITON_TOL, "merge_state_in_place v")
    expect(s_a, want_s, TRITON_TOL, "merge_state_in_place s")


def test_flashinfer_triton_grid_merge_states(rng):
    seq_len, num_states, num_heads, head_dim = 64, 100, 32, 128  # FlashInfer: 2048 tokens
    v = randn(rng, (seq_len, num_states, num_heads, head_dim), "float16")
    s = randn(rng, (seq_len, num_states, num_heads))
    merged_v, merged_s = flashinfer.merge_states(v, s)
    want_v, want_s = fi_merge_states(to_host(v), to_host(s))
    expect(merged_v, want_v, TRITON_TOL, "V")
    expect(merged_s, want_s, TRITON_TOL, "S")


def test_flashinfer_triton_grid_variable_length_merge_states(rng):
    seq_len, num_heads, head_dim = 64, 32, 128  # FlashInfer: 2048 tokens of 1 to 511 states
    lengths = rng.integers(1, 512, size=seq_len)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    indptr = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    v = randn(rng, (int(offsets[-1]), num_heads, head_dim), "float16")
    s = randn(rng, (int(offsets[-1]), num_heads))
    merged_v, merged_s = flashinfer.variable_length_merge_states(v, s, indptr)
    want_v, want_s = fi_variable_length_merge_states(to_host(v), to_host(s), offsets)
    expect(merged_v, want_v, TRITON_TOL, "V")
    expect(merged_s, want_s, TRITON_TOL, "S")


# -- FlashInfer: merge_state_in_place with a mask (its shared-prefix test) ---------------------------


def test_flashinfer_merge_state_in_place_with_mask(rng):
    seq_len, num_heads, head_dim, num_tries = 512, 32, 128, 50
    v = randn(rng, (seq_len, num_heads, head_dim), "float16")
    s = randn(rng, (seq_len, num_heads))
    v_other = randn(rng, (seq_len, num_heads, head_dim), "float16")
    s_other = randn(rng, (seq_len, num_heads))
    host = [to_host(x) for x in (v, s, v_other, s_other)]
    merged_v, merged_s = fi_merge_state_in_place(*host)
    tol = (1e-3, 1e-3)

    def run(mask):
        v_run, s_run = v.clone(), s.clone()
        flashinfer.merge_state_in_place(v_run, s_run, v_other, s_other, mask)
        return v_run, s_run

    plain_v, plain_s = run(None)
    expect(plain_v, merged_v, tol, "no mask")
    expect(plain_s, merged_s, tol, "no mask")
    ones_v, ones_s = run(torch.ones(seq_len, dtype=torch.bool, device="cuda"))
    assert torch.equal(ones_v, plain_v) and torch.equal(ones_s, plain_s)  # all True: the same as no mask
    zeros_v, zeros_s = run(torch.zeros(seq_len, dtype=torch.bool, device="cuda"))
    assert torch.equal(zeros_v, v) and torch.equal(zeros_s, s)  # all False: untouched
    for _ in range(num_tries):
        mask_host = rng.random(seq_len) > 0.5
        mask = torch.from_numpy(mask_host).cuda()
        got_v, got_s = run(mask)
        expect(got_v, np.where(mask_host[:, None, None], merged_v, host[0]), tol, "masked v")
        expect(got_s, np.where(mask_host[:, None], merged_s, host[1]), tol, "masked s")
        keep = ~mask
        assert torch.equal(got_v[keep], v[keep]) and torch.equal(got_s[keep], s[keep])  # bit for bit


@pytest.mark.parametrize("mask_dtype", ["bool", "uint8", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_merge_state_in_place_with_a_mask_of_cupy_or_torch(rng, backend, mask_dtype):
    """A byte mask is read as FlashInfer's CUDA kernel reads it: nonzero bytes (2, 255, -1 too) merge."""
    v, v_other = (randn(rng, (33, 4, 64), "float32", backend) for _ in range(2))
    s, s_other = (randn(rng, (33, 4), backend=backend) for _ in range(2))
    flags = rng.integers(-128, 128, 33) * (rng.random(33) > 0.5)
    mask_host = flags != 0
    want_v, want_s = fi_merge_state_in_place(
        to_host(v), to_host(s), to_host(v_other), to_host(s_other), mask_host
    )
    given = mask_host if mask_dtype == "bool" else flags.astype(np.int8).view(mask_dtype)
    flashinfer.merge_state_in_place(v, s, v_other, s_other, device_array(given, mask_dtype, backend))
    expect(v, want_v, VALUE_TOL["float32"], "v")
    expect(s, want_s, LSE_TOL, "s")


# -- FlashInfer: beyond its layout rules, and its empty states ---------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_takes_strided_views_it_would_refuse(rng, backend):
    seq_len, num_heads, head_dim = 37, 6, 64
    v_a = randn(rng, (seq_len, num_heads, 2 * head_dim), "float16", backend)[..., :head_dim]
    v_b = permute(randn(rng, (num_heads, seq_len, head_dim), "float16", backend), 1, 0, 2)  # head-major
    s_a = permute(
        randn(rng, (num_heads, seq_len), backend=backend), 1, 0
    )  # a [num_heads, seq_len] buffer's .T
    s_b = randn(rng, (seq_len, 2 * num_heads), backend=backend)[:, ::2]
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    expect(merged_v, want_v, VALUE_TOL["float16"], "V")
    expect(merged_s, want_s, LSE_TOL, "S")
    # N-way from state-major storage: FlashInfer's [seq_len, num_states, ...] as views.
    num_states = 5
    v = permute(randn(rng, (num_states, seq_len, num_heads, head_dim), "bfloat16" if backend == "torch" else "float32",
                      backend), 1, 0, 2, 3)  # fmt: skip
    s = permute(randn(rng, (num_states, num_heads, seq_len), backend=backend), 2, 0, 1)
    merged_v, merged_s = flashinfer.merge_states(v, s)
    want_v, want_s = fi_merge_states(to_host(v), to_host(s))
    expect(merged_v, want_v, VALUE_TOL[dtype_name(v)], "N-way V")
    expect(merged_s, want_s, LSE_TOL, "N-way S")


def test_flashinfer_empty_states_give_zero_and_minus_infinity(rng):
    v_a, v_b = (randn(rng, (8, 2, 64), "float16") for _ in range(2))
    s_a, s_b = (torch.full((8, 2), -INF, device="cuda") for _ in range(2))
    s_a[::2] = 0.5  # every other token has a state
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    expect(merged_v, want_v, VALUE_TOL["float16"])
    expect(merged_s, want_s, LSE_TOL)
    assert (to_host(merged_v)[1::2] == 0).all() and np.isneginf(to_host(merged_s)[1::2]).all()
    v = randn(rng, (4, 3, 2, 64), "float16")
    merged_v, merged_s = flashinfer.merge_states(v, torch.full((4, 3, 2), -INF, device="cuda"))
    assert (to_host(merged_v) == 0).all() and np.isneginf(to_host(merged_s)).all()  # FI releases: -5e4


# -- the porting trap: seq_len == num_heads ------------------------------------------------------------


@pytest.mark.parametrize("square", [4, 32])
def test_flashinfer_layout_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(rng, square):
    seq_len = num_heads = square
    v_a, v_b = (randn(rng, (seq_len, num_heads, 64), "float16") for _ in range(2))
    s_a, s_b = (randn(rng, (seq_len, num_heads), scale=3.0) for _ in range(2))  # FlashInfer's layout, base 2
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    expect(merged_v, want_v, VALUE_TOL["float16"], "compat V")
    expect(merged_s, want_s, LSE_TOL, "compat S")
    wrong_v, _ = cm.merge_state(v_a, s_a, v_b, s_b, lse_base=2)  # the shapes cannot tell: accepted
    assert np.abs(to_host(wrong_v) - want_v).max() > 0.1
    wrong_v, _ = cm.merge_state(v_a, s_a.T, v_b, s_b.T)  # transposed, but read as natural log
    assert np.abs(to_host(wrong_v) - want_v).max() > 0.01
    right_v, right_s = cm.merge_state(v_a, s_a.T, v_b, s_b.T, lse_base=2)  # the porting table's call
    expect(right_v, want_v, VALUE_TOL["float16"], "core V")
    expect(right_s.T, want_s, LSE_TOL, "core S")


def test_sglang_layout_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(rng):
    v_a, v_b = (randn(rng, (16, 16, 128), "bfloat16") for _ in range(2))
    s_a, s_b = (randn(rng, (16, 16), scale=3.0) for _ in range(2))
    want_v, want_s = sgl_merge_state_v2(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    merged_v, merged_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b)
    expect(merged_v, want_v, VALUE_TOL["bfloat16"])
    expect(merged_s, want_s, LSE_TOL)
    wrong_v, _ = cm.merge_state(v_a, s_a, v_b, s_b)
    assert np.abs(to_host(wrong_v) - want_v).max() > 0.1


def test_flash_attn_layout_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(rng):
    splits, seqlen = 5, 16
    num_heads = seqlen
    out_partial = randn(rng, (splits, 1, seqlen, num_heads, 64))
    lse_partial = randn(rng, (splits, 1, num_heads, seqlen), scale=3.0).transpose(-1, -2)
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial)
    expect(out, want_v, VALUE_TOL["float32"])
    expect(lse, want_s, LSE_TOL)
    wrong_v, _ = cm.merge_states(out_partial[:, 0], lse_partial[:, 0])  # [S, L, H] read as [S, H, L]
    assert np.abs(to_host(wrong_v) - want_v[0]).max() > 0.1


# -- SGLang: its merge_state_v2 grid ------------------------------------------------------------------

SGL_TOKENS_HEADS = [(256, 8), (512, 16), (613, 32), (1024, 8), (1536, 16)]  # its lists, paired
SGL_HEAD_SIZES = [32, 48, 64, 128, 256]


def sgl_lses(rng, num_tokens, num_heads, backend="torch"):
    """SGLang's test LSEs: normal, about 10 % +inf in each, never at the same place in both."""
    s_a, s_b = (randn(rng, (num_tokens, num_heads), backend=backend) for _ in range(2))
    inf_a = rng.random((num_tokens, num_heads)) < 0.1
    inf_b = rng.random((num_tokens, num_heads)) < 0.1
    both = inf_a & inf_b
    set_where(s_a, inf_a & ~both, INF)
    set_where(s_b, inf_b & ~both, INF)
    return s_a, s_b


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_size", SGL_HEAD_SIZES)
@pytest.mark.parametrize("num_tokens, num_heads", SGL_TOKENS_HEADS)
def test_sglang_merge_state_v2_grid(rng, dtype, head_size, num_tokens, num_heads):
    v_a, v_b = (randn(rng, (num_tokens, num_heads, head_size), dtype) for _ in range(2))
    s_a, s_b = sgl_lses(rng, num_tokens, num_heads)
    v_merged = torch.empty_like(v_a)
    s_merged = torch.empty(num_tokens, num_heads, device="cuda")
    fill_nan(v_merged)
    fill_nan(s_merged)
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged)
    assert got_v is v_merged and got_s is s_merged
    want_v, want_s = sgl_merge_state_v2(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    tol = (1e-3, 1e-2 if dtype == "bfloat16" else 1e-3)  # SGLang's, on values and LSE
    expect(v_merged, want_v, tol, "v_merged")
    expect(s_merged, want_s, tol, "s_merged")
    expect(s_merged, want_s, LSE_TOL, "s_merged, float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sglang_srt_merge_state_by_its_names(rng, dtype):
    """sglang.srt's merge_state (its serving code's name for merge_state_v2), by keyword, poisoned outputs."""
    num_tokens, num_heads, head_size = 613, 32, 128
    prefix, suffix = (randn(rng, (num_tokens, num_heads, head_size), dtype) for _ in range(2))
    p_lse, s_lse = sgl_lses(rng, num_tokens, num_heads)
    output, output_lse = torch.empty_like(prefix), torch.empty(num_tokens, num_heads, device="cuda")
    fill_nan(output)
    fill_nan(output_lse)
    got = sglang.merge_state(prefix_output=prefix, prefix_lse=p_lse, suffix_output=suffix, suffix_lse=s_lse,
                             output=output, output_lse=output_lse)  # fmt: skip
    assert got[0] is output and got[1] is output_lse
    want_v, want_s = sgl_merge_state_v2(to_host(prefix), to_host(p_lse), to_host(suffix), to_host(s_lse))
    expect(output, want_v, VALUE_TOL[dtype], "output")
    expect(output_lse, want_s, LSE_TOL, "output_lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_sglang_merge_state_v2_allocated_in_place_and_enable_pdl(rng, backend, dtype):
    need(backend, dtype)
    num_tokens, num_heads, head_size = 613, 16, 48
    v_a, v_b = (randn(rng, (num_tokens, num_heads, head_size), dtype, backend) for _ in range(2))
    s_a, s_b = sgl_lses(rng, num_tokens, num_heads, backend)
    want_v, want_s = sgl_merge_state_v2(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, enable_pdl=True)
    assert_kind(got_v, backend)
    assert_kind(got_s, backend)
    assert dtype_name(got_v) == dtype and tuple(got_s.shape) == (num_tokens, num_heads) and contiguous(got_s)
    expect(got_v, want_v, VALUE_TOL[dtype], "allocated")
    expect(got_s, want_s, LSE_TOL, "allocated")
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_a, s_a, enable_pdl=False)  # in place into state a
    assert got_v is v_a and got_s is s_a
    expect(v_a, want_v, VALUE_TOL[dtype], "in place")
    expect(s_a, want_s, LSE_TOL, "in place")


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_sglang_merge_state_v2_converts_to_the_dtype_of_v_merged(rng, out_dtype):
    v_a, v_b = (randn(rng, (256, 8, 64), "float16") for _ in range(2))
    s_a, s_b = sgl_lses(rng, 256, 8)
    v_merged = torch.full((256, 8, 64), float("nan"), dtype=getattr(torch, out_dtype), device="cuda")
    sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_merged)  # SGLang would reinterpret the fp16 inputs
    want_v, _ = sgl_merge_state_v2(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    expect(v_merged, want_v, VALUE_TOL[out_dtype])


def test_sglang_v1_base_2_lses_with_lse_base_2(rng):
    v_a, v_b = (randn(rng, (128, 8, 128), "float16") for _ in range(2))
    s_a, s_b = (randn(rng, (128, 8), scale=3.0) for _ in range(2))
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, lse_base=2)
    want_v, want_s = fi_merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    expect(got_v, want_v, VALUE_TOL["float16"])
    expect(got_s, want_s, LSE_TOL)


def test_sglang_both_states_empty_give_zero_not_nan(rng):
    v_a, v_b = (randn(rng, (4, 2, 32), "float16") for _ in range(2))
    s = torch.full((4, 2), -INF, device="cuda")
    got_v, got_s = sglang.merge_state_v2(v_a, s, v_b, s.clone())  # SGLang: NaN
    assert (to_host(got_v) == 0).all() and np.isneginf(to_host(got_s)).all()


# -- FlashAttention: its combine grid, sampled --------------------------------------------------------

#: (num_splits, seqlen, d) from its lists [1, 2, 3, 5, 17, 32, 55, 97, 133] x [1, 2, 3, 32, 64, 256,
#: 113, 108, 640, 1024] x [64, 96, 128, 192, 256, 512], paired to keep each case near 10M elements.
FA_BATCHED = [(1, 1, 64), (2, 2, 96), (3, 3, 128), (5, 32, 192), (17, 64, 64), (32, 108, 64),
              (55, 32, 96), (97, 3, 256), (133, 2, 512), (2, 640, 64), (3, 1024, 32), (1, 256, 512),
              (5, 113, 256)]  # fmt: skip
FA_DTYPES = ["float32", "float16", "bfloat16"]


def fa_check(out, lse, want_v: np.ndarray, want_s: np.ndarray, dtype: str) -> None:
    """FlashAttention's rule: LSE within 1e-5; values within twice the error of the float64
    reference rounded to the output dtype, or within 1e-5 of that rounded reference."""
    got_s = to_host(lse)
    np.testing.assert_allclose(got_s, want_s, atol=1e-5, rtol=1e-5)
    got_v = to_host(out)
    host_dtype = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    rounded = want_v.astype(host_dtype).astype(np.float64)
    error = np.abs(got_v - want_v).max(initial=0.0)
    rounding = np.abs(rounded - want_v).max(initial=0.0)
    assert error <= 2 * rounding or np.allclose(got_v, rounded, atol=1e-5, rtol=1e-5), (error, rounding)


def fa_partials(rng, num_splits, batch_size, seqlen, nheads, d, backend="torch", dtype="float32"):
    """FlashAttention's test inputs, non-contiguous on purpose; the later half of the splits of the
    first third of the batch is empty (-inf)."""
    values = randn(rng, (num_splits * 2, batch_size, nheads, seqlen, d), dtype, backend)
    lses = randn(rng, (num_splits, batch_size, nheads * 2, seqlen), backend=backend)
    out_partial = permute(values, 0, 1, 3, 2, 4)[:num_splits]
    lse_partial = permute(lses, 0, 1, 3, 2)[:, :, :, :nheads]
    lse_partial[num_splits // 2 :, : batch_size // 3] = -INF
    return out_partial, lse_partial


@pytest.mark.parametrize("num_splits, seqlen, d", FA_BATCHED)
def test_flash_attn_combine(rng, num_splits, seqlen, d):
    batch_size, nheads = 5, 16
    out_partial, lse_partial = fa_partials(rng, num_splits, batch_size, seqlen, nheads, d)
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    for dtype in FA_DTYPES:  # its dtype axis: the output's (the partials are float32, as in its test)
        out, lse = flash_attn.flash_attn_combine(
            out_partial, lse_partial, out_dtype=getattr(torch, dtype), return_lse=True
        )
        assert (
            out.shape == (batch_size, seqlen, nheads, d) and dtype_name(out) == dtype and out.is_contiguous()
        )
        assert lse.shape == (batch_size, seqlen, nheads) and lse.stride() == (nheads * seqlen, 1, seqlen)
        fa_check(out, lse, want_v, want_s, dtype)
        out_no_lse, lse_no_lse = flash_attn.flash_attn_combine(
            out_partial, lse_partial, out_dtype=getattr(torch, dtype), return_lse=False
        )
        assert lse_no_lse is None
        assert torch.allclose(out_no_lse, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("partial_dtype, out_dtype", [("float32", "bfloat16"), ("float16", "float16"),
                                                       ("bfloat16", "float32")])  # fmt: skip
@pytest.mark.parametrize(
    "batch_size, seqlen", [(5, 1), (1, 37), (4, 9), (6, 2)]
)  # fold; one; per batch; per row
def test_flash_attn_combine_into_a_given_out(rng, backend, partial_dtype, out_dtype, batch_size, seqlen):
    need(backend, partial_dtype)
    need(backend, out_dtype)
    num_splits, nheads, d = 7, 4, 80
    out_partial, lse_partial = fa_partials(
        rng, num_splits, batch_size, seqlen, nheads, d, backend, partial_dtype
    )
    out = randn(rng, (batch_size, seqlen, nheads, d), out_dtype, backend)
    fill_nan(out)
    got, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, out, out_dtype)
    assert got is out
    assert_kind(lse, backend)
    assert strides(lse) == (nheads * seqlen, 1, seqlen)
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    fa_check(out, lse, want_v, want_s, out_dtype)


FA_VARLEN = [(2, 1, 64), (5, 32, 96), (17, 113, 128), (55, 113, 64), (5, 1024, 64), (17, 256, 256)]


@pytest.mark.parametrize("varlen_mode", ["cu_seqlens", "seqused", "cu_seqlens_seqused"])
@pytest.mark.parametrize("num_splits, seqlen, d", FA_VARLEN)
def test_flash_attn_combine_varlen(rng, varlen_mode, num_splits, seqlen, d):
    batch_size, nheads = 3, 8
    seqlens = [int(n) for n in rng.integers(1, seqlen + 1, size=batch_size)]
    if varlen_mode == "seqused":  # batched, rows past seqused zero and -inf (FlashAttention's test)
        max_seqlen = max(seqlens)
        out_partial = randn(rng, (num_splits, batch_size, max_seqlen, nheads, d))
        lse_partial = randn(rng, (num_splits, batch_size, nheads, max_seqlen)).transpose(-1, -2)
        lse_partial[num_splits // 2 :, : batch_size // 2] = -INF
        for b, n in enumerate(seqlens):
            out_partial[:, b, n:] = 0
            lse_partial[:, b, n:] = -INF
        arguments = {"seqused": torch.tensor(seqlens, dtype=torch.int32, device="cuda")}
        lse_strides = (nheads * max_seqlen, 1, max_seqlen)
    else:
        total_q = sum(seqlens)
        cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device="cuda")
        arguments = {"cu_seqlens": cu_seqlens}
        if varlen_mode == "cu_seqlens_seqused":
            used = [max(1, n - int(rng.integers(0, max(1, seqlen // 4)))) for n in seqlens]
            arguments["seqused"] = torch.tensor(used, dtype=torch.int32, device="cuda")
        out_partial = randn(rng, (num_splits * 2, total_q, nheads, d))[:num_splits]
        lse_partial = randn(rng, (num_splits, nheads, total_q)).transpose(-1, -2)
        lse_partial[num_splits // 2 :, : total_q // 3] = -INF
        lse_strides = (1, total_q)
    # Every row is combined (FlashAttention leaves rows past seqused undefined): all are compared.
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    for dtype in FA_DTYPES:
        out, lse = flash_attn.flash_attn_combine(
            out_partial, lse_partial, out_dtype=getattr(torch, dtype), **arguments
        )
        assert out.shape == out_partial.shape[1:] and lse.shape == lse_partial.shape[1:]
        assert lse.stride() == lse_strides
        fa_check(out, lse, want_v, want_s, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_combine_varlen_of_cupy_or_torch(rng, backend):
    num_splits, total_q, nheads, d = 9, 50, 8, 64
    out_partial = randn(rng, (num_splits, total_q, nheads, d), backend=backend)
    lse_partial = permute(randn(rng, (num_splits, nheads, total_q), backend=backend), 0, 2, 1)
    cu_seqlens = device_array([0, 20, 50], "int32", backend)
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, None, "float16", cu_seqlens)
    assert_kind(out, backend)
    assert_kind(lse, backend)
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    fa_check(out, lse, want_v, want_s, "float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_splits, seqlen, d", [(2, 32, 64), (5, 113, 128), (17, 256, 256)])
def test_flash_attn_combine_virtual_batch_idx(rng, dtype, num_splits, seqlen, d):
    batch_size, nheads = 4, 8
    out_partial = randn(rng, (num_splits, batch_size, seqlen, nheads, d))
    lse_partial = randn(rng, (num_splits, batch_size, nheads, seqlen)).transpose(-1, -2)
    lse_partial[num_splits // 2 :, : batch_size // 2] = -INF
    perm = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device="cuda")
    seqused = torch.tensor(rng.integers(1, seqlen + 1, size=batch_size), dtype=torch.int32, device="cuda")
    for b, n in enumerate(seqused.tolist()):
        out_partial[:, b, n:] = 0
        lse_partial[:, b, n:] = -INF
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, out_dtype=getattr(torch, dtype),
                                             seqused=seqused, virtual_batch_idx=perm)  # fmt: skip
    want_v, want_s = fa_combine(to_host(out_partial), to_host(lse_partial))
    fa_check(out, lse, want_v, want_s, dtype)  # a bijection: the combine of every batch element


# -- xFormers: its tests' cases ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grouped", [True, False])
def test_xformers_merge_attentions_against_its_reference_case(rng, backend, grouped):
    """xFormers' test_merge_attentions_against_ref: B = 12 and M = 137 do not fold into one token
    axis, so this is one core merge per batch element; a tenth of the chunks' LSEs are -inf."""
    split_k, batch, queries, groups, heads, dim = 16, 12, 137, 2 if grouped else 1, 8, 128
    attn = randn(rng, (split_k, batch, queries, groups, heads, dim), backend=backend)
    lse = randn(rng, (split_k, batch, groups, heads, queries), backend=backend)
    set_where(lse, rng.random(to_host(lse).shape) < 0.1, -INF)
    if not grouped:
        attn, lse = attn[:, :, :, 0], lse[:, :, 0]
    out, out_lse = xformers.merge_attentions(attn, lse)
    assert_kind(out, backend)
    assert contiguous(out) and contiguous(out_lse)
    want_v, want_s = xf_merge_attentions(to_host(attn), to_host(lse))
    expect(out, want_v, (1e-4, 1e-4), "attn")
    expect(out_lse, want_s, (1e-4, 1e-4), "lse")


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("groups", [None, 7, 1])
@pytest.mark.parametrize("write_lse", [True, False])
def test_xformers_one_chunk_merged_with_itself_is_itself(rng, stacked, groups, write_lse):
    """xFormers' test_merge_attentions_nobias: [out1, out1] gives out1 and lse1 + log 2 (bfloat16)."""
    batch, queries, heads, dim = 13, 3, 11, 128
    shape = (batch, queries, heads, dim) if groups is None else (batch, queries, groups, heads, dim)
    lse_shape = (batch, heads, queries) if groups is None else (batch, groups, heads, queries)
    out1 = randn(rng, shape, "bfloat16")
    lse1 = randn(rng, lse_shape)
    chunks, lses = [out1, out1], [lse1, lse1]
    if stacked:
        chunks, lses = torch.stack(chunks), torch.stack(lses)
    out, lse = xformers.merge_attentions(chunks, lses, write_lse=write_lse)
    assert out.shape == out1.shape and out.dtype == torch.bfloat16
    expect(out, to_host(out1), (1e-3, 1e-2), "attn")
    if write_lse:
        expect(lse, to_host(lse1) + np.log(2), LSE_TOL, "lse")
    else:
        assert lse is None


def test_xformers_chunks_of_separate_buffers_and_the_output_dtype(rng):
    """A decode step's chunks, each its own tensor (stacked inside), merged to bfloat16."""
    chunks = [randn(rng, (1, 128, 2, 8, 128)) for _ in range(10)]
    lses = [randn(rng, (1, 2, 8, 128)) for _ in range(10)]
    out, lse = xformers.merge_attentions(chunks, lses, output_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_v, want_s = xf_merge_attentions(np.stack([to_host(c) for c in chunks]), np.stack([to_host(s) for s in lses]))
    expect(out, want_v, VALUE_TOL["bfloat16"], "attn")
    expect(lse, want_s, LSE_TOL, "lse")
