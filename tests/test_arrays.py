"""Host arrays and unknown objects are refused, by name, before anything runs (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_merge as cm
from cupy_merge import _arrays


def test_numpy_values_are_refused_naming_the_argument():
    v = np.ones((2, 3, 8), dtype=np.float16)
    s = np.zeros((3, 2), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^v_a: expected an array in GPU memory.*NumPy"):
        cm.merge_state(v, s, v, s)
    with pytest.raises(TypeError, match=r"^prefix_output: expected an array in GPU memory"):
        cm.merge_attn_states(v, v, s, v, s)


@pytest.mark.parametrize("name", ["s_a", "out_lse", "suffix_output"])
def test_host_arrays_are_refused_under_any_argument_name(name):
    with pytest.raises(TypeError, match=rf"^{name}: expected"):
        _arrays.describe(np.zeros((2, 2), dtype=np.float32), name)


def test_cpu_torch_tensors_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^s_b: expected a torch tensor on a CUDA device, got one on cpu"):
        _arrays.describe(torch.zeros(3, 2), "s_b")
    v = torch.zeros(2, 3, 8)
    with pytest.raises(TypeError, match=r"^v_a: expected a torch tensor on a CUDA device"):
        cm.merge_state(v, torch.zeros(3, 2), v, torch.zeros(3, 2))


class _HostDLPack:
    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported")

    def __dlpack_device__(self):
        return (1, 0)


def test_cpu_dlpack_producers_are_refused_without_export():
    with pytest.raises(TypeError, match=r"^v_b: expected an array in GPU memory.*DLPack device type is 1"):
        _arrays.describe(_HostDLPack(), "v_b")


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, "array", None])
def test_non_arrays_are_refused(value):
    with pytest.raises(TypeError, match=r"^out: expected a CuPy array, a torch CUDA tensor"):
        _arrays.describe(value, "out")


@pytest.mark.parametrize("stream", [1.5, "default", object(), -1, True])
def test_unusable_stream_is_refused(stream):
    with pytest.raises(TypeError, match=r"^stream: expected"):
        _arrays.stream_pointer(stream)


def test_streams_are_read_from_every_protocol():
    class CupyLike:
        ptr = 11

    class TorchLike:
        cuda_stream = 12

    class CudaPython:
        def __cuda_stream__(self):
            return (0, 13)

    assert _arrays.stream_pointer(10) == 10
    assert _arrays.stream_pointer(CupyLike()) == 11
    assert _arrays.stream_pointer(TorchLike()) == 12
    assert _arrays.stream_pointer(CudaPython()) == 13


def test_torch_negated_views_are_refused_naming_the_argument():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.Tensor, "is_neg"):
        pytest.skip("this torch has no negative bit")

    class CudaLooking:  # describe() asks the device first; pretend this tensor is on a GPU
        type = "cuda"

    tensor = torch.zeros(3, 2, dtype=torch.complex64).conj().imag
    adapter = _arrays.TorchAdapter()
    with pytest.raises(TypeError, match=r"^s_a: expected a tensor without torch's lazy negation"):
        adapter.describe(_Proxy(tensor, CudaLooking()), "s_a")


class _Proxy:
    """A tensor that reports another device; everything else is the tensor's."""

    def __init__(self, tensor, device):
        self._tensor, self.device = tensor, device

    def __getattr__(self, name):
        return getattr(self._tensor, name)


def test_tensors_on_other_accelerators_are_refused():
    torch = pytest.importorskip("torch")

    class Xpu:
        type = "xpu"

        def __str__(self):
            return "xpu:0"

    with pytest.raises(TypeError, match=r"^v_a: expected a torch tensor on a CUDA device, got one on xpu:0"):
        _arrays.TorchAdapter().describe(_Proxy(torch.zeros(2), Xpu()), "v_a")


@pytest.mark.parametrize(
    "ptr, align",
    [(0, 16), (1, 1), (2, 2), (6, 2), (12, 4), (8, 8), (24, 8), (16, 16), (48, 16), (1 << 40, 16)],
)
def test_a_views_spec_keeps_its_facts_and_only_the_alignment_class_of_its_address(ptr, align):
    view = _arrays.ArrayView(ptr, (2, 3, 8), (24, 8, 1), "float16", 2, 1)
    spec = view.spec
    assert spec == _arrays.ArraySpec((2, 3, 8), (24, 8, 1), "float16", 2, 1, align)
    assert _arrays.alignment(ptr) == align  # 0 is an address not yet known: fresh outputs are aligned
    assert view._replace(ptr=ptr + 1024).spec == spec  # another address of the same class


def test_a_fresh_output_is_specified_c_contiguous_and_fully_aligned():
    spec = _arrays.contiguous_spec((4, 3, 8), "bfloat16", 2, 0)
    assert spec == _arrays.ArraySpec((4, 3, 8), (24, 8, 1), "bfloat16", 2, 0, 16)
    assert _arrays.contiguous_spec((5, 3), "float32", 4, 1).strides == (3, 1)


def test_a_tensor_inside_torch_func_is_refused_by_name():
    torch = pytest.importorskip("torch")

    def loss(x):
        _arrays.TORCH.describe(x, "v", host=True)
        return x.sum()

    with pytest.raises(TypeError, match=r"^v: a tensor inside a torch.func transform .* not torch.func"):
        torch.func.grad(loss)(torch.randn(3))
    assert _arrays.TORCH.describe(torch.randn(3), "v", host=True).shape == (3,)  # a plain tensor is described
