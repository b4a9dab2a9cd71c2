"""The kernel sweep's variants: real tunings, applied for a block, leaving nothing behind."""

import pytest

from cupy_merge import _dispatch, _tuning
from cupy_merge.tools import sweep


@pytest.mark.parametrize(
    "variants", [sweep.TWO_VARIANTS, sweep.MANY_VARIANTS, sweep.BACKWARD_VARIANTS], ids=["two", "many", "backward"]
)
def test_every_variant_is_a_tuning_of_real_fields(variants):
    for settings in variants.values():
        tuning = sweep.tuning_of(settings)
        assert all(getattr(tuning, name) == value for name, value in settings.items())


def test_a_variant_is_a_value_that_leaves_no_global_behind():
    before = _tuning.current()
    with _tuning.use(sweep.tuning_of(sweep.MANY_VARIANTS["chunk8"])) as tuning:
        assert _tuning.current() is tuning and tuning.merge_chunk == 8
        assert "-DMERGE_CHUNK=8" in tuning.compile_options
    assert _tuning.current() is before is _tuning.DEFAULT
    assert tuning != _tuning.DEFAULT and hash(tuning) != hash(_tuning.DEFAULT)


def test_calls_planned_under_another_tuning_are_cached_apart():
    tuning = sweep.tuning_of({"packed_kernels": False})
    with _tuning.use(tuning):
        assert _dispatch._calls_by_tuning.setdefault(tuning, {}) is not _dispatch._calls


def test_use_refuses_what_is_not_a_tuning():
    with pytest.raises(TypeError, match="^tuning: expected"), _tuning.use({"packed_kernels": False}):  # type: ignore[arg-type]
        pass


def test_the_sweep_refuses_a_variant_its_family_lacks(capsys):
    with pytest.raises(SystemExit) as refused:
        sweep.main(["--family", "backward", "--variants", "default,chunk8"])
    assert refused.value.code == 2 and "--variants: chunk8 not among" in capsys.readouterr().err


def test_the_sweep_runs_only_the_cases_whose_labels_it_keeps(monkeypatch):
    made = []

    def states(rng, states, tokens, heads, head_size):  # no arrays: records the case it was asked for
        made.append(sweep._label(states, tokens, heads))
        return None, None, None, made[-1]

    monkeypatch.setattr(sweep, "_states", states)
    monkeypatch.setattr(sweep, "_row", lambda label, nbytes, run, variants: label)
    rows = sweep._sweep_states(None, sweep.BACKWARD_CASES, {}, lambda *args: (0, None),
                               lambda label: label.startswith(("S=16 T=1024", "ragged T=512")))  # fmt: skip
    assert rows == made == ["S=16 T=1024 H=32", "ragged T=512 mean 8"]
