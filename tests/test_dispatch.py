"""The one call sequence: what identifies a repeated call, what is cached, options checked first. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_merge as cm
from cupy_merge import _arrays, _checks, _dispatch, _kernels


def test_a_torch_tensor_is_fingerprinted_by_pointer_shape_strides_dtype_device_and_negation():
    torch = pytest.importorskip("torch")
    base = torch.zeros(4, 8, dtype=torch.float16)
    fingerprint = _arrays.fingerprints((base,))
    assert _arrays.fingerprints((base.view(4, 8),)) == fingerprint
    others = [base[1:], base.T, base.view(torch.bfloat16), base.reshape(8, 4), base.float(), base._neg_view()]
    for other in others:
        assert _arrays.fingerprints((other,)) != fingerprint
    assert base.get_device() in fingerprint  # the device is part of it
    # Flat, so two arrays' parts can never be confused with one array's.
    assert _arrays.fingerprints((base, None)) != _arrays.fingerprints((None, base))


def test_arrays_without_a_fingerprint_make_the_call_uncacheable():
    class Producer:  # e.g. a DLPack-only array
        pass

    assert _arrays.fingerprints((Producer(),)) is None
    assert _arrays.fingerprints((None, None)) == (None, None)  # a missing optional argument is a known value


def test_the_call_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "_MAX_CALLS", 3)
    monkeypatch.setattr(_dispatch, "_calls", {})
    monkeypatch.setattr(_dispatch, "prepare", lambda *args: "prepared")
    monkeypatch.setattr(_dispatch, "run", lambda *args: None)
    monkeypatch.setattr(_arrays, "fingerprints", lambda arrays: arrays)
    for key in range(5):
        _dispatch.call(
            _dispatch.Operation("f", None, False, False, False, frozenset(), frozenset()), (), (key,), None
        )
    assert 1 <= len(_dispatch._calls) <= 3


def test_calls_of_different_functions_never_share_a_cached_launch(monkeypatch):
    # merge_state_in_place(v, s, v_other, s_other, mask) and
    # merge_states_varlen(v_other, s_other, mask, out=v, out_lse=s) name the same five arrays.
    torch = pytest.importorskip("torch")
    keys = []
    real_call = _dispatch.call

    def spy(operation, options, arrays, stream):
        keys.append((operation.name, options, _arrays.fingerprints(arrays)))
        return real_call(operation, options, arrays, stream)

    monkeypatch.setattr(_dispatch, "call", spy)
    v, v_other = torch.zeros(2, 3, 2, 8)
    s, s_other = torch.zeros(2, 2, 3)
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(TypeError):  # CPU tensors: rejected on the full path
        cm.merge_state_in_place(v, s, v_other, s_other, mask)
    with pytest.raises(TypeError):
        cm.merge_states_varlen(v_other, s_other, mask, out=v, out_lse=s, check_indptr=False)
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"lse_base": np.array(2)}, ValueError, "^lse_base: expected"),
        ({"lse_base": True}, ValueError, "^lse_base: expected"),
        (
            {"prefill_tokens_with_context": True},
            TypeError,
            "^prefill_tokens_with_context: expected None or an int",
        ),
        (
            {"prefill_tokens_with_context": 1.0},
            TypeError,
            "^prefill_tokens_with_context: expected None or an int",
        ),
        ({"prefill_tokens_with_context": -1}, ValueError, "^prefill_tokens_with_context: expected >= 0"),
    ],
)
def test_bad_options_raise_before_any_array_is_looked_at(monkeypatch, kwargs, error, words):
    monkeypatch.setattr(_dispatch, "call", lambda *args: pytest.fail("reached the dispatcher"))
    with pytest.raises(error, match=words):
        cm.merge_attn_states(None, None, None, None, None, **kwargs)


def test_prefill_tokens_is_taken_as_its_value_never_as_an_object():
    assert _checks.token_count(np.int64(7)) == 7
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="^prefill_tokens_with_context: expected None or an int, got Tensor"):
        _checks.token_count(torch.tensor(3))


def test_check_indptr_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(_dispatch, "call", lambda *args: pytest.fail("reached the dispatcher"))
    with pytest.raises(TypeError, match="^check_indptr: expected True or False"):
        cm.merge_states_varlen(None, None, None, check_indptr="no")


def test_a_jax_output_is_refused_as_immutable(monkeypatch):
    class FakeJax:
        __module__ = "jaxlib.xla_extension"

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be exported")

        def __dlpack_device__(self):
            return (2, 0)

    monkeypatch.setattr(_arrays.FOREIGN, "describe", lambda obj, name: pytest.fail("described an output"))
    monkeypatch.setattr(_arrays.JAX, "describe", lambda obj, name: _arrays.ArrayView(256, (1, 1, 8), (8, 8, 1), "float16", 2, 0)
                        if name not in ("output", "output_lse") else pytest.fail("described the output"))  # fmt: skip
    with pytest.raises(TypeError, match="^output: JAX arrays are immutable"):
        cm.merge_attn_states(FakeJax(), FakeJax(), FakeJax(), FakeJax(), FakeJax())


def _prepared(values):
    pointers = values.__array_interface__["data"][0] + _kernels._ARGUMENT_OFFSETS[: len(values)]
    return _kernels.PreparedLaunch(7, 1, (1, 1, 1), (32, 1, 1), 0, 0, pointers.__array_interface__["data"][0],
                                   values, (pointers, None))  # fmt: skip


def _arguments(params, count):
    import ctypes

    table = (ctypes.c_uint64 * count).from_address(params)
    return [ctypes.c_int64.from_address(address).value for address in table]


def test_fresh_output_pointers_are_patched_into_the_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(_kernels, "_current_context", lambda: 1)
    monkeypatch.setattr(_kernels, "_driver_launch", lambda *args: launched.append(_arguments(args[-2], 3)))
    prepared = _prepared(np.array([11, 22, 33], dtype=np.int64))
    _kernels.launch_patched(prepared, 5, [(0, 1000), (1, 2000)])
    assert launched == [[1000, 2000, 33]]
    copy = _kernels.with_pointers(prepared, [(2, 3000)])
    assert _arguments(copy.params, 3) == [1000, 2000, 3000]
    assert prepared.values.tolist() == [1000, 2000, 33]  # the copy has its own buffer


def test_a_launch_makes_the_kernels_context_current_when_another_or_none_is(monkeypatch):
    switched, launched = [], []
    monkeypatch.setattr(_kernels, "_driver_launch", lambda *args: launched.append(args))
    monkeypatch.setattr(_kernels.cupy.cuda.runtime, "setDevice", switched.append)
    monkeypatch.setattr(_kernels.cupy.cuda.runtime, "getDevice", lambda: 1)  # the caller's device
    prepared = _prepared(np.array([1], dtype=np.int64))._replace(context=42, device=3)
    monkeypatch.setattr(_kernels, "_current_context", lambda: 0)  # a fresh thread: no context
    _kernels.launch(prepared, 9)
    monkeypatch.setattr(_kernels, "_current_context", lambda: 42)
    _kernels.launch(prepared, 9)
    assert switched == [3, 1] and len(launched) == 2  # switched for the launch, then back
    assert launched[0] == (7, 1, 1, 1, 32, 1, 1, 0, 9, prepared.params, 0)
