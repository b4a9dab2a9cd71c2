"""cupy_merge.jax without a GPU: its errors, its trace-time checks, and its planning, folding and caches.

The merges run on JAX's CPU device here, with the CUDA launch replaced by a NumPy
implementation of the kernels (``cupy_merge.reference`` on the buffers the callback
receives, read through the very specs the kernels would get): the layouts, the
batching folds, FP8 results, aliases and caches are checked against the float64
reference of the unbatched inputs, as on a GPU. The launch plumbing (pointer slots,
the element-aligned plan, XLA's stream) is checked with the CUDA branch driven by
CPU buffers and a recording launcher.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from bad_inputs import BAD_CASES, VALID
from numpy.lib.stride_tricks import as_strided

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")
ml_dtypes = pytest.importorskip("ml_dtypes")
import jax.numpy as jnp

import cupy_merge as cm
import cupy_merge.jax as cmj
from cupy_merge import _dispatch, _jax_batching, _jax_entry, _jax_launch, _launch, _tuning, reference
from cupy_merge._operands import BackwardOperands, TwoStateOperands, TwoStateOptions
from cupy_merge._ops import MERGE_STATE

FP8 = "float8_e4m3fn"
NVFP4 = "float4_e2m1fn_x2"


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


# -- the NumPy stand-in for the kernels --------------------------------------------------------------


def _numpy_merge(call: cmj.HostCall, buffers: tuple) -> None:
    """What the kernels compute, from the buffers through the specs the launch would use."""
    arrays = [np.asarray(buffer) for buffer in buffers]
    specs, options = call.specs, call.options

    def view(field):
        spec = getattr(specs, field)
        base = arrays[call.index[field]]
        return as_strided(base, spec.shape, tuple(stride * base.itemsize for stride in spec.strides))

    def f64(field):
        return None if getattr(specs, field) is None else view(field).astype(np.float64)

    base = 2 if options.lse_base_2 else "e"
    sinks = f64("sinks")
    if isinstance(specs, BackwardOperands):
        _numpy_backward(specs, view, f64, base)
        _numpy_merge.backward_calls += 1
        return
    if call.operation.many:
        if specs.indptr is not None:
            want, want_lse = reference.merge_states_varlen(
                f64("v"), f64("s"), view("indptr").copy(), base, check_indptr=False, sinks=sinks
            )
        else:
            want, want_lse = reference.merge_states(f64("v"), f64("s"), base, sinks=sinks)
    else:
        v_a, s_a, v_b, s_b = (f64(field) for field in ("v_a", "s_a", "v_b", "s_b"))
        want, want_lse = reference.merge_state(v_a, s_a, v_b, s_b, base, sinks=sinks)
        cut = options.merge_tokens
        if cut is not None and cut < len(want):
            if sinks is None:
                want[cut:], want_lse[:, cut:] = v_b[cut:], s_b[:, cut:]
            else:
                tail = reference.merge_states(v_b[None, cut:], s_b[None, :, cut:], base, sinks=sinks)
                want[cut:], want_lse[:, cut:] = tail
    written = slice(None)
    if getattr(specs, "mask", None) is not None:  # the kernel reads and writes the masked tokens alone
        written = view("mask").astype(bool)
    out = view("out")
    if specs.out.dtype == NVFP4:
        packed, scales = reference.quantize_nvfp4(
            want.reshape(len(want), -1), float(view("output_scale").reshape(-1)[0]), is_sf_swizzled_layout=options.swizzled_scales
        )
        out[written] = packed.reshape(out.shape)[written]
        view("output_block_scale")[...] = scales.view(np.uint8)
    elif specs.out.dtype == FP8:
        if specs.output_scale is not None:
            quantised = reference.quantize_fp8(want, float(view("output_scale").reshape(-1)[0]))
        else:
            quantised, scales = reference.quantize_fp8_groups(
                want, options.group_size, bool(options.scale_ue8m0)
            )
            view("output_block_scale")[...] = scales
        out[written] = quantised.view(np.uint8)[written]
    else:
        out[written] = want.astype(out.dtype)[written]
    view("out_lse")[:, written] = want_lse.astype(np.float32)[:, written]
    _numpy_merge.calls += 1


_numpy_merge.calls = 0
_numpy_merge.backward_calls = 0


def _ragged_backward(v, s, indptr, grad_out, grad_lse, sinks, base):
    """What the ragged backward kernel does: the rows of each token whose offsets are in range get
    their gradients, the rows before ``indptr[0]`` and from ``indptr[-1]`` on zeros, the rows a token
    of out-of-range offsets spans zeros."""
    total = v.shape[0]
    grad_v, grad_s = np.full(v.shape, np.nan), np.full(s.shape, np.nan)  # memory as allocated
    lead = min(max(int(indptr[0]), 0), total)
    trail = min(max(int(indptr[-1]), lead), total)
    for rows in (slice(0, lead), slice(trail, total)):
        grad_v[rows], grad_s[:, rows] = 0, 0
    grad_sinks = None if sinks is None else np.zeros(len(sinks))
    for token in range(len(indptr) - 1):
        begin, end = int(indptr[token]), int(indptr[token + 1])
        if begin < 0 or end < begin or end > total:
            spanned = slice(min(max(min(begin, end), 0), total), min(max(begin, end, 0), total))
            grad_v[spanned], grad_s[:, spanned] = 0, 0
            continue
        rows_v, rows_s, rows_z = reference.merge_states_backward(
            v[begin:end, None], s[:, begin:end].T[:, :, None], grad_out[token : token + 1],
            grad_lse[:, token : token + 1], sinks=sinks, lse_base=base,
        )  # fmt: skip
        grad_v[begin:end], grad_s[:, begin:end] = rows_v[:, 0], rows_s[:, :, 0].T
        if grad_sinks is not None:
            grad_sinks += rows_z
    return grad_v, grad_s, grad_sinks


def _from_results(v, s, indptr, grad_out, grad_lse, merged, merged_lse, sinks, base):
    """N-way or ragged gradients by the closed form from the merge's results as given (``merged``
    ``[T, H, D]``, ``merged_lse`` ``[H, T]``), as the kernel that reads them computes them: results
    handed over wrongly (another token's, another layout) give wrong gradients. A token whose
    offsets are out of range, and rows no token owns, get zeros."""
    k = math.log(2) if base == 2 else 1.0
    grad_v, grad_s = np.zeros(v.shape), np.zeros(s.shape)
    grad_sinks = None if sinks is None else np.zeros(len(sinks))
    for token in range(merged.shape[0]):
        if indptr is None:  # v [N, T, H, D], s [N, H, T]
            rows_v, rows_s, at = v[:, token], s[:, :, token], (slice(None), token)
        else:  # v [R, H, D], s [H, R]
            begin, end = int(indptr[token]), int(indptr[token + 1])
            if begin < 0 or end < begin or end > v.shape[0]:
                continue
            rows_v, rows_s, at = v[begin:end], s[:, begin:end].T, (slice(begin, end),)
        lse = merged_lse[:, token] * k
        with np.errstate(invalid="ignore", over="ignore"):
            weights = np.where(np.isfinite(lse), np.exp(np.where(np.isposinf(rows_s), -np.inf, rows_s) * k - lse),
                               np.where(np.isnan(lse), np.nan, 0.0))  # fmt: skip
        dot = (grad_out[token] * merged[token]).sum(-1)  # [H]
        states_v = weights[..., None] * grad_out[token]
        states_s = np.where(weights == 0, 0.0, weights * ((grad_out[token] * rows_v).sum(-1) - dot
                                                          + grad_lse[:, token] / k)) * k  # fmt: skip
        if indptr is None:
            grad_v[:, token], grad_s[:, :, token] = states_v, states_s
        else:
            grad_v[at], grad_s[:, at[0]] = states_v, states_s.T
        if sinks is not None:
            sink_weights = np.where(np.isfinite(lse), np.exp(sinks - lse), 0.0)
            grad_sinks += np.where(sink_weights == 0, 0.0, sink_weights * (grad_lse[:, token] / k - dot))
    return grad_v, grad_s, grad_sinks


def _numpy_backward(specs, view, f64, base) -> None:
    """The backward kernels: the float64 reference's gradients written through the gradients' specs
    (the sinks' too: the last launch writes them whole, summed from the rows' terms)."""
    grad_out, grad_lse, sinks = f64("grad_out"), f64("grad_lse"), f64("sinks")
    if specs.v_b is not None:
        *grads, grad_sinks = reference.merge_state_backward(
            f64("v"), f64("s"), f64("v_b"), f64("s_b"), grad_out, grad_lse, sinks=sinks, lse_base=base
        )
        for field, grad in zip(("grad_v", "grad_s", "grad_v_b", "grad_s_b"), grads):
            view(field)[...] = grad.astype(view(field).dtype)
    elif specs.merged is not None:  # as the kernel given the merge's results: from them, not recomputed
        grad_v, grad_s, grad_sinks = _from_results(
            f64("v"), f64("s"), None if specs.indptr is None else view("indptr").astype(np.int64), grad_out,
            grad_lse, f64("merged"), f64("merged_lse"), sinks, base,
        )  # fmt: skip
        view("grad_v")[...] = grad_v.astype(view("grad_v").dtype)
        view("grad_s")[...] = grad_s
    elif specs.indptr is None:
        grad_v, grad_s, grad_sinks = reference.merge_states_backward(
            f64("v"), f64("s"), grad_out, grad_lse, sinks=sinks, lse_base=base
        )
        view("grad_v")[...] = grad_v.astype(view("grad_v").dtype)
        view("grad_s")[...] = grad_s
    else:
        grad_v, grad_s, grad_sinks = _ragged_backward(
            f64("v"), f64("s"), view("indptr").copy(), grad_out, grad_lse, sinks, base
        )
        view("grad_v")[...] = grad_v.astype(view("grad_v").dtype)
        view("grad_s")[...] = grad_s
    if grad_sinks is not None:
        view("grad_sinks")[...] = grad_sinks.astype(np.float32)


@pytest.fixture
def numpy_kernels(monkeypatch):
    """Merges on JAX's CPU device, computed by :func:`_numpy_merge`; counts its calls."""
    monkeypatch.setattr(_jax_launch, "_devices_to_prepare", lambda: ())
    monkeypatch.setattr(_jax_launch, "_on_host", _numpy_merge)
    cmj._clear_caches()
    _numpy_merge.calls = _numpy_merge.backward_calls = 0
    with jax.default_device(jax.devices("cpu")[0]):
        yield _numpy_merge
    cmj._clear_caches()  # entries prepared for no device must not serve a later GPU test


def _host(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32)).astype(np.float64)


