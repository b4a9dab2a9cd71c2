"""Attention sinks in the float64 reference and the argument rules (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
from sinks_reference import attention_with_sinks, split_states

from cupy_merge import _dispatch, _tuning, reference
from cupy_merge._arrays import ArraySpec, contiguous_strides
from cupy_merge._operands import ManyStateOperands, TwoStateOperands
from cupy_merge._ops import MERGE_STATE, MERGE_STATES


@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("empty", [(), (1,)])
def test_merging_the_pieces_with_the_sinks_is_attention_with_sinks_over_the_whole_sequence(rng, lse_base, empty):
    (q, k, v), values, lses = split_states(rng, 5, 3, 16, 90, 4, empty)
    sinks = rng.standard_normal(3) * 2
    base = np.log(2.0) if lse_base == 2 else 1.0
    got_v, got_s = reference.merge_states(values, lses / base, lse_base, sinks=sinks)
    want_v, want_s = attention_with_sinks(q, k, v, sinks)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_s * base, want_s, rtol=1e-12)


def test_two_way_and_ragged_references_count_the_sink_once(rng):
    (q, k, v), values, lses = split_states(rng, 4, 2, 8, 40, 2)
    sinks = np.array([0.5, -1.0])
    want_v, want_s = attention_with_sinks(q, k, v, sinks)
    two_v, two_s = reference.merge_state(values[0], lses[0], values[1], lses[1], sinks=sinks)
    np.testing.assert_allclose(two_v, want_v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(two_s, want_s, rtol=1e-12)
    rows = values.transpose(1, 0, 2, 3).reshape(-1, 2, 8)  # token-major rows: token t's two states
    indptr = np.arange(0, 9, 2)
    ragged_v, ragged_s = reference.merge_states_varlen(rows, lses.transpose(1, 2, 0).reshape(2, -1), indptr,
                                                       sinks=sinks)  # fmt: skip
    np.testing.assert_allclose(ragged_v, want_v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ragged_s, want_s, rtol=1e-12)


def test_no_states_with_a_sink_give_zero_and_the_sink():
    sinks = np.array([1.5, -np.inf])
    out, lse = reference.merge_states(np.zeros((0, 3, 2, 4)), np.zeros((0, 2, 3)), sinks=sinks)
    assert (out == 0).all() and (lse[0] == 1.5).all() and np.isneginf(lse[1]).all()
    out, lse = reference.merge_states_varlen(np.ones((2, 2, 4)), np.zeros((2, 2)), [0, 0, 2], sinks=sinks)
    assert (out[0] == 0).all() and lse[0, 0] == 1.5
    assert np.allclose(out[1, 1], 1.0) and np.isclose(lse[1, 1], np.log(2.0))  # no sink: the two states


def test_empty_and_plus_inf_states_contribute_nothing_beside_a_sink():
    v = np.stack([np.full((1, 1, 4), np.nan), np.full((1, 1, 4), 2.0)])
    s = np.array([[[np.inf]], [[0.0]]])
    out, lse = reference.merge_states(v, s, sinks=np.array([0.0]))
    np.testing.assert_allclose(out, 1.0)  # half the weight on the sink's zero
    np.testing.assert_allclose(lse, np.log(2.0))


def test_a_nan_sink_makes_its_heads_rows_nan_and_a_plus_inf_sink_takes_all_the_weight():
    v = np.ones((2, 3, 2, 4))
    s = np.zeros((2, 2, 3))
    out, lse = reference.merge_states(v, s, sinks=np.array([np.nan, np.inf]))
    assert np.isnan(out[:, 0]).all() and np.isnan(lse[0]).all()
    assert (out[:, 1] == 0).all() and np.isposinf(lse[1]).all()


def _spec(shape, dtype="float16", itemsize=2):
    return ArraySpec(tuple(shape), contiguous_strides(tuple(shape)), dtype, itemsize, 0)


@pytest.mark.parametrize(
    "sinks, error, words",
    [
        (_spec((3,), "float32", 4), ValueError, r"^sinks: expected shape \(4,\)"),
        (_spec((4,), "float16"), TypeError, "^sinks: expected float32 sink logits"),
        (_spec((4, 1), "float32", 4), ValueError, "^sinks: expected a 1-D array"),
    ],
)
def test_bad_sinks_are_refused_naming_the_argument(sinks, error, words):
    values, lse = _spec((5, 4, 8)), _spec((4, 5), "float32", 4)
    two = TwoStateOperands(None, None, values, lse, values, lse, sinks=sinks)
    with pytest.raises(error, match=words):
        _dispatch.plan_specs(MERGE_STATE, MERGE_STATE.options(), _tuning.DEFAULT, two)
    many = ManyStateOperands(None, None, _spec((3, 5, 4, 8)), _spec((3, 4, 5), "float32", 4), sinks=sinks)
    with pytest.raises(error, match=words):
        _dispatch.plan_specs(MERGE_STATES, MERGE_STATES.options(), _tuning.DEFAULT, many)


def test_sinks_plan_their_own_instantiations_and_nothing_changes_without_them():
    values, lse, sinks = _spec((5, 4, 8)), _spec((4, 5), "float32", 4), _spec((4,), "float32", 4)
    plain = _dispatch.plan_specs(MERGE_STATE, MERGE_STATE.options(), _tuning.DEFAULT,
                                 TwoStateOperands(None, None, values, lse, values, lse)).plan[0]  # fmt: skip
    with_sinks = _dispatch.plan_specs(MERGE_STATE, MERGE_STATE.options(), _tuning.DEFAULT,
                                      TwoStateOperands(None, None, values, lse, values, lse, sinks=sinks)).plan[0]  # fmt: skip
    assert plain.module.sinks is False and with_sinks.module.sinks is True
    assert "true>" in with_sinks.kernel and plain.kernel.endswith("false>")
    assert with_sinks.slots("sinks") and not plain.slots("sinks")
