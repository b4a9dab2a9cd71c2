"""NVRTC compiles every kernel instantiation from the shipped source, and the catalogue matches it."""

from __future__ import annotations

import re

import pytest

from cupy_merge import _catalogue as cat
from cupy_merge import _kernels


@pytest.fixture(scope="module")
def lowered_names():
    """One real compile of every module for sm_90 (the disk cache bypassed), shared by the tests."""
    return _kernels.compile_offline("90", cache=False)


def test_every_kernel_instantiation_compiles_with_nvrtc(lowered_names):
    expected = {name for module in cat.all_modules() for name in cat.module_instances(module)}
    assert set(lowered_names) == expected
    assert all(name.startswith("_ZN10cupy_merge") for name in lowered_names.values())


def test_an_older_architecture_compiles_too():
    module = cat.Module(
        cat.TWO_STATES_SOURCE, "bfloat16", "bfloat16"
    )  # bfloat16 rounding differs before sm_80
    assert len(_kernels.compile_offline("75", [module], cache=False)) == len(cat.module_instances(module))


def _signature(source: str, name: str) -> tuple[list[str], list[str]]:
    """Template parameter names and parameter names of ``__global__ void name(...)`` in ``source``."""
    match = re.search(r"template <([^>]*)>\s*__global__ void " + name + r"\(([^)]*)\)", source)
    assert match, f"no __global__ {name} in the source"
    template = [part.split()[-1] for part in match.group(1).split(",")]
    params = [re.split(r"[\s*]+", part.strip())[-1] for part in match.group(2).split(",")]
    return template, params


@pytest.mark.parametrize("family", cat.FAMILIES, ids=lambda family: family.name)
def test_the_catalogue_matches_each_kernels_signature(family):
    template, params = _signature(_kernels.kernel_source(family.source), family.name)
    assert tuple(template) == family.template
    assert tuple(params) == family.params


def test_arguments_must_name_every_parameter():
    with pytest.raises(TypeError, match="missing arguments"):
        cat.TWO_PACKED.arguments(out=1)


def test_shipped_source_includes_no_cuda_header():
    source = _kernels.kernel_source("merge_two_states.cu")
    assert "#include" not in source  # local headers are inlined, CUDA headers never used
    assert "namespace cupy_merge" in source


def test_nvrtc_failure_raises_with_the_nvrtc_log(monkeypatch):
    broken = _kernels.kernel_source("merge_two_states.cu") + "\nthis is not C++;\n"
    monkeypatch.setattr(_kernels, "kernel_source", lambda name: broken)
    with pytest.raises(_kernels.KernelCompileError) as raised:
        _kernels.compile_offline("90", [cat.Module(cat.TWO_STATES_SOURCE, "float16", "float16")], cache=False)
    assert "error" in raised.value.log
    assert "merge_two_states.cu" in str(raised.value)


def test_a_plan_is_packed_into_one_argument_block(monkeypatch):
    from cupy_merge._plan import LaunchPlan

    monkeypatch.setattr(
        _kernels, "get_function", lambda module, kernel, device: _kernels.Function(1234, 77, None)
    )
    module = cat.Module(cat.MANY_STATES_SOURCE, "float32", "float32")
    plan = LaunchPlan(module, "k", (5, 1, 1), (16, 4, 2), (7, -3, 2**40), 96, 0, 1)
    prepared = _kernels.prepare(plan, device=0)
    assert (prepared.function, prepared.context, prepared.grid, prepared.block, prepared.shared_bytes) == (
        1234, 77, (5, 1, 1), (16, 4, 2), 96,
    )  # fmt: skip
    assert list(prepared.values) == [7, -3, 2**40]
    pointers = prepared.keep_alive[0]
    assert prepared.params == pointers.__array_interface__["data"][0]
    assert list(pointers) == [prepared.values.__array_interface__["data"][0] + 8 * i for i in range(3)]


def test_a_second_offline_compile_loads_the_first_from_the_disk_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    module = cat.Module(cat.TWO_STATES_SOURCE, "float32", "float32")
    with caplog.at_level("INFO", logger="cupy_merge"):
        first = _kernels.compile_offline("90", [module])
    assert any("compiled merge_two_states.cu" in record.getMessage() for record in caplog.records)
    assert len(list(tmp_path.glob("*.cubin"))) == 1 and len(list(tmp_path.glob("*.json"))) == 1

    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "compileProgram", lambda *args: pytest.fail("compiled again"))
    assert _kernels.compile_offline("90", [module]) == first
    with pytest.raises(BaseException, match="compiled again"):  # another architecture is another entry
        _kernels.compile_offline("80", [module])


def test_a_missing_nvrtc_is_reported_in_one_line_naming_the_extras(monkeypatch):
    from cupy.cuda import nvrtc

    def missing():
        raise OSError("libnvrtc.so.12: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "getVersion", missing)
    with pytest.raises(RuntimeError, match=r"^NVRTC \(libnvrtc\) could not be loaded: .*cupy-merge\[cu12\]"):
        _kernels.compile_offline("90", cache=False)