def _states(rng, tokens, heads, head_size, dtype="float32", lse_spread=4.0):
    v = [jnp.asarray(rng.standard_normal((tokens, heads, head_size)), dtype) for _ in range(2)]
    s = [jnp.asarray(rng.standard_normal((heads, tokens)) * lse_spread, jnp.float32) for _ in range(2)]
    return v[0], s[0], v[1], s[1]


def _close(got, want, tolerance=1e-5):
    got, want = _host(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


# -- what needs no kernel: imports, clear errors ------------------------------------------------------


def test_importing_it_registers_the_jax_path_and_does_not_import_jax():
    code = (
        "import sys, cupy_merge.jax as m, cupy_merge._dispatch as d; "
        "assert 'jax' not in sys.modules, 'jax was imported'; assert d._jax_call is m._jax_call; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(_has_cuda(), reason="JAX has a CUDA device here")
def test_a_cpu_only_jax_is_told_what_is_missing(rng):
    states = _states(rng, 4, 2, 8)
    for merge in (cmj.merge_state, cm.merge_state, jax.jit(cmj.merge_state)):
        with pytest.raises(RuntimeError, match="needs an NVIDIA GPU that JAX runs on; this JAX has only cpu"):
            merge(*states)


def test_a_jax_without_buffer_callback_or_no_jax_is_told_what_to_install(monkeypatch, rng):
    states = _states(rng, 4, 2, 8)
    monkeypatch.setattr(_jax_launch, "_loaded", [])
    monkeypatch.setitem(sys.modules, "jax.experimental.buffer_callback", None)
    with pytest.raises(ImportError, match=r"needs jax.experimental.buffer_callback, new in JAX 0\.6\.1"):
        cmj.merge_state(*states)
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match=r"needs JAX 0\.6\.1 or newer"):
        cmj.merge_state(*states)


def test_the_writing_forms_refuse_jax_arrays_and_point_to_the_functional_ones(rng):
    v, s, w, t = _states(rng, 4, 2, 8)
    with pytest.raises(
        TypeError,
        match=r"^output: JAX arrays are immutable and cannot be written in place; leave it out and call "
        r"cupy_merge\.jax\.merge_attn_states",
    ):
        cm.merge_attn_states(jnp.empty_like(v), v, s, w, t)
    with pytest.raises(
        TypeError, match=r"^v: JAX arrays are immutable.*cupy_merge\.jax\.merge_state_in_place"
    ):
        cm.merge_state_in_place(v, s, w, t)
    with pytest.raises(TypeError, match="^out: JAX arrays are immutable"):
        cm.merge_state(v, s, w, t, out=v)
    with pytest.raises(TypeError, match="^out_lse: JAX arrays are immutable"):
        cm.merge_states(jnp.stack([v, w]), jnp.stack([s, t]), out_lse=s)
    scales = jnp.zeros((4, 2), jnp.float32)
    with pytest.raises(TypeError, match=r"^output_block_scale: JAX arrays are immutable.*quant_group_size"):
        cm.merge_state(v, s, w, t, out_dtype=FP8, output_block_scale=scales, quant_group_size=8)
    with pytest.raises(TypeError, match="^stream: expected None for JAX arrays"):
        cm.merge_state(v, s, w, t, stream=0)


def test_check_indptr_is_refused_under_jit_and_vmap_and_checked_on_the_host_eagerly(rng):
    v = jnp.ones((5, 2, 8), jnp.float32)
    s = jnp.zeros((2, 5), jnp.float32)
    indptr = jnp.array([0, 2, 5], jnp.int32)
    bad = jnp.array([1, 2, 5], jnp.int32)
    for merge in (cmj.merge_states_varlen, cm.merge_states_varlen):
        with pytest.raises(ValueError, match="^check_indptr: .*pass check_indptr=False"):
            jax.jit(merge)(v, s, indptr)
        with pytest.raises(ValueError, match="^check_indptr: .*pass check_indptr=False"):
            jax.vmap(merge)(v[None], s[None], indptr[None])
        with pytest.raises(ValueError, match="^indptr: expected the first entry to be 0"):
            merge(v, s, bad)
        with pytest.raises(ValueError, match="^indptr: expected the first entry to be 0"):
            jax.jit(lambda v, s, merge=merge: merge(v, s, bad))(v, s)  # a constant: checked when traced
        with pytest.raises(
            ValueError, match="^indptr: expected the last entry to be at most total_states = 5"
        ):
            merge(v, s, jnp.array([0, 2, 6], jnp.int32))


_INPUT_CASES = [
    case
    for case in BAD_CASES
    if case.argument in ("v_a", "s_a", "v_b", "s_b")
    and case.spec.last_stride == 1
    and case.spec.device == 0
    and case.spec.byte_offset == 0
    and not case.spec.overlaps
    and not case.spec.broadcast
    and case.spec.dtype != "float64"
]


def _core_message(specs: dict) -> str:
    """The message the eager merges give for these inputs (the planner on their specs)."""
    from cupy_merge._arrays import contiguous_spec

    record = TwoStateOperands(
        None,
        None,
        *(contiguous_spec(specs[f].shape, specs[f].dtype, 4, 0) for f in ("v_a", "s_a", "v_b", "s_b")),
    )
    with pytest.raises((TypeError, ValueError)) as raised:
        _dispatch.plan_specs(MERGE_STATE, TwoStateOptions(), _tuning.DEFAULT, record)
    return str(raised.value)


@pytest.mark.parametrize("case", _INPUT_CASES, ids=lambda case: case.id)
def test_bad_inputs_raise_at_trace_time_with_the_messages_of_the_eager_merges(case):
    specs = dict(VALID, **{case.argument: case.spec})
    arrays = [jnp.zeros(specs[f].shape, specs[f].dtype) for f in ("v_a", "s_a", "v_b", "s_b")]
    expected = _core_message(specs)
    for merge in (cmj.merge_state, jax.jit(cmj.merge_state), cm.merge_state):
        with pytest.raises(case.error) as raised:
            merge(*arrays)
        assert str(raised.value) == expected


def test_bad_options_and_other_operands_raise_naming_them(rng):
    v, s, w, t = _states(rng, 6, 4, 16, "bfloat16")
    cases = [
        (lambda: cmj.merge_state(v, s, w, t, lse_base=10), ValueError, "^lse_base: expected"),
        (lambda: cmj.merge_state(v, s, w, t, out_dtype="int8"), TypeError, "^out_dtype: expected"),
        (lambda: cmj.merge_state(v, s, w, t, out_dtype=FP8), TypeError, "^out: an FP8 output needs its scale"),
        (lambda: cmj.merge_state(v, s, w, t, output_scale=jnp.ones(1)), TypeError, "^output_scale: a scale is for"),
        (lambda: cmj.merge_state(v, s, w, t, out_dtype=FP8, quant_group_size=5), ValueError,
         "^quant_group_size: expected a divisor of head_size 16"),
        (lambda: cmj.merge_state(v, s, w, t, out_dtype=FP8, output_scale=jnp.ones(2)), TypeError,
         "^output_scale: expected a float32 array of one element"),
        (lambda: cmj.merge_state(v, s, w, t, sinks=jnp.zeros(3)), ValueError, r"^sinks: expected shape \(4,\)"),
        (lambda: cmj.merge_attn_states(v, s.T, w, t), ValueError, "^prefix_lse: expected shape"),
        (lambda: cmj.merge_attn_states(v, s, w, t, prefill_tokens_with_context=-1), ValueError,
         "^prefill_tokens_with_context: expected >= 0"),
        (lambda: cmj.merge_state_in_place(v, s, w, t, jnp.ones(5, bool)), ValueError, r"^mask: expected shape \(6,\)"),
        (lambda: cmj.merge_states(v, s), ValueError, "^v: expected a 4-D array"),
        (lambda: cmj.merge_states_varlen(v, s.T, jnp.zeros(3, jnp.int32), check_indptr=False), ValueError,
         r"^s: expected shape \(num_heads, total_states\)"),
        (lambda: cmj.merge_states_varlen(v, s, jnp.zeros(3), check_indptr=False), TypeError,
         "^indptr: expected an int32 or int64 array"),
        (lambda: cmj.merge_state(None, s, w, t), TypeError, "^v_a: expected a JAX array, got None"),
    ]  # fmt: skip
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


# -- merges through the NumPy stand-in -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lse_base", ["e", 2])
def test_jit_eager_and_the_public_merge_agree_with_the_reference(numpy_kernels, rng, dtype, lse_base):
    v, s, w, t = _states(rng, 7, 3, 16, dtype)
    want = reference.merge_state(_host(v), _host(s), _host(w), _host(t), lse_base)
    for merge in (jax.jit(cmj.merge_state, static_argnames="lse_base"), cmj.merge_state, cm.merge_state):
        got_v, got_s = merge(v, s, w, t, lse_base=lse_base)
        assert got_v.dtype == v.dtype and got_s.dtype == jnp.float32
        _close(got_v, want[0], TOLERANCE[dtype])
        _close(got_s, want[1])


def test_eager_calls_reuse_one_trace_and_one_jitted_function(numpy_kernels, rng):
    states = _states(rng, 5, 2, 8)
    cmj.merge_state(*states)
    entries, functions = len(_jax_launch._entries), len(_jax_entry._jitted)
    (function,) = _jax_entry._jitted.values()
    traced = function._cache_size()
    for _ in range(3):
        cmj.merge_state(*states)
        cm.merge_state(*states)
    assert (len(_jax_launch._entries), len(_jax_entry._jitted), function._cache_size()) == (entries, functions, traced)
    cmj.merge_state(*states, lse_base=2)  # other options: another function
    assert len(_jax_entry._jitted) == functions + 1
    with _tuning.use(_tuning.DEFAULT.replace(packed_kernels=False)):  # another tuning: planned apart
        cmj.merge_state(*states)
    assert len(_jax_entry._jitted) == functions + 2
    assert numpy_kernels.calls == 9


@pytest.mark.parametrize("group", [None, 8, 16])
def test_fp8_results_are_float8_e4m3fn_with_either_scale(numpy_kernels, rng, group):
    v, s, w, t = _states(rng, 6, 4, 16, "bfloat16")
    want, want_lse = reference.merge_state(_host(v), _host(s), _host(w), _host(t))
    if group is None:
        got, got_lse = jax.jit(cmj.merge_state, static_argnames="out_dtype")(
            v, s, w, t, out_dtype=FP8, output_scale=jnp.array([0.5], jnp.float32)
        )
        expected = reference.quantize_fp8(want, 0.5)
    else:
        got, got_lse, scales = cmj.merge_state(
            v, s, w, t, out_dtype=jnp.float8_e4m3fn, quant_group_size=group
        )
        expected, expected_scales = reference.quantize_fp8_groups(want, group)
        assert scales.shape == (6, 4 * 16 // group) and scales.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(scales), expected_scales, rtol=1e-6)
    assert got.dtype == jnp.float8_e4m3fn and got.shape == (6, 4, 16)
    assert (np.asarray(got).view(np.uint8) == expected.view(np.uint8)).all()
    _close(got_lse, want_lse)


def test_fp8_from_the_n_way_and_ragged_merges_and_group_scales_returned_into_a_given_buffer(
    numpy_kernels, rng
):
    v = jnp.asarray(rng.standard_normal((3, 5, 2, 16)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((3, 2, 5)), jnp.float32)
    want, _ = reference.merge_states(_host(v), _host(s))
    got, _, scales = cmj.merge_states(v, s, out_dtype=FP8, quant_group_size=16, scale_ue8m0=True)
    expected, expected_scales = reference.quantize_fp8_groups(want, 16, True)
    assert (np.asarray(got).view(np.uint8) == expected.view(np.uint8)).all()
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    poisoned = jnp.full((5, 2), jnp.nan, jnp.float32)
    _, _, scales = cmj.merge_states(v, s, out_dtype=FP8, quant_group_size=16, output_block_scale=poisoned)
    np.testing.assert_allclose(np.asarray(scales), reference.quantize_fp8_groups(want, 16)[1], rtol=1e-6)
    rows, indptr = v.reshape(15, 2, 16), jnp.array([0, 4, 4, 15], jnp.int32)
    rows_lse = jnp.moveaxis(s, 1, 0).reshape(2, 15)
    got, _ = cmj.merge_states_varlen(rows, rows_lse, indptr, out_dtype=FP8, output_scale=2.0)
    want, _ = reference.merge_states_varlen(_host(rows), _host(rows_lse), np.asarray(indptr))
    assert got.dtype == jnp.float8_e4m3fn
    assert (np.asarray(got).view(np.uint8) == reference.quantize_fp8(want, 2.0).view(np.uint8)).all()


def test_the_in_place_merge_aliases_its_outputs_to_v_and_s_when_masked(numpy_kernels, rng):
    v, s, w, t = _states(rng, 6, 2, 8)
    mask = jnp.array([True, False, True, True, False, False])
    text = jax.jit(lambda *a: cmj.merge_state_in_place(*a)).lower(v, s, w, t, mask).as_text()
    assert "output_operand_aliases" in text
    got_v, got_s = cmj.merge_state_in_place(v, s, w, t, mask)
    want_v, want_s = reference.merge_state(_host(v), _host(s), _host(w), _host(t))
    keep = ~np.asarray(mask)
    want_v[keep], want_s[:, keep] = _host(v)[keep], _host(s)[:, keep]
    _close(got_v, want_v)
    _close(got_s, want_s)
    text = jax.jit(lambda *a: cmj.merge_state_in_place(*a)).lower(v, s, w, t).as_text()
    assert "output_operand_aliases" not in text  # unmasked: fresh outputs, no copy of v
    _close(
        cmj.merge_state_in_place(v, s, w, t)[0],
        reference.merge_state(_host(v), _host(s), _host(w), _host(t))[0],
    )
    donated = jax.jit(lambda *a: cmj.merge_state_in_place(*a), donate_argnums=(0, 1))
    got_v, _ = donated(jnp.copy(v), jnp.copy(s), w, t, mask)
    _close(got_v, want_v)


def test_merge_attn_states_takes_the_suffix_past_the_prefill_cut(numpy_kernels, rng):
    v, s, w, t = _states(rng, 6, 2, 8)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    for sink in (None, sinks):
        got, got_lse = cmj.merge_attn_states(v, s, w, t, 4, sinks=sink)
        host_sink = None if sink is None else _host(sink)
        want, want_lse = reference.merge_state(_host(v), _host(s), _host(w), _host(t), sinks=host_sink)
        if sink is None:
            want[4:], want_lse[:, 4:] = _host(w)[4:], _host(t)[:, 4:]
        else:
            want[4:], want_lse[:, 4:] = reference.merge_states(
                _host(w)[None, 4:], _host(t)[None, :, 4:], sinks=host_sink
            )
        _close(got, want)
        _close(got_lse, want_lse)


def test_zero_tokens_or_heads_launch_nothing_and_return_empty_results(numpy_kernels):
    for tokens, heads in ((0, 4), (3, 0)):
        v, s = jnp.zeros((tokens, heads, 8), jnp.float16), jnp.zeros((heads, tokens), jnp.float32)
        got_v, got_s = jax.jit(cmj.merge_state)(v, s, v, s)
        assert got_v.shape == (tokens, heads, 8) and got_s.shape == (heads, tokens)
        got_v, got_s, scales = cmj.merge_states(v[None], s[None], out_dtype=FP8, quant_group_size=8)
        assert got_v.dtype == jnp.float8_e4m3fn and scales.shape == (tokens, heads)
        got_v, got_s = cmj.merge_state_in_place(v, s, v, s, jnp.ones(tokens, bool))
        assert got_v.shape == v.shape
        text = jax.jit(cmj.merge_state).lower(v, s, v, s).as_text()
        assert "callback" not in text
    assert numpy_kernels.calls == 0


def test_no_states_give_zero_and_minus_infinity_or_the_sink(numpy_kernels, rng):
    v, s = jnp.zeros((0, 3, 2, 8), jnp.float32), jnp.zeros((0, 2, 3), jnp.float32)
    got_v, got_s = cmj.merge_states(v, s)
    assert (np.asarray(got_v) == 0).all() and np.isneginf(np.asarray(got_s)).all()
    sinks = jnp.array([0.5, -1.0], jnp.float32)
    got_v, got_s = cmj.merge_states(v, s, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got_s), np.repeat(np.asarray(sinks)[:, None], 3, 1))
    rows = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
    rows_lse = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32).at[:, 1].set(jnp.inf)
    got_v, got_s = cmj.merge_states_varlen(rows, rows_lse, jnp.array([0, 0, 4], jnp.int32))
    want_v, want_s = reference.merge_states_varlen(_host(rows), _host(rows_lse), [0, 0, 4])
    _close(got_v, want_v)
    _close(got_s, want_s)


# -- vmap ----------------------------------------------------------------------------------------------


def _stacked(rng, batch, tokens, heads, head_size):
    states = [_states(rng, tokens, heads, head_size) for _ in range(batch)]
    return tuple(jnp.stack(column) for column in zip(*states))


def _reference_batch(function, *arrays, **options):
    results = [function(*(_host(x[b]) for x in arrays), **options) for b in range(arrays[0].shape[0])]
    return tuple(np.stack(column) for column in zip(*results))


@pytest.mark.parametrize("tokens", [1, 5])
def test_vmap_folds_a_batch_into_the_tokens_in_one_launch(numpy_kernels, rng, tokens):
    batch = _stacked(rng, 3, tokens, 2, 8)
    want = _reference_batch(reference.merge_state, *batch)
    for merge in (jax.vmap(cmj.merge_state), jax.jit(jax.vmap(cmj.merge_state)), jax.vmap(cm.merge_state)):
        numpy_kernels.calls = 0
        got = merge(*batch)
        assert numpy_kernels.calls == 1
        _close(got[0], want[0])
        _close(got[1], want[1])


def test_nested_vmap_folds_twice_and_unbatched_values_are_merged_one_by_one(numpy_kernels, rng):
    batch = _stacked(rng, 6, 3, 2, 8)
    nested = tuple(x.reshape(2, 3, *x.shape[1:]) for x in batch)
    want = _reference_batch(reference.merge_state, *batch)
    numpy_kernels.calls = 0
    got = jax.jit(jax.vmap(jax.vmap(cmj.merge_state)))(*nested)
    assert numpy_kernels.calls == 1
    _close(got[0].reshape(want[0].shape), want[0])
    _close(got[1].reshape(want[1].shape), want[1])
    numpy_kernels.calls = 0
    v_a, s_a, v_b, s_b = batch
    got = jax.vmap(cmj.merge_state, in_axes=(0, 0, None, None))(v_a, s_a, v_b[0], s_b[0])
    assert numpy_kernels.calls == 6
    want = _reference_batch(lambda a, b: reference.merge_state(a, b, _host(v_b[0]), _host(s_b[0])), v_a, s_a)
    _close(got[0], want[0])
    numpy_kernels.calls = 0
    got = jax.vmap(cmj.merge_state, in_axes=(0, None, 0, 0))(v_a, s_a[0], v_b, s_b)  # an unbatched LSE folds
    assert numpy_kernels.calls == 1
    want = _reference_batch(lambda a, c, d: reference.merge_state(a, _host(s_a[0]), c, d), v_a, v_b, s_b)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_vmap_of_the_masked_in_place_merge_keeps_its_aliases(numpy_kernels, rng):
    v, s, w, t = _stacked(rng, 3, 4, 2, 8)
    mask = jnp.asarray(rng.random((3, 4)) < 0.5)
    numpy_kernels.calls = 0
    got_v, got_s = jax.jit(jax.vmap(cmj.merge_state_in_place))(v, s, w, t, mask)
    assert numpy_kernels.calls == 1
    want_v, want_s = _reference_batch(reference.merge_state, v, s, w, t)
    keep = ~np.asarray(mask)
    want_v[keep] = _host(v)[keep]
    want_s = np.where(keep[:, None, :], _host(s), want_s)
    _close(got_v, want_v)
    _close(got_s, want_s)


def test_vmap_of_merge_attn_states_with_a_prefill_cut_maps_over_the_batch(numpy_kernels, rng):
    batch = _stacked(rng, 2, 4, 2, 8)
    numpy_kernels.calls = 0
    got = jax.vmap(lambda *a: cmj.merge_attn_states(*a, prefill_tokens_with_context=2))(*batch)
    assert numpy_kernels.calls == 2
    want = _reference_batch(reference.merge_state, *batch)
    want[0][:, 2:], want[1][:, :, 2:] = _host(batch[2])[:, 2:], _host(batch[3])[:, :, 2:]
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("tokens, states, calls", [(1, 4, 1), (3, 1, 1), (3, 4, 3)])
def test_vmap_of_the_n_way_merge_folds_where_the_values_allow_it(numpy_kernels, rng, tokens, states, calls):
    v = jnp.asarray(rng.standard_normal((3, states, tokens, 2, 8)), jnp.float16)
    s = jnp.asarray(rng.standard_normal((3, states, 2, tokens)) * 3, jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    want = _reference_batch(lambda a, b: reference.merge_states(a, b, sinks=_host(sinks)), v, s)
    numpy_kernels.calls = 0
    got = jax.jit(jax.vmap(lambda a, b: cmj.merge_states(a, b, sinks=sinks, out_dtype="float32")))(v, s)
    assert numpy_kernels.calls == calls
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_nested_vmap_of_single_token_n_way_merges_is_one_launch(numpy_kernels, rng):
    v = jnp.asarray(rng.standard_normal((2, 3, 5, 1, 2, 8)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((2, 3, 5, 2, 1)), jnp.float32)
    numpy_kernels.calls = 0
    got = jax.vmap(jax.vmap(cmj.merge_states))(v, s)
    assert numpy_kernels.calls == 1
    want = _reference_batch(reference.merge_states, v.reshape(6, 5, 1, 2, 8), s.reshape(6, 5, 2, 1))
    _close(got[0].reshape(want[0].shape), want[0])
    _close(got[1].reshape(want[1].shape), want[1])


def test_vmap_of_the_ragged_merge_is_one_launch_with_the_unbatched_semantics(numpy_kernels, rng):
    v = jnp.asarray(rng.standard_normal((3, 9, 2, 8)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((3, 2, 9)), jnp.float32)
    indptr = jnp.array([[0, 3, 3, 7], [0, 1, 9, 9], [0, 5, 2, 11]], jnp.int32)  # the last: bad offsets
    merge = jax.jit(jax.vmap(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False)))
    numpy_kernels.calls = 0
    got = merge(v, s, indptr)
    assert numpy_kernels.calls == 1
    want = _reference_batch(
        lambda a, b, c: reference.merge_states_varlen(a, b, c.astype(np.int64), check_indptr=False),
        v,
        s,
        indptr,
    )
    assert np.isnan(want[0][2, 1:]).all() and not np.isnan(want[0][2, 0]).any()
    _close(got[0], want[0])
    _close(got[1], want[1])
    shared = jax.vmap(lambda a, b: cmj.merge_states_varlen(a, b, indptr[0], check_indptr=False))(v, s)
    want = _reference_batch(lambda a, b: reference.merge_states_varlen(a, b, np.asarray(indptr[0])), v, s)
    _close(shared[0], want[0])
    numpy_kernels.calls = 0
    rows = jax.vmap(lambda b, c: cmj.merge_states_varlen(v[0], b, c, check_indptr=False))(s[:2], indptr[:2])
    assert numpy_kernels.calls == 2  # unbatched values: one merge a batch element
    want = _reference_batch(
        lambda b, c: reference.merge_states_varlen(_host(v[0]), b, c.astype(np.int64)), s[:2], indptr[:2]
    )
    _close(rows[0], want[0])
    fp8, _ = jax.vmap(
        lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False, out_dtype=FP8, output_scale=0.5)
    )(v, s, indptr)
    want = _reference_batch(
        lambda a, b, c: reference.merge_states_varlen(a, b, c.astype(np.int64), check_indptr=False),
        v,
        s,
        indptr,
    )
    assert fp8.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(
        np.asarray(fp8).view(np.uint8), reference.quantize_fp8(want[0], 0.5).view(np.uint8)
    )


# -- derivatives ---------------------------------------------------------------------------------------


def _weights(rng, shape, dtype="float32"):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _linear_loss(merge, out_weight, lse_weight):
    """``sum(out * R) + sum(lse * Q)``: its cotangents are R (in the output's dtype) and Q."""

    def loss(*args):
        out, lse = merge(*args)[:2]
        return (out.astype(jnp.float32) * out_weight.astype(jnp.float32)).sum() + (lse * lse_weight).sum()

    return loss


def _close_all(got, want, tolerance):
    assert len(got) == len(want)
    for got_one, want_one in zip(got, want):
        _close(got_one, want_one, tolerance)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_grad_and_value_and_grad_of_merge_state_under_jit_follow_the_reference(
    numpy_kernels, rng, dtype, lse_base, with_sinks
):
    v, s, w, t = _states(rng, 7, 3, 16, dtype)
    sinks = jnp.asarray(rng.standard_normal(3), jnp.float32) if with_sinks else None
    out_weight, lse_weight = _weights(rng, v.shape, dtype), _weights(rng, s.shape)
    host = [_host(x) for x in (v, s, w, t)]
    want = reference.merge_state_backward(*host, _host(out_weight), _host(lse_weight), lse_base=lse_base,
                                          sinks=None if sinks is None else _host(sinks))  # fmt: skip
    argnums = (0, 1, 2, 3, 4) if with_sinks else (0, 1, 2, 3)
    for merge in (cmj.merge_state, cm.merge_state):
        loss = _linear_loss(lambda a, b, c, d, z, merge=merge: merge(a, b, c, d, sinks=z, lse_base=lse_base),
                            out_weight, lse_weight)  # fmt: skip
        grads = jax.jit(jax.grad(loss, argnums))(v, s, w, t, sinks)
        assert [g.dtype for g in grads[:4]] == [v.dtype, jnp.float32, v.dtype, jnp.float32]
        tolerances = [TOLERANCE[dtype], 1e-5] * 2 + [1e-5]
        for got, expected, tolerance in zip(grads, want, tolerances):
            _close(got, expected, tolerance)
        value, eager = jax.value_and_grad(loss, argnums)(v, s, w, t, sinks)  # eager: the cached jit
        np.testing.assert_allclose(float(value), float(loss(v, s, w, t, sinks)), rtol=1e-6)  # the forward's
        for got, expected in zip(eager, grads):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert numpy_kernels.backward_calls == 4


@pytest.mark.parametrize("lse_base", ["e", 2])
def test_grad_of_the_n_way_and_ragged_merges_with_sinks_follow_the_reference(numpy_kernels, rng, lse_base):
    v = jnp.asarray(rng.standard_normal((4, 5, 2, 8)), jnp.bfloat16)
    s = jnp.asarray(rng.standard_normal((4, 2, 5)) * 3, jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    out_weight, lse_weight = _weights(rng, (5, 2, 8)), _weights(rng, (2, 5))
    for merge in (cmj.merge_states, cm.merge_states):
        loss = _linear_loss(lambda a, b, z, merge=merge: merge(a, b, sinks=z, lse_base=lse_base, out_dtype="float32"),
                            out_weight, lse_weight)  # fmt: skip
        got = jax.jit(jax.grad(loss, (0, 1, 2)))(v, s, sinks)
        want = reference.merge_states_backward(_host(v), _host(s), _host(out_weight), _host(lse_weight),
                                               sinks=_host(sinks), lse_base=lse_base)  # fmt: skip
        assert got[0].dtype == jnp.bfloat16
        _close_all(got, want, TOLERANCE["bfloat16"])
    rows = np.asarray(rng.standard_normal((10, 2, 8)), np.float32)
    rows[8:] = np.nan  # rows no token owns: zero gradients, whatever they hold
    rows, rows_lse = jnp.asarray(rows), jnp.asarray(rng.standard_normal((2, 10)) * 3, jnp.float32)
    indptr = jnp.array([0, 3, 3, 8], jnp.int32)  # an empty token too
    out_weight, lse_weight = _weights(rng, (3, 2, 8)), _weights(rng, (2, 3))
    for with_sinks in (False, True):
        z = sinks if with_sinks else None
        for merge in (cmj.merge_states_varlen, cm.merge_states_varlen):
            loss = _linear_loss(lambda a, b, c, z, merge=merge: merge(a, b, c, check_indptr=False, sinks=z,
                                                                        lse_base=lse_base),
                                out_weight, lse_weight)  # fmt: skip
            got = jax.jit(jax.grad(loss, (0, 1, 2, 3), allow_int=True))(rows, rows_lse, indptr, z)
            assert got[2].dtype == jax.dtypes.float0 and got[2].shape == indptr.shape
            host_rows = np.nan_to_num(_host(rows))  # the reference checks nothing of the unowned rows
            want = reference.merge_states_varlen_backward(
                host_rows, _host(rows_lse), np.asarray(indptr), _host(out_weight), _host(lse_weight),
                sinks=None if z is None else _host(z), lse_base=lse_base,
            )  # fmt: skip
            _close(got[0], want[0])
            _close(got[1], want[1])
            assert (np.asarray(got[0])[8:] == 0).all() and (np.asarray(got[1])[:, 8:] == 0).all()
            if with_sinks:
                _close(got[3], want[2])
            else:
                assert got[3] is None


def _directional(loss, args, argnums, rng, step=2e-2):
    """The loss's derivative along a random direction of the arguments ``argnums``, by central
    differences of the forward merge (float64 sums of its float32 results; Richardson's
    extrapolation from steps ``step`` and ``step / 2`` cancels the step's squared term), and the
    direction."""
    directions = {i: rng.standard_normal(np.shape(args[i])).astype(np.float32) for i in argnums}

    def central(h):
        def moved(sign):
            return [jnp.asarray(np.asarray(x) + sign * h * directions[i]) if i in directions else x
                    for i, x in enumerate(args)]  # fmt: skip

        return (loss(*moved(1)) - loss(*moved(-1))) / (2 * h)

    return (4 * central(step / 2) - central(step)) / 3, directions


def test_gradients_agree_with_finite_differences_of_the_merges(numpy_kernels, rng):
    v, s, w, t = _states(rng, 5, 3, 8, lse_spread=2.0)
    sinks = jnp.asarray(rng.standard_normal(3), jnp.float32)
    stacked, stacked_lse = jnp.stack([v, w, v * 2]), jnp.stack([s, t, t - 1])
    rows, rows_lse = jnp.concatenate([v, w, v * 0.5]), jnp.concatenate([s, t, s - 1], axis=1)
    indptr = jnp.array([0, 4, 4, 9, 15], jnp.int32)
    mask = jnp.array([True, False, True, True, False])
    cases = [
        ("merge_state", lambda a, b, c, d, z: cmj.merge_state(a, b, c, d, sinks=z), (v, s, w, t, sinks)),
        ("base 2", lambda a, b, c, d: cmj.merge_state(a, b, c, d, lse_base=2), (v, s, w, t)),
        ("merge_attn_states", lambda a, b, c, d: cmj.merge_attn_states(a, b, c, d, 3), (v, s, w, t)),
        ("merge_attn_states, sinks", lambda a, b, c, d, z: cmj.merge_attn_states(a, b, c, d, 2, sinks=z),
         (v, s, w, t, sinks)),
        ("merge_state_in_place", lambda a, b, c, d, z: cmj.merge_state_in_place(a, b, c, d, mask, sinks=z),
         (v, s, w, t, sinks)),
        ("merge_states", lambda a, b, z: cm.merge_states(a, b, sinks=z, lse_base=2), (stacked, stacked_lse, sinks)),
        ("merge_states_varlen", lambda a, b, z: cmj.merge_states_varlen(a, b, indptr, check_indptr=False, sinks=z),
         (rows, rows_lse, sinks)),
    ]  # fmt: skip
    for name, merge, args in cases:
        out_shape, lse_shape = (x.shape for x in jax.eval_shape(merge, *args)[:2])
        out_weight, lse_weight = _weights(rng, out_shape), _weights(rng, lse_shape)

        def loss(*a, merge=merge, out_weight=out_weight, lse_weight=lse_weight):
            out, lse = (np.asarray(x, np.float64) for x in merge(*a)[:2])
            return float((out * np.asarray(out_weight)).sum() + (lse * np.asarray(lse_weight)).sum())

        argnums = tuple(range(len(args)))
        grads = jax.jit(jax.grad(_linear_loss(merge, out_weight, lse_weight), argnums))(*args)
        numeric, directions = _directional(loss, args, argnums, rng)
        analytic = sum(
            float((np.asarray(g, np.float64) * directions[i]).sum()) for i, g in zip(argnums, grads)
        )
        assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(analytic)), (name, numeric, analytic)


def test_the_masked_in_place_merge_and_the_prefill_cut_pass_gradients_through_their_kept_tokens(
    numpy_kernels, rng
):
    v, s, w, t = _states(rng, 6, 2, 8)
    w = w.at[1].set(jnp.nan)  # a token the mask keeps: v_other's NaN there must not reach any gradient
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    mask = jnp.array([True, False, True, True, False, True])
    out_weight, lse_weight = _weights(rng, v.shape), _weights(rng, s.shape)
    loss = _linear_loss(lambda *a: cmj.merge_state_in_place(*a, mask, sinks=sinks), out_weight, lse_weight)
    got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(v, s, w, t)
    got_sinks = jax.grad(lambda z: _linear_loss(lambda *a: cmj.merge_state_in_place(*a, mask, sinks=z),
                                                out_weight, lse_weight)(v, s, w, t))(sinks)  # fmt: skip
    on = np.asarray(mask)
    host = [_host(x)[on] if x.ndim == 3 else _host(x)[:, on] for x in (v, s, w, t)]
    merged = reference.merge_state_backward(*host, _host(out_weight)[on], _host(lse_weight)[:, on],
                                            sinks=_host(sinks))  # fmt: skip
    want = [np.zeros_like(_host(x)) for x in (v, s, w, t)]
    want[0][~on], want[1][:, ~on] = _host(out_weight)[~on], _host(lse_weight)[:, ~on]
    for index in range(4):
        if index % 2 == 0:
            want[index][on] = merged[index]
        else:
            want[index][:, on] = merged[index]
    _close_all(got, want, 1e-5)
    _close(got_sinks, merged[4])
    for with_sinks in (False, True):
        z = sinks if with_sinks else None
        loss = _linear_loss(lambda *a, z=z: cmj.merge_attn_states(*a, 4, sinks=z), out_weight, lse_weight)
        w_clean = w.at[1].set(0.0)
        got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(v, s, w_clean, t)
        host = [_host(x) for x in (v, s, w_clean, t)]
        head = reference.merge_state_backward(*(x[:4] if x.ndim == 3 else x[:, :4] for x in host),
                                              _host(out_weight)[:4], _host(lse_weight)[:, :4],
                                              sinks=None if z is None else _host(z))  # fmt: skip
        want = [np.zeros_like(x) for x in host]
        want[0][:4], want[1][:, :4], want[2][:4], want[3][:, :4] = head[:4]
        if z is None:  # the suffix unchanged past the cut
            want[2][4:], want[3][:, 4:] = _host(out_weight)[4:], _host(lse_weight)[:, 4:]
        else:  # the suffix merged with the sink alone
            tail = reference.merge_states_backward(host[2][None, 4:], host[3][None, :, 4:], _host(out_weight)[4:],
                                                   _host(lse_weight)[:, 4:], sinks=_host(z))  # fmt: skip
            want[2][4:], want[3][:, 4:] = tail[0][0], tail[1][0]
        _close_all(got, want, 1e-5)


def _per_element(function, batch, **options):
    """``function`` (a reference backward) over the batch elements, stacked per result."""
    results = [function(*(x[b] for x in batch), **options) for b in range(len(batch[0]))]
    return [np.stack(column) for column in zip(*results) if column[0] is not None]


@pytest.mark.parametrize("with_sinks", [False, True])
def test_vmap_of_grad_and_grad_of_vmap_of_merge_state(numpy_kernels, rng, with_sinks):
    batch = _stacked(rng, 3, 5, 2, 8)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32) if with_sinks else None
    out_weight, lse_weight = _weights(rng, (5, 2, 8)), _weights(rng, (2, 5))
    loss = _linear_loss(lambda *a: cmj.merge_state(*a, sinks=sinks), out_weight, lse_weight)
    host = [_host(x) for x in batch]
    want = _per_element(lambda *a: reference.merge_state_backward(
        *a, _host(out_weight), _host(lse_weight), sinks=None if sinks is None else _host(sinks))[:4], host)  # fmt: skip
    for transform in (jax.vmap(jax.grad(loss, (0, 1, 2, 3))),
                      jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1, 2, 3))):  # fmt: skip
        numpy_kernels.backward_calls = 0
        got = jax.jit(transform)(*batch)
        assert [g.shape for g in got] == [x.shape for x in batch]
        assert numpy_kernels.backward_calls == (
            3 if with_sinks else 1
        )  # folded into the tokens, unless sinks
        _close_all(got, want, 1e-5)
    v_a, s_a, v_b, s_b = batch  # the second state shared: vmap(grad) per element, grad(vmap) summed
    per_element = jax.jit(jax.vmap(jax.grad(loss, (2, 3)), in_axes=(0, 0, None, None)))(
        v_a, s_a, v_b[0], s_b[0]
    )
    want = _per_element(lambda a, b: reference.merge_state_backward(
        a, b, host[2][0], host[3][0], _host(out_weight), _host(lse_weight),
        sinks=None if sinks is None else _host(sinks))[2:4], (host[0], host[1]))  # fmt: skip
    _close_all(per_element, want, 1e-5)
    summed = jax.grad(lambda c, d: jax.vmap(loss, in_axes=(0, 0, None, None))(v_a, s_a, c, d).sum(), (0, 1))(
        v_b[0], s_b[0]
    )
    _close_all(summed, [x.sum(0) for x in want], 1e-5)
    if with_sinks:  # the sinks' gradient: one per batch element under vmap, their sum under grad
        sink_loss = _linear_loss(
            lambda a, b, c, d, z: cmj.merge_state(a, b, c, d, sinks=z), out_weight, lse_weight
        )
        got = jax.vmap(jax.grad(sink_loss, 4), in_axes=(0, 0, 0, 0, None))(*batch, sinks)
        want = np.stack([reference.merge_state_backward(*(x[b] for x in host), _host(out_weight), _host(lse_weight),
                                                        sinks=_host(sinks))[4] for b in range(3)])  # fmt: skip
        assert got.shape == (3, 2)
        _close(got, want)
        total = jax.grad(lambda z: jax.vmap(sink_loss, in_axes=(0, 0, 0, 0, None))(*batch, z).sum())(sinks)
        _close(total, want.sum(0))


