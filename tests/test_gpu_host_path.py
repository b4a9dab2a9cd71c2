"""The host path on a GPU: streams, threads, bound storage, refused views, concurrency, a fuzz."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gpu_arrays import fill_nan, relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

TOKENS, HEADS, HEAD_SIZE = 64, 8, 128


def _states(rng, backend="cupy", dtype="float16", tokens=TOKENS):
    v_a, v_b = (to_device(rng.standard_normal((tokens, HEADS, HEAD_SIZE)), dtype, backend) for _ in range(2))
    s_a, s_b = (to_device(rng.standard_normal((HEADS, tokens)) * 8, "float32", backend) for _ in range(2))
    return v_a, s_a, v_b, s_b


def _expect(v, s, states, tolerance=1e-2):
    want_v, want_s = reference.merge_state(*(to_host(x) for x in states))
    got_v, got_s = to_host(v), to_host(s)
    assert np.isfinite(got_v).all() and np.isfinite(got_s).all()
    assert relative_error(got_v, want_v) <= tolerance
    assert relative_error(got_s, want_s) <= 1e-6


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""


def _keep_busy(stream_ptr: int, cycles: int = 200_000_000) -> None:
    """Queue ~0.1 s of GPU time on a stream."""
    import cupy

    kernel = cupy.RawKernel(_SPIN, "spin")
    with cupy.cuda.Stream.from_external(_Raw(stream_ptr)):
        kernel((1,), (1,), (np.int64(cycles),))


class _Raw:
    def __init__(self, pointer):
        self.pointer = pointer

    def __cuda_stream__(self):
        return (0, self.pointer)


def test_torch_outputs_allocated_for_a_side_stream_are_not_handed_out_while_it_writes(rng):
    torch = pytest.importorskip("torch")
    states = _states(rng, "torch", "bfloat16", tokens=4096)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    _keep_busy(side.cuda_stream)
    v, s = cm.merge_state(*states, stream=side)  # queued behind the spin on the side stream
    del v, s  # dropped at once: the block goes back to the allocator while the merge is pending
    fresh = torch.full((4096, HEADS, HEAD_SIZE), 7.0, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    assert (fresh == 7.0).all(), "the merge wrote into memory handed out to another tensor"


def test_cupy_outputs_allocated_for_a_side_stream_are_not_handed_out_while_it_writes(rng):
    import cupy

    states = _states(rng, "cupy", "float16", tokens=4096)
    side = cupy.cuda.Stream(non_blocking=True)
    _keep_busy(side.ptr)
    v, s = cm.merge_state(*states, stream=side)
    del v, s
    fresh = cupy.full((4096, HEADS, HEAD_SIZE), 7.0, dtype=cupy.float16)
    cupy.cuda.runtime.deviceSynchronize()
    assert bool((fresh == 7.0).all()), "the merge wrote into memory handed out to another array"


@pytest.mark.parametrize("bound", [False, True])
def test_a_thread_that_never_used_cuda_can_merge(rng, bound):
    states = _states(rng)
    out, out_lse = cm.merge_state(*states)  # prepared and cached on this thread
    merge = cm.bind(cm.merge_state, *states, out=out, out_lse=out_lse) if bound else None
    fill_nan(out)
    errors = []

    def worker():
        try:
            if bound:
                merge()
            else:
                cm.merge_state(*states, out=out, out_lse=out_lse)
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    _expect(out, out_lse, states)


@pytest.mark.parametrize("change", ["set_", "data", "resize_storage"])
def test_a_bound_tensor_whose_storage_changed_is_refused_before_launch(rng, change):
    torch = pytest.importorskip("torch")
    states = _states(rng, "torch", "bfloat16")
    out = torch.empty_like(states[0])
    merge = cm.bind(cm.merge_attn_states, out, *states)
    merge()
    if change == "set_":
        out.set_(torch.empty_like(out))
    elif change == "data":
        out.data = torch.empty_like(out)
    else:
        out.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="^output: no longer points at the memory"):
        merge()
    torch.cuda.synchronize()


def test_negated_torch_views_are_refused_even_after_the_plain_view_was_cached(rng):
    torch = pytest.importorskip("torch")
    v_a, _, v_b, s_b = _states(rng, "torch", "float16")
    buffer = torch.randn(HEADS, TOKENS, dtype=torch.complex64, device="cuda")
    plain, negated = buffer.imag, buffer.conj().imag  # same pointer, shape and strides
    cm.merge_state(v_a, plain, v_b, s_b)
    with pytest.raises(TypeError, match="^s_a: expected a tensor without torch's lazy negation"):
        cm.merge_state(v_a, negated, v_b, s_b)


def test_jax_outputs_are_refused_and_results_come_back_as_new_jax_arrays(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    import jax.numpy as jnp

    v = jnp.asarray(rng.standard_normal((TOKENS, HEADS, HEAD_SIZE)), dtype=jnp.float16)
    s = jnp.asarray(rng.standard_normal((HEADS, TOKENS)), dtype=jnp.float32)
    before = np.asarray(v).copy()
    with pytest.raises(TypeError, match="^output: JAX arrays are immutable"):
        cm.merge_attn_states(v, v, s, v, s)
    with pytest.raises(TypeError, match="^v: JAX arrays are immutable"):
        cm.merge_state_in_place(v, s, v, s)
    with pytest.raises(TypeError, match="^out: JAX arrays are immutable"):
        cm.merge_state(v, s, v, s, out=v)
    np.testing.assert_array_equal(np.asarray(v), before)
    merged, _ = cm.merge_state(v, s, v, s)
    assert type(merged).__module__.startswith(("jax", "jaxlib"))


def test_eight_threads_on_their_own_streams_merge_repeatedly(rng):
    import cupy

    workers, rounds = 8, 25
    inputs = [_states(rng, "cupy", "float16", tokens=97 * (i + 1)) for i in range(workers)]
    cupy.cuda.Device().synchronize()  # the workers' non-blocking streams do not wait for the null stream
    errors = []

    def work(index):
        try:
            states = inputs[index]
            stream = cupy.cuda.Stream(non_blocking=True)
            out, out_lse = cupy.empty_like(states[0]), cupy.empty_like(states[1])
            bound = cm.bind(cm.merge_attn_states, out, *states, out_lse)
            for round_ in range(rounds):
                with stream:
                    if round_ % 2:
                        fill_nan(
                            out
                        )  # on the merge's stream: a non-blocking stream does not wait for the null stream
                    if round_ % 3 == 0:
                        bound(stream=stream)
                    elif round_ % 3 == 1:
                        cm.merge_attn_states(out, *states, out_lse)
                    else:
                        v, s = cm.merge_state(*states)
                        out[...], out_lse[...] = v, s
                    stream.synchronize()
                _expect(out, out_lse, states)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append((index, error))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
