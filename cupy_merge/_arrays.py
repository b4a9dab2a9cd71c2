"""Adapters between user arrays and the plain facts the kernels need: one per array kind.

Every supported kind (CuPy, torch, JAX, other ``__cuda_array_interface__`` or
DLPack producers) has one :class:`Adapter`: how to describe an array as an
:class:`ArrayView` (address, shape, strides in elements, dtype name, device),
whether it may be written, how to fingerprint it for the fast path, its
current stream, how to allocate an output for a stream, and how results go
back to the caller. Nothing else in the package looks at a user's array type.
torch is never imported here: a tensor is recognised only when the caller has
loaded torch (:func:`torch_module`, the one probe).

An :class:`ArraySpec` is a view without its address: what planning needs
(alignment is a class, not an address), so plans can be made from torch fake
tensors or JAX abstract values, and cached for every caller.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, NamedTuple

import cupy
import numpy

from .types import DeviceArray, Stream  # noqa: F401 - the names this module's callers annotate with

# DLPack device types (dlpack.h): the CUDA ones the kernels can read.
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13
#: Host arrays (CPU torch tensors, for gloo's cross-rank merges) are described on this device.
HOST = -1
#: The widest access any kernel makes: alignment classes stop here.
MAX_ALIGN = 16


def alignment(ptr: int) -> int:
    """The alignment class of an address: the largest power of two up to 16 dividing it (16 for
    an address not yet known: fresh outputs and traced arrays, which the allocators align)."""
    return MAX_ALIGN if ptr == 0 else min(MAX_ALIGN, ptr & -ptr)


class ArraySpec(NamedTuple):
    """What the checks and the planner know about one array: no address, only its alignment class."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    itemsize: int
    device: int
    align: int = MAX_ALIGN


class ArrayView(NamedTuple):
    """An array as the address rules see it: its address and its :class:`ArraySpec`'s facts."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    itemsize: int
    device: int

    @property
    def spec(self) -> ArraySpec:
        return ArraySpec(self.shape, self.strides, self.dtype, self.itemsize, self.device, alignment(self.ptr))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def contiguous_spec(shape: tuple[int, ...], dtype: str, itemsize: int, device: int) -> ArraySpec:
    """A C-contiguous array not yet allocated (an output the merge allocates, a traced array)."""
    return ArraySpec(tuple(shape), contiguous_strides(shape), dtype, itemsize, device)


def torch_module() -> Any:
    """torch if the caller has imported it, else ``None`` (never imports it)."""
    return sys.modules.get("torch")


# dtype object -> name. numpy's dtype.name is computed in Python on every access (~4 us a call).
_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``"float16"``, ``"bfloat16"``, ... for a NumPy, ml_dtypes or torch dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    if _is_torch_dtype(dtype):
        # Not cached: Dynamo traces this (the drop-ins under torch.compile), and a write into a
        # dict it guards on fails the compilation.
        return str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.setdefault(dtype, numpy.dtype(dtype).name)


def _is_torch_dtype(dtype: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(dtype, torch.dtype)


def cupy_dtype(name: str) -> Any:
    """The NumPy dtype CuPy uses for ``name``: bfloat16 comes from the ``ml_dtypes`` package;
    float8_e4m3fn too where CuPy takes it, else its bytes as uint8; NVFP4 as its bytes."""
    if name == "float4_e2m1fn_x2":
        return numpy.dtype("uint8")
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


def _describe_cupy(array: cupy.ndarray, name: str) -> ArrayView:
    itemsize = array.itemsize
    strides = array.strides
    if any(stride % itemsize for stride in strides):
        raise ValueError(
            f"{name}: expected strides that are whole elements ({itemsize} bytes), got byte strides "
            f"{strides}; copy it into a fresh array"
        )
    return ArrayView(
        array.data.ptr,
        array.shape,
        tuple(stride // itemsize for stride in strides),
        dtype_name(array.dtype),
        itemsize,
        array.data.device_id,
    )


def _empty_cupy(shape: tuple[int, ...], dtype: str, device: int, stream: int | None, zero: bool) -> cupy.ndarray:
    make = cupy.zeros if zero else cupy.empty
    with cupy.cuda.Device(device):
        if stream is None:
            return make(shape, dtype=cupy_dtype(dtype))
        # CuPy's pool hands a block back only to allocations on the stream it was freed on.
        with cupy.cuda.Stream.from_external(_RawStream(stream)):
            return make(shape, dtype=cupy_dtype(dtype))


class _RawStream:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (what ``Stream.from_external`` reads)."""

    def __init__(self, pointer: int):
        self._pointer = pointer

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._pointer)