def test_nested_vmap_of_grad_folds_twice(numpy_kernels, rng):
    batch = _stacked(rng, 6, 3, 2, 8)
    nested = tuple(x.reshape(2, 3, *x.shape[1:]) for x in batch)
    out_weight, lse_weight = _weights(rng, (3, 2, 8)), _weights(rng, (2, 3))
    loss = _linear_loss(cmj.merge_state, out_weight, lse_weight)
    numpy_kernels.backward_calls = 0
    got = jax.jit(jax.vmap(jax.vmap(jax.grad(loss, (0, 1, 2, 3)))))(*nested)
    assert numpy_kernels.backward_calls == 1
    want = _per_element(lambda *a: reference.merge_state_backward(*a, _host(out_weight), _host(lse_weight))[:4],
                        [_host(x) for x in batch])  # fmt: skip
    _close_all([g.reshape(w.shape) for g, w in zip(got, want)], want, 1e-5)


@pytest.mark.parametrize("tokens, states, calls", [(1, 4, 1), (3, 1, 1), (3, 4, 3)])
def test_vmap_of_grad_of_the_n_way_merge_folds_where_the_merge_does(
    numpy_kernels, rng, tokens, states, calls
):
    v = jnp.asarray(rng.standard_normal((3, states, tokens, 2, 8)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((3, states, 2, tokens)) * 3, jnp.float32)
    out_weight, lse_weight = _weights(rng, (tokens, 2, 8)), _weights(rng, (2, tokens))
    loss = _linear_loss(lambda a, b: cmj.merge_states(a, b, lse_base=2), out_weight, lse_weight)
    want = _per_element(lambda a, b: reference.merge_states_backward(a, b, _host(out_weight), _host(lse_weight),
                                                                     lse_base=2)[:2], [_host(v), _host(s)])  # fmt: skip
    for transform in (
        jax.vmap(jax.grad(loss, (0, 1))),
        jax.grad(lambda a, b: jax.vmap(loss)(a, b).sum(), (0, 1)),
    ):
        numpy_kernels.backward_calls = 0
        got = jax.jit(transform)(v, s)
        assert numpy_kernels.backward_calls == calls
        _close_all(got, want, 1e-5)
    nested = jax.vmap(jax.vmap(jax.grad(loss, (0, 1))))(v[None], s[None])  # folded again
    _close_all([g[0] for g in nested], want, 1e-5)


def test_vmap_of_grad_of_the_ragged_merge_is_one_launch_with_the_unbatched_semantics(numpy_kernels, rng):
    v = np.asarray(rng.standard_normal((3, 9, 2, 8)), np.float32)
    v[0, 7:] = np.nan  # rows no token of batch 0 owns
    v, s = jnp.asarray(v), jnp.asarray(rng.standard_normal((3, 2, 9)) * 2, jnp.float32)
    indptr = jnp.array(
        [[0, 3, 3, 7], [0, 1, 9, 9], [0, 5, 12, 12]], jnp.int32
    )  # the last: offsets out of range
    out_weight, lse_weight = _weights(rng, (3, 2, 8)), _weights(rng, (2, 3))
    loss = _linear_loss(
        lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False), out_weight, lse_weight
    )

    def want_one(a, b, c):
        return _ragged_backward(a, b, c, _host(out_weight), _host(lse_weight), None, "e")[:2]

    want = _per_element(want_one, [_host(v), _host(s), np.asarray(indptr)])
    assert (want[0][2, 5:] == 0).all()
    for transform in (
        jax.vmap(jax.grad(loss, (0, 1))),
        jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1)),
    ):
        numpy_kernels.backward_calls = 0
        got = jax.jit(transform)(v, s, indptr)
        assert numpy_kernels.backward_calls == 1
        assert np.isfinite(np.asarray(got[0])).all() and np.isfinite(np.asarray(got[1])).all()
        _close_all(got, want, 1e-5)
    shared = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, 0, None))(v, s, indptr[1])
    _close_all(shared, _per_element(lambda a, b: want_one(a, b, np.asarray(indptr[1])), [_host(v), _host(s)]),
               1e-5)  # fmt: skip
    numpy_kernels.backward_calls = 0
    rows = jax.vmap(jax.grad(loss, 1), in_axes=(None, 0, 0))(v[1], s, indptr)  # unbatched values: one by one
    assert numpy_kernels.backward_calls == 3
    want = [want_one(_host(v[1]), _host(s[b]), np.asarray(indptr[b]))[1] for b in range(3)]
    _close(rows, np.stack(want))


