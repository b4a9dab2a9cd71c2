"""The benchmark's rows and what it writes: the derived columns, the two tables, the environment
line, the results files and the plot (for ``python -m cupy_merge.bench``, :mod:`.bench`).

:func:`finish_row` adds a row's ratios to its times; :func:`format_table` lays rows out under
:data:`COLUMNS` (the merge table) or :data:`HOST_COLUMNS` (host cost per call); :func:`environment`
reads the date, GPU, driver and versions that :func:`environment_line` prints above them;
:func:`write_results` and :func:`plot` write ``--out`` and ``--plot``. Only :func:`environment`
asks the GPU anything.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import cupy

from .._version import __version__
from .bench_cases import FAMILIES

# ---------------------------------------------------------------------------------------------
# Rows and tables (pure)


def _time(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:.0f}"


def _mbytes(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}"


#: The merge table: (column, formatter); every row has these keys or lacks them ('-').
COLUMNS: list[tuple[str, Callable[[Any], str]]] = [
    ("family", str), ("case", str), ("mbytes", _mbytes),
    ("merge_us", _time), ("copy_us", _time), ("pct_of_copy", "{:.1f}".format), ("gbps", "{:.0f}".format),
    ("torch_us", _time), ("compiled_us", _time), ("graph_us", _time), ("chained_us", _time),
    ("unfused_us", _time), ("baseline_us", _time), ("overhead_pct", "{:+.1f}".format),
    ("flashinfer_us", _time), ("cm_fi_layout_us", _time), ("fi_over_cm", "{:.2f}".format),
    ("maxdiff", "{:.1e}".format), ("invariant_us", _time), ("invariant_cost_pct", "{:+.1f}".format),
]  # fmt: skip
#: The host-cost table (microseconds of host time per call).
HOST_COLUMNS: list[tuple[str, Callable[[Any], str]]] = [
    ("case", str), ("host_cupy_us", _time), ("host_torch_us", _time), ("bound_cupy_us", _time),
    ("bound_torch_us", _time), ("alloc_torch_us", _time), ("add_cupy_us", _time), ("add_torch_us", _time),
    ("add_alloc_torch_us", _time),
]  # fmt: skip
_TEXT_COLUMNS = {"family", "case"}


def overhead_pct(with_us: float, without_us: float) -> float:
    """The added time in percent: ``100 * (with_us - without_us) / without_us``."""
    return 100 * (with_us - without_us) / without_us


def finish_row(row: dict) -> dict:
    """Add the derived columns (pct_of_copy, gbps, overhead_pct, fi_over_cm) to a row of times."""
    merge_us = row.get("merge_us")
    if merge_us:
        if row.get("copy_us"):
            row["pct_of_copy"] = 100 * row["copy_us"] / merge_us
        row["gbps"] = row["mbytes"] * 1e6 / merge_us / 1e3
        if row.get("baseline_us"):
            row["overhead_pct"] = overhead_pct(merge_us, row["baseline_us"])
        if row.get("flashinfer_us"):
            ours = min(t for t in (merge_us, row.get("cm_fi_layout_us")) if t)
            row["fi_over_cm"] = row["flashinfer_us"] / ours
        if row.get("invariant_us"):
            row["invariant_cost_pct"] = overhead_pct(row["invariant_us"], merge_us)
    return row


def _cell(value: Any, fmt: Callable[[Any], str]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt(value)


def format_table(rows: list[dict], columns: list[tuple[str, Callable[[Any], str]]] | None = None) -> str:
    """A header line and one line per row; text columns left-aligned, numbers right; '-' where missing."""
    columns = COLUMNS if columns is None else columns
    table = [[name for name, _ in columns]]
    table += [[_cell(row.get(name), fmt) for name, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join(
        " ".join(
            f"{cell:<{width}}" if name in _TEXT_COLUMNS else f"{cell:>{width}}"
            for cell, width, (name, _) in zip(line, widths, columns)
        ).rstrip()
        for line in table
    )


def cuda_version_string(version: int) -> str:
    """CUDA's integer version (12080) as ``12.8``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def environment_line(env: dict) -> str:
    """One line: date, GPU, driver, CUDA runtime and the versions of cupy, torch and cupy-merge."""
    return (
        f"{env.get('date', '?')} | {env.get('gpu', '?')} | driver {env.get('driver', '?')} | "
        f"CUDA runtime {env.get('cuda_runtime', '?')} | cupy {env.get('cupy', '?')} | "
        f"torch {env.get('torch', 'not installed')} | cupy-merge {env.get('cupy_merge', '?')}"
        + (f" | {env['flashinfer']}" if env.get("flashinfer") else "")
    )