class Adapter:
    """One array kind."""

    kind = "other"

    def describe(self, obj: Any, name: str) -> ArrayView:
        raise NotImplementedError

    def writable(self, obj: Any) -> bool:
        """Whether a merge may write into ``obj``."""
        return True

    def current_stream(self, device: int) -> int:
        return cupy.cuda.get_current_stream(device).ptr

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, stream: int | None, zero: bool = False) -> Any:
        """A new C-contiguous array (``zero``: of zeros, filled on ``stream``); ``stream`` (a raw
        pointer, None: the current one) is the one that will write it first."""
        return _empty_cupy(shape, dtype, device, stream, zero)

    def pointer(self, array: Any) -> int:
        """The device address of an array :meth:`empty` made."""
        return array.data.ptr

    def result(self, array: Any) -> Any:
        return array

    def view(self, buffer: Any, dtype: str, shape: tuple, strides: tuple, byte_offset: int) -> Any:
        """A strided view (strides in elements of ``dtype``) into a contiguous byte ``buffer`` :meth:`empty` made."""
        dtype_object = cupy_dtype(dtype)
        return cupy.ndarray(
            shape, dtype_object, memptr=buffer.data + byte_offset,
            strides=tuple(stride * dtype_object.itemsize for stride in strides),
        )  # fmt: skip

    def copy(self, destination: Any, source: Any) -> None:
        """``destination[...] = source`` on the current stream (shapes and dtypes already checked)."""
        destination[...] = source

    def scope(self, stream: int | None, device: int) -> Any:
        """A context in which ``stream`` (None: the current one) is this kind's current stream."""
        if stream is None:
            return contextlib.nullcontext()
        return cupy.cuda.Stream.from_external(_RawStream(stream))


class CupyAdapter(Adapter):
    kind = "cupy"

    def describe(self, obj: cupy.ndarray, name: str) -> ArrayView:
        return _describe_cupy(obj, name)


class ForeignAdapter(Adapter):
    """``__cuda_array_interface__`` and DLPack producers: read zero-copy through CuPy; results are CuPy."""

    kind = "other"

    def describe(self, obj: Any, name: str) -> ArrayView:
        return _describe_cupy(as_cupy(obj, name), name)

    def writable(self, obj: Any) -> bool:
        interface = getattr(obj, "__cuda_array_interface__", None)
        return interface is None or not interface["data"][1]  # (pointer, read_only)


class JaxAdapter(ForeignAdapter):
    """JAX arrays are immutable and may share buffers: read, never written; results come back as JAX.
    Merges of JAX arrays run through :mod:`cupy_merge.jax` (eager calls too: its jitted path)."""

    kind = "jax"

    def writable(self, obj: Any) -> bool:
        return False

    def result(self, array: Any) -> Any:
        import jax.dlpack

        result = jax.dlpack.from_dlpack(array)
        if array.dtype == numpy.uint8:  # an FP8 output CuPy could only allocate as bytes
            import jax.numpy as jnp

            result = jax.lax.bitcast_convert_type(result, jnp.float8_e4m3fn)
        return result