@pytest.mark.parametrize("batch, heads", [(0, 2), (3, 0), (0, 0)])
def test_vmap_of_grad_of_the_ragged_merge_over_an_empty_batch_or_no_heads(numpy_kernels, rng, batch, heads):
    """Gradients of each element's shape, as unbatched (their rows were unfolded by a division by the
    batch, and a reshape to -1 of an empty array: ZeroDivisionError)."""
    rows, tokens = 7, 3
    v = jnp.asarray(rng.standard_normal((batch, rows, heads, 8)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((batch, heads, rows)), jnp.float32)
    indptr = jnp.tile(jnp.array([0, 2, 2, 7], jnp.int32), (batch, 1))
    out_weight, lse_weight = _weights(rng, (tokens, heads, 8)), _weights(rng, (heads, tokens))
    loss = _linear_loss(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False), out_weight,
                        lse_weight)  # fmt: skip
    for transform in (jax.vmap(jax.grad(loss, (0, 1))), jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), (0, 1))):
        got = jax.jit(transform)(v, s, indptr)
        want = [np.zeros((batch, rows, heads, 8)), np.zeros((batch, heads, rows))]
        for b in range(batch):  # (no heads: empty gradients)
            want[0][b], want[1][b] = _ragged_backward(_host(v[b]), _host(s[b]), np.asarray(indptr[b]),
                                                      _host(out_weight), _host(lse_weight), None, "e")[:2]  # fmt: skip
        _close_all(got, want, 1e-5)


