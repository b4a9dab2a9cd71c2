"""FlashAttention's ``flash_attn_combine`` with FlashAttention's layouts: split-major, natural-log LSE.

The signature is FlashAttention 4's (``flash_attn.cute.interface.flash_attn_combine``), whose
first four arguments are FlashAttention 3's (``hopper/flash_attn_interface.py``).

=======================  ================================================  ===================================
argument                 FlashAttention's layout                           the core's (what is passed to it)
=======================  ================================================  ===================================
``out_partial`` batched  ``[num_splits, batch_size, seqlen, nheads, d]``   per batch element ``[:, b]``, or
                                                                           folded ``[num_splits, B * L, ...]``
``lse_partial`` batched  ``[num_splits, batch_size, seqlen, nheads]``      ``[:, b].permute(0, 2, 1)``
``out_partial`` varlen   ``[num_splits, total_q, nheads, d]``              the same
``lse_partial`` varlen   ``[num_splits, total_q, nheads]``                 ``.permute(0, 2, 1)``
returned ``lse``         ``[batch_size, seqlen, nheads]``, strides         ``empty(B, H, L)[b]``
                         ``(nheads * seqlen, 1, seqlen)``
returned ``lse`` varlen  ``[total_q, nheads]``, strides ``(1, total_q)``   ``empty(H, total_q)``
=======================  ================================================  ===================================

Accepted beyond FlashAttention: any head size (FA4: multiples of 8; FA3 pads sizes that are not
multiples of 4 and then leaves the caller's ``out`` unwritten), any number of splits up to
65,536 (FA: 256), float16 and bfloat16 partials (FA3: float32 only), any strides with a
contiguous last dimension (FA: the LSE's seqlen dimension contiguous), the varlen layout without
``cu_seqlens``, one split (FA3 writes nothing then), torch tensors and CuPy arrays, a
keyword-only ``stream=``.
"""

from __future__ import annotations

from typing import Any

import cupy_merge as _cm

from .._options import value_dtype_name
from ..types import Array, Stream
from . import (
    VALUE_DTYPES,
    dims,
    dtype_of,
    empty,
    expect_dtype,
    expect_flag,
    expect_ndim,
    expect_shape,
    expect_unit_last_stride,
    expect_values,
    index_array,
    lse_input,
    merge_batched,
    permute,
    refuse_grad,
    shape_of,
    take,
)

BATCHED = "[num_splits, batch_size, seqlen, num_heads, head_size]"
VARLEN = "[num_splits, total_q, num_heads, head_size]"
BATCHED_LSE = "[num_splits, batch_size, seqlen, num_heads]"
VARLEN_LSE = "[num_splits, total_q, num_heads]"
BATCHED_OUT = "[batch_size, seqlen, num_heads, head_size]"
VARLEN_OUT = "[total_q, num_heads, head_size]"
CONVENTION = "FlashAttention's split-major partials"
LSE_CONVENTION = "FlashAttention's natural-log LSE, split-major"
SWAPPED = (
    "FlashAttention's lse_partial has num_heads last: pass the [..., num_heads, seqlen] buffer as "
    "buffer.transpose(-1, -2), a view"
)


