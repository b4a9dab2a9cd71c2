"""The torch integration without a GPU: schemas, fakes, Dynamo capture, export, opcheck, autograd wiring.

Fake CUDA tensors (``FakeTensorMode``) exercise the fakes and the tracing on a machine without a GPU;
a CPU stand-in kernel (the float64 reference) lets ``opcheck``, ``aot_eager``, Inductor and the
autograd Functions run here too. The real CUDA kernels are tested in test_gpu_torch_ops.py.
On torch's CPU wheel, fake CUDA views are made with ``narrow``/``transpose``/``flatten``: its
Python indexing, ``.contiguous()`` and ``copy_`` of fake CUDA tensors fail (no CUDA device guard).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode

import cupy_merge as cm
from cupy_merge import reference, torch_ops

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a fake that raises logs it
T, H, D = 16, 4, 64
FP8 = torch.float8_e4m3fn
OPS = torch_ops.ops()


# -- helpers --------------------------------------------------------------------------------------------


def fake_states(dtype=torch.bfloat16, tokens=T, device="cuda"):
    """Two states [T, H, D]; the first LSE a token-major buffer's transpose (no copy)."""
    v_a = torch.empty(tokens, H, D, device=device, dtype=dtype)
    v_b = torch.empty(tokens, H, D, device=device, dtype=dtype)
    return v_a, torch.empty(tokens, H, device=device).t(), v_b, torch.empty(H, tokens, device=device)


def fake_stack(states=3, dtype=torch.float32, tokens=T, device="cuda"):
    return (torch.empty(states, tokens, H, D, device=device, dtype=dtype),
            torch.empty(states, H, tokens, device=device))  # fmt: skip


def rows(total=7, dtype=torch.float32, device="cuda"):
    return torch.empty(total, H, D, device=device, dtype=dtype), torch.empty(H, total, device=device)


def captured(fn, *args, **options):
    """The call targets of the single graph Dynamo captures with fullgraph=True (any break raises)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    result = torch.compile(fn, backend=backend, fullgraph=True, **options)(*args)
    assert len(graphs) == 1
    return [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"], result


def merge_ops(targets):
    return [target for target in targets if target.startswith("cupy_merge.")]


# -- a CPU stand-in kernel for every op: the float64 reference -------------------------------------------


def _np(tensor):
    return None if tensor is None else tensor.detach().float().numpy()


def _tensor(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(array, dtype=np.float32))).to(dtype)


def _base(lse_base):
    return 2 if lse_base == "2" else "e"


def _quantised(v, dtype, scale=None, block=None, group=None, ue8m0=False, swizzled=True):
    """The values as the kernel writes them: ``dtype``, FP8 by a per-tensor or per-group scale, or
    NVFP4 (its bytes; ``uint8`` beside one-byte block scales too) with its global scale."""
    if dtype == torch.float4_e2m1fn_x2 or (dtype == torch.uint8 and block is not None and block.element_size() == 1):
        packed, scales = reference.quantize_nvfp4(v.reshape(len(v), -1), float(scale.reshape(-1)[0]), is_sf_swizzled_layout=swizzled)
        block.view(torch.uint8).copy_(torch.from_numpy(scales.view(np.uint8)))
        return torch.from_numpy(packed.reshape(*v.shape[:-1], -1)).view(dtype)
    if dtype != FP8:
        return _tensor(v, dtype)
    if block is not None:
        q, scales = reference.quantize_fp8_groups(v, group, ue8m0)
        block.copy_(_tensor(scales, torch.float32))
        return _tensor(q.astype(np.float32), FP8)
    return _tensor(reference.quantize_fp8(v, float(scale.reshape(-1)[0])).astype(np.float32), FP8)


def _write(out, values):
    """``out[...] = values``; NVFP4 bytes as bytes (torch does not copy between FP4 tensors)."""
    if out.dtype == torch.float4_e2m1fn_x2:
        out.view(torch.uint8).copy_(values.view(torch.uint8))
    else:
        out.copy_(values)


def _two(v_a, s_a, v_b, s_b, sinks, lse_base):
    return reference.merge_state(_np(v_a), _np(s_a), _np(v_b), _np(s_b), _base(lse_base), sinks=_np(sinks))


def _cpu_merge_state(v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None, lse_base="e"):
    v, s = _two(v_a, s_a, v_b, s_b, sinks, lse_base)
    return _quantised(v, out_dtype or v_a.dtype, output_scale), _tensor(s, torch.float32)


def _cpu_merge_state_out(out, out_lse, v_a, s_a, v_b, s_b, *, out_dtype=None, sinks=None, output_scale=None,
                         output_block_scale=None, quant_group_size=None, scale_ue8m0=False, is_sf_swizzled_layout=True,
                         lse_base="e"):  # fmt: skip
    v, s = _two(v_a, s_a, v_b, s_b, sinks, lse_base)
    _write(out, _quantised(v, out.dtype, output_scale, output_block_scale, quant_group_size, scale_ue8m0,
                           is_sf_swizzled_layout))  # fmt: skip
    out_lse.copy_(_tensor(s, torch.float32))


def _cpu_merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                           prefill_tokens_with_context=None, output_scale=None, output_block_scale=None,
                           quant_group_size=None, quant_scale_ue8m0=False, *, scale_ue8m0=False,
                           is_sf_swizzled_layout=True, sinks=None, lse_base="e"):  # fmt: skip
    v, s = _two(prefix_output, prefix_lse, suffix_output, suffix_lse, sinks, lse_base)
    cut = prefill_tokens_with_context
    if cut is not None:  # tokens past the cut take the suffix (with the sinks: merged with them alone)
        suffix_v, suffix_s = reference.merge_states(_np(suffix_output)[None, cut:], _np(suffix_lse)[None, :, cut:],
                                                    _base(lse_base), sinks=_np(sinks))  # fmt: skip
        v[cut:], s[:, cut:] = suffix_v, suffix_s
    _write(output, _quantised(v, output.dtype, output_scale, output_block_scale, quant_group_size,
                              scale_ue8m0 or quant_scale_ue8m0, is_sf_swizzled_layout))  # fmt: skip
    if output_lse is not None:
        output_lse.copy_(_tensor(s, torch.float32))


def _cpu_merge_state_in_place(v, s, v_other, s_other, mask=None, *, sinks=None, lse_base="e"):
    new_v, new_s = _two(v, s, v_other, s_other, sinks, lse_base)
    keep = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask
    v.copy_(torch.where(keep[:, None, None], _tensor(new_v, v.dtype), v))
    s.copy_(torch.where(keep[None, :], _tensor(new_s, torch.float32), s))


def _many(v, s, indptr, sinks, lse_base):
    if indptr is None:
        return reference.merge_states(_np(v), _np(s), _base(lse_base), sinks=_np(sinks))
    return reference.merge_states_varlen(_np(v), _np(s), indptr.numpy(), _base(lse_base), sinks=_np(sinks))


def _cpu_merge_states(v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None):
    merged, lse = _many(v, s, None, sinks, lse_base)
    return _quantised(merged, out_dtype or v.dtype, output_scale), _tensor(lse, torch.float32)


def _cpu_merge_states_out(out, out_lse, v, s, *, lse_base="e", out_dtype=None, sinks=None, output_scale=None,
                          output_block_scale=None, quant_group_size=None, scale_ue8m0=False,
                          is_sf_swizzled_layout=True):  # fmt: skip
    merged, lse = _many(v, s, None, sinks, lse_base)
    _write(out, _quantised(merged, out.dtype, output_scale, output_block_scale, quant_group_size, scale_ue8m0,
                           is_sf_swizzled_layout))  # fmt: skip
    out_lse.copy_(_tensor(lse, torch.float32))


def _cpu_merge_states_varlen(v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True, sinks=None,
                             output_scale=None):  # fmt: skip
    merged, lse = _many(v, s, indptr, sinks, lse_base)
    return _quantised(merged, out_dtype or v.dtype, output_scale), _tensor(lse, torch.float32)


def _cpu_merge_states_varlen_out(out, out_lse, v, s, indptr, *, lse_base="e", out_dtype=None, check_indptr=True,
                                 sinks=None, output_scale=None, output_block_scale=None, quant_group_size=None,
                                 scale_ue8m0=False, is_sf_swizzled_layout=True):  # fmt: skip
    merged, lse = _many(v, s, indptr, sinks, lse_base)
    _write(out, _quantised(merged, out.dtype, output_scale, output_block_scale, quant_group_size, scale_ue8m0,
                           is_sf_swizzled_layout))  # fmt: skip
    out_lse.copy_(_tensor(lse, torch.float32))


def _grads(arrays, likes, sinks):
    result = [_tensor(a, like.dtype) for a, like in zip(arrays, likes)]
    return (*result, None if sinks is None else _tensor(arrays[-1], torch.float32))


def _cpu_merge_state_backward(v_a, s_a, v_b, s_b, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                              lse_base="e"):  # fmt: skip
    g = reference.merge_state_backward(_np(v_a), _np(s_a), _np(v_b), _np(s_b), _np(grad_v), _np(grad_s),
                                       sinks=_np(sinks), lse_base=_base(lse_base))  # fmt: skip
    return _grads(g, (v_a, s_a, v_b, s_b), sinks)


def _cpu_merge_states_backward(v, s, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None, lse_base="e"):
    g = reference.merge_states_backward(_np(v), _np(s), _np(grad_v), _np(grad_s), sinks=_np(sinks),
                                        lse_base=_base(lse_base))  # fmt: skip
    return _grads(g, (v, s), sinks)


def _cpu_merge_states_varlen_backward(v, s, indptr, grad_v, grad_s=None, *, out=None, out_lse=None, sinks=None,
                                      lse_base="e"):  # fmt: skip
    g = reference.merge_states_varlen_backward(_np(v), _np(s), indptr.numpy(), _np(grad_v), _np(grad_s),
                                               sinks=_np(sinks), lse_base=_base(lse_base))  # fmt: skip
    return _grads(g, (v, s), sinks)


CPU_KERNELS = {name: globals()[f"_cpu_{name}"] for name in torch_ops.SCHEMAS}


@pytest.fixture(scope="module")
def _cpu_library():
    """The stand-in registered for CPU tensors, for this module's tests."""
    lib = torch.library.Library(torch_ops.NAMESPACE, "FRAGMENT")
    for name, kernel in CPU_KERNELS.items():
        lib.impl(name, kernel, "CPU")
    yield
    lib._destroy()


