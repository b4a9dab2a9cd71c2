"""Adapters between user arrays and the plain facts the kernels need.

Every supported array kind (CuPy, torch, objects exposing
``__cuda_array_interface__``, DLPack producers such as JAX) is reduced to an
:class:`ArrayView`: data pointer, shape, strides in elements, dtype name and
device. Nothing else in the package looks at the user's array type, and torch
is never imported here: a tensor is recognised only when torch is already
loaded by the caller.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import cupy
import numpy

# DLPack device types (dlpack.h): the CUDA ones the kernels can read.
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


class ArrayView(NamedTuple):
    """What the planner knows about one array; strides are in elements."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int


# dtype object -> name. numpy's dtype.name is computed in Python on every access (~4 us a call).
_DTYPE_NAMES: dict[Any, str] = {}


def _torch():
    return sys.modules.get("torch")


def array_kind(obj: Any) -> str:
    """``"cupy"``, ``"torch"``, ``"jax"`` or ``"other"``: the kind results are returned in."""
    if isinstance(obj, cupy.ndarray):
        return "cupy"
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return "torch"
    if type(obj).__module__.startswith(("jax", "jaxlib")):
        return "jax"
    return "other"


def describe(obj: Any, name: str) -> ArrayView:
    """Reduce a user array to an :class:`ArrayView`, or raise ``TypeError`` naming ``name``.

    Host arrays (NumPy, CPU tensors, CPU DLPack) are rejected: the merge reads
    device memory only and never copies.
    """
    if isinstance(obj, cupy.ndarray):
        return _describe_cupy(obj)
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _describe_torch(obj, name)
    if isinstance(obj, numpy.ndarray):
        raise TypeError(
            f"{name}: expected an array in GPU memory (CuPy array, torch CUDA tensor or "
            f"DLPack CUDA array), got a NumPy array in host memory; move it with cupy.asarray()"
        )
    if hasattr(obj, "__cuda_array_interface__"):
        return _describe_cupy(cupy.asarray(obj))
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        device_type, _ = obj.__dlpack_device__()
        if int(device_type) not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            raise TypeError(
                f"{name}: expected an array in GPU memory, got a {type(obj).__name__} whose "
                f"DLPack device type is {int(device_type)} (1 is the CPU, 2 is CUDA)"
            )
        return _describe_cupy(from_dlpack(obj))
    raise TypeError(
        f"{name}: expected a CuPy array, a torch CUDA tensor or a CUDA array exposing "
        f"__dlpack__ or __cuda_array_interface__, got {type(obj).__module__}.{type(obj).__name__}"
    )


def from_dlpack(obj: Any) -> cupy.ndarray:
    """A zero-copy CuPy view of a DLPack producer's device array."""
    return cupy.from_dlpack(obj)


def _describe_cupy(a: cupy.ndarray) -> ArrayView:
    itemsize = a.itemsize
    dtype = a.dtype
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES.setdefault(dtype, dtype.name)
    return ArrayView(
        a.data.ptr,
        a.shape,
        tuple(s // itemsize for s in a.strides),
        dtype_name,
        itemsize,
        a.device.id,
    )


def _describe_torch(t: Any, name: str) -> ArrayView:
    device = t.get_device()
    if device < 0:
        raise TypeError(
            f"{name}: expected a torch tensor on a CUDA device, got one on {t.device}; move it with .cuda()"
        )
    dtype = t.dtype
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES.setdefault(dtype, str(dtype).removeprefix("torch."))
    return ArrayView(t.data_ptr(), tuple(t.shape), t.stride(), dtype_name, t.element_size(), device)


def stream_pointer(stream: Any, kind: str, device: int) -> int:
    """The raw ``cudaStream_t`` to launch on.

    ``stream`` may be ``None`` (the caller's current stream: torch's for torch
    tensors, CuPy's otherwise), a CuPy or torch stream, an object with
    ``__cuda_stream__`` (CUDA Python protocol), or a raw pointer as ``int``.
    """
    if stream is None:
        return current_stream_getter(kind)(device)
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    raise TypeError(
        f"stream: expected None, an int cudaStream_t, a CuPy or torch stream, or an object "
        f"with __cuda_stream__, got {type(stream).__name__}"
    )


def current_stream_getter(kind: str):
    """``device -> cudaStream_t`` of the current stream, as ``stream_pointer(None, kind, device)``."""
    if kind == "torch":
        return _torch_current_stream
    return _cupy_current_stream


def _cupy_current_stream(device: int) -> int:
    return cupy.cuda.get_current_stream(device).ptr


def _torch_current_stream(device: int) -> int:
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        # The public torch.cuda.current_stream() builds a Stream object: ~5 us.
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def empty_values(
    like: Any, kind: str, shape: tuple[int, ...], dtype: str, device: int
) -> tuple[Any, ArrayView]:
    """A new C-contiguous value array of dtype name ``dtype`` on ``device``, in the caller's kind."""
    out = empty(like, kind, shape, dtype, device)
    return out, _describe_torch(out, "out") if kind == "torch" else _describe_cupy(out)


def empty(like: Any, kind: str, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    """A new C-contiguous array on ``device``: a torch tensor for torch callers, else CuPy."""
    if kind == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=cupy_dtype(dtype))


def data_pointer(array: Any) -> int:
    """The device address of an array made by :func:`empty`."""
    return array.data_ptr() if hasattr(array, "data_ptr") else array.data.ptr


def cupy_dtype(name: str) -> Any:
    """The NumPy dtype CuPy uses for ``name``; bfloat16 comes from the ``ml_dtypes`` package."""
    if name != "bfloat16":
        return numpy.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            "out_dtype: a bfloat16 CuPy array needs the ml_dtypes package (pip install ml_dtypes); "
            "or pass out= yourself, or use torch tensors"
        ) from None
    return numpy.dtype(ml_dtypes.bfloat16)


def empty_lse(original: Any, kind: str, shape: tuple[int, int], device: int) -> tuple[Any, ArrayView]:
    """A new C-contiguous float32 LSE array ``[num_heads, num_tokens]`` in the caller's kind."""
    out = empty(original, kind, shape, "float32", device)
    return out, _describe_torch(out, "out_lse") if kind == "torch" else _describe_cupy(out)


def to_numpy(array: Any) -> numpy.ndarray:
    """A host copy of a device array (synchronises with the stream that produced it)."""
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    if not isinstance(array, cupy.ndarray):
        array = cupy.asarray(array) if hasattr(array, "__cuda_array_interface__") else from_dlpack(array)
    return cupy.asnumpy(array)


def to_caller_kind(array: Any, kind: str) -> Any:
    """Hand a result back as the caller's kind: JAX in, JAX out; other producers get CuPy."""
    if kind == "jax":
        import jax.dlpack

        return jax.dlpack.from_dlpack(array)
    return array
