"""cupy_merge.compat without a GPU: the peers' layouts, checked in the peers' words, and wired to the core.

* the float64 references of each peer's documented semantics, in the peer's own layout (the
  GPU tests, ``test_gpu_compat.py``, compare against them too);
* every argument check, with the peer's argument names, made before the core is reached;
* the views each compat function hands the core (shapes, strides, storage, ``lse_base``,
  ``out``/``out_lse``), recorded by a stand-in for the core on CPU torch tensors, as
  ``docs/porting.rst`` lists them;
* the peers' semantics end to end on that stand-in (it merges in float64, in the core's layout,
  writing through the views it is given): where ``seq_len == num_heads`` the compat call is
  right and the core fed the peer's layout unchanged is accepted and wrong.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Any, NamedTuple

import numpy as np
import pytest

import cupy_merge as cm
from cupy_merge import compat
from cupy_merge.compat import flash_attn, flashinfer, sglang, xformers

torch = pytest.importorskip("torch")


# -- float64 references in the peers' layouts ------------------------------------------------------


def merge_reference(v, s, base: float) -> tuple[np.ndarray, np.ndarray]:
    """The merge of ``v`` ``[N, ..., D]`` by their LSEs ``s`` ``[N, ...]`` (base ``base`` in and
    out) over the first axis: ``S = log(sum 2**s)``, ``V = sum base**(s - S) * v`` in float64.

    The rules the peers document and cupy-merge keeps: ``+inf`` reads as ``-inf`` (SGLang, vLLM);
    a state of weight 0 adds exactly 0, even where its values are NaN (FlashAttention skips it);
    a token whose states are all ``-inf`` (or that has none) gets 0 and ``-inf`` (FlashInfer's
    main branch, FlashAttention); a NaN LSE makes its token NaN.
    """
    v = np.asarray(v, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    s = np.where(s == np.inf, -np.inf, s)
    if s.shape[0] == 0:
        return np.zeros(v.shape[1:]), np.full(s.shape[1:], -np.inf)
    log_base = math.log(base)
    top = s.max(axis=0)
    shift = np.where(np.isneginf(top), 0.0, top)
    weights = np.exp((s - shift) * log_base)
    total = weights.sum(axis=0)
    summed = np.where(weights[..., None] > 0, weights[..., None] * v, 0.0).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        merged_v = np.where(total[..., None] > 0, summed / total[..., None], 0.0)
        merged_s = np.where(total > 0, np.log(total) / log_base + shift, -np.inf)
    nan = np.isnan(total)
    merged_v[nan] = np.nan
    merged_s[nan] = np.nan
    return merged_v, merged_s


def xf_merge_attentions(attn_split, lse_split):
    """xFormers ``merge_attentions``: attn ``[N, B, M, (G,) H, K]``, lse ``[N, B, (G,) H, M]``, natural log."""
    lse = np.moveaxis(np.asarray(lse_split, dtype=np.float64), -1, 2)  # [N, B, M, (G,) H]
    merged_v, merged_s = merge_reference(attn_split, lse, math.e)
    return merged_v, np.moveaxis(merged_s, 1, -1)


def fi_merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer ``merge_state``: v ``[seq_len, num_heads, head_dim]``, s ``[seq_len, num_heads]`` base 2."""
    return merge_reference(np.stack([v_a, v_b]), np.stack([s_a, s_b]), 2.0)


def fi_merge_state_in_place(v, s, v_other, s_other, mask=None):
    """FlashInfer ``merge_state_in_place``'s results: tokens where ``mask`` is False keep ``(v, s)``."""
    merged_v, merged_s = fi_merge_state(v, s, v_other, s_other)
    if mask is None:
        return merged_v, merged_s
    mask = np.asarray(mask, dtype=bool)
    return (
        np.where(mask[:, None, None], merged_v, np.asarray(v, np.float64)),
        np.where(mask[:, None], merged_s, np.asarray(s, np.float64)),
    )


def fi_merge_states(v, s):
    """FlashInfer ``merge_states``: v ``[seq_len, num_states, num_heads, head_dim]``, s ``[seq_len, num_states, num_heads]``."""
    return merge_reference(np.moveaxis(np.asarray(v), 1, 0), np.moveaxis(np.asarray(s), 1, 0), 2.0)


def fi_variable_length_merge_states(v, s, indptr):
    """FlashInfer (Triton) ``variable_length_merge_states``: token ``t`` merges rows ``indptr[t]:indptr[t+1]``."""
    v, s, indptr = np.asarray(v, np.float64), np.asarray(s, np.float64), np.asarray(indptr)
    merged = [merge_reference(v[a:b], s[a:b], 2.0) for a, b in itertools.pairwise(indptr)]
    num_heads, head_dim = v.shape[1:]
    if not merged:
        return np.zeros((0, num_heads, head_dim)), np.zeros((0, num_heads))
    return np.stack([m[0] for m in merged]), np.stack([m[1] for m in merged])


def sgl_merge_state_v2(v_a, s_a, v_b, s_b, base: float = math.e):
    """SGLang ``merge_state_v2``: v ``[seq_len, num_heads, head_dim]``, s ``[seq_len, num_heads]`` natural log."""
    return merge_reference(np.stack([v_a, v_b]), np.stack([s_a, s_b]), base)


def fa_combine(out_partial, lse_partial):
    """FlashAttention ``flash_attn_combine``: split-major ``[num_splits, ..., num_heads, head_size]``
    and ``[num_splits, ..., num_heads]``, natural log (``attention_combine_ref`` of its tests)."""
    return merge_reference(out_partial, lse_partial, math.e)


def test_the_references_agree_with_hand_computed_merges():
    v = np.array([[[[1.0, 2.0]]], [[[3.0, 6.0]]]])  # two states of one token, one head
    s = np.array([[[0.0]], [[0.0]]])
    merged_v, merged_s = merge_reference(v, s, 2.0)
    assert np.allclose(merged_v, [[[2.0, 4.0]]]) and np.allclose(merged_s, [[1.0]])  # log2(2)
    merged_v, merged_s = merge_reference(v, s, math.e)
    assert np.allclose(merged_s, [[math.log(2.0)]])
    empty_v, empty_s = merge_reference(v, np.full_like(s, -np.inf), 2.0)
    assert (empty_v == 0).all() and np.isneginf(empty_s).all()
    nan_v = v.copy()
    nan_v[1] = np.nan
    one_v, one_s = merge_reference(nan_v, np.array([[[0.0]], [[-np.inf]]]), 2.0)
    assert np.allclose(one_v, v[0]) and np.allclose(one_s, 0.0)  # weight 0: NaN values ignored
    plus_v, _ = merge_reference(v, np.array([[[0.0]], [[np.inf]]]), 2.0)
    assert np.allclose(plus_v, v[0])  # +inf reads as -inf
    none_v, none_s = merge_reference(np.zeros((0, 3, 2, 4)), np.zeros((0, 3, 2)), 2.0)
    assert none_v.shape == (3, 2, 4) and (none_v == 0).all() and np.isneginf(none_s).all()


# -- a stand-in for the core: CPU torch tensors, the core's layout, float64 ---------------------------


class Call(NamedTuple):
    name: str
    args: dict


_BASES: dict[Any, float] = {"e": math.e, 2: 2.0, "2": 2.0}


def _host(x) -> np.ndarray:
    return x.detach().double().numpy()


def _write(target, values: np.ndarray) -> None:
    target.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(target.dtype))


