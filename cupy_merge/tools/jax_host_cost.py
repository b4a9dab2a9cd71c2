"""Host cost of JAX merges: eager calls and jitted chains against JAX's own elementwise ops.

``python -m cupy_merge.tools.jax_host_cost`` prints the table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from .. import _jax_launch
from .. import jax as cmj

_COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="
_SIZES = ((1, 32, 128), (512, 32, 128))


def benchmark(calls: int = 300, repeats: int = 7, file: Any = None) -> list[dict]:
    """Print (and return) per-call times of JAX merges against JAX's own elementwise ops.

    Rows: an eager ``cupy_merge.merge_state`` on JAX arrays (and ``cupy_merge.jax.merge_state``)
    against an eager ``a + b`` over the same bytes, and a jitted chain of 8 merges against a
    jitted chain of 8 ``a + b`` (fused by XLA, and kept apart by optimisation barriers), at
    1x32x128 and 512x32x128 bfloat16. Columns: XLA's command buffers (CUDA graphs) on, as by
    default, and off (``XLA_FLAGS=--xla_gpu_enable_command_buffer=``). Each column runs in a
    fresh process (XLA reads its flags once); a time is the median over ``repeats`` runs of
    ``calls`` calls, over their number, with one synchronisation at the end of each run.

    Parameters
    ----------
    calls : int
        Calls per run.
    repeats : int
        Runs per measurement (the median is reported).
    file : file-like, optional
        Where to print the table (standard output by default).

    Returns
    -------
    list of dict
        One per row: ``case``, ``on`` and ``off`` (µs per call, or None).

    Examples
    --------
    >>> from cupy_merge.tools import jax_host_cost
    >>> rows = jax_host_cost.benchmark(calls=100)  # doctest: +SKIP
    """
    file = sys.stdout if file is None else file
    columns = {}
    for column, flag in (("on", None), ("off", _COMMAND_BUFFERS_OFF)):
        env = dict(os.environ)
        if flag is not None:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        command = [
            sys.executable,
            "-c",
            f"from cupy_merge.tools import jax_host_cost as m; m._benchmark_child({calls}, {repeats})",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(
                f"command buffers {column}: the measuring process failed:\n{done.stdout}{done.stderr}",
                file=file,
            )
            return []
        result = json.loads(lines[-1])
        if "skipped" in result:
            print(result["skipped"], file=file)
            return []
        columns[column] = result
    rows = [
        {"case": case, "on": columns["on"].get(case), "off": columns["off"].get(case)}
        for case in columns["on"]
        if not case.startswith("_")
    ]
    width = max(len(row["case"]) for row in rows)
    print(f"{'µs per call (median)'.ljust(width)}  command buffers on  off", file=file)
    for row in rows:
        cells = [_cell(row[column]) for column in ("on", "off")]
        print(f"{row['case'].ljust(width)}  {cells[0]:>18}  {cells[1]:>8}", file=file)
    print(f"(jax {columns['on'].get('_jax', '?')}; XLA_FLAGS off: {_COMMAND_BUFFERS_OFF})", file=file)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.1f}"


def _benchmark_child(calls: int, repeats: int) -> None:
    """One column of :func:`benchmark`, in its own process: prints one JSON line."""
    loaded = _jax_launch._jax()
    jax, jnp = loaded.jax, loaded.jnp
    try:
        has_cuda = bool(jax.local_devices(backend="cuda"))
    except RuntimeError:
        has_cuda = False
    if not has_cuda:
        print(json.dumps({"skipped": "benchmark skipped: this JAX has no CUDA device"}))
        return
    import cupy_merge as cm

    def per_call(function, *args):
        for _ in range(3):
            jax.block_until_ready(function(*args))
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                result = function(*args)
            jax.block_until_ready(result)
            samples.append((time.perf_counter() - started) / calls * 1e6)
        return statistics.median(samples)

    def add(a, b):
        return a + b

    def chain_merges(v, s, v_b, s_b):
        for _ in range(8):
            v, s = cmj.merge_state(v, s, v_b, s_b)
        return v, s

    def chain_fused(a, b):
        for _ in range(8):
            a = a + b
        return a

    def chain_apart(a, b):
        for _ in range(8):
            a = jax.lax.optimization_barrier(a + b)
        return a

    keys = jax.random.split(jax.random.key(0), 4)
    table: dict[str, Any] = {"_jax": jax.__version__}
    jit_chain, jit_fused, jit_apart = jax.jit(chain_merges), jax.jit(chain_fused), jax.jit(chain_apart)
    for tokens, heads, head_size in _SIZES:
        shape = f"{tokens}x{heads}x{head_size} bf16"
        v_a, v_b = (jax.random.normal(k, (tokens, heads, head_size), jnp.bfloat16) for k in keys[:2])
        s_a, s_b = (jax.random.normal(k, (heads, tokens), jnp.float32) for k in keys[2:])
        merges = {"eager cm.merge_state": per_call(cm.merge_state, v_a, s_a, v_b, s_b),
                  "eager cupy_merge.jax.merge_state": per_call(cmj.merge_state, v_a, s_a, v_b, s_b)}
        _rows(table, shape, merges, {"eager a + b": per_call(add, v_a, v_b)})
        chains = {"jit: 8 merges": per_call(jit_chain, v_a, s_a, v_b, s_b)}
        _rows(table, shape, chains, {"jit: 8 a + b (fused by XLA)": per_call(jit_fused, v_a, v_b),
                                     "jit: 8 a + b (8 kernels)": per_call(jit_apart, v_a, v_b)})
    print(json.dumps(table))


def _rows(table: dict, shape: str, ours: dict[str, float], yardsticks: dict[str, float]) -> None:
    """Each time as a row, then each of ours over each yardstick."""
    for label, us in {**ours, **yardsticks}.items():
        table[f"{label}, {shape}"] = us
    for label, us in ours.items():
        for yardstick, their_us in yardsticks.items():
            table[f"  ratio {label.removeprefix('eager ')} / {yardstick.removeprefix('eager ')}, {shape}"] = (
                f"{us / their_us:.2f}x")


if __name__ == "__main__":
    benchmark()
