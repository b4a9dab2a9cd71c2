"""The kernel sweep's settings: applied for a block, restored after, with nothing compiled or prepared kept."""

from cupy_merge import _catalogue, _dispatch, _kernels, _plan
from cupy_merge.tools import sweep


def test_every_variant_names_only_constants_that_exist():
    for variants in (sweep.TWO_VARIANTS, sweep.MANY_VARIANTS):
        for settings in variants.values():
            for name in settings:
                assert hasattr(sweep._Settings._owner(name), name), name


def test_settings_are_restored_and_compiled_modules_forgotten_when_the_options_change(monkeypatch):
    before = (_plan.MIN_ROW_THREADS, _catalogue.MERGE_CHUNK, _catalogue.COMPILE_OPTIONS)
    monkeypatch.setitem(_kernels._modules, ("a module", 0), object())
    monkeypatch.setitem(_dispatch._calls, "a prepared call", object())
    with sweep._Settings(sweep.MANY_VARIANTS["chunk8"] | {"MIN_ROW_THREADS": 16}):
        assert (_plan.MIN_ROW_THREADS, _catalogue.MERGE_CHUNK) == (16, 8)
        assert "-DMERGE_CHUNK=8" in _catalogue.COMPILE_OPTIONS
        assert not _kernels._modules and not _dispatch._calls
        _kernels._modules[("compiled with chunks of 8", 0)] = object()
    assert (_plan.MIN_ROW_THREADS, _catalogue.MERGE_CHUNK, _catalogue.COMPILE_OPTIONS) == before
    assert not _kernels._modules, "a module compiled with the variant's options would outlive it"