def _core_shape(x, shape: tuple, name: str) -> None:
    """The only rule of the core's that matters here: its shape check (which a square LSE passes)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {shape} (the core's layout), got {tuple(x.shape)}")


class FakeCore:
    """``cm.merge_state``, ``merge_state_in_place``, ``merge_states`` and ``merge_states_varlen`` on
    CPU torch tensors: records each call's arguments (the very objects), checks the core's shapes,
    merges in float64 and writes through the ``out``/``out_lse`` views it is given."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def record(self, name: str, **args) -> None:
        self.calls.append(Call(name, args))

    def merge_state(self, v_a, s_a, v_b, s_b, *, out=None, out_lse=None, lse_base="e", stream=None):
        self.record(
            "merge_state",
            v_a=v_a,
            s_a=s_a,
            v_b=v_b,
            s_b=s_b,
            out=out,
            out_lse=out_lse,
            lse_base=lse_base,
            stream=stream,
        )
        tokens, heads, head_size = v_a.shape
        _core_shape(s_a, (heads, tokens), "s_a")
        _core_shape(s_b, (heads, tokens), "s_b")
        merged_v, merged_s = merge_reference(
            np.stack([_host(v_a), _host(v_b)]), np.stack([_host(s_a).T, _host(s_b).T]), _BASES[lse_base]
        )
        out = torch.empty(tokens, heads, head_size, dtype=v_a.dtype) if out is None else out
        out_lse = torch.empty(heads, tokens) if out_lse is None else out_lse
        _write(out, merged_v)
        _write(out_lse, merged_s.T)
        return out, out_lse

    def merge_state_in_place(self, v, s, v_other, s_other, mask=None, *, lse_base="e", stream=None):
        self.record(
            "merge_state_in_place",
            v=v,
            s=s,
            v_other=v_other,
            s_other=s_other,
            mask=mask,
            lse_base=lse_base,
            stream=stream,
        )
        tokens, heads, _ = v.shape
        _core_shape(s, (heads, tokens), "s")
        _core_shape(s_other, (heads, tokens), "s_other")
        merged_v, merged_s = merge_reference(
            np.stack([_host(v), _host(v_other)]), np.stack([_host(s).T, _host(s_other).T]), _BASES[lse_base]
        )
        keep = torch.ones(tokens, dtype=torch.bool) if mask is None else mask
        v[keep] = torch.from_numpy(merged_v).to(v.dtype)[keep]
        s[:, keep] = torch.from_numpy(np.ascontiguousarray(merged_s.T)).float()[:, keep]

    def merge_states(self, v, s, *, out=None, out_lse=None, lse_base="e", stream=None):
        self.record("merge_states", v=v, s=s, out=out, out_lse=out_lse, lse_base=lse_base, stream=stream)
        states, tokens, heads, head_size = v.shape
        _core_shape(s, (states, heads, tokens), "s")
        merged_v, merged_s = merge_reference(_host(v), _host(s).transpose(0, 2, 1), _BASES[lse_base])
        out = torch.empty(tokens, heads, head_size, dtype=v.dtype) if out is None else out
        out_lse = torch.empty(heads, tokens) if out_lse is None else out_lse
        _write(out, merged_v)
        _write(out_lse, merged_s.T)
        return out, out_lse

    def merge_states_varlen(
        self, v, s, indptr, *, out=None, out_lse=None, lse_base="e", check_indptr=True, stream=None
    ):
        self.record(
            "merge_states_varlen",
            v=v,
            s=s,
            indptr=indptr,
            out=out,
            out_lse=out_lse,
            lse_base=lse_base,
            check_indptr=check_indptr,
            stream=stream,
        )
        rows, heads, head_size = v.shape
        _core_shape(s, (heads, rows), "s")
        offsets = indptr.numpy()
        tokens = len(offsets) - 1
        results = [
            merge_reference(_host(v)[a:b], _host(s).T[a:b], _BASES[lse_base])
            for a, b in itertools.pairwise(offsets)
        ]
        merged_v = np.stack([r[0] for r in results]) if results else np.zeros((0, heads, head_size))
        merged_s = np.stack([r[1] for r in results]) if results else np.zeros((0, heads))
        out = torch.empty(tokens, heads, head_size, dtype=v.dtype) if out is None else out
        out_lse = torch.empty(heads, tokens) if out_lse is None else out_lse
        _write(out, merged_v)
        _write(out_lse, merged_s.T)
        return out, out_lse


@pytest.fixture
def core(monkeypatch):
    """The stand-in, in place of the core merges; CPU tensors let through the compat modules' CUDA check."""
    fake = FakeCore()
    for name in ("merge_state", "merge_state_in_place", "merge_states", "merge_states_varlen"):
        monkeypatch.setattr(cm, name, getattr(fake, name))
    monkeypatch.setattr(compat, "expect_cuda", lambda obj, name: None)
    return fake


def same_view(got, want) -> bool:
    """The very same memory seen the same way: storage address, shape, strides, dtype."""
    return (
        got.data_ptr() == want.data_ptr()
        and tuple(got.shape) == tuple(want.shape)
        and tuple(got.stride()) == tuple(want.stride())
        and got.dtype == want.dtype
    )


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def f64(x) -> np.ndarray:
    return x.detach().double().numpy()


def close(got, want: np.ndarray, tol: float = 1e-5) -> bool:
    return bool(np.allclose(f64(got), want, rtol=tol, atol=tol, equal_nan=True))


# -- FlashInfer: the views the core gets ------------------------------------------------------------


def test_flashinfer_merge_state_hands_the_core_transposed_views_and_base_2(core):
    tokens, heads, dim = 7, 3, 16
    v_a, v_b = randn(tokens, heads, dim, dtype=torch.float16), randn(tokens, heads, dim, dtype=torch.float16)
    s_a, s_b = randn(tokens, heads), randn(tokens, heads)
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    (call,) = core.calls
    assert call.name == "merge_state" and call.args["lse_base"] == 2
    assert call.args["v_a"] is v_a and call.args["v_b"] is v_b
    assert same_view(call.args["s_a"], s_a.T) and same_view(call.args["s_b"], s_b.T)
    assert call.args["out"] is merged_v
    assert same_view(call.args["out_lse"], merged_s.T)
    # FlashInfer's outputs: V like v_a, S float32 [seq_len, num_heads], both C-contiguous.
    assert (
        merged_v.dtype == torch.float16
        and merged_v.shape == (tokens, heads, dim)
        and merged_v.is_contiguous()
    )
    assert merged_s.dtype == torch.float32 and merged_s.shape == (tokens, heads) and merged_s.is_contiguous()
    want_v, want_s = fi_merge_state(f64(v_a), f64(s_a), f64(v_b), f64(s_b))
    assert close(merged_v, want_v, 1e-3) and close(merged_s, want_s)


def test_flashinfer_lse_of_another_float_dtype_is_cast_like_flashinfer_does(core):
    v = randn(5, 2, 8)
    s_a, s_b = randn(5, 2, dtype=torch.float16), randn(5, 2, dtype=torch.float64)
    merged_v, merged_s = flashinfer.merge_state(v, s_a, v, s_b)
    (call,) = core.calls
    assert call.args["s_a"].dtype == torch.float32 and call.args["s_a"].shape == (2, 5)
    assert call.args["s_a"].data_ptr() != s_a.data_ptr()  # a copy, as FlashInfer's s.to(float32)
    assert merged_s.dtype == torch.float32
    want_v, want_s = fi_merge_state(f64(v), f64(s_a), f64(v), f64(s_b.float()))
    assert close(merged_v, want_v) and close(merged_s, want_s)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_flashinfer_merge_state_in_place_reads_a_byte_mask_as_its_cuda_kernel_does(core, dtype):
    """FlashInfer's CUDA kernel reads a mask a byte a token, nonzero merging: a uint8 or int8 mask
    is handed to the core as a bool view of the same bytes (the kernels test each byte != 0)."""
    tokens, heads, dim = 6, 2, 8
    v, v_other = randn(tokens, heads, dim), randn(tokens, heads, dim)
    s, s_other = randn(tokens, heads), randn(tokens, heads)
    mask = torch.tensor([0, 1, 2, 0, -1 if dtype == torch.int8 else 255, 0], dtype=dtype)
    want_v, want_s = fi_merge_state_in_place(f64(v), f64(s), f64(v_other), f64(s_other), mask.numpy() != 0)
    flashinfer.merge_state_in_place(v, s, v_other, s_other, mask)
    (call,) = core.calls
    flags = call.args["mask"]
    assert flags.dtype == torch.bool and flags.data_ptr() == mask.data_ptr() and flags.shape == mask.shape
    assert close(v, want_v) and close(s, want_s)


