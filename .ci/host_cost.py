"""Host time per call at 1 x 32 x 128 bf16 for whichever cupy_merge is importable, as JSON (one
object: row -> microseconds). Rows: torch eager (outputs given, allocating), CuPy, bound, the
registered op, JAX eager (``cm.merge_state`` on JAX arrays, ``cupy_merge.jax.merge_state``) and a
jitted chain of 8 merges, beside ``torch.add``, ``cupy.add`` and JAX's ``a + b``. Each row's values
are checked against a float64 merge first.

``.ci/host_old_new.py`` runs it for the old tree (``.old/`` on PYTHONPATH) and the new, alternating,
and prints them side by side (issue 48: no call slower).

Usage: python3 .ci/host_cost.py
"""

import json
import os
import statistics
import sys
import time

import cupy
import torch

import cupy_merge as cm
from cupy_merge.tools.timing import host_us_per_call

TOKENS, HEADS, HEAD_SIZE = 1, 32, 128


def reference(v_a, s_a, v_b, s_b):
    s_a, s_b = s_a.double(), s_b.double()
    lse = torch.logaddexp(s_a, s_b)
    return (v_a.double() * torch.exp(s_a - lse).T[..., None] + v_b.double() * torch.exp(s_b - lse).T[..., None]), lse


def check(name, got, want):
    error = float((got.double() - want).abs().max() / want.abs().max())
    if not error < 1e-2:
        raise AssertionError(f"{name}: relative error {error}")


def torch_rows():
    v_a, v_b, out = (torch.randn(TOKENS, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, out_lse = (torch.randn(HEADS, TOKENS, device="cuda") for _ in range(3))
    want, _ = reference(v_a, s_a, v_b, s_b)
    arrays = [cupy.from_dlpack(x) for x in (out, v_a, s_a, v_b, s_b, out_lse)]
    bound = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
    c_out, c_a, c_b = (cupy.empty((TOKENS, HEADS, HEAD_SIZE), cupy.float16) for _ in range(3))
    rows = {
        "torch merge_attn_states, outputs given": lambda: cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse),
        "cupy merge_attn_states, outputs given": lambda: cm.merge_attn_states(*arrays),
        "torch bound merge_attn_states": bound,
        "torch merge_state, allocating": lambda: cm.merge_state(v_a, s_a, v_b, s_b),
        "torch.add(out=)": lambda: torch.add(v_a, v_b, out=out),
        "torch.add, allocating": lambda: torch.add(v_a, v_b),
        "cupy.add(out=)": lambda: cupy.add(c_a, c_b, out=c_out),
    }
    if hasattr(torch.ops, "cupy_merge") and hasattr(torch.ops.cupy_merge, "merge_attn_states"):
        op = torch.ops.cupy_merge.merge_attn_states
        rows["torch.ops.cupy_merge.merge_attn_states"] = lambda: op(out, v_a, s_a, v_b, s_b, out_lse)
    for name in ("torch merge_attn_states, outputs given", "cupy merge_attn_states, outputs given",
                 "torch bound merge_attn_states", "torch.ops.cupy_merge.merge_attn_states"):  # fmt: skip
        if name in rows:
            out.fill_(float("nan"))
            rows[name]()
            check(name, out, want)
    check("torch merge_state, allocating", rows["torch merge_state, allocating"]()[0], want)
    return rows


def jax_rows():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    import cupy_merge.jax as cmj

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    v_a, v_b = (jax.random.normal(k, (TOKENS, HEADS, HEAD_SIZE), jnp.bfloat16) for k in keys[:2])
    s_a, s_b = (jax.random.normal(k, (HEADS, TOKENS), jnp.float32) for k in keys[2:])

    @jax.jit
    def chain(v_a, s_a, v_b, s_b):
        for _ in range(8):
            v_a, s_a = cmj.merge_state(v_a, s_a, v_b, s_b)
        return v_a, s_a

    want, _ = reference(*(torch.from_dlpack(x) for x in (v_a, s_a, v_b, s_b)))
    rows = {
        "jax cm.merge_state (eager)": lambda: cm.merge_state(v_a, s_a, v_b, s_b),
        "jax cupy_merge.jax.merge_state (eager)": lambda: cmj.merge_state(v_a, s_a, v_b, s_b),
        "jax jit chain of 8 merges": lambda: chain(v_a, s_a, v_b, s_b),
        "jax a + b (eager)": lambda: v_a + v_b,
    }
    for name in list(rows)[:2]:
        try:
            check(name, torch.from_dlpack(rows[name]()[0]), want)
        except Exception as error:  # noqa: BLE001 - a tree without this path: the row is left out
            print(f"{name}: left out ({type(error).__name__}: {error})", file=sys.stderr)
            del rows[name]
    return rows, jax.block_until_ready


def jax_us(call, block, calls=1000):
    result = call()
    for _ in range(200):
        result = call()
    block(result)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            result = call()
        block(result)
        times.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    return statistics.median(times)


def main():
    rows = torch_rows()
    results = {}
    for _round in range(2):  # the first round warms everything (and compiles nothing after)
        results = {name: host_us_per_call(call, batches=60) for name, call in rows.items()}
    try:
        jax_calls, block = jax_rows()
    except ImportError as error:
        print(f"no JAX rows: {error}", file=sys.stderr)
    else:
        results.update({name: jax_us(call, block) for name, call in jax_calls.items()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
