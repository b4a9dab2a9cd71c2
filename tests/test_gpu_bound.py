"""bind() on a GPU: a bound merge relaunches on new data in the same buffers, on any stream."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import fill_nan, relative_error, to_device, to_host

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu

TOKENS, HEADS, HEAD_SIZE, STATES = 37, 8, 128, 5


def _refill(rng, arrays):
    """New random data in the same buffers (values ~N(0,1), LSEs spread +-8)."""
    for array in arrays:
        scale = 8.0 if _dtype_name(array) == "float32" else 1.0
        fresh = to_device(
            rng.standard_normal(tuple(array.shape)) * scale, _dtype_name(array), _backend(array)
        )
        array[...] = fresh


def _dtype_name(array) -> str:
    return str(array.dtype).replace("torch.", "")


def _backend(array) -> str:
    return "torch" if hasattr(array, "detach") else "cupy"


def _states(rng, backend, dtype="float16"):
    v_a, v_b = (to_device(rng.standard_normal((TOKENS, HEADS, HEAD_SIZE)), dtype, backend) for _ in range(2))
    s_a, s_b = (to_device(rng.standard_normal((HEADS, TOKENS)) * 8, "float32", backend) for _ in range(2))
    return v_a, s_a, v_b, s_b


def _like(array):
    return array.clone() if hasattr(array, "clone") else array.copy()


def _expect(got_v, got_s, want_v, want_s):
    got_v, got_s = to_host(got_v), to_host(got_s)
    assert not np.isnan(got_v).any() and not np.isnan(got_s).any(), "an output was not written"
    assert relative_error(got_v, want_v) <= 1e-2
    assert relative_error(got_s, want_s) <= 1e-6


@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_bound_merge_attn_states_sees_new_data_every_launch(rng, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    states = _states(rng, backend)
    out, out_lse = _like(states[0]), _like(states[1])
    merge = cm.bind(cm.merge_attn_states, out, *states, out_lse)
    for _ in range(3):
        _refill(rng, states)
        fill_nan(out)
        fill_nan(out_lse)
        assert merge() is None
        _expect(out, out_lse, *reference.merge_state(*(to_host(x) for x in states)))


def test_bind_itself_launches_nothing(rng):
    states = _states(rng, "cupy")
    out, out_lse = _like(states[0]), _like(states[1])
    fill_nan(out)
    cm.bind(cm.merge_attn_states, out, *states, out_lse)
    assert np.isnan(to_host(out)).all()


def test_bound_allocating_merge_returns_the_same_outputs_each_time(rng):
    states = _states(rng, "cupy")
    merge = cm.bind(cm.merge_state, *states, out_dtype="float32")
    first = merge()
    _refill(rng, states)
    second = merge()
    assert second[0] is first[0] and second[1] is first[1] and first[0].dtype == np.float32
    _expect(*second, *reference.merge_state(*(to_host(x) for x in states)))


def test_bound_in_place_merge_with_a_mask(rng):
    import cupy

    v, s, v_other, s_other = _states(rng, "cupy")
    mask = cupy.asarray(rng.random(TOKENS) < 0.5)
    mask[0], mask[1] = True, False
    merge = cm.bind(cm.merge_state_in_place, v, s, v_other, s_other, mask)
    for _ in range(2):
        _refill(rng, (v, s, v_other, s_other))
        before_v, before_s = to_host(v), to_host(s)
        merge()
        want_v, want_s = reference.merge_state(before_v, before_s, to_host(v_other), to_host(s_other))
        keep = ~cupy.asnumpy(mask)
        want_v[keep], want_s[:, keep] = before_v[keep], before_s[:, keep]
        _expect(v, s, want_v, want_s)


@pytest.mark.parametrize("ragged", [False, True])
def test_bound_n_way_and_ragged_merges(rng, ragged):
    import cupy

    if ragged:
        indptr = cupy.asarray([0, 2, 2, 5, 9], dtype=cupy.int32)
        v = to_device(rng.standard_normal((9, HEADS, HEAD_SIZE)), "float16")
        s = to_device(rng.standard_normal((HEADS, 9)) * 8, "float32")
        out, out_lse = cupy.empty((4, HEADS, HEAD_SIZE), v.dtype), cupy.empty((HEADS, 4), cupy.float32)
        merge = cm.bind(cm.merge_states_varlen, v, s, indptr, out=out, out_lse=out_lse)
        want = lambda: reference.merge_states_varlen(to_host(v), to_host(s), cupy.asnumpy(indptr))
    else:
        v = to_device(rng.standard_normal((STATES, TOKENS, HEADS, HEAD_SIZE)), "float16")
        s = to_device(rng.standard_normal((STATES, HEADS, TOKENS)) * 8, "float32")
        out, out_lse = (
            cupy.empty((TOKENS, HEADS, HEAD_SIZE), v.dtype),
            cupy.empty((HEADS, TOKENS), cupy.float32),
        )
        merge = cm.bind(cm.merge_states, v, s, out=out, out_lse=out_lse)
        want = lambda: reference.merge_states(to_host(v), to_host(s))
    for _ in range(2):
        _refill(rng, (v, s))
        fill_nan(out)
        fill_nan(out_lse)
        got = merge()
        assert got[0] is out and got[1] is out_lse
        want_v, want_s = want()
        finite = np.isfinite(want_s)
        assert np.array_equal(to_host(out_lse)[~finite], want_s[~finite])
        assert relative_error(to_host(out), want_v) <= 1e-2
        assert relative_error(to_host(out_lse)[finite], want_s[finite]) <= 1e-6


def test_bound_merge_launches_on_the_stream_it_is_given(rng):
    import cupy

    states = _states(rng, "cupy")
    out = _like(states[0])
    merge = cm.bind(cm.merge_attn_states, out, *states)
    stream = cupy.cuda.Stream(non_blocking=True)
    fill_nan(out)
    cupy.cuda.Device().synchronize()
    merge(stream=stream)
    stream.synchronize()
    assert not np.isnan(to_host(out)).any()
    with pytest.raises(TypeError, match="^stream: expected"):
        merge(stream="not a stream")


def test_bound_merge_replays_inside_a_torch_cuda_graph(rng):
    torch = pytest.importorskip("torch")
    states = _states(rng, "torch", "bfloat16")
    out, out_lse = _like(states[0]), _like(states[1])
    merge = cm.bind(cm.merge_attn_states, out, *states, out_lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge()
    for _ in range(2):
        _refill(rng, states)
        fill_nan(out)
        fill_nan(out_lse)
        graph.replay()
        torch.cuda.synchronize()
        _expect(out, out_lse, *reference.merge_state(*(to_host(x) for x in states)))


def test_a_bad_call_raises_at_bind_naming_the_argument(rng):
    v_a, s_a, v_b, s_b = _states(rng, "cupy")
    out = _like(v_a)
    fill_nan(out)
    with pytest.raises(ValueError, match="^suffix_lse: expected shape"):
        cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b[:, :-1])
    assert np.isnan(to_host(out)).all()


def test_empty_arrays_bind_to_a_merge_that_does_nothing(rng):
    import cupy

    v = cupy.empty((0, HEADS, HEAD_SIZE), cupy.float16)
    s = cupy.empty((HEADS, 0), cupy.float32)
    merge = cm.bind(cm.merge_attn_states, cupy.empty_like(v), v, s, v, s)
    assert merge() is None
    assert "nothing" in repr(merge)


def test_jax_arrays_cannot_be_bound():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    v = jnp.ones((4, 2, 64), dtype=jnp.float16)
    s = jnp.zeros((2, 4), dtype=jnp.float32)
    with pytest.raises(TypeError, match="^merge: JAX arrays are immutable"):
        cm.bind(cm.merge_state, v, s, v, s)
