"""FP8 (float8_e4m3fn) outputs on a GPU: per-tensor and per-group scales, fused into the merge.

Compared in dequantised space against the float64 reference: an element is
right when it is within one FP8 step (the spacing of float8_e4m3fn at the
reference's magnitude) of ``clamp(reference / scale, -448, 448)``. Rounding
to nearest costs half a step; the float32 arithmetic before it a few ulp,
which can move a value across a rounding boundary: one step allows exactly
that and nothing more (a wrong weight or scale is off by many steps).
Group scales are compared to the reference's to float32 rounding (1e-5,
the merge's own float32 error included).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import fill_nan, to_device, to_host

import cupy_merge as cm
from cupy_merge import _kernels, reference

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
cupy = pytest.importorskip("cupy")

DTYPES = ["float32", "float16", "bfloat16"]
FP8 = "float8_e4m3fn"


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _lse(rng, heads, tokens):
    return (rng.standard_normal((heads, tokens)) * 4).astype(np.float32)


def _fp8_to_host(array) -> np.ndarray:
    """An FP8 output (torch float8 tensor, CuPy float8 or uint8 bytes) as float64."""
    if hasattr(array, "detach"):
        raw = array.detach().view(_torch().uint8).cpu().numpy()
    else:
        raw = cupy.asnumpy(array.view(cupy.uint8))
    return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _fp8_step(x: np.ndarray) -> np.ndarray:
    """The spacing of float8_e4m3fn at |x|: 2^(e - 3) for normal numbers, 2^-9 below 2^-6."""
    magnitude = np.minimum(np.abs(x), 448.0)
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**-6)))
    return 2.0 ** (exponent - 3)


def _expect_within_one_step(got: np.ndarray, want_scaled: np.ndarray) -> None:
    """``got`` (dequantised FP8, before scaling back) against the exact ``reference / scale``."""
    want = np.clip(want_scaled, -448.0, 448.0)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), "NaN where the reference has none, or the reverse"
    error = np.abs(got[~nan] - want[~nan])
    worst = float((error / _fp8_step(want[~nan])).max(initial=0.0))
    assert worst <= 1.0, f"an element is {worst:.2f} FP8 steps from the reference"


def _expect_group_scales(got: np.ndarray, want: np.ndarray, group: int, ue8m0: bool = False) -> None:
    """Group scales against the reference's, from the float64 merge ``want``, within float32 rounding.

    Rounded up to a power of two (UE8M0), a scale whose unrounded value lies within that
    rounding of a power of two may land on either side of it: both are right.
    """
    _, raw = reference.quantize_fp8_groups(want, group)
    _, expected = reference.quantize_fp8_groups(want, group, ue8m0)
    close = np.isclose(got, expected, rtol=1e-5) | (np.isnan(got) & np.isnan(expected))
    if ue8m0:
        with np.errstate(divide="ignore", invalid="ignore"):
            power = np.exp2(np.round(np.log2(raw)))
        on_boundary = np.abs(raw / power - 1) < 1e-5
        close |= on_boundary & ((got == power) | (got == 2 * power))
        assert (np.frexp(got)[0] == 0.5).all(), "a UE8M0 scale is not a power of two"
    assert close.all(), (
        f"group scales differ at {np.argwhere(~close)[:5].tolist()}: {got[~close][:5]} vs {expected[~close][:5]}"
    )


def _empty_fp8(shape, backend):
    if backend == "torch":
        torch = _torch()
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        out.view(torch.uint8).fill_(0x7F)  # NaN poison
        return out
    out = cupy.empty(shape, dtype=cupy.uint8)
    out.fill(0x7F)
    return out


def _states(rng, tokens, heads, head_size, dtype, backend):
    v_a = to_device(rng.standard_normal((tokens, heads, head_size)) * 3, dtype, backend)
    v_b = to_device(rng.standard_normal((tokens, heads, head_size)) * 3, dtype, backend)
    s_a = to_device(_lse(rng, heads, tokens), "float32", backend)
    s_b = to_device(_lse(rng, heads, tokens), "float32", backend)
    return v_a, s_a, v_b, s_b


def _scale_array(value, backend):
    if backend == "torch":
        return _torch().tensor([value], dtype=_torch().float32, device="cuda")
    return cupy.array([value], dtype=cupy.float32)


def _merged_reference(v_a, s_a, v_b, s_b, prefill=None):
    want, want_lse = reference.merge_state(to_host(v_a), to_host(s_a), to_host(v_b), to_host(s_b))
    if prefill is not None:
        want[prefill:], want_lse[:, prefill:] = to_host(v_b)[prefill:], to_host(s_b)[:, prefill:]
    return want, want_lse


# -- the conversion itself -----------------------------------------------------------------------

_CONVERT = r"""
#include "fp8.cuh"
// Bit patterns first, first + 1, ... (or in[i], when given) converted to FP8.
extern "C" __global__ void convert(unsigned long long first, unsigned long long count, unsigned char* out,
                                   const unsigned* in) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < count;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned bits = in != nullptr ? in[i] : static_cast<unsigned>(first + i);
    out[i] = cupy_merge::from_float<cupy_merge::fp8_e4m3_t>(__uint_as_float(bits)).bits;
  }
}
"""
PORTABLE = "-DCUPY_MERGE_PORTABLE_FP8"


def _converter(*options):
    source = _kernels.with_includes(_CONVERT)
    return cupy.RawModule(code=source, options=("-std=c++17", *options)).get_function("convert")


def _same_fp8(a, b):
    """Equal bytes, any NaN equal to any NaN (the portable path keeps the sign of a NaN)."""
    return (a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))


def test_the_portable_fp8_conversion_matches_the_hardware_one_on_every_float32():
    if cupy.cuda.Device().compute_capability < "89":
        pytest.skip("the hardware conversion needs sm_89 or newer")
    hardware, portable = _converter(), _converter(PORTABLE)
    chunk = 1 << 30
    a, b = cupy.empty(chunk, cupy.uint8), cupy.empty(chunk, cupy.uint8)
    for first in range(0, 1 << 32, chunk):
        for kernel, out in ((hardware, a), (portable, b)):
            kernel((4096,), (256,), (cupy.uint64(first), cupy.uint64(chunk), out, cupy.uint64(0)))
        bad = int((~_same_fp8(a, b)).sum())
        assert bad == 0, f"{bad} float32 patterns from {first:#x} convert differently"


def test_the_fp8_conversion_rounds_to_nearest_even_and_saturates_as_ml_dtypes_after_a_clamp(rng):
    patterns = np.concatenate(
        [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64), np.arange(0, 1 << 32, 65537, dtype=np.uint64)]
    ).astype(np.uint32)
    floats = patterns.view(np.float32)
    with np.errstate(invalid="ignore"):  # the NaN patterns
        want = np.clip(floats, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    device_patterns = cupy.asarray(patterns)
    for options in ((), (PORTABLE,)):
        out = cupy.empty(len(patterns), cupy.uint8)
        _converter(*options)(
            (1024,), (256,), (cupy.uint64(0), cupy.uint64(len(patterns)), out, device_patterns)
        )
        got = cupy.asnumpy(out)
        assert _same_fp8(got, want).all(), (
            f"{int((~_same_fp8(got, want)).sum())} differ with options {options}"
        )


# -- per-tensor scale ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [32, 48, 96, 256])
@pytest.mark.parametrize("heads", [4, 48])
@pytest.mark.parametrize("tokens", [256, 613])
@pytest.mark.parametrize("prefill", [False, True])
def test_merge_attn_states_writes_fp8_with_a_per_tensor_scale(rng, tokens, heads, head_size, dtype, prefill):
    backend = "torch" if dtype == "bfloat16" and rng.random() < 0.5 else "cupy"
    if backend == "torch":
        _torch()
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, dtype, backend)
    scale_value = float(rng.uniform(0.002, 0.05))  # values up to ~10 land near FP8's top
    scale = _scale_array(scale_value, backend)
    out = _empty_fp8((tokens, heads, head_size), backend)
    out_lse = to_device(np.full((heads, tokens), np.nan, np.float32), "float32", backend)
    cut = tokens // 3 if prefill else None
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, cut, scale)
    want, want_lse = _merged_reference(v_a, s_a, v_b, s_b, cut)
    _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(scale_value)))
    np.testing.assert_allclose(to_host(out_lse), want_lse, rtol=1e-6, atol=1e-6)


def test_a_large_fp8_merge_of_64_heads_and_4096_tokens(rng):
    v_a, s_a, v_b, s_b = _states(rng, 4096, 64, 128, "bfloat16", "cupy")
    scale = _scale_array(0.02, "cupy")
    out = _empty_fp8((4096, 64, 128), "cupy")
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, None, scale)
    want, _ = _merged_reference(v_a, s_a, v_b, s_b)
    _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(0.02)))


def test_fp8_saturates_and_keeps_nan(rng):
    v_a, s_a, v_b, s_b = _states(rng, 8, 4, 64, "float32", "cupy")
    v_a[0] = 1e6  # far past 448 * scale
    s_a[1, 2] = np.nan  # a NaN LSE poisons its row
    scale = _scale_array(0.5, "cupy")
    out = _empty_fp8((8, 4, 64), "cupy")
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale)
    got = _fp8_to_host(out)
    assert np.isnan(got[2, 1]).all() and not np.isnan(np.delete(got.reshape(32, 64), 9, axis=0)).any()
    assert (np.abs(got[0]) <= 448).all() and (
        got[0][to_host(s_a)[:, 0] > to_host(s_b)[:, 0] + 5] == 448
    ).all()


def test_the_scale_is_read_on_the_device_when_a_cuda_graph_replays(rng):
    torch = _torch()
    v_a, s_a, v_b, s_b = _states(rng, 64, 8, 128, "bfloat16", "torch")
    scale = torch.tensor([0.01], device="cuda")
    out = torch.empty(64, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, None, scale)  # compile and plan outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, None, scale)
    torch.cuda.current_stream().wait_stream(stream)
    for new_scale in (0.003, 0.05):
        v_a.copy_(torch.randn_like(v_a.float()).to(v_a.dtype))
        scale.fill_(new_scale)
        out.view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        want, _ = _merged_reference(v_a, s_a, v_b, s_b)
        _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(new_scale)))


# -- per-group scales ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_size, group", [(128, 128), (128, 64), (256, 128), (96, 96), (48, 48), (64, 16), (32, 8), (80, 40)]
)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_merge_attn_states_writes_fp8_with_group_scales(rng, dtype, head_size, group, ue8m0):
    tokens, heads = int(rng.integers(1, 300)), int(rng.choice([1, 4, 7, 16]))
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, dtype, "cupy")
    out = _empty_fp8((tokens, heads, head_size), "cupy")
    scales = cupy.full((tokens, heads * head_size // group), np.nan, cupy.float32)
    cut = tokens // 2 if rng.random() < 0.5 else None
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, cut, output_block_scale=scales,
                         quant_group_size=group, scale_ue8m0=ue8m0)  # fmt: skip
    want, _ = _merged_reference(v_a, s_a, v_b, s_b, cut)
    got_scales = cupy.asnumpy(scales)
    _expect_group_scales(got_scales, want, group, ue8m0)
    per_element = np.repeat(got_scales.astype(np.float64), group, axis=1).reshape(want.shape)
    _expect_within_one_step(_fp8_to_host(out), want / per_element)


def test_group_scales_take_any_strides_and_an_all_zero_group_stays_finite(rng):
    torch = _torch()
    tokens, heads, head_size, group = 33, 4, 128, 64
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "torch")
    v_a[5].zero_()
    v_b[5].zero_()
    out = torch.empty(tokens, heads, head_size, dtype=torch.float8_e4m3fn, device="cuda")
    buffer = torch.full((heads * head_size // group, tokens), float("nan"), device="cuda")
    scales = buffer.T  # token stride 1, group stride tokens
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_block_scale=scales, quant_group_size=group)
    want, _ = _merged_reference(v_a, s_a, v_b, s_b)
    _expect_group_scales(scales.cpu().numpy(), want, group)
    assert (scales[5] == np.float32(1e-10) / np.float32(448)).all() and (_fp8_to_host(out)[5] == 0).all()


@pytest.mark.parametrize("group", [None, 128, 32])
@pytest.mark.parametrize("num_states, tokens", [(3, 100), (16, 2), (64, 16), (2, 50), (700, 1)])
def test_merge_states_writes_fp8(rng, num_states, tokens, group):
    heads, head_size = 8, 128
    v = to_device(rng.standard_normal((num_states, tokens, heads, head_size)) * 2, "bfloat16")
    s = to_device((rng.standard_normal((num_states, heads, tokens)) * 4).astype(np.float32), "float32")
    s[0, 0, 0] = -np.inf  # an empty state
    want, want_lse = reference.merge_states(to_host(v), to_host(s))
    if group is None:
        scale = _scale_array(0.01, "cupy")
        out, lse = cm.merge_states(v, s, out_dtype=FP8, output_scale=scale)
        _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(0.01)))
    else:
        scales = cupy.full((tokens, heads * head_size // group), np.nan, cupy.float32)
        out, lse = cm.merge_states(v, s, out_dtype=FP8, output_block_scale=scales, quant_group_size=group)
        _expect_group_scales(cupy.asnumpy(scales), want, group)
        per_element = np.repeat(cupy.asnumpy(scales).astype(np.float64), group, axis=1).reshape(want.shape)
        _expect_within_one_step(_fp8_to_host(out), want / per_element)
    np.testing.assert_allclose(to_host(lse), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("group", [None, 64])
def test_merge_states_varlen_writes_fp8(rng, group):
    counts = rng.integers(0, 9, 40)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, heads, head_size = int(indptr[-1]), 4, 64
    v = to_device(rng.standard_normal((rows, heads, head_size)), "float16")
    s = to_device((rng.standard_normal((heads, rows)) * 4).astype(np.float32), "float32")
    want, want_lse = reference.merge_states_varlen(to_host(v), to_host(s), indptr)
    out = _empty_fp8((40, heads, head_size), "cupy")
    if group is None:
        _, lse = cm.merge_states_varlen(
            v, s, cupy.asarray(indptr), out=out, output_scale=_scale_array(0.004, "cupy")
        )
        _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(0.004)))
    else:
        scales = cupy.full((40, heads * head_size // group), np.nan, cupy.float32)
        _, lse = cm.merge_states_varlen(
            v, s, cupy.asarray(indptr), out=out, output_block_scale=scales, quant_group_size=group
        )
        per_element = np.repeat(cupy.asnumpy(scales).astype(np.float64), group, axis=1).reshape(want.shape)
        _expect_within_one_step(_fp8_to_host(out), want / per_element)
    np.testing.assert_allclose(to_host(lse), want_lse, rtol=1e-6, atol=1e-6)


# -- array kinds and bad inputs --------------------------------------------------------------------


def test_merge_state_allocates_fp8_for_cupy_torch_and_jax(rng):
    host = [rng.standard_normal((16, 4, 64)).astype(np.float32) for _ in range(2)]
    lse = [_lse(rng, 4, 16) for _ in range(2)]
    want, _ = reference.merge_state(host[0], lse[0], host[1], lse[1])
    kinds = {"cupy": lambda x: cupy.asarray(x)}
    try:
        torch = _torch()
        kinds["torch"] = lambda x: torch.from_numpy(x).cuda()
    except pytest.skip.Exception:
        pass
    try:
        import jax.numpy as jnp

        kinds["jax"] = lambda x: jnp.asarray(x)
    except ImportError:
        pass
    for kind, make in kinds.items():
        scale = make(np.array([0.01], np.float32))
        out, _ = cm.merge_state(make(host[0]), make(lse[0]), make(host[1]), make(lse[1]),
                                out_dtype=FP8, output_scale=scale)  # fmt: skip
        if kind == "torch":
            assert out.dtype == torch.float8_e4m3fn
        elif kind == "jax":
            assert str(out.dtype) == FP8
            got = np.asarray(out).astype(np.float64)  # CuPy cannot import JAX's FP8 over DLPack
            _expect_within_one_step(got, want / np.float64(np.float32(0.01)))
            continue
        _expect_within_one_step(_fp8_to_host(out), want / np.float64(np.float32(0.01)))


def test_bad_fp8_arguments_raise_naming_them_before_anything_runs(rng):
    v_a, s_a, v_b, s_b = _states(rng, 8, 4, 64, "bfloat16", "cupy")
    out = _empty_fp8((8, 4, 64), "cupy")
    scale = _scale_array(0.1, "cupy")
    with pytest.raises(TypeError, match="^output_scale: expected an array in GPU memory"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, None, np.ones(1, np.float32))
    with pytest.raises(TypeError, match="^output: expected dtype .*got uint8"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b)  # bytes are FP8 only with a scale
    if _cupy_has_fp8():
        with pytest.raises(TypeError, match="^output: an FP8 output needs its scale"):
            cm.merge_attn_states(cupy.empty((8, 4, 64), ml_dtypes.float8_e4m3fn), v_a, s_a, v_b, s_b)
    with pytest.raises(ValueError, match="^output_scale: give output_scale .* not both"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, None, scale,
                             output_block_scale=cupy.zeros((8, 4), cupy.float32), quant_group_size=64)  # fmt: skip
    with pytest.raises(TypeError, match="^output_scale: a scale is for an FP8"):
        cm.merge_attn_states(cupy.empty_like(v_a), v_a, s_a, v_b, s_b, None, None, scale)
    with pytest.raises(ValueError, match="^quant_group_size: expected a divisor of head_size 64"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_block_scale=cupy.zeros((8, 5), cupy.float32),
                             quant_group_size=48)  # fmt: skip
    with pytest.raises(ValueError, match="^output_block_scale: expected shape"):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_block_scale=cupy.zeros((8, 3), cupy.float32),
                             quant_group_size=64)  # fmt: skip
    assert (cupy.asnumpy(out) == 0x7F).all(), "a refused call wrote its output"


def _cupy_has_fp8() -> bool:
    try:
        cupy.empty(1, ml_dtypes.float8_e4m3fn)
        return True
    except (TypeError, ValueError, NotImplementedError):
        return False


def test_bind_relaunches_an_fp8_merge(rng):
    v_a, s_a, v_b, s_b = _states(rng, 32, 4, 128, "float16", "cupy")
    out = _empty_fp8((32, 4, 128), "cupy")
    scales = cupy.empty((32, 4), cupy.float32)
    merge = cm.bind(
        cm.merge_attn_states, out, v_a, s_a, v_b, s_b, output_block_scale=scales, quant_group_size=128
    )
    for _ in range(2):
        v_a[...] = cupy.asarray(rng.standard_normal(v_a.shape), dtype=v_a.dtype)
        fill_nan(scales)
        merge()
        want, _ = _merged_reference(v_a, s_a, v_b, s_b)
        per_element = np.repeat(cupy.asnumpy(scales).astype(np.float64), 128, axis=1).reshape(want.shape)
        _expect_within_one_step(_fp8_to_host(out), want / per_element)


@pytest.mark.parametrize("head_size, group", [(96, 48), (128, 32), (64, 64)])
def test_group_scales_with_the_lse_written_in_place(rng, head_size, group):
    tokens, heads = 257, 5
    v_a, s_a, v_b, s_b = _states(rng, tokens, heads, head_size, "bfloat16", "cupy")
    want, want_lse = _merged_reference(v_a, s_a, v_b, s_b)
    out = _empty_fp8((tokens, heads, head_size), "cupy")
    scales = cupy.full((tokens, heads * head_size // group), np.nan, cupy.float32)
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, s_a, output_block_scale=scales, quant_group_size=group)
    np.testing.assert_allclose(to_host(s_a), want_lse, rtol=1e-6, atol=1e-6)
    per_element = np.repeat(cupy.asnumpy(scales).astype(np.float64), group, axis=1).reshape(want.shape)
    _expect_within_one_step(_fp8_to_host(out), want / per_element)