def _inside_torch_func(tensor: Any) -> bool:
    """Whether ``tensor`` is a torch.func transform's wrapper (no storage of its own)."""
    functorch = getattr(torch_module()._C, "_functorch", None)
    return functorch is not None and bool(functorch.is_functorch_wrapped_tensor(tensor))


class TorchAdapter(Adapter):
    kind = "torch"

    def __init__(self) -> None:
        self._devices: dict[int, Any] = {}
        self._raw_stream: Any = None  # torch._C._cuda_getCurrentRawStream, once looked up

    def describe(self, obj: Any, name: str, host: bool = False) -> ArrayView:
        """``host``: CPU tensors are described too, on :data:`HOST` (the cross-rank merge on gloo)."""
        spec = self.spec(obj, name, host)
        try:
            ptr = obj.data_ptr()
        except RuntimeError:
            if _inside_torch_func(obj):
                raise TypeError(
                    f"{name}: a tensor inside a torch.func transform (grad, vjp, jacrev, vmap); cupy-merge's "
                    f"merges are differentiable through torch.autograd (eagerly and under torch.compile), not "
                    f"torch.func: take gradients with torch.autograd.grad or loss.backward()"
                ) from None
            raise
        if ptr == 0 and obj.numel() > 0:
            raise ValueError(f"{name}: expected a tensor with memory, got a null data pointer (freed storage?)")
        return ArrayView(ptr, spec.shape, spec.strides, spec.dtype, spec.itemsize, spec.device)

    def spec(self, obj: Any, name: str, host: bool = False, meta: bool = False) -> ArraySpec:
        """What planning needs, without the address: works on fake tensors (``torch.compile``).
        ``meta``: meta tensors too (the ops' shapes), on :data:`HOST`."""
        torch = torch_module()
        if obj.layout != torch.strided:
            raise TypeError(
                f"{name}: expected a dense (strided) tensor, got layout {obj.layout}; convert it with .to_dense()"
            )
        where = obj.device.type
        if where != "cuda" and not (host and where == "cpu") and not (meta and where == "meta"):
            hint = ("meta tensors have no memory to merge (the registered ops, torch.ops.cupy_merge.*, give the "
                    "results' shapes on them)") if where == "meta" else "move it with .cuda()"  # fmt: skip
            raise TypeError(f"{name}: expected a torch tensor on a CUDA device, got one on {obj.device}; {hint}")
        if obj.is_neg() or obj.is_conj():
            raise TypeError(
                f"{name}: expected a tensor without torch's lazy negation or conjugation (a view such as "
                f"x.conj().imag); materialise it with .resolve_neg() / .resolve_conj()"
            )
        device = obj.device.index if obj.device.type == "cuda" else HOST
        return ArraySpec(tuple(obj.shape), tuple(obj.stride()), dtype_name(obj.dtype), obj.element_size(), device)

    def current_stream(self, device: int) -> int:
        raw = self._raw_stream
        if raw is None:
            torch = torch_module()
            # The public torch.cuda.current_stream() builds a Stream object: ~5 us.
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda index: torch.cuda.current_stream(index).cuda_stream
            )
            self._raw_stream = raw
        return raw(device)

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, stream: int | None, zero: bool = False) -> Any:
        torch = torch_module()
        make = torch.zeros if zero else torch.empty
        if device == HOST:
            return make(shape, dtype=getattr(torch, dtype))
        where = self._devices.get(device)
        if where is None:
            where = self._devices.setdefault(device, torch.device("cuda", device))
        if stream is None:
            return make(shape, dtype=getattr(torch, dtype), device=where)
        # torch's caching allocator hands a block back only to allocations on its stream.
        with torch.cuda.stream(torch_stream(stream, where)):
            return make(shape, dtype=getattr(torch, dtype), device=where)

    def empty_as(self, like: Any, shape: tuple[int, ...], zero: bool = False) -> Any:
        """A new C-contiguous tensor of ``like``'s dtype and device, for the current stream (what
        :meth:`empty` makes, without parsing a dtype and a device)."""
        return like.new_zeros(shape) if zero else like.new_empty(shape)

    def pointer(self, array: Any) -> int:
        return array.data_ptr()

    def mark_written(self, tensors: tuple) -> None:
        """Count a launch's writes into ``tensors`` as in-place modifications (their version
        counters: what torch's own ops bump, and autograd checks before using a saved tensor)."""
        increment = torch_module()._C._increment_version
        try:
            increment(tensors)
        except TypeError:  # torch before 2.6 takes one tensor at a time
            for tensor in tensors:
                increment(tensor)

    def view(self, buffer: Any, dtype: str, shape: tuple, strides: tuple, byte_offset: int) -> Any:
        torch = torch_module()
        typed = buffer.view(getattr(torch, dtype))
        return typed.as_strided(shape, strides, typed.storage_offset() + byte_offset // typed.element_size())

    def copy(self, destination: Any, source: Any) -> None:
        destination.copy_(source)

    def scope(self, stream: int | None, device: int) -> Any:
        torch = torch_module()
        if stream is None or device == HOST:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch_stream(stream, torch.device("cuda", device)))