@pytest.fixture
def cpu_kernels(_cpu_library, monkeypatch):
    """The stand-in, and the fakes told to take CPU tensors (for this test only)."""
    monkeypatch.setattr(torch_ops, "_SPECS_ON_HOST", True)


def host_states(dtype=torch.float32, tokens=T, requires_grad=False):
    v_a, v_b = (torch.randn(tokens, H, D).to(dtype) for _ in range(2))
    s_a = (torch.randn(tokens, H) * 2).t()  # a transposed view
    s_b = torch.randn(H, tokens) * 2
    return [x.requires_grad_(requires_grad) for x in (v_a, s_a, v_b, s_b)]


# -- importing -------------------------------------------------------------------------------------------


def _python(code):
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)


def test_importing_cupy_merge_imports_no_torch():
    result = _python("import sys, cupy_merge; print('torch' in sys.modules, cupy_merge.torch_ops._compiling())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_cupy_merge_imported_before_torch_still_traces_to_the_ops():
    code = """
import logging
import cupy_merge as cm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
assert not cm.torch_ops._compiling()
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
def f(v_a, s_a, v_b, s_b):
    return cm.merge_state(v_a, s_a, v_b, s_b)  # the first merge of the process, met inside Dynamo
with FakeTensorMode():
    args = [torch.empty(8, 2, 16, device="cuda"), torch.empty(2, 8, device="cuda")] * 2
    v, s = torch.compile(f, backend=backend, fullgraph=True)(*args)
print(len(graphs), [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"][0], tuple(v.shape))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "cupy_merge.merge_state.default", "(8,", "2,", "16)"]


def test_eager_calls_pay_one_cheap_predicate():
    assert torch_ops._compiling() is False
    calls = 20_000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            torch_ops._compiling()
        best = min(best, (time.perf_counter() - start) / calls)
    assert best < 2e-6, f"{best * 1e6:.2f} us a call"  # about 0.1-0.2 us; generous for a loaded CI box


# -- schemas ---------------------------------------------------------------------------------------------

WRITTEN = {
    "merge_attn_states": {"output", "output_lse", "output_block_scale"},
    "merge_state_out": {"out", "out_lse", "output_block_scale"},
    "merge_state_in_place": {"v", "s"},
    "merge_states_out": {"out", "out_lse", "output_block_scale"},
    "merge_states_varlen_out": {"out", "out_lse", "output_block_scale"},
}
RETURNS = {"merge_state": 2, "merge_states": 2, "merge_states_varlen": 2, "merge_state_backward": 5,
           "merge_states_backward": 3, "merge_states_varlen_backward": 3}  # fmt: skip


@pytest.mark.parametrize("name", list(torch_ops.SCHEMAS))
def test_every_op_declares_what_it_writes(name):
    op = getattr(OPS, name).default
    schema = op._schema
    written = {arg.name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == WRITTEN.get(name, set())
    assert len(schema.returns) == RETURNS.get(name, 0)
    assert torch.Tag.pt2_compliant_tag in op.tags
    assert str(schema) == f"{torch_ops.NAMESPACE}::{torch_ops.SCHEMAS[name]}"


def test_the_two_way_op_takes_vllms_arguments_in_their_order():
    names = [arg.name for arg in OPS.merge_attn_states.default._schema.arguments]
    assert names[:8] == ["output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse",
                         "prefill_tokens_with_context", "output_scale"]  # fmt: skip
    # SymInt: a count that changes from call to call stays dynamic under torch.compile
    assert "SymInt? prefill_tokens_with_context=None" in str(OPS.merge_attn_states.default._schema)


# -- fakes: outputs from shapes ----------------------------------------------------------------------------


def _layout(tensor):
    return tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()), tensor.device.type


def test_functional_fakes_allocate_contiguous_outputs_of_the_right_dtype():
    with FakeTensorMode():
        scale = torch.empty(1, device="cuda")
        sinks = torch.empty(H, device="cuda")
        v, s = OPS.merge_state(*fake_states(), out_dtype=FP8, output_scale=scale, sinks=sinks)
        assert _layout(v) == ((T, H, D), FP8, (H * D, D, 1), "cuda")
        assert _layout(s) == ((H, T), torch.float32, (T, 1), "cuda")
        v, s = OPS.merge_states(*fake_stack(), out_dtype=torch.bfloat16)
        assert _layout(v) == ((T, H, D), torch.bfloat16, (H * D, D, 1), "cuda")
        v, s = OPS.merge_states_varlen(*rows(), torch.empty(4, device="cuda", dtype=torch.int32))
        assert _layout(v) == ((3, H, D), torch.float32, (H * D, D, 1), "cuda") and tuple(s.shape) == (H, 3)


def test_backward_fakes_give_gradients_like_the_inputs():
    with FakeTensorMode():
        v_a, s_a, v_b, s_b = fake_states()
        grad_v = torch.empty(T, H, D, device="cuda")
        grads = OPS.merge_state_backward(v_a, s_a, v_b, s_b, grad_v, sinks=torch.empty(H, device="cuda"))
        assert [tuple(g.shape) for g in grads] == [(T, H, D), (H, T), (T, H, D), (H, T), (H,)]
        assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32]
        assert grads[1].stride() == (T, 1)  # C-contiguous, whatever the input's strides
        v, s = fake_stack(5)
        grad_v, _, grad_sinks = OPS.merge_states_backward(v, s, grad_v, torch.empty(H, T, device="cuda"))
        assert _layout(grad_v)[:2] == ((5, T, H, D), torch.float32) and grad_sinks is None
        v, s = rows(9)
        indptr = torch.empty(T + 1, device="cuda", dtype=torch.int64)
        grads = OPS.merge_states_varlen_backward(v, s, indptr, torch.empty(T, H, D, device="cuda"))
        assert [tuple(g.shape) for g in grads[:2]] == [(9, H, D), (H, 9)] and grads[2] is None


def test_out_and_in_place_fakes_return_nothing():
    with FakeTensorMode():
        v_a, s_a, v_b, s_b = fake_states()
        out, out_lse = torch.empty_like(v_a), torch.empty(H, T, device="cuda")
        assert OPS.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, 3) is None
        assert OPS.merge_state_out(out, out_lse, v_a, s_a, v_b, s_b) is None
        assert OPS.merge_state_in_place(out, out_lse, v_b, s_b, torch.empty(T, dtype=torch.bool, device="cuda")) is None
        block = torch.empty(T, H * D // 32, device="cuda")
        out8 = torch.empty(T, H, D, device="cuda", dtype=FP8)
        assert OPS.merge_states_out(out8, out_lse, *fake_stack(), output_block_scale=block, quant_group_size=32) is None


# -- fakes: the eager messages ---------------------------------------------------------------------------


def _bad_calls():
    """(label, call over fake CUDA tensors, error, the eager message)."""
    cuda = {"device": "cuda"}

    def two(**changes):
        v_a, s_a, v_b, s_b = fake_states()
        args = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b, **changes}
        return args.pop("v_a"), args.pop("s_a"), args.pop("v_b"), args.pop("s_b"), args

    cases = [
        ("v_b shape", lambda: OPS.merge_state(*two(v_b=torch.empty(T, 2, D, dtype=torch.bfloat16, **cuda))[:4]),
         ValueError, r"^v_b: expected shape \(16, 4, 64\) \(the shape of v_a\), got \(16, 2, 64\)"),
        ("token-major s_a", lambda: OPS.merge_state(*two(s_a=torch.empty(T, H, **cuda))[:4]),
         ValueError, r"^s_a: expected shape \(num_heads, num_tokens\) = \(4, 16\) from v_a, got \(16, 4\); a token-major"),
        ("dtypes", lambda: OPS.merge_state(*two(v_b=torch.empty(T, H, D, **cuda))[:4]),
         TypeError, r"^v_b: expected dtype bfloat16 \(the dtype of v_a\), got float32"),
        ("FP8 values in", lambda: OPS.merge_state(*two(v_a=torch.empty(T, H, D, dtype=FP8, **cuda),
                                                       v_b=torch.empty(T, H, D, dtype=FP8, **cuda))[:4]),
         TypeError, r"^v_a: expected dtype float32, float16 or bfloat16, got float8_e4m3fn; FP8 is an output dtype only"),
        ("FP8 without a scale", lambda: OPS.merge_state(*fake_states(), out_dtype=FP8),
         TypeError, r"^out: an FP8 output needs its scale"),
        ("a scale without FP8", lambda: OPS.merge_state(*fake_states(), output_scale=torch.empty(1, **cuda)),
         TypeError, r"^output_scale: a scale is for an FP8 \(float8_e4m3fn\) output; out is bfloat16"),
        ("lse_base", lambda: OPS.merge_state(*fake_states(), lse_base="10"),
         ValueError, r'^lse_base: expected "e" \(natural log, as vLLM\) or 2'),
        ("output shape", lambda: OPS.merge_attn_states(torch.empty(T, H, 32, dtype=torch.bfloat16, **cuda),
                                                       *fake_states()),
         ValueError, r"^output: expected shape \(16, 4, 64\)"),
        ("output_lse dtype", lambda: OPS.merge_attn_states(torch.empty(T, H, D, dtype=torch.bfloat16, **cuda),
                                                           *fake_states(), torch.empty(H, T, dtype=torch.float16, **cuda)),
         TypeError, r"^output_lse: expected a float32 log-sum-exp, got dtype float16"),
        ("sinks shape", lambda: OPS.merge_attn_states(torch.empty(T, H, D, dtype=torch.bfloat16, **cuda),
                                                      *fake_states(), sinks=torch.empty(H + 1, **cuda)),
         ValueError, r"^sinks: expected shape \(4,\) \(num_heads of prefix_output\), got \(5,\)"),
        ("negative prefill", lambda: OPS.merge_attn_states(torch.empty(T, H, D, dtype=torch.bfloat16, **cuda),
                                                           *fake_states(), None, -1),
         ValueError, r"^prefill_tokens_with_context: expected >= 0, got -1"),
        ("a broadcast output", lambda: OPS.merge_state_out(torch.empty(1, H, D, dtype=torch.bfloat16, **cuda).expand(T, H, D),
                                                           torch.empty(H, T, **cuda), *fake_states()),
         ValueError, r"^out: expected an output whose elements do not share memory"),
        ("out_dtype against out", lambda: OPS.merge_state_out(torch.empty(T, H, D, dtype=torch.bfloat16, **cuda),
                                                              torch.empty(H, T, **cuda), *fake_states(),
                                                              out_dtype=torch.float16),
         TypeError, r"^out_dtype: expected the dtype of out \(bfloat16\) or None"),
        ("a group not dividing head_size", lambda: OPS.merge_state_out(
            torch.empty(T, H, D, dtype=FP8, **cuda), torch.empty(H, T, **cuda), *fake_states(),
            output_block_scale=torch.empty(T, 10, **cuda), quant_group_size=24),
         ValueError, r"^quant_group_size: expected a divisor of head_size 64, got 24"),
        ("group size without scales", lambda: OPS.merge_state_out(
            torch.empty(T, H, D, dtype=torch.bfloat16, **cuda), torch.empty(H, T, **cuda), *fake_states(),
            quant_group_size=32),
         ValueError, r"^quant_group_size: given without output_block_scale"),
        ("a mask of ints", lambda: OPS.merge_state_in_place(*fake_states(), torch.empty(T, dtype=torch.int32, **cuda)),
         TypeError, r"^mask: expected a bool array \(True = merge this token\), got dtype int32"),
        ("N-way LSE", lambda: OPS.merge_states(torch.empty(3, T, H, D, **cuda), torch.empty(3, T, H, **cuda)),
         ValueError, r"^s: expected shape \(num_states, num_heads, num_tokens\) = \(3, 4, 16\) from v"),
        ("N-way rank", lambda: OPS.merge_states(torch.empty(T, H, D, **cuda), torch.empty(H, T, **cuda)),
         ValueError, r"^v: expected a 4-D array \[num_states, num_tokens, num_heads, head_size\]"),
        ("float offsets", lambda: OPS.merge_states_varlen(*rows(), torch.empty(4, **cuda)),
         TypeError, r"^indptr: expected an int32 or int64 array, got dtype float32"),
        ("ragged LSE", lambda: OPS.merge_states_varlen(torch.empty(7, H, D, **cuda), torch.empty(H, 6, **cuda),
                                                       torch.empty(4, dtype=torch.int32, **cuda)),
         ValueError, r"^s: expected shape \(num_heads, total_states\) = \(4, 7\) from v, got \(4, 6\)"),
        ("gradient shape", lambda: OPS.merge_states_backward(*fake_stack(), torch.empty(T, H, 32, **cuda)),
         ValueError, r"^grad_v: expected shape \(16, 4, 64\)"),
        ("gradient LSE dtype", lambda: OPS.merge_state_backward(*fake_states(), torch.empty(T, H, D, **cuda),
                                                                torch.empty(H, T, dtype=torch.bfloat16, **cuda)),
         TypeError, r"^grad_s: expected a float32 log-sum-exp, got dtype bfloat16"),
        ("CPU tensors", lambda: OPS.merge_state(*fake_states(device="cpu")),
         TypeError, r"^v_a: expected a torch tensor on a CUDA device, got one on cpu; move it with .cuda\(\)"),
    ]  # fmt: skip
    return cases


BAD_CALLS = {case[0]: case[1:] for case in _bad_calls()}


@pytest.mark.parametrize("label", list(BAD_CALLS))
def test_fakes_raise_the_eager_messages(label):
    call, error, message = BAD_CALLS[label]
    with FakeTensorMode(), pytest.raises(error, match=message):
        call()


def test_under_compile_the_message_reaches_the_user():
    def f(v_a, s_a, v_b, s_b):
        return cm.merge_state(v_a, s_a.t(), v_b, s_b)

    with FakeTensorMode(), pytest.raises(Exception, match=r"s_a: expected shape \(num_heads, num_tokens\)"):
        captured(f, *fake_states())


# -- Dynamo: every public merge is one op in one graph -------------------------------------------------


def _public_calls():
    """(label, function over fake CUDA tensors, the ops its graph must hold)."""

    def two_way(out, out_lse, v_a, s_a, v_b, s_b):
        v, s = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=torch.float16)
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, 5, lse_base=2)
        cm.merge_state_in_place(out, out_lse, v_b, s_b)
        v2, s2 = cm.merge_state(v_a, s_a, v_b, s_b, out=out)  # out= given: out_lse allocated in the graph
        return v, s, v2, s2

    def fp8(out, out_lse, v_a, s_a, v_b, s_b):
        scale = torch.ones(1, device=v_a.device)
        v8, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype=FP8, output_scale=scale)
        out8 = torch.empty(v_a.shape, dtype=FP8, device=v_a.device)
        block = torch.empty(v_a.shape[0], H * D // 64, device=v_a.device)
        cm.merge_attn_states(out8, v_a, s_a, v_b, s_b, None, None, None, block, 64, scale_ue8m0=True)
        return v8, out8, block

    def sinks(out, out_lse, v_a, s_a, v_b, s_b):
        z = torch.zeros(H, device=v_a.device)
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse, sinks=z)
        mask = torch.ones(v_a.shape[0], dtype=torch.bool, device=v_a.device)
        cm.merge_state_in_place(out, out_lse, v_b, s_b, mask, sinks=z)
        return cm.merge_state(v_a, s_a, v_b, s_b, sinks=z)

    def many(out, out_lse, v_a, s_a, v_b, s_b):
        v = torch.stack([v_a, v_b])  # [2, T, H, D]
        s = torch.stack([s_a, s_b])
        merged = cm.merge_states(v, s, out_dtype="float32", sinks=torch.zeros(H, device=v.device))
        indptr = torch.arange(0, 2 * v_a.shape[0] + 1, 2, device=v.device, dtype=torch.int32)
        ragged = cm.merge_states_varlen(v.transpose(0, 1).flatten(0, 1), s.permute(1, 2, 0).flatten(1, 2), indptr)
        cm.merge_states(v, s, out=out, out_lse=out_lse)
        return merged, ragged

    def backward(out, out_lse, v_a, s_a, v_b, s_b):
        grad_v = torch.ones(v_a.shape, device=v_a.device)
        grads = cm.merge_state_backward(v_a, s_a, v_b, s_b, grad_v, out_lse)
        v, s = torch.stack([v_a, v_b]), torch.stack([s_a, s_b])
        dense = cm.merge_states_backward(v, s, grad_v, lse_base=2)
        indptr = torch.arange(0, 2 * v_a.shape[0] + 1, 2, device=v.device)
        ragged = cm.merge_states_varlen_backward(v.transpose(0, 1).flatten(0, 1), s.permute(1, 2, 0).flatten(1, 2),
                                                 indptr, grad_v, sinks=torch.zeros(H, device=v.device))  # fmt: skip
        return grads, dense, ragged

    return {
        "two-way": (two_way, ["merge_state", "merge_attn_states", "merge_state_in_place", "merge_state_out"]),
        "FP8": (fp8, ["merge_state", "merge_attn_states"]),
        "sinks": (sinks, ["merge_attn_states", "merge_state_in_place", "merge_state"]),
        "N-way": (many, ["merge_states", "merge_states_varlen", "merge_states_out"]),
        "backward": (backward, ["merge_state_backward", "merge_states_backward", "merge_states_varlen_backward"]),
    }


PUBLIC_CALLS = _public_calls()


@pytest.mark.parametrize("label", list(PUBLIC_CALLS))
def test_every_public_merge_is_captured_as_its_op_in_one_graph(label):
    fn, expected = PUBLIC_CALLS[label]
    with FakeTensorMode():
        out, out_lse = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16), torch.empty(H, T, device="cuda")
        targets, _ = captured(fn, out, out_lse, *fake_states())
    assert merge_ops(targets) == [f"cupy_merge.{name}.default" for name in expected]


def test_the_traced_call_passes_its_options_to_the_op():
    def f(out, v_a, s_a, v_b, s_b, indptr):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, 7, lse_base=2)
        return cm.merge_states_varlen(v_a, s_a, indptr, out_dtype=torch.float16)  # check_indptr=True by default

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode():
        args = (torch.empty(T, H, D, device="cuda"), *fake_states(torch.float32), torch.empty(5, device="cuda",
                                                                                                dtype=torch.int32))  # fmt: skip
        v, _ = torch.compile(f, backend=backend, fullgraph=True)(*args)
    assert tuple(v.shape) == (4, H, D) and v.dtype == torch.float16
    nodes = {str(n.target): n for n in graphs[0].graph.nodes if n.op == "call_function"}
    two = nodes["cupy_merge.merge_attn_states.default"]
    assert two.args[6] == 7 and two.kwargs["lse_base"] == "2"
    ragged = nodes["cupy_merge.merge_states_varlen.default"]
    assert ragged.kwargs["check_indptr"] is True and ragged.kwargs["out_dtype"] == torch.float16


def test_dynamic_token_counts_compile_once():
    import torch._dynamo.utils as dynamo_utils

    def f(v_a, s_a, v_b, s_b):
        return cm.merge_state(v_a, s_a, v_b, s_b)

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(f, backend="eager", fullgraph=True, dynamic=True)
    with FakeTensorMode():
        for tokens in (5, 9, 33, 100):
            v, s = compiled(*fake_states(tokens=tokens))
            assert tuple(v.shape) == (tokens, H, D) and tuple(s.shape) == (H, tokens)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1


def test_make_fx_records_the_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(v, s):
        return cm.merge_states(v, s)

    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(f, tracing_mode="fake")(*fake_stack())
    assert "cupy_merge.merge_states.default" in [str(n.target) for n in graph.graph.nodes]


@pytest.mark.parametrize("tracer", ["export strict", "export non-strict", "make_fx symbolic"])
def test_a_traced_prefill_count_stays_symbolic(tracer, monkeypatch):
    """``prefill_tokens_with_context`` computed from a dynamic size is a SymInt wherever torch
    traces (Dynamo gives the option an int-like variable; non-strict export and make_fx a
    torch.SymInt): recorded in the graph as a size expression, not a constant."""
    from torch.export import Dim
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(out, v_a, s_a, v_b, s_b):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, None, v_a.shape[0] // 2)
        return out

    class Module(torch.nn.Module):
        def forward(self, out, v_a, s_a, v_b, s_b):
            return f(out, v_a, s_a, v_b, s_b)

    if tracer == "make_fx symbolic":  # its own fake mode, over host tensors (the fakes take them here)
        monkeypatch.setattr(torch_ops, "_SPECS_ON_HOST", True)
        args = (torch.empty(T, H, D, dtype=torch.bfloat16), *fake_states(device="cpu"))
        graph = make_fx(f, tracing_mode="symbolic")(*args).graph
    else:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = (torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16), *fake_states())
            tokens = Dim("tokens", min=2, max=4096)
            shapes = ({0: tokens}, {0: tokens}, {1: tokens}, {0: tokens}, {1: tokens})
            graph = torch.export.export(Module(), args, dynamic_shapes=shapes, strict=tracer == "export strict").graph
    (merge,) = [n for n in graph.nodes if str(n.target) == "cupy_merge.merge_attn_states.default"]
    count = merge.args[6]
    assert isinstance(count, torch.fx.Node), f"the count was traced as the constant {count!r}"


@pytest.mark.parametrize("strict", [True, False])
def test_export_of_a_module_that_merges_keeps_the_ops(strict):
    class Tail(torch.nn.Module):
        def forward(self, v_a, s_a, v_b, s_b):
            v, s = cm.merge_state(v_a, s_a, v_b, s_b)
            out = torch.empty_like(v)
            cm.merge_attn_states(out, v, s, v_b, s_b)
            return out * 2, cm.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]))[0]

    with FakeTensorMode(allow_non_fake_inputs=True):
        program = torch.export.export(Tail(), fake_states(), strict=strict)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert merge_ops(targets) == ["cupy_merge.merge_state.default", "cupy_merge.merge_attn_states.default",
                                  "cupy_merge.merge_states.default"]  # fmt: skip


def test_check_indptr_adds_no_host_read_to_the_graph():
    def f(v, s, indptr):
        return cm.merge_states_varlen(v, s, indptr, check_indptr=True)

    with FakeTensorMode():
        targets, _ = captured(f, *rows(), torch.empty(4, device="cuda", dtype=torch.int32))
    assert targets == ["cupy_merge.merge_states_varlen.default", "<built-in function getitem>",
                       "<built-in function getitem>"]  # fmt: skip


def test_a_stream_is_refused_under_compile():
    def f(v_a, s_a, v_b, s_b):
        return cm.merge_state(v_a, s_a, v_b, s_b, stream=7)

    with FakeTensorMode(), pytest.raises(Exception, match="stream: a merge that torch traces .* runs on torch's current stream"):
        captured(f, *fake_states())


# -- autograd refusals at trace time ----------------------------------------------------------------------


def _grad_states(**kwargs):
    return [x.requires_grad_() for x in fake_states(**kwargs)]


@pytest.mark.parametrize(
    "merge",
    [
        lambda out, v_a, s_a, v_b, s_b: cm.merge_attn_states(out, v_a, s_a, v_b, s_b),
        lambda out, v_a, s_a, v_b, s_b: cm.merge_state_in_place(out, torch.empty(H, T, device="cuda"), v_b, s_b),
    ],
    ids=["merge_attn_states", "merge_state_in_place"],
)
def test_in_place_forms_refuse_inputs_that_require_grad_under_compile(merge):
    with FakeTensorMode():
        out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(Exception, match="writes into its arguments, so autograd cannot differentiate it"):
            captured(merge, out, *_grad_states())


def test_in_place_forms_run_under_no_grad_under_compile():
    def f(out, v_a, s_a, v_b, s_b, sinks):
        with torch.no_grad():
            cm.merge_attn_states(out, v_a, s_a, v_b, s_b, sinks=sinks)
            cm.merge_state_in_place(out, torch.empty(H, T, device="cuda"), v_b, s_b, sinks=sinks)
        return out

    with FakeTensorMode():
        out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
        sinks = torch.nn.Parameter(torch.empty(H, device="cuda"))
        captured(f, out, *_grad_states(), sinks)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"out_dtype": FP8, "output_scale": True}, "an FP8 .float8_e4m3fn. output is not differentiable"),
        ({"out": True}, r"a merge into given tensors \(out=\) is not differentiable"),
    ],
    ids=["FP8", "out="],
)
def test_undifferentiable_forms_say_so_under_compile(kwargs, message):
    def f(v_a, s_a, v_b, s_b):
        given = dict(kwargs)
        if given.pop("output_scale", None):
            given["output_scale"] = torch.ones(1, device=v_a.device)
        if given.pop("out", None):
            given["out"] = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
        return cm.merge_state(v_a, s_a, v_b, s_b, **given)

    with FakeTensorMode(), pytest.raises(Exception, match=message):
        captured(f, *_grad_states())


def test_the_op_itself_in_differentiated_compiled_code_is_refused():
    def f(v_a, s_a, v_b, s_b):
        return OPS.merge_state(v_a, s_a, v_b, s_b)

    with FakeTensorMode(), pytest.raises(Exception, match=r"no autograd formula inside compiled code; call "
                                                          r"cupy_merge.merge_state\(\.\.\.\) instead"):  # fmt: skip
        captured(f, *_grad_states())


def test_under_no_grad_a_merge_of_inputs_that_require_grad_is_the_plain_op():
    def f(v_a, s_a, v_b, s_b):
        with torch.no_grad():
            return cm.merge_state(v_a, s_a, v_b, s_b)

    with FakeTensorMode():
        targets, _ = captured(f, *_grad_states())
    assert merge_ops(targets) == ["cupy_merge.merge_state.default"]


# -- with the CPU stand-in kernel: opcheck, functionalization, autograd ----------------------------------


def _opcheck_cases():
    r = torch.randn

    def two(dtype=torch.float32):
        return host_states(dtype)

    def stack(states=3):
        return [r(states, T, H, D), r(states, H, T)]

    ragged = [r(9, H, D), r(H, 9), torch.tensor([0, 2, 2, 9, 9], dtype=torch.int32)]
    block = r(T, H * D // 32)
    cases = {
        "merge_attn_states": ("merge_attn_states", [r(T, H, D), *two(), r(H, T)], {}),
        "merge_attn_states no LSE, cut": ("merge_attn_states", [r(T, H, D), *two(), None, 5], {"lse_base": "2"}),
        "merge_attn_states sinks": ("merge_attn_states", [r(T, H, D), *two()], {"sinks": r(H)}),
        "merge_attn_states FP8 groups": ("merge_attn_states", [torch.empty(T, H, D, dtype=FP8), *two(), None, None,
                                                               None, block, 32], {"scale_ue8m0": True}),
        "merge_state": ("merge_state", two(torch.bfloat16), {"out_dtype": torch.float32}),
        "merge_state FP8": ("merge_state", two(), {"out_dtype": FP8, "output_scale": torch.tensor([0.5])}),
        "merge_state sinks": ("merge_state", two(), {"sinks": r(H)}),
        "merge_state_out": ("merge_state_out", [r(T, H, D), r(H, T), *two()], {}),
        "merge_state_in_place": ("merge_state_in_place", [r(T, H, D), r(H, T), r(T, H, D), r(H, T),
                                                          torch.rand(T) > 0.5], {}),
        "merge_states": ("merge_states", stack(), {"out_dtype": torch.bfloat16}),
        "merge_states sinks": ("merge_states", stack(), {"sinks": r(H), "lse_base": "2"}),
        "merge_states_out": ("merge_states_out", [r(T, H, D), r(H, T), *stack()], {}),
        "merge_states_out FP8 groups": ("merge_states_out", [torch.empty(T, H, D, dtype=FP8), r(H, T), *stack()],
                                        {"output_block_scale": block, "quant_group_size": 32}),
        "merge_states_varlen": ("merge_states_varlen", ragged, {"check_indptr": False}),
        "merge_states_varlen_out": ("merge_states_varlen_out", [r(4, H, D), r(H, 4), *ragged], {"sinks": r(H)}),
        "merge_state_backward": ("merge_state_backward", [*two(), r(T, H, D), r(H, T)], {"sinks": r(H)}),
        "merge_states_backward": ("merge_states_backward", [*stack(), r(T, H, D)], {}),
        "merge_states_varlen_backward": ("merge_states_varlen_backward", [*ragged, r(4, H, D), r(H, 4)], {}),
    }
    return cases


OPCHECK_CASES = _opcheck_cases()
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# The schema check compares a written FP8 tensor before and after with arithmetic torch lacks for FP8.
FP8_WRITTEN_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck_with_the_cpu_stand_in(cpu_kernels, case):
    name, args, kwargs = OPCHECK_CASES[case]
    fp8_written = any(isinstance(x, torch.Tensor) and x.dtype == FP8 for x in args)
    torch.library.opcheck(getattr(OPS, name).default, args, kwargs,
                          test_utils=FP8_WRITTEN_CHECKS if fp8_written else ALL_CHECKS)  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_in_place_and_out_semantics_survive_functionalization(cpu_kernels, backend):
    def f(v, s, v_other, s_other, out, out_lse):
        cm.merge_state_in_place(v, s, v_other, s_other)
        cm.merge_attn_states(out, v, s, v_other, s_other, out_lse)
        return (v * 2).sum()

    args = [torch.randn(T, H, D), torch.randn(H, T), torch.randn(T, H, D), torch.randn(H, T),
            torch.empty(T, H, D), torch.empty(H, T)]  # fmt: skip
    expected = [x.clone() for x in args]
    OPS.merge_state_in_place(*expected[:4])
    OPS.merge_attn_states(expected[4], *expected[:4], expected[5])
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*args)
    torch.testing.assert_close(args, expected)


def _loss_gradients(outputs, inputs, seed):
    """Gradients of <v, G> + <s, g> for random G, g (so the incoming gradients are known)."""
    generator = torch.Generator().manual_seed(seed)
    v, s = outputs
    grad_v = torch.randn(v.shape, generator=generator)
    grad_s = torch.randn(s.shape, generator=generator)
    ((v.float() * grad_v).sum() + (s * grad_s).sum()).backward()
    return grad_v, grad_s, [None if x is None else x.grad for x in inputs]


def _close(got, want, what):
    assert got is not None, what
    got = got.double().numpy()
    error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
    assert error < 1e-5, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("lse_base", ["e", 2])
def test_gradients_under_compile_follow_the_reference(cpu_kernels, backend, with_sinks, lse_base):
    sinks = torch.randn(H).requires_grad_() if with_sinks else None
    two = host_states(requires_grad=True)
    stack = [torch.randn(3, T, H, D).requires_grad_(), torch.randn(3, H, T).requires_grad_()]
    total = 9
    indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int64)
    ragged = [torch.randn(total, H, D).requires_grad_(), torch.randn(H, total).requires_grad_()]

    def two_way(v_a, s_a, v_b, s_b, z):
        return cm.merge_state(v_a, s_a, v_b, s_b, sinks=z, lse_base=lse_base)

    def dense(v, s, z):
        return cm.merge_states(v, s, sinks=z, lse_base=lse_base)

    def varlen(v, s, z):
        return cm.merge_states_varlen(v, s, indptr, sinks=z, lse_base=lse_base)

    np_z = None if sinks is None else sinks.detach().numpy()
    for fn, inputs, want in [
        (two_way, [*two, sinks], lambda gv, gs: reference.merge_state_backward(
            *(_np(x) for x in two), gv.numpy(), gs.numpy(), sinks=np_z, lse_base=lse_base)),
        (dense, [*stack, sinks], lambda gv, gs: reference.merge_states_backward(
            *(_np(x) for x in stack), gv.numpy(), gs.numpy(), sinks=np_z, lse_base=lse_base)),
        (varlen, [*ragged, sinks], lambda gv, gs: reference.merge_states_varlen_backward(
            *(_np(x) for x in ragged), indptr.numpy(), gv.numpy(), gs.numpy(), sinks=np_z, lse_base=lse_base)),
    ]:  # fmt: skip
        for x in inputs:
            if x is not None:
                x.grad = None
        torch._dynamo.reset()
        outputs = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
        grad_v, grad_s, got = _loss_gradients(outputs, inputs, seed=len(inputs))
        expected = want(grad_v, grad_s)
        arrays = [x for x in inputs if x is not None]
        for index, (tensor, grad) in enumerate(zip(arrays, got)):
            _close(grad, expected[index] if tensor is not sinks else expected[-1], f"{fn.__name__} input {index}")


def test_a_compiled_training_graph_holds_the_forward_and_backward_ops(cpu_kernels):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, example_inputs):
        def record(graph, inputs):
            graphs.append(graph)
            return make_boxed_func(graph.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def f(v, s):
        merged, lse = cm.merge_states(v, s)
        return merged.sum() + lse.sum()

    torch._dynamo.reset()
    v, s = torch.randn(3, T, H, D).requires_grad_(), torch.randn(3, H, T).requires_grad_()
    torch.compile(f, backend=backend, fullgraph=True)(v, s).backward()
    forward, backward = ([str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in graphs)
    assert "cupy_merge.merge_states.default" in forward
    assert "cupy_merge.merge_states_backward.default" in backward
    (gradient,) = (n for n in graphs[1].graph.nodes if str(n.target) == "cupy_merge.merge_states_backward.default")
    assert {"out", "out_lse"} <= set(gradient.kwargs)  # the forward's results, saved for it
    torch.testing.assert_close(v.grad.sum(0), torch.ones(T, H, D))  # a token's weights sum to 1


def test_autograd_falls_through_to_the_kernels():
    # The kernels are the public merges, which handle autograd themselves: no "autograd kernel was
    # not registered" fallback (deprecated, and a cost) between them and the caller.
    for name in torch_ops.SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cupy_merge::{name}", "Autograd"), name


# -- eager autograd, with the launch replaced by the stand-in (the eager path refuses CPU tensors) ------


@pytest.fixture
def eager_stand_in(monkeypatch):
    """``_dispatch.prepare``/``run`` as the stand-in: the dispatcher's hooks run as they do on a GPU."""
    from cupy_merge import _arrays, _dispatch

    def prepare(operation, options, operands, tuning):
        tensors = [field for field in operands._fields if isinstance(getattr(operands, field), torch.Tensor)]
        grad, written = _dispatch.autograd_facts(operands, tensors)
        return _dispatch.Call((options,), _arrays.TORCH, -1, (), None, grad, written)  # the options ride along

    def run(operation, prepared, o, stream):
        ran.append(operation.name)
        if not operation.returns:
            return None  # a form that writes into its arguments: only whether it ran is checked
        lse_base = "2" if prepared.launches[0].lse_base_2 else "e"
        kernel = CPU_KERNELS[operation.name]
        if operation.name == "merge_state":
            return kernel(o.v_a, o.s_a, o.v_b, o.s_b, sinks=o.sinks, lse_base=lse_base)
        if operation.name == "merge_state_backward":
            return kernel(o.v, o.s, o.v_b, o.s_b, o.grad_out, o.grad_lse, sinks=o.sinks, lse_base=lse_base)
        if operation.name.endswith("_backward"):
            rows = () if o.indptr is None else (o.indptr,)
            return kernel(o.v, o.s, *rows, o.grad_out, o.grad_lse, sinks=o.sinks, lse_base=lse_base)
        rows = () if o.indptr is None else (o.indptr,)
        return kernel(o.v, o.s, *rows, sinks=o.sinks, lse_base=lse_base)

    ran: list[str] = []
    monkeypatch.setattr(_dispatch, "_calls", {})
    monkeypatch.setattr(_dispatch, "prepare", prepare)
    monkeypatch.setattr(_dispatch, "run", run)
    return ran


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("lse_base", ["e", 2])
def test_eager_gradients_run_through_the_autograd_hook(eager_stand_in, with_sinks, lse_base):
    sinks = [torch.randn(H).requires_grad_() if with_sinks else None for _ in range(3)]
    two = host_states(requires_grad=True)
    v, s = cm.merge_state(*two, sinks=sinks[0], lse_base=lse_base)
    grad_v, grad_s = torch.randn(v.shape), torch.randn(s.shape)
    torch.autograd.backward([v, s], [grad_v, grad_s])
    want = reference.merge_state_backward(*(_np(x) for x in two), grad_v.numpy(), grad_s.numpy(),
                                          sinks=_np(sinks[0]), lse_base=lse_base)  # fmt: skip
    for index, tensor in enumerate(two):
        _close(tensor.grad, want[index], f"two-way input {index}")
    stack = [torch.randn(3, T, H, D).requires_grad_(), torch.randn(3, H, T).requires_grad_()]
    merged, lse = cm.merge_states(*stack, sinks=sinks[1], lse_base=lse_base)
    (merged.sum() + lse.sum()).backward()  # broadcast (stride 0) incoming gradients
    want = reference.merge_states_backward(*(_np(x) for x in stack), np.ones((T, H, D)), np.ones((H, T)),
                                           sinks=_np(sinks[1]), lse_base=lse_base)  # fmt: skip
    _close(stack[0].grad, want[0], "dense v")
    _close(stack[1].grad, want[1], "dense s")
    if with_sinks:
        _close(sinks[1].grad, want[2], "dense sinks")
    indptr = torch.tensor([0, 3, 3, 9])
    ragged = [torch.randn(10, H, D).requires_grad_(), torch.randn(H, 10).requires_grad_()]
    merged, lse = cm.merge_states_varlen(*ragged, indptr, sinks=sinks[2], lse_base=lse_base)
    (2 * merged.sum() + lse.sum()).backward()
    want = reference.merge_states_varlen_backward(*(_np(x) for x in ragged), indptr.numpy(), 2 * np.ones((3, H, D)),
                                                  np.ones((H, 3)), sinks=_np(sinks[2]), lse_base=lse_base)  # fmt: skip
    _close(ragged[0].grad, want[0], "ragged v")
    _close(ragged[1].grad, want[1], "ragged s")
    if with_sinks:
        _close(sinks[0].grad, reference.merge_state_backward(*(_np(x) for x in two), grad_v.numpy(), grad_s.numpy(),
                                                             sinks=_np(sinks[0]), lse_base=lse_base)[4], "two sinks")
        _close(sinks[2].grad, want[2], "ragged sinks")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a: cm.merge_attn_states(torch.empty(T, H, D), *a), "^merge_attn_states: writes into its arguments"),
        (lambda a: cm.merge_state(*a, out=torch.empty(T, H, D)),
         r"^merge_state: an input requires grad, and a merge into given tensors \(out=\) is not differentiable"),
        (lambda a: cm.merge_state(*a, out_dtype=FP8, output_scale=torch.ones(1)),
         r"^merge_state: an input requires grad, and an FP8 \(float8_e4m3fn\) output is not differentiable"),
    ],
    ids=["in place", "out=", "FP8"],
)
def test_eager_undifferentiable_forms_refuse(eager_stand_in, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(host_states(requires_grad=True))


def test_eager_parameters_get_their_gradients(eager_stand_in):
    """nn.Parameter (a tensor subclass, which the fast path does not fingerprint) takes the same
    autograd hook: learned sinks and values get gradients."""
    v_a, s_a, v_b, s_b = host_states()
    v_a, sinks = torch.nn.Parameter(v_a), torch.nn.Parameter(torch.randn(H))
    v, s = cm.merge_state(v_a, s_a, v_b, s_b, sinks=sinks)
    grad_v, grad_s = torch.randn(v.shape), torch.randn(s.shape)
    torch.autograd.backward([v, s], [grad_v, grad_s])
    want = reference.merge_state_backward(*(_np(x) for x in (v_a, s_a, v_b, s_b)), grad_v.numpy(), grad_s.numpy(),
                                          sinks=_np(sinks))  # fmt: skip
    _close(v_a.grad, want[0], "v_a")
    _close(sinks.grad, want[4], "sinks")
    stack_sinks = torch.nn.Parameter(torch.randn(H))
    merged, lse = cm.merge_states(torch.randn(3, T, H, D), torch.randn(3, H, T), sinks=stack_sinks)
    assert merged.grad_fn is not None and lse.grad_fn is not None


def test_eager_in_place_forms_run_under_no_grad(eager_stand_in):
    """Inputs that require grad (here a sinks Parameter, an inference loop's) are refused by the
    forms that write into their arguments only in grad mode."""
    v_a, s_a, v_b, s_b = host_states()
    sinks = torch.nn.Parameter(torch.randn(H))
    with torch.no_grad():
        cm.merge_attn_states(torch.empty(T, H, D), v_a, s_a, v_b, s_b, sinks=sinks)
        cm.merge_state_in_place(v_a, s_a, v_b, s_b, sinks=sinks)
    assert eager_stand_in == ["merge_attn_states", "merge_state_in_place"]
    with pytest.raises(RuntimeError, match="^merge_state_in_place: writes into its arguments"):
        cm.merge_state_in_place(v_a, s_a, v_b, s_b, sinks=sinks)


def test_eager_second_derivatives_are_refused(eager_stand_in):
    v_a, s_a, v_b, s_b = host_states(requires_grad=True)
    v, _ = cm.merge_state(v_a, s_a, v_b, s_b)
    with pytest.raises(RuntimeError, match="^merge_state_backward: an input requires grad in grad mode"):
        torch.autograd.grad(v.sum(), v_a, create_graph=True)
    with torch.no_grad():
        v, _ = cm.merge_state(v_a, s_a, v_b, s_b)
    assert not v.requires_grad


# -- writes into given tensors: autograd's version counters, outputs that require grad (issue 47) --------


def _writes(target_shape):
    """Each way a merge writes into a caller's tensor ``target`` (of ``target_shape``'s kind)."""
    two = host_states()
    stack = [torch.randn(3, T, H, D), torch.randn(3, H, T)]
    ragged = [torch.randn(10, H, D), torch.randn(H, 10), torch.tensor([0, 3] + [4] * (T - 2) + [10])]
    values = {
        "merge_attn_states output": lambda t: cm.merge_attn_states(t, *two),
        "merge_attn_states output_lse": lambda t: cm.merge_attn_states(torch.empty(T, H, D), *two, t),
        "merge_state_in_place v": lambda t: cm.merge_state_in_place(t, two[1], two[2], two[3]),
        "merge_state_in_place s": lambda t: cm.merge_state_in_place(two[0], t, two[2], two[3]),
        "merge_state out": lambda t: cm.merge_state(*two, out=t),
        "merge_state out_lse": lambda t: cm.merge_state(*two, out_lse=t),
        "merge_states out": lambda t: cm.merge_states(*stack, out=t),
        "merge_states_varlen out_lse": lambda t: cm.merge_states_varlen(*ragged, out_lse=t, check_indptr=False),
    }
    return values


WRITE_CASES = list(_writes(None))


def _target(case):
    return torch.randn(H, T) if case.endswith(("lse", " s")) else torch.randn(T, H, D)


@pytest.mark.parametrize("case", WRITE_CASES)
def test_eager_writes_into_a_tensor_saved_for_backward_make_backward_raise(eager_stand_in, case):
    """A merge's write counts as an in-place modification: a backward that saved the tensor before
    the merge overwrote it raises, as after torch's own in-place ops, instead of using new values."""
    target = _target(case)
    weight = torch.randn(target.shape, requires_grad=True)
    loss = (weight * target).sum()  # saves target for weight's gradient
    version = target._version
    _writes(target.shape)[case](target)
    assert target._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("case", WRITE_CASES)
def test_eager_outputs_that_require_grad_are_refused_in_grad_mode_and_written_under_no_grad(eager_stand_in, case):
    target = _target(case).requires_grad_()
    name = case.split()[-1]
    with pytest.raises(RuntimeError, match=rf"^{name}: requires grad, and {case.split()[0]} writes into it"):
        _writes(target.shape)[case](target)
    assert eager_stand_in == []
    with torch.no_grad():
        _writes(target.shape)[case](target)
    assert eager_stand_in == [case.split()[0]]


def test_outputs_that_require_grad_are_refused_under_compile_and_in_the_fakes():
    with FakeTensorMode():
        out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        states = fake_states()
        with pytest.raises(Exception, match=r"output: requires grad, and merge_attn_states writes into it"):
            captured(lambda o, *a: cm.merge_attn_states(o, *a), out, *states)
        with pytest.raises(Exception, match=r"out: requires grad, and merge_state writes into it"):
            captured(lambda o, *a: cm.merge_state(*a, out=o), out, *states)
        with pytest.raises(RuntimeError, match=r"^out: requires grad, and merge_state writes into it"):
            OPS.merge_state_out(out, torch.empty(H, T, device="cuda"), *states)
        with torch.no_grad():
            OPS.merge_state_out(out, torch.empty(H, T, device="cuda"), *states)


def test_a_bound_merge_counts_each_launch_as_a_write_and_refuses_outputs_that_require_grad(monkeypatch):
    from cupy_merge import _arrays, _dispatch, _launch

    class HostTorch(_arrays.TorchAdapter):
        def current_stream(self, device):
            return 0

    def prepare(operation, options, operands, tuning):
        tensors = [field for field in operands._fields if isinstance(getattr(operands, field), torch.Tensor)]
        fresh = () if operation.name != "merge_state" else tuple(
            (_dispatch.FreshOutput(field, shape, "float32"), ()) for field, shape in (("out", (T, H, D)), ("out_lse", (H, T)))
        )  # fmt: skip
        return _dispatch.Call((), HostTorch(), _arrays.HOST, fresh, None, *_dispatch.autograd_facts(operands, tensors))

    monkeypatch.setattr(_dispatch, "prepare", prepare)
    monkeypatch.setattr(_launch, "launch", lambda *args: pytest.fail("launched"))
    output, lse = torch.randn(T, H, D), torch.randn(H, T)
    two = host_states()
    bound = cm.bind(cm.merge_attn_states, output, *two, lse)
    weight = torch.randn(H, T, requires_grad=True)
    loss = (weight * lse).sum()
    bound()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    again = cm.bind(cm.merge_state, *two)
    merged, merged_lse = again()  # outputs the bound merge allocated count too
    version = merged._version, merged_lse._version
    again()
    assert merged._version > version[0] and merged_lse._version > version[1]
    with pytest.raises(RuntimeError, match=r"^bind\(merge_attn_states\): output requires grad, and a bound merge"):
        cm.bind(cm.merge_attn_states, output.requires_grad_(), *two)
