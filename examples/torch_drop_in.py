"""cupy_merge as a drop-in for vLLM's merge_attn_states in PyTorch code: same signature, no copies,
torch's current stream, and capturable in a CUDA graph."""

import sys

import torch

if not torch.cuda.is_available():
    print("skipped: needs an NVIDIA GPU and a CUDA build of torch")
    sys.exit(0)

import cupy_merge as cm

tokens, heads, head_size = 256, 32, 128
prefix_output = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
suffix_output = torch.randn_like(prefix_output)
prefix_lse = torch.randn(heads, tokens, device="cuda") * 4
suffix_lse = torch.randn(heads, tokens, device="cuda") * 4
output = torch.empty_like(prefix_output)
output_lse = torch.empty_like(prefix_lse)

cm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)

# The same formula in eager torch, for comparison.
lse = torch.logaddexp(prefix_lse, suffix_lse)
weight_prefix = torch.exp(prefix_lse - lse).T.unsqueeze(-1)
weight_suffix = torch.exp(suffix_lse - lse).T.unsqueeze(-1)
expected = weight_prefix * prefix_output.float() + weight_suffix * suffix_output.float()
print("max abs difference to eager torch:", (output.float() - expected).abs().max().item())

graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    cm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)
prefix_output.normal_()
graph.replay()
torch.cuda.synchronize()
print("graph replay done; output LSE finite:", bool(torch.isfinite(output_lse).all()))
