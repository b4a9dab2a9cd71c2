"""The cross-rank merge in a one-rank group, in this process: its arrays follow the merges' rules.

On the CPU (gloo, CPU tensors: runs in CI) and on a GPU (NCCL and CuPy's NCCL).
With one rank the merge over all ranks is the rank's own state (merged with the
sinks), so every strategy can be checked against the float64 reference here.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from conftest import GPU_COUNT

from cupy_merge import reference

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import cupy_merge as cm
from cupy_merge.distributed import merge_across_ranks

MODES = [(False, "allgather"), (False, "allreduce"), (True, "alltoall"), (True, "allgather_reducescatter")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def group():
    backend = "nccl" if GPU_COUNT else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield "cuda" if GPU_COUNT else "cpu"
    dist.destroy_process_group()


def _state(rng, tokens, heads, head_size, device, dtype=torch.float32):
    v = torch.tensor(rng.standard_normal((tokens, heads, head_size)), dtype=dtype, device=device)
    s = torch.tensor(rng.standard_normal((heads, tokens)) * 3, dtype=torch.float32, device=device)
    return v, s


@pytest.mark.parametrize("shard_heads, op", MODES)
@pytest.mark.parametrize("shape", [(0, 4, 8), (3, 0, 8), (0, 0, 8)])
def test_zero_tokens_or_heads_merge_to_empty_results_with_every_strategy(group, shard_heads, op, shape):
    v = torch.zeros(shape, device=group)
    s = torch.zeros(shape[1], shape[0], device=group)
    out, lse = merge_across_ranks(v, s, op=op, shard_heads=shard_heads)
    assert tuple(out.shape) == shape and tuple(lse.shape) == (shape[1], shape[0])
    bound = cm.bind(merge_across_ranks, v, s, op=op, shard_heads=shard_heads)
    assert tuple(bound()[0].shape) == shape


@pytest.mark.parametrize("shard_heads, op", MODES)
def test_every_strategy_merges_one_rank_with_its_sinks(group, rng, shard_heads, op):
    v, s = _state(rng, 5, 4, 16, group)
    sinks = torch.tensor(rng.standard_normal(4) * 2, dtype=torch.float32, device=group)
    out, lse = merge_across_ranks(v, s, op=op, shard_heads=shard_heads, sinks=sinks)
    want_v, want_s = reference.merge_states(v.cpu().numpy()[None], s.cpu().numpy()[None], sinks=sinks.cpu().numpy())
    np.testing.assert_allclose(out.cpu().numpy(), want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.cpu().numpy(), want_s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shard_heads, op", MODES)
def test_outputs_that_share_memory_are_refused_before_any_collective(group, shard_heads, op):
    v, s = torch.zeros(3, 4, 8, device=group), torch.zeros(4, 3, device=group)
    broadcast = torch.zeros(4, 1, device=group).expand(4, 3)
    with pytest.raises(ValueError, match="^out_lse: expected an output whose elements do not share memory"):
        merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out_lse=broadcast)
    with pytest.raises(ValueError, match="^out: expected memory separate from v"):
        merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=v)
    with pytest.raises(ValueError, match="^out: expected the last dimension"):
        merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=torch.zeros(3, 4, 16, device=group)[..., ::2])


@pytest.mark.parametrize("shard_heads, op", MODES)
def test_outputs_with_any_token_and_head_strides_are_written(group, rng, shard_heads, op):
    v, s = _state(rng, 6, 4, 16, group)
    out = torch.full((6, 4, 32), float("nan"), device=group)[..., :16]
    out_lse = torch.full((6, 4), float("nan"), device=group).T  # token-major
    merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=out, out_lse=out_lse)
    np.testing.assert_allclose(out.cpu().numpy(), v.cpu().numpy(), rtol=1e-6)
    np.testing.assert_allclose(out_lse.cpu().numpy(), s.cpu().numpy(), rtol=1e-6)


def test_a_stream_that_is_not_a_stream_is_refused(group):
    v, s = torch.zeros(3, 4, 8, device=group), torch.zeros(4, 3, device=group)
    with pytest.raises(TypeError, match="^stream: expected"):
        merge_across_ranks(v, s, stream=object())


def test_a_sparse_tensor_is_refused_naming_the_argument(group):
    v, s = torch.zeros(3, 4, 8, device=group), torch.zeros(4, 3, device=group)
    with pytest.raises(TypeError, match="^s: expected a dense"):
        merge_across_ranks(v, s.to_sparse())



@pytest.mark.parametrize("shard_heads, op", MODES)
@pytest.mark.parametrize("argument", ["v", "s", "sinks"])
def test_an_input_that_requires_grad_is_refused_in_grad_mode_before_any_collective(
    group, monkeypatch, shard_heads, op, argument
):
    """The collectives record no autograd graph: a merge of inputs that require grad would
    return results whose gradients are silently lost (or, on gloo, only this rank's share)."""
    arrays = {"v": torch.ones(3, 4, 8, device=group), "s": torch.zeros(4, 3, device=group),
              "sinks": torch.zeros(4, device=group)}  # fmt: skip
    arrays[argument].requires_grad_()
    out = torch.full((3, 4, 8), float("nan"), device=group)
    collectives = []
    for name in ("all_gather", "all_gather_into_tensor", "all_to_all_single", "all_reduce", "reduce_scatter_tensor",
                 "reduce_scatter_single"):  # fmt: skip
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: collectives.append(_name))
    with pytest.raises(RuntimeError, match=f"^merge_across_ranks: {argument} requires grad, and a merge across ranks"):
        merge_across_ranks(**arrays, op=op, shard_heads=shard_heads, out=out)
    with pytest.raises(RuntimeError, match=rf"^bind\(merge_across_ranks\): {argument} requires grad, and a bound"):
        cm.bind(merge_across_ranks, **arrays, op=op, shard_heads=shard_heads)
    assert collectives == [] and torch.isnan(out).all()


