"""Communicators and array operations behind :mod:`cupy_merge.distributed`, one pair per array kind.

A communicator does two collectives (``all_reduce`` with "max" or "sum" on
float32, ``all_gather`` into a stacked ``[world, ...]`` array); the ops object
gives the few array operations the strategies need, with torch's or CuPy's names.
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
        self._gloo = dist.get_backend(group) == "gloo"

    def all_reduce(self, tensor: Any, op: str) -> None:
        # Elementwise results keep their input's strides, which may differ between ranks;
        # a collective pairs elements by memory order, so it must see one layout everywhere.
        dense = tensor.contiguous()
        reduce_op = self._dist.ReduceOp.MAX if op == "max" else self._dist.ReduceOp.SUM
        self._dist.all_reduce(dense, op=reduce_op, group=self._group)
        if dense.data_ptr() != tensor.data_ptr():
            tensor.copy_(dense)

    def all_gather(self, out: Any, tensor: Any) -> None:
        if self._gloo:  # gloo gathers into a list of tensors
            self._dist.all_gather(list(out.unbind(0)), tensor, group=self._group)
        else:
            self._dist.all_gather_into_tensor(out, tensor, group=self._group)


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

    def _stream_ptr(self) -> int:
        import cupy

        return (self._stream or cupy.cuda.get_current_stream()).ptr

    def all_reduce(self, array: Any, op: str) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("all_reduce needs a C-contiguous array")  # the strategies allocate them so
        nccl = self._nccl
        reduce_op = nccl.NCCL_MAX if op == "max" else nccl.NCCL_SUM
        self._comm.allReduce(
            array.data.ptr, array.data.ptr, array.size, nccl.NCCL_FLOAT32, reduce_op, self._stream_ptr()
        )

    def all_gather(self, out: Any, array: Any) -> None:
        byte_type = getattr(self._nccl, "NCCL_UINT8", 1)  # ncclUint8: gathers any dtype as bytes
        self._comm.allGather(array.data.ptr, out.data.ptr, array.nbytes, byte_type, self._stream_ptr())


class TorchOps:
    """Array operations on torch tensors (CPU or CUDA)."""

    def __init__(self):
        import torch

        self.t = torch

    def on_stream(self):
        return contextlib.nullcontext()

    def on_gpu(self, x):
        return x.is_cuda

    def dtype_name(self, x):
        return str(x.dtype).removeprefix("torch.")

    def device_of(self, x):
        return str(x.device)

    def itemsize(self, x):
        return x.element_size()

    def empty_to_neg_inf(self, s):
        return self.t.where(s == float("inf"), float("-inf"), s)

    def isnan(self, x):
        return self.t.isnan(x)

    def where(self, condition, a, b):
        return self.t.where(condition, a, b)

    def exp(self, x):
        return self.t.exp(x)

    def log(self, x):
        return self.t.log(x)

    def amax(self, x, axis):
        return self.t.amax(x, axis)

    def sum(self, x, axis):
        return self.t.sum(x, axis)

    def transpose(self, x):
        return x.transpose(-2, -1)

    def to_float32(self, x):
        return x.float()

    def cast_like(self, x, like):
        return x.to(like.dtype)

    def empty_float32(self, shape, like):
        return self.t.empty(shape, dtype=self.t.float32, device=like.device)

    def empty_like_stacked(self, x, count):
        return self.t.empty((count, *x.shape), dtype=x.dtype, device=x.device)

    def contiguous(self, x):
        return x.contiguous()

    def assign(self, dst, src):
        dst.copy_(src)  # shapes, dtypes and devices were checked before any collective


class CupyOps:
    """Array operations on CuPy arrays, on ``stream`` when one is given."""

    def __init__(self, stream):
        import cupy

        self.cp = cupy
        self._stream = stream

    def on_stream(self):
        return self._stream if self._stream is not None else contextlib.nullcontext()

    def on_gpu(self, x):
        return True

    def dtype_name(self, x):
        return x.dtype.name

    def device_of(self, x):
        return x.device.id

    def itemsize(self, x):
        return x.itemsize

    def empty_to_neg_inf(self, s):
        return self.cp.where(s == self.cp.inf, -self.cp.inf, s)

    def isnan(self, x):
        return self.cp.isnan(x)

    def where(self, condition, a, b):
        return self.cp.where(condition, a, b).astype(self.cp.float32, copy=False)

    def exp(self, x):
        return self.cp.exp(x)

    def log(self, x):
        return self.cp.log(x)

    def transpose(self, x):
        return self.cp.swapaxes(x, -2, -1)

    def to_float32(self, x):
        return x.astype(self.cp.float32)

    def cast_like(self, x, like):
        return x.astype(like.dtype)

    def empty_float32(self, shape, like):
        with self.cp.cuda.Device(like.device.id):
            return self.cp.empty(shape, dtype=self.cp.float32)

    def empty_like_stacked(self, x, count):
        with self.cp.cuda.Device(x.device.id):
            return self.cp.empty((count, *x.shape), dtype=x.dtype)

    def contiguous(self, x):
        return self.cp.ascontiguousarray(x)

    def assign(self, dst, src):
        dst[...] = src  # shapes and dtypes were checked before any collective
