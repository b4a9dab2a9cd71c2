"""Communicators and array helpers behind :mod:`cupy_merge.distributed`, one pair per array kind.

A communicator does the four collectives the strategies use, each on
contiguous arrays: ``all_gather`` (into a stacked ``[world, ...]`` array, any
dtype as bytes), ``all_to_all`` (equal chunks, bytes), ``all_reduce`` and
``reduce_scatter`` (sums in the array's dtype). The helpers allocate, view and
point at arrays of one kind, so the strategies never name torch or CuPy.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


class TorchGroup:
    """A ``torch.distributed`` process group: NCCL for CUDA tensors, gloo for CPU tensors."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "group: expected an initialised torch.distributed process group for torch tensors; "
                "call torch.distributed.init_process_group() first (torchrun sets up its environment)"
            )
        self._dist = dist
        self._group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._gloo = dist.get_backend(group) == "gloo"

    def all_gather(self, out: Any, tensor: Any) -> None:
        if self._gloo:  # gloo gathers into a list of tensors
            self._dist.all_gather(list(out.unbind(0)), tensor, group=self._group)
        else:
            self._dist.all_gather_into_tensor(out, tensor, group=self._group)

    def all_to_all(self, out: Any, tensor: Any) -> None:
        self._dist.all_to_all_single(out, tensor, group=self._group)

    def all_reduce(self, tensor: Any) -> None:
        self._dist.all_reduce(tensor, group=self._group)

    def reduce_scatter(self, out: Any, tensor: Any) -> None:
        # Flat, as gloo pairs the first dimensions; newer torch renames the call.
        reduce_scatter = (
            getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        )
        reduce_scatter(out.view(-1), tensor.view(-1), group=self._group)


class CupyNccl:
    """A ``cupy.cuda.nccl.NcclCommunicator``; collectives go on ``stream`` (default: the current one)."""

    def __init__(self, comm: Any, stream: Any):
        from cupy.cuda import nccl

        if comm is None or not hasattr(comm, "allReduce"):
            raise TypeError(
                f"group: expected a cupy.cuda.nccl.NcclCommunicator for CuPy arrays, got {type(comm).__name__}"
            )
        self._nccl = nccl
        self._comm = comm
        self._stream = stream
        self.world_size = comm.size()
        self.rank = comm.rank_id()

    def _stream_ptr(self) -> int:
        import cupy

        return (self._stream or cupy.cuda.get_current_stream()).ptr

    def _type(self, array: Any) -> int:
        nccl = self._nccl
        types = {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16, "uint8": nccl.NCCL_UINT8}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            types["bfloat16"] = nccl.NCCL_BFLOAT16
        if array.dtype.name not in types:
            raise TypeError(
                f"v: this CuPy's NCCL cannot sum {array.dtype.name}; use op='allgather' or 'alltoall'"
            )
        return types[array.dtype.name]

    def all_gather(self, out: Any, array: Any) -> None:
        self._comm.allGather(
            array.data.ptr, out.data.ptr, array.nbytes, self._nccl.NCCL_UINT8, self._stream_ptr()
        )

    def all_to_all(self, out: Any, array: Any) -> None:
        chunk = array.nbytes // self.world_size
        stream = self._stream_ptr()
        self._nccl.groupStart()
        for peer in range(self.world_size):
            self._comm.send(array.data.ptr + peer * chunk, chunk, self._nccl.NCCL_UINT8, peer, stream)
            self._comm.recv(out.data.ptr + peer * chunk, chunk, self._nccl.NCCL_UINT8, peer, stream)
        self._nccl.groupEnd()

    def all_reduce(self, array: Any) -> None:
        self._comm.allReduce(
            array.data.ptr,
            array.data.ptr,
            array.size,
            self._type(array),
            self._nccl.NCCL_SUM,
            self._stream_ptr(),
        )

    def reduce_scatter(self, out: Any, array: Any) -> None:
        self._comm.reduceScatter(
            array.data.ptr, out.data.ptr, out.size, self._type(array), self._nccl.NCCL_SUM, self._stream_ptr()
        )


