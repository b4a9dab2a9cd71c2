"""Host cost of the torch paths: microseconds a call of the eager merge, the registered op, the bound
merge and a compiled split-KV decode step, against ``torch.add`` on this GPU.

``python -m cupy_merge.tools.torch_host_cost`` prints the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .. import torch_ops


def _per_call(call: Callable[[], Any], torch: Any, batch: int, batches: int) -> float:
    """Median microseconds a call over batches of back-to-back calls, each batch synchronised."""
    for _ in range(batch):
        call()
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batch):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / batch * 1e6)
    return statistics.median(times)


def _decode_steps(torch: Any, heads: int, head_size: int, splits: int, split_len: int) -> dict[str, Any]:
    """A split-KV decode step (one query token; plain matmuls per split, then ``merge_states``),
    compiled with ``reduce-overhead`` and eager with the merge bound, over one static KV cache."""
    import cupy_merge as cm

    dtype = torch.bfloat16
    scale = head_size**-0.5
    keys = torch.randn(splits, heads, head_size, split_len, device="cuda", dtype=dtype)  # K^T per split
    values = torch.randn(splits, heads, split_len, head_size, device="cuda", dtype=dtype)
    query = torch.randn(1, heads, head_size, device="cuda", dtype=dtype)

    def step(q):
        scores = torch.matmul(q.transpose(0, 1), keys).float() * scale  # [splits, heads, 1, split_len]
        lse = torch.logsumexp(scores, dim=-1)  # [splits, heads, 1]
        partial = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(dtype), values)  # [splits, heads, 1, D]
        return cm.merge_states(partial.transpose(1, 2), lse)

    torch._dynamo.mark_static_address(keys)
    torch._dynamo.mark_static_address(values)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")

    def compiled_step():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(query)

    scores = torch.empty(splits, heads, 1, split_len, device="cuda", dtype=dtype)
    lse = torch.empty(splits, heads, 1, device="cuda")
    partial = torch.empty(splits, heads, 1, head_size, device="cuda", dtype=dtype)
    merge = cm.bind(cm.merge_states, partial.transpose(1, 2), lse)

    def eager_step():
        torch.matmul(query.transpose(0, 1), keys, out=scores)
        scaled = scores.float() * scale
        torch.logsumexp(scaled, dim=-1, out=lse)
        torch.matmul(torch.exp(scaled - lse.unsqueeze(-1)).to(dtype), values, out=partial)
        return merge()

    for _ in range(3):  # warm-up and capture
        compiled_step()
    want = eager_step()[0].float()
    got = compiled_step()[0].float()
    error = float((got - want).norm() / want.norm())
    if error > 2e-2:
        raise AssertionError(f"the compiled decode step differs from the eager one: relative error {error:.2e}")
    return {"compiled": compiled_step, "eager": eager_step}


def host_cost_table(
    tokens: int = 1,
    heads: int = 32,
    head_size: int = 128,
    splits: int = 4,
    split_len: int = 256,
    batch: int = 256,
    batches: int = 40,
    file: Any = None,
) -> dict[str, float]:
    """Print and return the host cost of the torch paths: microseconds a call on this GPU.

    Rows: the eager ``cm.merge_attn_states`` (bf16, ``tokens x heads x head_size``), the same merge as
    the registered op (packet and ``.default``), ``torch.add(a, b, out=c)`` and the bound merge as
    yardsticks, and a split-KV decode step (``splits`` splits of ``split_len`` keys, plain matmuls,
    then ``merge_states``) compiled with ``mode="reduce-overhead"`` against the same step in eager
    mode with its merge bound (``cm.bind``). Each row is the median over ``batches`` batches of
    ``batch`` calls, synchronised after each batch.

    Parameters
    ----------
    tokens, heads, head_size : int
        The merge's shape.
    splits, split_len : int
        The decode step's KV splits and their length.
    batch, batches : int
        Calls a batch, and batches a row.
    file : file-like, optional
        Where to print (standard output by default).

    Returns
    -------
    dict
        Microseconds a call by row name.

    Raises
    ------
    RuntimeError
        No CUDA device.

    Examples
    --------
    >>> from cupy_merge.tools import torch_host_cost
    >>> table = torch_host_cost.host_cost_table()  # doctest: +SKIP
    """
    import torch

    import cupy_merge as cm

    if not torch.cuda.is_available():
        raise RuntimeError("host_cost_table: needs a CUDA device")
    ops_ = torch_ops.ops()
    dtype = torch.bfloat16
    v_a, v_b, out = (torch.randn(tokens, heads, head_size, device="cuda", dtype=dtype) for _ in range(3))
    s_a, s_b, out_lse = (torch.randn(heads, tokens, device="cuda") for _ in range(3))
    packet, overload = ops_.merge_attn_states, ops_.merge_attn_states.default
    bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
    steps = _decode_steps(torch, heads, head_size, splits, split_len)
    rows: dict[str, Callable[[], Any]] = {
        "cm.merge_attn_states (eager)": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.ops.cupy_merge.merge_attn_states": lambda: packet(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.ops.cupy_merge.merge_attn_states.default": lambda: overload(out, v_a, s_a, v_b, s_b, out_lse),
        "torch.add(a, b, out=c)": lambda: torch.add(v_a, v_b, out=out),
        "cm.bind(cm.merge_attn_states) relaunch": bound,
        f"decode step, compiled reduce-overhead ({splits}x{split_len} keys)": steps["compiled"],
        f"decode step, eager with cm.bind ({splits}x{split_len} keys)": steps["eager"],
    }
    results: dict[str, float] = {}
    for _round in range(2):  # the first round warms every path
        results = {name: _per_call(call, torch, batch, batches) for name, call in rows.items()}
    width = max(map(len, results))
    print(f"host cost per call, {tokens}x{heads}x{head_size} bf16, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", file=file)  # fmt: skip
    for name, micros in results.items():
        print(f"  {name:<{width}}  {micros:7.2f} us", file=file)
    eager, packet_cost = results["cm.merge_attn_states (eager)"], results["torch.ops.cupy_merge.merge_attn_states"]
    compiled_cost, eager_step_cost = list(results.values())[-2:]
    print(f"  op / eager: {packet_cost / eager:.2f}x (target <= 1.3x); compiled step / eager bound step: "
          f"{compiled_cost / eager_step_cost:.2f}x (target <= 1x)", file=file)  # fmt: skip
    return results


if __name__ == "__main__":
    import sys

    import torch

    if len(sys.argv) > 1:
        sys.exit("usage: python -m cupy_merge.tools.torch_host_cost (no options; on a machine with an NVIDIA GPU)")
    if not torch.cuda.is_available():
        print("benchmark skipped: this torch has no CUDA device")
    else:
        host_cost_table()
