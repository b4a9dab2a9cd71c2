"""Streams, graphs, devices and array kinds: torch, CuPy, JAX."""

from __future__ import annotations

import numpy as np
import pytest
from bad_inputs import BAD_CASES, VLLM_NAMES, specs_for
from conftest import GPU_COUNT
from gpu_arrays import relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

TOKENS, HEADS, HEAD_SIZE = 512, 16, 128


def _torch():
    return pytest.importorskip("torch")


def _torch_states(torch, dtype=None, device="cuda"):
    dtype = dtype or torch.bfloat16
    v_a, v_b = torch.randn(2, TOKENS, HEADS, HEAD_SIZE, device=device, dtype=dtype)
    s_a, s_b = torch.randn(2, HEADS, TOKENS, device=device) * 4
    return v_a, s_a, v_b, s_b


def _expect_merge(v, s, states, tolerance=1e-2):
    want_v, want_s = reference.merge_state(*(to_host(x) for x in states))
    assert relative_error(to_host(v), want_v) <= tolerance
    assert relative_error(to_host(s), want_s) <= 1e-6


def test_torch_in_torch_out_zero_copy():
    torch = _torch()
    states = _torch_states(torch)
    out = torch.full_like(states[0], float("nan"))
    v, s = cm.merge_state(*states, out=out)
    assert isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor)
    assert v.data_ptr() == out.data_ptr() and s.dtype == torch.float32 and s.device == out.device
    _expect_merge(v, s, states)


