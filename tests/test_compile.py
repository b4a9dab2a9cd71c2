"""NVRTC compiles the kernels from the shipped source (every instantiation with --all-instantiations), and the catalogue matches it."""

from __future__ import annotations

import re

import pytest

from cupy_merge import _catalogue as cat
from cupy_merge import _kernels, _launch, _tuning

SM_90 = _kernels.Target("90")


def _every_module():
    """The modules compiled here: every instantiation of every kernel family, template and output
    dtype, with and without sinks, for bfloat16 inputs; and each same-dtype pair without sinks (the GPU runs
    compile every module with ``python -m cupy_merge --arch``; on CI's two cores all 69 take minutes)."""
    every = cat.every_module()
    assert set(cat.all_modules()) < set(every) and set(cat.all_modules(sinks=True)) < set(every)
    modules = [m for m in every if m.in_dtype == "bfloat16" or (m.in_dtype == m.out_dtype and not m.sinks)]
    assert {m.source for m in modules} == {m.source for m in every} and any(m.sinks for m in modules)
    return modules


@pytest.fixture(scope="module")
def lowered_names(tmp_path_factory):
    """One real compile of every module for sm_90 (into an empty cache folder: nothing compiled
    before is found), in parallel as ``--arch`` compiles; shared by the tests."""
    folder = tmp_path_factory.mktemp("kernel_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUPY_MERGE_CACHE_DIR", str(folder))
        modules = _every_module()
        count = _kernels.compile_ahead(SM_90, modules, progress=False)
        names = {}
        for module in modules:
            compiled = _kernels.cached(module, SM_90)
            assert compiled is not None and not compiled.ptx, module
            names.update(compiled.names)
    assert count == sum(len(cat.module_instances(module)) for module in modules)
    return names


@pytest.mark.exhaustive  # 11 minutes on two cores: CI runs it with --all-instantiations
def test_every_kernel_instantiation_compiles_with_nvrtc(lowered_names):
    expected = {name for module in _every_module() for name in cat.module_instances(module)}
    assert set(lowered_names) == expected
    assert any("true>" in name for name in expected)  # the sinks instantiations are among them
    assert all(name.startswith("_ZN10cupy_merge") for name in lowered_names.values())


@pytest.mark.parametrize(
    "source",
    [
        cat.TWO_STATES_SOURCE,
        # The gradients (no cp.async before sm_80): 40 s on two cores, with the exhaustive compiles.
        pytest.param(cat.BACKWARD_SOURCE, marks=pytest.mark.exhaustive),
    ],
)
def test_an_older_architecture_compiles_too(source):
    module = cat.Module(source, "bfloat16", "bfloat16")  # bfloat16 rounding differs before sm_80
    compiled = _kernels.compile_module(module, _kernels.Target("75"), cache=False)
    assert len(compiled.names) == len(cat.module_instances(module)) and compiled.binary


def _signature(source: str, name: str) -> tuple[list[str], list[str]]:
    """Template parameter names and parameter names of ``__global__ void name(...)`` in ``source``."""
    match = re.search(
        r"template <([^>]*)>\s*__global__ void (?:__launch_bounds__\([^)]*\) )?" + name + r"\(([^)]*)\)", source
    )
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
        _kernels.compile_module(cat.Module(cat.TWO_STATES_SOURCE, "float16", "float16"), SM_90, cache=False)
    assert "error" in raised.value.log
    assert "merge_two_states.cu" in str(raised.value)