def test_vmap_of_grad_of_a_ragged_merge_over_more_rows_than_a_token_may_hold_is_a_launch_an_element(
    numpy_kernels, rng
):
    """Folded, a batch element's unused rows would make one extra token of more states than a
    token may have (zeroed by one row of threads a head): past that, one launch an element."""
    from cupy_merge._catalogue import MAX_STATES_PER_TOKEN

    rows = MAX_STATES_PER_TOKEN + 1
    v = jnp.asarray(rng.standard_normal((2, rows, 1, 8)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((2, 1, rows)), jnp.float32)
    indptr = jnp.array([[0, 3, 5], [0, 1, 4]], jnp.int32)
    out_weight, lse_weight = _weights(rng, (2, 1, 8)), _weights(rng, (1, 2))
    loss = _linear_loss(lambda a, b, c: cmj.merge_states_varlen(a, b, c, check_indptr=False), out_weight,
                        lse_weight)  # fmt: skip
    numpy_kernels.backward_calls = 0
    got = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(v, s, indptr)
    assert numpy_kernels.backward_calls == 2
    for b in range(2):
        want = _ragged_backward(_host(v[b]), _host(s[b]), np.asarray(indptr[b]), _host(out_weight),
                                _host(lse_weight), None, "e")  # fmt: skip
        _close(got[0][b], want[0])
        _close(got[1][b], want[1])


def test_fp8_outputs_and_forward_mode_are_refused_and_merges_of_constants_differentiate(numpy_kernels, rng):
    v, s, w, t = _states(rng, 3, 2, 8)
    scale = jnp.array([0.5], jnp.float32)

    def fp8(x):
        return cmj.merge_state(x, s, w, t, out_dtype=FP8, output_scale=scale)[0].astype(jnp.float32).sum()

    with pytest.raises(
        TypeError, match=r"merge_state: an FP8 \(float8_e4m3fn\) output is not differentiable"
    ):
        jax.grad(fp8)(v)
    with pytest.raises(TypeError, match="merge_states: an FP8 .* not differentiable"):
        jax.jit(jax.grad(lambda x: cmj.merge_states(x, jnp.stack([s, t]), out_dtype=FP8, quant_group_size=8)[1].sum()))(
            jnp.stack([v, w])
        )  # fmt: skip
    assert float(jax.grad(lambda c: c * fp8(v))(jnp.float32(2.0))) == pytest.approx(
        float(fp8(v))
    )  # constants
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda x: cmj.merge_state(v, x, w, t), (s,), (s,))

    def lse_sum(x):
        return cmj.merge_state(v, x, w, t)[1].sum()

    for second in (
        jax.grad(lambda x: jax.grad(lse_sum)(x).sum()),
        jax.hessian(lse_sum),
        jax.jacfwd(jax.grad(lse_sum)),
    ):
        with pytest.raises(NotImplementedError, match="merge_state: merges are differentiable once"):
            second(s)
    merged = cmj.merge_state(v, s, w, t)[0]
    grad = jax.grad(lambda c: (c * cmj.merge_state(v, s, w, t)[0]).sum())(jnp.float32(2.0))
    np.testing.assert_allclose(float(grad), float(merged.sum()), rtol=1e-5)
    assert numpy_kernels.backward_calls == 0


