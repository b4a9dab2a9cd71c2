"""The types of cupy-merge's public API, for annotations.

>>> from cupy_merge.types import Array, LseBase
>>> def merge_twice(v: Array, s: Array, base: LseBase = "e") -> tuple[Array, Array]: ...
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias, TypeVar

#: The caller's array type, e.g. ``torch.Tensor``, ``cupy.ndarray`` or ``jax.Array``: a merge
#: returns its results in the kind of its first value array (other DLPack producers get CuPy).
Array = TypeVar("Array")

#: The base of every log-sum-exp in and out: natural log (``"e"``, vLLM) or 2 (FlashInfer).
LseBase: TypeAlias = Literal["e", 2]

#: The cross-rank merge's strategies (``cupy_merge.distributed.merge_across_ranks``).
Strategy: TypeAlias = Literal["auto", "allgather", "allreduce", "alltoall", "allgather_reducescatter"]

#: A CUDA stream: ``None`` (the current one of the arrays' kind), a raw ``cudaStream_t`` as
#: ``int``, a CuPy or torch stream, or any object with ``__cuda_stream__``.
Stream: TypeAlias = Any


class Bound(Protocol):
    """What :func:`cupy_merge.bind` returns: call it to launch the bound merge again."""

    def __call__(self, stream: Stream = None) -> Any: ...


class DeviceArray(Protocol):
    """What the merges take and return: a CuPy array, a torch CUDA tensor, a JAX array, or any
    ``__cuda_array_interface__`` or DLPack producer of GPU memory (checked when called)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


__all__ = ["Array", "Bound", "DeviceArray", "LseBase", "Strategy", "Stream"]
