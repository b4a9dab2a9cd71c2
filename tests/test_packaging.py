"""The built wheel carries the CUDA source, and the installed package finds it as a resource."""

from __future__ import annotations

import importlib.resources
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_installed_package_loads_the_kernel_source_as_a_resource():
    folder = importlib.resources.files("cupy_merge.cuda_src")
    assert "__global__ void merge_two_states" in (folder / "merge_two_states.cu").read_text()
    assert (folder / "numerics.cuh").is_file()


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_wheel_contains_the_cuda_source(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("cupy_merge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cupy_merge/cuda_src/merge_two_states.cu" in names
    assert "cupy_merge/cuda_src/numerics.cuh" in names
    assert "cupy_merge/py.typed" in names
