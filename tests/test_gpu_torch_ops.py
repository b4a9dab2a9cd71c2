"""The torch integration on a GPU: opcheck with the real kernels, ``torch.compile`` (Inductor, CUDA-graph
trees) against the float64 reference, autograd against the reference's backward, the eager path's isolation
from the dispatcher, and the fakes' messages against the eager ones.

Fresh random data every run; outputs the caller passes are poisoned with NaN first, so an element the
kernel fails to write shows. Tolerances as in test_gpu_merge.py (relative error of the whole array).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_arrays import fill_nan, relative_error, to_host

import cupy_merge as cm
from cupy_merge import reference, torch_ops
from cupy_merge.tools import torch_host_cost

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

T, H, D = 37, 4, 128
FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
GIVEN_TOLERANCE = 4e-2  # test_gpu_backward.py's, for gradients given the merge's 16-bit results
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def ops():
    return torch_ops.ops()


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def states(dtype=torch.bfloat16, tokens=T, requires_grad=False):
    """Two states; the first LSE a token-major buffer's transpose (no copy)."""
    v_a, v_b = randn(tokens, H, D, dtype=dtype), randn(tokens, H, D, dtype=dtype)
    s_a, s_b = randn(tokens, H, scale=3).t(), randn(H, tokens, scale=3)
    return [x.requires_grad_(requires_grad) for x in (v_a, s_a, v_b, s_b)]


def host(x):
    return None if x is None else to_host(x)


def check(got, want, dtype, what="", tolerance=None):
    got = host(got)
    assert np.isfinite(got).all(), f"{what}: not every element was written"
    error = relative_error(got, want)
    assert error <= (tolerance or TOLERANCE[dtype]), f"{what}: relative error {error:.2e}"


def fp8_within_one_step(got, want_scaled):
    """Dequantised FP8 against the exact ``reference / scale``: within one FP8 step (test_gpu_fp8.py)."""
    got = got.float().cpu().numpy().astype(np.float64)
    want = np.clip(want_scaled, -448.0, 448.0)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.minimum(np.abs(want), 448.0), 2.0**-6))) - 3)
    worst = float((np.abs(got - want) / step).max())
    assert worst <= 1.0, f"an element is {worst:.2f} FP8 steps from the reference"


# -- opcheck with the real kernels ----------------------------------------------------------------------


