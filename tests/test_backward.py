"""The float64 reference of the merges' gradients against finite differences (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_merge import reference

EPS = 1e-6


def _numeric(loss, x):
    """Central differences of ``loss`` with respect to every element of ``x`` (changed in place)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        keep = x[index]
        x[index] = keep + EPS
        up = loss()
        x[index] = keep - EPS
        down = loss()
        x[index] = keep
        grad[index] = (up - down) / (2 * EPS)
    return grad


@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_n_way_backward_is_the_gradient_of_the_merge(rng, lse_base, with_sinks):
    v = rng.standard_normal((4, 3, 2, 5))
    s = rng.standard_normal((4, 2, 3)) * 2
    s[1, 0, 2] = -np.inf  # an empty state
    sinks = rng.standard_normal(2) if with_sinks else None
    grad_v, grad_s = rng.standard_normal((3, 2, 5)), rng.standard_normal((2, 3))

    def loss():
        out, lse = reference.merge_states(v, s, lse_base, sinks=sinks)
        return float((out * grad_v).sum() + (lse * grad_s).sum())

    got_v, got_s, got_z = reference.merge_states_backward(v, s, grad_v, grad_s, sinks=sinks, lse_base=lse_base)
    np.testing.assert_allclose(got_v, _numeric(loss, v), atol=1e-7)
    finite = np.isfinite(s)
    np.testing.assert_allclose(got_s[finite], _numeric(loss, s)[finite], atol=1e-7)
    assert got_s[1, 0, 2] == 0.0 and (got_v[1, 2, 0] == 0).all()  # the empty state: zero gradients
    if with_sinks:
        np.testing.assert_allclose(got_z, _numeric(loss, sinks), atol=1e-7)
    else:
        assert got_z is None


@pytest.mark.parametrize("lse_base", ["e", 2])
def test_the_two_way_and_ragged_backwards_are_the_gradients_of_their_merges(rng, lse_base):
    """Each against finite differences of its own merge: uneven ragged rows, an empty token, sinks."""
    sinks = rng.standard_normal(2)
    v_a, v_b = rng.standard_normal((2, 3, 2, 4))
    s_a, s_b = rng.standard_normal((2, 2, 3)) * 2
    grad_v, grad_s = rng.standard_normal((3, 2, 4)), rng.standard_normal((2, 3))

    def two_loss():
        out, lse = reference.merge_state(v_a, s_a, v_b, s_b, lse_base, sinks=sinks)
        return float((out * grad_v).sum() + (lse * grad_s).sum())

    got = reference.merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s, sinks=sinks, lse_base=lse_base)
    for index, x in enumerate((v_a, s_a, v_b, s_b, sinks)):
        np.testing.assert_allclose(got[index], _numeric(two_loss, x), atol=1e-7, err_msg=f"two-way input {index}")
    rows, lse = rng.standard_normal((7, 2, 4)), rng.standard_normal((2, 7)) * 2
    indptr = np.array([0, 1, 1, 7])  # one state, none, six
    grad_v, grad_s = rng.standard_normal((3, 2, 4)), rng.standard_normal((2, 3))
    grad_s[:, 1] = 0.0  # the empty token's LSE is -inf: only its (zero) values carry a gradient

    def ragged_loss():
        out, merged = reference.merge_states_varlen(rows, lse, indptr, lse_base, sinks=sinks)
        return float((out * grad_v).sum() + (np.where(np.isfinite(merged), merged, 0.0) * grad_s).sum())

    got = reference.merge_states_varlen_backward(rows, lse, indptr, grad_v, grad_s, sinks=sinks, lse_base=lse_base)
    for index, x in enumerate((rows, lse, None, sinks)):
        if x is not None:
            np.testing.assert_allclose(got[min(index, 2)], _numeric(ragged_loss, x), atol=1e-7,
                                       err_msg=f"ragged input {index}")  # fmt: skip


def test_the_two_way_and_ragged_backwards_agree_with_the_n_way_one(rng):
    v = rng.standard_normal((2, 4, 3, 8))
    s = rng.standard_normal((2, 3, 4))
    grad_v, grad_s = rng.standard_normal((4, 3, 8)), rng.standard_normal((3, 4))
    sinks = rng.standard_normal(3)
    many = reference.merge_states_backward(v, s, grad_v, grad_s, sinks=sinks)
    two = reference.merge_state_backward(v[0], s[0], v[1], s[1], grad_v, grad_s, sinks=sinks)
    np.testing.assert_allclose(two[0], many[0][0])
    np.testing.assert_allclose(two[3], many[1][1])
    np.testing.assert_allclose(two[4], many[2])
    rows = v.transpose(1, 0, 2, 3).reshape(8, 3, 8)  # token t's states are rows 2t, 2t + 1
    lse = s.transpose(1, 2, 0).reshape(3, 8)
    ragged = reference.merge_states_varlen_backward(rows, lse, np.arange(0, 9, 2), grad_v, grad_s, sinks=sinks)
    np.testing.assert_allclose(ragged[0], many[0].transpose(1, 0, 2, 3).reshape(8, 3, 8))
    np.testing.assert_allclose(ragged[1], many[1].transpose(1, 2, 0).reshape(3, 8))
    np.testing.assert_allclose(ragged[2], many[2])


def test_zero_weight_states_with_nan_values_get_zero_gradients_never_nan():
    v = np.stack([np.full((1, 1, 4), np.nan), np.ones((1, 1, 4))])
    s = np.array([[[-1000.0]], [[0.0]]])
    grad_v, grad_s, _ = reference.merge_states_backward(v, s, np.ones((1, 1, 4)), np.ones((1, 1)))
    assert (grad_v[0] == 0).all() and grad_s[0, 0, 0] == 0.0
    assert np.isfinite(grad_v).all() and np.isfinite(grad_s).all()


def test_rows_no_token_owns_get_zero_gradients():
    grad_v, grad_s, _ = reference.merge_states_varlen_backward(
        np.ones((4, 1, 2)), np.zeros((1, 4)), [0, 1, 2], np.ones((2, 1, 2)), np.ones((1, 2))
    )
    assert (grad_v[2:] == 0).all() and (grad_s[:, 2:] == 0).all()


def test_bad_gradient_shapes_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="^grad_v: expected shape"):
        reference.merge_states_backward(np.ones((2, 3, 1, 4)), np.zeros((2, 1, 3)), np.ones((3, 1, 5)))
    with pytest.raises(ValueError, match="^s: expected shape"):
        reference.merge_states_backward(np.ones((2, 3, 1, 4)), np.zeros((2, 3, 1)), np.ones((3, 1, 4)))


def test_a_sink_of_plus_infinity_takes_all_the_weight_so_its_gradient_is_the_lse_gradients():
    """The forward gives a +inf sink's head zeros and S = +inf; dS/dz is then 1, and nothing else moves."""
    rng = np.random.default_rng(3)
    v, s = rng.standard_normal((3, 4, 2, 5)), rng.standard_normal((3, 2, 4))
    grad_v, grad_s = rng.standard_normal((4, 2, 5)), rng.standard_normal((2, 4))
    sinks = np.array([np.inf, 0.5])
    got_v, got_s, got_z = reference.merge_states_backward(v, s, grad_v, grad_s, sinks=sinks)
    assert got_z[0] == grad_s[0].sum() and (got_v[:, :, 0] == 0).all() and (got_s[:, 0] == 0).all()
    finite = reference.merge_states_backward(v, s, grad_v, grad_s, sinks=np.array([0.0, 0.5]))
    np.testing.assert_allclose(got_z[1], finite[2][1])  # the other head as with any sink
