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