class TorchOps:
    """Allocation, views and pointers of torch tensors (CPU or CUDA); ``t`` is torch itself."""

    def __init__(self):
        import torch

        self.t = torch

    def on_stream(self):
        return contextlib.nullcontext()

    def stream_context(self, stream):
        """``stream`` (a torch stream or a raw pointer) made current."""
        if not isinstance(stream, self.t.cuda.Stream):
            from .._arrays import stream_pointer

            stream = self.t.cuda.ExternalStream(stream_pointer(stream))
        return self.t.cuda.stream(stream)

    def on_gpu(self, x):
        return x.is_cuda

    def dtype_name(self, x):
        return str(x.dtype).removeprefix("torch.")

    def device_of(self, x):
        return str(x.device)

    def device_index(self, x):
        return x.get_device()

    def stream_pointer(self, device):
        return self.t.cuda.current_stream(device).cuda_stream

    def itemsize(self, x):
        return x.element_size()

    def strides(self, x):
        return x.stride()

    def pointer(self, x):
        return x.data_ptr()

    def is_contiguous(self, x):
        return x.is_contiguous()

    def empty_bytes(self, shape, like):
        return self.t.empty(shape, dtype=self.t.uint8, device=like.device)

    def empty_values(self, shape, like):
        return self.t.empty(shape, dtype=like.dtype, device=like.device)

    def empty_lse(self, shape, like):
        return self.t.empty(shape, dtype=self.t.float32, device=like.device)

    def strided_view(self, buffer, dtype, shape, strides, byte_offset):
        """A view of the contiguous byte ``buffer``; strides in elements of ``dtype``."""
        dtype = getattr(self.t, dtype) if isinstance(dtype, str) else dtype
        typed = buffer.view(dtype)
        itemsize = typed.element_size()
        return typed.as_strided(shape, strides, typed.storage_offset() + byte_offset // itemsize)

    def contiguous(self, x):
        return x.contiguous()

    def assign(self, dst, src):
        dst.copy_(src)  # shapes, dtypes and devices were checked before any collective


class CupyOps:
    """Allocation, views and pointers of CuPy arrays, on ``stream`` when one is given."""

    def __init__(self, stream):
        import cupy

        self.cp = cupy
        self._stream = stream

    def on_stream(self):
        return self._stream if self._stream is not None else contextlib.nullcontext()

    def stream_context(self, stream):
        """``stream`` (a CuPy stream or a raw pointer) made current."""
        if isinstance(stream, self.cp.cuda.Stream):
            return stream
        from .._arrays import stream_pointer

        return self.cp.cuda.ExternalStream(stream_pointer(stream))

    def on_gpu(self, x):
        return True

    def dtype_name(self, x):
        return x.dtype.name

    def device_of(self, x):
        return x.device.id

    def device_index(self, x):
        return x.device.id

    def stream_pointer(self, device):
        return (self._stream or self.cp.cuda.get_current_stream(device)).ptr

    def itemsize(self, x):
        return x.itemsize

    def strides(self, x):
        return tuple(stride // x.itemsize for stride in x.strides)

    def pointer(self, x):
        return x.data.ptr

    def is_contiguous(self, x):
        return x.flags.c_contiguous

    def _empty(self, shape, dtype, like):
        with self.cp.cuda.Device(like.device.id):
            return self.cp.empty(shape, dtype=dtype)

    def empty_bytes(self, shape, like):
        return self._empty(shape, self.cp.uint8, like)

    def empty_values(self, shape, like):
        return self._empty(shape, like.dtype, like)

    def empty_lse(self, shape, like):
        return self._empty(shape, self.cp.float32, like)

    def strided_view(self, buffer, dtype, shape, strides, byte_offset):
        from .._arrays import cupy_dtype

        dtype = cupy_dtype(dtype) if isinstance(dtype, str) else self.cp.dtype(dtype)
        return self.cp.ndarray(
            shape, dtype, memptr=buffer.data + byte_offset, strides=tuple(s * dtype.itemsize for s in strides)
        )

    def contiguous(self, x):
        return self.cp.ascontiguousarray(x)

    def assign(self, dst, src):
        dst[...] = src  # shapes and dtypes were checked before any collective