def test_the_public_backward_merges_take_jax_arrays(numpy_kernels, rng):
    v, s, w, t = _states(rng, 5, 3, 8, "bfloat16")
    grad_v, grad_s = _weights(rng, v.shape, "float32"), _weights(rng, s.shape)
    sinks = jnp.asarray(rng.standard_normal(3), jnp.float32)
    host = [_host(x) for x in (v, s, w, t)]
    got = cm.merge_state_backward(v, s, w, t, grad_v, sinks=sinks, lse_base=2)
    want = reference.merge_state_backward(*host, _host(grad_v), sinks=_host(sinks), lse_base=2)
    assert got[0].dtype == jnp.bfloat16
    _close_all(got, want, TOLERANCE["bfloat16"])
    stacked, stacked_lse = jnp.stack([v, w]), jnp.stack([s, t])
    got = jax.jit(lambda *a: cm.merge_states_backward(*a))(stacked, stacked_lse, grad_v, grad_s)
    want = reference.merge_states_backward(_host(stacked), _host(stacked_lse), _host(grad_v), _host(grad_s))
    assert got[2] is None
    _close_all(got[:2], want[:2], TOLERANCE["bfloat16"])
    indptr = jnp.array([0, 2, 2, 5], jnp.int32)
    got = cm.merge_states_varlen_backward(v, s, indptr, grad_v[:3], grad_s[:, :3], sinks=sinks)
    want = reference.merge_states_varlen_backward(host[0], host[1], np.asarray(indptr), _host(grad_v)[:3],
                                                  _host(grad_s)[:, :3], sinks=_host(sinks))  # fmt: skip
    _close_all(got, want, TOLERANCE["bfloat16"])
    with pytest.raises(TypeError, match="^stream: expected None for JAX arrays"):
        cm.merge_states_backward(stacked, stacked_lse, grad_v, stream=0)
    with pytest.raises(ValueError, match="^grad_v: expected shape"):
        cm.merge_states_backward(stacked, stacked_lse, grad_v[:2])


def test_zero_tokens_or_heads_give_empty_gradients_without_a_launch(numpy_kernels):
    for tokens, heads in ((0, 4), (3, 0)):
        v, s = jnp.zeros((tokens, heads, 8), jnp.float32), jnp.zeros((heads, tokens), jnp.float32)
        sinks = jnp.zeros(heads, jnp.float32)
        grads = jax.jit(jax.grad(lambda *a: cmj.merge_state(*a[:4], sinks=a[4])[1].sum(), (0, 1, 4)))(
            v, s, v, s, sinks
        )
        assert [g.shape for g in grads] == [v.shape, s.shape, sinks.shape] and not np.asarray(grads[2]).any()
    assert numpy_kernels.backward_calls == 0


# -- the CUDA branch of the callback, driven by CPU buffers ------------------------------------------------


class _Recorder:
    def __init__(self):
        self.prepared, self.launched, self.pointers = [], [], []

    def prepare(self, launch, device, addresses, programmatic=False):
        self.prepared.append((launch, device, programmatic))
        return ("prepared", launch, device)

    def launch_patched(self, prepared, stream, patches):
        self.launched.append((prepared, stream, patches))


@pytest.fixture
def recorder(monkeypatch):
    record = _Recorder()
    original = _jax_launch._pointer
    monkeypatch.setattr(_jax_launch, "_DLPACK_CUDA", 1)  # CPU buffers take the launch path
    monkeypatch.setattr(_jax_launch, "_devices_to_prepare", lambda: (0,))
    monkeypatch.setattr(_jax_entry, "_LAUNCH_PLATFORMS", _jax_entry._LAUNCH_PLATFORMS | {"cpu"})  # the CPU: device 0
    monkeypatch.setattr(_jax_launch, "_stream_of", lambda context: 1234)
    monkeypatch.setattr(
        _jax_launch, "_pointer", lambda buffer: record.pointers.append(original(buffer)) or record.pointers[-1]
    )
    monkeypatch.setattr(_launch, "prepare", record.prepare)
    monkeypatch.setattr(_launch, "launch_patched", record.launch_patched)
    cmj._clear_caches()
    with jax.default_device(jax.devices("cpu")[0]):
        yield record
    cmj._clear_caches()


