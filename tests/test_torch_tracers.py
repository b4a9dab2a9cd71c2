"""torch beyond eager code and torch.compile: torch.jit.trace, forward-mode AD, dispatch modes that
trace nothing, meta tensors, and the gradient refusals of the ops under torch.compile.

No GPU: the ops' CPU stand-in (the float64 reference, ``cpu_kernels``) or the dispatcher's
(``eager_stand_in``), as in test_torch_ops.py; every value against the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_ops import OPS, _cpu_library, cpu_kernels, eager_stand_in  # noqa: F401 - the fixtures

import cupy_merge as cm
from cupy_merge import reference, torch_ops

T, H, D = 5, 4, 64


def states(rng, requires_grad=False):
    v_a, v_b = (torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32)) for _ in range(2))
    s_a, s_b = (torch.from_numpy((rng.standard_normal((H, T)) * 3).astype(np.float32)) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (v_a, s_a, v_b, s_b)]


def f64(x):
    return x.detach().double().numpy()


def assert_reference(got, want, tolerance=1e-5):
    got, want = f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)


def compiled(function, fullgraph=True):
    torch._dynamo.reset()
    return torch.compile(function, backend="aot_eager", fullgraph=fullgraph)


# -- torch.jit.trace ------------------------------------------------------------------------------------


def test_jit_trace_records_the_op_so_the_trace_merges_new_inputs(cpu_kernels, rng):  # noqa: F811
    """The tracer is neither Dynamo nor a dispatch mode: the merge ran eagerly under it, unseen, and
    the trace replayed the first call's results for any input."""
    traced = torch.jit.trace(lambda *a: cm.merge_state(*a), tuple(states(rng)), check_trace=False)
    assert "cupy_merge::merge_state" in str(traced.graph)
    fresh = states(rng)
    v, s = traced(*fresh)
    want_v, want_s = reference.merge_state(*map(f64, fresh))
    assert_reference(v, want_v)
    assert_reference(s, want_s)


# -- forward-mode AD --------------------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_dual_tensor_is_refused_by_its_name(eager_stand_in, rng, requires_grad):  # noqa: F811
    """A dual tensor need not require grad, and its tangent was dropped without a word."""
    import torch.autograd.forward_ad as fwAD

    v_a, s_a, v_b, s_b = states(rng, requires_grad)
    with fwAD.dual_level():
        dual = fwAD.make_dual(s_b, torch.ones_like(s_b))
        with pytest.raises(TypeError, match="s_b: a dual tensor of forward-mode AD"):
            cm.merge_state(v_a, s_a, v_b, dual)
        assert not eager_stand_in  # refused before anything ran
        v, s = cm.merge_state(v_a, s_a, v_b, s_b)  # tensors without tangents merge as anywhere
    want_v, want_s = reference.merge_state(*map(f64, (v_a, s_a, v_b, s_b)))
    assert_reference(v, want_v)
    assert_reference(s, want_s)


# -- dispatch modes, meta tensors ---------------------------------------------------------------------------


def test_a_stream_inside_a_dispatch_mode_is_refused_in_words_that_fit(cpu_kernels, rng):  # noqa: F811
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False), pytest.raises(ValueError, match="dispatch mode"):
        cm.merge_state(*states(rng), stream=0)


def test_the_ops_give_shapes_on_meta_tensors_and_the_merges_say_why_they_cannot(rng):
    torch_ops.ops()
    v, s = (torch.empty(T, H, D, device="meta"), torch.empty(H, T, device="meta"))
    merged, lse = OPS.merge_state(v, s, v, s)
    assert (merged.shape, lse.shape, merged.device.type) == ((T, H, D), (H, T), "meta")
    stacked, stacked_lse = OPS.merge_states(torch.empty(3, T, H, D, device="meta"), torch.empty(3, H, T, device="meta"))
    assert (stacked.shape, stacked_lse.shape) == ((T, H, D), (H, T))
    with pytest.raises(ValueError, match="v_b"):  # the shape rules run on meta tensors too
        OPS.merge_state(v, s, torch.empty(T, H, D + 8, device="meta"), s)
    with pytest.raises(TypeError, match="v_a: .* on meta; meta tensors have no memory"):
        cm.merge_state(v, s, v, s)


# -- gradients under torch.compile: refused as eagerly ---------------------------------------------------


def test_a_backward_merge_of_inputs_that_require_grad_is_refused_compiled_as_eagerly(cpu_kernels, rng):  # noqa: F811
    """Compiled, the backward op ran and its results came back detached: a loss on them lost that term."""
    v_a, s_a, v_b, s_b = states(rng, requires_grad=True)
    grad_v = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32))

    def loss(*arrays):
        return (cm.merge_state_backward(*arrays, grad_v)[0] * grad_v).sum()

    with pytest.raises(Exception, match="not differentiable again"):
        compiled(loss)(v_a, s_a, v_b, s_b)
    with pytest.raises(Exception, match="not differentiable again"):  # the op by hand
        compiled(lambda *a: OPS.merge_state_backward(*a, grad_v))(v_a, s_a, v_b, s_b)


def test_an_out_op_by_hand_on_inputs_that_require_grad_is_refused_compiled(cpu_kernels, rng):  # noqa: F811
    """The functional op was refused in differentiated compiled code, the ``*_out`` op not: its
    results carried no gradient."""

    def merge_into(v_a, s_a, v_b, s_b):
        out, out_lse = torch.empty(T, H, D), torch.empty(H, T)
        OPS.merge_state_out(out, out_lse, v_a, s_a, v_b, s_b)
        return out.sum() + out_lse.sum()

    with pytest.raises(Exception, match="writes into its arguments"):
        compiled(merge_into)(*states(rng, requires_grad=True))


