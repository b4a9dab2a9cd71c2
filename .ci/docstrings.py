"""numpydoc validation of every public name (all checks but an extended summary and See Also)."""

from __future__ import annotations

import sys

from numpydoc.validate import validate

import cupy_merge
from cupy_merge import distributed, reference

IGNORED = {"ES01", "SA01"}


def public_names() -> list[str]:
    names = [f"cupy_merge.{name}" for name in cupy_merge.__all__ if callable(getattr(cupy_merge, name))]
    names += ["cupy_merge.BoundMerge.__call__", "cupy_merge.distributed.BoundAcrossRanks.__call__"]
    names += [f"cupy_merge.reference.{name}" for name in reference.__all__]
    names += [
        f"cupy_merge.distributed.{name}"
        for name in distributed.__all__
        if callable(getattr(distributed, name))
    ]
    return names


def main() -> int:
    failures = 0
    for name in public_names():
        for code, message in validate(name)["errors"]:
            if code not in IGNORED:
                print(f"{name}: {code} {message}")
                failures += 1
    print(f"numpydoc: {len(public_names())} public names, {failures} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
