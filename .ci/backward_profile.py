"""Launches of the gradient kernels inside an NVTX range named ``measure``, for Nsight Compute.

Default (benchmarks/PERF.md, session 10): one launch each of the two-way gradient (4096 x 32 x 128) and
the N-way one (16 x 1024 x 32 x 128), bf16. ``stages`` (PERF_LOG run 56): the N-way one under
three chunks of two states in flight (the default), four of two and two of four, then ragged rows
of 64 tokens with 0-200 states each, given the merge's results and recomputing them:

    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats python3 .ci/backward_profile.py [stages]
"""

import sys

import numpy
import torch

import cupy_merge as cm
from cupy_merge import _tuning
from cupy_merge.tools.sweep import tuning_of

H, D = 32, 128


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def default_calls():
    T = 4096
    v_a, v_b, grad = (randn(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, grad_s = (randn(H, T) for _ in range(3))
    v, s = randn(16, 1024, H, D, dtype=torch.bfloat16), randn(16, H, 1024)
    grad_many, grad_many_s = randn(1024, H, D, dtype=torch.bfloat16), randn(H, 1024)
    return [
        ({}, lambda: cm.merge_state_backward(v_a, s_a, v_b, s_b, grad, grad_s)),
        ({}, lambda: cm.merge_states_backward(v, s, grad_many, grad_many_s)),
    ]


def stage_calls():
    v, s = randn(16, 1024, H, D, dtype=torch.bfloat16), randn(16, H, 1024)
    grad, grad_s = randn(1024, H, D, dtype=torch.bfloat16), randn(H, 1024)
    counts = numpy.random.default_rng(0).integers(0, 201, 64)
    indptr = torch.tensor(numpy.concatenate([[0], numpy.cumsum(counts)]), device="cuda", dtype=torch.int32)
    rows = int(indptr[-1])
    rv, rs = randn(rows, H, D, dtype=torch.bfloat16), randn(H, rows)
    rgrad, rgrad_s = randn(64, H, D, dtype=torch.bfloat16), randn(H, 64)
    out, out_lse = cm.merge_states_varlen(rv, rs, indptr)

    def dense():
        return cm.merge_states_backward(v, s, grad, grad_s)

    def ragged_given():
        return cm.merge_states_varlen_backward(rv, rs, indptr, rgrad, rgrad_s, out=out, out_lse=out_lse)

    def ragged_recomputing():
        return cm.merge_states_varlen_backward(rv, rs, indptr, rgrad, rgrad_s)

    return [
        ({}, dense),
        ({"backward_stages": 4, "backward_chunk": 2}, dense),
        ({"backward_stages": 2, "backward_chunk": 4}, dense),
        ({}, ragged_given),
        ({}, ragged_recomputing),
    ]


def main(argv):
    calls = stage_calls() if argv[1:] == ["stages"] else default_calls()
    for settings, call in calls:  # compile and warm up outside the range
        with _tuning.use(tuning_of(settings)):
            for _ in range(3):
                call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    for settings, call in calls:
        with _tuning.use(tuning_of(settings)):
            call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main(sys.argv)
