"""Host time per call at 1x32x128 bf16 (the benchmark's host columns) for whichever cupy_merge is
importable: run it twice in one device call, the old tree on PYTHONPATH and the new, to compare.

Usage: python3 .ci/host_cost.py LABEL
"""

import sys

import cupy
import torch

import cupy_merge as cm
from cupy_merge.tools.timing import host_us_per_call


def per_call(call):
    return host_us_per_call(call, batches=60)


def main(label):
    tokens, heads, head_size = 1, 32, 128
    v_a, v_b, out = (torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, out_lse = (torch.randn(heads, tokens, device="cuda") for _ in range(3))
    arrays = [cupy.from_dlpack(x) for x in (out, v_a, s_a, v_b, s_b, out_lse)]
    bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
    c_out, c_a, c_b = (cupy.empty((tokens, heads, head_size), cupy.float16) for _ in range(3))
    rows = {
        "merge_attn_states torch": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
        "merge_attn_states cupy": lambda: cm.merge_attn_states(*arrays),
        "bound torch": bound,
        "merge_state alloc torch": lambda: cm.merge_state(v_a, s_a, v_b, s_b),
        "torch.add(out=)": lambda: torch.add(v_a, v_b, out=out),
        "torch.add alloc": lambda: torch.add(v_a, v_b),
        "cupy.add(out=)": lambda: cupy.add(c_a, c_b, out=c_out),
    }
    if hasattr(torch.ops, "cupy_merge") and hasattr(torch.ops.cupy_merge, "merge_attn_states"):
        op = torch.ops.cupy_merge.merge_attn_states
        rows["torch.ops.cupy_merge.merge_attn_states"] = lambda: op(out, v_a, s_a, v_b, s_b, out_lse)
    for _round in range(2):  # the first round warms everything (and compiles nothing after)
        results = {name: per_call(call) for name, call in rows.items()}
    for name, us in results.items():
        print(f"{label:>4} {name:<42} {us:7.2f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "new")
