"""Whether every rank called a cross-rank merge alike: one all-gather of each rank's call, compared on the host.

Ranks called with different dtypes, shapes, options or sinks make the merge's
collectives fail, wait until the group's timeout or, where the bytes happen to
agree, return wrong values. The check gathers a small header of every rank's
call (:func:`header`) and raises the same ``ValueError`` on every rank where
they differ, before any of the merge's collectives. A rank that refused its own
arguments sends a header saying so, so its peers raise instead of waiting.

It costs one more collective and a wait for the host to read the result, so it
is on where that is cheap or asked for (:func:`wanted`): CPU tensors (gloo),
``check_ranks=True``, or the environment (``CUPY_MERGE_CHECK_RANKS=1``, or
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for torch groups, torch's own switch for
checking collectives across ranks).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

from .. import _arrays, _launch, _options
from .._arrays import HOST

#: The values a header field takes, as the messages spell them.
DTYPES = ("float32", "float16", "bfloat16")
OPS = ("allgather", "allreduce", "alltoall", "allgather_reducescatter")
#: "the call": checked, or refused on that rank (its own exception says why).
CHECKED, REFUSED = 1, 2
#: Header length in int64: the call, dtype, tokens, heads, head size, base, shard_heads, op, sinks' checksum.
LENGTH = 9


def wanted(check_ranks: Any, adapter: _arrays.Adapter, v: Any) -> bool:
    """Whether this call checks its ranks agree: ``check_ranks`` if given, else on for CPU tensors or
    where the environment asks for it."""
    if check_ranks is not None:
        return _options.flag(check_ranks, "check_ranks")
    if os.environ.get("CUPY_MERGE_CHECK_RANKS") == "1":  # as the library's other switches
        return True
    if adapter is _arrays.TORCH:
        return v.device.type == "cpu" or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    return False


def header(state: Any, lse_base_2: int, shard_heads: bool, op: str, sinks: Any, adapter: _arrays.Adapter) -> list[int]:
    """This rank's call as :data:`LENGTH` integers (``state``: a ``StateShape``); the sinks by a
    checksum of their float32 values (read from the device: the check waits for the GPU anyway),
    -0.0 counted as 0.0 and every NaN as one, as the merge counts them."""
    checksum = 0 if sinks is None else 1 + zlib.crc32(_canonical(_arrays.to_numpy(sinks)).tobytes())
    return [
        CHECKED, DTYPES.index(state.dtype), state.num_tokens, state.num_heads, state.head_size,
        lse_base_2, int(shard_heads), OPS.index(op), checksum,
    ]  # fmt: skip


def _canonical(values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32) + np.float32(0.0)  # -0.0 + 0.0 is 0.0
    values[np.isnan(values)] = np.float32("nan")
    return values


def refused() -> list[int]:
    return [REFUSED] + [0] * (LENGTH - 1)


def agree(
    comm: Any, adapter: _arrays.Adapter, device: int, mine: list[int], stream: int | None, asked: bool
) -> None:
    """Gather every rank's header and raise ``ValueError`` naming what differs (the same on every rank).

    While ``stream`` or the current one is captured into a CUDA graph the host cannot read a
    collective's result: a check ``asked`` for (``check_ranks=True``) raises ``ValueError``, one on
    by default (the environment) is left out."""
    if device != HOST:
        for pointer in (stream, adapter.current_stream(device)):
            if pointer is not None and pointer > 2 and _launch.capturing(pointer):
                if not asked:
                    return
                raise ValueError(
                    "check_ranks: the ranks' calls cannot be compared while a CUDA graph is captured (the host "
                    "reads the gathered calls); pass check_ranks=False to capture, after an eager call has "
                    "checked them"
                )
    message = mismatch(_gather(comm, adapter, device, mine), comm.rank)
    if message:
        raise ValueError(message)


def _gather(comm: Any, adapter: _arrays.Adapter, device: int, mine: list[int]) -> np.ndarray:
    """``[world, LENGTH]`` int64: every rank's header, on the host."""
    if adapter is _arrays.TORCH:
        import torch

        where = torch.device("cpu") if device == HOST else torch.device("cuda", device)
        gathered = torch.empty((comm.world_size, LENGTH), dtype=torch.int64, device=where)
        comm.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=where))
        return _arrays.to_numpy(gathered)
    import cupy

    with cupy.cuda.Device(device):
        gathered = cupy.empty((comm.world_size, LENGTH), dtype=cupy.int64)
        comm.all_gather(gathered, cupy.asarray(np.asarray(mine, dtype=np.int64)))
        return _arrays.to_numpy(gathered)


def mismatch(rows: np.ndarray, rank: int) -> str:
    """The error every rank raises for gathered headers ``rows`` (``[world, LENGTH]``), or "" if they agree."""
    refusing = [r for r in range(len(rows)) if rows[r][0] == REFUSED]
    if refusing:
        if rank in refusing:
            return ""  # this rank raises its own error
        return (
            f"merge_across_ranks: {_ranks(refusing)} refused {'its' if len(refusing) == 1 else 'their'} "
            f"arguments (the exception there says why); no collective of the merge ran"
        )
    differences = []
    for field, columns in (
        ("v's dtype", [1]), ("v's shape", [2, 3, 4]), ("lse_base", [5]), ("shard_heads", [6]), ("op", [7]),
        ("sinks", [8]),
    ):  # fmt: skip
        values = [tuple(int(x) for x in row[columns]) for row in rows]
        if len(set(values)) > 1:
            spelled = {value: _spell(field, value) for value in values}
            by_value = {spelled[value]: [r for r, x in enumerate(values) if x == value] for value in values}
            differences.append(
                f"{field} is " + ", ".join(f"{text} on {_ranks(ranks)}" for text, ranks in by_value.items())
            )
    if not differences:
        return ""
    return (
        "merge_across_ranks: the ranks were not called alike: " + "; ".join(differences)
        + ". Every rank must pass the same shapes, dtypes and options (op='auto' also follows the "
        "batch-invariant mode); no collective of the merge ran"
    )  # fmt: skip


def _spell(field: str, value: tuple[int, ...]) -> str:
    if field == "v's dtype":
        return DTYPES[value[0]]
    if field == "v's shape":
        return "[" + ", ".join(map(str, value)) + "]"
    if field == "lse_base":
        return "2" if value[0] else "'e'"
    if field == "shard_heads":
        return str(bool(value[0]))
    if field == "op":
        return repr(OPS[value[0]])
    return "none" if value[0] == 0 else f"given (checksum {value[0] - 1:08x})"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