@pytest.mark.parametrize("masked", [False, True])
def test_flashinfer_merge_state_in_place_writes_through_the_callers_arrays(core, masked):
    tokens, heads, dim = 9, 4, 8
    v, v_other = (
        randn(tokens, heads, dim, dtype=torch.bfloat16),
        randn(tokens, heads, dim, dtype=torch.bfloat16),
    )
    s, s_other = randn(tokens, heads), randn(tokens, heads)
    mask = torch.rand(tokens) > 0.5 if masked else None
    want_v, want_s = fi_merge_state_in_place(f64(v), f64(s), f64(v_other), f64(s_other),
                                             None if mask is None else mask.numpy())  # fmt: skip
    flashinfer.merge_state_in_place(v, s, v_other, s_other, mask)
    (call,) = core.calls
    assert call.name == "merge_state_in_place" and call.args["lse_base"] == 2
    assert call.args["v"] is v and call.args["v_other"] is v_other and call.args["mask"] is mask
    assert same_view(call.args["s"], s.T) and same_view(call.args["s_other"], s_other.T)
    assert close(v, want_v, 1e-2) and close(s, want_s)


def test_flashinfer_merge_states_hands_the_core_permuted_views(core):
    tokens, states, heads, dim = 6, 5, 3, 8
    v, s = randn(tokens, states, heads, dim, dtype=torch.float16), randn(tokens, states, heads)
    merged_v, merged_s = flashinfer.merge_states(v, s)
    (call,) = core.calls
    assert call.name == "merge_states" and call.args["lse_base"] == 2
    assert same_view(call.args["v"], v.transpose(0, 1)) and same_view(call.args["s"], s.permute(1, 2, 0))
    assert call.args["out"] is merged_v and same_view(call.args["out_lse"], merged_s.T)
    assert merged_v.shape == (tokens, heads, dim) and merged_v.dtype == torch.float16
    assert merged_s.shape == (tokens, heads) and merged_s.is_contiguous()
    want_v, want_s = fi_merge_states(f64(v), f64(s))
    assert close(merged_v, want_v, 1e-3) and close(merged_s, want_s)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64, torch.int16])
def test_flashinfer_variable_length_merge_states_hands_the_core_the_transposed_lse(core, index_dtype):
    lengths = [3, 0, 1, 4]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=index_dtype)
    rows, heads, dim = sum(lengths), 2, 8
    v, s = randn(rows, heads, dim), randn(rows, heads)
    merged_v, merged_s = flashinfer.variable_length_merge_states(v, s, indptr)
    (call,) = core.calls
    assert call.name == "merge_states_varlen" and call.args["lse_base"] == 2
    assert call.args["check_indptr"] is False  # FlashInfer checks nothing: no host synchronisation
    assert call.args["v"] is v and same_view(call.args["s"], s.T)
    if index_dtype == torch.int16:
        assert call.args["indptr"].dtype == torch.int32  # cast, as FlashInfer's indptr.to(int32)
    else:
        assert call.args["indptr"] is indptr
    assert call.args["out"] is merged_v and same_view(call.args["out_lse"], merged_s.T)
    assert merged_v.shape == (len(lengths), heads, dim) and merged_s.shape == (len(lengths), heads)
    want_v, want_s = fi_variable_length_merge_states(f64(v), f64(s), indptr.numpy())
    assert close(merged_v, want_v) and close(merged_s, want_s)
    assert (f64(merged_v)[1] == 0).all() and np.isneginf(f64(merged_s)[1]).all()  # an empty token


def test_flashinfer_passes_the_stream_and_check_indptr_through(core):
    v, s = randn(4, 2, 8), randn(4, 2)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    flashinfer.variable_length_merge_states(v, s, indptr, check_indptr=True, stream=7)
    flashinfer.merge_state(v, s, v, s, stream=7)
    assert [c.args["stream"] for c in core.calls] == [7, 7]
    assert core.calls[0].args["check_indptr"] is True


# -- the porting trap: seq_len == num_heads ---------------------------------------------------------


@pytest.mark.parametrize("square", [4, 8])
def test_flashinfer_layout_is_right_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(core, square):
    tokens = heads = square
    v_a, v_b = randn(tokens, heads, 16), randn(tokens, heads, 16)
    s_a, s_b = 3 * randn(tokens, heads), 3 * randn(tokens, heads)  # FlashInfer's [seq_len, num_heads], base 2
    want_v, want_s = fi_merge_state(f64(v_a), f64(s_a), f64(v_b), f64(s_b))
    merged_v, merged_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    assert close(merged_v, want_v) and close(merged_s, want_s)
    # The same tensors handed to the core unchanged: the shapes pass its check, the answer is wrong.
    wrong_v, _ = cm.merge_state(v_a, s_a, v_b, s_b, lse_base=2)
    assert np.abs(f64(wrong_v) - want_v).max() > 0.1
    # Transposed but read as natural logs: wrong too.
    wrong_v, _ = cm.merge_state(v_a, s_a.T, v_b, s_b.T)
    assert np.abs(f64(wrong_v) - want_v).max() > 0.01


def test_sglang_layout_is_right_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(core):
    v_a, v_b = randn(8, 8, 32), randn(8, 8, 32)
    s_a, s_b = 3 * randn(8, 8), 3 * randn(8, 8)
    want_v, _ = sgl_merge_state_v2(f64(v_a), f64(s_a), f64(v_b), f64(s_b))
    merged_v, _ = sglang.merge_state_v2(v_a, s_a, v_b, s_b)
    assert close(merged_v, want_v)
    wrong_v, _ = cm.merge_state(v_a, s_a, v_b, s_b)
    assert np.abs(f64(wrong_v) - want_v).max() > 0.1


def test_flash_attn_layout_is_right_where_the_core_fed_the_same_arrays_is_accepted_and_wrong(core):
    splits, seqlen = 4, 8
    heads = seqlen
    out_partial = randn(splits, 1, seqlen, heads, 16)
    lse_partial = (3 * randn(splits, 1, heads, seqlen)).transpose(-1, -2)  # FA's [S, B, L, H] view
    want_v, want_s = fa_combine(f64(out_partial), f64(lse_partial))
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial)
    assert close(out, want_v) and close(lse, want_s)
    wrong_v, _ = cm.merge_states(out_partial[:, 0], lse_partial[:, 0])  # [S, L, H] taken as [S, H, L]
    assert np.abs(f64(wrong_v) - want_v[0]).max() > 0.1


# -- SGLang: the views the core gets ----------------------------------------------------------------


def test_sglang_merge_state_v2_allocates_token_major_outputs(core):
    v_a, v_b = randn(6, 3, 48, dtype=torch.float16), randn(6, 3, 48, dtype=torch.float16)
    s_a, s_b = randn(6, 3), randn(6, 3)
    merged_v, merged_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, enable_pdl=True)
    (call,) = core.calls
    assert call.name == "merge_state" and call.args["lse_base"] == "e"
    assert (
        call.args["v_a"] is v_a and same_view(call.args["s_a"], s_a.T) and same_view(call.args["s_b"], s_b.T)
    )
    assert call.args["out"] is merged_v and same_view(call.args["out_lse"], merged_s.T)
    assert merged_v.dtype == torch.float16 and merged_s.shape == (6, 3) and merged_s.dtype == torch.float32
    want_v, want_s = sgl_merge_state_v2(f64(v_a), f64(s_a), f64(v_b), f64(s_b))
    assert close(merged_v, want_v, 1e-3) and close(merged_s, want_s)


def test_sglang_merge_state_v2_writes_given_outputs_and_in_place(core):
    v_a, v_b = randn(5, 2, 32), randn(5, 2, 32)
    s_a, s_b = randn(5, 2), randn(5, 2)
    want_v, want_s = sgl_merge_state_v2(f64(v_a), f64(s_a), f64(v_b), f64(s_b))
    v_out = torch.full((5, 2, 32), float("nan"), dtype=torch.bfloat16)
    s_out = torch.full((5, 2), float("nan"))
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_out, s_out)
    assert got_v is v_out and got_s is s_out
    assert core.calls[-1].args["out"] is v_out and same_view(core.calls[-1].args["out_lse"], s_out.T)
    assert close(v_out, want_v, 1e-2) and close(s_out, want_s)
    got_v, got_s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_a, s_a)  # in place, as SGLang allows
    call = core.calls[-1]
    assert got_v is v_a and got_s is s_a
    assert call.args["out"] is call.args["v_a"] and same_view(call.args["out_lse"], call.args["s_a"])
    assert close(v_a, want_v) and close(s_a, want_s)