def test_launches_are_prepared_at_trace_time_and_patched_with_the_buffers_addresses(recorder, rng):
    v = jnp.asarray(rng.standard_normal((2, 4, 3, 16)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    merge = jax.jit(cmj.merge_states)
    merge(v, s)  # two states: the two-way kernel, with the second state at a byte offset into v
    assert len(recorder.prepared) >= 1 and all(device == 0 for _, device, _ in recorder.prepared)
    assert all(
        programmatic == _tuning.DEFAULT.programmatic_launch for _, _, programmatic in recorder.prepared
    )
    prepared_count = len(recorder.prepared)
    merge(v, s)
    assert len(recorder.prepared) == prepared_count, "prepared again at run time"
    assert len(recorder.launched) == 2
    (entry,) = [e for e in _jax_launch._entries.values() if e.call is not None]
    index = entry.host.index
    for call, ((_, launch, _), stream, patches) in enumerate(recorder.launched):
        assert stream == 1234
        pointers = recorder.pointers[call * len(index) : (call + 1) * len(index)]
        expected = [(slot, pointers[index[field]] + offset) for slot, field, offset in launch.pointers]
        assert patches == expected
        assert any(offset for _, _, offset in launch.pointers), "the second state's offset"


def test_a_backward_launch_is_prepared_at_trace_time_and_sums_the_sinks_from_its_scratch(recorder, rng):
    v = jnp.asarray(rng.standard_normal((7, 3, 16)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    indptr = jnp.array([0, 2, 7], jnp.int32)
    sinks = jnp.zeros(3, jnp.float32)

    def loss(a, b, z):
        return cmj.merge_states_varlen(a, b, indptr, check_indptr=False, sinks=z)[1].sum()

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    grad(v, s, sinks)
    (entry,) = [e for e in _jax_launch._entries.values() if e.scratch]
    # The kernel writes the gradients whole and each row's sink term into a scratch result, which
    # the last launch sums into the sinks' gradients; the callback's caller drops the scratch.
    assert entry.scratch == 1 and entry.results[-1] == ((3 * 2,), np.dtype("float32"))
    kernels = [launch.kernel for (_, launch, _), _, _ in recorder.launched[-2:]]
    assert "merge_states_backward<" in kernels[0] and "sum_sink_terms<" in kernels[1]
    index = entry.host.index
    first_result = min(index[field] for field in ("grad_v", "grad_s", "grad_sinks"))
    pointers = recorder.pointers[-(first_result + len(entry.results)) :]
    for (_, launch, _), stream, patches in recorder.launched[-2:]:
        assert stream == 1234
        assert patches == [(slot, pointers[index[field]] + offset) for slot, field, offset in launch.pointers]
    (_, gradients, _), (_, sums, _) = (launched for launched, _, _ in recorder.launched[-2:])
    assert {field for _, field, _ in sums.pointers} == {"grad_sinks", "sink_terms"}
    assert {field for _, field, _ in gradients.pointers} >= {"grad_v", "grad_s", "sink_terms", "indptr", "grad_out"}
    prepared = len(recorder.prepared)
    grad(v, s, sinks)
    assert len(recorder.prepared) == prepared, "prepared again at run time"


def test_an_address_aligned_below_16_bytes_takes_the_element_aligned_plan(recorder, monkeypatch, rng):
    states = _states(rng, 4, 3, 16)
    merge = jax.jit(cmj.merge_state)
    merge(*states)
    fast = recorder.launched[-1][0][1]
    monkeypatch.setattr(_jax_launch, "_MISALIGNED", ~0)  # every address counts as misaligned
    merge(*states)
    slow = recorder.launched[-1][0][1]
    assert fast.kernel != slow.kernel and "merge_two_states<float, float, 1," in slow.kernel, slow.kernel
    assert {launch.kernel for launch, _, _ in recorder.prepared} == {fast.kernel, slow.kernel}


def test_the_benchmark_and_the_example_say_why_they_skip_without_a_cuda_jax():
    if _has_cuda():
        pytest.skip("JAX has a CUDA device here")
    import io

    from cupy_merge.tools import jax_host_cost

    printed = io.StringIO()
    assert jax_host_cost.benchmark(calls=1, repeats=1, file=printed) == []
    assert "no CUDA device" in printed.getvalue()
    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "jax_split_kv_decode.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


def test_the_ragged_vmap_rule_gives_a_token_of_offsets_out_of_range_an_empty_merged_lse():
    """Folded under vmap, a token of offsets out of range looks in range (its offsets clipped) and
    its rows are handed over with empty LSEs; its merged LSE, NaN from the merge, must be empty
    too, or the kernel that reads it would give those rows NaN gradients instead of zeros."""
    from cupy_merge._ops import MERGE_STATES_VARLEN_BACKWARD

    batch, rows, tokens, heads, head_size = 2, 12, 3, 2, 8
    folded = {}

    def backward_of(cfg):
        def gradients(*arrays):
            folded.update(zip(cfg.fields, arrays))
            return jnp.zeros((batch * rows, heads, head_size)), jnp.zeros((batch * rows, heads))

        return gradients

    fields = ("v", "s", "indptr", "grad_out", "grad_lse", "merged", "merged_lse")
    layouts = ("", "ht", "", "", "ht", "", "ht")
    cfg = _jax_launch._Config(MERGE_STATES_VARLEN_BACKWARD, cm._options.backward_options(), _tuning.DEFAULT, fields, layouts)
    indptr = jnp.array([[0, 4, 8, 12], [0, 5, 9, 40]], jnp.int32)  # batch element 1's last token: past the rows
    merged_lse = jnp.ones((batch, heads, tokens)).at[1, :, 2].set(jnp.nan)
    args = (jnp.ones((batch, rows, heads, head_size)), jnp.ones((batch, heads, rows)), indptr,
            jnp.ones((batch, tokens, heads, head_size)), jnp.ones((batch, heads, tokens)),
            jnp.ones((batch, tokens, heads, head_size)), merged_lse)  # fmt: skip
    _jax_batching.rule(backward_of, cfg, batch, [True] * len(fields), *args)
    lse = np.asarray(folded["merged_lse"])  # token-major, a padded token a batch element: [B * (T + 1), H]
    assert lse.shape == (batch * (tokens + 1), heads) and not np.isnan(lse).any()
    assert (lse[tokens + 1 + 2] == -np.inf).all()  # batch element 1, token 2
    assert (lse[[0, 1, 2, tokens + 1, tokens + 2]] == 1).all()  # the tokens in range keep theirs


# -- issue 47: what must stay per batch element, shard_map types, weak scalars, placement -------------


@pytest.mark.parametrize("cut", [4, 5, 11])
def test_vmap_applies_a_prefill_cut_to_each_batch_elements_own_tokens(numpy_kernels, rng, cut):
    """tokens <= cut < batch * tokens: every token of every element merges (the cut is per element)."""
    batch = _stacked(rng, 3, 4, 2, 8)
    want = _reference_batch(reference.merge_state, *batch)
    for merge in (jax.vmap, lambda f: jax.jit(jax.vmap(f))):
        got = merge(lambda *a: cmj.merge_attn_states(*a, prefill_tokens_with_context=cut))(*batch)
        _close(got[0], want[0])
        _close(got[1], want[1])


def test_vmap_of_the_prefill_cut_and_its_gradients_stay_per_element(numpy_kernels, rng):
    batch = _stacked(rng, 3, 4, 2, 8)
    cut = 2
    want = _reference_batch(reference.merge_state, *batch)
    want[0][:, cut:], want[1][:, :, cut:] = _host(batch[2])[:, cut:], _host(batch[3])[:, :, cut:]
    got = jax.vmap(lambda *a: cmj.merge_attn_states(*a, prefill_tokens_with_context=cut))(*batch)
    _close(got[0], want[0])
    _close(got[1], want[1])

    def loss(v_a, s_a, v_b, s_b):
        v, s = cmj.merge_attn_states(v_a, s_a, v_b, s_b, prefill_tokens_with_context=5)
        return jnp.sum(v * v) + jnp.sum(jnp.sin(s))

    def loss_all(v_a, s_a, v_b, s_b):
        v, s = cmj.merge_state(v_a, s_a, v_b, s_b)
        return jnp.sum(v * v) + jnp.sum(jnp.sin(s))

    got = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)))(*batch)
    want = jax.vmap(jax.grad(loss_all, argnums=(0, 1, 2, 3)))(*batch)  # cut 5 > 4 tokens: every token merges
    for g, w in zip(got, want):
        _close(g, _host(w))


@pytest.mark.parametrize("size", [3, 10])
def test_vmap_over_masks_alone_gives_each_mask_its_own_output(numpy_kernels, rng, size):
    v, s, w, t = _states(rng, 4, 2, 8)
    masks = jnp.asarray(rng.random((size, 4)) < 0.5)
    merged_v, merged_s = reference.merge_state(_host(v), _host(s), _host(w), _host(t))
    for merge in (jax.vmap, lambda f, **k: jax.jit(jax.vmap(f, **k))):
        got_v, got_s = merge(cmj.merge_state_in_place, in_axes=(None, None, None, None, 0))(v, s, w, t, masks)
        for b in range(size):
            keep = ~np.asarray(masks[b])
            want_v = np.where(keep[:, None, None], _host(v), merged_v)
            want_s = np.where(keep[None, :], _host(s), merged_s)
            _close(got_v[b], want_v)
            _close(got_s[b], want_s)


def test_vmap_of_the_masked_merge_with_only_the_other_state_batched(numpy_kernels, rng):
    v, s, _, _ = _states(rng, 4, 2, 8)
    _, _, w, t = _stacked(rng, 3, 4, 2, 8)
    masks = jnp.asarray(rng.random((3, 4)) < 0.5)
    got_v, got_s = jax.vmap(cmj.merge_state_in_place, in_axes=(None, None, 0, 0, 0))(v, s, w, t, masks)
    for b in range(3):
        merged_v, merged_s = reference.merge_state(_host(v), _host(s), _host(w[b]), _host(t[b]))
        keep = ~np.asarray(masks[b])
        _close(got_v[b], np.where(keep[:, None, None], _host(v), merged_v))
        _close(got_s[b], np.where(keep[None, :], _host(s), merged_s))


def _shard_map():
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    return shard_map


@pytest.mark.parametrize("merge", ["merge_state", "merge_states", "merge_states_varlen", "merge_state_in_place"])
def test_grad_inside_shard_map_follows_the_reference(numpy_kernels, rng, merge):
    """The gradients carry the inputs' varying-axes types (check_vma, the default), replicated sinks too."""
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    if merge in ("merge_state", "merge_state_in_place"):
        v_a, s_a, v_b, s_b = _states(rng, 4, 2, 8)
        v, s = jnp.stack([v_a, v_b]), jnp.stack([s_a, s_b])
    else:
        v = jnp.asarray(rng.standard_normal((3, 4, 2, 8)), jnp.float32)
        s = jnp.asarray(rng.standard_normal((3, 2, 4)) * 3, jnp.float32)
    indptr = jnp.asarray([0, 3, 6, 9, 12], jnp.int32)

    def run(v, s, sinks):
        if merge == "merge_state":
            out, lse = cmj.merge_state(v[0], s[0], v[1], s[1], sinks=sinks)
        elif merge == "merge_state_in_place":
            out, lse = cmj.merge_state_in_place(v[0], s[0], v[1], s[1], sinks=sinks)
        elif merge == "merge_states":
            out, lse = cmj.merge_states(v, s, sinks=sinks)
        else:
            rows = v.reshape(12, 2, 8)
            lses = jnp.transpose(s, (1, 0, 2)).reshape(2, 12)
            out, lse = cmj.merge_states_varlen(rows, lses, indptr, check_indptr=False, sinks=sinks)
        return jnp.sum(out * out) + jnp.sum(jnp.sin(lse))

    def reference_loss(v, s, sinks):
        if merge in ("merge_state", "merge_state_in_place", "merge_states"):
            states_v, states_s = v, s
        else:
            states_v = v.reshape(4, 3, 2, 8).transpose(1, 0, 2, 3)
            states_s = jnp.transpose(s, (1, 0, 2)).reshape(2, 4, 3).transpose(2, 0, 1)
        z = jnp.concatenate([states_s, jnp.broadcast_to(sinks[None, :, None], (1, *states_s.shape[1:]))])
        lse = jax.scipy.special.logsumexp(z, axis=0)
        out = jnp.sum(jnp.exp(states_s - lse)[..., None].transpose(0, 2, 1, 3) * states_v, axis=0)
        return jnp.sum(out * out) + jnp.sum(jnp.sin(lse))

    replicated = PartitionSpec()
    sharded = jax.jit(
        _shard_map()(
            jax.grad(run, argnums=(0, 1, 2)), mesh=mesh, in_specs=(PartitionSpec("x"), PartitionSpec("x"), replicated),
            out_specs=(PartitionSpec("x"), PartitionSpec("x"), replicated),
        )
    )
    got = sharded(v, s, sinks)
    want = jax.grad(reference_loss, argnums=(0, 1, 2))(v, s, sinks)
    for g, w in zip(got, want):
        _close(g, _host(w), 1e-4)


def _x64():
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(True)


def test_a_python_float_scale_is_taken_as_float32_with_x64_enabled(numpy_kernels, rng):
    v_a, s_a, v_b, s_b = _states(rng, 4, 2, 8)
    want_v, want_s = reference.merge_state(*(_host(x) for x in (v_a, s_a, v_b, s_b)))
    want_fp8 = reference.quantize_fp8(want_v, 0.5).astype(np.float64)
    with _x64():
        for merge in (cmj.merge_state, cm.merge_state, jax.jit(cmj.merge_state, static_argnames="out_dtype")):
            got_v, got_s = merge(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=0.5)
            _close(got_v, want_fp8)
            _close(got_s, want_s)
        for merge in (cmj.merge_state, cm.merge_state):  # NumPy's float64 is a float (calibration code gives one)
            _close(merge(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=np.float64(0.5))[0], want_fp8)
        scaled = jax.jit(lambda c: cmj.merge_states(jnp.stack([v_a, v_b]), jnp.stack([s_a, s_b]), out_dtype=FP8,
                                                    output_scale=c))  # fmt: skip
        got_v, _ = scaled(0.5)  # a weakly typed float64 tracer
        _close(got_v, want_fp8)


@pytest.mark.parametrize("x64", [False, True])
def test_a_python_int_scale_is_taken_as_float32_eagerly_and_as_a_jit_argument(numpy_kernels, rng, x64):
    v_a, s_a, v_b, s_b = _states(rng, 4, 2, 8)
    want_v, _ = reference.merge_state(*(_host(x) for x in (v_a, s_a, v_b, s_b)))
    want_fp8 = reference.quantize_fp8(want_v, 2.0).astype(np.float64)
    scaled = jax.jit(lambda c: cmj.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=c))
    with _x64() if x64 else contextlib.nullcontext():
        _close(cmj.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=2)[0], want_fp8)
        _close(scaled(2)[0], want_fp8)  # a weakly typed int tracer