def _opcheck_cases():
    r = randn
    ragged = [r(9, H, D), r(H, 9), torch.tensor([0, 2, 2, 9, 9], dtype=torch.int32, device="cuda")]
    block = r(T, H * D // 64)
    return {
        "merge_attn_states": ("merge_attn_states", [r(T, H, D), *states(torch.float32), r(H, T)], {}),
        "merge_attn_states bf16 no LSE, cut": ("merge_attn_states", [r(T, H, D, dtype=torch.bfloat16),
                                                                     *states(), None, 11], {"lse_base": "2"}),
        "merge_attn_states sinks": ("merge_attn_states", [r(T, H, D), *states(torch.float32)], {"sinks": r(H)}),
        "merge_attn_states FP8 tensor scale": ("merge_attn_states", [torch.empty(T, H, D, dtype=FP8, device="cuda"),
                                                                     *states(), None, None, r(1).abs() + 0.1], {}),
        "merge_attn_states FP8 groups": ("merge_attn_states", [torch.empty(T, H, D, dtype=FP8, device="cuda"),
                                                               *states(), None, None, None, block, 64],
                                         {"scale_ue8m0": True}),
        "merge_state": ("merge_state", states(), {"out_dtype": torch.float32}),
        "merge_state FP8": ("merge_state", states(), {"out_dtype": FP8, "output_scale": r(1).abs() + 0.1}),
        "merge_state sinks base 2": ("merge_state", states(torch.float16), {"sinks": r(H), "lse_base": "2"}),
        "merge_state_out": ("merge_state_out", [r(T, H, D, dtype=torch.bfloat16), r(H, T), *states()], {}),
        "merge_state_in_place": ("merge_state_in_place", [*states(torch.float16), torch.rand(T, device="cuda") > 0.5],
                                 {"sinks": r(H)}),
        "merge_states": ("merge_states", [r(3, T, H, D), r(3, H, T)], {"out_dtype": torch.bfloat16}),
        "merge_states sinks": ("merge_states", [r(5, T, H, D, dtype=torch.bfloat16), r(5, H, T)], {"sinks": r(H)}),
        "merge_states_out": ("merge_states_out", [r(T, H, D), r(H, T), r(3, T, H, D), r(3, H, T)], {}),
        "merge_states_out FP8 groups": ("merge_states_out", [torch.empty(T, H, D, dtype=FP8, device="cuda"), r(H, T),
                                                             r(3, T, H, D), r(3, H, T)],
                                        {"output_block_scale": block, "quant_group_size": 64}),
        "merge_states_varlen": ("merge_states_varlen", ragged, {}),  # check_indptr=True: a host check
        "merge_states_varlen unchecked": ("merge_states_varlen", ragged, {"check_indptr": False}),
        "merge_states_varlen_out": ("merge_states_varlen_out", [r(4, H, D), r(H, 4), *ragged], {"sinks": r(H)}),
        "merge_state_backward": ("merge_state_backward", [*states(), r(T, H, D, dtype=torch.bfloat16), r(H, T)],
                                 {"sinks": r(H)}),
        "merge_states_backward": ("merge_states_backward", [r(3, T, H, D), r(3, H, T), r(T, H, D)], {}),
        "merge_states_varlen_backward": ("merge_states_varlen_backward", [*ragged, r(4, H, D), r(H, 4)], {}),
    }  # fmt: skip


OPCHECK_CASES = _opcheck_cases() if torch.cuda.is_available() else {}
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# The schema check compares a written FP8 tensor before and after with arithmetic torch lacks for FP8.
FP8_WRITTEN_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case):
    name, args, kwargs = OPCHECK_CASES[case]
    written_fp8 = any(isinstance(x, torch.Tensor) and x.dtype == FP8 for x in args)
    torch.library.opcheck(getattr(ops(), name).default, args, kwargs,
                          test_utils=FP8_WRITTEN_CHECKS if written_fp8 else ALL_CHECKS)  # fmt: skip


