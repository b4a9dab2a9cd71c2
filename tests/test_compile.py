"""NVRTC compiles every kernel instantiation from the shipped source, with no GPU and no nvcc."""

from __future__ import annotations

import pytest

from cupy_merge import _kernels, _plan


@pytest.mark.parametrize("arch", ["80", "90"])
def test_every_kernel_instantiation_compiles_with_nvrtc(arch):
    lowered = _kernels.compile_offline(arch)
    expected = {name for module in _plan.all_modules() for name in _plan.module_kernel_names(*module)}
    assert set(lowered) == expected
    assert all(name.startswith("_ZN10cupy_merge") for name in lowered.values())


def test_each_dtype_pair_vector_width_and_row_count_is_instantiated():
    names = {name for module in _plan.all_modules() for name in _plan.module_kernel_names(*module)}
    assert "cupy_merge::merge_two_states<float, float, 4, 1, false, int>" in names
    assert (
        "cupy_merge::merge_two_states<cupy_merge::bfloat16_t, cupy_merge::bfloat16_t, 8, 2, false, long long>"
        in names
    )
    assert (
        "cupy_merge::merge_two_states<cupy_merge::bfloat16_t, cupy_merge::bfloat16_t, 8, 8, true, long long>"
        in names
    )
    assert "cupy_merge::merge_two_states<float, cupy_merge::bfloat16_t, 8, 4, false, int>" in names
    assert "cupy_merge::merge_two_states<float, cupy_merge::bfloat16_t, 4, 4, true, long long>" in names
    assert "cupy_merge::merge_many_states<float, cupy_merge::half_t, 8, true, int>" in names
    assert "cupy_merge::merge_many_states<float, float, 1, false, long long>" in names
    # Two-way: 8 dtype pairs x 4 widths x 3 row counts + float32 x 3 x 3, each in 32- and
    # 64-bit offsets, and 3 staged row counts of 16-byte packs for each of the 9 pairs (64-bit);
    # N-way: (8 x 4 + 3) widths x split or not, in 32- and 64-bit offsets.
    assert len(names) == 2 * (8 * 4 * 3 + 3 * 3) + 9 * 3 + 2 * (8 * 4 + 3) * 2


def test_shipped_source_includes_no_cuda_header():
    source = _kernels.kernel_source("merge_two_states.cu")
    assert "#include" not in source  # local headers are inlined, CUDA headers never used
    assert "namespace cupy_merge" in source


def test_nvrtc_failure_raises_with_the_nvrtc_log(monkeypatch):
    broken = _kernels.kernel_source("merge_two_states.cu") + "\nthis is not C++;\n"
    monkeypatch.setattr(_kernels, "kernel_source", lambda name: broken)
    with pytest.raises(_kernels.KernelCompileError) as raised:
        _kernels.compile_offline("90", [("merge_two_states.cu", "float16", "float16")])
    assert "error" in raised.value.log
    assert "merge_two_states.cu" in str(raised.value)


def test_a_plan_is_packed_into_one_argument_block(monkeypatch):
    class FakeFunction:
        ptr = 1234

    monkeypatch.setattr(_kernels, "get_function", lambda module, kernel, device: FakeFunction())
    monkeypatch.setattr(_kernels, "_prepared", {})
    plan = _plan.LaunchPlan(
        ("merge_many_states.cu", "float32", "float32"), "k", (5, 1, 1), (16, 4, 2), (7, -3, 2**40), 96
    )
    prepared = _kernels.prepare(plan, device=0)
    assert (prepared.function, prepared.grid, prepared.block, prepared.shared_bytes) == (
        1234,
        (5, 1, 1),
        (16, 4, 2),
        96,
    )
    values, pointers, _ = prepared.buffers
    assert list(values) == [7, -3, 2**40]
    assert prepared.params == pointers.__array_interface__["data"][0]
    assert list(pointers) == [values.__array_interface__["data"][0] + 8 * i for i in range(3)]
    assert _kernels.prepare(plan, device=0) is prepared  # packed once


def test_a_prepared_launch_passes_grid_block_shared_memory_and_stream(monkeypatch):
    calls = []
    monkeypatch.setattr(_kernels, "_driver_launch", lambda *args: calls.append(args))
    monkeypatch.setattr(_kernels.cupy.cuda.runtime, "getDevice", lambda: 0)
    prepared = _kernels.PreparedLaunch(99, (5, 1, 1), (16, 4, 2), 4096, 96, 0, ())
    _kernels.launch_prepared(prepared, stream=77)
    assert calls == [(99, 5, 1, 1, 16, 4, 2, 96, 77, 4096, 0)]