SEQUENCES = {
    "indptr": lambda v, s, w, t: cmj.merge_states_varlen(v, s, [0, 2, 4], check_indptr=False),
    "indptr ": lambda v, s, w, t: cmj.merge_states_varlen(v, s, (0, 2, 4)),  # checked on the host by default
    "sinks": lambda v, s, w, t: cmj.merge_state(v, s, w, t, sinks=[0.25, -0.5]),
    "mask": lambda v, s, w, t: cmj.merge_state_in_place(v, s, w, t, [True] * 4),
    "output_scale": lambda v, s, w, t: cmj.merge_state(v, s, w, t, out_dtype=FP8, output_scale=[0.5]),
    "sinks  ": lambda v, s, w, t: cm.merge_state(v, s, w, t, sinks=(0.25, -0.5)),  # the dispatcher's JAX path
}


@pytest.mark.parametrize("case", SEQUENCES)
def test_a_python_list_where_an_array_goes_is_refused_by_its_name(numpy_kernels, rng, case):
    """JAX reads a list as a tree of scalars: the trace failed with "'list' object has no attribute
    'shape'", naming no argument."""
    name = case.strip()
    with pytest.raises(TypeError, match=rf"^{name}: expected a JAX array, got a Python (list|tuple)"):
        SEQUENCES[case](*_states(rng, 4, 2, 8))


def test_a_python_list_in_a_backward_merge_is_refused_by_its_name(numpy_kernels, rng):
    v_a, s_a, v_b, s_b = _states(rng, 4, 2, 8)
    with pytest.raises(TypeError, match=r"^grad_v: expected a JAX array, got a Python list"):
        cm.merge_state_backward(v_a, s_a, v_b, s_b, np.ones((4, 2, 8)).tolist())
    with pytest.raises(TypeError, match=r"^sinks: expected a JAX array, got a Python list"):
        cm.merge_state_backward(v_a, s_a, v_b, s_b, jnp.ones((4, 2, 8)), sinks=[0.25, -0.5])


def test_group_scale_errors_name_what_a_jax_call_passes(numpy_kernels, rng):
    """A JAX merge asks for group scales by quant_group_size (it allocates them): its errors named
    output_block_scale, which the caller never passed."""
    v_a, s_a, v_b, s_b = _states(rng, 4, 2, 16)
    with pytest.raises(TypeError, match=r"^quant_group_size: group scales are for an FP8 .* out is float32"):
        cmj.merge_state(v_a, s_a, v_b, s_b, quant_group_size=16)
    with pytest.raises(ValueError, match=r"^scale_ue8m0: given without quant_group_size \(it rounds"):
        cmj.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=1.0, scale_ue8m0=True)
    with pytest.raises(ValueError, match=r'^is_sf_swizzled_layout: .*; out_dtype is not "nvfp4"'):
        cmj.merge_state(v_a, s_a, v_b, s_b, is_sf_swizzled_layout=False)
    with pytest.raises(TypeError, match=r"^output_block_scale: "):  # given, it keeps its own name
        cmj.merge_state(v_a, s_a, v_b, s_b, output_block_scale=jnp.zeros((4, 2), jnp.float32), quant_group_size=16)
    with pytest.raises(TypeError, match=r"^output_scale: "):  # a bool is no scale
        cmj.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=True)


def test_a_jax_array_on_the_cpu_is_refused_by_name_before_anything_runs(monkeypatch, rng):
    """With CUDA devices present, an operand placed on the CPU device raises naming it, at once."""
    monkeypatch.setattr(_jax_launch, "_devices_to_prepare", lambda: (0,))
    cmj._clear_caches()
    calls = []
    monkeypatch.setattr(_jax_launch, "_on_host", lambda *args: calls.append(args))
    cpu = jax.devices("cpu")[0]
    v_a, s_a, v_b, s_b = (jax.device_put(x, cpu) for x in _states(rng, 4, 2, 8))
    try:
        for merge in (cmj.merge_state, cm.merge_state):
            with pytest.raises((TypeError, ValueError), match=r"v_a: .*CUDA.*CPU"):
                merge(v_a, s_a, v_b, s_b)
        with pytest.raises((TypeError, ValueError), match=r"^v: .*CUDA.*CPU"):
            cmj.merge_states(jnp.stack([v_a, v_b]), jnp.stack([s_a, s_b]))
        assert calls == []
    finally:
        cmj._clear_caches()


@pytest.mark.parametrize("size", [3, 9])  # unrolled, then by lax.map (more than _jax_batching._UNROLL)
def test_vmap_with_values_shared_by_the_batch_merges_each_element_alone(numpy_kernels, rng, size):
    """Shared values are not copied B times: each element is merged on its own, the batched
    operands sliced and the shared ones passed whole, in their places."""
    from cupy_merge import _jax_batching

    assert (size > _jax_batching._UNROLL) == (size == 9)
    v_a = jnp.asarray(rng.standard_normal((size, 4, 2, 8)), jnp.float32)
    s_a = jnp.asarray(rng.standard_normal((size, 2, 4)) * 3, jnp.float32)
    _, _, v_b, s_b = _states(rng, 4, 2, 8)
    numpy_kernels.calls = 0
    got_v, got_s = jax.jit(jax.vmap(cmj.merge_state, in_axes=(0, 0, None, None)))(v_a, s_a, v_b, s_b)
    assert numpy_kernels.calls == size
    for b in range(size):
        want_v, want_s = reference.merge_state(_host(v_a[b]), _host(s_a[b]), _host(v_b), _host(s_b))
        _close(got_v[b], want_v)
        _close(got_s[b], want_s)


def test_a_new_prefill_cut_every_step_leaves_every_cache_bounded(monkeypatch):
    """The prefill cut is a static option: a serving loop passes a new one every step, and each made
    a jitted function and three transform entries that stayed for the process's life."""
    from cupy_merge import _jax_transforms

    monkeypatch.setattr(_jax_launch, "CACHE_LIMIT", 64)
    monkeypatch.setattr(_jax_entry, "_call", lambda route, arrays: None)  # the caches alone, no trace
    _jax_entry._clear_caches()
    x = jnp.zeros(1)
    for cut in range(200):
        cmj.merge_attn_states(x, x, x, x, prefill_tokens_with_context=cut)
    assert 0 < len(_jax_entry._jitted) <= 64 and len(_jax_entry._routes) <= 64 and len(_jax_entry._quick) <= 64
    for factory in (_jax_transforms._batched, _jax_transforms._differentiable, _jax_transforms._once_differentiable):
        assert factory.cache_info().maxsize == 4096  # the limit when the module was imported
    _jax_entry._clear_caches()


def test_remember_keeps_the_first_value_and_never_more_than_its_limit(monkeypatch):
    monkeypatch.setattr(_jax_launch, "CACHE_LIMIT", 4)
    cache: dict = {}
    first, second = object(), object()
    assert _jax_launch.remember(cache, ("k",), first) is first
    assert _jax_launch.remember(cache, ("k",), second) is first  # another thread's value, set first, stays
    for i in range(9):
        _jax_launch.remember(cache, (i,), i)
        assert len(cache) <= 4