def test_torch_launch_runs_on_torchs_current_stream():
    torch = _torch()
    states = _torch_states(torch)
    fresh = torch.randn_like(states[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Keep the side stream busy, then change an input on it: a merge launched
        # on any other stream would read the old values.
        torch.cuda._sleep(50_000_000)
        states[0].copy_(fresh)
        v, s = cm.merge_state(*states)
    side.synchronize()
    _expect_merge(v, s, states)


def test_explicit_stream_argument_is_used():
    torch = _torch()
    states = _torch_states(torch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        states[2].mul_(3)
    out = torch.empty_like(states[0])
    cm.merge_attn_states(out, *states, stream=side)
    side.synchronize()
    _expect_merge(out, cm.merge_state(*states)[1], states)


def test_torch_cuda_graph_capture_and_replay():
    torch = _torch()
    states = _torch_states(torch)
    out = torch.empty_like(states[0])
    out_lse = torch.empty_like(states[1])
    cm.merge_attn_states(out, *states, out_lse)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cm.merge_attn_states(out, *states, out_lse)
    for _ in range(2):
        for x in states:
            x.copy_(torch.randn_like(x) * (4 if x.dtype == torch.float32 else 1))
        out.fill_(float("nan"))
        out_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _expect_merge(out, out_lse, states)


def test_cupy_launch_runs_on_cupys_current_stream(rng):
    import cupy

    v_a, v_b = (
        cupy.asarray(rng.standard_normal((TOKENS, HEADS, HEAD_SIZE)), dtype=cupy.float16) for _ in range(2)
    )
    s_a, s_b = (cupy.asarray(rng.standard_normal((HEADS, TOKENS)), dtype=cupy.float32) for _ in range(2))
    fresh = cupy.asarray(rng.standard_normal(v_a.shape), dtype=cupy.float16)
    inputs_ready = cupy.cuda.get_current_stream().record()
    with cupy.cuda.Stream(non_blocking=True) as side:
        side.wait_event(inputs_ready)
        _spin(side)
        v_a[...] = fresh
        v, s = cm.merge_state(v_a, s_a, v_b, s_b)
    side.synchronize()
    _expect_merge(v, s, (v_a, s_a, v_b, s_b))


def _spin(stream):
    """Keep ``stream`` busy for a few milliseconds."""
    import cupy

    spin = cupy.RawKernel(
        r"""extern "C" __global__ void spin(long long cycles) {
            long long start = clock64(); while (clock64() - start < cycles) {} }""",
        "spin",
    )
    spin((1,), (1,), (np.int64(20_000_000),), stream=stream)


def test_jax_in_jax_out():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    v_a = jax.random.normal(k1, (TOKENS, HEADS, HEAD_SIZE), dtype=jnp.float16)
    v_b = jax.random.normal(k2, (TOKENS, HEADS, HEAD_SIZE), dtype=jnp.float16)
    s_a = jax.random.normal(k3, (HEADS, TOKENS), dtype=jnp.float32)
    s_b = jax.random.normal(k4, (HEADS, TOKENS), dtype=jnp.float32)
    v, s = cm.merge_state(v_a, s_a, v_b, s_b)
    assert isinstance(v, jax.Array) and isinstance(s, jax.Array)
    host = [np.asarray(x, dtype=np.float64) for x in (v_a, s_a, v_b, s_b)]
    want_v, want_s = reference.merge_state(*host)
    assert relative_error(np.asarray(v, dtype=np.float64), want_v) <= 1e-2
    assert relative_error(np.asarray(s, dtype=np.float64), want_s) <= 1e-6


@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
def test_merge_runs_on_the_device_holding_the_arrays(rng):
    import cupy

    with cupy.cuda.Device(1):
        states = [
            to_device(rng.standard_normal((64, 4, 64)), "float16"),
            to_device(rng.standard_normal((4, 64)), "float32"),
        ]
        states += [
            to_device(rng.standard_normal((64, 4, 64)), "float16"),
            to_device(rng.standard_normal((4, 64)), "float32"),
        ]
    with cupy.cuda.Device(0):
        v, s = cm.merge_state(*states)
    assert v.device.id == 1
    _expect_merge(v, s, states)


# ---- every bad input through the public functions, on real arrays -------------------------------


def _build(spec, rng):
    """A real array for ``spec``; ``(array, bytes)``: ``bytes`` views the same memory as uint8."""
    import cupy

    with cupy.cuda.Device(spec.device):
        storage = spec.shape[:-1] + (spec.shape[-1] * spec.last_stride,)
        aligned = cupy.asarray(rng.standard_normal(storage) * 4).astype(spec.dtype)
        if spec.byte_offset:
            # Copied byte-wise: no kernel may touch a misaligned element (it would end the context).
            raw = cupy.zeros(aligned.nbytes + 16, dtype=cupy.uint8)[
                spec.byte_offset : spec.byte_offset + aligned.nbytes
            ]
            raw[...] = aligned.view(cupy.uint8).ravel()
            array = cupy.ndarray(storage, aligned.dtype, raw.data)
        else:
            raw, array = aligned.view(cupy.uint8), aligned
        if spec.broadcast:
            array = cupy.broadcast_to(array[:1], array.shape)
    return (array[..., :: spec.last_stride] if spec.last_stride > 1 else array), raw


def _build_all(specs, rng):
    import cupy

    arrays, raw = {}, {}
    for name, spec in specs.items():
        if spec.overlaps:
            continue
        arrays[name], raw[name] = _build(spec, rng)
    for name, spec in specs.items():
        if spec.overlaps:
            other = specs[spec.overlaps]
            base = cupy.asarray(rng.standard_normal((other.shape[0] + 1,) + other.shape[1:])).astype(
                other.dtype
            )
            arrays[spec.overlaps], arrays[name] = base[1:], base[:-1]
            raw[spec.overlaps] = raw[name] = base.view(cupy.uint8)
    return arrays, raw


@pytest.mark.parametrize("api", ["merge_state", "merge_attn_states"])
@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.id)
def test_every_bad_input_raises_before_writing_anything(rng, case, api):
    if GPU_COUNT < case.needs_devices:
        pytest.skip(f"needs {case.needs_devices} GPUs")
    arrays, raw = _build_all(specs_for(case), rng)
    before = {name: raw[name].get() for name in ("out", "out_lse")}
    with pytest.raises(case.error) as raised:
        if api == "merge_state":
            cm.merge_state(
                arrays["v_a"],
                arrays["s_a"],
                arrays["v_b"],
                arrays["s_b"],
                out=arrays["out"],
                out_lse=arrays["out_lse"],
            )
        else:
            cm.merge_attn_states(
                arrays["out"], arrays["v_a"], arrays["s_a"], arrays["v_b"], arrays["s_b"], arrays["out_lse"]
            )
    name = case.argument if api == "merge_state" else VLLM_NAMES[case.argument]
    assert str(raised.value).startswith(f"{name}: "), str(raised.value)
    import cupy

    cupy.cuda.runtime.deviceSynchronize()  # also: the context is still usable
    for out_name, saved in before.items():
        np.testing.assert_array_equal(raw[out_name].get(), saved)