# -- torch.compile with Inductor against the reference ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lse_base", ["e", 2])
def test_compiled_two_way_merges_follow_the_reference(dtype, lse_base):
    cut = 11

    def step(out, out_lse, v_a, s_a, v_b, s_b, sinks, out2):
        v1, s1 = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=torch.float32, lse_base=lse_base)
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, cut, lse_base=lse_base)
        v3, s3 = cm.merge_state(v_a, s_a, v_b, s_b, sinks=sinks, lse_base=lse_base)
        _, s4 = cm.merge_state(v_a, s_a, v_b, s_b, out=out2, lse_base=lse_base)  # out= given, out_lse allocated
        return v1, s1, v3, s3, s4

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):  # new data each call: nothing of it is compiled in
        v_a, s_a, v_b, s_b = states(dtype)
        sinks = randn(H)
        out, out2 = torch.empty(T, H, D, dtype=dtype, device="cuda"), torch.empty(T, H, D, dtype=dtype, device="cuda")
        out_lse = torch.empty(H, T, device="cuda")
        for x in (out, out2, out_lse):
            fill_nan(x)
        v1, s1, v3, s3, s4 = compiled(out, out_lse, v_a, s_a, v_b, s_b, sinks, out2)
        arrays = [host(x) for x in (v_a, s_a, v_b, s_b)]
        want_v, want_s = reference.merge_state(*arrays, lse_base)
        check(v1, want_v, torch.float32, "merge_state out_dtype=float32")
        check(s1, want_s, torch.float32, "its LSE")
        check(out2, want_v, dtype, "merge_state(out=)")
        check(s4, want_s, torch.float32, "its allocated LSE")
        cut_v, cut_s = want_v.copy(), want_s.copy()
        cut_v[cut:], cut_s[:, cut:] = arrays[2][cut:], arrays[3][:, cut:]
        check(out, cut_v, dtype, "merge_attn_states past the cut")
        check(out_lse, cut_s, torch.float32, "its LSE")
        want_v, want_s = reference.merge_state(*arrays, lse_base, sinks=host(sinks))
        check(v3, want_v, dtype, "with sinks")
        check(s3, want_s, torch.float32, "its LSE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_in_place_merge_leaves_masked_tokens_alone(dtype):
    def step(v, s, v_other, s_other, mask):
        cm.merge_state_in_place(v, s, v_other, s_other, mask)
        return v.float().sum()

    compiled = torch.compile(step, fullgraph=True)
    v, s, v_other, s_other = states(dtype)
    mask = torch.rand(T, device="cuda") > 0.4
    before_v, before_s = host(v), host(s)
    want_v, want_s = reference.merge_state(before_v, before_s, host(v_other), host(s_other))
    keep = ~host(mask).astype(bool)
    want_v[keep], want_s[:, keep] = before_v[keep], before_s[:, keep]
    compiled(v, s, v_other, s_other, mask)
    check(v, want_v, dtype, "values")
    check(s, want_s, torch.float32, "LSE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_n_way_and_ragged_merges_follow_the_reference(dtype):
    def step(v, s, v_rows, s_rows, indptr, sinks, out, out_lse):
        dense = cm.merge_states(v, s, out_dtype=torch.bfloat16)
        ragged = cm.merge_states_varlen(v_rows, s_rows, indptr, sinks=sinks, check_indptr=False)
        cm.merge_states(v, s, out=out, out_lse=out_lse, sinks=sinks)
        return dense, ragged

    compiled = torch.compile(step, fullgraph=True)
    counts = np.array([3, 0, 1, 6, 2])
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
    for _ in range(2):
        v, s = randn(5, T, H, D, dtype=dtype), randn(5, H, T, scale=3)
        v_rows, s_rows = randn(int(counts.sum()), H, D, dtype=dtype), randn(H, int(counts.sum()), scale=3)
        sinks = randn(H)
        out, out_lse = torch.empty(T, H, D, dtype=dtype, device="cuda"), torch.empty(H, T, device="cuda")
        fill_nan(out)
        fill_nan(out_lse)
        (dense_v, dense_s), (ragged_v, ragged_s) = compiled(v, s, v_rows, s_rows, indptr, sinks, out, out_lse)
        want_v, want_s = reference.merge_states(host(v), host(s))
        check(dense_v, want_v, torch.bfloat16, "dense, bfloat16 out")
        check(dense_s, want_s, torch.float32, "dense LSE")
        want_v, want_s = reference.merge_states(host(v), host(s), sinks=host(sinks))
        check(out, want_v, dtype, "dense out= with sinks")
        check(out_lse, want_s, torch.float32, "its LSE")
        want_v, want_s = reference.merge_states_varlen(host(v_rows), host(s_rows), host(indptr).astype(np.int64),
                                                       sinks=host(sinks))  # fmt: skip
        check(ragged_v, want_v, dtype, "ragged")
        check(ragged_s, want_s, torch.float32, "ragged LSE")


def test_compiled_fp8_outputs_follow_the_reference():
    group = 64

    def step(v_a, s_a, v_b, s_b, scale, out8, block):
        v8, s = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=scale)
        cm.merge_attn_states(out8, v_a, s_a, v_b, s_b, None, None, None, block, group)
        return v8, s

    compiled = torch.compile(step, fullgraph=True)
    v_a, s_a, v_b, s_b = states(torch.bfloat16)
    scale = torch.tensor([0.02], device="cuda")
    out8 = torch.empty(T, H, D, dtype=FP8, device="cuda")
    block = torch.empty(T, H * D // group, device="cuda")
    fill_nan(block)
    v8, s = compiled(v_a, s_a, v_b, s_b, scale, out8, block)
    want_v, want_s = reference.merge_state(*(host(x) for x in (v_a, s_a, v_b, s_b)))
    assert v8.dtype == FP8
    fp8_within_one_step(v8, want_v / 0.02)
    check(s, want_s, torch.float32, "LSE")
    _, want_scales = reference.quantize_fp8_groups(want_v, group)
    np.testing.assert_allclose(host(block), want_scales, rtol=1e-5)
    groups = want_v.reshape(T, -1, group) / want_scales[..., None]
    fp8_within_one_step(out8, groups.reshape(T, H, D))


# -- CUDA-graph trees ----------------------------------------------------------------------------------------


def _attention(q, keys, values):
    """A split-KV decode step's attention per split: q [T, H, D], keys/values [S, H, L, D] ->
    partial values [S, T, H, D] (float32) and their LSE [S, H, T]."""
    scores = torch.matmul(q.transpose(0, 1).float(), keys.float().transpose(-1, -2)) * D**-0.5  # [S, H, T, L]
    lse = torch.logsumexp(scores, dim=-1)
    partial = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())  # [S, H, T, D]
    return partial.transpose(1, 2), lse


def test_reduce_overhead_captures_a_decode_step_and_replays_it_with_new_data():
    from torch._dynamo.utils import counters

    splits, length, tokens = 4, 64, 2
    keys = randn(splits, H, length, D, dtype=torch.bfloat16)
    values = randn(splits, H, length, D, dtype=torch.bfloat16)
    torch._dynamo.mark_static_address(keys)  # the KV cache: read in place by every replay
    torch._dynamo.mark_static_address(values)

    def step(q):
        partial, lse = _attention(q, keys, values)
        out, out_lse = cm.merge_states(partial, lse, out_dtype=torch.bfloat16)  # allocated in the graph
        first, first_lse = cm.merge_states(partial.narrow(0, 0, 2), lse.narrow(0, 0, 2))
        rest, rest_lse = cm.merge_states(partial.narrow(0, 2, 2), lse.narrow(0, 2, 2))
        again, again_lse = cm.merge_state(first, first_lse, rest, rest_lse)
        return out, out_lse, again, again_lse

    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        for call in range(5):  # warm-up, record, then replays
            q = randn(tokens, H, D, dtype=torch.bfloat16)
            keys.copy_(randn(splits, H, length, D, dtype=torch.bfloat16))
            values.copy_(randn(splits, H, length, D, dtype=torch.bfloat16))
            torch.compiler.cudagraph_mark_step_begin()
            out, out_lse, again, again_lse = (x.clone() for x in compiled(q))
            whole_k = host(keys).transpose(0, 2, 1, 3).reshape(splits * length, H, D)
            whole_v = host(values).transpose(0, 2, 1, 3).reshape(splits * length, H, D)
            want_v, want_s = reference.attention(host(q), whole_k, whole_v)
            check(out, want_v, torch.bfloat16, f"call {call}: the merged step")
            assert relative_error(host(out_lse), want_s) <= 1e-4, f"call {call}: its LSE"
            assert relative_error(host(again), want_v) <= 1e-4, f"call {call}: merged in two steps"
            assert relative_error(host(again_lse), want_s) <= 1e-4, f"call {call}: its LSE"
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_check_indptr_in_a_captured_graph_skips_the_host_read_and_the_kernel_guards():
    counts = [2, 0, 3, 4]
    total = sum(counts)
    v, s = randn(total, H, D, dtype=torch.bfloat16), randn(H, total, scale=3)
    good = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
    bad = torch.tensor([0, 5, 2, 7, 9], dtype=torch.int32, device="cuda")  # token 1: rows 5 to 2

    def step(v, s, indptr):
        return cm.merge_states_varlen(v, s, indptr)  # check_indptr=True, the default

    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        captured = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up (checked on the host), record, replay
            torch.compiler.cudagraph_mark_step_begin()
            got_v, _ = captured(v, s, good)
        want_v, _ = reference.merge_states_varlen(host(v), host(s), counts_to_indptr(counts))
        check(got_v, want_v, torch.bfloat16, "good offsets")
        torch.compiler.cudagraph_mark_step_begin()
        got_v = host(captured(v, s, bad)[0])  # a replay: no host check, the kernel's guard
    assert np.isnan(got_v[1]).all() and np.isfinite(got_v[[0, 2, 3]]).all()
    torch._dynamo.reset()
    plain = torch.compile(step, fullgraph=True)  # no CUDA graph: the kernel checks on the host
    with pytest.raises(ValueError, match=r"^indptr: expected non-decreasing offsets, got indptr\[1\] = 5"):
        plain(v, s, bad)


def counts_to_indptr(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


# -- autograd ------------------------------------------------------------------------------------------------


def _differentiable_cases(dtype, with_sinks, lse_base):
    """(name, function, its inputs, the reference's gradients of them given (grad_v, grad_s))."""
    def fresh_sinks():  # one for each merge: gradients would add up in a shared one
        return randn(H).requires_grad_() if with_sinks else None

    two = states(dtype, requires_grad=True)
    stack = [randn(3, T, H, D, dtype=dtype).requires_grad_(), randn(3, H, T, scale=3).requires_grad_()]
    # Few rows of many states: the gradient kernel given the forward's results, saved for it.
    many = [randn(40, T, H, D, dtype=dtype).requires_grad_(), randn(40, H, T, scale=3).requires_grad_()]
    counts = [3, 0, 1, 6, 2]
    indptr = torch.tensor(counts_to_indptr(counts), device="cuda")
    ragged = [randn(sum(counts) + 1, H, D, dtype=dtype).requires_grad_(),  # a last row no token owns
              randn(H, sum(counts) + 1, scale=3).requires_grad_()]  # fmt: skip
    sinks = [fresh_sinks() for _ in range(4)]
    z = [host(x) for x in sinks]

    def two_way(v_a, s_a, v_b, s_b, sinks):
        return cm.merge_state(v_a, s_a, v_b, s_b, sinks=sinks, lse_base=lse_base)

    def dense(v, s, sinks):
        return cm.merge_states(v, s, sinks=sinks, lse_base=lse_base)

    def varlen(v, s, sinks):
        return cm.merge_states_varlen(v, s, indptr, sinks=sinks, lse_base=lse_base)

    def many_states(v, s, sinks):
        return cm.merge_states(v, s, sinks=sinks, lse_base=lse_base)

    return [
        (two_way, [*two, sinks[0]], lambda gv, gs: reference.merge_state_backward(
            *(host(x) for x in two), gv, gs, sinks=z[0], lse_base=lse_base)),
        (dense, [*stack, sinks[1]], lambda gv, gs: reference.merge_states_backward(
            *(host(x) for x in stack), gv, gs, sinks=z[1], lse_base=lse_base)),
        (varlen, [*ragged, sinks[2]], lambda gv, gs: reference.merge_states_varlen_backward(
            *(host(x) for x in ragged), host(indptr).astype(np.int64), gv, gs, sinks=z[2], lse_base=lse_base)),
        (many_states, [*many, sinks[3]], lambda gv, gs: reference.merge_states_backward(
            *(host(x) for x in many), gv, gs, sinks=z[3], lse_base=lse_base)),
    ]  # fmt: skip


def _check_gradients(dtype, with_sinks, lse_base, compile_it):
    for fn, inputs, want in _differentiable_cases(dtype, with_sinks, lse_base):
        run = torch.compile(fn, fullgraph=True) if compile_it else fn
        v, s = run(*inputs)
        assert v.requires_grad and s.requires_grad
        grad_v, grad_s = randn(*v.shape, dtype=v.dtype), randn(*s.shape)
        torch.autograd.backward([v, s], [grad_v, grad_s])
        expected = want(host(grad_v), host(grad_s))
        given = [x for x in inputs if x is not None]
        wanted = list(expected[: len(given) - with_sinks]) + ([expected[-1]] if with_sinks else [])
        for index, (tensor, grad) in enumerate(zip(given, wanted)):
            assert tensor.grad is not None, f"{fn.__name__}: no gradient for input {index}"
            assert tensor.grad.dtype == tensor.dtype
            # As test_gpu_backward.py: every gradient to the precision of the values' dtype; given
            # the merge's results (few rows of many states), the LSE and sinks' gradients carry the
            # rounding of its 16-bit output (GIVEN_TOLERANCE there).
            loose = fn.__name__ == "many_states" and index > 0 and dtype != torch.float32
            check(tensor.grad, grad, dtype, f"{fn.__name__}: gradient of input {index}",
                  GIVEN_TOLERANCE if loose else None)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("lse_base", ["e", 2])
def test_eager_gradients_follow_the_reference(dtype, with_sinks, lse_base):
    _check_gradients(dtype, with_sinks, lse_base, compile_it=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_compiled_gradients_follow_the_reference(dtype, with_sinks):
    _check_gradients(dtype, with_sinks, "e" if dtype == torch.float32 else 2, compile_it=True)


def test_a_loss_of_broadcast_gradients_is_differentiated():
    v_a, s_a, v_b, s_b = states(torch.float16, requires_grad=True)
    v, s = cm.merge_state(v_a, s_a, v_b, s_b)
    (v.float().sum() + s.sum()).backward()  # v.sum()'s gradient is a stride-0 broadcast
    want = reference.merge_state_backward(*(host(x) for x in (v_a, s_a, v_b, s_b)), np.ones((T, H, D)),
                                          np.ones((H, T)))  # fmt: skip
    check(v_a.grad, want[0], torch.float16, "v_a")
    check(s_b.grad, want[3], torch.float32, "s_b")


def test_the_op_called_directly_in_eager_code_is_differentiable():
    v_a, s_a, v_b, s_b = states(torch.float32, requires_grad=True)
    v, s = ops().merge_state(v_a, s_a, v_b, s_b)
    grad_v, grad_s = randn(T, H, D), randn(H, T)
    torch.autograd.backward([v, s], [grad_v, grad_s])
    want = reference.merge_state_backward(*(host(x) for x in (v_a, s_a, v_b, s_b)), host(grad_v), host(grad_s))
    for tensor, grad in zip((v_a, s_a, v_b, s_b), want):
        check(tensor.grad, grad, torch.float32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda v_a, s_a, v_b, s_b: cm.merge_attn_states(torch.empty_like(v_a.detach()), v_a, s_a, v_b, s_b),
         "^merge_attn_states: writes into its arguments, so autograd cannot differentiate it"),
        (lambda v_a, s_a, v_b, s_b: cm.merge_state_in_place(v_a.detach().clone(), s_a.detach().clone(), v_b, s_b),
         "^merge_state_in_place: writes into its arguments"),
        (lambda v_a, s_a, v_b, s_b: cm.merge_state(v_a, s_a, v_b, s_b, out=torch.empty_like(v_a.detach())),
         r"^merge_state: an input requires grad, and a merge into given tensors \(out=\) is not differentiable"),
        (lambda v_a, s_a, v_b, s_b: cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8,
                                                   output_scale=torch.ones(1, device="cuda")),
         r"^merge_state: an input requires grad, and an FP8 \(float8_e4m3fn\) output is not differentiable"),
    ],
    ids=["merge_attn_states", "merge_state_in_place", "out=", "FP8"],
)  # fmt: skip
def test_undifferentiable_forms_refuse_inputs_that_require_grad(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(*states(requires_grad=True))


def test_a_second_derivative_is_refused():
    v_a, s_a, v_b, s_b = states(torch.float32, requires_grad=True)
    v, _ = cm.merge_state(v_a, s_a, v_b, s_b)
    with pytest.raises(RuntimeError, match="the merges' gradients are not differentiable again"):
        torch.autograd.grad(v.sum(), v_a, create_graph=True)


# -- the eager path, the dispatcher and the fakes ------------------------------------------------------


def test_eager_public_calls_never_enter_the_dispatcher():
    v_a, s_a, v_b, s_b = states()
    out, out_lse = torch.empty_like(v_a), torch.empty(H, T, device="cuda")

    def public():
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)
        cm.merge_state(v_a, s_a, v_b, s_b)
        cm.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]))

    def events(fn):
        fn()  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            fn()
        return [event.name for event in profile.events()]

    assert not [name for name in events(public) if name.startswith("cupy_merge::")]
    assert "cupy_merge::merge_attn_states" in events(lambda: ops().merge_attn_states(out, v_a, s_a, v_b, s_b))


