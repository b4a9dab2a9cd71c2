"""``python -m cupy_merge`` (also the ``cupy-merge`` command): self-check, environment, ahead-of-time compile.

``--help``, ``--version`` and ``--info`` answer without CuPy; what needs CuPy or
NVRTC says in one line what to install and exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from ._version import __version__

_ARCH = re.compile(r"^(?:sm_?)?(\d{2,3}[a-z]?)$")


def _program_name() -> str:
    """The command as it was called: ``cupy-merge`` or ``python -m cupy_merge``."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "cupy-merge" if called == "cupy-merge" else "python -m cupy_merge"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_program_name(),
        description="With no option: print the environment, compile the same-dtype merges' kernels and "
        "check merges on the GPU against a float64 reference (without a GPU: compile them for sm_90 "
        "only). Exit status 0 when everything passed, 1 when a check failed, CuPy or NVRTC is missing "
        "or the cache folder cannot be written, 2 on bad options.",
    )
    parser.add_argument("--version", action="version", version=f"cupy-merge {__version__}")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--info", action="store_true", help="print the environment and configuration; compile nothing"
    )
    action.add_argument(
        "--arch",
        metavar="SM",
        help="compile every kernel module for this architecture (e.g. 90 or sm_90) with NVRTC alone, no "
        "GPU needed, into the cache folder (CUPY_MERGE_CACHE_DIR; checked first), where a GPU of that "
        "architecture loads them without NVRTC; progress on standard error",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each compilation and its time")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    from .tools import environment

    if args.info:
        print("\n".join(environment.lines()))
        return 0
    try:
        if args.arch is not None:
            return _compile_for(parser, args.arch)
        environment.require_cupy()
        from .tools import selfcheck

        return selfcheck.run()
    except environment.Missing as missing:
        print(f"{parser.prog}: {missing}", file=sys.stderr)
        return 1
    except RuntimeError as error:  # NVRTC missing part way (a cold cache on a GPU machine), a cache folder
        if type(error).__name__ not in ("NvrtcMissing", "CacheFolderError"):  # that cannot be written
            raise
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1


def _compile_for(parser: argparse.ArgumentParser, arch: str) -> int:
    from .tools import environment

    match = _ARCH.match(arch)
    if match is None:
        parser.error(f"--arch: expected an architecture such as 90 or sm_90, got {arch!r}")
    environment.require_cupy()
    known = environment.require_nvrtc()
    wanted = match.group(1)
    if not wanted.isdigit() or int(wanted) not in known:
        parser.error(
            f"--arch: this NVRTC compiles for {', '.join(f'sm_{a}' for a in known)}; got sm_{wanted}"
        )
    from .tools import selfcheck

    print(selfcheck.compile_ahead(wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
