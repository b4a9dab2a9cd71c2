"""Batch invariance and deterministic gradients, bit for bit, on a GPU.

A token merged alone and the same token at a random position of a random batch with random
company give the same bits (values, LSE, FP8 values and group scales), in batch-invariant mode,
whichever kernel, block shape or tuning the planner picks for each of the two calls. Gradients
give the same bits on every run (the sinks' too, in either mode) and, in batch-invariant mode,
the same bits for a token's states alone and in a batch. Outputs are poisoned (NaN) before
each run; the alone call is checked against the float64 reference too, so that the
comparisons cannot pass on garbage that happens to agree.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from gpu_arrays import relative_error, to_host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy_merge as cm
from cupy_merge import _tuning, reference

pytestmark = pytest.mark.gpu

INVARIANT = _tuning.DEFAULT.replace(batch_invariant=True)
#: Tunings that plan differently (kernel family, block shapes, threads a block): a token's bits
#: must not notice which of them planned its call.
TUNINGS = {
    "default": INVARIANT,
    "strided": INVARIANT.replace(packed_kernels=False),
    "narrow": INVARIANT.replace(
        busy_threads=1 << 30, min_blocks=1 << 20, strided_threads=32, min_pack_threads=1
    ),
    "wide": INVARIANT.replace(packed_many_threads=512, min_row_threads=4, max_block_threads=1024),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(tensor):
    """A tensor's bits, comparable with == (NaN included)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.view(torch.int16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    return tensor.view(torch.int32)


def _same_bits(got, want, what):
    got, want = _bits(got), _bits(want)
    assert got.shape == want.shape, what
    differ = (got != want).sum().item()
    assert differ == 0, f"{what}: {differ} of {want.numel()} elements differ"


def _lse(*shape, spread=4.0):
    return torch.randn(*shape, device="cuda") * spread


def _poisoned(shape, dtype):
    out = torch.empty(shape, dtype=dtype, device="cuda")
    if dtype == torch.float8_e4m3fn:
        out.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        out.fill_(float("nan"))
    return out


# -- N-way -----------------------------------------------------------------------------------------------


