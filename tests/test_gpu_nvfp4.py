"""NVFP4 outputs on a GPU: e2m1 values two a byte, e4m3 block scales, a global scale on the device.

Bit for bit: the merge's NVFP4 bytes and block scales (swizzled padding included) equal
:func:`cupy_merge.reference.quantize_nvfp4` of the same merge written as float32 by the same
kernel arithmetic (the float32 merge runs the same weights and sums, so any difference is the
epilogue's); and, dequantised, within the format's error of the float64 merge. Outputs are
poisoned (0xAB bytes) before each run: an element left unwritten cannot match.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
cupy = pytest.importorskip("cupy")

POISON = 0xAB
NVFP4 = "float4_e2m1fn_x2"


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _bytes(array) -> np.ndarray:
    """An NVFP4 output or its scales (torch float4/float8/uint8, CuPy uint8) as NumPy uint8."""
    if hasattr(array, "detach"):
        return array.detach().view(_torch().uint8).cpu().numpy()
    if isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array.view(cupy.uint8))
    return np.asarray(array).view(np.uint8)  # JAX


def _lse(rng, *shape):
    lse = (rng.standard_normal(shape) * 3).astype(np.float32)
    lse[..., 3::7] = -np.inf  # empty states among them (tokens 3, 10, ...: none of either state)
    return lse


def _states(rng, tokens, heads, head_size, dtype, backend="cupy"):
    v_a, v_b = (rng.standard_normal((tokens, heads, head_size)) * 2 for _ in range(2))
    s_a, s_b = _lse(rng, heads, tokens), _lse(rng, heads, tokens)
    if backend == "torch":
        torch = _torch()
        lse = lambda x: torch.from_numpy(x).cuda()
    else:
        lse = cupy.asarray
    return to_device(v_a, dtype, backend), lse(s_a), to_device(v_b, dtype, backend), lse(s_b)


def _nvfp4_buffers(tokens, heads, head_size, swizzled=True, backend="cupy", global_scale=1.0):
    """Poisoned NVFP4 values and block scales, and a global scale on the device."""
    blocks = heads * head_size // 16
    rows, cols = (-(-tokens // 128) * 128, -(-blocks // 4) * 4) if swizzled else (tokens, blocks)
    if backend == "torch":
        torch = _torch()
        out = torch.full((tokens, heads, head_size // 2), POISON, dtype=torch.uint8, device="cuda")
        scales = torch.full((rows, cols), POISON, dtype=torch.uint8, device="cuda")
        return (
            out.view(torch.float4_e2m1fn_x2),
            scales.view(torch.float8_e4m3fn),
            torch.tensor([global_scale], dtype=torch.float32, device="cuda"),
        )
    out = cupy.full((tokens, heads, head_size // 2), POISON, cupy.uint8)
    scales = cupy.full((rows, cols), POISON, cupy.uint8)
    return out, scales, cupy.asarray([global_scale], dtype=cupy.float32)


def _float32_out(like_shape, backend="cupy"):
    if backend == "torch":
        return _torch().empty(like_shape, dtype=_torch().float32, device="cuda")
    return cupy.empty(like_shape, cupy.float32)


def _host32(array) -> np.ndarray:
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return cupy.asnumpy(array)


def _merged32(v_a, s_a, v_b, s_b, backend="cupy", **options) -> np.ndarray:
    """The same two-way merge written as float32 by the same kernel arithmetic, on the host."""
    merged32 = _float32_out(tuple(v_a.shape), backend)
    cm.merge_attn_states(merged32, v_a, s_a, v_b, s_b, **options)
    return _host32(merged32)


def _expect_bit_exact(out, scales, merged32, global_scale, swizzled=True):
    """NVFP4 bytes and scales against the reference quantisation of the float32 merge, per token
    row of ``num_heads * head_size`` values (the rows of the GEMM that reads them)."""
    merged32 = np.asarray(merged32, dtype=np.float32)
    tokens = merged32.shape[0]
    want_packed, want_scales = reference.quantize_nvfp4(merged32.reshape(tokens, -1), global_scale, is_sf_swizzled_layout=swizzled)
    got_packed, got_scales = _bytes(out).reshape(tokens, -1), _bytes(scales)
    want_scales = want_scales.view(np.uint8)
    assert got_scales.shape == want_scales.shape
    bad = np.argwhere(got_scales != want_scales)
    assert bad.size == 0, f"block scales differ at {bad[:5].tolist()}: {got_scales[tuple(bad[:5].T)]} vs {want_scales[tuple(bad[:5].T)]}"
    bad = np.argwhere(got_packed != want_packed)
    assert bad.size == 0, f"values differ at {bad[:5].tolist()}: {got_packed[tuple(bad[:5].T)]} vs {want_packed[tuple(bad[:5].T)]}"


def _calibrated(merged32) -> float:
    """The global scale that maps the tensor's largest magnitude to 448 * 6 (no block saturates)."""
    amax = float(abs(merged32).max())
    return float(np.float32(448 * 6 / amax))


