"""The sinks' gradient, timed: ``python benchmarks/sinks_gradient_cost.py [label]``.

Median microseconds (CUDA events, L2 flushed) of each merge's gradient with sinks, for the
cupy_merge that Python imports (put another tree first on PYTHONPATH to time it beside: the
sinks' gradient moved from float atomics to a fixed-order sum in session 25).
"""

from __future__ import annotations

import sys

import torch

import cupy_merge as cm
from cupy_merge.tools.timing import median_ms

HEADS, HEAD_SIZE = 32, 128


def _cases():
    """(label, gradient call) pairs over fresh bfloat16 states."""
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    z = torch.randn(HEADS, device="cuda")
    for states, tokens, given in ((2, 4096, False), (16, 1024, False), (1024, 1, False), (64, 64, True),
                                  (16, 1024, True)):  # fmt: skip
        v, s = torch.randn(states, tokens, HEADS, HEAD_SIZE, **bf16), torch.randn(states, HEADS, tokens, device="cuda")
        grad_v, grad_s = torch.randn(tokens, HEADS, HEAD_SIZE, **bf16), torch.randn(HEADS, tokens, device="cuda")
        if states == 2:
            yield (f"two-way T={tokens}",
                   lambda v=v, s=s, gv=grad_v, gs=grad_s: cm.merge_state_backward(v[0], s[0], v[1], s[1], gv, gs,
                                                                                  sinks=z))  # fmt: skip
            continue
        out, out_lse = cm.merge_states(v, s, sinks=z) if given else (None, None)
        yield (f"n-way S={states} T={tokens}{' given' if given else ''}",
               lambda v=v, s=s, gv=grad_v, gs=grad_s, o=out, ol=out_lse: cm.merge_states_backward(
                   v, s, gv, gs, out=o, out_lse=ol, sinks=z))  # fmt: skip
    for tokens, mean in ((512, 8), (64, 200)):
        counts = torch.randint(0, 2 * mean + 1, (tokens,))
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to("cuda", torch.int32)
        total = int(indptr[-1])
        v, s = torch.randn(total, HEADS, HEAD_SIZE, **bf16), torch.randn(HEADS, total, device="cuda")
        grad_v, grad_s = torch.randn(tokens, HEADS, HEAD_SIZE, **bf16), torch.randn(HEADS, tokens, device="cuda")
        yield (f"ragged T={tokens} S~{mean}",
               lambda v=v, s=s, i=indptr, gv=grad_v, gs=grad_s: cm.merge_states_varlen_backward(v, s, i, gv, gs,
                                                                                               sinks=z))  # fmt: skip


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    torch.manual_seed(0)
    for case, call in _cases():
        print(f"{label:>10}  {case:<28} {median_ms(call, repeat=50) * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