def test_sglang_srt_merge_state_is_merge_state_v2_under_its_names(core):
    """sglang.srt.layers.attention.merge_state.merge_state, called by keyword as SGLang's serving code
    may: natural log, token-major, the given output written in place."""
    prefix, suffix = randn(6, 3, 16, dtype=torch.bfloat16), randn(6, 3, 16, dtype=torch.bfloat16)
    p_lse, s_lse = randn(6, 3), randn(6, 3)
    want_v, want_s = sgl_merge_state_v2(f64(prefix), f64(p_lse), f64(suffix), f64(s_lse))
    output, output_lse = sglang.merge_state(prefix_output=prefix, prefix_lse=p_lse, suffix_output=suffix,
                                            suffix_lse=s_lse)  # fmt: skip
    (call,) = core.calls
    assert call.name == "merge_state" and call.args["lse_base"] == "e" and call.args["v_a"] is prefix
    assert same_view(call.args["s_a"], p_lse.T) and same_view(call.args["out_lse"], output_lse.T)
    assert close(output, want_v, 1e-2) and close(output_lse, want_s)
    got = sglang.merge_state(prefix, p_lse, suffix, s_lse, output=prefix)
    assert got[0] is prefix and close(prefix, want_v, 1e-2)
    with pytest.raises(ValueError, match=r"^prefix_lse: expected shape \[seq_len, num_heads\] = \(6, 3\) from "):
        sglang.merge_state(prefix, p_lse.T.contiguous()[:, :5], suffix, s_lse)
    with pytest.raises(TypeError, match=r"^suffix_output: expected the dtype of prefix_output"):
        sglang.merge_state(prefix, p_lse, suffix.float(), s_lse)


def test_sglang_v1_base_2_is_lse_base_2(core):
    v, s = randn(4, 2, 8), randn(4, 2)
    t = randn(4, 2)
    merged_v, merged_s = sglang.merge_state_v2(v, s, 2 * v, t, lse_base=2)
    assert core.calls[-1].args["lse_base"] == 2
    want_v, want_s = fi_merge_state(f64(v), f64(s), f64(2 * v), f64(t))
    assert close(merged_v, want_v) and close(merged_s, want_s)


# -- FlashAttention: the views the core gets --------------------------------------------------------


def test_flash_attn_varlen_is_one_core_merge_with_the_permuted_lse(core):
    splits, total_q, heads, dim = 5, 11, 4, 16
    out_partial = randn(2 * splits, total_q, heads, dim)[:splits]
    lse_partial = randn(splits, heads, total_q).transpose(-1, -2)  # total_q contiguous, as FA wants
    cu_seqlens = torch.tensor([0, 4, 11], dtype=torch.int32)
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16,
                                             cu_seqlens=cu_seqlens, seqused=torch.tensor([3, 7], dtype=torch.int32))  # fmt: skip
    (call,) = core.calls
    assert call.name == "merge_states" and call.args["lse_base"] == "e"
    assert call.args["v"] is out_partial and same_view(call.args["s"], lse_partial.permute(0, 2, 1))
    assert call.args["out"] is out and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert same_view(call.args["out_lse"], lse.T) and call.args["out_lse"].is_contiguous()
    assert lse.shape == (total_q, heads) and lse.stride() == (1, total_q)  # FA4's lse
    want_v, want_s = fa_combine(f64(out_partial), f64(lse_partial))
    assert close(out, want_v, 1e-2) and close(lse, want_s)


@pytest.mark.parametrize(
    "batch, seqlen, heads, calls",
    [
        (4, 1, 3, 1),  # decode: seqlen 1 folds, one merge of 4 tokens
        (1, 6, 3, 1),  # one batch element
        (3, 5, 2, 3),  # one merge per batch element
        (5, 2, 2, 2),  # fewer rows than batch elements: one merge per row position
        (3, 4, 1, 1),  # one head: everything folds (contiguous arrays)
        (0, 4, 2, 1),  # empty: one merge of no tokens
    ],
)
def test_flash_attn_batched_merges_views_per_batch_element_where_they_do_not_fold(
    core, batch, seqlen, heads, calls
):
    splits, dim = 3, 8
    out_partial = randn(splits, batch, seqlen, heads, dim)
    lse_partial = randn(splits, batch, heads, seqlen).transpose(-1, -2)
    if heads == 1:
        lse_partial = randn(splits, batch, seqlen, heads)
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial)
    assert len(core.calls) == calls
    assert all(c.name == "merge_states" and c.args["lse_base"] == "e" for c in core.calls)
    # FlashAttention's outputs: out C-contiguous [B, L, H, D]; lse [B, L, H] of strides (H*L, 1, L).
    assert out.shape == (batch, seqlen, heads, dim) and out.is_contiguous() and out.dtype == torch.float32
    assert lse.shape == (batch, seqlen, heads) and lse.stride() == (heads * seqlen, 1, seqlen)
    storage = lse.data_ptr()
    for c in core.calls:  # every argument is a view of the caller's (or the returned) memory
        assert c.args["v"].untyped_storage().data_ptr() == out_partial.untyped_storage().data_ptr()
        assert c.args["s"].untyped_storage().data_ptr() == lse_partial.untyped_storage().data_ptr()
        assert c.args["out"].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert c.args["out_lse"].untyped_storage().data_ptr() == storage
    if calls > 1 and batch <= seqlen:
        for b, c in enumerate(core.calls):
            assert same_view(c.args["v"], out_partial[:, b])
            assert same_view(c.args["s"], lse_partial[:, b].permute(0, 2, 1))
            assert same_view(c.args["out"], out[b]) and same_view(c.args["out_lse"], lse[b].T)
    elif calls > 1:
        for row, c in enumerate(core.calls):
            assert same_view(c.args["v"], out_partial[:, :, row])
            assert same_view(c.args["s"], lse_partial[:, :, row].permute(0, 2, 1))
            assert same_view(c.args["out"], out[:, row]) and same_view(c.args["out_lse"], lse[:, row].T)
    else:
        (c,) = core.calls
        assert c.args["v"].shape == (splits, batch * seqlen, heads, dim)
        assert c.args["s"].shape == (splits, heads, batch * seqlen)
        assert c.args["out"].shape == (batch * seqlen, heads, dim)
        assert c.args["out_lse"].shape == (heads, batch * seqlen)
    want_v, want_s = fa_combine(f64(out_partial), f64(lse_partial))
    assert close(out, want_v) and close(lse, want_s)


def test_flash_attn_writes_the_given_out_and_may_skip_the_lse(core):
    out_partial = randn(3, 2, 4, 2, 8)
    lse_partial = randn(3, 2, 2, 4).transpose(-1, -2)
    lse_partial[1:, :1] = -float("inf")  # FA's test: empty splits for the first batch elements
    out = torch.full((2, 4, 2, 8), float("nan"), dtype=torch.float16)
    got, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, out, torch.float16, return_lse=False)
    assert got is out and lse is None
    want_v, _ = fa_combine(f64(out_partial), f64(lse_partial))
    assert close(out, want_v, 1e-2)


def test_flash_attn_accepts_and_ignores_the_batch_descriptions(core):
    out_partial = randn(2, 3, 4, 2, 8)
    lse_partial = randn(2, 3, 2, 4).transpose(-1, -2)
    index = torch.tensor([2, 0, 1], dtype=torch.int32)
    out, lse = flash_attn.flash_attn_combine(
        out_partial, lse_partial, seqused=index + 1, virtual_batch_idx=index
    )
    want_v, want_s = fa_combine(f64(out_partial), f64(lse_partial))
    assert close(out, want_v) and close(lse, want_s)