def _expect_near_float64(out, scales, want64, global_scale, swizzled=True):
    """Dequantised, within the format's error of the float64 merge (a calibrated global scale: no
    block saturates): half the e2m1 spacing at the value (1 at the top of the range) times the
    block's scale, plus the float32 merge's error."""
    tokens = want64.shape[0]
    got = reference.dequantize_nvfp4(_bytes(out).reshape(tokens, -1), _bytes(scales), global_scale,
                                     (tokens, want64[0].size), is_sf_swizzled_layout=swizzled)  # fmt: skip
    want = want64.reshape(tokens, -1)
    _, row_scales = reference.quantize_nvfp4(want.astype(np.float32), global_scale, is_sf_swizzled_layout=False)
    step = np.repeat(row_scales.astype(np.float64), 16, axis=1) / global_scale  # one e2m1 unit
    assert np.all(np.abs(got - want) <= 1.0 * step + 1e-5 * np.abs(want)), float(np.max(np.abs(got - want) / step))


# -- the two-way merges ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tokens, heads, head_size", [(1, 32, 128), (7, 4, 64), (130, 3, 16), (300, 8, 80)])
@pytest.mark.parametrize("swizzled", [True, False])
def test_merge_attn_states_writes_nvfp4_bit_for_bit(rng, dtype, tokens, heads, head_size, swizzled):
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, dtype)
    lse = cupy.full((heads, tokens), np.nan, cupy.float32)
    merged32, lse32 = _float32_out((tokens, heads, head_size)), cupy.empty_like(lse)
    cm.merge_attn_states(merged32, v_a, s_a, v_b, s_b, lse32)
    global_scale = _calibrated(merged32)
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, swizzled, global_scale=global_scale)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, lse, output_scale=scale, output_block_scale=scales,
                         is_sf_swizzled_layout=swizzled)  # fmt: skip
    _expect_bit_exact(out, scales, cupy.asnumpy(merged32), global_scale, swizzled)
    assert np.array_equal(cupy.asnumpy(lse), cupy.asnumpy(lse32), equal_nan=True)
    want, _ = reference.merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    _expect_near_float64(out, scales, want, global_scale, swizzled)


@pytest.mark.parametrize("options", [{"prefill_tokens_with_context": 5}, {"lse_base": 2}, {"sinks": True}])
def test_nvfp4_with_the_prefill_cut_lse_base_2_and_sinks(rng, options):
    tokens, heads, head_size = 9, 4, 64
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16")
    if options.get("sinks"):
        options = {"sinks": cupy.asarray(rng.standard_normal(heads).astype(np.float32))}
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, global_scale=100.0)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales, **options)
    _expect_bit_exact(out, scales, _merged32(v_a, s_a, v_b, s_b, **options), 100.0)


