"""Shared fixtures: GPU detection, random states, and conversions to float64 on the host."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    except (ImportError, RuntimeError):  # CUDARuntimeError is a RuntimeError
        return 0


GPU_COUNT = _gpu_count()

# JAX otherwise takes most of the GPU's memory at import, starving the other tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_addoption(parser):
    parser.addoption(
        "--strided-kernels",
        action="store_true",
        help="plan every merge on the general (strided) kernels, as for arrays the packed ones do not take",
    )
    parser.addoption(
        "--all-instantiations",
        action="store_true",
        help="also run the exhaustive tests (marked exhaustive): NVRTC compiles of every kernel "
        "instantiation and the larger gloo worlds, about 12 minutes on two cores",
    )


@pytest.fixture(autouse=True)
def _strided_kernels(request):
    """With --strided-kernels, every test plans its merges on the general kernels."""
    if not request.config.getoption("--strided-kernels"):
        yield
        return
    from cupy_merge import _tuning

    with _tuning.use(_tuning.DEFAULT.replace(packed_kernels=False)):
        yield


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    skip_exhaustive = pytest.mark.skip(reason="exhaustive: run with --all-instantiations")
    exhaustive = config.getoption("--all-instantiations")
    for item in items:
        if "gpu" in item.keywords and GPU_COUNT == 0:
            item.add_marker(skip)
        if "exhaustive" in item.keywords and not exhaustive:
            item.add_marker(skip_exhaustive)


@pytest.fixture
def rng():
    # Fresh data every run: a fixed seed would let a wrong kernel pass by luck forever.
    return np.random.default_rng()
