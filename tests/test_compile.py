"""NVRTC compiles every kernel instantiation from the shipped source, with no GPU and no nvcc."""

from __future__ import annotations

import pytest

from cupy_merge import _kernels, _plan


@pytest.mark.parametrize("arch", ["80", "90"])
def test_every_kernel_instantiation_compiles_with_nvrtc(arch):
    lowered = _kernels.compile_offline(arch)
    assert set(lowered) == set(_plan.two_state_kernel_names())
    assert all(name.startswith("_ZN10cupy_merge") for name in lowered.values())


def test_each_dtype_and_vector_width_is_instantiated():
    names = _plan.two_state_kernel_names()
    assert "cupy_merge::merge_two_states<float, 4>" in names
    assert "cupy_merge::merge_two_states<cupy_merge::bfloat16_t, 8>" in names
    assert "cupy_merge::merge_two_states<cupy_merge::half_t, 1>" in names
    assert len(names) == 11


def test_shipped_source_includes_no_cuda_header():
    source = _kernels.kernel_source("merge_two_states.cu")
    assert "#include" not in source  # local headers are inlined, CUDA headers never used
    assert "namespace cupy_merge" in source


def test_nvrtc_failure_raises_with_the_nvrtc_log(monkeypatch):
    broken = _kernels.kernel_source("merge_two_states.cu") + "\nthis is not C++;\n"
    monkeypatch.setattr(_kernels, "kernel_source", lambda name: broken)
    with pytest.raises(_kernels.KernelCompileError) as raised:
        _kernels.compile_offline("90")
    assert "error" in raised.value.log
    assert "merge_two_states.cu" in str(raised.value)