def test_a_plan_is_packed_into_one_argument_block(monkeypatch):
    from cupy_merge._plan import KernelLaunch

    monkeypatch.setattr(
        _launch, "get_function", lambda module, kernel, device: _launch.Function(1234, 77, None)
    )
    module = cat.Module(cat.MANY_STATES_SOURCE, "float32", "float32")
    # Parameters 1 and 3 are pointers: operand v at 16 bytes in, and out (not allocated yet).
    plan = KernelLaunch(
        module, "k", (5, 1, 1), (16, 4, 2), 96, (7, 0, 2**40, 0, -3), ((1, "v", 16), (3, "out", 0))
    )
    prepared = _launch.prepare(plan, 0, {"v": 1 << 32, "s": 2 << 32})
    assert (prepared.function, prepared.context, prepared.grid, prepared.block, prepared.shared_bytes) == (
        1234, 77, (5, 1, 1), (16, 4, 2), 96,
    )  # fmt: skip
    assert list(prepared.values) == [7, (1 << 32) + 16, 2**40, 0, -3]  # out's slot stays null until patched
    assert plan.args == (7, 0, 2**40, 0, -3)  # the plan itself holds no address
    pointers = prepared.keep_alive[0]
    assert prepared.params == pointers.__array_interface__["data"][0]
    assert list(pointers) == [prepared.values.__array_interface__["data"][0] + 8 * i for i in range(5)]


def test_a_second_offline_compile_loads_the_first_from_the_disk_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    assert _kernels.cache_folder() == tmp_path
    module = cat.Module(cat.TWO_STATES_SOURCE, "float32", "float32")
    assert _kernels.cached(module, SM_90) is None
    with caplog.at_level("INFO", logger="cupy_merge"):
        first = _kernels.compile_module(module, SM_90)
    assert any("compiled merge_two_states.cu" in record.getMessage() for record in caplog.records)
    assert len(list(tmp_path.glob("*.bin"))) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    (names_file,) = tmp_path.glob("*.json")
    assert names_file.with_suffix(".bin").read_bytes() == first.binary

    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "compileProgram", lambda *args: pytest.fail("compiled again"))
    assert _kernels.compile_module(module, SM_90) == first
    assert _kernels.cached(module, SM_90) == first
    # Ahead-of-time compiles take the same path: nothing left to compile, every kernel counted.
    assert _kernels.compile_ahead(SM_90, [module], progress=False) == len(cat.module_instances(module))
    with pytest.raises(BaseException, match="compiled again"):  # another architecture is another entry
        _kernels.compile_module(module, _kernels.Target("80"))
    with pytest.raises(BaseException, match="compiled again"):  # as are other compile options
        _kernels.compile_module(
            module._replace(options=_tuning.DEFAULT.replace(merge_chunk=8).compile_options), SM_90
        )


def test_a_cached_binary_cut_short_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_MERGE_CACHE_DIR", str(tmp_path))
    module = cat.Module(cat.TWO_STATES_SOURCE, "float16", "float16")
    first = _kernels.compile_module(module, SM_90)
    (binary,) = tmp_path.glob("*.bin")
    binary.write_bytes(first.binary[: len(first.binary) // 2])  # a process that died half way
    assert _kernels.cached(module, SM_90) is None
    again = _kernels.compile_module(module, SM_90)
    assert again.names == first.names and _kernels.cached(module, SM_90) == again  # kept whole this time


def test_a_missing_nvrtc_is_reported_in_one_line_naming_the_wheels(monkeypatch):
    from cupy.cuda import nvrtc

    def missing():
        raise OSError("libnvrtc.so.12: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "getVersion", missing)
    for attempt in (
        _kernels.nvrtc_version,
        _kernels.supported_architectures,
        lambda: _kernels.compile_module(cat.all_modules()[0], SM_90, cache=False),
    ):
        with pytest.raises(
            _kernels.NvrtcMissing, match=r"^NVRTC \(libnvrtc\) could not be loaded: .*pip install nvidia-cuda-nvrtc-cu12"
        ) as raised:
            attempt()
        assert isinstance(raised.value, RuntimeError) and "\n" not in str(raised.value)


def test_a_gpu_newer_than_nvrtc_gets_ptx_it_can_load():
    """The PTX path (the newest architecture NVRTC knows, for a GPU it does not): text whatever
    CuPy's getPTX returns (str in CuPy 13, bytes in 14), its kernels named."""
    module = next(m for m in cat.all_modules() if m.source == "merge_two_states.cu" and m.in_dtype == "float32")
    compiled = _kernels.compile_module(module, _kernels.Target("90", ptx=True), cache=False)
    assert compiled.ptx and isinstance(compiled.binary, bytes) and b".target sm_90" in compiled.binary
    assert set(compiled.names) == set(cat.module_instances(module))
