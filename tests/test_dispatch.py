"""The one call sequence: what identifies a repeated call, what is cached, options checked first. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_merge as cm
from cupy_merge import _arrays, _dispatch, _launch, _options, _tuning
from cupy_merge._operands import TwoStateOperands, TwoStateOptions
from cupy_merge._ops import MERGE_STATE


def test_a_torch_tensor_is_fingerprinted_by_pointer_shape_strides_dtype_device_and_negation():
    torch = pytest.importorskip("torch")
    base = torch.zeros(4, 8, dtype=torch.float16)
    fingerprint = _arrays.fingerprints((base,))
    assert _arrays.fingerprints((base.view(4, 8),)) == fingerprint
    others = [base[1:], base.T, base.view(torch.bfloat16), base.reshape(8, 4), base.float(), base._neg_view()]
    for other in others:
        assert _arrays.fingerprints((other,)) != fingerprint
    # The device is known from the pointer (CUDA's unified addressing gives every device's memory
    # addresses of its own); whether autograd must see the call is part of it too.
    with_grad = base.view(4, 8).requires_grad_(True)
    assert _arrays.fingerprints((with_grad,)) != fingerprint
    assert fingerprint[0] == base.data_ptr()
    # Flat, so two arrays' parts can never be confused with one array's.
    assert _arrays.fingerprints((base, None)) != _arrays.fingerprints((None, base))
    # An nn.Parameter (learned sinks in a decode loop) takes the fast path as the tensor it is.
    parameter = torch.nn.Parameter(base)
    assert _arrays.fingerprints((parameter,)) == _arrays.fingerprints((base.view(4, 8).requires_grad_(True),))


def test_a_guarded_entry_serves_the_same_tensors_and_never_another_array_at_their_address(monkeypatch):
    # Torch calls are found by their pointers, then checked by torch's C++ guards: every change a
    # fingerprint tells apart must fail the check and be prepared as its own call.
    torch = pytest.importorskip("torch")
    if _arrays.torch_guards([torch.zeros(1)]) is None:
        pytest.skip("this torch has no TensorGuards")
    prepared = []

    def prepare(operation, options, operands, tuning):
        prepared.append(operands)
        return _dispatch.Call((), None, 0, (), None)

    monkeypatch.setattr(_dispatch, "_calls", {})
    monkeypatch.setattr(_dispatch, "prepare", prepare)
    monkeypatch.setattr(_dispatch, "run", lambda operation, call, operands, stream: call)
    base, v_b = torch.randn(2, 4, 8, dtype=torch.float16)
    s_a, s_b = torch.randn(2, 8, 4)

    def call(v):
        operands = TwoStateOperands(None, None, v, s_a, v_b, s_b)
        return _dispatch.call(MERGE_STATE, TwoStateOptions(), operands, None)

    first = call(base)
    assert call(base.view(4, 8)) is first and len(prepared) == 1  # the same array, another view object
    assert any(key[-1] is _dispatch.Guarded for key in _dispatch._calls)
    monkeypatch.setattr(_arrays, "fingerprints", lambda operands: pytest.fail("the guarded entry was missed"))
    assert call(base) is first
    monkeypatch.undo()
    monkeypatch.setattr(_dispatch, "prepare", prepare)
    monkeypatch.setattr(_dispatch, "run", lambda operation, call, operands, stream: call)
    monkeypatch.setattr(_dispatch, "_calls", {})
    first = call(base)
    others = {
        "a slice": base[:2],
        "transposed": base.T,
        "another dtype": base.view(torch.bfloat16),
        "reshaped": base.reshape(8, 4),
        "negated": base._neg_view(),
        "requiring grad": base.view(4, 8).requires_grad_(True),
    }
    for what, other in others.items():
        assert other.data_ptr() == base.data_ptr()
        count = len(prepared)
        assert call(other) is not first, what
        assert len(prepared) == count + 1 and prepared[-1].v_a is other, what
        assert call(base) is first, what  # and the first is still found, by its fingerprint
    with torch.inference_mode():  # another dispatch state fails the guards: the fingerprint path
        assert call(base) is first
    # One buffer's slices of two lengths share their addresses: each keeps a guarded entry.
    monkeypatch.setattr(_dispatch, "_calls", {})
    first, short = call(base), call(base[:2])
    monkeypatch.setattr(_arrays, "fingerprints", lambda operands: pytest.fail("a guarded entry was missed"))
    for _ in range(3):
        assert call(base) is first and call(base[:2]) is short


def test_torchs_tensor_guards_are_used_only_while_they_behave_as_relied_on(monkeypatch):
    torch = pytest.importorskip("torch")
    guards = pytest.importorskip("torch._C._dynamo.guards")
    assert _arrays._checked_tensor_guards() is guards.TensorGuards

    class Lenient:  # a TensorGuards that stopped checking shapes
        def __init__(self, *tensors, **kwargs):
            pass

        def check(self, *tensors):
            return True

    monkeypatch.setattr(guards, "TensorGuards", Lenient)
    assert _arrays._checked_tensor_guards() is False
    monkeypatch.setattr(_arrays, "_TENSOR_GUARDS", None)
    assert _arrays.torch_guards([torch.zeros(1)]) is None


def test_no_guards_are_made_for_one_tensor_passed_twice():
    # torch's guards fail a call with a tensor twice: such calls keep the fingerprint path.
    torch = pytest.importorskip("torch")
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    _arrays.fingerprints((a,))  # the tensor types are learned by the first fingerprint
    addresses, tensors = _arrays.torch_addresses((a, None, a, b))
    assert addresses == (a.data_ptr(), None, a.data_ptr(), b.data_ptr()) and tensors == [a, a, b]
    assert _arrays.torch_guards(tensors) is None
    guards = _arrays.torch_guards([a, a.view(4, 8), b])
    if guards is not None:
        assert guards.check(a, a.view(4, 8), b)
        assert not guards.check(a, a, b)
    assert _arrays.torch_addresses((a, np.zeros(3))) is None  # any other kind: the fingerprint path


def test_a_guarded_entry_keeps_no_tensor_alive():
    # Entries live in the call cache: holding a caller's tensor would keep its memory allocated.
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    tensor = torch.zeros(256, 256)
    if _arrays.torch_guards([tensor]) is None:
        pytest.skip("this torch has no TensorGuards")
    alive = weakref.ref(tensor)
    guards = _arrays.torch_guards([tensor])
    del tensor
    gc.collect()
    assert guards is not None and alive() is None


def test_a_fresh_torch_output_is_allocated_from_an_input_of_its_dtype_never_from_an_output():
    def view(dtype):
        return _arrays.ArrayView(4096, (2, 3), (3, 1), dtype, 4, 0)

    torch = pytest.importorskip("torch")

    class Tagged(torch.Tensor):  # a subclass: an output made from it would come back Tagged
        pass

    views = {"out": view("bfloat16"), "out_lse": view("float32"), "v_a": view("bfloat16"), "s_a": view("float32"),
             "v_b": view("bfloat16"), "s_b": view("float32")}  # fmt: skip
    operands = TwoStateOperands(None, None, torch.ones(1).as_subclass(Tagged), np.ones(1), torch.ones(1), torch.ones(1))
    _arrays.fingerprints((torch.ones(1),))  # the tensor types are learned by the first fingerprint
    assert _dispatch._input_like(_dispatch.FreshOutput("out", (2, 3), "bfloat16"), views, operands) == "v_b"
    assert _dispatch._input_like(_dispatch.FreshOutput("out_lse", (3, 2), "float32"), views, operands) == "s_b"
    assert _dispatch._input_like(_dispatch.FreshOutput("out", (2, 3), "float8_e4m3fn"), views, operands) is None
    like = torch.ones(4, dtype=torch.bfloat16)
    made = _arrays.TORCH.empty_as(like, (2, 3), zero=True)
    assert made.dtype == like.dtype and made.device == like.device and made.shape == (2, 3)
    assert made.is_contiguous() and not made.requires_grad and bool((made == 0).all())


def test_arrays_without_a_fingerprint_make_the_call_uncacheable():
    class Producer:  # e.g. a DLPack-only array
        pass

    assert _arrays.fingerprints((Producer(),)) is None
    assert _arrays.fingerprints((None, None)) == (None, None)  # a missing optional argument is a known value


def test_the_call_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "_MAX_CALLS", 3)
    monkeypatch.setattr(_dispatch, "_calls", {})
    monkeypatch.setattr(_dispatch, "prepare", lambda *args: _dispatch.Call((), None, 0, (), None))
    monkeypatch.setattr(_dispatch, "run", lambda *args: None)
    monkeypatch.setattr(_arrays, "fingerprints", lambda arrays: arrays)
    operation = _dispatch.Operation(
        "f",
        TwoStateOperands(*TwoStateOperands._fields),
        _options.two_state_options,
        allocates=False,
        returns=False,
    )
    for key in range(5):
        _dispatch.call(
            operation, TwoStateOptions(), TwoStateOperands(None, None, key, None, None, None), None
        )
    assert 1 <= len(_dispatch._calls) <= 3


def test_calls_of_different_functions_never_share_a_cached_launch(monkeypatch):
    # merge_state_in_place(v, s, v_other, s_other, mask) and
    # merge_states_varlen(v_other, s_other, mask, out=v, out_lse=s) name the same five arrays.
    torch = pytest.importorskip("torch")
    keys = []
    real_call = _dispatch.call

    def spy(operation, options, operands, stream):
        keys.append((operation, options, _arrays.fingerprints(operands)))  # what the call cache is keyed by
        return real_call(operation, options, operands, stream)

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
    assert _options.token_count(np.int64(7)) == 7
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="^prefill_tokens_with_context: expected None or an int, got Tensor"):
        _options.token_count(torch.tensor(3))


def test_check_indptr_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(_dispatch, "call", lambda *args: pytest.fail("reached the dispatcher"))
    with pytest.raises(TypeError, match="^check_indptr: expected True or False"):
        cm.merge_states_varlen(None, None, None, check_indptr="no")


IMMUTABLE = r"^output: JAX arrays are immutable"
READ_ONLY = r"^output: a read-only array cannot be written; leave it out"


def test_a_jax_output_is_refused_as_immutable(monkeypatch):
    class FakeJax:
        __module__ = "jaxlib.xla_extension"

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be exported")

        def __dlpack_device__(self):
            return (2, 0)

    # The dispatcher's own rule (cupy_merge.jax, once imported, takes JAX calls before it and says the same).
    monkeypatch.setattr(_dispatch, "_jax_call", None)
    monkeypatch.setattr(_arrays.FOREIGN, "describe", lambda obj, name: pytest.fail("described an output"))
    monkeypatch.setattr(_arrays.JAX, "describe", lambda obj, name: _arrays.ArrayView(256, (1, 1, 8), (8, 8, 1), "float16", 2, 0)
                        if name not in ("output", "output_lse") else pytest.fail("described the output"))  # fmt: skip
    with pytest.raises(TypeError, match=IMMUTABLE):
        cm.merge_attn_states(FakeJax(), FakeJax(), FakeJax(), FakeJax(), FakeJax())


class _Interface:
    """A ``__cuda_array_interface__`` producer, read-only or not."""

    def __init__(self, read_only):
        self.read_only = read_only

    @property
    def __cuda_array_interface__(self):
        return {"shape": (1, 1, 8), "typestr": "<f2", "data": (256, self.read_only), "version": 3}


def test_a_read_only_cuda_array_interface_output_is_refused(monkeypatch):
    read_only, writable = _Interface(True), _Interface(False)
    assert not _arrays.FOREIGN.writable(read_only) and _arrays.FOREIGN.writable(writable)
    assert not _arrays.JAX.writable(object()) and _arrays.CUPY.writable(object())
    view = _arrays.ArrayView(256, (1, 1, 8), (8, 8, 1), "float16", 2, 0)
    monkeypatch.setattr(_arrays.FOREIGN, "describe",
                        lambda obj, name: view if name != "output" else pytest.fail("described the output"))  # fmt: skip
    with pytest.raises(TypeError, match=READ_ONLY):
        cm.merge_attn_states(read_only, writable, writable, writable, writable)


def _prepared(values):
    pointers = values.__array_interface__["data"][0] + _launch._ARGUMENT_OFFSETS[: len(values)]
    return _launch.PreparedLaunch(7, 1, (1, 1, 1), (32, 1, 1), 0, 0, pointers.__array_interface__["data"][0],
                                   values, None, (pointers, None))  # fmt: skip


def _arguments(params, count):
    import ctypes

    table = (ctypes.c_uint64 * count).from_address(params)
    return [ctypes.c_int64.from_address(address).value for address in table]


def test_fresh_output_pointers_are_patched_into_the_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(_launch, "_current_context", lambda: 1)
    monkeypatch.setattr(_launch, "_driver_launch", lambda *args: launched.append(_arguments(args[-2], 3)))
    prepared = _prepared(np.array([11, 22, 33], dtype=np.int64))
    _launch.launch_patched(prepared, 5, [(0, 1000), (1, 2000)])
    assert launched == [[1000, 2000, 33]]
    copy = _launch.with_pointers(prepared, [(2, 3000)])
    assert _arguments(copy.params, 3) == [1000, 2000, 3000]
    assert prepared.values.tolist() == [1000, 2000, 33]  # the copy has its own buffer


def test_a_launch_makes_the_kernels_context_current_when_another_or_none_is(monkeypatch):
    switched, launched = [], []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *args: launched.append(args))
    monkeypatch.setattr(_launch.cupy.cuda.runtime, "setDevice", switched.append)
    monkeypatch.setattr(_launch.cupy.cuda.runtime, "getDevice", lambda: 1)  # the caller's device
    prepared = _prepared(np.array([1], dtype=np.int64))._replace(context=42, device=3)
    monkeypatch.setattr(_launch, "_current_context", lambda: 0)  # a fresh thread: no context
    _launch.launch(prepared, 9)
    monkeypatch.setattr(_launch, "_current_context", lambda: 42)
    _launch.launch(prepared, 9)
    assert switched == [3, 1] and len(launched) == 2  # switched for the launch, then back
    assert launched[0] == (7, 1, 1, 1, 32, 1, 1, 0, 9, prepared.params, 0)


class _ViewAdapter(_arrays.Adapter):
    """Arrays that are their own ArrayViews; the outputs it allocates are fake addresses."""

    kind = "views"

    def __init__(self):
        self.allocated = []

    def describe(self, obj, name):
        return obj

    def current_stream(self, device):
        return 0

    def empty(self, shape, dtype, device, stream, zero=False):
        array = ("fresh", len(self.allocated), shape, dtype)
        self.allocated.append(array)
        return array

    def pointer(self, array):
        return (20 + array[1]) << 32


def test_fresh_outputs_are_allocated_on_every_run_and_patched_into_their_slots(monkeypatch):
    from views import view

    adapter = _ViewAdapter()
    monkeypatch.setattr(_arrays, "adapter_for", lambda obj, name: adapter)
    monkeypatch.setattr(
        _launch, "get_function", lambda module, kernel, device: _launch.Function(1234, 77, None)
    )
    monkeypatch.setattr(_launch, "_current_context", lambda: 77)
    launched = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *args: launched.append(args))
    v_a, v_b = view((5, 3, 16), ptr=1 << 32), view((5, 3, 16), ptr=2 << 32)
    s_a, s_b = view((3, 5), "float32", ptr=3 << 32), view((3, 5), "float32", ptr=4 << 32)
    operands = TwoStateOperands(None, None, v_a, s_a, v_b, s_b)
    plain = _tuning.DEFAULT.replace(programmatic_launch=False)  # launched through cuLaunchKernel
    call = _dispatch.prepare(MERGE_STATE, TwoStateOptions(), operands, plain)
    (plan,) = _dispatch.plan_for(MERGE_STATE, TwoStateOptions(), _tuning.DEFAULT, operands).plan
    (out_slot,), (lse_slot,) = plan.slots("out"), plan.slots("out_lse")
    assert [(output.field, slots) for output, slots in call.fresh] == [
        ("out", ((0, out_slot, 0),)),
        ("out_lse", ((0, lse_slot, 0),)),
    ]
    (prepared,) = call.launches
    assert prepared.values[out_slot] == prepared.values[lse_slot] == 0  # no output yet: allocated per run
    for field, operand in (("v_a", v_a), ("lse_a", s_a), ("v_b", v_b), ("lse_b", s_b)):
        assert (
            prepared.values[plan.slots({"lse_a": "s_a", "lse_b": "s_b"}.get(field, field))[0]] == operand.ptr
        )
    for run in range(2):
        out, out_lse = _dispatch.run(MERGE_STATE, call, operands, None)
        assert [out, out_lse] == adapter.allocated[-2:] and out[2:] == ((5, 3, 16), "float16")
        arguments = _arguments(launched[-1][-2], len(prepared.values))
        assert arguments[out_slot] == adapter.pointer(out) and arguments[lse_slot] == adapter.pointer(out_lse)
        assert arguments[plan.slots("v_a")[0]] == v_a.ptr
    assert len(adapter.allocated) == 4 and len(launched) == 2  # new outputs every run


@pytest.mark.parametrize("itemsize", [2, 4])
def test_a_view_of_negative_strides_overlaps_the_bytes_below_its_address(itemsize):
    """A CuPy view such as buf[::-1] starts at its highest element and reaches down: its bytes are
    [ptr - 3 * itemsize, ptr + itemsize) for 4 elements, and an output there partly overlaps it."""
    from cupy_merge import _addresses
    from cupy_merge._arrays import ArrayView

    top = 1 << 32
    reversed_view = ArrayView(top, (4,), (-1,), "float32" if itemsize == 4 else "float16", itemsize, 0)
    for ptr, overlapping in ((top - 3 * itemsize, True), (top - itemsize, True), (top - 4 * itemsize, False),
                             (top + itemsize, False)):  # fmt: skip
        other = ArrayView(ptr, (1,), (1,), reversed_view.dtype, itemsize, 0)
        assert _addresses.overlaps(reversed_view, other) == overlapping, (ptr - top) // itemsize
        assert _addresses.overlaps(other, reversed_view) == overlapping


@pytest.mark.parametrize(
    "shape, strides, refused",
    [((3, 2, 2), (8, 4, 2), True), ((3, 2, 8), (32, 16, 2), True), ((3, 2, 1), (4, 2, 2), False),
     ((0, 2, 4), (0, 0, 0), False), ((3, 2, 4), (8, 4, 1), False)],
)  # fmt: skip
def test_a_strided_last_dimension_is_refused_from_two_elements(shape, strides, refused):
    """A row of values is read as contiguous packs: its elements must be adjacent wherever a row has
    two or more (a row of one, or an empty array, has no such constraint)."""
    from cupy_merge import _array_rules
    from cupy_merge._arrays import ArraySpec

    spec = ArraySpec(shape, strides, "float16", 2, 0)
    if refused:
        with pytest.raises(ValueError, match=r"^v_a: expected the last dimension \(head_size\) to be contiguous"):
            _array_rules.expect_unit_last_stride(spec, "v_a")
    else:
        _array_rules.expect_unit_last_stride(spec, "v_a")
