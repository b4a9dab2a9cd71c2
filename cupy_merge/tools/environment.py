"""What ``python -m cupy_merge --info`` prints, and the one-line answers when CuPy or NVRTC is missing.

Nothing here needs CuPy to import: versions of the other packages are read from
their installed metadata, so ``--info`` imports neither torch nor JAX.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

from .._version import __version__

#: What each missing piece needs, in one line.
CUPY_MISSING = (
    "CuPy is not installed: pip install 'cupy-cuda12x>=14' nvidia-cuda-nvrtc-cu12 (CUDA 12) or 'cupy-cuda13x>=14' "
    "'nvidia-cuda-nvrtc>=13,<14' (CUDA 13); from a checkout, pip install -e '.[cu12]' or '.[cu13]'"
)


class Missing(Exception):
    """CuPy or NVRTC cannot be loaded; the message says what to install."""


def require_cupy() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise Missing(CUPY_MISSING) from None


def require_nvrtc() -> tuple[int, ...]:
    """The architectures NVRTC compiles for; ``Missing`` naming the extra when it cannot be loaded."""
    from .. import _kernels

    try:
        return _kernels.supported_architectures()
    except RuntimeError as error:
        raise Missing(str(error)) from None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_version(*distributions: str) -> tuple[str, str] | None:
    for distribution in distributions:
        version = _version(distribution)
        if version is not None:
            return distribution, version
    return None


def _at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    if version is None:
        return False
    parts = []
    for part in version.split("+")[0].split(".")[: len(minimum)]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= minimum


def lines(brief: bool = False) -> list[str]:
    """Versions, devices, integrations and configuration, one fact a line; compiles nothing.

    ``brief`` (the self-check's): the architectures NVRTC targets as a range and the compile
    options as a count, where ``--info`` lists each."""
    out = [f"cupy-merge {__version__}, Python {platform.python_version()} ({sys.executable})"]
    cupy_dist = _first_version("cupy-cuda13x", "cupy-cuda12x", "cupy")
    try:
        import cupy
    except ImportError:
        out.append(CUPY_MISSING)
        cupy = None
    else:
        out.append(f"cupy {cupy.__version__} ({cupy_dist[0] if cupy_dist else 'cupy'}), numpy {_version('numpy')}")
        from .. import _kernels

        try:
            major, minor = _kernels.nvrtc_version()
            known = _kernels.supported_architectures()
            targets = (f"{len(known)} architectures, sm_{known[0]} to sm_{known[-1]}" if brief
                       else f"sm_{', sm_'.join(map(str, known))}")  # fmt: skip
            out.append(f"NVRTC {major}.{minor}, compiles for {targets}")
        except RuntimeError as error:
            out.append(str(error))
    torch_version, jax_version = _version("torch"), _version("jax")
    out.append(f"torch {torch_version or 'not installed'}; JAX {jax_version or 'not installed'}"
               + (f" (jaxlib {_version('jaxlib')})" if jax_version else ""))  # fmt: skip
    out.append(
        "integrations: torch ops for torch.compile and torch.export "
        + ("available" if _at_least(torch_version, (2, 4)) else "need torch 2.4 or newer")
        + "; JAX jit and vmap "
        + ("available (on a CUDA JAX)" if _at_least(jax_version, (0, 6, 1)) else "need JAX 0.6.1 or newer")
    )
    if cupy is not None:
        out += _devices(cupy)
        from .. import _kernels, _tuning

        tuning = _tuning.DEFAULT
        options = tuning.compile_options
        if brief:
            tuned = "the defaults" if options == _tuning.Tuning().compile_options else "not the defaults"
            out.append(f"compile options: {options[0]} and {len(options) - 1} -DMERGE_* tuning values, "
                       f"{tuned} (--info lists them)")  # fmt: skip
        else:
            out.append(f"kernels compiled with {' '.join(options)}")
        out.append(f"packed kernels {'on' if tuning.packed_kernels else 'off'}; programmatic launch "
                   f"{'on' if tuning.programmatic_launch else 'off'} (sm_90 and newer)")  # fmt: skip
        out.append(f"compiled kernels are kept in {_kernels.cache_folder()} (CUPY_MERGE_CACHE_DIR)")
    return out


def _devices(cupy) -> list[str]:
    try:
        if not cupy.cuda.is_available():
            return ["no CUDA device found"]
        runtime = cupy.cuda.runtime
        out = [f"CUDA driver {runtime.driverGetVersion()}, runtime {runtime.runtimeGetVersion()}"]
        for device in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(device)
            out.append(f"device {device}: {props['name'].decode()} (sm_{props['major']}{props['minor']})")
        return out
    except Exception as error:  # noqa: BLE001 - a broken driver is reported, not raised
        return [f"CUDA devices could not be read: {error}"]