def test_torch_float4_and_vllm_uint8_outputs_and_the_allocating_merge(rng):
    torch = _torch()
    tokens, heads, head_size = 33, 8, 128
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "torch")
    merged32 = _merged32(v_a, s_a, v_b, s_b, "torch")
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, backend="torch", global_scale=30.0)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)
    _expect_bit_exact(out, scales, merged32, 30.0)
    # vLLM gives an NVFP4 output as uint8 bytes beside float8_e4m3fn scales.
    out_bytes, scales, _ = _nvfp4_buffers(tokens, heads, head_size, backend="torch")
    cm.merge_attn_states(out_bytes.view(torch.uint8), v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)
    _expect_bit_exact(out_bytes, scales, merged32, 30.0)
    # Allocated: torch's float4_e2m1fn_x2.
    _, scales, _ = _nvfp4_buffers(tokens, heads, head_size, backend="torch")
    v, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype="nvfp4", output_scale=scale, output_block_scale=scales)
    assert v.dtype == torch.float4_e2m1fn_x2 and tuple(v.shape) == (tokens, heads, head_size // 2)
    _expect_bit_exact(v, scales, merged32, 30.0)


def test_cupy_allocates_nvfp4_as_bytes(rng):
    tokens, heads, head_size = 5, 2, 32
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "float16")
    _, scales, scale = _nvfp4_buffers(tokens, heads, head_size, global_scale=7.0)
    v, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=NVFP4, output_scale=scale, output_block_scale=scales)
    assert v.dtype == cupy.uint8 and v.shape == (tokens, heads, head_size // 2)
    merged32, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype="float32")
    _expect_bit_exact(v, scales, cupy.asnumpy(merged32), 7.0)


# -- N-way and ragged --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_states, tokens, heads, head_size, dtype",
    [(3, 7, 4, 128, "bfloat16"), (16, 5, 8, 64, "bfloat16"), (64, 2, 32, 128, "bfloat16"),
     (5, 300, 8, 128, "float16"), (16, 1, 32, 128, "float32"), (33, 4, 2, 64, "bfloat16")],
)  # fmt: skip
def test_merge_states_writes_nvfp4_bit_for_bit(rng, num_states, tokens, heads, head_size, dtype):
    v = to_device(rng.standard_normal((num_states, tokens, heads, head_size)), dtype)
    s = cupy.asarray(_lse(rng, num_states, heads, tokens))
    merged32, lse32 = cm.merge_states(v, s, out_dtype="float32")
    global_scale = _calibrated(merged32)
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, global_scale=global_scale)
    _, lse = cm.merge_states(v, s, out=out, output_scale=scale, output_block_scale=scales)
    _expect_bit_exact(out, scales, cupy.asnumpy(merged32), global_scale)
    assert np.array_equal(cupy.asnumpy(lse), cupy.asnumpy(lse32), equal_nan=True)
    want, _ = reference.merge_states(to_host(v), to_host(s))
    _expect_near_float64(out, scales, want, global_scale)


@pytest.mark.parametrize("heads, head_size, dtype", [(4, 128, "bfloat16"), (2, 64, "float32")])
def test_merge_states_varlen_writes_nvfp4_with_a_token_of_no_states(rng, heads, head_size, dtype):
    counts = [3, 0, 1, 17, 200, 2, 0, 5]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, tokens = int(indptr[-1]), len(counts)
    v = to_device(rng.standard_normal((rows, heads, head_size)), dtype)
    s = cupy.asarray(_lse(rng, heads, rows))
    sinks = cupy.asarray(rng.standard_normal(heads).astype(np.float32))
    for given_sinks in (None, sinks):
        out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, global_scale=20.0)
        cm.merge_states_varlen(v, s, cupy.asarray(indptr), out=out, sinks=given_sinks, output_scale=scale,
                               output_block_scale=scales)  # fmt: skip
        merged32, _ = cm.merge_states_varlen(v, s, cupy.asarray(indptr), out_dtype="float32", sinks=given_sinks)
        _expect_bit_exact(out, scales, cupy.asnumpy(merged32), 20.0)