def torch_stream(pointer: int, device: Any) -> Any:
    """The torch stream of a raw ``cudaStream_t`` on ``device``. The null stream is torch's default
    stream: ``torch.cuda.ExternalStream(0)`` would be a new stream from torch's pool instead, not
    ordered with the default stream's work (a host read of the offsets on it read memory before
    their producer had written it)."""
    torch = torch_module()
    if pointer == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(pointer, device=device)


CUPY = CupyAdapter()
TORCH = TorchAdapter()
JAX = JaxAdapter()
FOREIGN = ForeignAdapter()


def is_jax(obj: Any) -> bool:
    """A JAX array or tracer (the module of its type is JAX's)."""
    return type(obj).__module__.startswith(("jax", "jaxlib"))


def adapter_for(obj: Any, name: str) -> Adapter:
    """The adapter of ``obj``'s kind, or ``TypeError`` naming ``name`` (host arrays included)."""
    if isinstance(obj, cupy.ndarray):
        return CUPY
    torch = torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return TORCH
    if is_jax(obj):
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
_torch_parameter: type | None = None  # nn.Parameter (learned sinks): a plain tensor's fingerprint
#: The two, once learned: whether a call's first input is a tensor, in one look-up.
torch_types: frozenset = frozenset()


def fingerprints(operands: tuple) -> tuple | None:
    """What identifies the arrays for the fast path, flat: pointer, shape, strides, dtype and device
    of each (and torch's negation and requires-grad bits), or ``None`` when one of them has no cheap
    fingerprint (JAX, DLPack, other producers, tensors without a data pointer). A missing operand
    is ``None``."""
    global _torch_tensor, _torch_parameter, torch_types
    parts: list = []
    try:
        for obj in operands:
            cls = type(obj)
            if cls is _torch_tensor or cls is _torch_parameter:
                parts += (obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.is_neg(), obj.requires_grad)
            elif cls is cupy.ndarray:
                data = obj.data
                parts += (data.ptr, obj.shape, obj.strides, obj.dtype, data.device_id)
            elif obj is None:
                parts.append(None)
            else:
                torch = torch_module()
                if _torch_tensor is None and torch is not None and cls in (torch.Tensor, torch.nn.Parameter):
                    # torch was imported after this module: learn its tensor types once
                    _torch_tensor, _torch_parameter = torch.Tensor, torch.nn.Parameter
                    torch_types = frozenset((_torch_tensor, _torch_parameter))
                    return fingerprints(operands)
                return None
    except RuntimeError:  # a sparse or meta tensor has no data pointer: the full path explains
        return None
    return tuple(parts)


_TENSOR_GUARDS: Any = None  # torch's TensorGuards class once looked up; False where torch has none


