"""Where a torch call's host time goes (issue 28's host targets): each step of the call sequence
timed alone, 1x32x128 bf16, µs a call (median of batches; no synchronisation inside a batch).

Steps of ``merge_attn_states`` (torch, outputs given), as ``_dispatch.call`` runs them:
options (the keyword normalisation), operands (the record), the tensors' addresses and torch's
guards over them (the guarded look-up; the fingerprints of six tensors' pointer, shape, strides,
dtype and flags are what a failed check falls back to), lookup (the prepared call by key), stream
(torch's current raw stream), launch (``_launch.launch``: the context check and cuLaunchKernel),
and the driver's launch alone; then what ``merge_state`` adds: two allocations (``new_empty``
from its inputs since session 28; ``torch.empty`` beside). Yardsticks beside.

Usage: python3 .ci/host_profile.py
"""


import torch

import cupy_merge as cm
from cupy_merge import _arrays, _dispatch, _launch, _options, _tuning
from cupy_merge._operands import TwoStateOperands
from cupy_merge._ops import MERGE_ATTN_STATES
from cupy_merge.tools.timing import host_us_per_call


def per_call(call):
    return host_us_per_call(call, batches=60)


def main():
    v_a, v_b, out = (torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, out_lse = (torch.randn(32, 1, device="cuda") for _ in range(3))
    cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)
    options = _options.two_state_options()
    operands = TwoStateOperands(out, out_lse, v_a, s_a, v_b, s_b, None, None, None, None)
    fingerprint = _arrays.fingerprints(operands)
    key = (MERGE_ATTN_STATES, options, fingerprint)
    prepared = _dispatch._calls[key]
    launch = prepared.launches[0]
    stream = _arrays.TORCH.current_stream(0)
    driver = _launch._driver_launch
    guards = _arrays.torch_guards([out, out_lse, v_a, s_a, v_b, s_b])
    steps = {
        "whole call: merge_attn_states": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
        "options": lambda: _options.two_state_options(),
        "operands record": lambda: TwoStateOperands(out, out_lse, v_a, s_a, v_b, s_b, None, None, None, None),
        "torch addresses (guarded key)": lambda: _arrays.torch_addresses(operands),
        "torch guards check (6 tensors)": lambda: guards.check(out, out_lse, v_a, s_a, v_b, s_b),
        "fingerprints (6 tensors)": lambda: _arrays.fingerprints(operands),
        "one tensor's fingerprint": lambda: (
            v_a.data_ptr(),
            v_a.shape,
            v_a.stride(),
            v_a.dtype,
            v_a.is_neg(),
            v_a.requires_grad,
        ),
        "lookup": lambda: _dispatch._calls.get(key),
        "tuning.current": _tuning.current,
        "current stream": lambda: _arrays.TORCH.current_stream(0),
        "run (launch + results)": lambda: _dispatch.run(MERGE_ATTN_STATES, prepared, operands, None),
        "_launch.launch": lambda: _launch.launch(launch, stream),
        "driver launch alone": lambda: driver(
            launch.function, *launch.grid, *launch.block, launch.shared_bytes, stream, launch.params, 0
        ),
        "merge_state (allocating)": lambda: cm.merge_state(v_a, s_a, v_b, s_b),
        "2x new_empty": lambda: (v_a.new_empty((1, 32, 128)), s_a.new_empty((32, 1))),
        "2x torch.empty": lambda: (
            torch.empty((1, 32, 128), dtype=torch.bfloat16, device="cuda"),
            torch.empty((32, 1), dtype=torch.float32, device="cuda"),
        ),
        "adapter.empty x2": lambda: (
            _arrays.TORCH.empty((1, 32, 128), "bfloat16", 0, None),
            _arrays.TORCH.empty((32, 1), "float32", 0, None),
        ),
        "torch.add(out=)": lambda: torch.add(v_a, v_b, out=out),
        "torch.add": lambda: torch.add(v_a, v_b),
    }
    for _round in range(2):
        results = {name: per_call(call) for name, call in steps.items()}
    for name, us in results.items():
        print(f"host-profile {name:<34} {us:7.2f} us")


if __name__ == "__main__":
    main()
