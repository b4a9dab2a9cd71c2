"""The communicators behind :mod:`cupy_merge.distributed`: a torch process group or a CuPy NCCL communicator.

A communicator does the four collectives the strategies use, each on
contiguous arrays: ``all_gather`` (into a stacked ``[world, ...]`` array, any
dtype as bytes), ``all_to_all`` (equal chunks, bytes), ``all_reduce`` and
``reduce_scatter`` (sums in the array's dtype). torch's run on its current
stream (the merge makes the given one current); CuPy's on the stream given.
"""

from __future__ import annotations

from typing import Any


class TorchGroup:
    """A ``torch.distributed`` process group: NCCL for CUDA tensors, gloo for CPU tensors."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "group: expected an initialised torch.distributed process group for torch tensors; "
                "call torch.distributed.init_process_group() first (torchrun sets up its environment)"
            )
        # new_group() gives the processes outside the group a sentinel int (GroupMember.NON_GROUP_MEMBER)
        outside = type(group) is int and group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
        if group is not None and not outside and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group: expected None (the default group) or a torch.distributed.ProcessGroup for torch "
                f"tensors, got {type(group).__name__}"
            )
        self.rank = -1 if outside else dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(
                f"group: this process (rank {dist.get_rank()} of the default group) is not a member of the "
                f"group; call the merge on the group's ranks only"
            )
        self._dist = dist
        self._group = group
        self.world_size = dist.get_world_size(group)
        self._gloo = dist.get_backend(group) == "gloo"

    def all_gather(self, out: Any, tensor: Any) -> None:
        # gloo gathers into a list of tensors: a "gloo" group, and CPU tensors of a group of several
        # backends (init_process_group() without one, "cpu:gloo,cuda:nccl")
        if self._gloo or tensor.device.type == "cpu":
            self._dist.all_gather(list(out.unbind(0)), tensor, group=self._group)
        else:
            self._dist.all_gather_into_tensor(out, tensor, group=self._group)

    def all_to_all(self, out: Any, tensor: Any) -> None:
        self._dist.all_to_all_single(out, tensor, group=self._group)

    def sums(self, dtype: str) -> bool:
        """Whether ``all_reduce`` and ``reduce_scatter`` take values of ``dtype`` (torch's NCCL and gloo take every one)."""
        return True

    def all_reduce(self, tensor: Any) -> None:
        self._dist.all_reduce(tensor, group=self._group)

    def reduce_scatter(self, out: Any, tensor: Any) -> None:
        # Flat, as gloo pairs the first dimensions; newer torch renames the call.
        reduce_scatter = (
            getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        )
        reduce_scatter(out.view(-1), tensor.view(-1), group=self._group)


class CupyNccl:
    """A ``cupy.cuda.nccl.NcclCommunicator``; collectives go on ``stream`` (a raw pointer; None: the current one)."""

    def __init__(self, comm: Any, stream: int | None):
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

        return self._stream if self._stream is not None else cupy.cuda.get_current_stream().ptr

    def _types(self) -> dict[str, int]:
        nccl = self._nccl
        types = {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16, "uint8": nccl.NCCL_UINT8}
        if hasattr(nccl, "NCCL_BFLOAT16"):  # NCCL 2.10 and newer, and a CuPy that knows it
            types["bfloat16"] = nccl.NCCL_BFLOAT16
        return types

    def sums(self, dtype: str) -> bool:
        """Whether ``all_reduce`` and ``reduce_scatter`` take values of ``dtype`` (checked with the
        arguments, before anything runs: a sum is the last step of its strategy)."""
        return dtype in self._types()

    def _type(self, array: Any) -> int:
        return self._types()[array.dtype.name]

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