def test_flash_attn_takes_fa4_betas_older_name_for_the_batch_index(core):
    """FlashAttention 4 up to fa4-v4.0.0.beta24 (849f660f) called virtual_batch_idx varlen_batch_idx."""
    out_partial = randn(2, 3, 4, 2, 8)
    lse_partial = randn(2, 3, 2, 4).transpose(-1, -2)
    index = torch.tensor([2, 0, 1], dtype=torch.int32)
    out, lse = flash_attn.flash_attn_combine(out_partial, lse_partial, varlen_batch_idx=index)
    want_v, want_s = fa_combine(f64(out_partial), f64(lse_partial))
    assert close(out, want_v) and close(lse, want_s)
    with pytest.raises(ValueError, match=r"^varlen_batch_idx: expected shape \[batch_size\] = \(3,\)"):
        flash_attn.flash_attn_combine(out_partial, lse_partial, varlen_batch_idx=index[:2])
    with pytest.raises(TypeError, match="^varlen_batch_idx: FlashAttention 4's older name of virtual_batch_idx"):
        flash_attn.flash_attn_combine(out_partial, lse_partial, None, None, None, None, index, varlen_batch_idx=index)

# -- xFormers: the views the core gets -----------------------------------------------------------


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("batch, queries, calls", [(1, 9, 1), (4, 1, 1), (3, 5, 3), (6, 2, 2)])
def test_xformers_merges_folded_views_or_one_merge_per_batch_element(core, grouped, batch, queries, calls):
    """B and M fold into the core's tokens where the strides allow (B == 1 or M == 1), else one core
    merge per batch element or query position; G and H fold into its heads; nothing is copied."""
    chunks, groups, heads, dim = 3, 2, 5, 8
    attn = randn(chunks, batch, queries, groups, heads, dim, dtype=torch.bfloat16)
    lse = randn(chunks, batch, groups, heads, queries)
    if not grouped:
        attn, lse = attn[:, :, :, 0], lse[:, :, 0]
    out, out_lse = xformers.merge_attentions(attn, lse)
    assert len(core.calls) == calls and all(call.name == "merge_states" for call in core.calls)
    for call in core.calls:
        assert call.args["v"].untyped_storage().data_ptr() == attn.untyped_storage().data_ptr()
        assert call.args["s"].untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
    want_v, want_s = xf_merge_attentions(f64(attn), f64(lse))
    assert out.shape == attn.shape[1:] and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert out_lse.shape == lse.shape[1:] and out_lse.dtype == torch.float32 and out_lse.is_contiguous()
    assert close(out, want_v, 1e-2) and close(out_lse, want_s)


def test_xformers_merges_each_head_group_where_groups_and_heads_do_not_fold(core):
    attn = randn(2, 1, 4, 3, 3, 8).transpose(3, 4)  # heads outer to groups in memory: G and H do not fold
    lse = randn(2, 1, 3, 3, 4)
    out, out_lse = xformers.merge_attentions(attn, lse)
    assert len(core.calls) == 3
    want_v, want_s = xf_merge_attentions(f64(attn), f64(lse))
    assert close(out, want_v) and close(out_lse, want_s)


def test_xformers_reads_a_sequence_of_views_of_one_buffer_in_place_and_stacks_any_other(core):
    stacked_attn, stacked_lse = randn(3, 1, 6, 4, 8), randn(3, 1, 4, 6)
    want_v, want_s = xf_merge_attentions(f64(stacked_attn), f64(stacked_lse))
    out, out_lse = xformers.merge_attentions(list(stacked_attn.unbind(0)), list(stacked_lse.unbind(0)))
    assert core.calls[-1].args["v"].data_ptr() == stacked_attn.data_ptr()  # read in place
    assert close(out, want_v) and close(out_lse, want_s)
    one_attn, one_lse = stacked_attn[1], stacked_lse[1]  # the same chunk twice: xFormers' own test
    out, out_lse = xformers.merge_attentions([one_attn, one_attn], [one_lse, one_lse], write_lse=True)
    assert core.calls[-1].args["v"].stride()[0] == 0 and core.calls[-1].args["v"].data_ptr() == one_attn.data_ptr()
    assert close(out, f64(one_attn)) and close(out_lse, f64(one_lse) + math.log(2))
    apart = [randn(1, 6, 4, 8) for _ in range(3)]  # separate allocations: stacked, a copy
    lses = [randn(1, 4, 6) for _ in range(3)]
    out, out_lse = xformers.merge_attentions(apart, tuple(lses))
    assert all(core.calls[-1].args["v"].data_ptr() != a.data_ptr() for a in apart)
    want_v, want_s = xf_merge_attentions(np.stack([f64(a) for a in apart]), np.stack([f64(x) for x in lses]))
    assert close(out, want_v) and close(out_lse, want_s)


def test_xformers_sequences_it_must_not_read_in_place_are_stacked_or_refused(core):
    """From a review: a chunk with its own smaller storage at the buffer's address (a DLPack import),
    a negated view (same memory, read negated), sliding windows and reversed orders are merged right;
    a later chunk that requires grad is refused by its name though the view would be of the first."""
    buf, lse = randn(2, 1, 7, 2, 8), randn(2, 1, 2, 7)
    want_v, want_s = xf_merge_attentions(f64(buf), f64(lse))
    out, out_lse = xformers.merge_attentions([torch.from_dlpack(buf[0]), buf[1]], list(lse))
    assert close(out, want_v) and close(out_lse, want_s)
    one, lses = buf[0], [lse[0], lse[1]]
    out, _ = xformers.merge_attentions([one, torch._neg_view(one)], lses)
    assert close(out, xf_merge_attentions(np.stack([f64(one), -f64(one)]), np.stack([f64(x) for x in lses]))[0])
    flat = randn(1, 9, 2, 8)
    windows, window_lses = [flat[:, i : i + 5] for i in range(3)], [randn(1, 2, 5) for _ in range(3)]
    out, _ = xformers.merge_attentions(windows[::-1], window_lses)
    want = xf_merge_attentions(np.stack([f64(c) for c in windows[::-1]]), np.stack([f64(x) for x in window_lses]))
    assert close(out, want[0])
    grad = randn(2, 1, 7, 2, 8).requires_grad_()
    with pytest.raises(RuntimeError, match=r"^attn_split\[1\]: requires grad"):
        xformers.merge_attentions([grad.detach()[0], grad[1]], list(lse))
    chunks, chunk_lses = randn(3, 1, 5, 2, 8), randn(3, 1, 2, 5)
    square = randn(2, 1, 4, 4, 8)  # M == H: another stride order of the same shape
    for attn, lses in (
        ([chunks[i] for i in (0, 2, 1)], [chunk_lses[i] for i in (0, 2, 1)]),  # not at equal distances
        ([torch.from_dlpack(chunk) for chunk in chunks], list(chunk_lses)),  # equal distances, own storages
        ([square[0], square[1].transpose(1, 2)], [randn(1, 4, 4), randn(1, 4, 4)]),  # other strides
    ):
        out, out_lse = xformers.merge_attentions(attn, lses)
        want_v, want_s = xf_merge_attentions(np.stack([f64(a) for a in attn]), np.stack([f64(x) for x in lses]))
        assert close(out, want_v) and close(out_lse, want_s)


def test_xformers_output_dtype_write_lse_and_the_lses_dtype(core):
    attn, lse = randn(2, 1, 3, 2, 8), randn(2, 1, 2, 3)
    out, out_lse = xformers.merge_attentions(attn, lse, write_lse=False, output_dtype=torch.float16)
    assert out.dtype == torch.float16 and out_lse is None
    out, out_lse = xformers.merge_attentions(attn, lse.bfloat16(), output_dtype="bfloat16")
    assert out.dtype == torch.bfloat16 and out_lse.dtype == torch.bfloat16  # xFormers: lse_split's dtype
    want_v, want_s = xf_merge_attentions(f64(attn), f64(lse.bfloat16()))
    assert close(out, want_v, 1e-2) and close(out_lse, want_s, 1e-2)