def flash_attn_combine(
    out_partial: Array,
    lse_partial: Array,
    out: Array | None = None,
    out_dtype: Any = None,
    cu_seqlens: Array | None = None,
    seqused: Array | None = None,
    virtual_batch_idx: Array | None = None,
    return_lse: bool = True,
    *,
    varlen_batch_idx: Array | None = None,
    num_splits_dynamic_ptr: Array | None = None,
    semaphore_to_reset: Array | None = None,
    stream: Stream = None,
) -> tuple[Array, Array | None]:
    """Combine split-KV partial attention outputs (FlashAttention's ``flash_attn_combine``).

    ``lse = log(sum_i exp(lse_partial[i]))``, ``out = sum_i exp(lse_partial[i] - lse) * out_partial[i]``
    over the splits ``i`` (the first axis), per token and head.

    Parameters
    ----------
    out_partial : torch.Tensor or cupy.ndarray
        ``[num_splits, batch_size, seqlen, num_heads, head_size]`` (batched) or
        ``[num_splits, total_q, num_heads, head_size]`` (varlen); float32, float16 or bfloat16;
        any strides with a contiguous last dimension.
    lse_partial : torch.Tensor or cupy.ndarray
        ``[num_splits, batch_size, seqlen, num_heads]`` or ``[num_splits, total_q, num_heads]``,
        float32, natural log; any strides (FlashAttention's usual one is a
        ``.transpose(-1, -2)`` view of ``[..., num_heads, seqlen]`` storage). A split whose LSE is
        ``-inf`` contributes nothing, even if its values are NaN.
    out : torch.Tensor or cupy.ndarray, optional
        ``[batch_size, seqlen, num_heads, head_size]`` or ``[total_q, num_heads, head_size]``,
        float32, float16 or bfloat16, written; allocated (C-contiguous, as FlashAttention) if
        omitted. Must not overlap the inputs.
    out_dtype : torch.dtype or str, optional
        Dtype of an allocated ``out``; ``out_partial``'s by default. With ``out`` it must be
        ``out``'s dtype (FlashAttention 4 ignores it then).
    cu_seqlens : torch.Tensor or cupy.ndarray, optional
        Int32 ``[batch_size + 1]``, varlen only. Accepted, not read: the combine is per token, so
        the sequence boundaries do not change it.
    seqused : torch.Tensor or cupy.ndarray, optional
        Int32 ``[batch_size]``. Accepted, not read: every row is combined, those past
        ``seqused[b]`` too (FlashAttention leaves them unwritten; its tests call them undefined).
    virtual_batch_idx : torch.Tensor or cupy.ndarray, optional
        Int32 ``[batch_size]``, a permutation of the batch slots. Accepted, not read: FlashAttention
        reads and writes through it, so the result is the combine of every batch element.
    return_lse : bool
        Whether to return the combined LSE (it is computed either way).
    varlen_batch_idx : torch.Tensor or cupy.ndarray, optional
        ``virtual_batch_idx`` by the name FlashAttention 4 gave it up to ``fa4-v4.0.0.beta24``
        (keyword only, as those callers pass it; it stood where ``virtual_batch_idx`` stands):
        checked and ignored alike. Giving both is a ``TypeError``.
    num_splits_dynamic_ptr : torch.Tensor or cupy.ndarray, optional
        FlashAttention 4's private per-batch split counts (``_flash_attn_fwd_combine``): refused
        with ``NotImplementedError`` (honouring them would read the device array on the host).
        Pass ``lse_partial`` with ``-inf`` for the splits past each count instead.
    semaphore_to_reset : torch.Tensor or cupy.ndarray, optional
        FlashAttention 4's private semaphore, zeroed by its last block: refused with
        ``NotImplementedError`` (cupy-merge launches no extra kernel); zero it yourself.
    stream : Stream, optional
        Where to launch (cupy-merge's extension; by default the current stream of the arrays' kind).

    Returns
    -------
    out : torch.Tensor or cupy.ndarray
        The combined values: the given ``out``, or a new ``[batch_size, seqlen, num_heads,
        head_size]`` / ``[total_q, num_heads, head_size]`` array.
    lse : torch.Tensor or cupy.ndarray or None
        Float32 ``[batch_size, seqlen, num_heads]`` with strides ``(num_heads * seqlen, 1, seqlen)``
        (the transpose of a C-contiguous ``[batch_size, num_heads, seqlen]``), or ``[total_q,
        num_heads]`` with strides ``(1, total_q)``, as FlashAttention returns it; None if
        ``return_lse`` is False. A token whose splits are all ``-inf`` gets 0 and ``-inf``.

    Raises
    ------
    TypeError
        A dtype or array kind FlashAttention's layout does not allow; the message names the argument.
    ValueError
        A shape that is not FlashAttention's layout; the message names the argument and the layout.
    NotImplementedError
        ``num_splits_dynamic_ptr`` or ``semaphore_to_reset`` given.

    Warnings
    --------
    ``lse_partial`` ends in ``[..., seqlen, num_heads]``, whatever the extents: with
    ``seqlen == num_heads`` a buffer passed without its ``.transpose(-1, -2)`` cannot be told
    apart by its shape.

    See Also
    --------
    cupy_merge.merge_states : The core merge, with ``lse_partial.permute(0, 2, 1)``.

    Notes
    -----
    Varlen: one call of ``cupy_merge.merge_states(out_partial, lse_partial.permute(0, 2, 1),
    out=out, out_lse=lse_store)`` with ``lse_store = empty(num_heads, total_q)``; the returned
    ``lse`` is ``lse_store.T``.

    Batched: the core merge has one token axis with one stride, and FlashAttention's layouts do
    not fold ``batch_size`` and ``seqlen`` into one without a copy (the LSE's seqlen dimension is
    contiguous, its batch stride spans the heads too). Where every array's strides allow it
    (``seqlen == 1``, the decode case; ``batch_size == 1``; one head) it is **one** core merge on
    folded views; otherwise **one core merge per batch element** (``out_partial[:, b]`` into
    ``out[b]``), or per row position where ``seqlen < batch_size`` (``out_partial[:, :, l]`` into
    ``out[:, l]``): views, no copy, ``min(batch_size, seqlen)`` launches of ``B * L / min(B, L)``
    tokens each. Hot loops may ``cupy_merge.bind`` the core merges instead.

    Tokens whose splits are all ``-inf`` give 0 and ``-inf``, as FlashAttention; ``+inf`` is read
    as ``-inf`` (FlashAttention: 0 and NaN).

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat.flash_attn import flash_attn_combine
    >>> out_partial = torch.randn(5, 2, 113, 16, 128, device="cuda")               # doctest: +SKIP
    >>> lse_partial = torch.randn(5, 2, 16, 113, device="cuda").transpose(-1, -2)  # doctest: +SKIP
    >>> out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)  # doctest: +SKIP
    >>> out.shape, out.dtype, lse.shape, lse.stride()                              # doctest: +SKIP
    (torch.Size([2, 113, 16, 128]), torch.bfloat16, torch.Size([2, 113, 16]), (1808, 1, 113))
    """
    if num_splits_dynamic_ptr is not None:
        raise NotImplementedError(
            "num_splits_dynamic_ptr: per-batch split counts on the device are not supported (they would be "
            "read on the host); set lse_partial to -inf for the splits past each batch element's count"
        )
    if semaphore_to_reset is not None:
        raise NotImplementedError(
            "semaphore_to_reset: cupy-merge launches no extra kernel to zero it; zero it yourself after the call"
        )
    batch_index = (virtual_batch_idx, "virtual_batch_idx")
    if varlen_batch_idx is not None:
        if virtual_batch_idx is not None:
            raise TypeError(
                "varlen_batch_idx: FlashAttention 4's older name of virtual_batch_idx (up to fa4-v4.0.0.beta24); "
                "give one of them, not both"
            )
        batch_index = (varlen_batch_idx, "varlen_batch_idx")
    out_partial, adapter = take(out_partial, "out_partial")
    shape = shape_of(out_partial)
    if len(shape) not in (4, 5):
        raise ValueError(
            f"out_partial: expected a 5-D array {BATCHED} (batched) or a 4-D array {VARLEN} (varlen), "
            f"got shape {dims(shape)}"
        )
    varlen = len(shape) == 4
    layout, lse_layout, out_layout = (
        (VARLEN, VARLEN_LSE, VARLEN_OUT) if varlen else (BATCHED, BATCHED_LSE, BATCHED_OUT)
    )
    expect_values(out_partial, "out_partial", len(shape), layout, CONVENTION)
    lse_partial = lse_input(
        lse_partial, "lse_partial", shape[:-1], lse_layout, "out_partial", LSE_CONVENTION, castable=False,
        swapped_hint=SWAPPED,
    )  # fmt: skip
    _check_batch_arrays(cu_seqlens, seqused, batch_index, varlen, shape)
    expect_flag(return_lse, "return_lse")
    out_shape = shape[1:]
    if out is None:
        dtype = dtype_of(out_partial) if out_dtype is None else value_dtype_name(out_dtype, "out_dtype")
        out = empty(out_partial, adapter, out_shape, dtype, stream)
    else:
        out, _ = take(out, "out")
        expect_ndim(out, len(out_shape), "out", out_layout, "FlashAttention's layout")
        expect_shape(out, out_shape, "out", out_layout, "out_partial", "FlashAttention's layout")
        dtype = expect_dtype(out, "out", VALUE_DTYPES)
        expect_unit_last_stride(out, "out", out_layout)
        if out_dtype is not None and value_dtype_name(out_dtype, "out_dtype") != dtype:
            raise TypeError(
                f"out_dtype: expected None or out's dtype {dtype} when out is given, got {out_dtype!r}"
            )
    refuse_grad((("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out)), "merge_states")
    if varlen:
        _, total_q, num_heads, _ = shape
        lse_store = empty(out_partial, adapter, (num_heads, total_q), "float32", stream)
        _cm.merge_states(
            out_partial, permute(lse_partial, 0, 2, 1), out=out, out_lse=lse_store, stream=stream
        )
        return out, (permute(lse_store, 1, 0) if return_lse else None)

    _, batch_size, seqlen, num_heads, _ = shape
    lse_store = empty(out_partial, adapter, (batch_size, num_heads, seqlen), "float32", stream)
    merge_batched(out_partial, lse_partial, out, lse_store, stream)
    # [batch_size, seqlen, num_heads] with FlashAttention's strides (num_heads * seqlen, 1, seqlen)
    return out, (permute(lse_store, 0, 2, 1) if return_lse else None)


def _check_batch_arrays(
    cu_seqlens: Any, seqused: Any, batch_index: tuple[Any, str], varlen: bool, shape: tuple[int, ...]
) -> None:
    """The int32 batch descriptions FlashAttention takes, checked against the layout (none is read);
    ``batch_index``: the batch index array and the name it was given by."""
    if cu_seqlens is not None:
        if not varlen:
            raise ValueError(
                f"cu_seqlens: given with a 5-D out_partial {BATCHED}; FlashAttention takes cu_seqlens "
                f"only with the varlen layout {VARLEN}"
            )
        cu_seqlens = index_array(cu_seqlens, "cu_seqlens", ("int32",), "[batch_size + 1]")
        (count,) = shape_of(cu_seqlens)
        if count < 1:
            raise ValueError(
                "cu_seqlens: expected [batch_size + 1] offsets, at least one (0), got an empty array"
            )
        batch_size: int | None = count - 1
        source = "cu_seqlens"
    elif varlen:
        batch_size, source = None, ""
    else:
        batch_size, source = shape[1], "out_partial"
    for array, name in ((seqused, "seqused"), batch_index):
        if array is None:
            continue
        if batch_size is None:
            raise ValueError(
                f"{name}: given with a 4-D (varlen) out_partial but no cu_seqlens; FlashAttention's varlen "
                f"layout [num_splits, total_q, ...] needs cu_seqlens to say where each batch element starts"
            )
        array = index_array(array, name, ("int32",), "[batch_size]")
        expect_shape(array, (batch_size,), name, "[batch_size]", source, "one entry a batch element")


__all__ = ["flash_attn_combine"]
