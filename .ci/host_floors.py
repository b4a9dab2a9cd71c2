"""Host time per call and its floors, in one process (issue 51; benchmarks/PERF_LOG.md run 66).

Torch, 1 x 32 x 128 bf16: each merge path with the guarded look-up on ("new") and off ("old": the
fingerprint path), three rounds alternating, beside the yardsticks (torch.add, cupy.add) and the
floors (the driver's launch alone, a no-op op registered with merge_attn_states' own schema, two
output allocations). Then JAX eager: a + b, a jitted no-op buffer_callback (the floor of a kernel
launched from Python) and the merges. Needs a GPU, torch and JAX.

Usage: python3 .ci/host_floors.py
"""
import sys

import cupy
import torch

import cupy_merge as cm
import cupy_merge.torch_ops as _torch_ops

_torch_ops.ops()
from cupy_merge import _arrays, _dispatch
from cupy_merge.tools.timing import host_us_per_call

guarded_lookup = _arrays.torch_addresses


def us(call):
    return host_us_per_call(call, batches=60)


dev = torch.device("cuda", 0)
v_a, v_b, out = (torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
s_a, s_b, out_lse = (torch.randn(32, 1, device="cuda") for _ in range(3))
c_va, c_vb, c_out = (cupy.asarray(t.float()).astype(cupy.float16) for t in (v_a, v_b, out))
c_sa, c_sb, c_lse = (cupy.asarray(t) for t in (s_a, s_b, out_lse))

# A no-op op registered as cupy-merge's are (define / impl CUDA): the registered op's floor.
lib = torch.library.Library("host51", "FRAGMENT")
lib.define(str(torch.ops.cupy_merge.merge_attn_states.default._schema).replace("cupy_merge::merge_attn_states", "noop"))
lib.impl("noop", lambda *args: None, "CUDA")

bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
shared = {
    "torch.add(out=)": lambda: torch.add(v_a, v_b, out=out),
    "torch.add alloc": lambda: torch.add(v_a, v_b),
    "cupy.add(out=)": lambda: cupy.add(c_va, c_vb, out=c_out),
    "bound": bound,
    "registered no-op, same schema (floor)": lambda: torch.ops.host51.noop(out, v_a, s_a, v_b, s_b, out_lse),
    "driver launch alone (floor)": None,
    "torch.empty x2": lambda: (torch.empty((1, 32, 128), dtype=torch.bfloat16, device=dev),
                               torch.empty((32, 1), dtype=torch.float32, device=dev)),
    "adapter.empty x2": lambda: (_arrays.TORCH.empty((1, 32, 128), "bfloat16", 0, None),
                                 _arrays.TORCH.empty((32, 1), "float32", 0, None)),
    "v_a.new_empty x2": lambda: (v_a.new_empty((1, 32, 128)), s_a.new_empty((32, 1))),
}
paths = {
    "torch merge_attn_states": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
    "torch merge_state alloc": lambda: cm.merge_state(v_a, s_a, v_b, s_b),
    "registered op": lambda: torch.ops.cupy_merge.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
    "cupy merge_attn_states": lambda: cm.merge_attn_states(c_out, c_va, c_sa, c_vb, c_sb, c_lse),
}
from cupy_merge._operands import TwoStateOperands
from cupy_merge._ops import MERGE_ATTN_STATES
from cupy_merge._options import two_state_options

cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)
_fp = _arrays.fingerprints(TwoStateOperands(out, out_lse, v_a, s_a, v_b, s_b, None, None, None, None))
_launch = _dispatch._calls[(MERGE_ATTN_STATES, two_state_options(), _fp)].launches[0]
_stream = _arrays.TORCH.current_stream(0)
_args = (_launch.function, *_launch.grid, *_launch.block, _launch.shared_bytes, _stream, _launch.params, 0)
shared["driver launch alone (floor)"] = lambda: cupy.cuda.driver.launchKernel(*_args)
for call in (*shared.values(), *paths.values()):
    call()
torch.cuda.synchronize()
results = {}
for _round in range(3):  # alternate the two trees' paths, three rounds; the median of each
    for name, call in shared.items():
        results.setdefault(name, []).append(us(call))
    for mode in ("new", "old"):
        _arrays.torch_addresses = guarded_lookup if mode == "new" else (lambda operands: None)
        for name, call in paths.items():
            results.setdefault(f"{name} [{mode}]", []).append(us(call))
    _arrays.torch_addresses = guarded_lookup