# -- the semantics rows ----------------------------------------------------------------------------


def test_nan_inf_negative_zero_and_all_zero_blocks(rng):
    tokens, heads, head_size = 4, 1, 64
    v_a = np.abs(rng.standard_normal((tokens, heads, head_size))).astype(np.float32) + 0.1
    v_a[0, 0, 3] = np.nan  # block 0 of token 0: NaN
    v_a[1, 0, 20] = np.inf  # block 1 of token 1: +inf
    v_a[1, 0, 40] = -np.inf  # block 2 of token 1: -inf
    v_a[2, 0, :16] = 0.0  # block 0 of token 2: all zero
    v_a[3, 0, :16] = -0.0  # block 0 of token 3: all -0
    s_a = np.zeros((heads, tokens), np.float32)
    s_b = np.full((heads, tokens), -np.inf, np.float32)  # state b empty: the merge is state a
    args = (cupy.asarray(v_a), cupy.asarray(s_a), cupy.asarray(v_a), cupy.asarray(s_b))
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, global_scale=3.0)
    cm.merge_attn_states(out, *args, output_scale=scale, output_block_scale=scales)
    _expect_bit_exact(out, scales, _merged32(*args), 3.0)
    codes = _bytes(out).reshape(tokens, -1)
    row_scales = reference.nvfp4_scales_from_swizzled(_bytes(scales), tokens, head_size // 16)
    assert row_scales[0, 0] == 0x7F and (codes[0, :8] == 0).all()  # a NaN block: NaN scale, codes 0
    assert row_scales[1, 1] == 0x7E and codes[1, 10] == 0x07  # +inf: scale 448, code +6 (low nibble)
    assert row_scales[2, 0] == 0x08 and (codes[2, :8] == 0).all()  # all zero: the 2^-6 floor, codes 0
    assert (codes[3, :8] == 0x88).all()  # -0 keeps its sign


@pytest.mark.parametrize("bad", [0.0, -1.0, np.inf, np.nan])
def test_a_bad_global_scale_on_the_device_writes_nan_blocks(rng, bad):
    tokens, heads, head_size = 3, 2, 32
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16")
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, swizzled=False, global_scale=bad)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales,
                         is_sf_swizzled_layout=False)  # fmt: skip
    assert (_bytes(scales) == 0x7F).all() and (_bytes(out) == 0).all()


def test_the_global_scale_is_read_on_the_device_when_a_cuda_graph_replays(rng):
    torch = _torch()
    tokens, heads, head_size = 16, 4, 64
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "torch")
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, backend="torch", global_scale=1.0)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)  # compile, plan
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)
    torch.cuda.current_stream().wait_stream(stream)
    merged32 = _merged32(v_a, s_a, v_b, s_b, "torch")
    for new_scale in (40.0, 0.5):
        scale.fill_(new_scale)
        out.view(torch.uint8).fill_(POISON)
        scales.view(torch.uint8).fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _expect_bit_exact(out, scales, merged32, new_scale)


