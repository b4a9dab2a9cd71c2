"""bind() on the CPU: what it accepts, that it prepares without launching, and the pointer guard."""

from __future__ import annotations

import gc

import pytest

import cupy_merge as cm
from cupy_merge import _arrays, _dispatch, _launch


def test_bind_takes_only_this_librarys_merges():
    with pytest.raises(TypeError, match=r"^merge: expected one of cupy_merge's merges \(merge_attn_states, "):
        cm.bind(print, 1, 2)


def test_every_merge_declares_its_binder():
    from cupy_merge import bound
    from cupy_merge.distributed import merge_across_ranks

    for merge in (cm.merge_attn_states, cm.merge_state, cm.merge_state_in_place, cm.merge_states,
                  cm.merge_states_varlen, merge_across_ranks):  # fmt: skip
        assert callable(getattr(merge, bound.BINDER, None)), merge
    assert bound.BINDER == "__cupy_merge_bind__"


def test_bind_refuses_a_stream_which_belongs_to_each_launch():
    with pytest.raises(TypeError, match=r"^stream: pass it to each launch"):
        cm.bind(cm.merge_attn_states, None, None, None, None, None, stream=0)


class _Adapter(_arrays.Adapter):
    kind = "torch"

    def current_stream(self, device):
        return 0


@pytest.fixture
def prepared_without_a_gpu(monkeypatch):
    """merge calls prepare nothing real: the call it gets has no launch; nothing may run."""
    monkeypatch.setattr(_dispatch, "prepare", lambda *args: _dispatch.Call((), _Adapter(), 0, (), None))
    monkeypatch.setattr(_dispatch, "run", lambda *args: pytest.fail("ran the merge"))
    monkeypatch.setattr(_launch, "launch", lambda *args: pytest.fail("launched"))


def test_bind_prepares_the_call_and_never_runs_it(prepared_without_a_gpu):
    torch = pytest.importorskip("torch")
    v = torch.zeros(2, 3, 8)
    s = torch.zeros(3, 2)
    bound = cm.bind(cm.merge_state, v, s, v, s, out=v.clone(), out_lse=s.clone())
    out, out_lse = bound()
    assert out.shape == v.shape and bound() == (out, out_lse)  # the same outputs every time


def test_bind_refuses_inputs_that_require_grad_in_grad_mode(monkeypatch):
    """A bound merge records no autograd graph: binding tensors that require grad in grad mode is
    refused (under torch.no_grad() they bind, e.g. an inference loop's learned sinks)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(_dispatch, "prepare", lambda *args: _dispatch.Call((), _Adapter(), 0, (), None, True))
    monkeypatch.setattr(_launch, "launch", lambda *args: pytest.fail("launched"))
    v, s = torch.zeros(2, 3, 8), torch.zeros(3, 2)
    sinks = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"^bind\(merge_state\): an input requires grad, and a bound merge records no"):
        cm.bind(cm.merge_state, v, s, v, s, out=v.clone(), out_lse=s.clone(), sinks=sinks)
    with torch.no_grad():
        cm.bind(cm.merge_state, v, s, v, s, out=v.clone(), out_lse=s.clone(), sinks=sinks)


def test_a_bound_tensor_whose_storage_changed_is_refused(prepared_without_a_gpu):
    torch = pytest.importorskip("torch")
    output = torch.zeros(2, 3, 8)
    v, s = torch.zeros(2, 3, 8), torch.zeros(3, 2)
    bound = cm.bind(cm.merge_attn_states, output, v, s, v, s)
    bound()
    output.set_(torch.zeros(2, 3, 8))
    with pytest.raises(RuntimeError, match="^output: no longer points at the memory this merge was bound to"):
        bound()


def test_a_bound_tensor_whose_storage_was_resized_in_place_is_refused_even_at_the_same_address(
    prepared_without_a_gpu,
):
    """A storage freed and allocated again smaller may get its old address back (the caching
    allocator's first fit): the launch would then write past its end. The size is compared too."""
    torch = pytest.importorskip("torch")
    output, v, s = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(3, 2)
    bound = cm.bind(cm.merge_attn_states, output, v, s, v, s)
    storage = output.untyped_storage()
    storage.resize_(0)
    storage.resize_(16)
    # CUDA's allocator may hand the old address back; the CPU's did not here, so the guard is told
    # it saw this address: only the storage's size can then tell the two apart.
    guard = bound._guard
    guard._tensors = tuple((t, t.data_ptr(), st, size, name) for t, _, st, size, name in guard._tensors)
    with pytest.raises(RuntimeError, match="^output: no longer points at the memory this merge was bound to"):
        bound()


def test_a_bound_merge_holds_its_tensors_storages_so_a_swapped_one_is_never_at_the_old_address(
    prepared_without_a_gpu,
):
    torch = pytest.importorskip("torch")
    output, v, s = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(3, 2)
    bound = cm.bind(cm.merge_attn_states, output, v, s, v, s)
    address, size = output.data_ptr(), output.untyped_storage().nbytes()
    output.set_(torch.zeros(2, 3, 8))  # nothing else holds the old storage
    gc.collect()
    held = [storage for _, _, storage, _, name in bound._guard._tensors if name == "output"]
    assert [(storage.data_ptr(), storage.nbytes()) for storage in held] == [(address, size)]
    with pytest.raises(RuntimeError, match="^output: no longer points"):
        bound()


def test_a_bound_tensor_whose_storage_was_freed_is_refused(prepared_without_a_gpu):
    torch = pytest.importorskip("torch")
    output, v, s = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(3, 2)
    bound = cm.bind(cm.merge_attn_states, output, v, s, v, s)
    s.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="^prefix_lse: no longer points"):
        bound()
