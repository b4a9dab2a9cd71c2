"""Seconds from a fresh process's import to its first merge's result (bf16 1x32x128, torch):
``warm`` with the disk cache filled by ``python -m cupy_merge --arch``; ``no-nvrtc`` the same with
NVRTC made unloadable, so the binaries must come from the cache alone; ``cold`` with an empty cache.

Usage: python3 .ci/first_merge.py warm|no-nvrtc|cold
"""

import sys
import time

started = time.perf_counter()
mode = sys.argv[1]
import cupy

if mode == "no-nvrtc":

    def _missing(*args, **kwargs):
        raise OSError("libnvrtc.so: cannot open shared object file (hidden by .ci/first_merge.py)")

    cupy.cuda.nvrtc.getVersion = _missing
    cupy.cuda.nvrtc.compileProgram = _missing
import torch

import cupy_merge as cm

imported = time.perf_counter()
v_a, v_b = (torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
s_a, s_b = (torch.randn(32, 1, device="cuda") for _ in range(2))
torch.cuda.synchronize()
ready = time.perf_counter()
v, s = cm.merge_state(v_a, s_a, v_b, s_b)
torch.cuda.synchronize()
done = time.perf_counter()
print(f"first merge ({mode}): imports {imported - started:.2f} s, first merge {done - ready:.3f} s")
