"""Issue 51's three kernel misses against FlashInfer: one launch each of ours and FlashInfer's,
inside one NVTX range named ``measure``, for Nsight Compute (FlashInfer's headers carried as
``.anchors``, see ../shared/anchors/README.md; the shim is built with nvcc).

Usage:
    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section MemoryWorkloadAnalysis python3 .ci/ncu_fi_misses.py
"""
import ctypes
import os
import subprocess

import torch

import cupy_merge as cm

so = "/tmp/libfi_misses.so"
if not os.path.exists(so):
    here = ".anchors"
    subprocess.check_call(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-shared", "-Xcompiler",
                           "-fPIC", "-I", os.path.join(here, "flashinfer", "include"),
                           os.path.join(here, "flashinfer", "fi_merge.cu"), "-o", so])
fi = ctypes.CDLL(so)
P, U = ctypes.c_void_p, ctypes.c_uint
dev = "cuda"
torch.manual_seed(0)


def st():
    return P(torch.cuda.current_stream().cuda_stream)


ops = {}
# two-way 4096 x 8 x 64
T, H, D = 4096, 8, 64
va, vb = (torch.randn(T, H, D, device=dev).bfloat16() for _ in range(2))
sa, sb = (torch.randn(T, H, device=dev) * 3 for _ in range(2))
saT, sbT = sa.T.contiguous(), sb.T.contiguous()
vo, so_, cso = torch.empty_like(va), torch.empty(T, H, device=dev), torch.empty(H, T, device=dev)
ops["cm two 4096x8x64"] = lambda: cm.merge_state(va, saT, vb, sbT, out=vo, out_lse=cso, lse_base=2)
ops["fi two 4096x8x64"] = lambda: fi.fi_merge_state_bf16(P(va.data_ptr()), P(sa.data_ptr()), P(vb.data_ptr()),
                                                         P(sb.data_ptr()), P(vo.data_ptr()), P(so_.data_ptr()),
                                                         U(T), U(H), U(D), st())
# N-way T=4 S=32 H=64 D=128
T2, S2, H2, D2 = 4, 32, 64, 128
v = torch.randn(T2, S2, H2, D2, device=dev).bfloat16()
s = torch.randn(T2, S2, H2, device=dev) * 3
vn, sn = v.transpose(0, 1).contiguous(), s.permute(1, 2, 0).contiguous()
vo2, so2, cso2 = torch.empty(T2, H2, D2, device=dev).bfloat16(), torch.empty(T2, H2, device=dev), torch.empty(H2, T2, device=dev)
ops["cm n-way T4 S32 H64"] = lambda: cm.merge_states(vn, sn, out=vo2, out_lse=cso2, lse_base=2)
ops["fi n-way T4 S32 H64"] = lambda: fi.fi_merge_states_bf16(P(v.data_ptr()), P(s.data_ptr()), P(vo2.data_ptr()),
                                                            P(so2.data_ptr()), U(S2), U(T2), U(H2), U(D2), st())
# ragged: 512 tokens, 0..400 states each (mean ~200), 32 heads of 128
counts = torch.randint(0, 401, (512,))
indptr = torch.zeros(513, dtype=torch.int32)
indptr[1:] = torch.cumsum(counts, 0)
R, H3, D3, T3 = int(indptr[-1]), 32, 128, 512
rv = torch.randn(R, H3, D3, device=dev).bfloat16()
rs = torch.randn(R, H3, device=dev) * 3
rsT = rs.T.contiguous()
ind = indptr.to(dev)
vo3, so3, cso3 = torch.empty(T3, H3, D3, device=dev).bfloat16(), torch.empty(T3, H3, device=dev), torch.empty(H3, T3, device=dev)
ops["cm ragged 512x~200"] = lambda: cm.merge_states_varlen(rv, rsT, ind, out=vo3, out_lse=cso3, lse_base=2,
                                                           check_indptr=False)
ops["fi ragged 512x~200"] = lambda: fi.fi_varlen_bf16(P(rv.data_ptr()), P(rs.data_ptr()), P(ind.data_ptr()),
                                                      P(vo3.data_ptr()), P(so3.data_ptr()), U(T3), U(H3), U(D3), st())
for f in ops.values():
    f()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("measure")
for f in ops.values():
    f()
    torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
print("done", R)