@SETTINGS
@given(
    states=st.integers(1, 2100),  # up to 64 splits a row and past it: blocks of 8 packs, shuffles and shared memory
    company=st.integers(1, 1500),
    heads=st.sampled_from([1, 4, 32]),
    head_size=st.sampled_from([64, 128, 40]),
    dtype=st.sampled_from(list(DTYPES)),
    output=st.sampled_from(["same", "fp8", "fp8-groups"]),
    sinks=st.booleans(),
    base_2=st.booleans(),
    tunings=st.tuples(st.sampled_from(list(TUNINGS)), st.sampled_from(list(TUNINGS))),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_token_merged_alone_and_in_a_batch_gives_the_same_bits(
    states, company, heads, head_size, dtype, output, sinks, base_2, tunings, seed
):
    if output == "fp8-groups" and head_size % 64:
        head_size = 64  # a group of 64 elements must divide a head
    torch.manual_seed(seed)
    tokens = min(company, max(1, 20_000_000 // (states * heads * head_size))) + 1
    position = seed % tokens
    v = torch.randn(states, tokens, heads, head_size, device="cuda").to(DTYPES[dtype])
    s = _lse(states, heads, tokens)
    s[torch.rand_like(s) < 0.05] = float("-inf")  # empty states among them
    z = _lse(heads) if sinks else None
    kwargs = {"lse_base": 2 if base_2 else "e", "sinks": z}

    def merge(v, s, tuning):
        count = v.shape[1]
        if output == "same":
            out, extra = _poisoned((count, heads, head_size), v.dtype), {}
        elif output == "fp8":
            out = _poisoned((count, heads, head_size), torch.float8_e4m3fn)
            extra = {"output_scale": torch.full((1,), 0.05, device="cuda")}
        else:
            out = _poisoned((count, heads, head_size), torch.float8_e4m3fn)
            scales = _poisoned((count, heads * head_size // 64), torch.float32)
            extra = {"output_block_scale": scales, "quant_group_size": 64}
        out_lse = _poisoned((heads, count), torch.float32)
        with _tuning.use(tuning):
            cm.merge_states(v, s, out=out, out_lse=out_lse, **kwargs, **extra)
        return out, out_lse, extra.get("output_block_scale")

    alone = merge(
        v[:, position : position + 1].clone(), s[:, :, position : position + 1].clone(), TUNINGS[tunings[0]]
    )
    batch = merge(v, s, TUNINGS[tunings[1]])
    _same_bits(batch[0][position], alone[0][0], "values")
    _same_bits(batch[1][:, position], alone[1][:, 0], "LSE")
    if alone[2] is not None:
        _same_bits(batch[2][position], alone[2][0], "group scales")
        assert torch.isfinite(alone[2]).all(), "a group scale left unwritten (NaN poison)"
    if output != "same":  # every FP8 value written: no NaN byte (0x7F) of the poison is left
        assert (_bits(alone[0]) != 0x7F).all() and (_bits(batch[0][position]) != 0x7F).all()
    if output == "same":  # and what agrees is the merge
        want, want_lse = reference.merge_states(
            to_host(v[:, position : position + 1]), to_host(s[:, :, position : position + 1]),
            2 if base_2 else "e", sinks=None if z is None else to_host(z),
        )  # fmt: skip
        assert relative_error(to_host(alone[0]), want) < (1e-5 if dtype == "float32" else 1e-2)
        finite = np.isfinite(want_lse)
        assert np.array_equal(finite, np.isfinite(to_host(alone[1])))
        assert relative_error(to_host(alone[1])[finite], want_lse[finite]) < 1e-5


@SETTINGS
@given(
    count=st.integers(0, 300),
    company=st.lists(st.integers(0, 300), min_size=1, max_size=64),
    heads=st.sampled_from([1, 8]),
    dtype=st.sampled_from(list(DTYPES)),
    sinks=st.booleans(),
    tunings=st.tuples(st.sampled_from(list(TUNINGS)), st.sampled_from(list(TUNINGS))),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_ragged_token_merged_alone_and_in_a_batch_gives_the_same_bits(count, company, heads, dtype, sinks, tunings,
                                                                         seed):  # fmt: skip
    torch.manual_seed(seed)
    position = seed % (len(company) + 1)
    counts = company[:position] + [count] + company[position:]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
    total = int(indptr[-1])
    v = torch.randn(total, heads, 128, device="cuda").to(DTYPES[dtype])
    s = _lse(heads, total)
    z = _lse(heads) if sinks else None
    first = int(indptr[position])

    def merge(v, s, indptr, tuning):
        tokens = indptr.numel() - 1
        out, out_lse = _poisoned((tokens, heads, 128), v.dtype), _poisoned((heads, tokens), torch.float32)
        with _tuning.use(tuning):
            cm.merge_states_varlen(v, s, indptr, out=out, out_lse=out_lse, sinks=z)
        return out, out_lse

    own = torch.tensor([0, count], dtype=torch.int32, device="cuda")
    alone = merge(
        v[first : first + count].clone(), s[:, first : first + count].clone(), own, TUNINGS[tunings[0]]
    )
    batch = merge(v, s, indptr, TUNINGS[tunings[1]])
    _same_bits(batch[0][position], alone[0][0], "values")
    _same_bits(batch[1][:, position], alone[1][:, 0], "LSE")


@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_a_two_way_token_gives_the_same_bits_alone_and_in_a_batch(tuning):
    torch.manual_seed(7)
    tokens, heads, head_size = 777, 8, 128
    v_a, v_b = (torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    s_a, s_b = _lse(heads, tokens), _lse(heads, tokens)
    z = _lse(heads)
    with _tuning.use(TUNINGS[tuning]):
        batch, batch_lse = cm.merge_state(v_a, s_a, v_b, s_b, sinks=z)
    for position in (0, 400, tokens - 1):
        with _tuning.use(INVARIANT):
            alone, alone_lse = cm.merge_state(
                v_a[position : position + 1], s_a[:, position : position + 1].contiguous(),
                v_b[position : position + 1], s_b[:, position : position + 1].contiguous(), sinks=z,
            )  # fmt: skip
        _same_bits(batch[position], alone[0], "values")
        _same_bits(batch_lse[:, position], alone_lse[:, 0], "LSE")


# -- gradients ---------------------------------------------------------------------------------------------


def _gradients(kind, v, s, grad_v, grad_s, z, indptr=None, given=False, tuning=None):
    """A merge's gradients through the public backward (given: the merge's results too)."""
    with _tuning.use(tuning or _tuning.current()):
        if kind == "ragged":
            out, out_lse = cm.merge_states_varlen(v, s, indptr, sinks=z) if given else (None, None)
            return cm.merge_states_varlen_backward(
                v, s, indptr, grad_v, grad_s, out=out, out_lse=out_lse, sinks=z
            )
        if kind == "two-way":
            return cm.merge_state_backward(v[0], s[0], v[1], s[1], grad_v, grad_s, sinks=z)
        out, out_lse = cm.merge_states(v, s, sinks=z) if given else (None, None)
        return cm.merge_states_backward(v, s, grad_v, grad_s, out=out, out_lse=out_lse, sinks=z)


@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("kind, states, tokens, given", [
    ("dense", 16, 1024, False), ("dense", 700, 8, False), ("dense", 64, 512, True), ("dense", 3001, 2, True),
    ("two-way", 2, 8192, False), ("ragged", 0, 512, False), ("ragged", 0, 64, True),
])  # fmt: skip
def test_gradients_are_the_same_bits_on_every_run(mode, kind, states, tokens, given):
    """The sinks' gradient included: it used to be added by float atomics in the order blocks ran."""
    torch.manual_seed(3)
    heads = 8
    indptr = None
    if kind == "ragged":
        counts = torch.randint(0, 300, (tokens,))
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to("cuda", torch.int32)
        total = int(indptr[-1])
        v, s = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16), _lse(heads, total)
    else:
        v = torch.randn(states, tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
        s = _lse(states, heads, tokens)
    grad_v = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    grad_s = torch.randn(heads, tokens, device="cuda")
    z = _lse(heads)
    tuning = INVARIANT if mode == "invariant" else _tuning.DEFAULT
    runs = [_gradients(kind, v, s, grad_v, grad_s, z, indptr, given, tuning) for _ in range(3)]
    for run in runs[1:]:
        for got, want, what in zip(run, runs[0], ("dV", "dS", "dV_b", "dS_b", "d(sinks)")):
            _same_bits(got, want, what)
    host = {"grad_v": to_host(grad_v), "grad_s": to_host(grad_s), "sinks": to_host(z)}
    if kind == "ragged":
        *_, want_z = reference.merge_states_varlen_backward(
            to_host(v), to_host(s), indptr.cpu().numpy(), **host
        )
    elif kind == "two-way":
        *_, want_z = reference.merge_state_backward(
            to_host(v[0]), to_host(s[0]), to_host(v[1]), to_host(s[1]), **host
        )
    else:
        *_, want_z = reference.merge_states_backward(to_host(v), to_host(s), **host)
    # Given the results, <dV, V> is read from V as rounded to bfloat16.
    assert relative_error(to_host(runs[0][-1]), want_z) < (1e-2 if given else 1e-4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["dense", "ragged"]),
    states=st.integers(1, 200),
    tokens=st.sampled_from([2, 9, 300, 5000]),
    given_results=st.booleans(),
    head_size=st.sampled_from([64, 128, 512]),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_tokens_gradients_are_the_same_bits_alone_and_in_a_batch(kind, states, tokens, given_results, head_size,
                                                                     seed):  # fmt: skip
    torch.manual_seed(seed)
    heads = 4
    tokens = min(tokens, max(2, 4_000_000 // (states * heads * head_size)))
    position = seed % tokens
    grad_v = torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
    grad_s = torch.randn(heads, tokens, device="cuda")
    if kind == "ragged":
        counts = torch.randint(0, 2 * states, (tokens,))
        counts[position] = states
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to("cuda", torch.int32)
        total, first = int(indptr[-1]), int(indptr[position])
        v, s = torch.randn(total, heads, head_size, device="cuda", dtype=torch.bfloat16), _lse(heads, total)
        batch = _gradients("ragged", v, s, grad_v, grad_s, None, indptr, given_results, INVARIANT)
        own = torch.tensor([0, states], dtype=torch.int32, device="cuda")
        rows = slice(first, first + states)
        alone = _gradients("ragged", v[rows].clone(), s[:, rows].clone(), grad_v[position : position + 1],
                           grad_s[:, position : position + 1].clone(), None, own, given_results, INVARIANT)  # fmt: skip
        _same_bits(batch[0][rows], alone[0], "dV")
        _same_bits(batch[1][:, rows], alone[1], "dS")
        return
    v = torch.randn(states, tokens, heads, head_size, device="cuda", dtype=torch.bfloat16)
    s = _lse(states, heads, tokens)
    one = slice(position, position + 1)
    batch = _gradients("dense", v, s, grad_v, grad_s, None, None, given_results, INVARIANT)
    alone = _gradients("dense", v[:, one].clone(), s[:, :, one].clone(), grad_v[one], grad_s[:, one].clone(), None,
                       None, given_results, INVARIANT)  # fmt: skip
    _same_bits(batch[0][:, one], alone[0], "dV")
    _same_bits(batch[1][:, :, one], alone[1], "dS")


def test_autograd_runs_the_backward_in_the_mode_its_forward_ran_in():
    """Autograd's thread does not see the forward's context: the Function carries the tuning."""
    torch.manual_seed(5)
    v = torch.randn(64, 3, 4, 128, device="cuda", requires_grad=True)
    s = _lse(64, 4, 3).requires_grad_()
    seen = []
    from cupy_merge import _dispatch

    real = _dispatch.plan_for

    def spy(operation, options, tuning, views):
        seen.append((operation.name, tuning.batch_invariant))
        return real(operation, options, tuning, views)

    _dispatch.plan_for = spy
    try:
        with cm.batch_invariant():
            out, lse = cm.merge_states(v, s)
        (out.sum() + lse.sum()).backward()
    finally:
        _dispatch.plan_for = real
    assert ("merge_states_backward", True) in seen
    want_v, _, _ = reference.merge_states_backward(
        to_host(v), to_host(s), np.ones((3, 4, 128)), np.ones((4, 3))
    )
    assert relative_error(to_host(v.grad), want_v) < 1e-5


# -- through the frameworks' compilers and CUDA graphs -------------------------------------------------------


def _dense_batch(states=300, tokens=333, heads=8, seed=11):
    torch.manual_seed(seed)
    v = torch.randn(states, tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    return v, _lse(states, heads, tokens)


def test_a_compiled_graph_and_a_cuda_graph_give_the_eager_tokens_bits():
    v, s = _dense_batch()
    position = 123
    with cm.batch_invariant():
        alone, alone_lse = cm.merge_states(v[:, position : position + 1].clone(), s[:, :, position : position + 1].clone())
    cm.set_batch_invariant(True)  # compiled graphs run their merges in the process's mode
    try:
        compiled = torch.compile(lambda v, s: cm.merge_states(v, s), fullgraph=True)
        out, lse = compiled(v, s)
        _same_bits(out[position], alone[0], "values, torch.compile")
        _same_bits(lse[:, position], alone_lse[:, 0], "LSE, torch.compile")
        out, lse = _poisoned(out.shape, out.dtype), _poisoned(lse.shape, lse.dtype)
        cm.merge_states(v, s, out=out, out_lse=lse)  # planned before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cm.merge_states(v, s, out=out, out_lse=lse)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(out[position], alone[0], "values, CUDA graph")
        _same_bits(lse[:, position], alone_lse[:, 0], "LSE, CUDA graph")
    finally:
        cm.set_batch_invariant(False)


def test_a_jitted_merge_gives_the_eager_tokens_bits():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.experimental.buffer_callback")
    import cupy_merge.jax as cmj

    v, s = _dense_batch()
    position = 200
    jv, js = jax.dlpack.from_dlpack(v.float()), jax.dlpack.from_dlpack(s)
    with cm.batch_invariant():
        alone, alone_lse = cm.merge_states(v[:, position : position + 1].float().clone(),
                                           s[:, :, position : position + 1].clone())  # fmt: skip
        out, lse = jax.jit(lambda v, s: cmj.merge_states(v, s))(jv, js)  # traced in the mode
    out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
    _same_bits(out[position], alone[0], "values, jax.jit")
    _same_bits(lse[:, position], alone_lse[:, 0], "LSE, jax.jit")