def torch_addresses(operands: tuple) -> tuple[tuple, list] | None:
    """For operands that are all torch tensors (or None): their data pointers (None for a missing
    operand) and the tensors, in order; what a guarded entry of the fast path is found by and
    checked against (:func:`torch_guards`). None for any other array kind, or a tensor without a
    data pointer."""
    addresses: list = []
    tensors: list = []
    try:
        for obj in operands:
            if obj is None:
                addresses.append(None)
                continue
            cls = type(obj)
            if cls is not _torch_tensor and cls is not _torch_parameter:
                return None
            addresses.append(obj.data_ptr())
            tensors.append(obj)
    except RuntimeError:  # a sparse or meta tensor
        return None
    return tuple(addresses), tensors


def torch_guards(tensors: list) -> Any | None:
    """A check that tensors are again of these tensors' Python types, dtypes, devices, shapes,
    strides, requires-grad flags and dispatch keys (torch's lazy negation and conjugation bits
    among them), or None where this torch has no such check.

    It is the check Dynamo guards compiled graphs with (``torch._C._dynamo.guards.TensorGuards``,
    in C++): for six tensors about 1 us, against about 5 us to read those facts in Python. With
    the data pointers it identifies an array as :func:`fingerprints` does. Its checks also
    compare the thread's dispatch state (``torch.inference_mode`` flips it): a call under
    another state fails the check and takes the fingerprint path, never a wrong entry. It
    fails any call that passes one tensor twice (torch's guards expect distinct tensors), so
    none is made for such tensors: those calls always take the fingerprint path.
    """
    if len({id(tensor) for tensor in tensors}) < len(tensors):
        return None
    global _TENSOR_GUARDS
    if _TENSOR_GUARDS is None:
        _TENSOR_GUARDS = _checked_tensor_guards()
    if _TENSOR_GUARDS is False:
        return None
    try:
        return _TENSOR_GUARDS(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (TypeError, RuntimeError):  # a torch whose TensorGuards takes other arguments
        return None


def _checked_tensor_guards() -> Any:
    """torch's TensorGuards if it behaves as :func:`torch_guards` relies on (a private class: its
    arguments and meaning may change), else False: guards made for a tensor pass it and fail a
    view of its memory with another shape, strides, dtype or negation bit."""
    try:
        from torch._C._dynamo import guards

        torch = torch_module()
        probe = torch.zeros(2, 4)
        guard_class: Any = guards.TensorGuards
        made = guard_class(probe, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        others = (probe.t(), probe[:, ::2], probe[:1], probe.view(torch.int32), probe._neg_view())
        works = made.check(probe) and not any(made.check(other) for other in others)
    except Exception:  # noqa: BLE001 - any failure of a private API means: do without it
        return False
    return guard_class if works else False


def stream_pointer(stream: Any) -> int:
    """The raw ``cudaStream_t`` of a stream given by the caller.

    ``stream`` may be a CuPy or torch stream, an object with ``__cuda_stream__``
    (CUDA Python protocol), or a raw pointer as ``int``.
    """
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    raise TypeError(
        f"stream: expected None, an int cudaStream_t, a CuPy or torch stream, or an object "
        f"with __cuda_stream__, got {stream!r}"
    )


def to_numpy(array: Any, stream: int | None = None) -> numpy.ndarray:
    """A host copy of a device array, made on ``stream`` (default: the current one of its kind)."""
    if hasattr(array, "detach"):
        torch = torch_module()
        if stream is None or not array.is_cuda:
            return array.detach().cpu().numpy()
        with torch.cuda.stream(torch_stream(stream, array.device)):
            return array.detach().cpu().numpy()
    array = as_cupy(array)
    if stream is None:
        return cupy.asnumpy(array)
    with cupy.cuda.Device(array.device.id):
        return cupy.asnumpy(array, stream=cupy.cuda.Stream.from_external(_RawStream(stream)))
