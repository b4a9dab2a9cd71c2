"""``python -m cupy_merge`` (also the ``cupy-merge`` command): self-check, environment, ahead-of-time compile."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from . import __version__

_ARCH = re.compile(r"^(?:sm_?)?(\d{2,3}[a-z]?)$")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cupy_merge",
        description="With no option: print the environment, compile the kernels and check merges on the "
        "GPU against a float64 reference (without a GPU: compile for sm_90 only). Exit status 0 when "
        "everything passed, 1 when a check failed, 2 on bad options.",
    )
    parser.add_argument("--version", action="version", version=f"cupy-merge {__version__}")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--info", action="store_true", help="print the environment and configuration; compile nothing"
    )
    action.add_argument(
        "--arch",
        metavar="SM",
        help="compile every kernel for this architecture (e.g. 90 or sm_90) with NVRTC alone, "
        "no GPU needed; the result is cached on disk",
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
    from . import _catalogue
    from .tools import selfcheck

    if args.info:
        print("\n".join(selfcheck.environment()))
        return 0
    if args.arch is not None:
        match = _ARCH.match(args.arch)
        if match is None:
            parser.error(f"--arch: expected an architecture such as 90 or sm_90, got {args.arch!r}")
        from ._kernels import KernelCompileError

        try:
            print(selfcheck.compile_ahead(match.group(1), _catalogue.all_modules()))
        except KernelCompileError as error:
            print(
                f"NVRTC cannot compile for sm_{match.group(1)}: {error.log.strip().splitlines()[-1]}",
                file=sys.stderr,
            )
            return 1
        return 0
    return selfcheck.run()


if __name__ == "__main__":
    sys.exit(main())
