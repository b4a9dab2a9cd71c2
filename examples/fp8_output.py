"""FP8 attention output fused into the merge, as a quantised GEMM reads it next: vLLM's static
per-tensor scale, and DeepGEMM-style per-group scales (128 elements, UE8M0 powers of two).
Checked against cupy_merge's float64 reference of merge-then-quantise."""

import sys

import numpy as np
import torch

if not torch.cuda.is_available():
    print("skipped: needs an NVIDIA GPU and a CUDA build of torch")
    sys.exit(0)

import cupy_merge as cm
from cupy_merge import reference


def fp8_steps(got, want):
    """|got - want| in units of float8_e4m3fn's spacing at |want|."""
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0**-6))) - 3)
    return float((np.abs(got - want) / spacing).max())


tokens, heads, head_size = 512, 32, 128
prefix_output = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
suffix_output = torch.randn_like(prefix_output)
prefix_lse = torch.randn(heads, tokens, device="cuda") * 4
suffix_lse = torch.randn(heads, tokens, device="cuda") * 4
host = [x.double().cpu().numpy() for x in (prefix_output, prefix_lse, suffix_output, suffix_lse)]
merged, _ = reference.merge_state(*host)

# Per tensor: one scale, read on the device (a CUDA graph replays with whatever it holds then).
scale = torch.tensor([0.01], device="cuda")
output = torch.empty(tokens, heads, head_size, device="cuda", dtype=torch.float8_e4m3fn)
cm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, None, None, scale)
want = np.clip(merged / np.float32(0.01), -448, 448)
print(
    f"per tensor: at most {fp8_steps(output.double().cpu().numpy(), want):.2f} FP8 steps from the reference"
)

# Per group: a scale per 128 elements of each token, written beside the values.
scales = torch.empty(tokens, heads * head_size // 128, device="cuda")
cm.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                     output_block_scale=scales, quant_group_size=128, scale_ue8m0=True)  # fmt: skip
_, want_scales = reference.quantize_fp8_groups(merged, 128, ue8m0=True)
got_scales = scales.cpu().numpy()
per_element = np.repeat(got_scales.astype(np.float64), 128, axis=1).reshape(merged.shape)
print(
    f"per group: {np.mean(got_scales == want_scales):.1%} of the scales equal the reference's "
    f"(powers of two), values at most {fp8_steps(output.double().cpu().numpy(), merged / per_element):.2f} "
    "FP8 steps from it"
)
