"""Adapters between user arrays and the plain facts the kernels need: one per array kind.

Every supported kind (CuPy, torch, JAX, other ``__cuda_array_interface__`` or
DLPack producers) has one :class:`Adapter`: how to describe an array as an
:class:`ArrayView` (data pointer, shape, strides in elements, dtype name,
device), how to fingerprint it for the fast path, its current stream, how to
allocate an output for a stream, and how results go back to the caller.
Nothing else in the package looks at a user's array type. torch is never
imported here: a tensor is recognised only when the caller has loaded torch
(:func:`torch_module`, the one probe).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Protocol, TypeAlias

import cupy
import numpy

# DLPack device types (dlpack.h): the CUDA ones the kernels can read.
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


class DeviceArray(Protocol):
    """What the merges take and return: a CuPy array, a torch CUDA tensor, a JAX array, or any
    ``__cuda_array_interface__`` or DLPack producer of GPU memory (checked when called)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


#: A CUDA stream: ``None`` (the current one), a raw ``cudaStream_t`` as ``int``, a CuPy or
#: torch stream, or any object with ``__cuda_stream__``.
Stream: TypeAlias = Any


class ArrayView(NamedTuple):
    """What the checks and the planner know about one array; strides are in elements."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int


def torch_module() -> Any:
    """torch if the caller has imported it, else ``None`` (never imports it)."""
    return sys.modules.get("torch")


# dtype object -> name. numpy's dtype.name is computed in Python on every access (~4 us a call).
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES.setdefault(
            dtype, str(dtype).removeprefix("torch.") if _is_torch_dtype(dtype) else dtype.name
        )
    return name


def _is_torch_dtype(dtype: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(dtype, torch.dtype)


def cupy_dtype(name: str) -> Any:
    """The NumPy dtype CuPy uses for ``name``: bfloat16 comes from the ``ml_dtypes`` package;
    float8_e4m3fn too where CuPy takes it, else its bytes as uint8."""
    if name not in _ML_DTYPES:
        return numpy.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            f"out_dtype: a {name} CuPy array needs the ml_dtypes package (pip install ml_dtypes); "
            "or pass out= yourself, or use torch tensors"
        ) from None
    dtype = numpy.dtype(getattr(ml_dtypes, name))
    if name == "float8_e4m3fn" and not _cupy_takes(dtype):
        return numpy.dtype("uint8")
    return dtype


_ML_DTYPES = ("bfloat16", "float8_e4m3fn")
_cupy_dtypes: dict[Any, bool] = {}


def _cupy_takes(dtype: Any) -> bool:
    """Whether CuPy makes arrays of ``dtype`` (asked once)."""
    if dtype not in _cupy_dtypes:
        try:
            cupy.empty(0, dtype=dtype)
            _cupy_dtypes[dtype] = True
        except (TypeError, ValueError, NotImplementedError):
            _cupy_dtypes[dtype] = False
    return _cupy_dtypes[dtype]


def _describe_cupy(array: cupy.ndarray) -> ArrayView:
    itemsize = array.itemsize
    return ArrayView(
        array.data.ptr,
        array.shape,
        tuple(s // itemsize for s in array.strides),
        _dtype_name(array.dtype),
        itemsize,
        array.data.device_id,
    )


def _empty_cupy(shape: tuple[int, ...], dtype: str, device: int, stream: int | None) -> cupy.ndarray:
    with cupy.cuda.Device(device):
        if stream is None:
            return cupy.empty(shape, dtype=cupy_dtype(dtype))
        # CuPy's pool hands a block back only to allocations on the stream it was freed on.
        with cupy.cuda.Stream.from_external(_RawStream(stream)):
            return cupy.empty(shape, dtype=cupy_dtype(dtype))


class _RawStream:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (what ``Stream.from_external`` reads)."""

    def __init__(self, pointer: int):
        self._pointer = pointer

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._pointer)


class Adapter:
    """One array kind. ``writable``: whether merges may write into its arrays."""

    kind = "other"
    writable = True

    def describe(self, obj: Any, name: str) -> ArrayView:
        raise NotImplementedError

    def current_stream(self, device: int) -> int:
        return cupy.cuda.get_current_stream(device).ptr

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, stream: int | None) -> Any:
        """A new C-contiguous array; ``stream`` (a raw pointer) is the one that will write it first."""
        return _empty_cupy(shape, dtype, device, stream)

    def pointer(self, array: Any) -> int:
        """The device address of an array :meth:`empty` made."""
        return array.data.ptr

    def result(self, array: Any) -> Any:
        return array


class CupyAdapter(Adapter):
    kind = "cupy"

    def describe(self, obj: cupy.ndarray, name: str) -> ArrayView:
        return _describe_cupy(obj)


class ForeignAdapter(Adapter):
    """``__cuda_array_interface__`` and DLPack producers: read zero-copy through CuPy; results are CuPy."""

    kind = "other"

    def describe(self, obj: Any, name: str) -> ArrayView:
        return _describe_cupy(as_cupy(obj, name))


class JaxAdapter(ForeignAdapter):
    """JAX arrays are immutable and may share buffers: read, never written; results come back as JAX."""

    kind = "jax"
    writable = False

    def result(self, array: Any) -> Any:
        import jax.dlpack

        result = jax.dlpack.from_dlpack(array)
        if array.dtype == numpy.uint8:  # an FP8 output CuPy could only allocate as bytes
            import jax.numpy as jnp

            result = jax.lax.bitcast_convert_type(result, jnp.float8_e4m3fn)
        return result


