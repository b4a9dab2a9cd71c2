"""The built wheel carries the CUDA source, and the installed package finds it as a resource."""

from __future__ import annotations

import importlib.resources
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The headers the kernels include (inlined by ``_kernels.with_includes``).
HEADERS = ("conversions.cuh", "packs.cuh", "grid.cuh", "fp8.cuh")


def _shipped_sources() -> list[str]:
    """Every .cu and .cuh file of the source tree's cuda_src/."""
    return sorted(path.name for path in (ROOT / "cuda_src").iterdir() if path.suffix in (".cu", ".cuh"))


def test_the_kernel_source_read_is_the_imported_packages_own():
    """An installed package (a wheel) reads the package resource ``cupy_merge.cuda_src`` inside it;
    a source tree (a checkout or an unpacked sdist: installed editable, not installed, or imported
    ahead of an installed wheel) reads the top-level ``cuda_src/`` beside its ``cupy_merge/``, never
    another copy's."""
    import re

    import cupy_merge
    from cupy_merge import _kernels

    package = pathlib.Path(cupy_merge.__file__).resolve().parent
    in_a_source_tree = (package.parent / "pyproject.toml").is_file()
    folder = _kernels._source_folder()
    if in_a_source_tree:
        assert pathlib.Path(str(folder)).resolve() == package.parent / "cuda_src"
    else:
        assert folder == importlib.resources.files("cupy_merge.cuda_src")
        assert pathlib.Path(str(folder)).resolve() == package / "cuda_src"
    assert "__global__ void merge_two_states" in (folder / "merge_two_states.cu").read_text()
    for header in HEADERS:
        assert (folder / header).is_file(), header
    # Every header a kernel file names, directly or through another header, is there to inline.
    for source in ("merge_two_states.cu", "merge_many_states.cu", "merge_across_ranks.cu"):
        text = (folder / source).read_text()
        for header in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE):
            assert (folder / header).is_file(), header
        assert "#include" not in _kernels.kernel_source(source)


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
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "cupy_merge/cuda_src/merge_two_states.cu" in names
    for header in HEADERS:
        assert f"cupy_merge/cuda_src/{header}" in names, header
    for source in _shipped_sources():
        assert f"cupy_merge/cuda_src/{source}" in names, source
    assert "cupy_merge/py.typed" in names
    assert "cupy_merge/tools/bench.py" in names and "cupy_merge/distributed/__init__.py" in names
    (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    text = archive.read(metadata).decode()
    import cupy_merge

    assert f"Version: {cupy_merge.__version__}" in text  # one version, read from the package
    assert "License-Expression: Apache-2.0" in text and "License-File: LICENSE" in text
    # No CuPy wheel is forced on a machine that has the other CUDA major's.
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist: cupy")]
    assert requires and all("extra ==" in line for line in requires)


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_sdist_carries_the_tests_their_helpers_and_the_license(tmp_path):
    import tarfile

    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("cupy_merge-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ["LICENSE", "CHANGELOG.md", *(f"cuda_src/{h}" for h in HEADERS), "tests/conftest.py",
                   "tests/gpu_arrays.py", "tests/bad_inputs.py", "tests/views.py", "tests/test_plan.py",
                   "examples/torch_drop_in.py", "cupy_merge/_version.py"]:  # fmt: skip
        assert needed in names, needed
    for source in _shipped_sources():
        assert f"cuda_src/{source}" in names, source