# -- argument checks in the peers' words (before the core is reached) -------------------------------


def _fi_state(tokens=7, heads=2, dim=16, dtype=torch.float16):
    return randn(tokens, heads, dim, dtype=dtype), randn(tokens, heads)


def _bad_calls():
    v, s = _fi_state()
    v32 = v.float()
    strided = randn(7, 2, 32, dtype=torch.float16)[..., ::2]
    fa_v, fa_s = randn(3, 2, 5, 4, 8), randn(3, 2, 4, 5).transpose(-1, -2)
    fa_varlen_v, fa_varlen_s = randn(3, 9, 4, 8), randn(3, 4, 9).transpose(-1, -2)
    xf_v, xf_s = randn(3, 1, 5, 2, 4, 8), randn(3, 1, 2, 4, 5)
    i32 = torch.int32
    return [
        # FlashInfer
        (lambda: flashinfer.merge_state(v[0], s, v, s), ValueError,
         r"v_a: expected a 3-D array \[seq_len, num_heads, head_dim\] \(FlashInfer's layout\), got shape \(2, 16\)"),
        (lambda: flashinfer.merge_state(v.int(), s, v, s), TypeError,
         r"v_a: expected dtype float32, float16 or bfloat16, got int32"),
        (lambda: flashinfer.merge_state(strided, s, strided, s), ValueError,
         r"v_a: expected its last dimension of \[seq_len, num_heads, head_dim\] to be contiguous"),
        (lambda: flashinfer.merge_state(v, s, v[:6], s), ValueError, r"v_b: expected the shape of v_a, \(7, 2, 16\)"),
        (lambda: flashinfer.merge_state(v, s, v32, s), TypeError, r"v_b: expected the dtype of v_a, float16, got float32"),
        (lambda: flashinfer.merge_state(v, s.T, v, s), ValueError,
         (r"s_a: expected shape \[seq_len, num_heads\] = \(7, 2\) from v_a \(FlashInfer's token-major, base-2 LSE\), "
          r"got \(2, 7\); that is cupy_merge's \[num_heads, num_tokens\] layout")),
        (lambda: flashinfer.merge_state(v, s, v, s[:, 0]), ValueError,
         r"s_b: expected a 2-D array \[seq_len, num_heads\] \(FlashInfer's token-major, base-2 LSE\)"),
        (lambda: flashinfer.merge_state(v, s.int(), v, s), TypeError,
         r"s_a: expected dtype float32 \(FlashInfer's token-major, base-2 LSE\), or float16, bfloat16 or float64"),
        (lambda: flashinfer.merge_state(v.numpy(), s, v, s), TypeError, r"v_a: expected an array in GPU memory"),
        (lambda: flashinfer.merge_state(v, None, v, s), TypeError, r"^s_a: expected a CuPy array, a torch CUDA tensor"),
        (lambda: flashinfer.merge_state_in_place(v, s, None, s), TypeError, r"^v_other: expected a CuPy array"),
        (lambda: sglang.merge_state_v2(v, s, v, None), TypeError, r"^s_b: expected a CuPy array"),
        (lambda: flashinfer.merge_state_in_place(v, s.half(), v, s), TypeError,
         r"s: expected dtype float32 .*lose the update"),
        (lambda: flashinfer.merge_state_in_place(v, s, v, s, torch.ones(7, dtype=torch.int32)), TypeError,
         r"mask: expected dtype bool, uint8 or int8 \[seq_len\].*got int32.*bytes one by one: pass mask != 0"),
        (lambda: flashinfer.merge_state_in_place(v, s, v, s, torch.ones(6, dtype=torch.bool)), ValueError,
         r"mask: expected shape \[seq_len\] = \(7,\) from v"),
        (lambda: flashinfer.merge_state_in_place(v, s, v, s.T), ValueError,
         r"s_other: expected shape \[seq_len, num_heads\] = \(7, 2\) from v"),
        (lambda: flashinfer.merge_states(v, s), ValueError,
         r"v: expected a 4-D array \[seq_len, num_states, num_heads, head_dim\] \(FlashInfer's layout\)"),
        (lambda: flashinfer.merge_states(randn(7, 3, 2, 8), randn(3, 2, 7)), ValueError,
         r"s: expected shape \[seq_len, num_states, num_heads\] = \(7, 3, 2\) from v"),
        (lambda: flashinfer.variable_length_merge_states(v, s, torch.tensor([0.0, 7.0])), TypeError,
         r"indptr: expected dtype int32, int64.*got float32"),
        (lambda: flashinfer.variable_length_merge_states(v, s, torch.zeros(2, 2, dtype=i32)), ValueError,
         r"indptr: expected a 1-D array \[seq_len \+ 1\]"),
        (lambda: flashinfer.variable_length_merge_states(v, s, torch.zeros(0, dtype=i32)), ValueError,
         r"indptr: expected \[seq_len \+ 1\] offsets"),
        (lambda: flashinfer.variable_length_merge_states(v, s[:5], torch.zeros(2, dtype=i32)), ValueError,
         r"s: expected shape \[total_num_states, num_heads\] = \(7, 2\) from v"),
        (lambda: flashinfer.variable_length_merge_states(v, s, torch.zeros(2, dtype=i32), check_indptr=1), TypeError,
         r"check_indptr: expected True or False"),
        # SGLang
        (lambda: sglang.merge_state_v2(v, s.T, v, s), ValueError,
         r"s_a: expected shape \[seq_len, num_heads\] = \(7, 2\) from v_a \(SGLang's token-major LSE, natural log\)"),
        (lambda: sglang.merge_state_v2(v, s, v, s, v[:, :1]), ValueError,
         r"v_merged: expected shape \[seq_len, num_heads, head_dim\] = \(7, 2, 16\) from v_a"),
        (lambda: sglang.merge_state_v2(v, s, v, s, v.int()), TypeError, r"v_merged: expected dtype float32"),
        (lambda: sglang.merge_state_v2(v, s, v, s, None, s.half()), TypeError, r"s_merged: expected dtype float32"),
        (lambda: sglang.merge_state_v2(v, s, v, s, None, s.T), ValueError,
         r"s_merged: expected shape \[seq_len, num_heads\] = \(7, 2\) from v_a"),
        (lambda: sglang.merge_state_v2(v, s, v, s, enable_pdl="yes"), TypeError,
         r"enable_pdl: expected None, True or False"),
        (lambda: sglang.merge_state_v2(v, s, v32, s), TypeError, r"v_b: expected the dtype of v_a"),
        # FlashAttention
        (lambda: flash_attn.flash_attn_combine(v, s), ValueError,
         (r"out_partial: expected a 5-D array \[num_splits, batch_size, seqlen, num_heads, head_size\] \(batched\) "
          r"or a 4-D array \[num_splits, total_q, num_heads, head_size\] \(varlen\), got shape \(7, 2, 16\)")),
        (lambda: flash_attn.flash_attn_combine(fa_v.double(), fa_s), TypeError,
         r"out_partial: expected dtype float32, float16 or bfloat16, got float64"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s.transpose(-1, -2)), ValueError,
         (r"lse_partial: expected shape \[num_splits, batch_size, seqlen, num_heads\] = \(3, 2, 5, 4\) from "
          r"out_partial \(FlashAttention's natural-log LSE, split-major\), got \(3, 2, 4, 5\); FlashAttention's "
          r"lse_partial has num_heads last")),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s.half()), TypeError,
         r"lse_partial: expected dtype float32 \(FlashAttention's natural-log LSE, split-major\), got float16"),
        (lambda: flash_attn.flash_attn_combine(fa_varlen_v, fa_varlen_s[:, :8]), ValueError,
         r"lse_partial: expected shape \[num_splits, total_q, num_heads\] = \(3, 9, 4\)"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, randn(2, 5, 4, 4)), ValueError,
         r"out: expected shape \[batch_size, seqlen, num_heads, head_size\] = \(2, 5, 4, 8\) from out_partial"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, randn(2, 5, 4, 8).int()), TypeError,
         r"out: expected dtype float32, float16 or bfloat16, got int32"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, None, torch.int8), TypeError,
         r"out_dtype: expected float32, float16 or bfloat16, got torch.int8"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, randn(2, 5, 4, 8), torch.float16), TypeError,
         r"out_dtype: expected None or out's dtype float32 when out is given"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, cu_seqlens=torch.tensor([0, 5], dtype=i32)), ValueError,
         r"cu_seqlens: given with a 5-D out_partial"),
        (lambda: flash_attn.flash_attn_combine(fa_varlen_v, fa_varlen_s, cu_seqlens=torch.tensor([0, 9])), TypeError,
         r"cu_seqlens: expected dtype int32, got int64"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, seqused=torch.tensor([5, 5, 5], dtype=i32)), ValueError,
         r"seqused: expected shape \[batch_size\] = \(2,\) from out_partial"),
        (lambda: flash_attn.flash_attn_combine(fa_varlen_v, fa_varlen_s, seqused=torch.tensor([9], dtype=i32)),
         ValueError, r"seqused: given with a 4-D \(varlen\) out_partial but no cu_seqlens"),
        (lambda: flash_attn.flash_attn_combine(fa_varlen_v, fa_varlen_s, cu_seqlens=torch.tensor([0, 4, 9], dtype=i32),
                                               virtual_batch_idx=torch.tensor([0], dtype=i32)),
         ValueError, r"virtual_batch_idx: expected shape \[batch_size\] = \(2,\) from cu_seqlens"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, return_lse=None), TypeError,
         r"return_lse: expected True or False"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, num_splits_dynamic_ptr=torch.tensor([1, 2], dtype=i32)),
         NotImplementedError, r"num_splits_dynamic_ptr: per-batch split counts on the device are not supported"),
        (lambda: flash_attn.flash_attn_combine(fa_v, fa_s, semaphore_to_reset=torch.zeros(1, dtype=i32)),
         NotImplementedError, r"semaphore_to_reset: "),
        # xFormers
        (lambda: xformers.merge_attentions(v, s), ValueError,
         r"attn_split: expected a 6-D array \[num_chunks, B, M, G, H, Kq\] or a 5-D array .*got shape \(7, 2, 16\)"),
        (lambda: xformers.merge_attentions(xf_v, xf_s[:, :, 0]), ValueError,
         r"lse_split: expected a 5-D array \[num_chunks, B, \(G,\) H, M\]"),
        (lambda: xformers.merge_attentions(xf_v, xf_s.transpose(-1, -2)), ValueError,
         r"lse_split: expected shape \[num_chunks, B, \(G,\) H, M\] = \(3, 1, 2, 4, 5\) from attn_split"),
        (lambda: xformers.merge_attentions(xf_v.int(), xf_s), TypeError,
         r"attn_split: expected dtype float32, float16 or bfloat16, got int32"),
        (lambda: xformers.merge_attentions(xf_v, xf_s.int()), TypeError, r"lse_split: expected dtype float32"),
        (lambda: xformers.merge_attentions([], []), ValueError,
         r"attn_split: expected at least one chunk \[B, M, \(G,\) H, Kq\], got an empty sequence"),
        (lambda: xformers.merge_attentions([xf_v[0], xf_v[1, :, :4]], list(xf_s)), ValueError,
         r"attn_split\[1\]: expected the shape of attn_split\[0\], \(1, 5, 2, 4, 8\), got \(1, 4, 2, 4, 8\)"),
        (lambda: xformers.merge_attentions([xf_v[0], xf_v[1].half()], list(xf_s)), TypeError,
         r"attn_split\[1\]: expected the dtype of attn_split\[0\], float32, got float16"),
        (lambda: xformers.merge_attentions(list(xf_v), [xf_s[0], None]), TypeError,
         r"^lse_split\[1\]: expected a CuPy array, a torch CUDA tensor"),
        (lambda: xformers.merge_attentions(xf_v, xf_s, write_lse=None), TypeError, r"write_lse: expected True or False"),
        (lambda: xformers.merge_attentions(xf_v, xf_s, output_dtype=torch.int8), TypeError,
         r"output_dtype: expected float32, float16 or bfloat16, got torch.int8"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_are_refused_in_the_peers_words_before_the_core_is_reached(core, index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()
    assert core.calls == []


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: flash_attn.flash_attn_combine(t(3, 2, 4, 2, 8), t(3, 2, 4, 2)), "out_partial"),
        (lambda t: sglang.merge_state_v2(t(4, 2, 8), t(4, 2), t(4, 2, 8), t(4, 2)), "v_a"),
        (lambda t: flashinfer.merge_states(t(4, 3, 2, 8), t(4, 3, 2)), "v"),
        (lambda t: xformers.merge_attentions([t(1, 4, 2, 8)], [t(1, 2, 4)]), r"attn_split\[0\]"),
    ],
)
def test_host_tensors_are_refused_in_the_peers_words(call, message):
    with pytest.raises(
        TypeError, match=rf"^{message}: expected a torch tensor on a CUDA device, got one on cpu"
    ):
        call(randn)