class TorchAdapter(Adapter):
    kind = "torch"

    def __init__(self) -> None:
        self._devices: dict[int, Any] = {}

    def describe(self, obj: Any, name: str) -> ArrayView:
        if obj.device.type != "cuda":
            raise TypeError(
                f"{name}: expected a torch tensor on a CUDA device, got one on {obj.device}; move it with .cuda()"
            )
        if obj.is_neg() or obj.is_conj():
            raise TypeError(
                f"{name}: expected a tensor without torch's lazy negation or conjugation (a view such as "
                f"x.conj().imag); materialise it with .resolve_neg() / .resolve_conj()"
            )
        ptr = obj.data_ptr()
        if ptr == 0 and obj.numel() > 0:
            raise ValueError(
                f"{name}: expected a tensor with memory, got a null data pointer (freed storage?)"
            )
        return ArrayView(
            ptr, tuple(obj.shape), obj.stride(), _dtype_name(obj.dtype), obj.element_size(), obj.get_device()
        )

    def current_stream(self, device: int) -> int:
        torch = torch_module()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            # The public torch.cuda.current_stream() builds a Stream object: ~5 us.
            return raw(device)
        return torch.cuda.current_stream(device).cuda_stream

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, stream: int | None) -> Any:
        torch = torch_module()
        where = self._devices.get(device)
        if where is None:
            where = self._devices.setdefault(device, torch.device("cuda", device))
        if stream is None:
            return torch.empty(shape, dtype=getattr(torch, dtype), device=where)
        # torch's caching allocator hands a block back only to allocations on its stream.
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=where)):
            return torch.empty(shape, dtype=getattr(torch, dtype), device=where)

    def pointer(self, array: Any) -> int:
        return array.data_ptr()


CUPY = CupyAdapter()
TORCH = TorchAdapter()
JAX = JaxAdapter()
FOREIGN = ForeignAdapter()


def adapter_for(obj: Any, name: str) -> Adapter:
    """The adapter of ``obj``'s kind, or ``TypeError`` naming ``name`` (host arrays included)."""
    if isinstance(obj, cupy.ndarray):
        return CUPY
    torch = torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return TORCH
    if type(obj).__module__.startswith(("jax", "jaxlib")):
        return JAX
    if isinstance(obj, numpy.ndarray):
        raise TypeError(
            f"{name}: expected an array in GPU memory (CuPy array, torch CUDA tensor or "
            f"DLPack CUDA array), got a NumPy array in host memory; move it with cupy.asarray()"
        )
    if hasattr(obj, "__cuda_array_interface__") or (
        hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")
    ):
        return FOREIGN
    raise TypeError(
        f"{name}: expected a CuPy array, a torch CUDA tensor or a CUDA array exposing "
        f"__dlpack__ or __cuda_array_interface__, got {type(obj).__module__}.{type(obj).__name__}"
    )


def describe(obj: Any, name: str) -> ArrayView:
    """Reduce a user array to an :class:`ArrayView`, or raise naming ``name``."""
    return adapter_for(obj, name).describe(obj, name)


def as_cupy(obj: Any, name: str = "array") -> cupy.ndarray:
    """A zero-copy CuPy view of a device array from another producer."""
    if isinstance(obj, cupy.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return cupy.asarray(obj)
    device_type, _ = obj.__dlpack_device__()
    if int(device_type) not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        raise TypeError(
            f"{name}: expected an array in GPU memory, got a {type(obj).__name__} whose "
            f"DLPack device type is {int(device_type)} (1 is the CPU, 2 is CUDA)"
        )
    return cupy.from_dlpack(obj)


_torch_tensor: type | None = None


def fingerprints(arrays: tuple) -> tuple | None:
    """What identifies the arrays for planning, flat: pointer, shape, strides, dtype and device of
    each (and torch's negation bit), or ``None`` when one of them has no cheap fingerprint (JAX,
    DLPack, other producers). A missing optional array is a known value (``None``)."""
    global _torch_tensor
    parts: list = []
    for obj in arrays:
        cls = type(obj)
        if cls is _torch_tensor:
            parts += (obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.get_device(), obj.is_neg())
        elif cls is cupy.ndarray:
            data = obj.data
            parts += (data.ptr, obj.shape, obj.strides, obj.dtype, data.device_id)
        elif obj is None:
            parts.append(None)
        else:
            torch = torch_module()
            if _torch_tensor is None and torch is not None and cls is torch.Tensor:
                _torch_tensor = cls  # torch was imported after this module: learn its tensor type once
                return fingerprints(arrays)
            return None
    return tuple(parts)


def stream_pointer(stream: Any) -> int:
    """The raw ``cudaStream_t`` of a stream given by the caller.

    ``stream`` may be a CuPy or torch stream, an object with ``__cuda_stream__``
    (CUDA Python protocol), or a raw pointer as ``int``.
    """
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
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
        f"with __cuda_stream__, got {stream!r}"
    )


def to_numpy(array: Any) -> numpy.ndarray:
    """A host copy of a device array (synchronises with the stream that produced it)."""
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return cupy.asnumpy(as_cupy(array))