# ---------------------------------------------------------------------------------------------
# Environment, output files, plot


def _nvidia_driver() -> str | None:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]
        done = subprocess.run(query, check=False, capture_output=True, text=True, timeout=10)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Date, GPU, driver, CUDA runtime and versions, for the line above the table and the plot's title."""
    runtime = cupy.cuda.runtime
    device = cupy.cuda.Device()
    props = runtime.getDeviceProperties(device.id)
    driver_cuda = cuda_version_string(runtime.driverGetVersion())
    driver = _nvidia_driver()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "gpu": f"{props['name'].decode()} (sm_{device.compute_capability})",
        "driver": f"{driver} (CUDA {driver_cuda})" if driver else f"CUDA {driver_cuda}",
        "cuda_runtime": cuda_version_string(runtime.runtimeGetVersion()),
        "cupy": cupy.__version__,
        "torch": torch_version,
        "cupy_merge": __version__,
    }


def write_results(rows: list[dict], host_rows: list[dict], env: dict, path: str) -> None:
    """JSON: ``{"environment", "rows", "host"}``; CSV: one table, its ``table`` column ``merge`` or ``host``."""
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"environment": env, "rows": rows, "host": host_rows}, f, indent=1)
        return
    names = ["table"] + list(dict.fromkeys(name for name, _ in COLUMNS + HOST_COLUMNS))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([{"table": "merge", **row} for row in rows])
        writer.writerows([{"table": "host", **row} for row in host_rows])


_MARKERS = "os^vD<>ph*Xd"


def plot(rows: list[dict], env: dict, path: str) -> bool:
    """% of copy against traffic (log x), a marker per family; FI/cm beside where measured. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        return False
    with_fi = [r for r in rows if r.get("fi_over_cm")]
    fig, axes = plt.subplots(1, 2 if with_fi else 1, figsize=(13 if with_fi else 8, 5), squeeze=False)
    left = axes[0][0]
    for index, family in enumerate(FAMILIES):
        points = [
            (r["mbytes"], r["pct_of_copy"]) for r in rows if r["family"] == family and r.get("pct_of_copy")
        ]
        if points:
            left.scatter(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=family, alpha=0.8)
    left.axhline(100, color="grey", lw=0.5)
    left.set(xscale="log", xlabel="traffic (MB)", ylabel="% of same-bytes copy speed", title="merge vs copy")
    left.legend(fontsize="small", ncol=2)
    if with_fi:
        right = axes[0][1]
        for index, family in enumerate(FAMILIES):
            points = [(r["mbytes"], r["fi_over_cm"]) for r in with_fi if r["family"] == family]
            if points:
                right.scatter(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=family)
        right.axhline(1, color="grey", lw=0.5)
        right.set(xscale="log", xlabel="traffic (MB)", ylabel="FlashInfer time / cupy-merge time",
                  title="FlashInfer / cupy-merge (above 1: cupy-merge faster)")  # fmt: skip
        right.legend(fontsize="small")
    fig.suptitle(f"cupy-merge {env.get('cupy_merge')} on {env.get('gpu')}, {env.get('date')}; "
                 f"cupy {env.get('cupy')}, torch {env.get('torch')}", fontsize="medium")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