for name, values in results.items():
    print(f"host51b {name:<38} {sorted(values)[1]:7.2f} us  ({' '.join(f'{v:.2f}' for v in values)})")

# the merge's values through the guarded path (an old pointer, a new one, same shapes)
for _ in range(3):
    merged, lse = cm.merge_state(v_a, s_a, v_b, s_b)
ref_s = torch.logaddexp(s_a, s_b)
ref = (v_a.double() * torch.exp(s_a.double() - ref_s.double()).T[..., None]
       + v_b.double() * torch.exp(s_b.double() - ref_s.double()).T[..., None])
print("values check", float((merged.double() - ref).abs().max() / ref.abs().max()), float((lse - ref_s).abs().max()))
sys.stdout.flush()

# -- JAX eager, three rounds alternating, against a + b and a jitted no-op buffer_callback --
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

import cupy_merge.jax as cmj

ja = jnp.asarray(v_a.float().cpu().numpy(), dtype=jnp.bfloat16)
jb = jnp.asarray(v_b.float().cpu().numpy(), dtype=jnp.bfloat16)
jsa, jsb = jnp.asarray(s_a.cpu().numpy()), jnp.asarray(s_b.cpu().numpy())
from jax.experimental.buffer_callback import buffer_callback

noop = jax.jit(buffer_callback(lambda ctx, out, *ins: None, jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16),
                                   command_buffer_compatible=True))
# Where the merge's ~45 us above the one-output no-op go (session 29's hypotheses, not yet run): a
# second result, XLA's command buffer (a CUDA graph a call) and the callback reading six addresses.
two_results = (jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32, 1), jnp.float32))
noop_two = jax.jit(buffer_callback(lambda ctx, out, *ins: None, two_results, command_buffer_compatible=True))
noop_two_plain = jax.jit(buffer_callback(lambda ctx, out, *ins: None, two_results, command_buffer_compatible=False))


def _read_addresses(ctx, out, *ins):
    for buffer in (*ins, *out):
        buffer.__cuda_array_interface__["data"][0]


noop_two_addresses = jax.jit(buffer_callback(_read_addresses, two_results, command_buffer_compatible=True))
jcalls = {
    "jax a + b": lambda: ja + jb,
    "jax jit(no-op buffer_callback) (floor)": lambda: noop(ja, jsa, jb, jsb),
    "jax no-op, two results": lambda: noop_two(ja, jsa, jb, jsb),
    "jax no-op, two results, no cmd buffer": lambda: noop_two_plain(ja, jsa, jb, jsb),
    "jax no-op, two results, 6 addresses": lambda: noop_two_addresses(ja, jsa, jb, jsb),
    "jax cm.merge_state": lambda: cm.merge_state(ja, jsa, jb, jsb),
    "jax cmj.merge_state": lambda: cmj.merge_state(ja, jsa, jb, jsb),
}


def jax_us(call, n=1000):
    for _ in range(200):
        r = call()
    jax.block_until_ready(r)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            r = call()
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / (n // 5) * 1e6)
    return sorted(times)[2]


jres = {}
for _round in range(3):
    for name, call in (jcalls.items() if _round % 2 == 0 else reversed(jcalls.items())):
        jres.setdefault(name, []).append(jax_us(call))
for name, values in jres.items():
    print(f"host51b {name:<38} {sorted(values)[1]:7.2f} us  ({' '.join(f'{v:.2f}' for v in values)})")
# The merge with XLA's command buffer off (every callback of cupy_merge.jax built without it).
from cupy_merge import _jax_launch

loaded = _jax_launch._jax()
plain = loaded._replace(buffer_callback=lambda *a, **k: loaded.buffer_callback(*a, **{**k, "command_buffer_compatible": False}))
_jax_launch._loaded[0] = plain
cmj._clear_caches()
times = [jax_us(lambda: cmj.merge_state(ja, jsa, jb, jsb)) for _ in range(3)]
print(f"host51b {'jax cmj.merge_state, no cmd buffer':<38} {sorted(times)[1]:7.2f} us  ({' '.join(f'{v:.2f}' for v in times)})")
merged, _ = cmj.merge_state(ja, jsa, jb, jsb)
print("jax values check (no cmd buffer)", float(jnp.abs(merged.astype(jnp.float32) - jnp.asarray(ref.float().cpu().numpy())).max()))
_jax_launch._loaded[0] = loaded
cmj._clear_caches()
merged, _ = cm.merge_state(ja, jsa, jb, jsb)
print("jax values check", float(jnp.abs(merged.astype(jnp.float32) - jnp.asarray(ref.float().cpu().numpy())).max()))