def _bad_calls():
    """(label, eager public call, the op's call): the same bad arguments, as tensors."""
    cuda = {"device": "cuda"}
    return {
        "v_b shape": (lambda a: cm.merge_state(a[0], a[1], torch.empty(T, 2, D, **cuda), a[3]),
                      lambda a: ops().merge_state(a[0], a[1], torch.empty(T, 2, D, **cuda), a[3])),
        "token-major s_a": (lambda a: cm.merge_state(a[0], a[1].t(), a[2], a[3]),
                            lambda a: ops().merge_state(a[0], a[1].t(), a[2], a[3])),
        "FP8 output without scale": (
            lambda a: cm.merge_attn_states(torch.empty(T, H, D, dtype=FP8, **cuda), *a),
            lambda a: ops().merge_attn_states(torch.empty(T, H, D, dtype=FP8, **cuda), *a)),
        "N-way LSE": (lambda a: cm.merge_states(torch.stack([a[0], a[2]]), torch.stack([a[3], a[3]]).transpose(1, 2)),
                      lambda a: ops().merge_states(torch.stack([a[0], a[2]]), torch.stack([a[3], a[3]]).transpose(1, 2))),
        "float offsets": (lambda a: cm.merge_states_varlen(a[0], a[3], torch.zeros(T + 1, **cuda)),
                          lambda a: ops().merge_states_varlen(a[0], a[3], torch.zeros(T + 1, **cuda))),
        "sinks shape": (lambda a: cm.merge_state_in_place(*a, sinks=torch.zeros(H + 1, **cuda)),
                        lambda a: ops().merge_state_in_place(*a, sinks=torch.zeros(H + 1, **cuda))),
        "gradient shape": (lambda a: cm.merge_state_backward(*a, torch.empty(T, H, 64, **cuda)),
                           lambda a: ops().merge_state_backward(*a, torch.empty(T, H, 64, **cuda))),
    }  # fmt: skip


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("label", list(BAD_CALLS))
def test_the_fakes_raise_the_eager_messages_word_for_word(label):
    from torch._subclasses.fake_tensor import FakeTensorMode

    eager, op = BAD_CALLS[label]
    arrays = states(torch.float32)
    with pytest.raises((TypeError, ValueError)) as eager_error:
        eager(arrays)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in arrays]
        with pytest.raises(type(eager_error.value)) as fake_error:
            op(fakes)
    assert str(fake_error.value) == str(eager_error.value)