@pytest.mark.parametrize("shard_heads, op", MODES)
def test_inputs_that_require_grad_merge_under_no_grad_eagerly_and_bound(group, shard_heads, op):
    v, s = torch.ones(3, 4, 8, device=group, requires_grad=True), torch.zeros(4, 3, device=group)
    with torch.no_grad():
        out, lse = merge_across_ranks(v, s, op=op, shard_heads=shard_heads)
        bound = cm.bind(merge_across_ranks, v, s, op=op, shard_heads=shard_heads)
    assert torch.equal(out, v.detach()) and torch.equal(lse, s) and out.grad_fn is None
    # Launched in grad mode, the bound merge still records nothing, on the CPU as on the GPU.
    bound_out, bound_lse = bound()
    assert torch.equal(bound_out, v.detach()) and not bound_out.requires_grad and not bound_lse.requires_grad


@pytest.mark.gpu
def test_a_summed_output_at_an_address_not_16_byte_aligned_is_written_by_narrow_stores(group, rng):
    v, s = _state(rng, 7, 4, 64, group, torch.bfloat16)
    buffer = torch.full((7 * 4 * 64 + 1,), float("nan"), dtype=torch.bfloat16, device=group)
    out = buffer[1:].view(7, 4, 64)  # contiguous, 2-byte aligned: summed in place
    merge_across_ranks(v, s, op="allreduce", out=out)
    torch.cuda.synchronize()  # a misaligned 16-byte store would have ended the context here
    np.testing.assert_array_equal(out.float().cpu().numpy(), v.float().cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("shard_heads, op", MODES)
def test_a_torch_merge_runs_on_the_stream_given(group, rng, shard_heads, op):
    fresh, s = _state(rng, 64, 8, 128, group, torch.float16)
    v = torch.zeros_like(fresh)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy, then writes the state
        v.copy_(fresh)
    out, lse = merge_across_ranks(v, s, op=op, shard_heads=shard_heads, stream=side)
    side.synchronize()  # a merge run on another stream would have read the zeros
    np.testing.assert_array_equal(out.cpu().numpy(), fresh.cpu().numpy())
    np.testing.assert_array_equal(lse.cpu().numpy(), s.cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("shard_heads, op", MODES)
def test_a_cupy_merge_takes_a_raw_int_stream(rng, shard_heads, op):
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    v = cupy.asarray(rng.standard_normal((5, 4, 32)).astype(np.float32))
    s = cupy.asarray(rng.standard_normal((4, 5)).astype(np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    # The inputs' copies ran on the null stream, which a non-blocking stream does not wait for (the
    # H200 once read s before its copy landed: the merged LSE was stale memory, the values right).
    stream.wait_event(cupy.cuda.get_current_stream().record())
    out, lse = merge_across_ranks(v, s, comm, op=op, shard_heads=shard_heads, stream=stream.ptr)
    stream.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(out), cupy.asnumpy(v), rtol=1e-6)
    np.testing.assert_allclose(cupy.asnumpy(lse), cupy.asnumpy(s), rtol=1e-6)


@pytest.mark.parametrize("shard_heads, op", MODES)
def test_writes_into_given_outputs_bump_their_versions_and_outputs_that_require_grad_are_refused(
    group, rng, shard_heads, op
):
    """As the core merges: a backward that saved ``out`` before a cross-rank merge overwrote it
    raises, eager and bound; an ``out`` that requires grad is refused in grad mode."""
    v, s = _state(rng, 3, 4, 8, group)
    out, out_lse = torch.randn(3, 4, 8, device=group), torch.randn(4, 3, device=group)
    weight = torch.randn(3, 4, 8, device=group, requires_grad=True)
    loss = (weight * out).sum()
    merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=out, out_lse=out_lse)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    bound = cm.bind(merge_across_ranks, v, s, op=op, shard_heads=shard_heads, out=out, out_lse=out_lse)
    loss = (torch.randn(4, 3, device=group, requires_grad=True) * out_lse).sum()
    bound()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(RuntimeError, match="^out: requires grad, and merge_across_ranks writes into it"):
        merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=out.requires_grad_())
    with torch.no_grad():
        merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=out)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(MODES), st.integers(0, 6), st.integers(1, 4), st.sampled_from([1, 8, 24]),
    st.sampled_from(["float32", "float16", "bfloat16"]), st.booleans(), st.booleans(), st.booleans(),
    st.integers(0, 2**32 - 1),
)  # fmt: skip
def test_every_strategy_on_one_rank_writes_any_output_layout(group, mode, tokens, heads, head_size, dtype,
                                                             padded_out, token_major_lse, with_sinks, seed):  # fmt: skip
    """Outputs of every strategy, padded or contiguous, LSEs either way round, with or without sinks."""
    shard_heads, op = mode
    rng = np.random.default_rng(seed)
    torch_dtype = getattr(torch, dtype)
    v = torch.tensor(rng.standard_normal((tokens, heads, head_size)), dtype=torch_dtype, device=group)
    s = torch.tensor(rng.standard_normal((heads, tokens)) * 3, dtype=torch.float32, device=group)
    width = head_size + (3 if padded_out else 0)
    out = torch.full((tokens, heads, width), float("nan"), dtype=torch_dtype, device=group)[..., :head_size]
    out_lse = torch.full((tokens, heads) if token_major_lse else (heads, tokens), float("nan"), device=group)
    out_lse = out_lse.T if token_major_lse else out_lse
    sinks = torch.tensor(rng.standard_normal(heads), dtype=torch.float32, device=group) if with_sinks else None
    merge_across_ranks(v, s, op=op, shard_heads=shard_heads, out=out, out_lse=out_lse, sinks=sinks)
    want_v, want_s = reference.merge_states(
        v.double().cpu().numpy()[None], s.cpu().numpy()[None], sinks=None if sinks is None else sinks.cpu().numpy()
    )
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    got_v = out.double().cpu().numpy()
    if tokens:
        assert np.isfinite(got_v).all()
        assert np.linalg.norm(got_v - want_v) <= tolerance * max(np.linalg.norm(want_v), 1e-30)
        np.testing.assert_allclose(out_lse.cpu().numpy(), want_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shard_heads, exchanging, summing", [
    (False, "allgather", "allreduce"), (True, "alltoall", "allgather_reducescatter"),
])  # fmt: skip
def test_batch_invariant_mode_makes_auto_exchange_the_states_and_merge_them_in_rank_order(
    group, rng, monkeypatch, shard_heads, exchanging, summing
):
    """An NCCL sum's order is NCCL's: in batch-invariant mode "auto" never picks a summing strategy,
    even where the cost model would (made to here: on one rank it would exchange anyway)."""
    from cupy_merge.distributed import _strategies

    monkeypatch.setattr(_strategies, "choose_strategy", lambda *args, **kwargs: summing)
    v, s = _state(rng, 64, 8, 64, group)
    picked = {}
    for mode in (False, True):
        with cm.batch_invariant(mode):
            picked[mode] = _strategies.resolve(v, s, None, "auto", shard_heads, None, None, "e", None, None).op
            out, lse = merge_across_ranks(v, s, shard_heads=shard_heads)
        want_v, want_s = reference.merge_states(v.cpu().numpy()[None], s.cpu().numpy()[None])
        np.testing.assert_allclose(out.cpu().numpy(), want_v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse.cpu().numpy(), want_s, rtol=1e-5, atol=1e-6)
    assert picked == {False: summing, True: exchanging}
