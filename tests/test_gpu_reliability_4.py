"""The fourth reliability pass on a GPU: the ragged offsets' host read, and writes into given tensors."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_arrays import relative_error

import cupy_merge as cm
from cupy_merge import reference

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HEADS, HEAD_SIZE = 8, 64
SLEEP_CYCLES = 200_000_000  # ~0.1 s: the offsets' producer is still queued when the merge reads them


def _ragged(rng, counts):
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = int(indptr[-1])
    v = torch.from_numpy(rng.standard_normal((rows, HEADS, HEAD_SIZE)).astype(np.float32)).cuda()
    s = torch.from_numpy((rng.standard_normal((HEADS, rows)) * 3).astype(np.float32)).cuda()
    return v, s, indptr


def _poisoned_offsets(values: np.ndarray):
    """``values`` as a new device tensor written by a producer held back on the stream, in memory
    that held ``-inf`` LSE bytes just before (freed and handed out again by torch's allocator)."""
    source = torch.from_numpy(values).cuda()
    poison = torch.full((values.size * 2,), -float("inf"), device="cuda")
    del poison
    torch.cuda._sleep(SLEEP_CYCLES)
    offsets = torch.empty(values.size, dtype=torch.int64, device="cuda")
    offsets.copy_(source)  # a device copy queued after the sleep
    return offsets


@pytest.mark.parametrize("how", ["merge", "bound", "side stream"])
def test_the_offsets_host_check_waits_for_their_producer_on_the_merges_stream(rng, how):
    """check_indptr=True copies the offsets to the host on the stream the merge runs on: after a
    producer held back on that stream, never a read of the memory before it was written
    (``torch.cuda.ExternalStream(0)`` is a fresh pool stream, not the default stream: issue 47)."""
    counts = np.array([3, 0, 7, 1, 12, 2])
    v, s, indptr = _ragged(rng, counts)
    want_v, want_s = reference.merge_states_varlen(v.cpu().double().numpy(), s.cpu().double().numpy(), indptr)
    side = torch.cuda.Stream()
    for _ in range(3):
        torch.cuda.synchronize()
        if how == "side stream":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                offsets = _poisoned_offsets(indptr)
                got_v, got_s = cm.merge_states_varlen(v, s, offsets, check_indptr=True)
            torch.cuda.current_stream().wait_stream(side)
        elif how == "bound":
            offsets = _poisoned_offsets(indptr)
            got_v, got_s = cm.bind(cm.merge_states_varlen, v, s, offsets, check_indptr=True)()
        else:
            offsets = _poisoned_offsets(indptr)
            got_v, got_s = cm.merge_states_varlen(v, s, offsets, check_indptr=True)
        torch.cuda.synchronize()
        got_s = got_s.cpu().double().numpy()
        empty = np.isneginf(want_s)  # the token of no rows
        assert (got_s[empty] == want_s[empty]).all()
        assert relative_error(got_v.cpu().double().numpy(), want_v) <= 1e-5
        assert relative_error(got_s[~empty], want_s[~empty]) <= 1e-6


def test_writes_into_given_tensors_bump_their_version_and_outputs_that_require_grad_are_refused(rng):
    """The real launch path: a backward that saved a tensor a merge then overwrote raises."""
    tokens = 32
    v_a, v_b = (torch.randn(tokens, HEADS, HEAD_SIZE, device="cuda") for _ in range(2))
    s_a, s_b = (torch.randn(HEADS, tokens, device="cuda") for _ in range(2))
    output = torch.randn(tokens, HEADS, HEAD_SIZE, device="cuda")
    weight = torch.randn(output.shape, device="cuda", requires_grad=True)
    loss = (weight * output).sum()
    cm.merge_attn_states(output, v_a, s_a, v_b, s_b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.empty_like(output)
    bound = cm.bind(cm.merge_state, v_a, s_a, v_b, s_b, out=out)
    loss = (weight * out).sum()
    bound()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(RuntimeError, match="^output: requires grad, and merge_attn_states writes into it"):
        cm.merge_attn_states(output.requires_grad_(), v_a, s_a, v_b, s_b)
    with torch.no_grad():
        cm.merge_attn_states(output, v_a, s_a, v_b, s_b)
    want, _ = reference.merge_state(*(x.detach().cpu().double().numpy() for x in (v_a, s_a, v_b, s_b)))
    assert relative_error(output.detach().cpu().double().numpy(), want) <= 1e-5