def test_one_state_twice_is_differentiable_under_fullgraph_compile(cpu_kernels, rng):  # noqa: F811
    """merge_state(x, s, x, s): Dynamo refuses a Function given one tensor twice, in words that name no merge."""
    v, s, _, _ = states(rng, requires_grad=True)
    merged, lse = compiled(lambda x, y: cm.merge_state(x, y, x, y))(v, s)
    grad_v, grad_s = rng.standard_normal(merged.shape), rng.standard_normal(lse.shape)
    torch.autograd.backward([merged, lse], [torch.from_numpy(grad_v).float(), torch.from_numpy(grad_s).float()])
    want = reference.merge_state_backward(f64(v), f64(s), f64(v), f64(s), grad_v, grad_s)
    assert_reference(merged, reference.merge_state(f64(v), f64(s), f64(v), f64(s))[0])
    assert_reference(v.grad, want[0] + want[2])
    assert_reference(s.grad, want[1] + want[3])


def test_importing_cupy_merge_after_torch_leaves_dynamo_unloaded():
    """The forward-mode refusal's Dynamo-proof wrapper (torch.compiler.disable imports Dynamo, a
    second) is made at its first use, not when the ops are defined."""
    import subprocess
    import sys

    code = "import sys, torch, cupy_merge; cupy_merge.torch_ops.ops(); print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


# -- inside a dual level: tensors without tangents merge as anywhere --------------------------------------


def test_plain_tensors_merge_inside_a_dual_level_under_modes_tracers_and_threads(cpu_kernels, rng):  # noqa: F811
    """torch keeps one dual level for the process: a dispatch mode, torch.jit.trace or make_fx inside
    it (or beside it, in another thread) sees real tensors and refuses only tangents."""
    import threading

    import torch.autograd.forward_ad as fwAD
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    arrays = states(rng)
    want_v, want_s = reference.merge_state(*map(f64, arrays))
    with fwAD.dual_level():
        with FlopCounterMode(display=False):
            assert_reference(cm.merge_state(*arrays)[0], want_v)
        traced = torch.jit.trace(lambda *a: cm.merge_state(*a), tuple(arrays), check_trace=False)
        assert_reference(traced(*arrays)[1], want_s)
        assert_reference(make_fx(lambda *a: cm.merge_state(*a))(*arrays)(*arrays)[0], want_v)
        with pytest.raises(TypeError, match="v_b: a dual tensor of forward-mode AD"):
            torch.jit.trace(lambda *a: cm.merge_state(*a), (*arrays[:2], fwAD.make_dual(arrays[2], arrays[0]),
                                                               arrays[3]), check_trace=False)  # fmt: skip
    entered, leave = threading.Event(), threading.Event()

    def other_thread():
        with fwAD.dual_level():
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert entered.wait(30)
        with FlopCounterMode(display=False):
            assert_reference(cm.merge_state(*arrays)[0], want_v)
    finally:
        leave.set()
        thread.join()


def test_a_dual_level_keeps_the_callers_tuning_for_the_backward(eager_stand_in, rng):  # noqa: F811
    import torch.autograd.forward_ad as fwAD

    from cupy_merge import _tuning

    tuning = _tuning.DEFAULT.replace(min_blocks=7)
    arrays = states(rng, requires_grad=True)
    with fwAD.dual_level(), _tuning.use(tuning):
        merged, lse = cm.merge_state(*arrays)
        assert merged.grad_fn.tuning == tuning
        torch.autograd.backward([merged, lse], [torch.ones_like(merged), torch.ones_like(lse)])
    want = reference.merge_state_backward(*map(f64, arrays), np.ones(merged.shape), np.ones(lse.shape))
    for array, gradient in zip(arrays, want):
        assert_reference(array.grad, gradient)


def test_bind_and_the_outputs_refuse_dual_tensors_by_name(eager_stand_in, rng):  # noqa: F811
    import torch.autograd.forward_ad as fwAD

    v_a, s_a, v_b, s_b = states(rng)
    with fwAD.dual_level():
        with pytest.raises(TypeError, match="v_a: a dual tensor of forward-mode AD"):
            cm.bind(cm.merge_state, fwAD.make_dual(v_a, v_b), s_a, v_b, s_b)
        with pytest.raises(TypeError, match="output: a dual tensor of forward-mode AD"):
            cm.merge_attn_states(fwAD.make_dual(torch.empty_like(v_a), v_b), v_a, s_a, v_b, s_b)
    assert not eager_stand_in


def test_a_jit_trace_of_a_backward_merge_is_refused_before_it_runs(eager_stand_in, rng):  # noqa: F811
    """The backward ops return ``Tensor?`` (grad_sinks), which the tracer cannot record: it ran the
    kernel, then failed with "unsupported output type"."""
    v_a, s_a, v_b, s_b = states(rng)
    with pytest.raises(TypeError, match="merge_state_backward: torch.jit.trace cannot record the backward merges"):
        torch.jit.trace(lambda *a: cm.merge_state_backward(*a)[:2], (v_a, s_a, v_b, s_b, v_a), check_trace=False)
    assert not eager_stand_in
