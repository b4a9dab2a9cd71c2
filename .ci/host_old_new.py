"""Issue 48's host-cost table: the old tree (``.old/``: the package and ``cuda_src`` of the commit
before the redesign, a5a022b) against this one, in one run: ``.ci/host_cost.py`` in a fresh
process for each, alternating, three rounds; the median of each row and new / old.

Make ``.old`` here (it is git-ignored, carried to the device with ``carry``):
    rm -rf .old && mkdir .old && git archive a5a022b cupy_merge cuda_src | tar -x -C .old

Usage: python3 .ci/host_old_new.py
"""

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

ROUNDS = 3


def _old_sources_beside_the_old_package() -> None:
    """``cupy_merge.cuda_src`` of the old tree as a package of its own: without it the editable
    install's finder hands the old package this tree's kernels, whose arguments it does not pass
    (the launch fails with CUDA_ERROR_INVALID_VALUE)."""
    inside = pathlib.Path(".old/cupy_merge/cuda_src")
    if not inside.exists():
        shutil.copytree(".old/cuda_src", inside)
        (inside / "__init__.py").touch()


def run(tree: str) -> dict:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    if tree == "old":
        _old_sources_beside_the_old_package()
        env["PYTHONPATH"] = ".old"
    done = subprocess.run([sys.executable, ".ci/host_cost.py"], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree} tree: host_cost.py failed (rc {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-3000:]}")
    sys.stderr.write("".join(f"{tree}: {line}\n" for line in done.stderr.splitlines() if "left out" in line))
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    results: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for round_ in range(ROUNDS):
        for tree in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
            for row, us in run(tree).items():
                results[tree].setdefault(row, []).append(us)
    print(f"{'call (1 x 32 x 128 bf16)':<44} {'old us':>8} {'new us':>8} {'new/old':>8}   rounds (old | new)")
    for row in results["new"]:
        new = statistics.median(results["new"][row])
        old_values = results["old"].get(row)
        old = statistics.median(old_values) if old_values else float("nan")
        spread = f"{' '.join(f'{v:.1f}' for v in old_values or [])} | {' '.join(f'{v:.1f}' for v in results['new'][row])}"
        print(f"{row:<44} {old:8.2f} {new:8.2f} {new / old:8.2f}   {spread}")
    # JAX's eager times drift together between processes (40 % between rounds, session 31): each
    # JAX row as a multiple of JAX's own a + b in the same process drifts far less.
    yardstick = "jax a + b (eager)"
    if yardstick in results["new"] and yardstick in results["old"]:
        print(f"\n{'JAX rows / a + b in the same process':<44} {'old':>8} {'new':>8} {'new/old':>8}")
        for row in results["new"]:
            if row.startswith("jax") and row != yardstick and row in results["old"]:
                ratio = {tree: statistics.median(a / b for a, b in zip(results[tree][row], results[tree][yardstick]))
                         for tree in ("old", "new")}  # fmt: skip
                print(f"{row:<44} {ratio['old']:8.2f} {ratio['new']:8.2f} {ratio['new'] / ratio['old']:8.2f}")


if __name__ == "__main__":
    main()