def test_bind_and_torch_compile_write_the_same_bytes(rng):
    torch = _torch()
    tokens, heads, head_size = 20, 4, 128
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "torch")
    merged32 = _merged32(v_a, s_a, v_b, s_b, "torch")
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, backend="torch", global_scale=12.0)
    bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)
    bound()
    _expect_bit_exact(out, scales, merged32, 12.0)

    @torch.compile(fullgraph=True)
    def merge(out, scales, v_a, s_a, v_b, s_b, scale):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales)
        return out

    out, scales, _ = _nvfp4_buffers(tokens, heads, head_size, backend="torch")
    merge(out, scales, v_a, s_a, v_b, s_b, scale)
    _expect_bit_exact(out, scales, merged32, 12.0)

    @torch.compile(fullgraph=True)
    def allocating(scales, v_a, s_a, v_b, s_b, scale):  # the output allocated in the graph
        return cm.merge_state(v_a, s_a, v_b, s_b, out_dtype="nvfp4", output_scale=scale, output_block_scale=scales)[0]

    _, scales, _ = _nvfp4_buffers(tokens, heads, head_size, backend="torch")
    v = allocating(scales, v_a, s_a, v_b, s_b, scale)
    assert v.dtype == torch.float4_e2m1fn_x2 and tuple(v.shape) == (tokens, heads, head_size // 2)
    _expect_bit_exact(v, scales, merged32, 12.0)


def test_jax_writes_nvfp4_under_jit_and_vmap(rng):
    jax = pytest.importorskip("jax")
    import cupy_merge.jax as cmj

    if not any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("JAX without a GPU")
    batch, tokens, heads, head_size = 2, 9, 4, 64
    states = [_states(rng, tokens, heads, head_size, "float32") for _ in range(batch)]
    merged = []
    for v_a, s_a, v_b, s_b in states:
        merged.append(_merged32(v_a, s_a, v_b, s_b))
    global_scale = _calibrated(np.stack(merged))
    stacked = [jax.numpy.asarray(np.stack([cupy.asnumpy(state[i]) for state in states])) for i in range(4)]

    def merge(*x):
        return cmj.merge_state(*x, out_dtype="nvfp4", output_scale=global_scale)

    v, _, scales = jax.jit(merge)(*(x[0] for x in stacked))
    assert v.dtype == np.uint8 and v.shape == (tokens, heads, head_size // 2)
    _expect_bit_exact(v, scales, merged[0], global_scale)
    v, _, scales = jax.jit(jax.vmap(merge))(*stacked)
    for element in range(batch):
        _expect_bit_exact(v[element], scales[element], merged[element], global_scale)


def test_bit_for_bit_with_torchao_on_the_merged_values(rng):
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch = _torch()
    tokens, heads, head_size = 64, 4, 64
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "torch")
    merged32 = _float32_out((tokens, heads, head_size), "torch")  # torchao quantises the torch tensor
    cm.merge_attn_states(merged32, v_a, s_a, v_b, s_b)
    global_scale = 448 * 6 / float(merged32.abs().max())
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size, swizzled=False, backend="torch",
                                        global_scale=global_scale)  # fmt: skip
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales,
                         is_sf_swizzled_layout=False)  # fmt: skip
    per_tensor = torch.tensor(1 / np.float32(global_scale), dtype=torch.float32, device="cuda")
    want_scales, want_values = nvfp4.nvfp4_quantize(merged32.reshape(tokens, -1), per_tensor_scale=per_tensor)
    assert np.array_equal(_bytes(scales), _bytes(want_scales).reshape(tokens, -1))
    assert np.array_equal(_bytes(out).reshape(tokens, -1), _bytes(want_values).reshape(tokens, -1))


def test_bad_nvfp4_arguments_raise_before_anything_runs(rng):
    tokens, heads, head_size = 4, 2, 64
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16")
    out, scales, scale = _nvfp4_buffers(tokens, heads, head_size)
    with pytest.raises(TypeError, match="^output_scale: an NVFP4 output"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_block_scale=scales)
    with pytest.raises(ValueError, match="^output_block_scale: expected shape"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales[:64])
    v40 = to_device(rng.standard_normal((tokens, heads, 40)), "bfloat16")
    with pytest.raises(ValueError, match="^output: an NVFP4 output needs a head_size that is a positive multiple of 16"):
        cm.merge_attn_states(cupy.zeros((tokens, heads, 20), cupy.uint8), v40, s_a, v40, s_b,
                             output_scale=scale, output_block_scale=scales)  # fmt: skip
    assert (_bytes(out) == POISON).all() and (_bytes(scales) == POISON).all()
