"""One launch of the gradient kernel (two-way 4096x32x128 and N-way 16x1024x32x128, bf16) inside an
NVTX range named ``measure``, for Nsight Compute (docs/PERF.md, session 10):

    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats python3 .ci/backward_profile.py
"""

import torch

import cupy_merge as cm

T, H, D = 4096, 32, 128
v_a, v_b, grad = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
s_a, s_b, grad_s = (torch.randn(H, T, device="cuda") for _ in range(3))
v = torch.randn(16, 1024, H, D, device="cuda", dtype=torch.bfloat16)
s = torch.randn(16, H, 1024, device="cuda")
grad_many = torch.randn(1024, H, D, device="cuda", dtype=torch.bfloat16)
grad_many_s = torch.randn(H, 1024, device="cuda")
for _ in range(3):  # compile and warm up outside the range
    cm.merge_state_backward(v_a, s_a, v_b, s_b, grad, grad_s)
    cm.merge_states_backward(v, s, grad_many, grad_many_s)
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("measure")
cm.merge_state_backward(v_a, s_a, v_b, s_b, grad, grad_s)
cm.merge_states_backward(v, s, grad_many, grad_many_s)
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
