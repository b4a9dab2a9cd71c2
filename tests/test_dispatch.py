"""The per-call fast path: what identifies a repeated call, and what is never cached. No GPU needed."""

from __future__ import annotations

import pytest

from cupy_merge import _dispatch


def test_a_torch_tensor_is_fingerprinted_by_pointer_shape_strides_and_dtype():
    torch = pytest.importorskip("torch")
    _dispatch._learn_torch()
    base = torch.zeros(4, 8, dtype=torch.float16)
    same = base.view(4, 8)
    assert _dispatch.fingerprint(base) == _dispatch.fingerprint(same)
    others = [base[1:], base.T, base.view(torch.bfloat16), base.reshape(8, 4), base.float()]
    for other in others:
        assert _dispatch.fingerprint(other) != _dispatch.fingerprint(base)


def test_arrays_without_a_fingerprint_make_the_call_uncacheable():
    class Producer:  # e.g. a DLPack-only array
        pass

    assert _dispatch.fingerprint(Producer()) is None
    assert _dispatch.fingerprint(None) == ()  # a missing optional argument is a known value
    _dispatch._calls.clear()
    _dispatch.remember((1, None), _dispatch.Call(None, "other", 0))
    assert _dispatch._calls == {}
    _dispatch.remember((1, ()), _dispatch.Call(None, "cupy", 0))
    assert _dispatch.lookup((1, ())) is not None
    assert _dispatch.lookup(([1],)) is None  # unhashable options fall through to the full path
    _dispatch._calls.clear()


def test_the_call_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "_MAX_CALLS", 3)
    _dispatch._calls.clear()
    for key in range(5):
        _dispatch.remember((key,), _dispatch.Call(None, "cupy", 0))
    assert len(_dispatch._calls) <= 3
    _dispatch._calls.clear()


def test_calls_of_different_functions_never_share_a_cached_launch(monkeypatch):
    # merge_state_in_place(v, s, v_other, s_other, mask) and
    # merge_states_varlen(v_other, s_other, mask, out=v, out_lse=s) name the same five arrays;
    # a shared key would let the second replay the first's launch without any check.
    torch = pytest.importorskip("torch")
    import cupy_merge as cm

    keys = []
    monkeypatch.setattr(_dispatch, "lookup", lambda key: keys.append(key))
    v, v_other = torch.zeros(2, 3, 2, 8)
    s, s_other = torch.zeros(2, 2, 3)
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(TypeError):  # CPU tensors: rejected after the lookup
        cm.merge_state_in_place(v, s, v_other, s_other, mask)
    with pytest.raises(TypeError):
        cm.merge_states_varlen(v_other, s_other, mask, out=v, out_lse=s, check_indptr=False)
    assert len(keys) == 2 and keys[0] != keys[1]


def test_fresh_output_pointers_are_patched_into_a_copy_of_the_arguments():
    import ctypes

    import numpy as np

    from cupy_merge import _kernels

    values = np.array([11, 22, 33], dtype=np.int64)
    pointers = values.__array_interface__["data"][0] + _kernels._ARGUMENT_OFFSETS[:3]
    prepared = _kernels.PreparedLaunch(7, (1, 1, 1), (32, 1, 1), pointers.__array_interface__["data"][0], 0, 0,
                                       (values, pointers, None))  # fmt: skip
    patched = _kernels.with_pointers(prepared, [(0, 1000), (1, 2000)])
    # cuLaunchKernel reads params as void*[]: each entry points at one int64 argument.
    table = (ctypes.c_uint64 * 3).from_address(patched.params)
    assert [ctypes.c_int64.from_address(address).value for address in table] == [1000, 2000, 33]
    assert values.tolist() == [11, 22, 33]  # the cached launch is untouched
    assert patched.function == 7 and patched.grid == prepared.grid


def test_a_call_given_both_outputs_relaunches_its_cached_arguments_without_copying(monkeypatch):
    import numpy as np

    from cupy_merge import _arrays, _kernels

    values = np.array([11, 22, 33], dtype=np.int64)
    prepared = _kernels.PreparedLaunch(7, (1, 1, 1), (32, 1, 1), 12345, 0, 0, (values, None, None))
    call = _dispatch.Call(prepared, "cupy", 0, _dispatch.FreshOutputs(None, None))
    monkeypatch.setattr(_arrays, "stream_pointer", lambda stream, kind, device: 0)
    monkeypatch.setattr(_kernels, "with_pointers", lambda *args: pytest.fail("copied the arguments"))
    launched = []
    monkeypatch.setattr(_kernels, "launch_prepared", lambda p, stream: launched.append(p))
    assert _dispatch.run_with_fresh_outputs(call, None, "out", "out_lse", None) == ("out", "out_lse")
    assert launched == [prepared]
