"""One launch of each case PERF.md's sessions 12 and 14 profiled, each inside an NVTX range `measure`, for
Nsight Compute (warm-up launches first, outside the range). FlashInfer's kernels join when
`.anchors/` was carried (they are built with nvcc, as .anchors/bench_vs_flashinfer.py builds them).

Usage (on the GPU machine):
    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python3 .ci/ncu_cases.py [gradients|forward]
"""

import ctypes
import os
import subprocess
import sys

import torch

import cupy_merge as cm

HEADS, HEAD_SIZE = 32, 128
generator = torch.Generator(device="cuda").manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=generator).to(dtype)


def ragged_offsets(mean: int, tokens: int) -> torch.Tensor:
    counts = torch.randint(mean // 2, mean * 3 // 2 + 1, (tokens,), generator=torch.Generator().manual_seed(mean))
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).cuda()


def flashinfer():
    """FlashInfer's merge kernels through .anchors' C ABI, or None without .anchors/."""
    here = os.path.join(os.getcwd(), ".anchors", "flashinfer")
    if not os.path.isdir(here):
        return None
    library = "/tmp/libfi.so"
    if not os.path.exists(library):
        subprocess.check_call(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-shared",
                               "-Xcompiler", "-fPIC", "-I", os.path.join(here, "include"),
                               os.path.join(here, "fi_merge.cu"), "-o", library])  # fmt: skip
    return ctypes.CDLL(library)


def gradient_cases() -> dict:
    cases = {}
    tokens = 1024
    a, b, grad = (randn(tokens, HEADS, HEAD_SIZE) for _ in range(3))
    s_a, s_b, grad_s = (randn(HEADS, tokens, dtype=torch.float32) for _ in range(3))
    cases["two-way backward T=1024"] = lambda: cm.merge_state_backward(a, s_a, b, s_b, grad, grad_s)
    for states in (4, 16):
        v, s = randn(states, tokens, HEADS, HEAD_SIZE), randn(states, HEADS, tokens, dtype=torch.float32)
        cases[f"n-way backward S={states} T=1024"] = lambda v=v, s=s: cm.merge_states_backward(v, s, grad, grad_s)
    # 1040 tokens: the grid of 1024 (within 2 %), whose states are not 4 MiB apart (session 19: +2.4 points).
    grad_1040, grad_s1040 = randn(1040, HEADS, HEAD_SIZE), randn(HEADS, 1040, dtype=torch.float32)
    v_1040, s_1040 = randn(16, 1040, HEADS, HEAD_SIZE), randn(16, HEADS, 1040, dtype=torch.float32)
    cases["n-way backward S=16 T=1040"] = lambda: cm.merge_states_backward(v_1040, s_1040, grad_1040, grad_s1040)
    indptr = ragged_offsets(8, 4096)
    rows = int(indptr[-1])
    v, s = randn(rows, HEADS, HEAD_SIZE), randn(HEADS, rows, dtype=torch.float32)
    grad_t, grad_st = randn(4096, HEADS, HEAD_SIZE), randn(HEADS, 4096, dtype=torch.float32)
    cases["ragged backward T=4096"] = lambda: cm.merge_states_varlen_backward(v, s, indptr, grad_t, grad_st)
    # Few rows of many states: the kernel given the merge's results.
    tokens = 64
    grad_64, grad_s64 = randn(tokens, HEADS, HEAD_SIZE), randn(HEADS, tokens, dtype=torch.float32)
    v_64, s_64 = randn(64, tokens, HEADS, HEAD_SIZE), randn(64, HEADS, tokens, dtype=torch.float32)
    out, out_lse = cm.merge_states(v_64, s_64)
    cases["n-way backward given results S=64 T=64"] = lambda: cm.merge_states_backward(
        v_64, s_64, grad_64, grad_s64, out=out, out_lse=out_lse)  # fmt: skip
    indptr_100 = ragged_offsets(100, tokens)
    rows = int(indptr_100[-1])
    v_100, s_100 = randn(rows, HEADS, HEAD_SIZE), randn(HEADS, rows, dtype=torch.float32)
    out_100, out_lse_100 = cm.merge_states_varlen(v_100, s_100, indptr_100)
    cases["ragged backward given results T=64 mean 100"] = lambda: cm.merge_states_varlen_backward(
        v_100, s_100, indptr_100, grad_64, grad_s64, out=out_100, out_lse=out_lse_100)  # fmt: skip
    return cases


def forward_cases(fi) -> dict:
    cases = {}
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    P, U = ctypes.c_void_p, ctypes.c_uint
    for states, tokens in ((16, 64), (16, 1), (8, 8192)):
        v, s = randn(states, tokens, HEADS, HEAD_SIZE), randn(states, HEADS, tokens, dtype=torch.float32)
        cases[f"n-way T={tokens} S={states}"] = lambda v=v, s=s: cm.merge_states(v, s)
        if fi is not None:
            v_fi, s_fi = v.transpose(0, 1).contiguous(), s.permute(2, 0, 1).contiguous()
            out, out_lse = torch.empty_like(v_fi[:, 0]), torch.empty(tokens, HEADS, device="cuda")
            cases[f"FlashInfer n-way T={tokens} S={states}"] = lambda v=v_fi, s=s_fi, o=out, lse=out_lse, S=states, T=tokens: (
                fi.fi_merge_states_bf16(P(v.data_ptr()), P(s.data_ptr()), P(o.data_ptr()), P(lse.data_ptr()), U(S), U(T),
                                        U(HEADS), U(HEAD_SIZE), stream()))  # fmt: skip
    for tokens, heads, head_size in ((4096, 8, 64), (1, 32, 128)):
        a, b = randn(tokens, heads, head_size), randn(tokens, heads, head_size)
        s_a, s_b = randn(tokens, heads, dtype=torch.float32), randn(tokens, heads, dtype=torch.float32)
        out, out_lse = torch.empty_like(a), torch.empty(heads, tokens, device="cuda")
        cases[f"two-way {tokens}x{heads}x{head_size} (FlashInfer's layout)"] = lambda a=a, b=b, sa=s_a, sb=s_b, o=out, lse=out_lse: (
            cm.merge_state(a, sa.T, b, sb.T, out=o, out_lse=lse, lse_base=2))  # fmt: skip
        if fi is not None:
            fi_lse = torch.empty(tokens, heads, device="cuda")
            cases[f"FlashInfer two-way {tokens}x{heads}x{head_size}"] = lambda a=a, b=b, sa=s_a, sb=s_b, o=out, lse=fi_lse, T=tokens, H=heads, D=head_size: (
                fi.fi_merge_state_bf16(P(a.data_ptr()), P(sa.data_ptr()), P(b.data_ptr()), P(sb.data_ptr()), P(o.data_ptr()),
                                       P(lse.data_ptr()), U(T), U(H), U(D), stream()))  # fmt: skip
    for mean, tokens in ((100, 64), (200, 64), (200, 512)):
        indptr = ragged_offsets(mean, tokens)
        rows = int(indptr[-1])
        v, s = randn(rows, HEADS, HEAD_SIZE), randn(HEADS, rows, dtype=torch.float32)
        cases[f"ragged {mean} x {tokens}"] = lambda v=v, s=s, p=indptr: cm.merge_states_varlen(v, s, p)
    return cases


def main(which: str) -> None:
    cases = gradient_cases() if which == "gradients" else forward_cases(flashinfer())
    for case in cases.values():
        case(), case()
    torch.cuda.synchronize()
    for name, case in cases.items():
        torch.cuda.nvtx.range_push("measure")
        case()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print("profiled", name)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "forward")