def test_jax_arrays_are_refused_with_a_way_out(core):
    jnp = pytest.importorskip("jax.numpy")
    v = jnp.zeros((4, 2, 8), dtype=jnp.float16)
    s = jnp.zeros((4, 2), dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"v_a: expected a torch tensor or a CuPy array, got a JAX array"):
        flashinfer.merge_state(v, s, v, s)
    assert core.calls == []


# -- documentation -----------------------------------------------------------------------------------

COMPAT_FUNCTIONS = [
    "cupy_merge.compat.flashinfer.merge_state",
    "cupy_merge.compat.flashinfer.merge_state_in_place",
    "cupy_merge.compat.flashinfer.merge_states",
    "cupy_merge.compat.flashinfer.variable_length_merge_states",
    "cupy_merge.compat.sglang.merge_state_v2",
    "cupy_merge.compat.flash_attn.flash_attn_combine",
]


@pytest.mark.parametrize("name", COMPAT_FUNCTIONS)
def test_every_compat_function_has_a_valid_numpydoc_docstring_naming_its_peer(name):
    validate = pytest.importorskip("numpydoc.validate").validate
    result = validate(name)
    errors = [(code, text) for code, text in result["errors"] if code not in {"ES01", "SA01"}]
    assert errors == []
    doc = result["docstring"]
    assert "Examples" in doc and "doctest: +SKIP" in doc
    peer = name.split(".")[2]
    assert {"flashinfer": "FlashInfer", "sglang": "SGLang", "flash_attn": "FlashAttention"}[peer] in doc


# -- the peers' signatures ---------------------------------------------------------------------------

_REQUIRED = inspect.Parameter.empty