def test_the_host_cost_table_runs():
    with open(os.devnull, "w") as quiet:
        table = torch_host_cost.host_cost_table(batch=4, batches=2, file=quiet)
    assert len(table) == 7 and all(micros > 0 for micros in table.values())


def test_the_torch_compile_example_runs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_compile_decode.py")], check=False,
                            capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_a_jit_trace_merges_new_inputs_and_a_dual_tensor_is_refused():
    """torch.jit.trace records the op (its kernel, the eager merge, runs inside the tracer's op);
    forward-mode AD's dual tensors are refused, eagerly and compiled, never merged without tangents."""
    import torch.autograd.forward_ad as fwAD

    traced = torch.jit.trace(lambda *a: cm.merge_state(*a), tuple(states()), check_trace=False)
    assert "cupy_merge::merge_state" in str(traced.graph)
    fresh = states()
    v, s = traced(*fresh)
    want_v, want_s = reference.merge_state(*map(host, fresh))
    assert relative_error(to_host(v), want_v) < TOLERANCE[torch.bfloat16]
    assert relative_error(to_host(s), want_s) < 1e-5
    v_a, s_a, v_b, s_b = states()
    with fwAD.dual_level():
        dual = fwAD.make_dual(s_a, torch.ones_like(s_a))
        with pytest.raises(TypeError, match="s_a: a dual tensor of forward-mode AD"):
            cm.merge_state(v_a, dual, v_b, s_b)
        with pytest.raises(Exception, match="s_a: a dual tensor of forward-mode AD"):
            torch.compile(lambda *a: cm.merge_state(*a))(v_a, dual, v_b, s_b)