# Each peer's parameters, in order, with their defaults, as read in its source (the drop-in may add
# keyword-only parameters of its own, never positional ones):
PEER_SIGNATURES = {
    # Dao-AILab/flash-attention flash_attn/cute/interface.py, flash_attn_combine, at 0251105a2fb1
    # (main, 2026-08-15, = tag fa4-v4.0.0.beta27); its first four are FA3's (hopper/flash_attn_interface.py).
    flash_attn.flash_attn_combine: [
        ("out_partial", _REQUIRED), ("lse_partial", _REQUIRED), ("out", None), ("out_dtype", None),
        ("cu_seqlens", None), ("seqused", None), ("virtual_batch_idx", None), ("return_lse", True),
    ],
    # flashinfer-ai/flashinfer flashinfer/cascade.py at fb28d7242b35 (main, 2026-08-22).
    flashinfer.merge_state: [("v_a", _REQUIRED), ("s_a", _REQUIRED), ("v_b", _REQUIRED), ("s_b", _REQUIRED)],
    flashinfer.merge_state_in_place: [
        ("v", _REQUIRED), ("s", _REQUIRED), ("v_other", _REQUIRED), ("s_other", _REQUIRED), ("mask", None),
    ],
    flashinfer.merge_states: [("v", _REQUIRED), ("s", _REQUIRED)],
    # flashinfer/triton/cascade.py at the same commit (the only variable_length_merge_states).
    flashinfer.variable_length_merge_states: [("v", _REQUIRED), ("s", _REQUIRED), ("indptr", _REQUIRED)],
    # sgl-project/sglang sgl-kernel/python/sgl_kernel/attention.py, merge_state_v2, in every stored
    # version that defines it (as also sglang.srt.layers.attention.merge_state calls it, c3855c54e27b).
    sglang.merge_state_v2: [
        ("v_a", _REQUIRED), ("s_a", _REQUIRED), ("v_b", _REQUIRED), ("s_b", _REQUIRED),
        ("v_merged", None), ("s_merged", None),
    ],
    # sgl-project/sglang python/sglang/srt/layers/attention/merge_state.py at 1f739321.
    sglang.merge_state: [
        ("prefix_output", _REQUIRED), ("prefix_lse", _REQUIRED), ("suffix_output", _REQUIRED),
        ("suffix_lse", _REQUIRED), ("output", None), ("output_lse", None),
    ],
    # facebookresearch/xformers xformers/ops/fmha/__init__.py, merge_attentions, at bed3978b (the last
    # version before it re-exports mslk's).
    xformers.merge_attentions: [
        ("attn_split", _REQUIRED), ("lse_split", _REQUIRED), ("write_lse", True), ("output_dtype", None),
    ],
    # vllm-project/vllm vllm/v1/attention/ops/merge_attn_states.py at 15a3fd47 (up to output_scale) and
    # its Triton kernel's group-scale arguments: the core's own merge_attn_states is vLLM's.
    cm.merge_attn_states: [
        ("output", _REQUIRED), ("prefix_output", _REQUIRED), ("prefix_lse", _REQUIRED),
        ("suffix_output", _REQUIRED), ("suffix_lse", _REQUIRED), ("output_lse", None),
        ("prefill_tokens_with_context", None), ("output_scale", None), ("output_block_scale", None),
        ("quant_group_size", None), ("quant_scale_ue8m0", False),
    ],
}  # fmt: skip


def test_vllms_merge_is_named_beside_the_other_peers_and_is_the_core_merge():
    from cupy_merge.compat import vllm

    assert vllm.merge_attn_states is cm.merge_attn_states and compat.vllm is vllm


@pytest.mark.parametrize("function", PEER_SIGNATURES, ids=lambda function: function.__qualname__)
def test_every_drop_in_takes_its_peers_parameters_names_positions_and_defaults(function):
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == PEER_SIGNATURES[function]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in positional)


# -- under torch.compile -----------------------------------------------------------------------------


def _captured(function, *args):
    """``function`` compiled with ``fullgraph=True``: the ops its graph calls, and its result."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    result = torch.compile(function, backend=backend, fullgraph=True)(*args)
    return [str(n.target) for graph in graphs for n in graph.graph.nodes if n.op == "call_function"], result


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_drop_in_compiles_whole_the_first_time_its_dtype_is_met(dtype, monkeypatch):
    """Dtype names met first while Dynamo traces were cached into a dict it guards on, and the
    compilation failed ("Guard failed on the same frame it was created")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupy_merge import _arrays, torch_ops

    torch_ops.ops()
    monkeypatch.setattr(_arrays, "_DTYPE_NAMES", {})  # as in a fresh process
    with FakeTensorMode():
        v = torch.empty(7, 3, 16, device="cuda", dtype=dtype)
        s = torch.empty(7, 3, device="cuda")
        targets, (merged_v, merged_s) = _captured(flashinfer.merge_state, v, s, v, s)
        assert "cupy_merge.merge_state_out.default" in targets
        assert merged_v.shape == (7, 3, 16) and merged_v.dtype == dtype and merged_s.shape == (7, 3)
        assert merged_s.stride() == (3, 1)  # FlashInfer's C-contiguous [seq_len, num_heads]


@pytest.mark.parametrize("as_list", [False, True])
def test_xformers_compiles_whole_stacked_or_a_sequence_of_chunks(as_list):
    """A sequence of chunks is looked at by address to read it in place; a traced tensor has none,
    so under torch.compile it is stacked (no graph break)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupy_merge import torch_ops

    torch_ops.ops()
    with FakeTensorMode():
        attn = torch.empty(3, 1, 5, 4, 16, device="cuda", dtype=torch.bfloat16)  # B == 1: one merge
        lse = torch.empty(3, 1, 4, 5, device="cuda")
        args = (list(attn.unbind(0)), list(lse.unbind(0))) if as_list else (attn, lse)
        targets, (out, out_lse) = _captured(lambda a, s: xformers.merge_attentions(a, s), *args)
        assert "cupy_merge.merge_states_out.default" in targets
        assert out.shape == (1, 5, 4, 16) and out.dtype == torch.bfloat16 and out_lse.shape == (1, 4, 5)


def test_fold_compiles_whole_at_a_storage_offset():
    """compat.fold asked for the tensor's storage offset, which Dynamo cannot put in a graph."""
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    view = base[1:]  # at a storage offset
    _, folded = _captured(lambda x: compat.fold(x, 1) * 1, view)  # fullgraph: no break
    assert torch.equal(folded, view.reshape(3 * 4, 5).unsqueeze(0))


@pytest.mark.parametrize(
    "call, name, core_merge",
    [
        (lambda r: flashinfer.merge_state(r(7, 2, 8), r(7, 2, grad=False), r(7, 2, 8, grad=False), r(7, 2)), "v_a",
         "merge_state"),
        (lambda r: flashinfer.merge_state_in_place(r(7, 2, 8, grad=False), r(7, 2, grad=False), r(7, 2, 8, grad=False),
                                                   r(7, 2)), "s_other", "merge_state"),
        (lambda r: flashinfer.merge_states(r(7, 3, 2, 8, grad=False), r(7, 3, 2)), "s", "merge_states"),
        (lambda r: flashinfer.variable_length_merge_states(r(7, 2, 8), r(7, 2), torch.tensor([0, 3, 7], dtype=torch.int32)),
         "v", "merge_states_varlen"),
        (lambda r: sglang.merge_state_v2(r(7, 2, 8, grad=False), r(7, 2, grad=False), r(7, 2, 8), r(7, 2, grad=False)),
         "v_b", "merge_state"),
        (lambda r: flash_attn.flash_attn_combine(r(3, 7, 2, 8, grad=False), r(3, 7, 2)), "lse_partial", "merge_states"),
        (lambda r: xformers.merge_attentions([r(1, 7, 2, 8), r(1, 7, 2, 8, grad=False)], [r(1, 2, 7, grad=False)] * 2),
         r"attn_split\[0\]", "merge_states"),
        (lambda r: xformers.merge_attentions(r(2, 1, 7, 2, 8, grad=False), r(2, 1, 2, 7)), "lse_split", "merge_states"),
    ],
)  # fmt: skip
def test_a_drop_in_refuses_an_input_that_requires_grad_by_its_name(core, call, name, core_merge):
    """The drop-ins are not differentiable (nor are the peers' kernels); the refusal names the
    caller's argument and the core merge that is, not the out= the drop-in passes inside."""

    def r(*shape, grad=True):
        return randn(*shape).requires_grad_(grad)

    message = rf"^{name}: requires grad, and the drop-ins are not differentiable.*cupy_merge\.{core_merge} in the core"
    with pytest.raises(RuntimeError, match=message):
        call(r)
    assert core.calls == []
    with torch.no_grad():
        call(r)
    assert len(core.calls) == 1


def test_code_dynamo_traces_calls_no_locals():
    """Dynamo before torch 2.13 (the GPU machine's 2.11) cannot trace ``locals()``: every drop-in's
    body passed it to its declaration, and torch.compile(fullgraph=True) of them failed there
    (CI runs torch 2.13, which traces it)."""
    import ast
    import pathlib

    import cupy_merge

    package = pathlib.Path(cupy_merge.__file__).parent
    traced = [*package.glob("compat/*.py"), *(package / name for name in ("merge.py", "merge_many.py", "backward.py",
                                                                        "torch_ops.py", "_dispatch.py", "_options.py"))]  # fmt: skip
    calls = [f"{path.name}:{node.lineno}" for path in traced for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("locals", "id")]  # fmt: skip
    assert not calls, calls
